"""The torch executor: CPU and CUDA.

Two strategies, picked per stage and tensor:

* runs: one slice op per run of consecutive slots, ``t[:, a:b].zero_()`` or
  ``t[:, d:d+n].copy_(t[:, s:s+n])``. Each op streams ``num_layers`` contiguous
  chunks with no index tensor and no temporary, which reaches memset/memcpy speed
  when the chunks are large (CPU), but costs one launch per run;
* index: one ``index_fill_`` (zero) or ``index_select`` + ``index_copy_`` (copy,
  rotate) per tensor, with host-built indices: one launch whatever the slot count,
  the better choice for many small runs and on GPUs. Copy gathers are chunked to
  ``copy_workspace_bytes`` (at least one slot); a rotate is gathered whole, and
  the gather is kept until its scatter is done (see ``Progress``).
"""

from __future__ import annotations

import torch

from .._planner import CopyStage, RotateStage, Stage, ZeroStage
from ._base import IndexBuilder, Progress, stage_pairs

__all__ = ["TorchExecutor"]


def _slot_bytes(tensor: torch.Tensor) -> int:
    """Bytes of one slot of a ``[layers, slots, ...]`` pool tensor, all layers."""
    return tensor.numel() // tensor.shape[1] * tensor.element_size()


class TorchExecutor:
    name = "torch"

    def __init__(
        self, copy_workspace_bytes: int = 64 << 20, *, min_run_bytes: int = 64 << 10, max_runs: int = 4
    ) -> None:
        # Runs are used when each slice op moves at least `min_run_bytes` (CPU:
        # per-op overhead is then a few percent) or there are few of them.
        self.copy_workspace_bytes = copy_workspace_bytes
        self.min_run_bytes = min_run_bytes
        self.max_runs = max_runs
        self._indices = IndexBuilder()
        self._progress = Progress()
        # id(tensor) -> (tensor, its single-slot views); the tensor is held, so the id stays its own.
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor | None]]] = {}

    def _use_runs(self, tensor: torch.Tensor, slots: int, runs: int) -> bool:
        if runs <= self.max_runs:
            return True
        if tensor.device.type != "cpu":
            return False
        return slots * _slot_bytes(tensor) >= runs * self.min_run_bytes

    def _slot(self, tensor: torch.Tensor, slot: int) -> torch.Tensor:
        """``tensor[:, slot]`` as a cached view: making a view costs about as much as a small op,
        and decode steps are mostly single-slot runs. Built lazily, one per slot touched."""
        entry = self._views.get(id(tensor))
        if entry is None or entry[0] is not tensor:
            if len(self._views) >= 16:  # a manager hands over a few pool tensors; scratch ones come and go
                self._views.pop(next(iter(self._views)))
            entry = self._views[id(tensor)] = (tensor, [None] * tensor.shape[1])
        views = entry[1]
        view = views[slot]
        if view is None:
            view = views[slot] = tensor[:, slot]
        return view

    def _run(self, tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
        return self._slot(tensor, start) if length == 1 else tensor[:, start : start + length]

    def execute(self, stage: Stage, tensor: torch.Tensor) -> None:
        if isinstance(stage, ZeroStage):
            if self._use_runs(tensor, len(stage.slots), len(stage.runs)):
                run = self._run
                torch._foreach_zero_([run(tensor, r.start, r.length) for r in stage.runs])
            else:
                (idx,) = self._indices.get(stage, tensor.device, stage.slots)
                tensor.index_fill_(1, idx, 0)
        elif isinstance(stage, CopyStage) and self._use_runs(tensor, len(stage.pairs), len(stage.runs)):
            # Sources and destinations of a copy stage are disjoint: runs never overlap.
            run = self._run
            torch._foreach_copy_(
                [run(tensor, c.dst, c.length) for c in stage.runs], [run(tensor, c.src, c.length) for c in stage.runs]
            )
        elif isinstance(stage, CopyStage):
            srcs, dsts = stage_pairs(stage)
            src_idx, dst_idx = self._indices.get(stage, tensor.device, srcs, dsts)
            # Disjoint sources and destinations: gathers are chunked to stay within
            # copy_workspace_bytes, and a repeat after a fault is harmless.
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
        else:
            raise TypeError(f"unknown stage {stage!r}")
