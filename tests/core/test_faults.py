"""Fault injection: a failure at any aten op, on any executor, loses nothing.

The class of test that finds half-written rotates: every variant of every
executor (each chunking level of the npu workspace included) runs a step with a
fault raised before its k-th aten op, with ``MemoryError``, ``RuntimeError`` and
``KeyboardInterrupt``; then one good flush must leave exactly what
one-event-at-a-time execution leaves.

Which k: every op of the step under ``MAMBACACHE_FULL_SWEEP=1``, as CI runs it
(about two minutes, most of it the npu variants with the smallest workspaces);
by default a deterministic sample of at most 24 (the first and last three and an
even spread between, ``tests/support/sweep.py``) on every variant and scenario, a few
seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache._executors._npu import NpuExecutor
from mambacache._executors._torch import TorchExecutor
from mambacache.testing import FailingExecutor, SequentialOracle, fail_at_op

from ..support.strategies import events_from_ops, shift_ops
from ..support.sweep import fault_points
from ..support.util import SPEC, VARIANTS, drive, fill_random, flush_with_fault, kinds_for, small_spec, sweep_pool


def swap_via_temp(mgr: mc.CacheManager, slots: list[int]) -> None:
    """The issue's example: swap a and b through t, then release t: one rotate stage."""
    a, b, t = slots[:3]
    mgr.submit(mc.CopyOnWrite(a, t), mc.CopyOnWrite(b, a), mc.CopyOnWrite(t, b), mc.Release(t))


def mixed_step(mgr: mc.CacheManager, slots: list[int]) -> None:
    """Every stage kind in one step: a copy wave, two 2-cycles, and zeros.

    Final values: a=B b=A c=E d=E e=D f=0 g=A h=0; (a b) and (d e) rotate, g and c
    are copied first (they read a and e before the rotate writes them).
    """
    a, b, c, d, e, f, g, h = slots[:8]
    mgr.submit(
        mc.CopyOnWrite(a, g),
        mc.CopyOnWrite(a, h),
        mc.CopyOnWrite(h, h),
        mc.CopyOnWrite(b, a),
        mc.CopyOnWrite(g, b),
        mc.CopyOnWrite(e, c),
        mc.CopyOnWrite(d, e),
        mc.Clear(f),
    )
    mgr.copy_on_write(c, d)
    mgr.clear(h)


def three_cycle(mgr: mc.CacheManager, slots: list[int]) -> None:
    """a <- c, c <- b, b <- a through a temporary that is then released: one 3-cycle."""
    a, b, c, t = slots[:4]
    mgr.submit(mc.CopyOnWrite(a, t), mc.CopyOnWrite(c, a), mc.CopyOnWrite(b, c), mc.CopyOnWrite(t, b), mc.Release(t))


def shifted_step(mgr: mc.CacheManager, slots: list[int]) -> None:
    """Shifted copies among plain ones and clears: in place (not idempotent: a repeat would shift twice), a
    chain that reads a slot shifted earlier in the step, a plain copy of a shifted slot, a shifted swap.

    Stages: copy (a->g), shift (a a, b b, c->d), shift (d->e), copy (e->f), zero (c), shift (g->h), shift (h->g).
    """
    a, b, c, d, e, f, g, h = slots[:8]
    mgr.submit(
        mc.CopyOnWrite(a, g),
        mc.CopyOnWrite(a, a, shift=1),
        mc.CopyOnWrite(b, b, shift=1),
        mc.CopyOnWrite(c, d, shift=1),
        mc.CopyOnWrite(d, e, shift=1),
        mc.CopyOnWrite(e, f),
        mc.Clear(c),
    )
    mgr.copy_many([g, h], [h, g], shift=1)


def split_step(mgr: mc.CacheManager, slots: list[int]) -> None:
    """Copies whose temporal state comes from a slot of its own (speculative decoding's align mode): a shifted
    one, one in place (its conv states shifted there, its temporal state from another slot), a chain of a shift-0
    one reading a slot the first wrote, one keeping its own temporal state, and a split swap.

    Stages: shift (a->b, d d), shift 0 (b->f), shift (g->h), shift 0 (h->g).
    """
    a, b, c, d, e, f, g, h = slots[:8]
    mgr.copy_on_write(a, b, shift=1, temporal_src=c)
    mgr.copy_on_write(d, d, shift=1, temporal_src=e)
    mgr.copy_on_write(b, f, temporal_src=a)
    mgr.copy_on_write(g, h, shift=1, temporal_src=h)
    mgr.copy_on_write(h, g, temporal_src=e)


