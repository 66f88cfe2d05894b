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
from collections.abc import Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from ..._core._errors import TransferError
from ._base import Message, Transport, Wire, spans
from ._regions import Regions
from ._regions import plan as _plan

__all__ = ["NixlTransport", "NixlWire"]

_KEYS = "mambacache/xfer/nixl/"
_VERSIONS_KEPT = 8  # metadata versions left in the store: a reader of an older one is on a batch long ended
_DEVICES = ("cpu", "cuda")  # host memory is NIXL's DRAM, a CUDA device's its VRAM


def _memory(device: torch.device) -> str:
    return "DRAM" if device.type == "cpu" else "VRAM"


# The UCX progress thread's wait between rounds, in microseconds: it sleeps in poll() on its worker's event fd for
# at most this long (NIXL rounds it up to whole milliseconds). NIXL's Python API makes it 0: a poll that returns at
# once, a core kept busy for the agent's life, and in a two-process bench on two cores the copies outside the wire
# took 3 to 5 times as long. The sender's end of a read over TCP is served by this thread alone (measured: with no
# progress thread a read never completed), and a socket that fills waits out one such pause (10 ms: reads of
# 74 MiB 2x slower than at 1 ms), so the shortest.
PROGRESS_DELAY_US = 1000


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
        return _live(box).register_memory([(base, size, max(t.get_device(), 0), "")], _memory(t.device))


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
        self.devices: tuple[str, ...] = _DEVICES  # whose memory its wires move (device memory as VRAM)
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
        changed = self.regions.keep([t for t in tensors if t.device.type == "cpu"])
        device = [t for t in tensors if t.device.type in self.devices and t.device.type != "cpu"]
        try:
            changed = self.regions.keep(device) or changed
        except Exception:  # a UCX without its CUDA support: device rows go through host buffers, as over gloo
            self.devices = ("cpu",)
        if changed:
            self._publish()

    def cover(self, raw: Sequence[Message], owner: object) -> None:
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
    pieces = True

    def __init__(self, transport: NixlTransport, src: int, dst: int, timeout: float) -> None:
        self.transport, self.src, self.dst, self.timeout = transport, src, dst, timeout
        self._agent: str | None = None  # the remote agent last read from
        self.devices = transport.devices  # the transfer registered its pools before it made its wires

    def source(self, raw: Sequence[Message]) -> dict[str, Any]:
        x = self.transport
        x.cover(raw, self)
        kinds = {_memory(m.device) for m in raw if m.numel()}
        if len(kinds) > 1:
            raise TransferError("a batch's rows lie in host and device memory at once: not one NIXL read")
        descs: list[list[int]] = []
        parts = []
        for m in raw:
            dev = max(m.device.index or 0, 0)
            ranges = spans(m)
            descs += [[a, b, dev] for a, b in ranges]
            parts.append(len(ranges))
        return {"agent": x.agent_name, "md": x.version, "mem": kinds.pop() if kinds else "DRAM", "descs": descs,
                "parts": parts}  # fmt: skip

    def push(self, raw: Sequence[Message], name: str, peer: str, ids: list[str]) -> None:
        return  # the receiver reads

    def pull(self, raw: Sequence[Message], source: dict[str, Any] | None, name: str, peer: str, ids: list[str]) -> None:
        deadline = time.monotonic() + self.timeout
        try:
            agent, version, descs = str(source["agent"]), int(source["md"]), source["descs"]  # type: ignore[index]
            mem = str(source["mem"])  # type: ignore[index]
            plan = _plan(raw, descs, source.get("parts"))  # type: ignore[union-attr]
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise TransferError(f"rank {self.src} sent no NIXL source for its rows: {exc}", ids) from exc
        if not any(plan):
            return
        x = self.transport
        try:
            x.cover(raw, self)
            self._agent = agent
            x.load(agent, version, deadline)
        except Exception as exc:  # a registration NIXL refused, metadata that never came or did not load
            raise TransferError(f"reading the states' bytes from rank {self.src} failed: {exc}", ids) from exc
        self._read(raw, plan, agent, mem, deadline, ids)

    def _read(
        self,
        raw: Sequence[Message],
        plan: list[list[tuple[int, int, int, int]]],
        agent: str,
        mem: str,
        deadline: float,
        ids: list[str],
    ) -> None:
        """One READ request of every message, polled until done, failed or past ``deadline``; released after,
        whatever happened (NIXL cancels a request still in flight when it is released)."""
        x, handle = self.transport, None
        kinds = {_memory(m.device) for m, cuts in zip(raw, plan, strict=True) if cuts}
        if len(kinds) > 1:
            raise TransferError("a batch's rows lie in host and device memory at once: not one NIXL read", ids)
        local_mem = kinds.pop()
        local, remote = [], []
        for m, cuts in zip(raw, plan, strict=True):
            dev = max(m.device.index or 0, 0)
            for la, ra, size, rdev in cuts:
                local.append((la, size, dev))
                remote.append((ra, size, rdev))
        try:
            with x.lock:
                local_descs = x.agent.get_xfer_descs(local, local_mem)
                remote_descs = x.agent.get_xfer_descs(remote, mem)
                handle = x.agent.initialize_xfer("READ", local_descs, remote_descs, agent)
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
