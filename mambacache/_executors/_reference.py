"""The reference executor: one slot at a time, obviously correct; the tests' oracle."""

from __future__ import annotations

import torch

from .._core._planner import CommitStage, CopyStage, HostStage, OffloadStage, RotateStage, ShiftStage, Stage, ZeroStage
from ._base import Executor, Progress

__all__ = ["ReferenceExecutor"]


class ReferenceExecutor(Executor):
    """Runs each stage one slot (one pair, one cycle) at a time with plain indexing: slow and obviously correct,
    the executor others are checked against (``executor="reference"``)."""

    name = "reference"

    def __init__(self, copy_workspace_bytes: int = 0) -> None:
        del copy_workspace_bytes  # one slot at a time needs no workspace bound
        self._progress = Progress()

    def execute_host(self, stage: HostStage, tensor: torch.Tensor, host: torch.Tensor) -> None:
        offload = type(stage) is OffloadStage
        for a, b in stage.pairs:
            if offload:
                host[:, b].copy_(tensor[:, a])
            else:
                tensor[:, b].copy_(host[:, a])

    def execute(self, stage: Stage, tensor: torch.Tensor, draft: torch.Tensor | None = None) -> None:
        if isinstance(stage, CommitStage):
            if draft is None:
                raise TypeError("a CommitStage needs the pool tensor's draft buffer")
            for src, pos, dst in stage.entries:
                tensor[:, dst].copy_(draft[:, src, pos])
        elif isinstance(stage, ZeroStage):
            for s in stage.slots:
                tensor[:, s].zero_()
        elif isinstance(stage, CopyStage):
            for s, d in stage.pairs:
                tensor[:, d].copy_(tensor[:, s])
        elif isinstance(stage, RotateStage):
            # One unit per cycle: clone every member, then write; a repeat after a
            # fault in the writes writes the same clones again.
            progress = self._progress
            unit, saved = progress.resume(stage, tensor)
            for k in range(unit, len(stage.cycles)):
                cycle = stage.cycles[k]
                if saved is None:
                    saved = [tensor[:, c].clone() for c in cycle]
                    progress.mark(k, saved)
                for i, old in enumerate(saved):
                    tensor[:, cycle[(i + 1) % len(cycle)]].copy_(old)
                saved = None
                progress.mark(k + 1)
        elif isinstance(stage, ShiftStage):
            # One unit per pair: clone the source's window, then write it shifted and
            # zero the end; a repeat after a fault in the writes writes the same clone.
            progress = self._progress
            unit, saved = progress.resume(stage, tensor)
            k, w = stage.shift, tensor.shape[-1]
            for u in range(unit, len(stage.pairs)):
                src, dst = stage.pairs[u]
                if saved is None:
                    saved = tensor[:, src, ..., k:].clone()
                    progress.mark(u, saved)
                tensor[:, dst, ..., : w - k].copy_(saved)
                tensor[:, dst, ..., w - k :].zero_()
                saved = None
                progress.mark(u + 1)
        else:
            raise TypeError(f"unknown stage {stage!r}")
