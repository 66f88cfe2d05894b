"""Fault injection: an executor that fails mid-flush loses nothing."""

from __future__ import annotations

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache._executors import resolve_executor
from mambacache._planner import Stage

from .conftest import fill_random, small_spec
from .oracle import SequentialOracle
from .strategies import events_from_ops, ops


class Flaky:
    """Delegates to a real executor and raises before the calls listed in `fail_at`."""

    name = "flaky"

    def __init__(self, inner: str, fail_at: set[int]) -> None:
        self.inner = resolve_executor(inner, torch.device("cpu"), 1 << 10)
        self.fail_at = fail_at
        self.calls = 0

    def execute(self, stage: Stage, tensor: torch.Tensor) -> None:
        self.calls += 1
        if self.calls in self.fail_at:
            raise MemoryError(f"injected fault at call {self.calls}")
        self.inner.execute(stage, tensor)


@pytest.mark.parametrize("inner", ["torch", "npu", "reference"])
@given(raw=ops, fail_at=st.sets(st.integers(1, 40), max_size=5), seed=st.integers(0, 99))
@settings(max_examples=60)
def test_faults_lose_nothing(inner: str, raw: list[tuple[str, int, int]], fail_at: set[int], seed: int) -> None:
    async def main() -> None:
        n = 8
        pool = mc.StatePool(small_spec(), n)
        flaky = Flaky(inner, fail_at)
        async with mc.CacheManager(pool, executor=flaky) as mgr:
            mgr.alloc(4)
            while True:
                try:
                    await mgr.flush()
                    break
                except mc.ExecutorError:
                    pass
            fill_random(pool, seed)
            oracle = SequentialOracle(pool)
            raw0 = [(k, 0 if k == "alloc" else a, b) for k, a, b in raw]
            for events, _ in events_from_ops(raw0, n, set(pool.allocated_slots())):
                for ev in events:
                    if isinstance(ev, mc.Alloc):
                        ev = mc.Alloc(mgr.alloc(1)[0])
                    else:
                        mgr.submit(ev)  # type: ignore[arg-type]
                    oracle.apply([ev])
                try:
                    await mgr.flush()
                except mc.ExecutorError as exc:
                    assert isinstance(exc.__cause__, MemoryError)
                    continue  # the work is kept; it runs first next time
                oracle.assert_matches(pool)
            flaky.fail_at = set()
        oracle.assert_matches(pool)  # leaving the context finished everything

    anyio.run(main)


@pytest.mark.anyio
async def test_failed_flush_raises_then_next_flush_completes() -> None:
    pool = mc.StatePool(small_spec(), 4)
    fill_random(pool, 0)
    flaky = Flaky("torch", {2})  # the zero stage fails on the second of three tensors
    async with mc.CacheManager(pool, executor=flaky) as mgr:
        a, b = mgr.alloc(2)
        with pytest.raises(mc.ExecutorError, match="kept") as info:
            await mgr.flush()
        assert isinstance(info.value.__cause__, MemoryError)
        assert bool((pool.tensors[0][:, [a, b]] == 0).all())
        assert not bool((pool.tensors[1][:, [a, b]] == 0).any())
        (c,) = mgr.alloc(1)
        report = await mgr.flush()
        assert report.resumed_stages == 1 and report.events == 1 and report.zeroed == 1
        assert all(bool((t[:, [a, b, c]] == 0).all()) for t in pool.tensors)
        assert flaky.calls == 2 + 2 + 3  # tensor 0 was not done twice


@pytest.mark.anyio
async def test_exit_flush_failure_does_not_mask_the_blocks_error() -> None:
    pool = mc.StatePool(small_spec(), 4)
    with pytest.raises(KeyError, match="the body's own error") as info:
        async with mc.CacheManager(pool, executor=Flaky("torch", {1})) as mgr:
            mgr.alloc(1)
            raise KeyError("the body's own error")
    notes = getattr(info.value, "__notes__", [""])
    assert "flush on leaving the block failed" in notes[0]
    # Without an error in the block, the exit flush's failure is raised.
    with pytest.raises(mc.ExecutorError):
        async with mc.CacheManager(mc.StatePool(small_spec(), 4), executor=Flaky("torch", {1})) as mgr:
            mgr.alloc(1)
