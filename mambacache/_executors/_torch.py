"""The torch executor: CPU and CUDA (any device with torch's foreach and index kernels).

Three paths for zero and copy stages, picked per stage and tensor (``path="auto"``),
or forced (``path="runs" | "index" | "direct"``):

* runs: one slice view per run of consecutive slots, ``t[:, a:b]``, zeroed or
  copied by one ``_foreach_zero_`` / ``_foreach_copy_`` over them. Each view is
  ``num_layers`` contiguous chunks, no index tensor, no temporary: memset/memcpy
  speed when chunks are large (CPU). On CPU a view of ``GRAIN`` elements or more
  is cut into pieces under it (``pieces`` in ``_base.py``), so that no op of the stage
  is an OpenMP parallel region. A stage of a few MiB or more (twice the crew's
  chunk) runs the way measured fastest for its shape (``large_stages="auto"``,
  ``_policy.py``): its pieces shared in chunks with the process's helper threads
  (``_crew.py``), its pieces on the calling thread, or one uncut view per run
  (each op a parallel region: fastest on a quiet host, many times slower with
  another process computing); a zero stage also one ``index_fill_`` per tensor.
  Single-slot views are cached;
* index: one ``index_fill_`` (zero) or ``index_select`` + ``index_copy_`` (copy)
  per tensor with host-built indices: one op whatever the slot count, but a
  copy gathers into a temporary (chunked to ``copy_workspace_bytes``), so every
  byte moves twice;
* direct: one ``_foreach_zero_`` / ``_foreach_copy_`` over the contiguous
  ``(layer, slot)`` rows of the stage, from a view table built once per tensor::

      t.view(L * (S + 1), *state).unbind(0)   rows[l * (S + 1) + s] == t[l, s]
      stage slots {a, b} -> [rows[a], rows[b], rows[S+1+a], rows[S+1+b], ...]
      one _foreach_copy_(dst rows, src rows): no index tensor, no temporary

  One aten op per stage and tensor whatever the slot and run count; on CUDA it
  is a multi-tensor-apply kernel (a launch per ~100 rows), with no host-to-device
  index copy at all.

The auto rule, from the interleaved CPU measurements in docs/benchmarks.md:
on CPU, runs when there are few runs (``max_runs``); else a zero or copy stage
runs when each run moves at least ``min_run_bytes`` (its pieces shared with the
crew: memset/memcpy speed quiet, faster than one parallel region per tensor
with another process computing), else index (tiny states, many runs: one op beats
many; with ``share_stages=False`` every zero stage of many runs); elsewhere,
direct (no temporary, constant op count).

Offload and restore stages on CPU (``execute_host``) take the runs path's views
on both sides, pool and host tensor alike, so a run at or past ``GRAIN``
elements is cut under it too (one ``_foreach_copy_`` per stage and tensor); a
large one runs the way its shape measured fastest, as a zero or copy stage does
(its pieces shared or not, or one strided op per run); one of ``MEMMOVE_BYTES``
or more that stays on the calling thread (one torch thread, or the crew's rule
keeps it) is one libc ``memmove`` per run and layer where both sides' layers are
contiguous blocks (0.7-0.9x the pieces' time on a staging copy here; no op for a
dispatch mode or profiler to see, so it is not taken under one); on
accelerators, ``copy_host``'s per-layer non-blocking ops.

Rotate stages (cycles) take the index path on every setting: one gather of all
members, then one scatter, so every member is read before any is written; the
gather is kept until its scatter is done (see ``Progress``). Shift stages do the
same on a conv tensor's time axis: gather ``t[..., k:]`` of the sources, scatter
it to ``t[..., :w - k]`` of the destinations and fill ``t[..., w - k:]`` with 0.
"""

from __future__ import annotations

import ctypes
import operator
import time
from collections.abc import Iterable

import torch

from .._core._errors import InvalidArgumentError
from .._core._planner import CommitStage, CopyStage, HostStage, OffloadStage, RotateStage, ShiftStage, Stage, ZeroStage
from ._base import GRAIN, Executor, IndexBuilder, Progress, copy_host, piece_size, pieces, row_width, stage_pairs
from ._crew import crew, unobserved
from ._policy import Policy

