"""StateTransfer: exported slot states to a peer engine, imported ones from it, over torch.distributed.

One batch per call, point to point, in two planes (``_link.py``): the batch is
agreed on through the process group's key-value store (a header naming the
ids, a fingerprint of the states' layout and the byte sizes; the receiver's
decision: take it, re-acknowledge a batch it landed already, or refuse it for
room, spec or an impossible size; after the bytes, its acknowledgement), and
the bytes go over a two-rank gloo group of the two peers alone, replaced after
any failure: one message per pool tensor holding every state's rows, or, for a
large batch, one per pool tensor and layer, sent straight from the staging
host rows and received straight into them when the batch's slots are one run. Why: gloo
closes a pair on any timeout, so on the group itself one late peer would break
every later batch; here a failed batch is retried to success on the same
transfer. Every wait is bounded by ``timeout``; every failure is a
:class:`TransferError`. See ``docs/transfer.md``.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import anyio
import torch

from .._core import _tracer
from .._core._errors import (
    DistributedError,
    InvalidArgumentError,
    MambaCacheError,
    PoolExhaustedError,
    TransferError,
    TransferRefusedError,
)
from .._core._events import Export
from .._core._validate import (
    check_bool,
    check_instance,
    check_request_ids,
    check_rows,
    check_shapes,
    check_str,
    need_host,
)
from .._core._worker import cancel_again, run_in_worker, unwrap
from .._manager import CacheManager
from ._link import (
    SPLIT_BYTES,
    Batch,
    Inbox,
    NothingSent,
    Outbox,
    Shapes,
    Withdrawn,
    as_bytes,
    check_timeout,
    fingerprint,
    messages,
    root_store,
)
from ._transports._base import Message, Pieces, Transport, Wire
from ._transports._pick import check_transport
from ._transports._pick import make as make_transport

__all__ = ["StateTransfer"]


class _Buffers:
    """A transfer's message buffers, kept across batches: a batch's rows are contiguous prefixes of them.

    Invariant: nothing here is allocated in a batch no larger than one seen
    before. After a failed batch the transfer drops the whole set (its pair is
    dropped too, so no message of it can still write into them, but a fresh set
    costs nothing next to a failure).
    """

    def __init__(self) -> None:
        self._flat: list[torch.Tensor] = []

    @torch.inference_mode(False)
    def rows(self, layers: int, n: int, shapes: Shapes) -> list[torch.Tensor]:
        """One ``[layers, n, *shape]`` view per ``(shape, dtype)``, each buffer grown to fit if it is too small.
        Outside inference mode: a buffer made under it would refuse a later batch's writes outside it."""
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


@torch.inference_mode()
def write_staging(manager: CacheManager, slots: list[int], rows: list[torch.Tensor]) -> None:
    """Write arrived ``rows`` (``[layers, n, *state]`` per pool tensor) into staging host ``slots``, under
    inference mode whatever the caller's, as a flush's stages run (a host pool made under it refuses writes
    outside it).

    The slots were free when landed, but on an accelerator a restore from one of
    them in an earlier flush may still be reading it on the stream: the write
    waits for that stream first (an event, not a device synchronize). Float8
    states go by indexed assignment: CPU torch has no ``index_copy_`` for them.
    """
    wait_for_restores(manager)
    index = torch.tensor(slots, dtype=torch.long)
    host = manager.host_pool
    assert host is not None
    for t, buf in zip(host.tensors, rows, strict=True):
        if t.is_floating_point() and t.element_size() == 1:
            t[:, index] = buf  # float8: CPU torch has no index_copy_ for it
        else:
            t.index_copy_(1, index, buf)


def wait_for_restores(manager: CacheManager) -> None:
    """Before a write into free staging slots (or pool slots awaiting a state): an earlier flush's restore from
    them (or its work on the slot's last tenant) may still run on the stream."""
    staged = staged_event(manager)
    if staged is not None:
        staged.synchronize()


class ReadingBatch:
    """The read of a batch's rows for a send: after the staging copies (the rows are read from the staging or pool
    slots: their bytes must be final), and before any header is posted, so a failure in it (an event wait, buffers
    that could not grow) is :class:`NothingSent`, the cause chained: no peer can hold this try, so it is not in
    doubt (a bare error was counted so, pinning an export to no one to a peer that got nothing).

    A class, not ``contextlib.contextmanager``: NothingSent is a RuntimeError, and one raised ``from`` a
    StopIteration of the body looks to contextlib like PEP 479's conversion of a StopIteration the generator let
    out, so it re-raised the bare StopIteration (counted in doubt)."""

    __slots__ = ("_ids", "_manager")

    def __init__(self, manager: CacheManager, ids: list[str]) -> None:
        self._manager, self._ids = manager, ids

    def __enter__(self) -> None:
        try:
            staged = staged_event(self._manager)
            if staged is not None:
                staged.synchronize()
        except Exception as exc:
            raise self._nothing_sent(exc) from exc

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, Exception):  # an interrupt or exit goes on up as it is
            raise self._nothing_sent(exc) from exc

    def _nothing_sent(self, exc: Exception) -> NothingSent:
        return NothingSent(f"reading the batch failed before it was posted, nothing was sent: {exc!r}", self._ids)


