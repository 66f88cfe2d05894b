"""The Mooncake wire: a Mooncake Transfer Engine per transfer (TCP, P2P handshake), the receiver reads.

An engine outlives its transfer: once the transfer is closed or collected, its
registrations are dropped and the engine goes to the process's next transfer
(destroying one holds the GIL for about 0.8 s: see ``_IDLE``); the idle ones are
destroyed at exit.

The engine listens on the address this process reaches the group's store from
(the store on 127.0.0.1: 127.0.0.1), its segment named ``host:port`` (its RPC
port); the pools' memory is registered once, other rows per batch (a read
from memory registered after the peer's first read works without a new
handshake). A sender's header names its segment and one ``(address, bytes)``
per message; the receiver reads them all in one ``batch_transfer_sync_read``.
The engine's read cannot be aborted and takes no timeout: it runs in a thread
of its own, and a read not done within the timeout fails the batch (a
:class:`~mambacache.TransferError`) while its thread is left to finish. Not
aborted, such a read may still write into the rows it was reading into after
the failure (NIXL's reads are cancelled; docs/transfer.md). A dead peer shows
as a return code of -1 at once: a TransferError too.
"""

from __future__ import annotations

import atexit
import contextlib
import socket
import threading
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from ..._core._errors import TransferError
from ._base import Message, Transport, Wire, spans
from ._regions import Regions
from ._regions import plan as _plan

__all__ = ["MooncakeTransport", "MooncakeWire"]


def _local_address(store: Any) -> str:
    """The address this process reaches ``store``'s host from (its own address on that network)."""
    host = str(getattr(store, "host", "127.0.0.1"))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((socket.gethostbyname(host), 9))  # no packet: a UDP connect only picks the route
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


# Engines of this process that no transport holds, by the address they listen on. Destroying an engine takes
# about 0.8 s and holds the GIL all along (measured here: every Python thread of the process stopped, an engine's
# step loop and a transfer's waits included), so a transport's engine goes on to the process's next transport on
# that address instead, its registrations gone; they are destroyed at exit. At most as many as transports were
# alive at once.
_IDLE: dict[str, list[Any]] = {}
_IDLE_LOCK = threading.Lock()
_EXITING: list[bool] = []  # set by _drain: an engine let go from then on is destroyed at once
_DRAIN: list[bool] = []  # _drain registered with atexit


def _engine(host: str) -> Any:
    """An engine listening on ``host``: an idle one of this process, else a new one."""
    from mooncake.engine import TransferEngine

    with _IDLE_LOCK:
        idle = _IDLE.get(host)
        if idle:
            return idle.pop()
    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise TransferError(f"the Mooncake Transfer Engine could not start on {host}")
    return engine


def _close(box: list[Any], regions: Regions, host: str) -> None:
    """Deregister everything, then hand the engine to the process's next transport (destroy it at exit)."""
    regions.close()
    if not box:
        return
    engine = box.pop()
    with _IDLE_LOCK:
        if not _EXITING:
            if not _DRAIN:
                _DRAIN.append(True)
                atexit.register(_drain)
            _IDLE.setdefault(host, []).append(engine)
            return
    del engine  # the process exits: destroyed now, not in the interpreter's teardown


def _drain() -> None:
    """At exit, the idle engines destroyed. Registered after weakref.finalize's own exit hook, so it runs before
    it: the transports finalized after it destroy their engine at once (``_EXITING``)."""
    with _IDLE_LOCK:
        _EXITING.append(True)
        engines = [e for idle in _IDLE.values() for e in idle]
        _IDLE.clear()
    engines.clear()


def _live(box: list[Any]) -> Any:
    """The Transfer Engine in ``box`` (empty once the transport is closed)."""
    if not box:
        raise TransferError("the Mooncake Transfer Engine is closed (its transfer was closed, or the process exits)")
    return box[0]


