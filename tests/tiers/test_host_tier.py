"""The host tier: offload, restore and drop, in the pure planner and through every executor, with faults."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache._core._planner import (
    CopyStage,
    OffloadStage,
    RestoreStage,
    ZeroStage,
    plan_step,
)
from mambacache._executors._base import copy_host
from mambacache.testing import SequentialOracle

from ..support.layered import pool_tensors
from ..support.strategies import host_ops
from ..support.sweep import fault_points
from ..support.util import VARIANTS, Driver, fill_random, flush_with_fault, kinds_for, small_spec, sweep_pool

N, H = 10, 6
SPEC = small_spec()


# -- the planner alone ----------------------------------------------------------
# Every host event kind mixed with commits, against one-event-at-a-time execution:
# tests/core/test_planner.py (test_plan_with_host_events_and_commits_equals_sequential_execution).


def test_plan_examples() -> None:
    # Preemption by swap: the offload reads the slot before the new tenant's clear.
    p = plan_step([mc.Offload(1, 1), mc.Release(1), mc.Alloc(1), mc.CopyOnWrite(2, 3)])
    assert [type(s) for s in p.stages] == [OffloadStage, CopyStage, ZeroStage]
    assert (p.offloaded, p.copied, p.zeroed) == (1, 1, 1)
    # A restore lands after the copies that read the slot's old content, before the zeros.
    p = plan_step([mc.CopyOnWrite(1, 2), mc.Restore(3, 1), mc.Clear(4)])
    assert [type(s) for s in p.stages] == [CopyStage, RestoreStage, ZeroStage]
    # A restore of what this step offloaded is a plain copy, and the offload dropped after it is elided.
    p = plan_step([mc.Offload(1, 2), mc.Clear(1), mc.Restore(2, 3)])
    assert [type(s) for s in p.stages] == [CopyStage, ZeroStage] and p.elided == 1
    # Offloading a slot cleared earlier in the log splits the log there: exact, two plans.
    p = plan_step([mc.Clear(1), mc.Offload(1, 1)])
    assert [type(s) for s in p.stages] == [ZeroStage, OffloadStage]
    # Contiguous slots to contiguous host slots: one run.
    p = plan_step([mc.Offload(4, 1), mc.Offload(5, 2), mc.Offload(6, 3)])
    assert p.stages[0].runs == ((4, 1, 3),)  # type: ignore[union-attr]


# -- through the manager, on every executor ---------------------------------------
def _open(executor: Any, kind: str = "plain") -> tuple[mc.StatePool, mc.HostPool, mc.CacheManager]:
    pool = sweep_pool(kind, N)  # tests/support/util.py's POOL_KINDS
    host = mc.HostPool(pool.spec, H)
    return pool, host, mc.CacheManager(pool, executor=executor, host_pool=host, max_failed_flushes=1000)


def _started(mgr: mc.CacheManager, seed: int) -> tuple[SequentialOracle, Driver]:
    """Four live slots, every slot dirty, and an oracle and a driver from there (``mgr`` is open)."""
    mgr.alloc(4)
    mgr.flush_nowait()
    fill_random(mgr.pool, seed)
    assert mgr.host_pool is not None
    oracle = SequentialOracle(mgr.pool, mgr.host_pool)
    return oracle, Driver(mgr, oracle)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@given(raw=host_ops, seed=st.integers(0, 2**16), data=st.data())
@settings(max_examples=30)
def test_host_events_match_sequential_on_every_executor(
    variant: str, raw: list[tuple[str, int, int]], seed: int, data: st.DataObject
) -> None:
    kind = data.draw(st.sampled_from(kinds_for(variant)), label="pool")
    pool, host, mgr = _open(VARIANTS[variant](), kind)
    with mgr:
        oracle, drive = _started(mgr, seed)
        step = 0
        for kind, a, b in raw:
            if kind == "flush":
                report = mgr.flush_nowait()
                oracle.assert_matches(pool, host)
                assert report.bytes_offloaded == report.offloaded * pool.spec.slot_bytes
                drive.forward(step)
                step += 1
            else:
                drive.apply(kind, a, b)
    oracle.assert_matches(pool, host)


def host_scenario(mgr: mc.CacheManager, slots: list[int], h0: int) -> None:
    """Every host stage kind in one step, and both splits: offload, restore, and offloads of written slots."""
    a, b, c, d, e = slots[:5]
    mgr.offload(d)
    mgr.offload(e)  # d and e land in consecutive host slots: one run
    mgr.offload(a)  # reads a before the copy below overwrites it
    mgr.copy_on_write(b, a)
    mgr.restore(h0, b, keep=True)  # a restore stage, after the copy read b
    mgr.offload(b)  # b's value is the host's: the log splits here
    mgr.clear(c)
    mgr.offload(c)  # a cleared slot: splits again
    mgr.drop(h0)


def run_host_scenario(variant: str, at: int, exc: type[BaseException], kind: str = "plain") -> int:
    pool, host, mgr = _open(VARIANTS[variant](), kind)
    with mgr:
        slots = mgr.alloc(8)
        mgr.flush_nowait()
        fill_random(pool, at)
        h0 = mgr.offload(slots[5])
        mgr.flush_nowait()
        for t in pool_tensors(pool):
            t[:, slots[5]] = -7.0  # the pool moves on; the host keeps the old state
        oracle = SequentialOracle(pool, host)
        before = mgr.pending
        host_scenario(mgr, slots, h0)
        oracle.apply(mgr.queued()[before:])
        ops = flush_with_fault(mgr, at, exc)
        oracle.assert_matches(pool, host)
        assert pool.unfinished == 0
        return ops


@pytest.mark.parametrize(("variant", "kind"), [(v, k) for v in sorted(VARIANTS) for k in kinds_for(v)])
def test_a_fault_at_every_op_of_a_host_step_loses_nothing(variant: str, kind: str) -> None:
    total = run_host_scenario(variant, 0, MemoryError, kind)
    assert total > 0
    excs: list[type[BaseException]] = [MemoryError, RuntimeError, KeyboardInterrupt]
    for at in fault_points(total):
        run_host_scenario(variant, at, excs[at % len(excs)], kind)


class FlakyHost:
    """Delegates to a real executor; fails the host copies listed in ``fail_at`` (1-based calls)."""

    name = "flaky-host"

    def __init__(self, inner: Any, fail_at: set[int]) -> None:
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def execute(self, stage: Any, tensor: torch.Tensor, draft: torch.Tensor | None = None) -> None:
        self.inner.execute(stage, tensor, draft) if draft is not None else self.inner.execute(stage, tensor)

    def execute_host(self, stage: Any, tensor: torch.Tensor, host: torch.Tensor) -> None:
        self.calls += 1
        if self.calls in self.fail_at:
            raise RuntimeError(f"injected host copy fault at call {self.calls}")
        getattr(self.inner, "execute_host", copy_host)(stage, tensor, host)


@given(raw=host_ops, fail_at=st.sets(st.integers(1, 30), max_size=6), seed=st.integers(0, 99))
@settings(max_examples=40)
def test_failed_host_copies_are_retried_exactly(raw: list[tuple[str, int, int]], fail_at: set[int], seed: int) -> None:
    flaky = FlakyHost(VARIANTS["torch"](), fail_at)
    pool, host, mgr = _open(flaky)
    with mgr:
        oracle, drive = _started(mgr, seed)
        for step, (kind, a, b) in enumerate(raw):
            if kind != "flush":
                drive.apply(kind, a, b)
                continue
            try:
                mgr.flush_nowait()
            except mc.ExecutorError:
                continue  # kept; no forward, since the engine would not run one on a failed flush
            oracle.assert_matches(pool, host)
            drive.forward(step)
        flaky.fail_at = set()
    oracle.assert_matches(pool, host)
    assert pool.unfinished == 0


def test_offload_left_by_a_failed_exit_flush_runs_in_the_next_manager() -> None:
    pool, host = mc.StatePool(SPEC, N), mc.HostPool(SPEC, H)
    flaky = FlakyHost(VARIANTS["torch"](), {1, 2, 3})
    with mc.CacheManager(pool, host_pool=host) as mgr:
        (a,) = mgr.alloc(1)
        mgr.flush_nowait()
        fill_random(pool, 3)
        oracle = SequentialOracle(pool, host)
    with pytest.raises(mc.ExecutorError), mc.CacheManager(pool, executor=flaky, host_pool=host) as mgr:
        h = mgr.offload(a)
        mgr.release(a)
        oracle.apply([mc.Offload(a, h), mc.Release(a)])
    assert pool.unfinished == 1
    flaky.fail_at = set()  # the kept stage runs on the executor that started it
    with mc.CacheManager(pool) as mgr:  # the backlog keeps the host tensors: no host_pool needed to finish it
        mgr.flush_nowait()
    assert flaky.calls == 1 + len(pool.tensors)
    assert pool.unfinished == 0
    oracle.assert_matches(pool, host)


# -- contract details ---------------------------------------------------------------
def test_bad_host_calls_raise_typed_errors_and_change_nothing() -> None:
    pool, host = mc.StatePool(SPEC, 4), mc.HostPool(SPEC, 2)
    with mc.CacheManager(pool) as plain:
        (s,) = plain.alloc(1)
        with pytest.raises(mc.InvalidArgumentError, match="needs a host pool"):
            plain.offload(s)
    with mc.CacheManager(pool, host_pool=host) as mgr:
        (t,) = mgr.alloc(1, request_id="r")
        mgr.flush_nowait()
        before = mgr.pending
        with pytest.raises(mc.SlotStateError, match="not allocated"):
            mgr.offload(4)
        with pytest.raises(mc.SlotStateError, match="belongs to 'r'"):
            mgr.offload(t, request_id="q")
        with pytest.raises(mc.InvalidSlotError, match="host slot 3 is out of range"):
            mgr.restore(3, t)
        with pytest.raises(mc.SlotStateError, match="holds no state"):
            mgr.restore(1, t)
        with pytest.raises(mc.SlotStateError, match="holds no state"):
            mgr.drop(2)
        with pytest.raises(mc.InvalidSlotError):
            mgr.drop(True)  # type: ignore[arg-type]
        h = mgr.offload(t)
        with pytest.raises(mc.InvalidArgumentError, match="keep must be a bool"):
            mgr.restore(h, t, keep=1)  # type: ignore[arg-type]
        mgr.offload(t)
        with pytest.raises(mc.PoolExhaustedError, match="host pool exhausted"):
            mgr.offload(t)
        assert mgr.pending == before + 2 and host.num_held == 2
        with pytest.raises(mc.InvalidEventError, match=r"CacheManager\.offload"):
            mgr.submit(mc.Offload(t, 1))  # type: ignore[arg-type]
        mgr.drop(h)
        # Freed by a queued drop, and no other slot free: a full tier takes it in the same step.
        assert host.num_free == 1 and mgr.offload(t) == h
        mgr.flush_nowait()
        with pytest.raises(mc.PoolExhaustedError, match="host pool exhausted"):
            mgr.offload(t)
    with pytest.raises(mc.InvalidArgumentError, match="host_pool holds states"):
        mc.CacheManager(pool, host_pool=mc.HostPool(small_spec(layers=2), 2))
    with pytest.raises(mc.InvalidArgumentError, match="host_pool must be a HostPool"):
        mc.CacheManager(pool, host_pool=pool)  # type: ignore[arg-type]


def test_host_pool_is_attached_to_one_open_manager() -> None:
    host = mc.HostPool(SPEC, 2)
    with (
        mc.CacheManager(mc.StatePool(SPEC, 2), host_pool=host),
        pytest.raises(mc.InvalidArgumentError, match="another open CacheManager"),
    ):
        mc.CacheManager(mc.StatePool(SPEC, 2), host_pool=host).__enter__()
    with mc.CacheManager(mc.StatePool(SPEC, 2), host_pool=host):
        pass


def test_host_pool_layout_and_pinning() -> None:
    spec = mc.StateSpec(num_layers=2, conv_shapes=[(3, 4)], temporal_shape=(2, 2), draft_tokens=2)
    host = mc.HostPool(spec, 3)
    assert [tuple(t.shape) for t in host.tensors] == [(2, 4, 3, 4), (2, 4, 2, 2)]
    assert host.spec.draft_tokens == 0 and host.compatible_with(spec)
    assert not host.pinned  # no accelerator on this machine: pinning would fail, and buys nothing
    assert all(t.device.type == "cpu" for t in host.tensors)
    with pytest.raises(mc.InvalidArgumentError):
        mc.HostPool(spec, 0)


@pytest.mark.anyio
async def test_async_offload_restore_round_trip() -> None:
    pool, host = mc.StatePool(SPEC, 4), mc.HostPool(SPEC, 2)
    async with mc.CacheManager(pool, host_pool=host) as mgr:
        (a,) = mgr.alloc(1, request_id="r")
        await mgr.flush()
        for t in pool.tensors:
            t[:, a] = 5.0
        h = mgr.offload(a, request_id="r")
        mgr.release(a, request_id="r")
        (b,) = mgr.alloc(1, request_id="x")  # the same slot, a new tenant: cleared after the offload read it
        report = await mgr.flush()
        assert (report.offloaded, report.zeroed) == (1, 1) and b == a
        (c,) = mgr.alloc(1, request_id="r", clear=False)
        mgr.restore(h, c, request_id="r")
        report = await mgr.flush()
        assert report.restored == 1 and host.num_held == 0
        assert all(bool((t[:, c] == 5.0).all()) and bool((t[:, b] == 0).all()) for t in pool.tensors)


# -- argument checks of HostPool and StateIndices: typed errors, nothing changed -------
def test_host_pool_calls_with_bad_arguments_are_typed_errors_that_change_nothing() -> None:
    np = pytest.importorskip("numpy")
    pool, host = mc.StatePool(SPEC, 4), mc.HostPool(SPEC, 3)
    for kwargs in (
        {"spec": pool}, {"spec": None}, {"num_slots": 0}, {"num_slots": -1}, {"num_slots": True},
        {"num_slots": 2.0}, {"num_slots": "2"}, {"pin_memory": 1}, {"pin_memory": "yes"},
    ):  # fmt: skip
        with pytest.raises(mc.InvalidArgumentError):
            mc.HostPool(**{"spec": SPEC, "num_slots": 2, **kwargs})
    with mc.CacheManager(pool, host_pool=host) as mgr:
        (a,) = mgr.alloc(1, request_id="a")
        h = mgr.offload(a, request_id="a")
        mgr.flush_nowait()
        before = (host.held(), host.num_free, [t.clone() for t in host.tensors], mgr.pending)
        # Host slots are checked as the manager checks them: numpy and 0-d tensor ints are slots, the rest is not.
        assert host.is_held(h) and host.is_held(np.int64(h)) and host.is_held(torch.tensor(h))
        assert not host.is_held(h + 1)
        for bad in (True, np.bool_(True), 1.0, "1", None, 0, -1, 4, torch.tensor([1]), torch.tensor(1.0)):
            with pytest.raises(mc.InvalidSlotError):
                host.is_held(bad)
        for spec in (None, pool, "spec", dataclasses.asdict(SPEC)):
            with pytest.raises(mc.InvalidArgumentError, match="StateSpec"):
                host.compatible_with(spec)
        assert host.compatible_with(SPEC) and not host.compatible_with(small_spec(layers=2))
        after = (host.held(), host.num_free, [t.clone() for t in host.tensors], mgr.pending)
        assert after[:2] == before[:2] and after[3] == before[3]
        assert all(torch.equal(x, y) for x, y in zip(after[2], before[2], strict=True))
        mgr.drop(h)
        mgr.release(a, request_id="a")


def test_host_num_free_counts_slots_freed_in_the_step() -> None:
    """num_free is what offloads can take now: a slot freed by a queued drop or restore counts at once, and is
    handed out only once no other slot is free."""
    pool, host = mc.StatePool(SPEC, 4), mc.HostPool(SPEC, 3)
    with mc.CacheManager(pool, host_pool=host) as mgr:
        (a,) = mgr.alloc(1)
        h1, h2 = mgr.offload(a), mgr.offload(a)
        mgr.flush_nowait()
        mgr.drop(h1)
        mgr.restore(h2, a)
        assert (host.num_free, host.num_held) == (3, 0)
        assert [mgr.offload(a) for _ in range(3)] == [3, h1, h2]  # the truly free slot first, then in freeing order
        assert (host.num_free, host.num_held) == (0, 3)
        with pytest.raises(mc.PoolExhaustedError):
            mgr.offload(a)
        mgr.flush_nowait()
        for h in (1, 2, 3):
            mgr.drop(h)
        mgr.release(a)


def test_state_indices_calls_with_bad_arguments_are_typed_errors_that_change_nothing() -> None:
    np = pytest.importorskip("numpy")
    for kwargs in (
        {"capacity": 0}, {"capacity": True}, {"capacity": 2.0}, {"capacity": None}, {"num_slots": 0},
        {"num_slots": True}, {"num_slots": "8"}, {"device": "nonsense"}, {"device": 3.5},
    ):  # fmt: skip
        with pytest.raises(mc.InvalidArgumentError):
            mc.StateIndices(**{"capacity": 4, **kwargs})
    idx = mc.StateIndices(4, num_slots=8)
    ptr = idx.update([3, 1]).data_ptr()
    for bad, error in (
        ([1] * 5, mc.InvalidArgumentError), ([9], mc.InvalidSlotError), ([-1], mc.InvalidSlotError),
        ([True], mc.InvalidSlotError), ([1.0], mc.InvalidSlotError), (["1"], mc.InvalidSlotError),
        ([None], mc.InvalidSlotError), (None, mc.InvalidSlotError), ("12", mc.InvalidSlotError),
        (5, mc.InvalidSlotError), (np.array([1.0]), mc.InvalidSlotError), (np.array([[1]]), mc.InvalidSlotError),
        (torch.tensor([1.0]), mc.InvalidSlotError), (torch.tensor([[1]]), mc.InvalidSlotError),
        (torch.tensor([True]), mc.InvalidSlotError), (torch.tensor([1j]), mc.InvalidSlotError),
        ([1, 2, 3, 9], mc.InvalidSlotError),  # a bad slot after good ones: nothing written either
    ):  # fmt: skip
        with pytest.raises(error):
            idx.update(bad)
        assert idx.tensor.tolist() == [3, 1, 0, 0] and idx.size == 2 and idx.tensor.data_ptr() == ptr
    # A tensor already on the index's device takes the device-to-device path (unchecked values, checked kind).
    meta = mc.StateIndices(4, device="meta", num_slots=8)
    meta.update(torch.tensor([1, 2], device="meta"))
    for bad in (
        torch.zeros(5, dtype=torch.int32, device="meta"), torch.zeros(1, 1, dtype=torch.int32, device="meta"),
        torch.zeros(1, device="meta"), torch.zeros(1, dtype=torch.bool, device="meta"),
        torch.zeros(1, dtype=torch.complex64, device="meta"),
    ):  # fmt: skip
        with pytest.raises(mc.InvalidArgumentError):
            meta.update(bad)
        assert meta.size == 2