def export_rows(
    manager: CacheManager, exports: list[Export], out: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The states of ``exports`` (all staged, or all in place), ``[layers, n, *state]`` per pool tensor, in export
    order: copied into ``out`` (host tensors of that shape), else into fresh host tensors.

    Staged, they are read from their staging host rows; in place, from their
    pool slots, layer by layer (any pool layout; on an accelerator a copy to
    the host, after :func:`staged_event`'s wait, as the staging copy would be).
    """
    in_place = exports[0].host is None
    host = manager.host_pool
    assert host is not None
    if not in_place:
        index = torch.tensor([ev.host for ev in exports], dtype=torch.long)
        if out is None:
            return [t.index_select(1, index) for t in host.tensors]
        for t, o in zip(host.tensors, out, strict=True):
            torch.index_select(t, 1, index, out=o)
        return out
    pool = manager.pool
    index = torch.tensor([ev.slot for ev in exports], dtype=torch.long, device=pool.device)
    if out is None:
        out = [torch.empty(t.shape[0], len(exports), *t.shape[2:], dtype=t.dtype) for t in host.tensors]
    for layers, o in zip(pool.layers, out, strict=True):
        for view, row in zip(layers, o.unbind(0), strict=True):
            if view.device.type == "cpu":
                torch.index_select(view, 0, index, out=row)
            else:
                row.copy_(view.index_select(0, index))
    return out


Cut = tuple[int, int, bool]  # (byte offset in a state's row, bytes, replicated): one range of a re-slice's shard


class _Rows:
    """Where the slot rows of each layer of a pool's (or host pool's) tensors lie, read once: row ``s`` of a layer
    at ``base + s * step``, ``size`` bytes (the tensors are the manager's for its life, so their addresses are).

    ``layers``: per pool tensor, its layers' ``[slots + 1, *state]`` views; ``contiguous``: each row is contiguous
    memory (not, for a paged pool whose rows are strided within)."""

    __slots__ = ("contiguous", "device_types", "geometry", "layers")

    def __init__(self, layers: list[list[torch.Tensor]]) -> None:
        self.layers = layers
        self.geometry = [
            [(v.data_ptr(), v.stride(0) * v.element_size(), v[0].numel() * v.element_size()) for v in views]
            for views in layers
        ]
        self.contiguous = all(v[0].is_contiguous() for views in layers for v in views)
        self.device_types = {v.device.type for views in layers for v in views}

    def pieces(
        self,
        slots: list[int],
        split: bool,
        devices: tuple[str, ...],
        cuts: Sequence[Sequence[Cut]] | None = None,
        aside: torch.Tensor | None = None,
    ) -> list[Pieces] | None:
        """A batch's messages (:func:`~._link.messages`' order: per pool tensor, per layer when ``split``) as the
        byte ranges of the rows of ``slots``, each run of consecutive rows that touch one range: a pulled wire
        reads them from there and writes them there, with no gather or scatter copy. None unless each row is
        contiguous memory on a device type of ``devices``.

        ``cuts``: per pool tensor, the byte ranges of a row the message holds of each (a re-slice's shard of the
        state: ``StateLayout.cuts``), so each row gives only those bytes, in that order; ``aside`` (a flat
        ``uint8`` tensor on the rows' device, of at least :func:`replicated_bytes`): the replicated cuts' ranges
        lie there instead, one after the other in the message's order (a re-slicing receiver's copy of a part
        another rank landed already, to compare)."""
        if not self.contiguous or not self.device_types <= set(devices):
            return None
        if cuts is not None:
            return self._cut(slots, split, cuts, aside)
        runs = _runs(slots)
        out = []
        for views, geometry in zip(self.layers, self.geometry, strict=True):
            cut = [_spans(base, step, size, slots, runs) for base, step, size in geometry]
            if split:
                out += [Pieces(c, [v], v.device) for c, v in zip(cut, views, strict=True)]
            else:
                out.append(Pieces(_joined(cut), list(views), views[0].device))
        return out

    def _cut(
        self, slots: list[int], split: bool, cuts: Sequence[Sequence[Cut]], aside: torch.Tensor | None
    ) -> list[Pieces]:
        """:meth:`pieces` of the ``cuts`` of each row (a layer's message: slot by slot, each slot's cuts in order;
        the ranges that touch joined)."""
        out: list[Pieces] = []
        put = aside.data_ptr() if aside is not None else 0  # where the next replicated range goes in ``aside``
        extra = [aside] if aside is not None else []
        for views, geometry, tensor_cuts in zip(self.layers, self.geometry, cuts, strict=True):
            per_layer = []
            for base, step, _ in geometry:
                ranges = []
                for s in slots:
                    for offset, size, replicated in tensor_cuts:
                        if replicated and aside is not None:
                            ranges.append((put, size))
                            put += size
                        else:
                            ranges.append((base + s * step + offset, size))
                per_layer.append(_joined([ranges]))
            if split:
                out += [Pieces(c, [v, *extra], v.device) for c, v in zip(per_layer, views, strict=True)]
            else:
                out.append(Pieces(_joined(per_layer), [*views, *extra], views[0].device))
        return out


def replicated_bytes(layers: int, n: int, cuts: Sequence[Sequence[Cut]]) -> int:
    """The bytes of the replicated cuts of a batch of ``n`` states over ``layers`` layers (``aside``'s size)."""
    return layers * n * sum(size for tensor_cuts in cuts for _, size, replicated in tensor_cuts if replicated)


def replicated_rows(rows: list[list[torch.Tensor]], slots: list[int], cuts: Sequence[Sequence[Cut]]) -> torch.Tensor:
    """The replicated cuts' bytes of the rows of ``slots`` (per pool tensor its layers' ``[slots + 1, *state]``
    views), in the order :meth:`_Rows.pieces` puts them in its ``aside``: a copy, on the rows' device."""
    parts = []
    for views, tensor_cuts in zip(rows, cuts, strict=True):
        kept = [(offset, size) for offset, size, replicated in tensor_cuts if replicated]
        if not kept:
            continue
        for view in views:
            index = torch.tensor(slots, dtype=torch.long, device=view.device)
            raw = view.index_select(0, index).contiguous().view(torch.uint8).reshape(len(slots), -1)
            parts.append(torch.cat([raw[:, offset : offset + size] for offset, size in kept], 1).reshape(-1))
    device = rows[0][0].device if rows and rows[0] else torch.device("cpu")
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)


def _spans(base: int, step: int, size: int, slots: list[int], runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges of rows ``slots`` of a layer (row ``s`` at ``base + s * step``, ``size`` bytes): one per run of
    ``runs`` where rows touch, else one per row."""
    if step == size:
        return [(base + s * step, n * size) for s, n in runs]
    return [(base + s * step, size) for s in slots]


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """``slots`` as runs of consecutive ones: ``(first, count)``."""
    out: list[tuple[int, int]] = []
    for s in slots:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


def _joined(cuts: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """Ranges in order, each one that starts where the last ended joined to it."""
    out: list[tuple[int, int]] = []
    for start, size in (r for cut in cuts for r in cut):
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + size)
        else:
            out.append((start, size))
    return out


def _views(sources: list[list[torch.Tensor]], slots: list[int]) -> list[torch.Tensor] | None:
    """A split batch's messages as views of the rows of ``slots`` in ``sources`` (per pool tensor, its layers'
    ``[slots + 1, *state]`` rows), or None unless ``slots`` are one run whose rows of each layer are contiguous
    host memory (not an accelerator's, not strided paged rows)."""
    first = run_of(slots)
    if first is None:
        return None
    parts = [layer[first : first + len(slots)] for layers in sources for layer in layers]
    if not all(p.device.type == "cpu" and p.is_contiguous() for p in parts):
        return None
    return [as_bytes(p) for p in parts]  # not view(): a one-state row of a paged pool keeps the page's stride


@torch.inference_mode()
def write_pool(manager: CacheManager, slots: list[int], rows: list[torch.Tensor]) -> None:
    """Write arrived ``rows`` (``[layers, n, *state]`` per pool tensor) into pool ``slots`` (awaiting them in
    place), layer by layer on any pool layout, under inference mode (as :func:`write_staging`); on an
    accelerator the copies are waited for before the states count as arrived (an import may be read by the next
    forward on another stream)."""
    wait_for_restores(manager)  # the last tenant's work on them may still run on the stream
    pool = manager.pool
    index = torch.tensor(slots, dtype=torch.long, device=pool.device)
    for layers, buf in zip(pool.layers, rows, strict=True):
        for view, row in zip(layers, buf.unbind(0), strict=True):
            if view.device.type == "cpu" and not (view.is_floating_point() and view.element_size() == 1):
                view.index_copy_(0, index, row)
            else:
                view[index] = row.to(view.device)  # float8: CPU torch has no index_copy_ for it
    if pool.device.type != "cpu":
        torch.accelerator.current_stream(pool.device).record_event().synchronize()


def run_of(slots: list[int]) -> int | None:
    """The first slot when ``slots`` are consecutive and ascending (their rows of a layer are one contiguous run)."""
    first = slots[0] if slots else None
    return first if first is not None and slots == list(range(first, first + len(slots))) else None


def _ranks(rank: int, peer: int) -> bool:
    """Whether ``rank`` and ``peer`` are two distinct ranks in ``[0, 2**31)`` (c10d's ranks are 32-bit)."""
    return rank != peer and min(rank, peer) >= 0 and max(rank, peer) < 2**31


BatchId = tuple[str, int]  # (token, seq): the receiver remembers the last batch it landed per token


class Batches:
    """A sender's batch identities: a token and increasing numbers, and the room the peer last reported.

    A batch in doubt (it failed after the peer may have landed it: no
    acknowledgement seen) is not recorded here but in the manager's hand-off
    book (``exports_returned(..., batch=)``), per export and peer, so that any
    sender of the manager to that peer (this one, a second one, one built after
    the failure) finds it (``exports_in_doubt``) and sends it next, alone, under
    its identity: the peer acknowledges it again instead of landing it twice.
    Exports withdrawn meanwhile leave it, and a re-export of the same request
    is a new export of the book, never taken for the retry.

    Invariant: once a batch of a token is in doubt, no new batch goes under that
    token (this sender takes a fresh one). The peer remembers only the last batch
    it landed per token, so a later batch of the token landing first would make
    the retry look new, whichever sender retries it.
    """

    __slots__ = ("limit", "seq", "token")

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex[:16]
        self.seq = 0
        self.limit: int | None = None  # the room the peer last had when it refused a batch for room

    def failed(
        self, manager: CacheManager, batch: list[Export], exc: BaseException, ident: BatchId, retry: bool, peer: int
    ) -> bool:
        """Give a batch ``ident`` whose ship raised ``exc`` back to ``manager``, in doubt or not; True when it goes
        again at once (refused for room: cut to the room the peer has). ``retry``: it was in doubt before."""
        if isinstance(exc, TransferRefusedError):  # nothing landed: not in doubt
            # A refused retry: the peer never landed that batch (it acknowledges the batch it landed last whatever
            # its room), so it is in doubt under none now, and goes as a new batch; still that peer's alone.
            manager.exports_returned(batch, peer=peer if retry else None)
            if exc.reason == "room" and exc.room and exc.room < len(batch):
                self.limit = exc.room  # a batch the peer has room for, at once
                return True
            if exc.reason != "room":
                # The cut is the room of the peer's last refusal for room, not a rule: a batch refused for another
                # reason goes whole again (refused for room again if it still does not fit). Kept, it pinned a
                # prefill rank of a TP engine to a cut its other ranks did not make: a re-slicing receiver then
                # refused their batches as not one batch on every try, for good.
                self.limit = None
            return False
        # Withdrawn before the peer's go, a first try is nowhere: not in doubt, and not kept for that peer (an
        # export to no one must stay free to go to another peer). A retry of a batch in doubt (it went out
        # before) may have landed by an earlier try: still in doubt. A ship to several peers raises
        # NothingSent only if every peer withdrew it (and TransferRefusedError only if every peer refused it):
        # any other failure of one rank is a plain TransferError, in doubt.
        if isinstance(exc, NothingSent) and not retry:
            manager.exports_returned(batch)
            return False
        if ident[0] == self.token:
            self.token = uuid.uuid4().hex[:16]  # nothing new under a token in doubt (the class's invariant)
        manager.exports_returned(batch, peer=peer, batch=ident)  # it may have landed there: nowhere else
        return False

    def pick(self, manager: CacheManager, ready: list[Export]) -> tuple[list[Export], BatchId, bool]:
        """The batch to send out of ``ready``, its identity, and whether it is the retry of a batch in doubt: the
        exports in doubt under the first such batch of the book, else a new batch (the first ``limit`` of them
        after a refusal for room)."""
        doubts = manager.exports_in_doubt(ready)
        ident = next((d for d in doubts if d is not None), None)
        if ident is not None:
            return [ev for ev, d in zip(ready, doubts, strict=True) if d == ident], ident, True  # type: ignore[return-value]
        self.seq += 1
        return ready[: self.limit] if self.limit else ready, (self.token, self.seq), False


def send_exports(
    manager: CacheManager,
    ship: Callable[[list[Export], list[str], BatchId, bool], None],
    peers: list[int],
    batches: Batches,
    sizes: Callable[[int], dict[str, Any]] = lambda n: {},
) -> list[str]:
    """The sender's side of an export's life around ``ship(batch, ids, ident, retry)`` (the wire, which raises
    unless every peer acknowledged batch ``ident``; ``retry``: it is a batch in doubt sent again): take the
    exports ready for ``peers[0]``, ship them, then deliver them (slots released, staging dropped), or on any
    failure give them back to the manager (retry, or release, which withdraws them). A batch in doubt (the
    book's, :class:`Batches`) goes alone first, then the rest in a batch of its own; a batch refused for room goes
    again at once cut to the room the peer has (none: the refusal is raised). Returns the ids delivered; raises
    only when none was (a failure after a part of the call's exports went out returns that part).

    One protocol for :class:`StateTransfer` and :class:`~mambacache._handoff._reslice.ReslicingSender`;
    ``sizes(n)``: the extra fields of the batch's ``transfer.send`` line (one line naming ``peers[0]``, however
    many peers took a part of it: the analyzer counts a line as one delivery of its states).
    """
    delivered: list[str] = []
    while True:
        try:
            ready = manager.take_exports(to=peers[0])
        except Exception:
            # The manager closed (or broke) while a batch was out: the batches it delivered ended, and the
            # caller must hear so (a closing manager still takes a send in flight; it is no failure).
            if delivered:
                return delivered
            raise
        if not ready:
            return delivered
        batch, ident, retry = batches.pick(manager, ready)
        in_place = batch[0].host is None  # a batch is read from one place: the staging rows, or the pool
        batch = [ev for ev in batch if (ev.host is None) is in_place]
        rest = [ev for ev in ready if ev not in batch]
        if rest:
            manager.exports_returned(rest)  # taken again below, once the batch in doubt is resolved
        ids = [ev.request_id or "" for ev in batch]
        try:
            ship(batch, ids, ident, retry)
        except BaseException as exc:
            if batches.failed(manager, batch, exc, ident, retry, peers[0]):
                continue
            if delivered and isinstance(exc, Exception):
                return delivered  # what went out is the caller's news; the rest fails again on the next call
            raise  # an interrupt or exit is never swallowed (what went out stays delivered: its slots are free)
        batches.limit = None
        try:
            _tracer.tracer.transfer("transfer.send", peers[0], ids, step=manager.step, n=len(ids), **sizes(len(ids)))
        finally:  # acknowledged: taken even if the tracer raises (a full disk), else they stayed sending for good
            manager.exports_delivered(batch)
        delivered += ids
        if not rest:
            return delivered


def ship_rows(xfer: StateTransfer, request_ids: list[str], rows: list[torch.Tensor], ident: BatchId) -> None:
    """:meth:`StateTransfer.send_rows` of batch ``ident``, a token other than the transfer's own included (a
    re-slicing sender's batches are its own, and a batch in doubt keeps the token it first went under)."""
    check_rows(request_ids, rows, ident[1])
    layers = rows[0].shape[0]
    fp = fingerprint(layers, [(tuple(r.shape[2:]), r.dtype) for r in rows])
    ship_messages(xfer, request_ids, fp, messages([r.contiguous() for r in rows], False), ident)


def ship_messages(
    xfer: StateTransfer, request_ids: list[str], fp: list[Any], raw: Sequence[Message], ident: BatchId
) -> None:
    """:func:`ship_rows` of a batch already in the wire's messages (unsplit, fingerprint ``fp``): a re-slicing
    sender's shard of each state as :class:`~._transports._base.Pieces` of the rows it lies in, over a wire that
    reads pieces (the peer reads only those bytes, where they are)."""
    with xfer._send_lock:  # one batch at a time per direction, as send() takes turns
        xfer._check_open()
        xfer._out.send(list(request_ids), ident[1], fp, raw, False, ident[0])


@contextlib.contextmanager
def receive_turn(xfer: StateTransfer) -> Iterator[Inbox]:
    """``xfer``'s turn to receive, and its inbox: another receive of it waits for the end of the block (the
    receiving counterpart of :func:`ship_messages`'s turn). :class:`TransferError` when it is closed, or a batch of
    :meth:`StateTransfer.receive_rows` awaits its answer. A receive of every rank at once (the re-slicing
    receiver's) holds the turns of all its transfers."""
    with xfer._receive_lock:
        xfer._check_open()
        xfer._check_answered()
        yield xfer._in


def _receive_line(peer: int, mgr: CacheManager, batch: Batch, where: str) -> Callable[[list[int]], None]:
    """The ``arrived`` callback of a landing of ``batch`` from ``peer``: its ``transfer.receive`` line, naming the
    staging host slots (``where`` ``"hosts"``) or the pool slots it landed in place in (``"slots"``)."""

    def arrived(slots: list[int]) -> None:
        _tracer.tracer.transfer(
            "transfer.receive", peer, batch.ids, step=mgr.step, n=len(batch.ids), bytes=sum(batch.sizes),
            **{where: slots},
        )  # fmt: skip

    return arrived


def _acknowledge_landed(inbox: Inbox, peer: int, batch: Batch) -> None:
    """Acknowledge ``batch``, landed. A failure of the answer (its write to the store) is traced, not raised: the
    states arrived, and raising would hide which from the engine; the sender, unanswered, sends the batch again,
    acknowledged as a duplicate."""
    try:
        inbox.answer(batch, True)
    except TransferError as exc:
        _tracer.tracer.transfer("transfer.failed", peer, batch.ids, call="acknowledge", error=str(exc))


def answer_not_landed(inbox: Inbox, batch: Batch, why: str) -> None:
    """Answer ``batch`` not landed (its sender keeps its slots and sees ``why``), unless it was answered already
    (its sender withdrew it, or its bytes failed: answered ``fail``)."""
    if inbox.waiting is batch:
        inbox.answer(batch, False, why)


def wire_of(xfer: StateTransfer, receiving: bool) -> Wire | None:
    """The wire of ``xfer``'s inbox (``receiving``) or outbox; None for a link without one (one that
    :func:`open_link` did not make): it moves whole tensors."""
    return getattr(getattr(xfer, "_in" if receiving else "_out", None), "wire", None)


def _slot_rows(xfer: StateTransfer, in_place: bool) -> _Rows:
    """Where ``xfer``'s manager's pool (``in_place``) or host pool slot rows lie (``StateTransfer._rows``): the
    re-slicing sender and receiver cut their ranks' pieces from them."""
    return xfer._rows(in_place)


def _rows_in_place(wire: Wire | None, rows: _Rows, slots: list[int], split: bool) -> Sequence[Message] | None:
    """A batch's messages as the rows of ``slots`` where they lie (see ``StateTransfer._straight``), or None."""
    if getattr(wire, "pieces", False):  # not a stand-in wire of another shape: those move whole tensors
        assert wire is not None
        return rows.pieces(slots, split, wire.devices)
    return _views(rows.layers, slots) if split else None


def _landing_rows(mgr: CacheManager, in_place: bool) -> list[list[torch.Tensor]]:
    """Per pool tensor, its ``[slots + 1, *state]`` rows of each layer: the pool's (``in_place``) or the host
    pool's."""
    host = mgr.host_pool
    assert host is not None
    return mgr.pool.layers if in_place else [list(t.unbind(0)) for t in host.tensors]


def open_link(
    transport: str, store: Any, rank: int, peer: int, seconds: float, memory: list[torch.Tensor]
) -> tuple[Transport, Outbox, Inbox]:
    """The link of ``rank`` with ``peer`` over ``store``: the transport's wires, with ``memory`` registered once (a
    batch's rows are read from and written into it, or the kept buffers), and the two directions over them."""
    wires = make_transport(transport, root_store(store), rank, peer, seconds)
    wires.register(memory)
    return wires, Outbox(store, rank, peer, seconds, wires), Inbox(store, peer, rank, seconds, wires)


class StateTransfer:
    """Sends a manager's exports to ``peer`` and receives the peer's into the manager's staging host slots.

    Invariants: a send ships exactly the exports whose flush has run, in export
    order, and releases their pool and staging slots only after the peer's
    acknowledgement (a failed send keeps them all: call :meth:`send` again once
    the peer can take them, or release); a batch that may have landed is sent
    again under its own token and number by whichever transfer of the manager
    sends to that peer next (the doubt is the manager's hand-off book's), and
    the peer acknowledges it without landing it twice; a receive lands every
    state of a batch or none and acknowledges only what landed. Nothing of one
    batch outlives its failure: the next batch goes over a fresh gloo pair.

    ``send`` and ``receive`` may run in two threads at once (each direction has
    its own store client and pair); two sends, or two receives, take turns.
    ``store`` and ``rank``: for a process outside the group's world (one that
    joins later, a restarted engine), a client of the group's store and the rank
    its peer knows it by; ``group`` is then None.
    """

    def __init__(
        self,
        manager: CacheManager,
        group: Any,
        peer: int,
        *,
        timeout: float = 60.0,
        store: Any = None,
        rank: int | None = None,
        transport: str = "gloo",
    ) -> None:
        import torch.distributed as dist

        check_instance("manager", manager, CacheManager)
        host = need_host("StateTransfer", manager.host_pool)  # its staging area
        seconds = check_timeout(timeout)
        check_transport(transport)
        if store is None:
            if not dist.is_initialized():
                raise DistributedError("torch.distributed is not initialized: call init_process_group first")
            members = dist.get_process_group_ranks(group)
            if type(peer) is not int or peer == dist.get_rank() or peer not in members:
                raise InvalidArgumentError(f"peer must be another rank of the group, got {peer!r}")
            rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
        elif group is not None or type(rank) is not int or type(peer) is not int or not _ranks(rank, peer):
            raise InvalidArgumentError(
                f"with a store: group=None, and rank and peer two distinct ranks (ints in [0, 2**31)), got {rank!r}"
                f" and {peer!r}"
            )
        elif not isinstance(store, dist.distributed_c10d.Store):
            raise InvalidArgumentError(f"store must be a torch.distributed.Store (a TCPStore client), got {store!r}")
        self._mgr, self.peer, self.rank = manager, peer, rank
        memory = [v for views in manager.pool.layers for v in views] + host.tensors
        self._wires, self._out, self._in = open_link(transport, store, rank, peer, seconds, memory)
        self.transport = transport
        self._where: dict[bool, _Rows] = {}
        self._batches = Batches()
        self._bufs, self._send_bufs = _Buffers(), _Buffers()
        self._send_lock, self._receive_lock = threading.Lock(), threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Release the transport's resources now: over NIXL its agent (its threads, the memory it registered), over
        Mooncake the memory its engine registered (the engine goes on to the process's next transfer: destroying
        one stops every Python thread for about 0.8 s); over gloo nothing (its pairs go with the transfer).
        Idempotent.

        A send or receive in flight in another thread ends first (close waits for
        it). Every call after it is a :class:`TransferError`; the manager's exports
        and arrivals stay as they are (another transfer of the manager sends and
        receives them). Without it the resources go when the transfer is collected.
        """
        with self._send_lock, self._receive_lock:
            self._closed = True
            self._wires.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"this StateTransfer to rank {self.peer} is closed")

    def _layers(self) -> int:
        return self._mgr.pool.spec.num_layers

    def _shapes(self) -> Shapes:
        host = self._mgr.host_pool
        assert host is not None
        return [(tuple(t.shape[2:]), t.dtype) for t in host.tensors]

    # -- sending -------------------------------------------------------------
    @_tracer.traces_failures
    def send(self) -> list[str]:
        """Ship every export whose flush has run, wait for the acknowledgement, then free their slots.

        Returns the request ids delivered (none: nothing was sent). Exports queued
        since the last flush wait for the next send. A failure keeps every
        export: :class:`TransferRefusedError` when the peer refused the batch
        (``reason`` ``"room"``: send again once it has room), :class:`TransferError`
        otherwise (send again once the peer is there). With pools on an
        accelerator, the staging copies are waited for through an event recorded
        on the pool device's current stream (where ``flush_nowait()`` runs them:
        after a flush on another stream, send with that stream current), not a
        device synchronize.
        """
        mgr = self._mgr
        with self._send_lock:
            self._check_open()
            return send_exports(
                mgr, self._ship, [self.peer], self._batches, lambda n: {"bytes": n * mgr.pool.spec.slot_bytes}
            )

    def _ship(self, ready: list[Export], ids: list[str], ident: BatchId, retry: bool) -> None:
        """Batch ``ident`` until acknowledged: sent straight from the staging rows (or, exported in place, the pool's)
        when they are one run of host memory and the batch is split (see ``_link``), else gathered into the kept
        buffers."""
        try:
            with ReadingBatch(self._mgr, ids):
                split = self._split(len(ids))
                raw = self._straight(ready, split)
                if raw is None:
                    rows = export_rows(self._mgr, ready, self._send_bufs.rows(self._layers(), len(ids), self._shapes()))
                    raw = messages(rows, split)
            self._out.send(ids, ident[1], fingerprint(self._layers(), self._shapes()), raw, split, ident[0])
        except BaseException:
            self._send_bufs = _Buffers()
            raise

    def _straight(self, ready: list[Export], split: bool = True) -> Sequence[Message] | None:
        """The messages of ``ready`` where their rows lie: over a wire that reads pieces, the ranges of the rows
        (any slots, host or device memory it reads); else, split, views of the rows when their slots are one run
        of contiguous host memory. None: gather them."""
        in_place = ready[0].host is None
        slots = [ev.slot for ev in ready] if in_place else [h for ev in ready if (h := ev.host) is not None]
        return _rows_in_place(wire_of(self, False), self._rows(in_place), slots, split)

    def _rows(self, in_place: bool) -> _Rows:
        """Where the pool's (``in_place``) or the host pool's slot rows lie, read at the first batch."""
        rows = self._where.get(in_place)
        if rows is None:
            rows = self._where[in_place] = _Rows(_landing_rows(self._mgr, in_place))
        return rows

    def _split(self, n: int) -> bool:
        """Whether a batch of ``n`` states goes as one message per layer: large enough that a message costs less
        than the copy it saves, or one layer (the same messages either way, and a split one lands in place)."""
        layers = self._layers()
        return layers == 1 or n * self._mgr.pool.spec.slot_bytes >= layers * SPLIT_BYTES

    def send_rows(self, request_ids: list[str], rows: list[torch.Tensor], seq: int) -> None:
        """Send one batch of the given ``[layers, n, *state]`` rows (one per pool tensor, the wire's order) for
        ``request_ids`` as batch ``seq`` of this transfer, and wait for its acknowledgement.

        The sending side of :meth:`receive_rows` and :meth:`acknowledge`, for a
        sender that reshapes what it sends (a peer at another tensor-parallel
        size: ``docs/transfer-tp.md``); the manager's slots are not touched. A
        retry of a batch that may have landed must reuse its ``seq`` (the peer
        then acknowledges without landing it again); a new batch takes a larger
        one. Raises :class:`TransferRefusedError` (refused, nothing landed) or
        :class:`TransferError` (failed: it may have landed) unless the peer
        acknowledged ``len(request_ids)`` states.
        """
        ship_rows(self, request_ids, rows, (self._out.token, seq))

    # -- receiving -----------------------------------------------------------
    @_tracer.traces_failures
    def receive(self) -> list[str]:
        """Land one batch of the peer's exports in staging host slots and acknowledge it; returns their ids.

        Each is then read by ``manager.import_into(slot, request_id=...)``. Waits
        up to ``timeout`` for a batch (none: :class:`TransferError`, and the next
        call waits again), then up to ``timeout`` for its bytes. A batch larger
        than ``manager.landing_room()`` (asked when its header arrives), of another spec or of an impossible size
        is refused before anything is allocated (:class:`TransferRefusedError`,
        the sender keeps it); a batch landed already (its acknowledgement was
        lost) is acknowledged again and not landed twice, whatever the room.
        """
        mgr = self._mgr
        with receive_turn(self) as inbox:
            deadline = time.monotonic() + inbox.timeout
            while True:
                batch = inbox.offer(self._layers(), self._shapes(), mgr.landing_room, deadline)
                try:
                    # The slots are taken before the answer, so the bytes may arrive straight into them; they
                    # count as arrived (importable) only once written, and the line is traced in that same
                    # hold of the lock (an import in another thread may follow at once: its line comes after).
                    # In place (expect_import) when every state awaits it in a pool slot whose alloc ran, else staged.
                    traced = partial(_receive_line, self.peer, mgr, batch)
                    slots = mgr.land_in_place(batch.ids, partial(self._take, batch, True), arrived=traced("slots"))
                    if slots is None:
                        mgr.land(batch.ids, partial(self._take, batch, False), arrived=traced("hosts"))
                except Withdrawn:  # its sender gave up on it first: nothing arrived, the next header may
                    inbox.check_left(deadline)
                    continue
                except PoolExhaustedError as exc:  # room went elsewhere since the header was judged
                    inbox.answer(batch, False, f"room:{mgr.landing_room()}:{exc}")
                    raise TransferRefusedError(
                        f"refused a batch from rank {self.peer}: {exc}", batch.ids, "room"
                    ) from exc
                except BaseException as exc:  # not landed, or not written (its slots freed): the sender keeps them
                    self._bufs = _Buffers()
                    answer_not_landed(inbox, batch, str(exc))
                    if isinstance(exc, Exception) and not isinstance(exc, MambaCacheError):
                        # A local fault (the kept buffers could not grow, a copy out of them failed): a
                        # TransferError, as every failure of a transfer, the cause chained.
                        raise TransferError(
                            f"receiving a batch from rank {self.peer} failed, nothing landed: {exc!r}", batch.ids
                        ) from exc
                    raise
                _acknowledge_landed(inbox, self.peer, batch)
                return batch.ids

    def _take(self, batch: Batch, in_place: bool, slots: list[int]) -> None:
        """Receive ``batch`` into staging host ``slots`` (``in_place``: the pool slots awaiting it): straight into
        their rows when they are one run of contiguous host memory and the batch is split, else into the kept
        buffers and copied over."""
        mgr = self._mgr
        raw = _rows_in_place(wire_of(self, True), self._rows(in_place), slots, batch.split)
        if raw is not None:
            wait_for_restores(mgr)  # the bytes land in the slots themselves (write_staging and write_pool wait)
            self._in.take(batch, raw)
            return
        rows = self._bufs.rows(self._layers(), len(slots), self._shapes())
        self._in.take(batch, messages(rows, batch.split))
        if in_place:
            write_pool(mgr, slots, rows)
        else:
            write_staging(mgr, slots, rows)

    @_tracer.traces_failures
    def receive_rows(self, shapes: Shapes | None = None) -> tuple[list[str], list[torch.Tensor]]:
        """One batch of the peer's exports as ``[layers, n, *state]`` tensors, landed nowhere and not acknowledged.

        The hook for a receiver that reshapes what arrives before it lands (a
        peer at another tensor-parallel size: ``docs/transfer-tp.md``).
        ``shapes``: the peer's per-slot ``(shape, dtype)`` of each pool tensor
        (its ``StateSpec.shapes()``), default this manager's. Answer it with
        :meth:`acknowledge` once the states are safe (or ``landed=False``); until
        then another receive is refused (:class:`TransferError`). The
        tensors are the caller's (fresh each call, unlike :meth:`receive`'s kept
        buffers).
        """
        shapes = self._shapes() if shapes is None else check_shapes(shapes)
        with receive_turn(self) as inbox:
            deadline = time.monotonic() + inbox.timeout
            while True:
                batch = inbox.offer(self._layers(), shapes, lambda ids: self._mgr.landing_room(), deadline)
                rows = _Buffers().rows(self._layers(), len(batch.ids), shapes)
                try:
                    inbox.take(batch, messages(rows, batch.split))
                except Withdrawn:
                    inbox.check_left(deadline)
                    continue
                return batch.ids, rows

    def _check_answered(self) -> None:
        """Refuse a receive while a batch of :meth:`receive_rows` awaits its answer: the next header would leave
        that batch's sender waiting (and the answer would go to the wrong batch)."""
        waiting = self._in.waiting
        if waiting is not None and waiting.taken:
            raise TransferError(
                f"a batch of {waiting.ids} from rank {self.peer} awaits its answer: acknowledge() it first",
                list(waiting.ids),
            )

    @_tracer.traces_failures
    def acknowledge(self, request_ids: list[str], *, landed: bool = True, why: str = "") -> None:
        """Answer the batch :meth:`receive_rows` returned: ``landed``, the peer releases its slots; else it keeps
        them and sees ``why`` (``"room:<k>:<text>"``: a refusal for room, ``k`` the states that could land now).

        :class:`TransferError` when ``request_ids`` are not that batch's (nothing answered).
        """
        check_request_ids("acknowledge", request_ids, batch=True)
        check_bool("acknowledge's landed", landed)  # by its truth, landed="no" would free the sender's slots
        check_str("acknowledge's why", why)
        self._in.answer(self._waiting(request_ids), landed, why or "the receiver did not land it")

    def _waiting(self, request_ids: list[str]) -> Batch:
        batch = self._in.waiting
        if batch is None or not batch.taken or list(request_ids) != batch.ids:
            raise TransferError(f"no batch of {list(request_ids)} awaits an answer", list(request_ids))
        return batch

    # -- async forms ---------------------------------------------------------
    async def send_async(self) -> list[str]:
        """:meth:`send` in a worker thread, shielded: once started, a cancellation waits for the batch to finish.

        Why shielded: abandoning the thread mid-batch would leave the peer with
        half a batch and this side unsure whether it was acknowledged. A batch
        that ran returns its ids even when the call was cancelled meanwhile: the
        states were delivered (received, for :meth:`receive_async`), and raising
        instead would lose which ones, so the cancellation is delivered at the
        caller's next checkpoint. A call cancelled before it starts sends nothing
        and raises it (the shield would hide that cancellation from the thread's
        start, so it is checked first). asyncio's own cancellation
        (``Task.cancel()``: ``asyncio.timeout``, ``wait_for``, a ``TaskGroup``),
        which passes the shield, is held the same way: come while the batch is
        in the thread, the batch finishes, its ids come back and the task is
        cancelled again for its next checkpoint (``Task.cancelling()``
        unchanged); come before the thread took it, nothing is sent.
        """
        return await self._shielded(self.send)

    async def receive_async(self) -> list[str]:
        """:meth:`receive` in a worker thread, shielded like :meth:`send_async`: cancelled before it starts, it
        receives nothing; cancelled during the batch, it finishes it and returns the ids that arrived."""
        return await self._shielded(self.receive)

    @staticmethod
    async def _shielded(call: Callable[[], list[str]]) -> list[str]:
        await anyio.lowlevel.checkpoint_if_cancelled()
        # The shield holds anyio's cancellation back; asyncio's own (Task.cancel()) passes it, so the thread's
        # outcome is waited for here and that cancellation requested again for the caller's next checkpoint, as
        # the shield does with anyio's. Come before the thread took the call, it is raised: nothing moved.
        cancelled: list[BaseException] = []
        with anyio.CancelScope(shield=True):
            outcome = await run_in_worker(call, cancelled)
        if outcome is None:
            raise cancelled[0]
        cancel_again(cancelled)
        ids: list[str] = unwrap(outcome)
        return ids  # no checkpoint first: it would raise a pending cancellation and drop the ids that moved
