"""StateTransfer: exported slot states to a peer engine, imported ones from it, over torch.distributed (issue #20).

One batch per call, point to point: a header (a magic number, the count, the
length of the ids), the request ids (UTF-8 JSON: no pickling), then one message
per pool tensor holding every exported slot's rows, gathered from the staging
host slots; the receiver answers with one acknowledgement. The rows are
gathered into buffers kept across batches (grown to the largest batch seen),
and received into such buffers, then copied into staging; the messages of a
batch are posted together (``batch_isend_irecv``) and waited on together. A
batch is bounded by ``timeout`` (the receiver's wait for the header by one
more): a dead or silent peer is a :class:`TransferError` on both sides, never
a hang. See ``docs/transfer.md``.

Wire, per batch (sender -> receiver unless marked)::

    int64[3]   MAGIC, n, len(ids)
    uint8[..]  JSON list of the n request ids
    uint8[..]  per pool tensor: its [layers, n, *state] rows as bytes
    int64[2]   <- ACK, n
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import anyio
import torch

from . import _tracing
from ._errors import DistributedError, InvalidArgumentError, TransferError
from ._events import Export
from ._manager import CacheManager

__all__ = ["StateTransfer"]

MAGIC, ACK = 0x6D63_7846, 0x6D63_7841


def _as_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a copy: frombuffer wants a writable buffer


class _Buffers:
    """A transfer's message buffers, kept across batches: a batch's rows are contiguous prefixes of them.

    Invariant: nothing here is allocated in a batch no larger than one seen
    before. After a failed batch the transfer drops the whole set, since a
    message of it may still be in flight: the next batch never writes under it.
    """

    def __init__(self) -> None:
        self.header = torch.zeros(3, dtype=torch.int64)
        self._ids = torch.zeros(0, dtype=torch.uint8)
        self._flat: list[torch.Tensor] = []

    def id_bytes(self, size: int) -> torch.Tensor:
        """``size`` bytes for the request ids."""
        if self._ids.numel() < size:
            self._ids = torch.zeros(size, dtype=torch.uint8)
        return self._ids[:size]

    def rows(self, layers: int, n: int, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """One ``[layers, n, *shape]`` view per ``(shape, dtype)``, each buffer grown to fit if it is too small."""
        if len(self._flat) != len(shapes):
            self._flat = [torch.zeros(0, dtype=dtype) for _, dtype in shapes]
        out = []
        for i, (shape, dtype) in enumerate(shapes):
            numel = layers * n * math.prod(shape)
            if self._flat[i].dtype != dtype or self._flat[i].numel() < numel:
                self._flat[i] = torch.empty(numel, dtype=dtype)
            out.append(self._flat[i][:numel].view(layers, n, *shape))
        return out


def staged_event(manager: CacheManager) -> Any:
    """An event behind the staging copies on the pool device's current stream (see :meth:`StateTransfer.send`),
    or None on the CPU, where they ran in the flush."""
    device = manager.pool.device
    return None if device.type == "cpu" else torch.accelerator.current_stream(device).record_event()


def write_staging(manager: CacheManager, slots: list[int], rows: list[torch.Tensor]) -> None:
    """Write arrived ``rows`` (``[layers, n, *state]`` per pool tensor) into staging host ``slots``.

    The slots were free when landed, but on an accelerator a restore from one of
    them in an earlier flush may still be reading it on the stream: the write
    waits for that stream first (an event, not a device synchronize). Float8
    states go by indexed assignment: CPU torch has no ``index_copy_`` for them.
    """
    staged = staged_event(manager)
    if staged is not None:
        staged.synchronize()
    index = torch.tensor(slots, dtype=torch.long)
    host = manager.host_pool
    assert host is not None
    for t, buf in zip(host.tensors, rows, strict=True):
        if t.is_floating_point() and t.element_size() == 1:
            t[:, index] = buf  # float8: CPU torch has no index_copy_ for it
        else:
            t.index_copy_(1, index, buf)


def send_exports(
    manager: CacheManager,
    ship: Callable[[list[Export], list[str]], None],
    peers: list[int],
    sizes: Callable[[int], dict[str, Any]] = lambda n: {},
) -> list[str]:
    """The sender's side of an export's life around ``ship`` (the wire, which raises unless every peer acknowledged):
    take the exports whose flush has run, ship them, then deliver them (slots released, staging dropped), or on any
    failure give them back to the manager (retry, or release, which withdraws them). Returns the ids delivered.

    One protocol for :class:`StateTransfer` and :class:`~mambacache._reslice.ReslicingSender`; ``sizes(n)``: the
    extra fields of each peer's ``transfer.send`` line.
    """
    ready = manager.take_exports()
    if not ready:
        return []
    ids = [ev.request_id or "" for ev in ready]
    try:
        if manager.unfinished:
            raise TransferError("the flush that ran the exports left work unfinished: flush again first", [])
        ship(ready, ids)
    except BaseException:
        manager.exports_returned(ready)
        raise
    for peer in peers:
        _tracing.tracer.transfer("transfer.send", peer, ids, step=manager.step, n=len(ids), **sizes(len(ids)))
    manager.exports_delivered(ready)
    return ids


class StateTransfer:
    """Sends a manager's exports to ``peer`` and receives the peer's into the manager's staging host slots.

    Invariants: a send ships exactly the exports whose flush has run, in export
    order, and releases their pool and staging slots only after the peer's
    acknowledgement (a failed send keeps them all: call :meth:`send` again, or
    release); a receive lands every state of a batch or none (a failure gives
    its staging slots back) and acknowledges only what landed.

    Not thread-safe: use it from the task or thread that schedules steps.
    """

    def __init__(self, manager: CacheManager, group: Any, peer: int, *, timeout: float = 60.0) -> None:
        import torch.distributed as dist

        if not isinstance(manager, CacheManager):
            raise InvalidArgumentError(f"manager must be a CacheManager, got {type(manager).__name__}")
        if manager.host_pool is None:
            raise InvalidArgumentError(
                "a transfer stages in the manager's host pool: CacheManager(pool, host_pool=...)"
            )
        if not dist.is_initialized():
            raise DistributedError("torch.distributed is not initialized: call init_process_group first")
        if type(peer) is not int or peer == dist.get_rank() or peer not in dist.get_process_group_ranks(group):
            raise InvalidArgumentError(f"peer must be another rank of the group, got {peer!r}")
        if not timeout > 0:
            raise InvalidArgumentError(f"timeout must be positive seconds, got {timeout!r}")
        self._dist, self._mgr, self._group, self.peer = dist, manager, group, peer
        self._timeout = timedelta(seconds=timeout)
        self._bufs = _Buffers()

    # -- the wire ------------------------------------------------------------
    def _wait(self, work: Any, what: str, ids: list[str], seconds: float | None = None) -> None:
        left = self._timeout if seconds is None else timedelta(seconds=max(seconds, 1e-3))  # 0 means "no limit"
        try:
            work.wait(left)
        except Exception as exc:  # gloo reports a dead peer and a timeout as RuntimeError
            raise TransferError(
                f"{what} with rank {self.peer} failed or timed out after {self._timeout.total_seconds():g}s: {exc}",
                ids,
            ) from exc

    def _post(self, ops: list[tuple[bool, torch.Tensor, str]], ids: list[str]) -> list[tuple[Any, str]]:
        """Post ``(send?, tensor, what)`` messages together; each of their works with what it carries."""
        dist = self._dist
        p2p = [dist.P2POp(dist.isend if out else dist.irecv, t, self.peer, self._group) for out, t, _ in ops]
        try:
            works = dist.batch_isend_irecv(p2p)
        except Exception as exc:  # a peer known dead already fails the post
            raise TransferError(f"posting {ops[0][2]} to rank {self.peer} failed: {exc}", ids) from exc
        return list(zip(works, [what for *_, what in ops], strict=True))

    def _wait_all(self, works: list[tuple[Any, str]], ids: list[str], start: float) -> None:
        """Wait for ``works`` in order, all within one timeout from ``start`` (a ``time.monotonic()``)."""
        limit = self._timeout.total_seconds()
        for work, what in works:
            self._wait(work, what, ids, limit - (time.monotonic() - start))

    def _host_tensors(self) -> list[torch.Tensor]:
        host = self._mgr.host_pool
        assert host is not None
        return host.tensors

    def _shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [(tuple(t.shape[2:]), t.dtype) for t in self._host_tensors()]

    def _staged(self) -> Any:
        return staged_event(self._mgr)

    # -- sending -------------------------------------------------------------
    @_tracing.traces_failures
    def send(self) -> list[str]:
        """Ship every export whose flush has run, wait for the acknowledgement, then free their slots.

        Returns the request ids delivered (none: nothing was sent). Exports queued
        since the last flush wait for the next send. With pools on an
        accelerator, the staging copies are waited for through an event recorded
        on the pool device's current stream (where ``flush_nowait()`` runs them:
        after a flush on another stream, send with that stream current), not a
        device synchronize.
        """
        mgr = self._mgr
        return send_exports(mgr, self._ship, [self.peer], lambda n: {"bytes": n * mgr.pool.spec.slot_bytes})

    def _ship(self, ready: list[Export], ids: list[str]) -> None:
        """One batch on the wire, gathered into the kept buffers, and its acknowledgement."""
        staged = self._staged()
        try:
            if staged is not None:
                staged.synchronize()  # the rows are gathered from the staging slots: their bytes must be final
            hosts = torch.tensor([ev.host for ev in ready], dtype=torch.long)
            rows = self._bufs.rows(self._mgr.pool.spec.num_layers, len(ids), self._shapes())
            for t, out in zip(self._host_tensors(), rows, strict=True):
                torch.index_select(t, 1, hosts, out=out)
            self.post_rows(ids, rows)()
        except BaseException:
            self._bufs = _Buffers()  # a message may still be in flight from these: never write under it
            raise

    def post_rows(self, request_ids: list[str], rows: list[torch.Tensor]) -> Callable[[], None]:
        """Post one batch of the given ``[layers, n, *state]`` rows (one per pool tensor, the wire's order) for
        ``request_ids``, with the receive of its acknowledgement; returns the wait for all of it.

        The sending side of :meth:`receive_rows` and :meth:`acknowledge`, for a
        sender that reshapes what it sends (a peer at another tensor-parallel
        size: ``docs/transfer-tp.md``); the manager's slots are not touched. The
        wait raises :class:`TransferError` unless everything went out and the peer
        acknowledged ``len(request_ids)`` states within the timeout, counted from
        the post. ``rows`` must stay unchanged until the wait returns.
        """
        start = time.monotonic()
        names = json.dumps(request_ids).encode()
        header = torch.tensor([MAGIC, len(request_ids), len(names)], dtype=torch.int64)
        ack = torch.zeros(2, dtype=torch.int64)
        ops = [(True, header, "the header"), (True, _as_bytes(names), "the request ids")]
        ops += [(True, r.reshape(-1).view(torch.uint8), "a state tensor") for r in rows]
        works = self._post([*ops, (False, ack, "the acknowledgement")], request_ids)

        def wait() -> None:
            self._wait_all(works, request_ids, start)
            del ops[:]  # the messages are out: their tensors may go
            if ack.tolist() != [ACK, len(request_ids)]:
                raise TransferError(
                    f"rank {self.peer} acknowledged {ack.tolist()}, not {len(request_ids)} states", request_ids
                )

        return wait

    # -- receiving -----------------------------------------------------------
    @_tracing.traces_failures
    def receive(self) -> list[str]:
        """Land one batch of the peer's exports in staging host slots and acknowledge it; returns their ids.

        Each is then read by ``manager.import_into(slot, request_id=...)``.
        """
        try:
            ids, rows = self._receive(self._shapes(), self._bufs)
        except BaseException:
            self._bufs = _Buffers()  # as in send: a receive may still be posted into these
            raise
        slots = self._mgr.land(ids)
        write_staging(self._mgr, slots, rows)
        _tracing.tracer.transfer(
            "transfer.receive",
            self.peer,
            ids,
            step=self._mgr.step,
            n=len(ids),
            hosts=slots,
            bytes=sum(b.nbytes for b in rows),
        )
        self._acknowledge(ids)
        return ids

    @_tracing.traces_failures
    def receive_rows(
        self, shapes: list[tuple[tuple[int, ...], torch.dtype]] | None = None
    ) -> tuple[list[str], list[torch.Tensor]]:
        """One batch of the peer's exports as ``[layers, n, *state]`` tensors, landed nowhere and not acknowledged.

        The hook for a receiver that reshapes what arrives before it lands (a
        peer at another tensor-parallel size: ``docs/transfer-tp.md``).
        ``shapes``: the peer's per-slot ``(shape, dtype)`` of each pool tensor
        (its ``StateSpec.shapes()``), default this manager's. Call
        :meth:`acknowledge` once the states are safe. The tensors are the
        caller's (fresh each call, unlike :meth:`receive`'s kept buffers).
        """
        return self._receive(self._shapes() if shapes is None else shapes, _Buffers())

    def _receive(
        self, shapes: list[tuple[tuple[int, ...], torch.dtype]], bufs: _Buffers
    ) -> tuple[list[str], list[torch.Tensor]]:
        """The header (its own timeout: the peer sends when it is ready), then ids and rows posted together."""
        self._wait(self._dist.irecv(bufs.header, self.peer, group=self._group), "the header", [])
        start = time.monotonic()
        magic, n, size = bufs.header.tolist()
        if magic != MAGIC or n < 1 or size < 2:
            raise TransferError(f"rank {self.peer} sent {bufs.header.tolist()}, not a transfer header", [])
        raw = bufs.id_bytes(size)
        rows = bufs.rows(self._mgr.pool.spec.num_layers, n, shapes)
        ops = [(False, r.reshape(-1).view(torch.uint8), "a state tensor") for r in rows]
        self._wait_all(self._post([(False, raw, "the request ids"), *ops], []), [], start)
        ids = json.loads(bytes(raw.tolist()).decode())
        if not isinstance(ids, list) or len(ids) != n or not all(isinstance(r, str) for r in ids):
            raise TransferError(f"rank {self.peer} sent malformed request ids", [])
        return list(ids), rows

    @_tracing.traces_failures
    def acknowledge(self, request_ids: list[str]) -> None:
        """Tell the peer its batch of ``request_ids`` is safe here: it then releases their slots."""
        self._acknowledge(request_ids)

    def _acknowledge(self, request_ids: list[str]) -> None:  # untraced: receive() traces its own failures once
        ack = torch.tensor([ACK, len(request_ids)], dtype=torch.int64)
        self._wait(self._dist.isend(ack, self.peer, group=self._group), "the acknowledgement", request_ids)

    # -- async forms ---------------------------------------------------------
    async def send_async(self) -> list[str]:
        """:meth:`send` in a worker thread, shielded: once started, a cancellation waits for the batch to finish.

        Why shielded: abandoning the thread mid-batch would leave the peer with
        half a batch and this side unsure whether it was acknowledged; the
        cancellation is delivered at the next checkpoint after it returns. A
        call cancelled before it starts sends nothing (the shield would hide that
        cancellation from the thread's start, so it is checked first).
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        with anyio.CancelScope(shield=True):
            ids = await anyio.to_thread.run_sync(self.send)
        await anyio.lowlevel.checkpoint()
        return ids

    async def receive_async(self) -> list[str]:
        """:meth:`receive` in a worker thread, shielded like :meth:`send_async` (cancelled before it starts: no-op)."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        with anyio.CancelScope(shield=True):
            ids = await anyio.to_thread.run_sync(self.receive)
        await anyio.lowlevel.checkpoint()
        return ids
