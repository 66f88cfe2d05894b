"""The decode row of ``mambacache bench``: the async decode step against the one op it issues, and the floor.

Three loops alternate in one run, on one pool:

* the step: 2 releases of finished requests, 2 allocs for new ones and 2 forks
  of a cached prefix into them (``copy_on_write``), then ``await mgr.flush()``;
* the op: what such a step cannot do without, the one ``_foreach_copy_`` of its
  copy stage over views built beforehand, and one anyio checkpoint;
* the floor: the same step through :class:`BareManager`, the least a manager
  written in Python does for it (below).

The floor is there so that the step's ratio to its op (the aim: within 1.5x)
can be read against what any Python manager costs on the same machine, in the
same run: the floor alone is about 1.5x of the op.
"""

from __future__ import annotations

import statistics
import time
from heapq import heappop, heappush
from typing import Any

import anyio
import torch

from .._core._pool import StatePool
from .._core._spec import StateSpec
from .._manager import CacheManager


class BareManager:
    """The floor of a decode step in Python: what any manager must do for it, and nothing else.

    A held bit per slot, a heap of free slots, the step's events as tuples, one dict of
    copies and one of clears at the flush, one foreach op per stage over views
    built once. No lock, no tenants, no reservation, no trace, no report, no
    fault handling, and only *plain* steps: no copy reads a slot the same step
    wrote. Its steps leave the pool exactly as :class:`CacheManager`'s do
    (``tests/tools/test_bench.py`` checks it), so its time is a fair floor, not a
    stand-in that skips work.
    """

    __slots__ = ("_free", "_held", "_log", "_views")

    def __init__(self, pool: StatePool) -> None:
        n = pool.num_slots
        self._held = bytearray(n + 1)
        self._free = list(range(1, n + 1))  # a heap: the lowest free slot first, as the manager's ledger
        self._log: list[tuple[Any, ...]] = []
        self._views = [[t[:, s] for s in range(n + 1)] for t in pool.exec_tensors]

    def alloc(self, n: int) -> list[int]:
        free = self._free
        if len(free) < n:
            raise MemoryError(f"{n} slots wanted, {len(free)} free")
        slots = [heappop(free) for _ in range(n)]
        held = self._held
        for s in slots:
            held[s] = 1
        self._log.append((True, slots))
        return slots

    def release_many(self, slots: list[int]) -> None:
        held = self._held
        for s in slots:
            if not held[s]:
                raise ValueError(f"slot {s} is not held")
        free = self._free
        for s in slots:
            held[s] = 0
            heappush(free, s)

    def copy_on_write(self, src: int, dst: int) -> None:
        held = self._held
        if not (held[src] and held[dst]):
            raise ValueError(f"copy {src} -> {dst}: a slot is not held")
        self._log.append((False, src, dst))

    async def flush(self) -> int:
        log, self._log = self._log, []
        zero: dict[int, None] = {}
        copies: dict[int, int] = {}
        for e in log:
            if e[0]:
                for s in e[1]:
                    zero[s] = None
                    copies.pop(s, None)
            else:
                zero.pop(e[2], None)
                copies[e[2]] = e[1]
        views = self._views
        if copies:
            torch._foreach_copy_([v[d] for v in views for d in copies], [v[s] for v in views for s in copies.values()])
        if zero:
            torch._foreach_zero_([v[s] for v in views for s in zero])
        return len(log)


def decode_pool() -> StatePool:
    """The decode row's pool: small states, so that the host's work is what is timed."""
    return StatePool(StateSpec(num_layers=4, conv_shapes=[(4, 2)], temporal_shape=(2, 2)), 64)


def decode_flush(repeats: int, steps: int = 400) -> dict[str, float]:
    """Medians (and minima) in microseconds of the step, the op and the floor, alternating after warm-up.

    ``steps`` alternations, or 20 per repeat; ``ratio`` is the step over the op,
    ``floor_ratio`` the floor over the op. Each manager has a pool of its own.
    """
    n = max(steps, repeats * 20)

    async def main() -> tuple[list[int], list[int], list[int]]:
        flush: list[int] = []
        bare: list[int] = []
        floor: list[int] = []
        pool = decode_pool()
        async with CacheManager(pool) as mgr:
            (prefix,) = mgr.alloc(1, "prefix")
            running = mgr.alloc(8)
            spare = mgr.alloc(2)  # the bare op's two destinations, never flushed over
            await mgr.flush()
            low = BareManager(decode_pool())
            (low_prefix,) = low.alloc(1)
            low_running = low.alloc(8)
            await low.flush()
            tensors = pool.exec_tensors
            dsts = [t[:, s] for t in tensors for s in spare]
            srcs = [t[:, prefix] for t in tensors for _ in spare]
            clock, checkpoint, copy = time.perf_counter_ns, anyio.lowlevel.checkpoint, torch._foreach_copy_
            for _ in range(n + 20):
                t0 = clock()
                mgr.release_many(running[:2])
                new = mgr.alloc(2)
                mgr.copy_on_write(prefix, new[0])
                mgr.copy_on_write(prefix, new[1])
                await mgr.flush()
                t1 = clock()
                copy(dsts, srcs)
                await checkpoint()
                t2 = clock()
                low.release_many(low_running[:2])
                low_new = low.alloc(2)
                low.copy_on_write(low_prefix, low_new[0])
                low.copy_on_write(low_prefix, low_new[1])
                await low.flush()
                t3 = clock()
                flush.append(t1 - t0)
                bare.append(t2 - t1)
                floor.append(t3 - t2)
                running = running[2:] + new
                low_running = low_running[2:] + low_new
        return flush[20:], bare[20:], floor[20:]

    flush, bare, floor = anyio.run(main)
    f, b, lo = (statistics.median(x) / 1e3 for x in (flush, bare, floor))
    return {"flush_us": f, "flush_min_us": min(flush) / 1e3, "op_us": b, "op_min_us": min(bare) / 1e3,
            "floor_us": lo, "floor_min_us": min(floor) / 1e3, "ratio": f / b, "floor_ratio": lo / b}  # fmt: skip
