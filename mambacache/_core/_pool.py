"""StatePool: the slot tensors and the free list.

Layout of each pool tensor (one per conv shape, the temporal tensor, one per extra)::

    dim 0: layer   dim 1: slot (0 = padding)   dims 2..: the per-slot state
    +---------+---------+---------+-----+-------------------+------------------+
    | L0 s0   | L0 s1   | L0 s2   | ... | L0 s(num_slots)   | L0 pads (k - 1)  |   <- one row per layer,
    +---------+---------+---------+-----+-------------------+------------------+      slots contiguous
    | L1 s0   | L1 s1   | ...                                                  |      inside the row
    +---------+---------+------------------------------------------------------+

``pad_slots=k`` padding slots: slot 0 and ``num_slots + 1 .. num_slots + k - 1``
(none of the latter by default), so the live slots stay ``1..num_slots``.

``t[l, a:b]`` is contiguous; ``t[:, a:b]`` is ``num_layers`` contiguous chunks,
one per layer, which is what the executors coalesce runs of slots into.

An engine's tensors adopted with :meth:`StatePool.from_tensors` may instead be
*paged*: only each ``(layer, slot)`` row is contiguous, because the engine keeps
every state of a block in one page (vLLM: a mamba layer's conv and SSM state
share the block's page, conv first)::

    one layer's storage, block (slot) pages one after another
    +------------------------------+------------------------------+-----
    | page of slot 0               | page of slot 1               | ...
    | conv[l, 0] | temporal[l, 0]  | conv[l, 1] | temporal[l, 1]  |
    +------------------------------+------------------------------+-----
    conv:     [L, S + 1, *conv]      strides (.., page, contiguous inside a row)
    temporal: [L, S + 1, *temporal]  strides (.., page, contiguous inside a row)

Every executor but the npu one takes paged tensors (``t[l, s]`` views, index
ops and strided slices); the npu executor refuses them, since an Ascend op
adapter would copy each strided input into a contiguous temporary. An extra
tensor (``StateSpec.extra_shapes``, e.g. an int8 state's per-slot scales) has the
same layout, so every executor carries it with the slot as one more tensor.

:meth:`StatePool.from_layers` adopts a tensor per layer instead, ``[S + 1, *state]``
each, allocated anywhere: the executors get one ``[layers, S + 1, *state]`` tensor
per *layer group* (consecutive layers that are one strided view of one storage,
:mod:`mambacache._core._layout`), so ``exec_tensors`` has ``len(layer_groups)`` tensors
per state, and ``tensors`` exists only when that is one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._backlog import Backlog
from ._errors import InvalidArgumentError, PoolAllocationError
from ._layout import layer_args, layer_groups, stack_group
from ._ledger import SlotLedger
from ._spec import StateSpec
from ._torchutil import as_device, executor_view, failure_reason
from ._validate import as_slot, check_count, check_instance, check_positive_int

__all__ = ["StatePool"]


def _with_drafts(given: Any, draft_tokens: int | None) -> StateSpec:
    check_instance("spec", given, StateSpec)
    spec: StateSpec = given
    if draft_tokens is None or draft_tokens == spec.draft_tokens:
        return spec
    check_count("draft_tokens", draft_tokens)
    return dataclasses.replace(spec, draft_tokens=draft_tokens)


def _check_pads(pad_slots: object) -> None:
    if type(pad_slots) is not int or pad_slots < 1:
        raise InvalidArgumentError(f"pad_slots must be an int >= 1 (slot 0 is always one), got {pad_slots!r}")


def _named_extras(
    extra: Mapping[str, torch.Tensor] | None,
    draft_extra: Mapping[str, torch.Tensor] | None,
    draft_temporal: torch.Tensor | None,
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """``from_tensors``' extras and their draft buffers as ``(what, tensor)`` lists; checks their keys only."""
    extra = {} if extra is None else extra
    if not isinstance(extra, Mapping) or (draft_extra is not None and not isinstance(draft_extra, Mapping)):
        raise InvalidArgumentError("extra and draft_extra must be mappings of name -> tensor")
    if draft_extra is not None and draft_temporal is None:
        raise InvalidArgumentError("draft_extra needs the state tensors' draft buffers (draft_conv, draft_temporal)")
    if (draft_extra is not None and set(draft_extra) != set(extra)) or (
        draft_temporal is not None and extra and draft_extra is None
    ):
        raise InvalidArgumentError(f"with draft buffers, give draft_extra for each extra tensor: {sorted(extra)}")
    drafts = [(f"draft_extra[{n!r}]", draft_extra[n]) for n in extra] if draft_extra is not None else []
    return [(f"extra[{n!r}]", t) for n, t in extra.items()], drafts


