"""The obviously-correct reference: apply each event to a copy of the tensors, one at a time."""

from __future__ import annotations

from collections.abc import Iterable

import torch

import mambacache as mc


class SequentialOracle:
    def __init__(self, pool: mc.StatePool) -> None:
        self.tensors = [t.clone() for t in pool.tensors]
        self.allocated: set[int] = set(pool.allocated_slots())

    def apply(self, events: Iterable[mc.Alloc | mc.Clear | mc.CopyOnWrite | mc.Release]) -> None:
        for ev in events:
            if isinstance(ev, (mc.Alloc, mc.Clear)):
                for t in self.tensors:
                    t[:, ev.slot] = 0
                if isinstance(ev, mc.Alloc):
                    self.allocated.add(ev.slot)
            elif isinstance(ev, mc.CopyOnWrite):
                for t in self.tensors:
                    t[:, ev.dst] = t[:, ev.src].clone()
            elif isinstance(ev, mc.Release):
                self.allocated.discard(ev.slot)

    def write(self, slot: int, value: float) -> None:
        for t in self.tensors:
            t[:, slot] = value

    def assert_matches(self, pool: mc.StatePool) -> None:
        assert set(pool.allocated_slots()) == self.allocated
        for i, (want, got) in enumerate(zip(self.tensors, pool.tensors, strict=True)):
            for s in sorted(self.allocated):
                assert torch.equal(want[:, s], got[:, s]), f"tensor {i} slot {s} differs"
            # The padding slot is never written.
            assert torch.equal(want[:, 0], got[:, 0]), f"tensor {i} padding slot written"
