"""The NIXL wire: a NIXL agent per transfer (UCX), its pools' memory registered once, the receiver reads.

Each end's agent is named ``mambacache-{rank}-{token}`` (a restarted engine's
agent is a new one under the same rank) and publishes its metadata under
``mambacache/xfer/nixl/{agent}/{version}`` of the group's store, a new version
whenever its registrations change. A sender's header names its agent, the
metadata version and one descriptor per message; the receiver loads that
metadata if it has not yet, and reads (``READ``) every message straight into
its own rows in one transfer request, polling its state until it is done, it
fails, or the timeout passes: then the request is released (NIXL cancels what
is in flight) and the batch fails, a :class:`~mambacache.TransferError`. A dead
peer shows as NIXL's ``NIXL_ERR_REMOTE_DISCONNECT`` (raised) or the state
``ERR``: a TransferError too. UCX picks its transports from ``UCX_TLS`` (over
TCP between hosts: ``tcp,self``; one host: ``tcp,sm,self``).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
import weakref
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from ..._errors import TransferError
from ._base import Transport, Wire
from ._regions import Regions, span

__all__ = ["NixlTransport", "NixlWire"]

_KEYS = "mambacache/xfer/nixl/"
_VERSIONS_KEPT = 8  # metadata versions left in the store: a reader of an older one is on a batch long settled
# The longest an agent's progress thread sleeps between wake-ups when no event woke it (UCX's poll can miss one):
# it wakes on its workers' events at once; far above the wheel's 0 (a core spinning per agent), far below a batch.
PROGRESS_DELAY_US = 1000


def _memory(t: torch.Tensor) -> str:
    return "DRAM" if t.device.type == "cpu" else "VRAM"


def _close(box: list[Any], regions: Regions) -> None:
    """Deregister everything, then destroy the agent now: its Python wrapper may outlive this (a traceback of a
    NIXL error kept by the caller holds it), so the wrapper's reference to the native agent is dropped, the last
    one. An agent destroyed later, in the interpreter's teardown, crashed the process."""
    regions.close()
    if box:
        vars(box.pop()).pop("agent", None)


def _live(box: list[Any]) -> Any:
    """The NIXL agent in ``box`` (empty once the transport is closed)."""
    if not box:
        raise TransferError("the NIXL agent is closed (its transfer was closed, or the process exits)")
    return box[0]


# Module functions over the agent's box and lock, not methods: what the finalizer and the registered regions hold
# must not hold the transport, or it is never collected and its agent (its progress thread) lives as long as the
# process.
def _register(box: list[Any], lock: threading.Lock, base: int, size: int, t: torch.Tensor) -> Any:
    with lock:
        return _live(box).register_memory([(base, size, max(t.get_device(), 0), "")], _memory(t))


def _deregister(box: list[Any], lock: threading.Lock, handle: Any) -> None:
    with lock, contextlib.suppress(Exception):
        _live(box).deregister_memory(handle)


def _agent(name: str) -> Any:
    """A NIXL agent with the UCX backend whose progress thread sleeps between wake-ups.

    The wheel's Python API makes every agent's progress thread with
    ``pthrDelay = 0``: UCX's backend then polls its workers with a zero timeout,
    a core spinning per agent even when idle (measured here: 0.7 s of CPU in 2 s
    of an idle agent, 0.02 s with this). With a delay the thread sleeps in
    ``poll`` on the workers' event fds and wakes on their events (a read is
    served as soon as it comes), or after the delay at the latest. The agent is
    built as the wheel builds it, from the bindings' config with that one field
    changed; a wheel whose API differs gets its own agent unchanged.
    """
    from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    try:
        from nixl_cu12 import _bindings  # type: ignore[attr-defined]

        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))  # no backend yet
        config = _bindings.nixlAgentConfig()
        config.useProgThread, config.useListenThread = True, False
        config.syncMode = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value  # the wheel's, without a listener
        config.pthrDelay = PROGRESS_DELAY_US
        agent.agent = _bindings.nixlAgent(name, config)
    except (ImportError, AttributeError, TypeError):
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    agent.create_backend("UCX", {})
    return agent