SCENARIOS = {
    "swap": swap_via_temp, "mixed": mixed_step, "three-cycle": three_cycle, "shifted": shifted_step,
    "split": split_step,
}  # fmt: skip


def run_scenario(
    make: Callable[[], mc.Executor], scenario: str, at: int, exc: type[BaseException], kind: str = "plain"
) -> int:
    """Run the scenario with a fault before op ``at`` (0: none) on a pool of ``kind`` (tests/support/util.py's
    :data:`POOL_KINDS`); returns the ops the flush ran."""
    pool = sweep_pool(kind, 9)
    with mc.CacheManager(pool, executor=make()) as mgr:
        slots = mgr.alloc(8)
        mgr.flush_nowait()
        fill_random(pool, at)
        oracle = SequentialOracle(pool)
        before = mgr.pending
        SCENARIOS[scenario](mgr, slots)
        events = _queued(mgr)[before:]
        oracle.apply(events)
        ops = flush_with_fault(mgr, at, exc)
        oracle.assert_matches(pool)
        assert pool.unfinished == 0
        return ops


def _queued(mgr: mc.CacheManager) -> list[Any]:
    return mgr.queued()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize(("variant", "kind"), [(v, k) for v in sorted(VARIANTS) for k in kinds_for(v)])
def test_a_fault_at_every_op_then_one_flush_is_exact(variant: str, kind: str, scenario: str) -> None:
    make = VARIANTS[variant]
    total = run_scenario(make, scenario, 0, MemoryError, kind)
    assert total > 0
    excs: list[type[BaseException]] = [MemoryError, RuntimeError, KeyboardInterrupt]
    for at in fault_points(total):
        run_scenario(make, scenario, at, excs[at % len(excs)], kind)


def test_the_sweep_samples_both_ends_and_the_middle_and_runs_every_op_under_the_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MAMBACACHE_FULL_SWEEP", raising=False)
    points = fault_points(500)
    assert len(points) <= 24 and points[:3] == [1, 2, 3] and points[-3:] == [498, 499, 500]
    assert all(any(lo <= p < lo + 50 for p in points) for lo in range(0, 500, 50))  # no stretch left out
    assert fault_points(500) == points and fault_points(24) == list(range(1, 25))
    monkeypatch.setenv("MAMBACACHE_FULL_SWEEP", "0")
    assert fault_points(500) == points
    monkeypatch.setenv("MAMBACACHE_FULL_SWEEP", "1")  # what .ci/run sets
    assert fault_points(500) == list(range(1, 501))


def test_npu_rotate_stays_within_a_workspace_smaller_than_a_row() -> None:
    # Defect: the row-by-row rotate held members x element size (40 B against a 4 B bound).
    for bound in (4, 8, 12):
        ex = NpuExecutor(bound)
        pool = mc.StatePool(SPEC, 9)
        with mc.CacheManager(pool, executor=ex) as mgr:
            slots = mgr.alloc(8)
            mgr.flush_nowait()
            fill_random(pool, 1)
            oracle = SequentialOracle(pool)
            mixed_step(mgr, slots)
            oracle.apply(_queued(mgr))
            mgr.flush_nowait()
            oracle.assert_matches(pool)
        assert ex._workspace is not None and ex._workspace.numel() <= bound


def test_a_workspace_below_one_element_is_refused_when_the_manager_is_made() -> None:
    pool = mc.StatePool(SPEC, 4)
    with pytest.raises(mc.UnsupportedDtypeError, match=r"smaller than one torch\.float32 element"):
        mc.CacheManager(pool, executor=NpuExecutor(2))
    assert pool.ledger.owner is None


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@given(
    raw=shift_ops,
    fail_at=st.sets(st.integers(1, 40), max_size=5),
    seed=st.integers(0, 99),
    data=st.data(),
)
@settings(max_examples=25)
def test_faults_lose_nothing(
    variant: str, raw: list[tuple[str, int, int]], fail_at: set[int], seed: int, data: st.DataObject
) -> None:
    kind = data.draw(st.sampled_from(kinds_for(variant)), label="pool")

    async def main() -> None:
        n = 8
        pool = sweep_pool(kind, n)
        failing = FailingExecutor(VARIANTS[variant]())
        async with mc.CacheManager(pool, executor=failing, max_failed_flushes=100) as mgr:
            failing.arm(fail_at)
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
            max_shift = min(s[-1] for s in pool.spec.conv_shapes) - 1
            for events, _ in events_from_ops(raw0, n, set(pool.allocated_slots()), max_shift=max_shift):
                drive(mgr, events, oracle)
                try:
                    await mgr.flush()
                except mc.ExecutorError as exc:
                    assert isinstance(exc.__cause__, MemoryError)
                    continue  # the work is kept; it runs first next time
                oracle.assert_matches(pool)
            failing.arm(())
        oracle.assert_matches(pool)  # leaving the context finished everything
        assert pool.unfinished == 0

    anyio.run(main)


