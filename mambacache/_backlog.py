"""Backlog: device work taken from the event queue and not finished yet.

It belongs to the pool, not to the manager, so that it outlives the manager that
started it: a manager whose last flush failed leaves its work here, and the next
manager opened on the same pool runs it before anything newer.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import torch

from ._executors import Executor
from ._planner import Stage

__all__ = ["Backlog"]


class Backlog:
    """Stages still to run, oldest first, each with the executor that runs it (and the host tensors of
    an offload or restore stage, so the work outlives the manager and its host pool argument).

    Invariants: only the head stage can be partly done, and only up to tensor
    ``next_tensor`` (tensors before it are done); the head runs on the executor
    recorded with it, which may hold the saved reads of a half-done rotate
    (see ``Progress``), so it is never handed to another executor.
    """

    __slots__ = ("next_tensor", "stages")

    def __init__(self) -> None:
        self.stages: collections.deque[tuple[Stage, Executor, list[torch.Tensor] | None]] = collections.deque()
        self.next_tensor = 0

    def __len__(self) -> int:
        return len(self.stages)

    def push(self, stages: Iterable[Stage], executor: Executor, host: list[torch.Tensor] | None = None) -> None:
        self.stages.extend((stage, executor, host) for stage in stages)

    def clear(self) -> int:
        """Drop every stage; returns how many there were."""
        n = len(self.stages)
        self.stages.clear()
        self.next_tensor = 0
        return n
