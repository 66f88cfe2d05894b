"""StatePool: the slot tensors and the free list.

Layout of each pool tensor (one per conv shape, plus the temporal tensor)::

    dim 0: layer   dim 1: slot (0 = padding)   dims 2..: the per-slot state
    +---------+---------+---------+-----+-------------------+
    | L0 s0   | L0 s1   | L0 s2   | ... | L0 s(num_slots)   |   <- one row per layer,
    +---------+---------+---------+-----+-------------------+      slots contiguous
    | L1 s0   | L1 s1   | ...                               |      inside the row
    +---------+---------+-----------------------------------+

``t[l, a:b]`` is contiguous; ``t[:, a:b]`` is ``num_layers`` contiguous chunks,
one per layer, which is what the executors coalesce runs of slots into.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import torch

from ._errors import InvalidArgumentError, PoolExhaustedError
from ._spec import StateSpec

__all__ = ["StatePool"]


class StatePool:
    """Per-layer conv and temporal state for ``num_slots`` slots plus padding slot 0.

    Invariants: slot 0 is never handed out or written by mambacache; every slot in
    ``1..num_slots`` is either free or allocated, never both; the free list hands
    out the lowest free slots first, so allocations stay in coalescable runs.
    """

    def __init__(self, spec: StateSpec, num_slots: int, device: str | torch.device = "cpu") -> None:
        if not isinstance(spec, StateSpec):
            raise InvalidArgumentError(f"spec must be a StateSpec, got {type(spec).__name__}")
        if type(num_slots) is not int or num_slots < 1:
            raise InvalidArgumentError(f"num_slots must be a positive int, got {num_slots!r}")
        self.spec = spec
        self.num_slots = num_slots
        self.device = torch.device(device)
        rows = (spec.num_layers, num_slots + 1)
        self.conv: list[torch.Tensor] = [
            torch.zeros(*rows, *shape, dtype=spec.conv_dtype, device=self.device) for shape in spec.conv_shapes
        ]
        self.temporal: torch.Tensor = torch.zeros(
            *rows, *spec.temporal_shape, dtype=spec.temporal_dtype, device=self.device
        )
        self._free: list[int] = list(range(1, num_slots + 1))  # a heap; sorted is a valid heap
        self._allocated = bytearray(num_slots + 1)
        self._manager: object | None = None  # the open CacheManager driving this pool, if any

    @classmethod
    def from_memory_budget(cls, spec: StateSpec, budget_bytes: int, device: str | torch.device = "cpu") -> StatePool:
        """As many slots as fit in ``budget_bytes``, the padding slot included."""
        if type(budget_bytes) is not int or budget_bytes < 0:
            raise InvalidArgumentError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        num_slots = budget_bytes // spec.slot_bytes - 1
        if num_slots < 1:
            raise InvalidArgumentError(
                f"budget of {budget_bytes} bytes holds no usable slot (one slot is {spec.slot_bytes} bytes,"
                " and the padding slot takes one)"
            )
        return cls(spec, num_slots, device)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every pool tensor: the conv tensors, then the temporal tensor."""
        return [*self.conv, self.temporal]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_allocated(self, slot: int) -> bool:
        return 0 < slot <= self.num_slots and bool(self._allocated[slot])

    def allocated_slots(self) -> list[int]:
        return [s for s in range(1, self.num_slots + 1) if self._allocated[s]]

    # Bookkeeping below is driven by the CacheManager, which validates first.
    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhaustedError(f"asked for {n} slots, {len(self._free)} of {self.num_slots} are free")
        slots = [heapq.heappop(self._free) for _ in range(n)]
        for s in slots:
            self._allocated[s] = 1
        return slots

    def _give_back(self, slots: Iterable[int]) -> None:
        for s in slots:
            self._allocated[s] = 0
            heapq.heappush(self._free, s)

    def __repr__(self) -> str:
        return (
            f"StatePool(num_slots={self.num_slots}, num_free={self.num_free}, device={self.device},"
            f" slot_bytes={self.spec.slot_bytes})"
        )