@pytest.mark.anyio
async def test_failed_flush_raises_then_next_flush_completes() -> None:
    pool = mc.StatePool(small_spec(), 4)
    fill_random(pool, 0)
    failing = FailingExecutor(TorchExecutor())
    async with mc.CacheManager(pool, executor=failing) as mgr:
        failing.arm({2})  # the zero stage fails on the second of three tensors
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
        assert failing.calls == 2 + 2 + 3  # tensor 0 was not done twice


@pytest.mark.anyio
async def test_exit_flush_failure_does_not_mask_the_blocks_error() -> None:
    pool = mc.StatePool(small_spec(), 4)
    failing = FailingExecutor(TorchExecutor())
    with pytest.raises(KeyError, match="the body's own error") as info:
        async with mc.CacheManager(pool, executor=failing) as mgr:
            failing.arm({1})
            mgr.alloc(1)
            raise KeyError("the body's own error")
    notes = getattr(info.value, "__notes__", [""])
    assert "flush on leaving the block failed" in notes[0]
    # Without an error in the block, the exit flush's failure is raised.
    failing = FailingExecutor(TorchExecutor())
    with pytest.raises(mc.ExecutorError):
        async with mc.CacheManager(mc.StatePool(small_spec(), 4), executor=failing) as mgr:
            failing.arm({1})
            mgr.alloc(1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_work_kept_by_a_failed_exit_flush_runs_first_in_the_next_manager(variant: str) -> None:
    total = run_scenario(VARIANTS[variant], "mixed", 0, MemoryError)
    for at in range(1, total + 1, max(1, total // 6)):
        pool = mc.StatePool(SPEC, 9)
        with mc.CacheManager(pool) as mgr:
            slots = mgr.alloc(8)
        fill_random(pool, at)
        oracle = SequentialOracle(pool)
        mgr = mc.CacheManager(pool, executor=VARIANTS[variant]())
        mgr.__enter__()
        mixed_step(mgr, slots)
        oracle.apply(_queued(mgr))
        # Leaving the block runs the exit flush, which faults part-way (maybe mid-rotate).
        with pytest.raises(mc.ExecutorError), fail_at_op(at, MemoryError):
            mgr.__exit__(None, None, None)
        assert pool.unfinished >= 1 and pool.ledger.owner is None
        # A new manager runs the kept work first, on the executor that started it.
        with mc.CacheManager(pool, executor="reference") as mgr2:
            report = mgr2.flush_nowait()
            assert report.resumed_stages >= 1 and report.events == 0
        oracle.assert_matches(pool)
        assert pool.unfinished == 0


def test_a_persistent_failure_breaks_the_manager_instead_of_growing_a_queue() -> None:
    pool = mc.StatePool(SPEC, 6)
    failing = FailingExecutor(TorchExecutor())
    with pytest.raises(mc.ManagerBrokenError), mc.CacheManager(pool, executor=failing, max_failed_flushes=5) as mgr:
        failing.arm(set(range(1, 10**6)))
        (a, b) = mgr.alloc(2)
        for i in range(1000):
            try:
                mgr.clear(a)
                mgr.copy_on_write(a, b)
                mgr.flush_nowait()
            except mc.ManagerBrokenError as exc:
                assert i == 4 and "5 flushes in a row failed" in str(exc)
                break
            except mc.ExecutorError:
                # Kept work never exceeds one step's plan; new events wait, unplanned.
                assert pool.unfinished <= 2 and mgr.pending <= 2 * i + 2
        assert mgr.broken is not None
        with pytest.raises(mc.ManagerBrokenError):
            mgr.clear(a)
        with pytest.raises(mc.ManagerBrokenError):
            mgr.flush_nowait()
    # Nothing is lost: the pool keeps it all (planned) for the next manager.
    kept = pool.unfinished
    assert 1 <= kept <= 4
    failing.arm(())
    with mc.CacheManager(pool) as mgr:
        assert mgr.flush_nowait().resumed_stages == kept
    assert pool.unfinished == 0
    assert all(bool((t[:, [a, b]] == 0).all()) for t in pool.tensors)