__all__ = ["PATHS", "TorchExecutor"]

PATHS = ("auto", "runs", "index", "direct")
# How a large CPU stage runs (``large_stages``): picked per stage shape from measured times, or one way always.
LARGE = ("auto", "crew", "inline", "whole")
_ZERO_WAYS = ("crew", "index", "whole")  # a zero stage's ways under "auto" (inline: index_fill_ beats it)
_WAYS = ("crew", "inline", "whole")  # a copy's and a host stage's
# A host stage on one thread from this many bytes on goes by ``memmove`` (``_memmove_runs``): under it, one
# foreach op costs less than a call per run and layer.
MEMMOVE_BYTES = 1 << 20
# Pool tensors whose views are cached: past it the oldest is dropped, and a pool with more tensors would
# rebuild its views every step.
_MAX_VIEWS = 1024


def _unbind(tensor: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """``tensor``'s rows over its first ``depth`` dims in row-major order, as views (any strides)."""
    rows = [tensor]
    for _ in range(depth):
        rows = [r for t in rows for r in t.unbind(0)]
    return rows


def _slot_bytes(tensor: torch.Tensor) -> int:
    """Bytes of one slot of a ``[layers, slots, ...]`` pool tensor, all layers."""
    return tensor.numel() // tensor.shape[1] * tensor.element_size()


def _alike(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Two cuts of the same logical bytes, both in (layer, slot, element) order, pair one to one when their
    pieces have the same shapes: a copy piece by piece is then exact (the dtypes match: each side's width is
    one of the distinct sizes of ``_base._WIDE``, or the tensors' own, checked equal)."""
    return len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b, strict=True))


class _Views:
    """Cached views of one pool tensor: each single slot's run-path views (lazily) and the ``(layer, slot)`` rows.

    A slot's views are ``[t[:, s]]`` (one op), or its pieces under the grain on CPU when that view has
    ``GRAIN`` elements or more (``split``). The piece table: for a tensor whose layers are each contiguous,
    every layer as one flat ``width`` view (``flats``), so that a run's pieces are slices of it, one view
    each, where cutting the block afresh makes five.
    """

    __slots__ = (
        "bases", "drafts", "flats", "row", "rows", "slot_bytes", "slots", "small", "split", "tensor", "wholes", "width",
    )  # fmt: skip

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.slot_bytes = tensor.shape[0] * tensor[0, 0].nbytes  # a slot's bytes, every layer
        self.slots: list[list[torch.Tensor] | None] = [None] * tensor.shape[1]
        self.wholes: list[torch.Tensor | None] | None = None  # each single slot as one uncut ``t[:, s]`` (lazily)
        self.rows: tuple[torch.Tensor, ...] | None = None
        self.drafts: dict[int, list[torch.Tensor]] = {}  # a draft buffer's pieces by slot * k + draft state
        cpu, slot = tensor.device.type == "cpu", tensor.shape[0] * tensor[0, 0].numel()
        self.split = cpu and slot >= GRAIN and tensor[0, 0].is_contiguous()
        # A slot under the grain: a run of several is cut slot by slot where its view reaches the grain.
        self.small = cpu and slot < GRAIN
        self.width = row_width(tensor) if self.split else tensor.dtype
        self.flats: list[torch.Tensor] | None = None
        self.row = 0  # one (layer, slot) row, in width elements
        # Per layer, the address of its slot 0 when its rows are one contiguous CPU block (``layer_bases``).
        self.bases: list[int] | bool | None = False  # False: not read yet
        if self.split and all(tensor[layer].is_contiguous() for layer in range(tensor.shape[0])):
            self.flats = [tensor[layer].view(-1).view(torch.uint8).view(self.width) for layer in range(tensor.shape[0])]
            self.row = self.flats[0].numel() // tensor.shape[1]

    def run(self, start: int, length: int) -> list[torch.Tensor]:
        """The views of slots ``start .. start + length - 1``, every layer: one strided view, or pieces."""
        if length == 1:
            views = self.slots[start]
            if views is None:
                views = self.slots[start] = self._build(start, 1)
            return views
        return self._build(start, length)

    def layer_bases(self) -> list[int] | None:
        """Per layer, the address of slot 0's row, where each layer's rows are one contiguous block of CPU memory
        (row ``s`` at ``base + s * row bytes``); else None. Read once: a pool's tensors are its for life."""
        if self.bases is False:
            t = self.tensor
            ok = t.device.type == "cpu" and all(t[layer].is_contiguous() for layer in range(t.shape[0]))
            self.bases = [t[layer].data_ptr() for layer in range(t.shape[0])] if ok else None
        return self.bases  # type: ignore[return-value]

    def whole(self, start: int, length: int) -> torch.Tensor:
        """Slots ``start .. start + length - 1``, every layer, as one uncut strided view; a single slot's from
        the cache (making a view costs about a tenth of copying a slot of a few hundred KiB)."""
        if length != 1:
            return self.tensor[:, start : start + length]
        wholes = self.wholes
        if wholes is None:
            wholes = self.wholes = [None] * self.tensor.shape[1]
        view = wholes[start]
        if view is None:
            view = wholes[start] = self.tensor[:, start]
        return view

    def _build(self, start: int, length: int) -> list[torch.Tensor]:
        t = self.tensor
        view = t[:, start] if length == 1 else t[:, start : start + length]
        if self.small and view.numel() >= GRAIN:  # one op would be a parallel region: one per slot instead
            return [v for s in range(start, start + length) for v in self.run(s, 1)]
        if not self.split or view.numel() < GRAIN:
            return [view]
        if self.flats is not None:  # the table: pieces(t[layer, start:start + length]), sliced from the flat
            n = self.row * length
            step = piece_size(n)
            a0 = self.row * start
            return [flat[a0 + a : a0 + min(a + step, n)] for flat in self.flats for a in range(0, n, step)]
        blocks = [t[layer, start : start + length] for layer in range(t.shape[0])]
        if not blocks[0].is_contiguous():  # paged: only each (layer, slot) row is contiguous
            blocks = [row for block in blocks for row in block.unbind(0)]
        return [p for block in blocks for p in pieces(block, self.width)]


def _run_views(stage: ZeroStage | CopyStage, entries: list[_Views], share: bool, slot_bytes: int | None = None) -> None:
    """The runs path of a whole stage: one ``_foreach_zero_`` / ``_foreach_copy_`` over every tensor's views of
    the runs. A cached single slot is read inline: a method call per run is a measurable part of a decode step,
    whose stages are a few single-slot runs of a few tensors. ``slot_bytes``: a slot's bytes over every entry,
    where the caller keeps it."""
    views: list[torch.Tensor] = []
    if type(stage) is ZeroStage:
        for entry in entries:
            cache = entry.slots
            for start, length in stage.runs:
                got = cache[start] if length == 1 else None
                views += got if got is not None else entry.run(start, length)
        if share and len(views) >= crew.min_views:  # a decode step's few views: not even the crew's call
            if slot_bytes is None:
                slot_bytes = sum(e.slot_bytes for e in entries)
            crew.run(views, nbytes=len(stage.slots) * slot_bytes)
        else:
            torch._foreach_zero_(views)
        return
    sources: list[torch.Tensor] = []
    for entry in entries:
        cache = entry.slots
        for src, dst, length in stage.runs:  # type: ignore[misc]
            a, b = (cache[src], cache[dst]) if length == 1 else (None, None)
            sources += a if a is not None else entry.run(src, length)
            views += b if b is not None else entry.run(dst, length)
    if share and len(views) >= crew.min_views:
        if slot_bytes is None:
            slot_bytes = sum(e.slot_bytes for e in entries)
        crew.run(views, sources, len(stage.pairs) * slot_bytes)  # type: ignore[union-attr]
    else:
        torch._foreach_copy_(views, sources)


def _whole_runs(stage: ZeroStage | CopyStage, entries: list[_Views]) -> None:
    """A zero or copy stage as one strided view per run and tensor, uncut: each op of ``GRAIN`` elements or
    more is an OpenMP parallel region (the way a large stage runs fastest on a quiet host)."""
    if isinstance(stage, ZeroStage):
        torch._foreach_zero_([e.whole(a, n) for e in entries for a, n in stage.runs])
        return
    runs = stage.runs
    dests = [e.whole(d, n) for e in entries for _, d, n in runs]
    torch._foreach_copy_(dests, [e.whole(s, n) for e in entries for s, _, n in runs])


class _Large:
    """How a large CPU stage runs (``large_stages``): one of its ways, always the one set or, under ``"auto"``,
    the one its :class:`Policy` picks from the times it measured."""

    __slots__ = ("indices", "policy", "setting")

    def __init__(self, setting: str, indices: IndexBuilder) -> None:
        self.setting, self.indices, self.policy = setting, indices, Policy()

    def way(self, key: tuple[str, int, int], nbytes: int) -> str | None:
        """How a CPU stage of ``nbytes`` bytes runs: None for the pieces' own rule (under the crew's size, or
        the crew closed: a mode, a profiler, one torch thread), else one of the ways."""
        if self.setting == "inline" or nbytes < 2 * crew.chunk_bytes or not crew.open():
            return None
        if self.setting != "auto":
            return self.setting
        return self.policy.pick(key, _ZERO_WAYS if key[0] == "zero" else _WAYS)

    def run_views(self, stage: ZeroStage | CopyStage, entries: list[_Views], slot_bytes: int | None = None) -> None:
        """The runs path of a whole stage over ``entries`` (the pool tensors' view caches), the way
        :meth:`way` picks; timed for the policy."""
        zero = type(stage) is ZeroStage
        share = self.setting != "inline"
        n = len(stage.slots) if zero else len(stage.pairs)  # type: ignore[union-attr]
        if slot_bytes is None:
            slot_bytes = sum(e.slot_bytes for e in entries)
        if share and (nbytes := n * slot_bytes) >= 2 * crew.chunk_bytes:
            key = ("zero" if zero else "copy", nbytes.bit_length(), len(stage.runs).bit_length())
            way = self.way(key, nbytes)
            if way is not None:
                t0 = time.perf_counter()
                if way == "whole":
                    _whole_runs(stage, entries)
                elif way == "index":
                    for entry in entries:
                        (idx,) = self.indices.get(stage, entry.tensor.device, stage.slots)  # type: ignore[union-attr]
                        entry.tensor.index_fill_(1, idx, 0)
                else:
                    _run_views(stage, entries, way == "crew", slot_bytes)
                if self.setting == "auto":
                    self.policy.record(key, way, time.perf_counter() - t0, nbytes)
                return
        _run_views(stage, entries, share, slot_bytes)

    def host(self, stage: HostStage, src: torch.Tensor, dst: torch.Tensor, read: _Views, write: _Views) -> None:
        """An offload or restore between CPU tensors ``src`` and ``dst`` (their view caches ``read``, ``write``),
        the way :meth:`way` picks; timed for the policy."""
        way = None
        nbytes = sum(n for _, _, n in stage.runs) * read.slot_bytes
        if self.setting != "inline":
            key = ("host", nbytes.bit_length(), len(stage.runs).bit_length())
            way = self.way(key, nbytes)
        if way is None:
            if nbytes < MEMMOVE_BYTES or not _memmove_runs(stage, src, read, write):
                _host_pieces(stage, src, dst, read, write, self.setting != "inline")
            return
        t0 = time.perf_counter()
        if way == "whole":  # one strided op per run, as copy_host makes it
            for a, b, n in stage.runs:
                write.whole(b, n).copy_(read.whole(a, n))
        elif way == "crew" or not _memmove_runs(stage, src, read, write):  # inline: as the inline setting's
            _host_pieces(stage, src, dst, read, write, way == "crew")
        if self.setting == "auto":
            self.policy.record(key, way, time.perf_counter() - t0, nbytes)


def _memmove_runs(stage: HostStage, src: torch.Tensor, read: _Views, write: _Views) -> bool:
    """A host stage on one thread as one ``memmove`` per run and layer (consecutive rows of a layer are one
    block on both sides), where both sides' layers are contiguous CPU blocks of the same row bytes; False,
    with nothing copied, where not, or where an observer must see every op (a Python dispatch or function
    mode other than a default-device context, a profiler: a fault or op-counting mode, a trace).

    Why not ``copy_``: ATen's CPU copy is a loop of vector loads and stores, and every store first reads its
    destination line; libc's ``memmove`` of a large block uses the CPU's string copy, which writes whole
    lines without reading them, and moved a staging-sized copy faster on this host (docs/benchmarks.md).
    """
    a_bases, b_bases = read.layer_bases(), write.layer_bases()
    if a_bases is None or b_bases is None or src.shape[2:] != write.tensor.shape[2:]:
        return False
    if not unobserved():
        return False
    row = src[0, 0].nbytes
    move = ctypes.memmove
    for a, b, n in stage.runs:
        size, da, db = n * row, a * row, b * row
        for pa, pb in zip(a_bases, b_bases, strict=True):
            move(pb + db, pa + da, size)
    return True


def _host_pieces(
    stage: HostStage, src: torch.Tensor, dst: torch.Tensor, read: _Views, write: _Views, share: bool
) -> None:
    """A host stage's runs as pieces under the grain on both sides, shared with the crew (``share``) or on
    the calling thread; a run whose two sides are not cut alike, one strided op."""
    sources: list[torch.Tensor] = []
    dests: list[torch.Tensor] = []
    for a, b, n in stage.runs:
        got, put = read.run(a, n), write.run(b, n)
        if n > 1 and not _alike(got, put):  # a paged side cuts a run row by row: go slot by slot
            got = [v for i in range(n) for v in read.run(a + i, 1)]
            put = [v for i in range(n) for v in write.run(b + i, 1)]
        if not _alike(got, put) and read.split and write.split:
            # Another row width on each side (a paged pool's rows start at narrower offsets): both cut in
            # the narrower one, which divides the wider, slot by slot and row by row, as a commit's are.
            width = min(read.width, write.width, key=lambda dt: dt.itemsize)
            layers = range(src.shape[0])
            got = [p for i in range(n) for layer in layers for p in pieces(src[layer, a + i], width)]
            put = [p for i in range(n) for layer in layers for p in pieces(dst[layer, b + i], width)]
        if _alike(got, put):
            sources += got
            dests += put
        else:
            dst[:, b : b + n].copy_(src[:, a : a + n])
    if dests:
        if share:
            crew.run(dests, sources)
        else:
            torch._foreach_copy_(dests, sources)


class TorchExecutor(Executor):
    name = "torch"

    def __init__(
        self,
        copy_workspace_bytes: int = 64 << 20,
        *,
        min_run_bytes: int = 8 << 10,
        max_runs: int = 4,
        path: str = "auto",
        share_stages: bool = True,
        large_stages: str = "auto",
    ) -> None:
        """``share_stages``: a CPU stage of a few MiB or more may leave the calling thread; False keeps every
        op of every stage on it. ``large_stages``, how such a stage runs on the runs path (zero, copy) and
        offload or restore: ``"auto"`` picks per stage shape from measured times (``_policy.py``) between its
        pieces shared with the crew's helper threads (``_crew.py``), its pieces on the calling thread, one
        strided op per run (each an OpenMP parallel region) and, for a zero stage, one ``index_fill_`` per
        tensor; ``"crew"``, ``"inline"`` or ``"whole"`` always the one."""
        if path not in PATHS:
            raise InvalidArgumentError(f"path must be one of {PATHS}, got {path!r}")
        if large_stages not in LARGE:
            raise InvalidArgumentError(f"large_stages must be one of {LARGE}, got {large_stages!r}")
        self.copy_workspace_bytes = copy_workspace_bytes
        self.min_run_bytes = min_run_bytes
        self.max_runs = max_runs
        self.path = path
        self.share_stages = share_stages
        self.large_stages = large_stages if share_stages else "inline"
        self._indices = IndexBuilder()
        self._large = _Large(self.large_stages, self._indices)
        self.policy = self._large.policy  # the measured times of "auto"
        self._progress = Progress()
        # id(tensor) -> its views; the entry holds the tensor, so the id stays its own.
        self._views: dict[int, _Views] = {}
        # The last all-CPU group of tensors a whole stage ran on, their views and a slot's bytes over all of
        # them (:meth:`_cpu_group`).
        self._group: tuple[list[torch.Tensor], list[_Views], int] = ([], [], 0)

    def _copy(self, dests: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        """One copy of CPU views in any order (a host stage, a commit): shared with the crew if large."""
        if self.share_stages:
            crew.run(dests, sources)
        else:
            torch._foreach_copy_(dests, sources)

    # -- views ---------------------------------------------------------------
    def _entry(self, tensor: torch.Tensor) -> _Views:
        entry = self._views.get(id(tensor))
        if entry is None or entry.tensor is not tensor:
            # A manager hands over its pool tensors, one per state and layer group (a from_layers pool of
            # separate layers: states x layers), every step; scratch ones (probes) come and go.
            if len(self._views) >= _MAX_VIEWS:
                self._views.pop(next(iter(self._views)))
            entry = self._views[id(tensor)] = _Views(tensor)
        return entry

    def _runs(self, tensor: torch.Tensor, runs: Iterable[tuple[int, int]]) -> list[torch.Tensor]:
        """The views of ``tensor[:, start:start + length]`` for each run (:meth:`_Views.run`); single slots
        from the cache (a view costs about as much as a small op, and decode steps are mostly single-slot runs)."""
        entry = self._entry(tensor)
        out: list[torch.Tensor] = []
        for start, length in runs:
            out += entry.run(start, length)
        return out

    def _rows(self, tensor: torch.Tensor, slots: list[int] | tuple[int, ...], depth: int = 2) -> list[torch.Tensor]:
        """The contiguous ``tensor[l, s]`` rows of ``slots``, every layer.

        ``depth=3`` reads a draft buffer ``[layers, slots + 1, k, *state]`` as
        ``[layers, (slots + 1) * k, *state]``: "slot" ``s * k + j`` is draft state ``j`` of ``s``.
        """
        entry = self._entry(tensor)
        if entry.rows is None:
            if tensor.is_contiguous():
                entry.rows = tensor.view(-1, *tensor.shape[depth:]).unbind(0)
            else:  # paged: each (layer, slot) row is contiguous, the rows are not evenly spaced
                entry.rows = tuple(_unbind(tensor, depth))
        rows, stride = entry.rows, len(entry.rows) // tensor.shape[0]
        return [rows[base + s] for base in range(0, len(rows), stride) for s in slots]

    def _commit_views(
        self, stage: CommitStage, tensor: torch.Tensor, draft: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A commit's destinations and sources on CPU: one strided view per slot (every layer at once), as the
        runs path does (a call per row costs more than the copy of a small row), or, for a view of ``GRAIN``
        elements or more, its rows in pieces under the grain, cut alike on both sides."""
        entry = self._entry(tensor)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        k = draft.shape[2]
        if not entry.split or not draft[0, 0, 0].is_contiguous():
            whole = self._entry(draft).drafts  # one strided view per (slot, draft state), every layer
            for src, pos, dst in stage.entries:
                dsts += entry.run(dst, 1) if not entry.split else [tensor[:, dst]]
                got = whole.get(src * k + pos)
                if got is None:
                    got = whole[src * k + pos] = [draft[:, src, pos]]
                srcs += got
            return dsts, srcs
        width = min(entry.width, row_width(draft, 3), key=lambda dt: dt.itemsize)
        # The draft's pieces per (slot, draft state), cached on its entry as a slot's views are on the pool's.
        cache = self._entry(draft).drafts if width == entry.width else {}
        for src, pos, dst in stage.entries:
            if width == entry.width:
                dsts += entry.run(dst, 1)
            else:
                dsts += [p for layer in range(tensor.shape[0]) for p in pieces(tensor[layer, dst], width)]
            got = cache.get(src * k + pos)
            if got is None:
                got = cache[src * k + pos] = [
                    p for layer in range(draft.shape[0]) for p in pieces(draft[layer, src, pos], width)
                ]
            srcs += got
        return dsts, srcs

    # -- the rule ------------------------------------------------------------
    def _choose(self, tensor: torch.Tensor, slots: int, runs: int, zero: bool = False) -> str:
        if self.path != "auto":
            return self.path
        if tensor.device.type != "cpu":
            return "direct"
        if runs <= self.max_runs:
            return "runs"
        if zero and not self.share_stages:
            # On the calling thread alone, pieces under the grain run at about 0.6 of memset on a quiet host;
            # one index_fill_ per tensor (one parallel region) at memset speed (docs/benchmarks.md, "Contention").
            # Shared with the crew, the pieces are at memset speed quiet and faster with another process computing.
            return "index"
        if slots * _slot_bytes(tensor) >= runs * self.min_run_bytes:
            return "runs"
        return "index"

    def execute_stage(self, stage: Stage, tensors: list[torch.Tensor]) -> bool:
        """A zero or copy stage on every pool tensor with one foreach op; False to go tensor by tensor.

        Only for stages that are idempotent (a repeat after a fault is harmless), on
        the runs and direct paths: it halves the ops of a decode step, whose stages
        touch a few slots of a few tensors.

        One function because it is the whole choice for one stage, path by path
        (runs, direct zero, direct copy), each branch one foreach op over the
        views it gathers; split, each piece would re-derive the same path set.
        """
        kind = type(stage)
        few = (kind is ZeroStage or kind is CopyStage) and self.path == "auto" and len(stage.runs) <= self.max_runs  # type: ignore[union-attr]
        if few and (group := self._cpu_group(tensors)) is not None:  # few runs on CPU tensors (a decode step)
            self._large.run_views(stage, group[1], group[2])  # type: ignore[arg-type]
            return True
        if isinstance(stage, ZeroStage):
            slots, runs = len(stage.slots), len(stage.runs)
        elif isinstance(stage, CopyStage):
            slots, runs = len(stage.pairs), len(stage.runs)
        else:
            return False
        if self.path == "auto" and runs <= self.max_runs:
            # Few runs (a decode step): the rule does not depend on the tensor's size.
            path = "runs" if tensors[0].is_cpu else "direct"
        else:
            zero = isinstance(stage, ZeroStage)
            paths = {self._choose(t, slots, runs, zero) for t in tensors}
            if len(paths) != 1:
                return False
            (path,) = paths
        if path == "index":
            return False
        views: list[torch.Tensor] = []
        if path == "direct":
            if isinstance(stage, ZeroStage):
                for t in tensors:
                    views += self._rows(t, stage.slots)
                torch._foreach_zero_(views)
                return True
            srcs, dsts = stage_pairs(stage)
            sources: list[torch.Tensor] = []
            for t in tensors:
                views += self._rows(t, dsts)
                sources += self._rows(t, srcs)
            torch._foreach_copy_(views, sources)
            return True
        self._large.run_views(stage, [self._entry(t) for t in tensors])  # type: ignore[arg-type]
        return True

    def _cpu_group(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[_Views], int] | None:
        """``tensors``, their view caches and a slot's bytes over all of them, when all are on the CPU; else
        None. The last group is kept: a manager's flushes hand over the same pool tensors every step, found
        again with one identity check. The group is returned, not read back from ``_group`` by the caller:
        another manager's flush on another thread may replace it in between (an executor given to two)."""
        group = self._group
        key = group[0]
        if key and len(key) == len(tensors) and all(map(operator.is_, key, tensors)):
            return group
        if not all(t.is_cpu for t in tensors):
            return None
        entries = [self._entry(t) for t in tensors]
        group = self._group = (list(tensors), entries, sum(e.slot_bytes for e in entries))
        return group

    def execute_host(self, stage: HostStage, tensor: torch.Tensor, host: torch.Tensor) -> None:
        """An offload or restore on CPU tensors: one ``_foreach_copy_`` over both sides' run views, each cut
        under the grain as the runs path cuts them (:meth:`_Views.run`), so that no op is an OpenMP parallel
        region waiting on a competing process; single slots from the cache. A run whose two sides are not cut
        alike (a paged side, another row width) is one strided op, as :func:`copy_host` makes it; so is
        every run on an accelerator (``copy_host``'s per-layer non-blocking ops). Reads one side and writes
        the other: a repeat after a fault is harmless."""
        if not (tensor.is_cpu and host.is_cpu and tensor.dtype == host.dtype):
            copy_host(stage, tensor, host)
            return
        src, dst = (tensor, host) if type(stage) is OffloadStage else (host, tensor)
        read, write = self._entry(src), self._entry(dst)
        self._large.host(stage, src, dst, read, write)

    def execute(self, stage: Stage, tensor: torch.Tensor, draft: torch.Tensor | None = None) -> None:
        if isinstance(stage, CommitStage):
            # One foreach copy from the draft buffer into the slots, every layer: no index
            # tensor and no temporary on any device (sources and destinations are
            # different tensors, so any order is exact and a repeat is harmless).
            if draft is None:
                raise TypeError("a CommitStage needs the pool tensor's draft buffer")
            k = draft.shape[2]
            dsts = [dst for _, _, dst in stage.entries]
            if self._choose(tensor, len(dsts), len(dsts)) == "direct":
                srcs = [src * k + pos for src, pos, _ in stage.entries]
                torch._foreach_copy_(self._rows(tensor, dsts), self._rows(draft, srcs, depth=3))
            else:
                self._copy(*self._commit_views(stage, tensor, draft))
        elif isinstance(stage, (ZeroStage, CopyStage)):
            # The runs and direct paths are the whole-stage ones, on this one tensor;
            # what they decline takes the index path.
            if self.execute_stage(stage, [tensor]):
                return
            if isinstance(stage, ZeroStage):
                (idx,) = self._indices.get(stage, tensor.device, stage.slots)
                tensor.index_fill_(1, idx, 0)
                return
            # Sources and destinations of a copy stage are disjoint: any order is
            # exact, a repeat after a fault is harmless, and the gathers can be chunked.
            srcs, dsts = stage_pairs(stage)
            src_idx, dst_idx = self._indices.get(stage, tensor.device, srcs, dsts)
            n = len(srcs)
            chunk = max(1, self.copy_workspace_bytes // _slot_bytes(tensor))
            for c0 in range(0, n, chunk):
                part = slice(c0, c0 + chunk)
                tensor.index_copy_(1, dst_idx[part], tensor.index_select(1, src_idx[part]))
        elif isinstance(stage, RotateStage):
            # One gather of every member, then one scatter: read before write. The
            # gather is kept until the scatter is done, so a repeat after a fault
            # in between scatters the same values instead of rotating twice.
            unit, saved = self._progress.resume(stage, tensor)
            if unit == 0:
                srcs, dsts = stage_pairs(stage)
                src_idx, dst_idx = self._indices.get(stage, tensor.device, srcs, dsts)
                if saved is None:
                    saved = tensor.index_select(1, src_idx)
                    self._progress.mark(0, saved)
                tensor.index_copy_(1, dst_idx, saved)
                self._progress.mark(1)
        elif isinstance(stage, ShiftStage):
            self._shift(stage, tensor)
        else:
            raise TypeError(f"unknown stage {stage!r}")

    def _shift(self, stage: ShiftStage, tensor: torch.Tensor) -> None:
        """A shift stage on a conv tensor (time last): one gather of the sources' last ``w - k`` positions, kept
        until both writes (the shifted window, the zeroed end) are done, as a rotate's gather is, since a pair
        may shift a slot in place. Two strided in-place ops, no padded temporary."""
        unit, saved = self._progress.resume(stage, tensor)
        if unit == 0:
            srcs, dsts = stage_pairs(stage)
            src_idx, dst_idx = self._indices.get(stage, tensor.device, srcs, dsts)
            k, w = stage.shift, tensor.shape[-1]
            if saved is None:
                saved = tensor[..., k:].index_select(1, src_idx)
                self._progress.mark(0, saved)
            tensor[..., : w - k].index_copy_(1, dst_idx, saved)
            tensor[..., w - k :].index_fill_(1, dst_idx, 0)
            self._progress.mark(1)
