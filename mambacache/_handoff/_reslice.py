"""Re-slicing states between tensor-parallel sizes: a layout of segments per pool tensor.

A state tensor's first per-slot dimension (conv channels, temporal heads) is a
run of segments, each either split evenly across the ranks or replicated on
every rank. The segments follow the rule the sharded presets use
(``bench/_presets.py`` ``_shard_config``) over the shapes ``_core/_hfconfig.py`` derives:

* Mamba2 / Nemotron-H conv channels: ``x`` (inner) split, then ``B`` and ``C``
  (``G * N`` each) split when ``tp`` divides the groups, replicated when there is
  one group (vLLM's rule: any other group count does not shard);
* Qwen3-Next conv channels: ``q``, ``k`` (``Hk * Dk`` each) and ``v`` (``Hv * Dv``) split;
* temporal states: the heads (first dimension) split;
* extras (per-slot scales and the like): replicated.

A spec with no config behind it (a synthetic one) splits the first dimension of
its conv and temporal tensors and replicates extras. See ``docs/transfer-tp.md``.

Directions: TP ``a`` -> TP 1 joins on the receiver (:class:`ReslicingReceiver`),
TP 1 -> TP ``b`` cuts on the sender (:class:`ReslicingSender`: each receiving
rank gets only its shard's bytes), and ``a`` -> ``b`` where one divides the
other is either of them over :meth:`StateLayout.shard_layout` (a shard is
itself a layout, re-sliced ``b / a`` or ``a / b`` ways).

Over a wire that reads pieces (NIXL, Mooncake) neither side copies where the
rows allow it (host memory, or memory the wire reads, each slot's row
contiguous): a rank's shard is named as the byte ranges of the rows it lies in
(:meth:`StateLayout.cuts`, ``_transfer._Rows.pieces``) and read there into the
byte ranges of the landing rows it belongs in. Over gloo the shards are cut
from a host copy and pushed whole, and a receiver gathers them before it
writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .._core import _tracer
from .._core._errors import (
    DistributedError,
    InvalidArgumentError,
    PoolExhaustedError,
    TransferError,
    TransferRefusedError,
)
from .._core._events import Export
from .._core._spec import StateSpec
from .._manager import CacheManager
from ._link import Batch, Inbox, NothingSent, Withdrawn, check_timeout, fingerprint, messages
from ._transfer import (
    Batches,
    BatchId,
    Cut,
    ReadingBatch,
    StateTransfer,
    _Buffers,
    _landing_rows,
    _Rows,
    _slot_rows,
    answer_not_landed,
    export_rows,
    receive_turn,
    replicated_bytes,
    replicated_rows,
    send_exports,
    ship_messages,
    ship_rows,
    wait_for_restores,
    wire_of,
    write_pool,
    write_staging,
)
from ._transports._base import Message
from ._transports._pick import check_transport

__all__ = ["ReslicingReceiver", "ReslicingSender", "Segment", "StateLayout", "TensorLayout"]


@dataclass(frozen=True, slots=True)
class Segment:
    """``size`` entries of the full tensor's first state dimension: split across the ranks, or replicated."""

    size: int
    split: bool
    unit: int = 1  # a split never cuts one of these (a head, a group): it splits whole units only


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """One pool tensor's first state dimension as segments (none: a scalar state, replicated whole).

    Invariant: a rank's shard holds, in segment order, its ``1/tp`` of each split
    segment and the whole of each replicated one.
    """

    segments: tuple[Segment, ...]

    def full_size(self) -> int:
        """The first state dimension of the full tensor."""
        return sum(s.size for s in self.segments)

    def check(self, tp: int) -> None:
        """InvalidArgumentError unless every split segment divides by ``tp``."""
        bad = [s.size for s in self.segments if s.split and (s.size % s.unit or (s.size // s.unit) % tp)]
        if bad:
            raise InvalidArgumentError(f"segments of sizes {bad} do not split {tp} ways in whole heads or groups")

    def shard_size(self, tp: int) -> int:
        """The first state dimension of one rank's shard."""
        self.check(tp)
        return sum(s.size // tp if s.split else s.size for s in self.segments)

    def slice(self, full: torch.Tensor, tp: int, rank: int, dim: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``full`` (segments along ``dim``), a new contiguous tensor."""
        self.check(tp)
        if not self.segments:
            return full.clone()
        parts, start = [], 0
        for seg in self.segments:
            width = seg.size // tp if seg.split else seg.size
            offset = start + (rank * width if seg.split else 0)
            parts.append(full.narrow(dim, offset, width))
            start += seg.size
        return torch.cat(parts, dim)

    def cuts(self, shape: Sequence[int], dtype: torch.dtype, tp: int, rank: int) -> list[Cut]:
        """Rank ``rank``'s shard of one state's row (per-slot ``shape``, ``dtype``) as byte ranges of the full
        row, in shard order: :meth:`slice`'s parts, where they lie (``(offset, bytes, replicated)``)."""
        self.check(tp)
        if not self.segments:
            return [(0, math.prod(shape) * dtype.itemsize, True)]
        unit = math.prod(shape[1:]) * dtype.itemsize  # one entry of the first state dimension
        out, start = [], 0
        for seg in self.segments:
            width = seg.size // tp if seg.split else seg.size
            out.append(((start + (rank * width if seg.split else 0)) * unit, width * unit, not seg.split))
            start += seg.size
        return out

    def gather(self, shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """The full tensor from every rank's shard, in rank order; TransferError when replicated parts differ."""
        tp = len(shards)
        self.check(tp)
        if not self.segments:
            _same(shards, "a replicated tensor")
            return shards[0].clone()
        pieces, start = [], 0
        for i, seg in enumerate(self.segments):
            width = seg.size // tp if seg.split else seg.size
            parts = [s.narrow(dim, start, width) for s in shards]
            if seg.split:
                pieces.extend(parts)
            else:
                _same(parts, f"replicated segment {i}")
                pieces.append(parts[0])
            start += width
        return torch.cat(pieces, dim)


def _same(parts: Sequence[torch.Tensor], what: str) -> None:
    # Bytes, not values: a NaN is equal to itself here, and -0.0 differs from 0.0, as the wire sees them.
    first = parts[0].contiguous().view(torch.uint8) if parts[0].dim() else parts[0].reshape(1).view(torch.uint8)
    for k, p in enumerate(parts[1:], 1):
        raw = p.contiguous().view(torch.uint8) if p.dim() else p.reshape(1).view(torch.uint8)
        if not torch.equal(raw, first):
            raise TransferError(f"{what} differs between rank 0 and rank {k}: the shards are not of one state")


def _split(size: int, unit: int = 1) -> Segment:
    return Segment(size, True, unit)


@dataclass(frozen=True, slots=True)
class StateLayout:
    """How each pool tensor of a full ``spec`` divides across tensor-parallel ranks (convs, temporal, extras).

    Invariant: for every ``tp`` that :meth:`check` accepts, gathering the
    ``tp`` slices of a state gives the state back, byte for byte.
    """

    spec: StateSpec
    tensors: tuple[TensorLayout, ...]

    @classmethod
    def from_config(cls, config: Any, spec: StateSpec | None = None) -> StateLayout:
        """The layout of the model ``config`` describes (its full spec: ``StateSpec.from_hf_config`` unless given)."""
        if spec is not None and not isinstance(spec, StateSpec):
            raise InvalidArgumentError(f"StateLayout.from_config's spec must be a StateSpec or None, got {spec!r}")
        text = getattr(config, "text_config", None) or config  # multimodal Qwen3.5: the language model's
        kind = getattr(text, "model_type", None)
        derived = StateSpec.from_hf_config(config)
        full = spec if spec is not None else derived
        # What the layout cuts must be the config's: the segments below are cut from the spec's channels, and a
        # shard's spec (or another head count) would give a layout that passes every later check and cuts wrong.
        # Only the first dimension is cut, so only it is compared: an engine's adopted pool keeps kernel - 1 conv
        # columns (SGLang's, TensorRT-LLM's [conv_dim, d_conv - 1]) and passes its pool's spec.
        cut = [c[0] for c in full.conv_shapes], full.temporal_shape[0]
        if cut != ([c[0] for c in derived.conv_shapes], derived.temporal_shape[0]):
            raise InvalidArgumentError(
                f"the spec's conv channels {cut[0]} and temporal heads {cut[1]} are not the config's"
                f" ({[c[0] for c in derived.conv_shapes]} and {derived.temporal_shape[0]}): a layout takes the whole"
                " model's spec (a shard's is shard_layout)"
            )
        temporal = TensorLayout((_split(full.temporal_shape[0]),))
        if kind in ("mamba2", "nemotron_h"):
            state = text.state_size if kind == "mamba2" else text.ssm_state_size
            groups = text.n_groups * state
            inner = full.conv_shapes[0][0] - 2 * groups
            head = text.head_dim if kind == "mamba2" else text.mamba_head_dim
            bc = Segment(groups, text.n_groups != 1, state)  # one group: every rank holds it (vLLM's rule)
            conv = TensorLayout((_split(inner, head), bc, bc))
        elif kind in ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
            key = text.linear_num_key_heads * text.linear_key_head_dim
            value = text.linear_num_value_heads * text.linear_value_head_dim
            dk, dv = text.linear_key_head_dim, text.linear_value_head_dim
            conv = TensorLayout((_split(key, dk), _split(key, dk), _split(value, dv)))
        else:
            raise InvalidArgumentError(f"no sharding rule for model_type {kind!r}: mamba2, nemotron_h, qwen3_next")
        if conv.full_size() != full.conv_shapes[0][0]:
            raise InvalidArgumentError(f"the config's conv channels {conv.full_size()} are not the spec's")
        return cls(full, (conv, temporal, *(TensorLayout(()) for _ in full.extra_shapes)))

    @classmethod
    def synthetic(cls, spec: StateSpec) -> StateLayout:
        """A spec without a config: the first dimension of each conv and of the temporal state split, extras
        replicated (the synthetic presets' rule)."""
        if not isinstance(spec, StateSpec):
            raise InvalidArgumentError(f"StateLayout.synthetic takes a StateSpec, got {spec!r}")
        conv = [TensorLayout((_split(c[0]),)) for c in spec.conv_shapes]
        temporal = TensorLayout((_split(spec.temporal_shape[0]),))
        return cls(spec, (*conv, temporal, *(TensorLayout(()) for _ in spec.extra_shapes)))

    def check(self, tp: int) -> None:
        """InvalidArgumentError unless the state divides ``tp`` ways (``tp`` a positive int)."""
        if type(tp) is not int or tp < 1:
            raise InvalidArgumentError(f"tp must be a positive int, got {tp!r}")
        for t in self.tensors:
            t.check(tp)

    def shard_spec(self, tp: int) -> StateSpec:
        """The spec of one rank's shard at ``tp``."""
        self.check(tp)
        spec, n = self.spec, len(self.spec.conv_shapes)
        conv = [(t.shard_size(tp), *c[1:]) for t, c in zip(self.tensors[:n], spec.conv_shapes, strict=True)]
        temporal = (self.tensors[n].shard_size(tp), *spec.temporal_shape[1:])
        return dataclasses.replace(spec, conv_shapes=conv, temporal_shape=temporal)

    def shard_layout(self, tp: int) -> StateLayout:
        """One rank's shard at ``tp`` as a layout of its own: each split segment ``1/tp`` its size, the rest kept.

        Why: slicing this ``m`` ways gives the shards at ``tp * m`` (rank ``k`` of
        ``tp`` holds ranks ``k * m .. k * m + m - 1`` of ``tp * m``), so ``a`` -> ``b``
        where one divides the other is a 1 -> ``m`` or ``m`` -> 1 re-slice per shard.
        """
        spec = self.shard_spec(tp)
        return StateLayout(
            spec,
            tuple(
                TensorLayout(tuple(Segment(s.size // tp, True, s.unit) if s.split else s for s in t.segments))
                for t in self.tensors
            ),
        )

    def cuts(self, tp: int, rank: int) -> list[list[Cut]]:
        """Rank ``rank``'s shard at ``tp`` of one state's row of each pool tensor, as the byte ranges of the full
        row it is made of, in shard order (``(offset, bytes, replicated)``): what a wire that reads pieces reads
        (or writes), where :meth:`slice` copies."""
        self.check(tp)
        if type(rank) is not int or not 0 <= rank < tp:
            raise InvalidArgumentError(f"rank must be in [0, {tp}), got {rank!r}")
        shapes = self.spec.shapes()
        return [t.cuts(s, dtype, tp, rank) for t, (s, dtype) in zip(self.tensors, shapes, strict=True)]

    def slice(self, full: Sequence[torch.Tensor], tp: int, rank: int, dim: int = 2) -> list[torch.Tensor]:
        """Rank ``rank``'s shard of each full tensor (pool-shaped ``[layers, slots, *state]``: ``dim=2``)."""
        self.check(tp)
        if type(rank) is not int or not 0 <= rank < tp:
            raise InvalidArgumentError(f"rank must be in [0, {tp}), got {rank!r}")
        return [t.slice(x, tp, rank, dim) for t, x in zip(self.tensors, full, strict=True)]

    def gather(self, shards: Sequence[Sequence[torch.Tensor]], dim: int = 2) -> list[torch.Tensor]:
        """The full tensors from ``shards[rank]`` (each rank's tensors in pool order); TransferError when the
        replicated parts of two ranks differ."""
        self.check(len(shards))
        return [t.gather([s[i] for s in shards], dim) for i, t in enumerate(self.tensors)]


def _devices(transfers: Sequence[StateTransfer], receiving: bool) -> tuple[str, ...] | None:
    """The device types whose memory every one of ``transfers``' wires (their inboxes', ``receiving``, else their
    outboxes') reads pieces of, or None unless each of them does (gloo pushes whole tensors; a stand-in wire too)."""
    wires = [wire_of(x, receiving) for x in transfers]
    if not all(getattr(w, "pieces", False) is True for w in wires):
        return None
    kinds = [set(w.devices) for w in wires if w is not None]
    return tuple(sorted(set.intersection(*kinds))) if kinds else None


def export_pieces(
    transfers: Sequence[StateTransfer], exports: list[Export], layout: StateLayout
) -> list[list[Message]] | None:
    """Each rank's shard of the states of ``exports`` (all staged, or all in place) as the wire's messages, one per
    pool tensor: the byte ranges of their staging host rows (or pool rows, in place) the shard is made of, per
    rank ``k`` of ``len(transfers)`` (:meth:`StateLayout.cuts`), so the rank reads its bytes where they lie and
    nothing is copied here. None unless every transfer's wire reads pieces of those rows
    (``_transfer._Rows.pieces``): then the shards are cut from a host copy (:func:`export_rows`)."""
    devices = _devices(transfers, receiving=False)
    if devices is None:
        return None
    in_place = exports[0].host is None
    slots = [ev.slot if in_place or ev.host is None else ev.host for ev in exports]
    rows = _slot_rows(transfers[0], in_place)  # one manager behind every transfer
    tp = len(transfers)
    out: list[list[Message]] = []
    for rank in range(tp):
        shard = rows.pieces(slots, False, devices, layout.cuts(tp, rank))
        if shard is None:
            return None
        out.append(list(shard))
    return out


class ReslicingReceiver:
    """Receives each state from the ``tp`` ranks of a peer at another tensor-parallel size and lands it whole.

    ``transfers[k]`` talks to the peer's rank ``k`` (its shard ``k`` of
    ``layout``); the manager holds full states (``layout.spec``). Invariants:
    a batch lands only when every rank sent the same ids and their replicated
    parts agree, and no rank is acknowledged before it has landed, so a failure
    anywhere leaves every sender holding its slots and nothing landed here.
    """

    def __init__(self, manager: CacheManager, transfers: Sequence[StateTransfer], layout: StateLayout) -> None:
        if not transfers:
            raise InvalidArgumentError("a reslicing receiver needs one transfer per peer rank")
        layout.check(len(transfers))
        if manager.host_pool is None or manager.pool.spec != layout.spec:
            raise InvalidArgumentError("the manager must hold the layout's full spec, with a host pool to land in")
        self._mgr, self._transfers, self._layout = manager, list(transfers), layout
        self._shapes = layout.shard_spec(len(transfers)).shapes()
        self._asides: dict[int, torch.Tensor] = {}  # per rank after the first: its replicated parts, read aside

    def receive(self) -> list[str]:
        """One batch from every peer rank, assembled and landed whole; returns the ids.

        In place when every state awaits a pool slot whose alloc ran (``expect_import``), else in staging host
        slots; each is then read by ``manager.import_into(slot, request_id=...)``. Over a wire that reads pieces (NIXL,
        Mooncake) each rank's shard is read straight into its parts of the landing rows (no buffer, no gather,
        no copy after; a rank after the first reads its replicated parts aside, compared with the first's); over
        gloo each arrives whole, and is gathered, then written. An acknowledgement that fails
        after the landing (a store failure) is traced, not raised: the states landed, and their ids are
        returned; a rank that missed its answer sends the batch again, acknowledged without landing twice.
        """
        if _devices(self._transfers, receiving=True) is not None:
            return self._receive_pieces()
        got: list[tuple[list[str], list[torch.Tensor]]] = []
        try:
            for x in self._transfers:
                got.append(x.receive_rows(self._shapes))
            ids = got[0][0]
            try:
                self._one_batch(ids, [other for other, _ in got])
                full = self._layout.gather([rows for _, rows in got], dim=2)
            except TransferError as exc:
                # These checks are this receiver's own: each rank's receive_rows traced only its own failures.
                self._refused(ids, exc)
                raise
            size = sum(r.numel() * r.element_size() for _, rows in got for r in rows)  # from every rank
            # Arrived only once written (a failed write frees the slots, and every rank hears it landed nothing).
            mgr = self._mgr
            line = partial(self._arrived, ids, size)
            if mgr.land_in_place(ids, lambda slots: write_pool(mgr, slots, full), arrived=line("slots")) is None:
                mgr.land(ids, lambda hosts: write_staging(mgr, hosts, full), arrived=line("hosts"))
        except BaseException as exc:
            # Every rank that sent its shard hears that nothing landed: it keeps its slots and sends again.
            why = f"room:{self._mgr.landing_room()}:{exc}" if isinstance(exc, PoolExhaustedError) else str(exc)
            for x, (shard_ids, _) in zip(self._transfers, got, strict=False):
                with contextlib.suppress(TransferError):
                    x.acknowledge(shard_ids, landed=False, why=why)
            raise
        # Every rank is answered even when one answer fails (its store client): a rank left unanswered keeps its
        # batch awaiting an answer here that nothing could give any more, and every later receive is refused.
        # A failed answer (traced by acknowledge) is not raised: the states landed, and raising would hide which;
        # that rank, unanswered, sends its shards again, acknowledged as a duplicate.
        for x in self._transfers:
            with contextlib.suppress(TransferError):
                x.acknowledge(ids)
        return ids

    def _arrived(self, ids: list[str], size: int, where: str) -> Callable[[list[int]], None]:
        """The ``arrived`` callback of a landing: one ``transfer.receive`` line naming every rank (``peers``), the
        bytes from all of them, and the staging host slots (``where`` ``"hosts"``) or pool slots (``"slots"``)."""
        peers = [x.peer for x in self._transfers]

        def arrived(slots: list[int]) -> None:  # in the hold that makes them arrived: before any import's line
            _tracer.tracer.transfer(
                "transfer.receive", peers[0], ids, step=self._mgr.step, n=len(ids), bytes=size, peers=peers,
                **{where: slots},
            )  # fmt: skip

        return arrived

    @staticmethod
    def _one_batch(ids: list[str], each: list[list[str]]) -> None:
        """TransferError (not traced: the caller's :meth:`_refused`) unless every rank sent the batch of ``ids``."""
        for k, other in enumerate(each[1:], 1):
            if other != ids:
                raise TransferError(f"peer rank 0 sent {ids}, rank {k} sent {other}: not one batch", ids)

    def _refused(self, ids: list[str], exc: TransferError) -> None:
        """This receiver's own refusal of what its ranks sent (not one batch; replicated parts that differ): one
        ``transfer.failed`` line, as a failed plain receive writes, ``peer`` the first rank and ``peers`` every
        rank. A failure of one rank's wire is that rank's own line instead (:meth:`_rank_failed`)."""
        peers = [x.peer for x in self._transfers]
        _tracer.tracer.transfer("transfer.failed", peers[0], ids, call="receive", error=str(exc), peers=peers)

    @staticmethod
    def _rank_failed(x: StateTransfer, exc: TransferError) -> None:
        """One rank's own failure (no batch, a refusal, its bytes, the store): that rank's ``transfer.failed``
        line, as its ``receive_rows`` would write."""
        _tracer.tracer.transfer("transfer.failed", x.peer, exc.request_ids, call="receive", error=str(exc))

    def _receive_pieces(self) -> list[str]:
        """:meth:`receive` over wires that read pieces: every rank's header judged first, the landing slots taken,
        then each rank's ``go`` and its shard read into its parts of the slots' rows (:meth:`_read_into`)."""
        mgr, xs = self._mgr, self._transfers
        layers = mgr.pool.spec.num_layers
        batches: list[Batch] = []
        with contextlib.ExitStack() as turns:
            # A receive of each transfer takes turns with this one (and one awaiting its answer first).
            inboxes = [turns.enter_context(receive_turn(x)) for x in xs]
            deadlines = [time.monotonic() + inbox.timeout for inbox in inboxes]
            try:
                for x, inbox, deadline in zip(xs, inboxes, deadlines, strict=True):
                    try:
                        batches.append(inbox.offer(layers, self._shapes, mgr.landing_room, deadline))
                    except TransferError as exc:  # this rank's own failure (no batch, a refusal)
                        self._rank_failed(x, exc)
                        raise
                ids = batches[0].ids
                try:
                    self._one_batch(ids, [b.ids for b in batches])
                except TransferError as exc:
                    self._refused(ids, exc)
                    raise
                size = sum(sum(b.sizes) for b in batches)
                write = partial(self._read_into, inboxes, batches, deadlines, ids)
                line = partial(self._arrived, ids, size)
                if mgr.land_in_place(ids, partial(write, True), arrived=line("slots")) is None:
                    mgr.land(ids, partial(write, False), arrived=line("hosts"))
            except BaseException as exc:
                # Every rank hears that nothing landed: one whose go was not written yet sees a refusal at once
                # (room: cut to it), one that sent its bytes a refusal after them; each keeps its slots.
                why = f"room:{mgr.landing_room()}:{exc}" if isinstance(exc, PoolExhaustedError) else str(exc)
                for inbox, batch in zip(inboxes, batches, strict=False):
                    with contextlib.suppress(TransferError):
                        answer_not_landed(inbox, batch, why)
                raise
        for x in xs:  # as receive()'s: every rank answered, a failed answer traced, not raised
            with contextlib.suppress(TransferError):
                x.acknowledge(ids)
        return ids

    def _read_into(
        self,
        inboxes: list[Inbox],
        batches: list[Batch],
        deadlines: list[float],
        ids: list[str],
        in_place: bool,
        slots: list[int],
    ) -> None:
        """The landing's write: each rank's ``go`` and its shard read into ``slots`` (pool slots ``in_place``, else
        staging host slots), rank ``k``'s bytes into its parts of the rows (:meth:`StateLayout.cuts`). Rank 0's
        replicated parts land; every other rank's are read too, into a buffer kept aside, and compared with rank
        0's once all arrived (they differ: not one state, TransferError, nothing arrives). Rows the wires cannot
        read into (an accelerator's a wire does not reach, strided rows) take each rank's shard into a fresh
        buffer, gathered and written after. A rank whose sender withdrew its header before its go is waited for
        again until its deadline (its retry must be the same batch)."""
        mgr, xs, tp = self._mgr, self._transfers, len(self._transfers)
        devices = _devices(xs, receiving=True)
        assert devices is not None
        rows = _slot_rows(xs[0], in_place)  # one manager behind every transfer
        layers = mgr.pool.spec.num_layers
        direct = rows.contiguous and rows.device_types <= set(devices)  # as _Rows.pieces asks
        asides: list[tuple[int, torch.Tensor, list[list[Cut]]]] = []
        bufs: list[list[torch.Tensor]] = []
        wait_for_restores(mgr)  # the bytes land in the slots themselves; an earlier restore may still read them
        for k, (x, inbox) in enumerate(zip(xs, inboxes, strict=True)):
            cuts = self._layout.cuts(tp, k)
            while True:
                batch = batches[k]
                try:
                    if direct:
                        aside_bytes = replicated_bytes(layers, len(slots), cuts) if k else 0
                        aside = self._aside(k, aside_bytes, rows) if aside_bytes else None
                        raw = rows.pieces(slots, batch.split, devices, cuts, aside)
                        assert raw is not None
                        inbox.take(batch, raw)
                        if aside is not None:
                            asides.append((k, aside, cuts))
                    else:
                        got = _Buffers().rows(layers, len(ids), self._shapes)
                        inbox.take(batch, messages(got, batch.split))
                        bufs.append(got)
                    break
                except Withdrawn:  # its sender gave up on this header first: its retry comes next
                    try:
                        inbox.check_left(deadlines[k])
                        batches[k] = inbox.offer(layers, self._shapes, lambda _: len(ids), deadlines[k])
                    except TransferError as exc:  # no retry in time, or one refused: this rank's own failure
                        self._rank_failed(x, exc)
                        raise
                except TransferError as exc:  # this rank's own failure (the bytes, the store)
                    self._rank_failed(x, exc)
                    raise
                try:
                    self._one_batch(ids, [b.ids for b in batches])  # the retry of a withdrawn header
                except TransferError as exc:
                    self._refused(ids, exc)
                    raise
        try:
            if bufs:
                (write_pool if in_place else write_staging)(mgr, slots, self._layout.gather(bufs, dim=2))
            if asides:
                landed = _landing_rows(mgr, in_place)
                for k, aside, cuts in asides:
                    if not torch.equal(aside, replicated_rows(landed, slots, cuts)):
                        raise TransferError(
                            f"the replicated parts differ between rank 0 and rank {k}: the shards are not of one"
                            " state", ids
                        )  # fmt: skip
        except TransferError as exc:
            self._refused(ids, exc)
            raise

    @torch.inference_mode(False)
    def _aside(self, rank: int, size: int, rows: _Rows) -> torch.Tensor:
        """Rank ``rank``'s buffer for its replicated parts, ``size`` bytes on the landing rows' device: kept across
        batches (a pulled wire registers it once, not at every batch), grown when too small."""
        device = rows.layers[0][0].device
        buffer = self._asides.get(rank)
        if buffer is None or buffer.numel() < size or buffer.device != device:
            buffer = self._asides[rank] = torch.empty(size, dtype=torch.uint8, device=device)
        return buffer[:size]


class ReslicingSender:
    """Sends each exported state to the ``tp`` ranks of a peer at another tensor-parallel size, each only its shard.

    The counterpart of :class:`ReslicingReceiver`: the manager holds whole
    states (``layout.spec``) and ``peers[k]`` is the peer's rank ``k``, which
    receives with a plain :class:`~mambacache.StateTransfer` into a manager of
    ``layout.shard_spec(len(peers))``. The cut happens here so each rank is sent
    its ``1/tp`` of the split segments (and the replicated ones), never the whole
    state: over gloo cut into a host copy and pushed, over a wire that reads
    pieces (NIXL, Mooncake) named where it lies (each rank's header lists the
    byte ranges of the staging or pool rows its shard is made of) and read there
    by the rank, no copy on this side. Invariants: the wire is
    :class:`~mambacache.StateTransfer`'s, one
    batch per rank per call; the exported slots are released only once every
    rank acknowledged, so a rank that dies or times out is a
    :class:`TransferError` with every slot still held (send again or release),
    while each rank that did receive landed its whole batch (a
    ``StateTransfer.receive`` lands all or nothing).
    """

    def __init__(
        self,
        manager: CacheManager,
        group: Any,
        peers: Sequence[int],
        layout: StateLayout,
        *,
        timeout: float = 60.0,
        transport: str = "gloo",
    ) -> None:
        import torch.distributed as dist

        if not isinstance(manager, CacheManager) or manager.host_pool is None or manager.pool.spec != layout.spec:
            raise InvalidArgumentError("the manager must hold the layout's full spec, with a host pool to stage in")
        if not peers:
            raise InvalidArgumentError("a reslicing sender needs the peer's ranks, one per shard")
        layout.check(len(peers))
        check_transport(transport)
        if not dist.is_initialized():
            raise DistributedError("torch.distributed is not initialized: call init_process_group first")
        members, me = dist.get_process_group_ranks(group), dist.get_rank()
        if any(type(p) is not int or p == me or p not in members for p in peers) or len(set(peers)) != len(peers):
            raise InvalidArgumentError(f"peers must be distinct other ranks of the group, got {list(peers)!r}")
        check_timeout(timeout)
        self._mgr, self._layout = manager, layout
        self._batches = Batches()
        # Two sends take turns, as a StateTransfer's do: they share the batch numbers and token (a batch in doubt
        # is the manager's book's, whichever sender retries it).
        self._send_lock = threading.Lock()
        # The last ship's batch and the ranks it failed on, with their errors (traced by send() if it raises).
        self._failed: tuple[list[str], list[tuple[int, TransferError]]] = ([], [])
        self.peers = list(peers)
        self._shard_bytes = layout.shard_spec(len(peers)).slot_bytes
        self._transfers = [StateTransfer(manager, group, p, timeout=timeout, transport=transport) for p in peers]

    def send(self) -> list[str]:
        """Ship every export whose flush has run, rank ``k`` its shard ``k``; once all acknowledged, free the slots.

        Returns the request ids delivered (none: nothing was sent). Every rank is
        sent its batch even when another failed; a failure returns the exports to
        the manager (send again, or release: :meth:`StateTransfer.send`'s rules),
        and the retry carries the same batch number, so a rank that landed it
        already acknowledges it again without landing it twice.
        """
        with self._send_lock:
            # One transfer.send line per batch, naming every rank: a line per rank was counted as that many
            # deliveries, and took a later export of the same request (to another rank) as delivered. Its bytes:
            # what went to all the ranks (each its shard of every state).
            sent = len(self.peers) * self._shard_bytes
            try:
                return send_exports(
                    self._mgr, self._ship, self.peers, self._batches, lambda n: {"bytes": n * sent, "peers": self.peers}
                )
            except TransferError as exc:
                # Traced only when the call raises, as a StateTransfer's send: a batch every rank refused for room
                # is cut and sent again in the same call, and its refusals are no failure of it. Each rank whose
                # shards failed in the last ship gets its line (none recorded: the first rank, for the call).
                ids, failed = self._failed
                for peer, err in failed or [(self.peers[0], exc)]:
                    _tracer.tracer.transfer(
                        "transfer.failed", peer, ids or exc.request_ids, call="send", error=str(err)
                    )
                raise

    def _ship(self, ready: list[Export], ids: list[str], ident: BatchId, retry: bool) -> None:
        """Each rank its shard of every staged state as batch ``ident``, all ranks at once; raises unless all
        acknowledged (a rank that acknowledged before acknowledges a retry of ``ident`` again, landing nothing).
        ``retry``: the batch is in doubt, sent again."""
        mgr, tp = self._mgr, len(self.peers)
        self._failed = [], []
        with ReadingBatch(mgr, ids):  # before any rank's header: a failure is NothingSent, not in doubt
            # Over a wire that reads pieces each rank reads its shard's bytes where they lie: no copy here.
            pieces = export_pieces(self._transfers, ready, self._layout)
            if pieces is None:
                full = export_rows(mgr, ready)
                shards = [[s.contiguous() for s in self._layout.slice(full, tp, k)] for k in range(tp)]
        # One thread per rank: each waits for its rank's decision and acknowledgement on its own store client,
        # so a dead rank costs one timeout, not one per rank after it.
        with ThreadPoolExecutor(tp) as threads:
            if pieces is not None:
                fp = fingerprint(mgr.pool.spec.num_layers, self._layout.shard_spec(tp).shapes())
                outcomes = [
                    threads.submit(ship_messages, x, ids, fp, raw, ident)
                    for x, raw in zip(self._transfers, pieces, strict=True)
                ]
            else:
                outcomes = [
                    threads.submit(ship_rows, x, ids, rows, ident)
                    for x, rows in zip(self._transfers, shards, strict=True)
                ]
        failed: list[tuple[int, TransferError]] = []
        for x, outcome in zip(self._transfers, outcomes, strict=True):
            exc = outcome.exception()
            if isinstance(exc, TransferError):
                failed.append((x.peer, exc))
            elif exc is not None:
                raise exc
        self._failed = ids, failed  # traced by send() if the call raises
        if not failed:
            return
        what = f"{len(failed)} of {tp} ranks did not take their shards: {failed[0][1]}"
        errors = [err for _, err in failed]
        # No rank landed it: each refused it (a rank that landed an earlier try answers dup, never a refusal), or,
        # on a first try, each refused it or withdrew it before its go (on a retry a withdrawn rank may hold an
        # earlier try). Not in doubt then, and refused for room by every rank that refused, it is cut to the least
        # room, as a plain transfer's batch is. Else some rank may hold it: in doubt, sent again under the same
        # number (a rank that landed it answers dup).
        refusals = [e for e in errors if isinstance(e, TransferRefusedError)]
        withdrawn = [e for e in errors if isinstance(e, NothingSent)]
        if refusals and len(errors) == tp and len(refusals) + (0 if retry else len(withdrawn)) == tp:
            rooms = [e.room for e in refusals if e.reason == "room" and e.room is not None]
            if len(rooms) == len(refusals):
                raise TransferRefusedError(what, ids, "room", min(rooms))
            raise TransferRefusedError(what, ids, next((e.reason for e in refusals if e.reason != "room"), "room"))
        if len(errors) == tp and all(isinstance(e, NothingSent) for e in errors):
            raise NothingSent(what, ids)
        raise TransferError(what, ids)