def _check_adopted(
    conv: Sequence[torch.Tensor],
    temporal: torch.Tensor,
    draft_conv: Sequence[torch.Tensor] | None,
    draft_temporal: torch.Tensor | None,
    extras: tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]] = ([], []),
    overlap: bool = True,
) -> None:
    """:meth:`StatePool.from_tensors`' checks of the engine's tensors, all before anything is built.

    One function because every check reads the same numbered tensor list (and
    its names for the messages) and the overlap check needs all of them.
    """
    if isinstance(conv, torch.Tensor) or not isinstance(conv, Sequence):
        raise InvalidArgumentError(f"conv must be a sequence of tensors, got {type(conv).__name__}")
    if (draft_conv is None) != (draft_temporal is None):
        raise InvalidArgumentError("give draft_conv and draft_temporal together, or neither")
    if isinstance(draft_conv, torch.Tensor) or (draft_conv is not None and len(draft_conv) != len(conv)):
        raise InvalidArgumentError(f"draft_conv must be a sequence of {len(conv)} tensors, one per conv")
    drafts = [*draft_conv, draft_temporal] if draft_conv is not None and draft_temporal is not None else []
    extra, draft_extra = extras
    # (name for messages, tensor, least ndim, whether dims 0-1 must equal temporal's): drafts are checked below.
    named = [(f"conv[{i}]", c, 3, True) for i, c in enumerate(conv)] + [("temporal", temporal, 3, True)]
    named += [(f"draft buffer {i}", d, 3, False) for i, d in enumerate(drafts)]
    named += [(what, t, 2, True) for what, t in extra] + [(what, t, 2, False) for what, t in draft_extra]
    for what, t, ndim, rows in named:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim < ndim:
            raise InvalidArgumentError(f"{what} must be [num_layers, num_slots + 1, *state], got {tuple(t.shape)}")
        if not t.is_contiguous() and not t[0, 0].is_contiguous():
            raise InvalidArgumentError(
                f"{what} must hold each (layer, slot) row contiguously (a view with strides {t.stride()} does not)"
            )
        if t.requires_grad:
            raise InvalidArgumentError(f"{what} requires grad: state tensors are written in place")
        if t.device != temporal.device:
            raise InvalidArgumentError(f"{what} is on {t.device}, temporal on {temporal.device}")
        if rows and t.shape[:2] != temporal.shape[:2]:
            raise InvalidArgumentError(
                f"{what} has {tuple(t.shape[:2])} (layers, slots + 1), temporal {tuple(temporal.shape[:2])}"
            )
    if temporal.shape[1] < 2:
        raise InvalidArgumentError("tensors need at least 2 slots along dim 1 (slot 0 is padding)")
    pairs = [(f"draft_conv[{i}]", d, t) for i, (d, t) in enumerate(zip(drafts, conv, strict=False))]
    pairs += [("draft_temporal", drafts[-1], temporal)] if drafts else []
    if draft_extra:  # one per extra, in the same order (_named_extras)
        pairs += [(what, d, t) for (what, d), (_, t) in zip(draft_extra, extra, strict=True)]
    for what, d, t in pairs:
        if d.ndim != t.ndim + 1 or d.shape[:2] != t.shape[:2] or d.shape[3:] != t.shape[2:] or d.dtype != t.dtype:
            raise InvalidArgumentError(
                f"{what} is {tuple(d.shape)} {d.dtype}; [num_layers, num_slots + 1, draft_tokens, *state] of"
                f" its state tensor {tuple(t.shape)} {t.dtype} expected"
            )
        if d.shape[2] != drafts[-1].shape[2] or d.shape[2] < 1:
            raise InvalidArgumentError("every draft buffer needs the same draft_tokens (at least 1)")
    if len({c.dtype for c in conv}) > 1:
        raise InvalidArgumentError(f"conv tensors must share one dtype, got {[c.dtype for c in conv]}")
    clash = _first_overlap([t for _, t, _, _ in named]) if overlap else None
    if clash is not None:
        i, j = clash
        what = f"pool tensors {named[i][0]} and {named[j][0]}" if i != j else f"the rows of {named[i][0]}"
        raise InvalidArgumentError(f"{what} overlap in memory")