# Module functions over the engine's box and lock, not methods: what the finalizer and the registered regions
# hold must not hold the transport, or it is never collected and its engine (its threads) lives as long as the
# process.
def _register(box: list[Any], lock: threading.Lock, base: int, size: int, t: torch.Tensor) -> Any:
    with lock:
        if _live(box).register_memory(base, size) != 0:
            raise TransferError(f"Mooncake could not register {size} bytes at {base:#x}")
    return base


def _deregister(box: list[Any], lock: threading.Lock, handle: Any) -> None:
    with lock, contextlib.suppress(Exception):
        _live(box).unregister_memory(handle)


class MooncakeTransport(Transport):
    """One Transfer Engine for both directions of a transfer; ``store`` the group's (its root)."""

    name = "mooncake"

    def __init__(self, store: Any, rank: int, peer: int, timeout: float) -> None:
        host = _local_address(store)
        engine = _engine(host)
        self.segment = f"{host}:{engine.get_rpc_port()}"
        self._box = [engine]
        self.lock = threading.Lock()
        self.regions = Regions(partial(_register, self._box, self.lock), partial(_deregister, self._box, self.lock))
        self._finalizer = weakref.finalize(self, _close, self._box, self.regions, host)

    @property
    def engine(self) -> Any:
        """The Transfer Engine (gone once the transport is closed)."""
        return _live(self._box)

    def close(self) -> None:
        self._finalizer()

    def register(self, tensors: Any) -> None:
        self.regions.keep([t for t in tensors if t.device.type == "cpu"])  # the non-CUDA engine: host memory

    def wire(self, store: Any, src: int, dst: int, me: int, timeout: float) -> Wire:
        return MooncakeWire(self, src, timeout)


class MooncakeWire(Wire):
    """One direction's reads over the transfer's engine."""

    pulls = True
    pieces = True

    def __init__(self, transport: MooncakeTransport, src: int, timeout: float) -> None:
        self.transport, self.src, self.timeout = transport, src, timeout

    def source(self, raw: Sequence[Message]) -> dict[str, Any]:
        self.transport.regions.cover(raw, self)
        ranges = [spans(m) for m in raw]
        descs = [[a, size, 0] for r in ranges for a, size in r]
        parts = [len(r) for r in ranges]
        return {"agent": self.transport.segment, "md": 0, "mem": "DRAM", "descs": descs, "parts": parts}

    def push(self, raw: Sequence[Message], name: str, peer: str, ids: list[str]) -> None:
        return  # the receiver reads

    def pull(self, raw: Sequence[Message], source: dict[str, Any] | None, name: str, peer: str, ids: list[str]) -> None:
        try:
            segment, descs = str(source["agent"]), source["descs"]  # type: ignore[index]
            cuts = [c for plan in _plan(raw, descs, source.get("parts")) for c in plan]  # type: ignore[union-attr]
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise TransferError(f"rank {self.src} sent no Mooncake source for its rows: {exc}", ids) from exc
        if not cuts:
            return
        x = self.transport
        x.regions.cover(raw, self)
        local = [la for la, _, _, _ in cuts]
        remote = [ra for _, ra, _, _ in cuts]
        sizes = [size for _, _, size, _ in cuts]
        out: list[Any] = []
        reader = threading.Thread(
            target=lambda: out.append(_read(x.engine, segment, local, remote, sizes)), daemon=True
        )
        reader.start()
        reader.join(self.timeout)
        if reader.is_alive():
            what = f"timed out after {self.timeout:g}s (the read is not aborted)"
            raise TransferError(f"reading the states' bytes from rank {self.src} {what}", ids)
        if out != [0]:
            raise TransferError(f"reading the states' bytes from rank {self.src} failed ({out[0]!r})", ids)


def _read(engine: Any, segment: str, local: list[int], remote: list[int], sizes: list[int]) -> Any:
    try:
        return engine.batch_transfer_sync_read(segment, local, remote, sizes)
    except Exception as exc:  # a return code in the common case; an exception handed to the waiting thread
        return exc