class NixlTransport(Transport):
    """One NIXL agent for both directions of a transfer; ``store`` the group's (its root)."""

    name = "nixl"

    def __init__(self, store: Any, rank: int, peer: int, timeout: float) -> None:
        self.store, self.timeout = store, timeout
        self.agent_name = f"mambacache-{rank}-{uuid.uuid4().hex[:16]}"
        try:
            self._box = [_agent(self.agent_name)]
        except Exception as exc:
            raise TransferError(f"the NIXL agent could not start: {exc}") from exc
        self.lock = threading.Lock()  # the agent is made without NIXL's own thread sync: one call at a time
        self.version = 0
        self.regions = Regions(partial(_register, self._box, self.lock), partial(_deregister, self._box, self.lock))
        self._loaded: dict[str, int] = {}  # remote agent -> the metadata version loaded
        # At close, at the transport's collection, or at exit before the interpreter tears down: an agent
        # destroyed during the teardown (its registered memory freed first) crashes the process.
        self._finalizer = weakref.finalize(self, _close, self._box, self.regions)
        self._publish()

    @property
    def agent(self) -> Any:
        """The NIXL agent (gone once the transport is closed)."""
        return _live(self._box)

    def close(self) -> None:
        self._finalizer()

    def _publish(self) -> None:
        """This agent's metadata (its registrations with it) under a new version."""
        with self.lock:
            self.version += 1
            metadata = self.agent.get_agent_metadata()
        try:
            self.store.set(f"{_KEYS}{self.agent_name}/{self.version}", metadata)
        except Exception as exc:
            raise TransferError(f"the key-value store failed (publishing NIXL metadata): {exc}") from exc
        if self.version > _VERSIONS_KEPT:
            with contextlib.suppress(Exception):
                self.store.delete_key(f"{_KEYS}{self.agent_name}/{self.version - _VERSIONS_KEPT}")

    def register(self, tensors: Any) -> None:
        if self.regions.keep(tensors):
            self._publish()

    def cover(self, raw: list[torch.Tensor], owner: object) -> None:
        if self.regions.cover(raw, owner):
            self._publish()

    def load(self, agent: str, version: int, deadline: float) -> None:
        """The metadata of remote ``agent`` at ``version`` (or later) loaded, so that this agent reads from it."""
        if self._loaded.get(agent, 0) >= version:
            return
        key = f"{_KEYS}{agent}/{version}"
        try:
            self.store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            metadata = self.store.get(key)
        except Exception as exc:
            raise TransferError(
                f"the NIXL metadata of {agent} (version {version}) timed out in the store (its agent gone?): {exc}"
            ) from exc
        with self.lock:
            if self._loaded.pop(agent, None) is not None:  # an older version: its registrations changed since
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(agent)
            try:
                self.agent.add_remote_agent(metadata)
            except Exception as exc:  # UCX connects to the agent as it loads it: a peer gone is refused here
                with contextlib.suppress(Exception):  # whatever NIXL kept of it: loaded afresh next time
                    self.agent.remove_remote_agent(agent)
                raise TransferError(f"the NIXL metadata of {agent} did not load (its agent gone?): {exc}") from exc
            self._loaded[agent] = version

    def forget(self, agent: str | None) -> None:
        """Load remote ``agent``'s metadata again at its next batch (after a failure: the peer may be gone)."""
        with self.lock:
            if agent is not None and self._loaded.pop(agent, None) is not None:
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(agent)

    def wire(self, store: Any, src: int, dst: int, me: int, timeout: float) -> Wire:
        return NixlWire(self, src, dst, timeout)


class NixlWire(Wire):
    """One direction's reads over the transfer's agent."""

    pulls = True

    def __init__(self, transport: NixlTransport, src: int, dst: int, timeout: float) -> None:
        self.transport, self.src, self.dst, self.timeout = transport, src, dst, timeout
        self._agent: str | None = None  # the remote agent last read from

    def source(self, raw: list[torch.Tensor]) -> dict[str, Any]:
        x = self.transport
        x.cover(raw, self)
        kinds = {_memory(t) for t in raw}
        return {
            "agent": x.agent_name,
            "md": x.version,
            "mem": kinds.pop() if len(kinds) == 1 else "DRAM",
            "descs": [list(span(t)) for t in raw],
        }

    def push(self, raw: list[torch.Tensor], name: str, peer: str, ids: list[str]) -> None:
        return  # the receiver reads

    def pull(
        self, raw: list[torch.Tensor], source: dict[str, Any] | None, name: str, peer: str, ids: list[str]
    ) -> None:
        deadline = time.monotonic() + self.timeout
        try:
            agent, version, descs = str(source["agent"]), int(source["md"]), source["descs"]  # type: ignore[index]
            mem = str(source["mem"])  # type: ignore[index]
            if len(descs) != len(raw) or any(int(d[1]) != t.numel() for d, t in zip(descs, raw, strict=True)):
                raise ValueError("its descriptors are not the batch's messages")
        except (TypeError, KeyError, ValueError) as exc:
            raise TransferError(f"rank {self.src} sent no NIXL source for its rows: {exc}", ids) from exc
        pairs = [(t, d) for t, d in zip(raw, descs, strict=True) if t.numel()]
        if not pairs:
            return
        x = self.transport
        try:
            x.cover(raw, self)
            self._agent = agent
            x.load(agent, version, deadline)
        except Exception as exc:  # a registration NIXL refused, metadata that never came or did not load
            raise TransferError(f"reading the states' bytes from rank {self.src} failed: {exc}", ids) from exc
        self._read(pairs, agent, mem, deadline, ids)

    def _read(
        self, pairs: list[tuple[torch.Tensor, list[int]]], agent: str, mem: str, deadline: float, ids: list[str]
    ) -> None:
        """One READ request of every message, polled until done, failed or past ``deadline``; released after,
        whatever happened (NIXL cancels a request still in flight when it is released)."""
        x, handle = self.transport, None
        local_mem = _memory(pairs[0][0])
        try:
            with x.lock:
                local = x.agent.get_xfer_descs([span(t) for t, _ in pairs], local_mem)
                remote = x.agent.get_xfer_descs([tuple(int(v) for v in d) for _, d in pairs], mem)
                handle = x.agent.initialize_xfer("READ", local, remote, agent)
                state = x.agent.transfer(handle)
            pause = 2e-5
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
                with x.lock:
                    state = x.agent.check_xfer_state(handle)
        except Exception as exc:  # NIXL raises on a peer gone (NIXL_ERR_REMOTE_DISCONNECT) and on bad descriptors
            x.forget(agent)
            raise TransferError(f"reading the states' bytes from rank {self.src} failed: {exc}", ids) from exc
        finally:
            if handle is not None:
                self._release(handle)
        if state != "DONE":
            x.forget(agent)
            what = "failed" if state == "ERR" else f"timed out after {self.timeout:g}s"
            raise TransferError(f"reading the states' bytes from rank {self.src} {what}", ids)

    def _release(self, handle: Any) -> None:
        x = self.transport
        try:
            with x.lock:
                x.agent.release_xfer_handle(handle)
        except Exception as exc:  # not cancelled: it may still write into these rows
            raise TransferError(f"a NIXL read from rank {self.src} could not be aborted: {exc}") from exc

    def drop(self, peer: str | None = None) -> None:
        self.transport.forget(self._agent)