def _footprint(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The byte addresses where ``t``'s ``(layer, slot)`` rows start, and the bytes of one row.

    A contiguous tensor is one span (one row of all its bytes); a paged one (an
    engine's block pages, each holding several states, see :meth:`StatePool.from_tensors`)
    is ``layers * slots`` rows, one per ``t[l, s]``.
    """
    size = t.element_size()
    if t.is_contiguous():
        return torch.tensor([t.data_ptr()], dtype=torch.int64), t.numel() * size
    layers = torch.arange(t.shape[0], dtype=torch.int64) * (t.stride(0) * size)
    slots = torch.arange(t.shape[1], dtype=torch.int64) * (t.stride(1) * size)
    return (t.data_ptr() + layers[:, None] + slots[None, :]).reshape(-1), t[0, 0].numel() * size


def _first_overlap(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """Two tensors (or one, twice) with bytes in common, as indices into ``tensors``; None if none.

    Exact for paged tensors too: every row is an interval, and intervals sorted
    by start are disjoint exactly when each ends before the next one starts.
    One sort on the host, once, when a pool is adopted.
    """
    starts, ends, owners = [], [], []
    for i, t in enumerate(tensors):
        row_starts, row_bytes = _footprint(t)
        if row_bytes == 0:
            continue
        starts.append(row_starts)
        ends.append(row_starts + row_bytes)
        owners.append(torch.full_like(row_starts, i))
    if not starts:
        return None
    start, order = torch.sort(torch.cat(starts), stable=True)
    end, owner = torch.cat(ends)[order], torch.cat(owners)[order]
    clash = torch.nonzero(end[:-1] > start[1:])
    if clash.numel() == 0:
        return None
    k = int(clash[0, 0])
    i, j = int(owner[k]), int(owner[k + 1])
    return min(i, j), max(i, j)


def _stacked(
    spec: StateSpec,
    conv: Sequence[torch.Tensor],
    temporal: torch.Tensor,
    draft_conv: Sequence[torch.Tensor] | None,
    draft_temporal: torch.Tensor | None,
    extra: Mapping[str, torch.Tensor] | None,
    draft_extra: Mapping[str, torch.Tensor] | None,
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Stacked ``[num_layers, ...]`` tensors as :meth:`StatePool._init`'s kinds: one layer group each. Extras
    in the spec's (name) order, since tensors are matched by position everywhere else."""
    kinds = [[c] for c in conv] + [[temporal]] + [[extra[n]] for n in spec.extra_shapes if extra]
    if draft_temporal is None:
        return kinds, []
    drafts = [[d] for d in draft_conv or []] + [[draft_temporal]]
    return kinds, drafts + [[draft_extra[n]] for n in spec.extra_shapes if draft_extra]


def _adopt_layers(
    conv: Any, temporal: Any, draft_conv: Any, draft_temporal: Any, extra: Any, draft_extra: Any
) -> tuple[StateSpec, list[list[torch.Tensor]], list[list[torch.Tensor]], tuple[tuple[int, int], ...]]:
    """:meth:`StatePool.from_layers`' checks and layer groups: each group is checked as ``from_tensors``
    checks its tensors, the groups against the first (shapes, dtypes), then every layer's rows for overlap."""
    states, draft_args = layer_args(conv, temporal, draft_conv, draft_temporal, extra, draft_extra)
    groups = layer_groups([layers for _, layers in states + draft_args])
    kinds = [[stack_group(layers, a, b) for a, b in groups] for _, layers in states]
    drafts = [[stack_group(layers, a, b) for a, b in groups] for _, layers in draft_args]
    nconv, names = len(states) - 1 - len(extra or {}), list(extra or {})
    for j, (a, b) in enumerate(groups):
        at = kinds[nconv][j]
        d = [k[j] for k in drafts]
        try:
            extras = (
                [(what, kinds[nconv + 1 + i][j]) for i, (what, _) in enumerate(states[nconv + 1 :])],
                [(what, d[nconv + 1 + i]) for i, (what, _) in enumerate(draft_args[nconv + 1 :])],
            )
            _check_adopted([k[j] for k in kinds[:nconv]], at, d[:nconv] if d else None, d[nconv] if d else None,
                           extras, overlap=False)  # fmt: skip
        except InvalidArgumentError as exc:
            where = f"layers {a}..{b - 1}" if b - a > 1 else f"layer {a}"
            raise InvalidArgumentError(f"{where}: {exc}") from None
        for (what, _), k in zip(states + draft_args, kinds + drafts, strict=True):
            first, mine = k[0], k[j]
            if mine.shape[1:] != first.shape[1:] or mine.dtype != first.dtype or mine.device != first.device:
                raise InvalidArgumentError(
                    f"{what}: layer {a} is {tuple(mine.shape[1:])} {mine.dtype} on {mine.device}, layer 0"
                    f" {tuple(first.shape[1:])} {first.dtype} on {first.device}; a pool has one shape, dtype and"
                    " device per state"
                )
    named = [
        (f"layer {i}'s {what}", layer[None]) for what, layers in states + draft_args for i, layer in enumerate(layers)
    ]
    overlap = _first_overlap([t for _, t in named])
    if overlap is not None:
        i, j = overlap
        raise InvalidArgumentError(
            f"{named[i][0]} and {named[j][0]} overlap in memory" if i != j else f"the rows of {named[i][0]} overlap"
        )
    temp = kinds[nconv][0]
    spec = StateSpec(
        num_layers=len(states[nconv][1]),
        conv_shapes=[tuple(k[0].shape[2:]) for k in kinds[:nconv]],
        temporal_shape=tuple(temp.shape[2:]),
        conv_dtype=kinds[0][0].dtype if nconv else torch.bfloat16,
        temporal_dtype=temp.dtype,
        draft_tokens=drafts[nconv][0].shape[2] if drafts else 0,
        extra_shapes={n: (tuple(k[0].shape[2:]), k[0].dtype) for n, k in zip(names, kinds[nconv + 1 :], strict=True)},
    )
    return spec, kinds, drafts, groups


class StatePool:
    """Per-layer conv and temporal state (and any extra tensors) for ``num_slots`` slots plus ``pad_slots``
    padding slots.

    Invariants: the padding slots (``pad_ids``: slot 0, then any after slot
    ``num_slots``) are never handed out or written by mambacache, so a padded
    batch position (CUDA-graph capture) writes only its own dummy row; every slot in
    ``1..num_slots`` is either free or allocated, never both; the free list hands
    out the lowest free slots first, so allocations stay in coalescable runs.

    Surface: O(1) figures are attributes and properties (``num_slots``,
    ``num_free``, ``num_available``, ``num_allocated``, ``unfinished``, ``device``,
    ``spec``, ``pad_slots``, ``pad_ids``); what
    walks the slots is a method (``allocated_slots()``, ``is_allocated(slot)``).

    The core drives three more attributes, which engines leave alone: ``ledger``
    (held slots and tenants, :class:`~mambacache._core._ledger.SlotLedger`),
    ``backlog`` (device work a failed flush left) and ``exec_tensors`` /
    ``exec_drafts`` (what executors are handed: the same storage as ``tensors``
    and ``draft_tensors``, as integer views where a dtype needs one, one tensor
    per state and layer group, the first ``exec_convs`` the conv states'), with
    ``layer_groups`` (the layer ranges ``(start, stop)`` of the groups: one
    range but for a :meth:`from_layers` pool whose layers are apart) and
    ``exec_split`` (a host pool's tensors cut into the same groups).

    ``extra`` / ``draft_extra`` map each name of ``spec.extra_shapes`` to its
    tensor (and draft buffer); they are in ``tensors`` / ``draft_tensors`` after
    the temporal one, so every event moves them with the slot.
    """

    def __init__(
        self,
        spec: StateSpec,
        num_slots: int,
        device: str | torch.device = "cpu",
        *,
        draft_tokens: int | None = None,
        pad_slots: int = 1,
    ) -> None:
        spec = _with_drafts(spec, draft_tokens)
        check_positive_int("num_slots", num_slots)
        _check_pads(pad_slots)
        dev = as_device(device)
        rows = (spec.num_layers, num_slots + pad_slots)
        drafts = (spec.num_layers, num_slots + pad_slots, spec.draft_tokens)
        total = spec.memory_bytes * (num_slots + pad_slots)
        try:
            if num_slots + pad_slots >= 2**63:  # torch's sizes are int64: past them it raises a bare TypeError
                raise MemoryError("more slots than a tensor can index")
            conv = [torch.zeros(*rows, *shape, dtype=spec.conv_dtype, device=dev) for shape in spec.conv_shapes]
            temporal = torch.zeros(*rows, *spec.temporal_shape, dtype=spec.temporal_dtype, device=dev)
            extra = {n: torch.zeros(*rows, *shape, dtype=d, device=dev) for n, (shape, d) in spec.extra_shapes.items()}
            draft_conv: list[torch.Tensor] = []
            draft_temporal: torch.Tensor | None = None
            draft_extra: dict[str, torch.Tensor] = {}
            if spec.draft_tokens:
                draft_conv = [
                    torch.zeros(*drafts, *shape, dtype=spec.conv_dtype, device=dev) for shape in spec.conv_shapes
                ]
                draft_temporal = torch.zeros(*drafts, *spec.temporal_shape, dtype=spec.temporal_dtype, device=dev)
                draft_extra = {
                    n: torch.zeros(*drafts, *shape, dtype=d, device=dev) for n, (shape, d) in spec.extra_shapes.items()
                }
        except (RuntimeError, MemoryError) as exc:  # torch reports out-of-memory and size overflow as these
            raise PoolAllocationError(
                f"could not allocate a pool of {num_slots} slots ({total:,} bytes) on {dev}: {failure_reason(exc)}"
            ) from None
        self._init(spec, *_stacked(spec, conv, temporal, draft_conv, draft_temporal, extra, draft_extra), pad_slots)

    def _init(
        self,
        spec: StateSpec,
        kinds: list[list[torch.Tensor]],
        drafts: list[list[torch.Tensor]],
        pad_slots: int = 1,
        groups: tuple[tuple[int, int], ...] | None = None,
    ) -> None:
        """``kinds``: per pool tensor (the conv ones, temporal, the extras in ``spec`` order), its tensor per
        layer group (one ``[num_layers, ...]`` tensor for a stacked pool); ``drafts`` the same for the draft
        buffers, or empty."""
        self.spec = spec
        self.layer_groups: tuple[tuple[int, int], ...] = groups or ((0, spec.num_layers),)
        self._kinds = kinds
        self._drafts = drafts
        temporal = kinds[len(spec.conv_shapes)][0]
        self.num_slots = temporal.shape[1] - pad_slots
        self.pad_slots = pad_slots
        # Slot 0, then the rows after the live slots: never handed out, never written by mambacache.
        self.pad_ids = (0, *range(self.num_slots + 1, self.num_slots + pad_slots))
        self.device = temporal.device
        # What executors are handed: the same storage, as integer views where needed, one tensor per pool
        # tensor and layer group (pool-tensor major), the conv states' first.
        self.exec_tensors = [executor_view(t) for groups_of in kinds for t in groups_of]
        self.exec_drafts = [executor_view(t) for groups_of in drafts for t in groups_of]
        self.exec_convs = len(spec.conv_shapes) * len(self.layer_groups)
        self.ledger = SlotLedger(self.num_slots)  # held slots and tenants; driven by the manager under its lock
        self.backlog = Backlog()

    @classmethod
    def from_tensors(
        cls,
        conv: Sequence[torch.Tensor],
        temporal: torch.Tensor,
        *,
        draft_conv: Sequence[torch.Tensor] | None = None,
        draft_temporal: torch.Tensor | None = None,
        extra: Mapping[str, torch.Tensor] | None = None,
        draft_extra: Mapping[str, torch.Tensor] | None = None,
        pad_slots: int = 1,
    ) -> StatePool:
        """Adopt engine-owned ``[num_layers, num_slots + 1, *state]`` tensors: same storage, no copy.

        Validated: every tensor has at least 3 dims and holds each
        ``(layer, slot)`` row contiguously (the whole tensor contiguous, or paged:
        see the module docstring; rows may interleave with other tensors' rows,
        as in vLLM's block pages), all on one
        device, with the same ``num_layers`` and ``num_slots + 1`` (at least 2), the
        conv tensors share one dtype, no two overlap in memory, and none requires
        grad. Slot 0 of each is padding: mambacache never hands it out or writes
        it, so an engine that indexes from 0 keeps 0 as its dummy slot.

        ``draft_conv`` / ``draft_temporal`` adopt the engine's speculative-decoding
        buffers too (SGLang's intermediate conv windows and SSM states):
        ``[num_layers, num_slots + 1, draft_tokens, *state]``, matching the state
        tensors' shapes and dtypes, given together.

        ``extra`` adopts named per-slot tensors of any dtype and of at least 2
        dims, ``[num_layers, num_slots + 1, *shape]`` (an fp8 or int8 state's
        scales, which engines keep apart from the state), as
        ``StateSpec.extra_shapes``; with draft buffers, ``draft_extra`` gives
        theirs, ``[num_layers, num_slots + 1, draft_tokens, *shape]``, same names.

        ``pad_slots=k``: the last ``k - 1`` slots along dim 1 are padding too (see
        :class:`StatePool`), for an engine that reserved dummy rows there.
        """
        extras = _named_extras(extra, draft_extra, draft_temporal)
        _check_adopted(conv, temporal, draft_conv, draft_temporal, extras)
        _check_pads(pad_slots)
        if temporal.shape[1] - pad_slots < 1:
            raise InvalidArgumentError(
                f"{temporal.shape[1]} slots along dim 1 leave no live slot beside {pad_slots} padding slot(s)"
            )
        adopted = dict(extra or {})
        spec = StateSpec(
            num_layers=temporal.shape[0],
            conv_shapes=[tuple(c.shape[2:]) for c in conv],
            temporal_shape=tuple(temporal.shape[2:]),
            conv_dtype=conv[0].dtype if conv else torch.bfloat16,
            temporal_dtype=temporal.dtype,
            draft_tokens=draft_temporal.shape[2] if draft_temporal is not None else 0,
            extra_shapes={n: (tuple(t.shape[2:]), t.dtype) for n, t in adopted.items()},
        )
        pool = cls.__new__(cls)
        pool._init(spec, *_stacked(spec, conv, temporal, draft_conv, draft_temporal, adopted, draft_extra), pad_slots)
        return pool

    @classmethod
    def from_layers(
        cls,
        conv: Sequence[Sequence[torch.Tensor]] | None = None,
        temporal: Sequence[torch.Tensor] = (),
        *,
        draft_conv: Sequence[Sequence[torch.Tensor]] | None = None,
        draft_temporal: Sequence[torch.Tensor] | None = None,
        extra: Mapping[str, Sequence[torch.Tensor]] | None = None,
        draft_extra: Mapping[str, Sequence[torch.Tensor]] | None = None,
        pad_slots: int = 1,
    ) -> StatePool:
        """Adopt engine-owned per-layer tensors as one pool: same storage, no copy, one ledger, one plan.

        ``conv[layer]`` lists layer ``layer``'s conv tensors (``None``: no conv
        state), ``temporal[layer]`` is its temporal tensor, each
        ``[num_slots + 1, *state]``, allocated anywhere on one device; each
        ``(slot)`` row contiguous (paged rows as in :meth:`from_tensors`). ``extra``
        maps a name to its per-layer tensors, ``draft_conv`` / ``draft_temporal`` /
        ``draft_extra`` give the draft buffers per layer, ``[num_slots + 1,
        draft_tokens, *state]``. Checked as :meth:`from_tensors` checks its
        tensors, every layer alike (one shape and dtype per state across layers),
        and no two rows of any layers overlap.

        Consecutive layers that are one strided view of one storage are run as
        one tensor (a *layer group*, :mod:`mambacache._core._layout`): a stage is one
        op per group and pool tensor, or one foreach over all of them. Evenly
        spaced layers (one allocation cut into layers) cost what a stacked pool
        costs; separately allocated ones one row view per layer in each op.
        :attr:`layers` returns the adopted tensors; :attr:`tensors` only when
        the layers form one group.
        """
        spec, kinds, drafts, groups = _adopt_layers(conv, temporal, draft_conv, draft_temporal, extra, draft_extra)
        _check_pads(pad_slots)
        if kinds[0][0].shape[1] - pad_slots < 1:
            raise InvalidArgumentError(
                f"{kinds[0][0].shape[1]} slots leave no live slot beside {pad_slots} padding slot(s)"
            )
        pool = cls.__new__(cls)
        pool._init(spec, kinds, drafts, pad_slots, groups)
        return pool

    @classmethod
    def from_memory_budget(
        cls,
        spec: StateSpec,
        budget_bytes: int,
        device: str | torch.device = "cpu",
        *,
        draft_tokens: int | None = None,
        pad_slots: int = 1,
    ) -> StatePool:
        """As many slots as fit in ``budget_bytes``, the padding slots and draft buffers included."""
        spec = _with_drafts(spec, draft_tokens)
        check_count("budget_bytes", budget_bytes)
        _check_pads(pad_slots)
        num_slots = budget_bytes // spec.memory_bytes - pad_slots
        if num_slots < 1:
            raise InvalidArgumentError(
                f"budget of {budget_bytes} bytes holds no usable slot (one slot is {spec.memory_bytes} bytes with"
                f" its {spec.draft_tokens} draft state(s), and the {pad_slots} padding slot(s) take as many)"
            )
        return cls(spec, num_slots, device, pad_slots=pad_slots)

    @property
    def draft_tokens(self) -> int:
        """Draft states kept per slot (0: no speculative decoding buffers)."""
        return self.spec.draft_tokens

    @property
    def num_free(self) -> int:
        """Slots free at the end of the event queue (O(1))."""
        return self.ledger.num_free

    @property
    def num_available(self) -> int:
        """Slots a request can allocate now (O(1)): ``num_free`` less the slots a reservation
        (``PrefixCache(..., reserved=k)``) keeps free for its tenant; ``num_free`` without one."""
        return self.ledger.available(None)

    @property
    def num_allocated(self) -> int:
        """Slots held at the end of the event queue (O(1)); ``num_free + num_allocated == num_slots``."""
        return self.num_slots - self.ledger.num_free

    def is_allocated(self, slot: int) -> bool:
        """Whether ``slot`` is held at the end of the event queue.

        ``slot`` is checked as the manager checks slots (numpy and 0-d CPU tensor
        ints taken): a bool, a float, a str or a slot outside ``1..num_slots``
        raises :class:`InvalidSlotError`, as :meth:`HostPool.is_held` does.
        """
        if type(slot) is not int or not 0 < slot <= self.num_slots:
            slot = as_slot(slot, self.num_slots)
        return self.ledger.is_held(slot)

    def allocated_slots(self) -> list[int]:
        """The held slots, ascending: a method, since it walks every slot (``CacheManager.held`` adds tenants)."""
        return list(self.ledger.held_by())

    @property
    def unfinished(self) -> int:
        """Stages of device work a failed flush left for the next flush (or the next manager) to run first."""
        return len(self.backlog)

    def discard_unfinished(self) -> int:
        """Drop the unfinished work; returns how many stages were dropped.

        The last resort when the executor that started the work can never finish
        it: the slots it would have written hold unspecified content afterwards,
        so release them, or clear them before use. Refused while a manager is open.
        """
        if self.ledger.owner is not None:
            raise InvalidArgumentError("discard_unfinished() while a CacheManager is open on this pool")
        return self.backlog.clear()

    def __repr__(self) -> str:
        return (
            f"StatePool(num_slots={self.num_slots}, num_free={self.num_free}, device={self.device},"
            f" slot_bytes={self.spec.slot_bytes}, pad_slots={self.pad_slots})"
        )

    # -- the tensors as the public attributes read them, from the layer groups: stacked [num_layers, ...] tensors
    # where the layers are one group, per-layer views on every pool --------------------------------------------
    def _stack(self, kinds: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        if len(self.layer_groups) > 1 and kinds:
            raise InvalidArgumentError(
                f"this pool's layers are {len(self.layer_groups)} separate tensors (StatePool.from_layers, layer"
                f" groups {list(self.layer_groups)}), not one [num_layers, ...] tensor each: use pool.layers"
            )
        return [k[0] for k in kinds]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every pool tensor, ``[num_layers, num_slots + 1, *state]``: the conv tensors, the temporal tensor,
        then the extra tensors in ``spec`` order. A :meth:`from_layers` pool whose layers are not one strided
        view each raises :class:`InvalidArgumentError` (:attr:`layers` has them)."""
        return self._stack(self._kinds)

    @property
    def draft_tensors(self) -> list[torch.Tensor]:
        """Every draft buffer, matching :attr:`tensors`: the conv ones, the temporal one, the extras' (empty
        without)."""
        return self._stack(self._drafts)

    @property
    def conv(self) -> list[torch.Tensor]:
        """The conv tensors, one per ``spec.conv_shapes`` (as :attr:`tensors`)."""
        return self.tensors[: len(self.spec.conv_shapes)]

    @property
    def temporal(self) -> torch.Tensor:
        """The temporal tensor (as :attr:`tensors`)."""
        return self.tensors[len(self.spec.conv_shapes)]

    @property
    def extra(self) -> dict[str, torch.Tensor]:
        """Each name of ``spec.extra_shapes`` -> its tensor (as :attr:`tensors`)."""
        return dict(zip(self.spec.extra_shapes, self.tensors[len(self.spec.conv_shapes) + 1 :], strict=True))

    @property
    def draft_conv(self) -> list[torch.Tensor]:
        """The conv tensors' draft buffers (empty without)."""
        return self.draft_tensors[: len(self.spec.conv_shapes)]

    @property
    def draft_temporal(self) -> torch.Tensor | None:
        """The temporal tensor's draft buffer, or None."""
        return self.draft_tensors[len(self.spec.conv_shapes)] if self._drafts else None

    @property
    def draft_extra(self) -> dict[str, torch.Tensor]:
        """Each extra's draft buffer, by name (empty without)."""
        drafts = self.draft_tensors[len(self.spec.conv_shapes) + 1 :]
        return dict(zip(self.spec.extra_shapes, drafts, strict=True)) if drafts else {}

    @property
    def layers(self) -> list[list[torch.Tensor]]:
        """Every pool tensor (in :attr:`tensors`' order) as its layers, ``[num_slots + 1, *state]`` views, on
        any pool (a :meth:`from_layers` pool's are the tensors it adopted)."""
        return [[v for t in groups_of for v in t.unbind(0)] for groups_of in self._kinds]

    @property
    def draft_layers(self) -> list[list[torch.Tensor]]:
        """Every draft buffer (in :attr:`draft_tensors`' order) as its layers (empty without)."""
        return [[v for t in groups_of for v in t.unbind(0)] for groups_of in self._drafts]

    def exec_split(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Stacked ``[num_layers, ...]`` tensors matching :attr:`tensors` (a host pool's) cut into this pool's
        layer groups, so they match :attr:`exec_tensors` by position."""
        if len(self.layer_groups) == 1:
            return tensors
        return [t[a:b] for t in tensors for a, b in self.layer_groups]
