"""mambacache.testing, the public checking kit: the oracle agrees with the manager and finds a pool that differs,
the fault injectors fault where they say, and importing the module pulls in no test framework."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache.testing import FailingExecutor, ReferenceExecutor, SequentialOracle, count_ops, fail_at_op

from ..support.layered import pool_tensors
from ..support.strategies import host_ops
from ..support.sweep import fault_points
from ..support.util import VARIANTS, Driver, fill_random, kinds_for, sweep_pool

N, H = 8, 4


def _open(executor: mc.Executor | str, kind: str = "plain") -> mc.CacheManager:
    pool = sweep_pool(kind, N)
    return mc.CacheManager(pool, executor=executor, host_pool=mc.HostPool(pool.spec, H), max_failed_flushes=1000)


def _start(mgr: mc.CacheManager, seed: int) -> tuple[SequentialOracle, Driver]:
    """Four live slots and every slot dirty; an oracle and a driver from there."""
    mgr.alloc(4)
    mgr.flush_nowait()
    fill_random(mgr.pool, seed)
    oracle = SequentialOracle(mgr.pool, mgr.host_pool)
    return oracle, Driver(mgr, oracle)


def _flush_retrying(mgr: mc.CacheManager, at: int, exc: type[BaseException]) -> bool:
    """Flush with a fault before op ``at`` (0: none); after a fault, flush again. Whether it faulted."""
    try:
        with fail_at_op(at, exc):
            mgr.flush_nowait()
    except (mc.ExecutorError, KeyboardInterrupt) as err:
        assert at >= 1
        if isinstance(err, mc.ExecutorError):
            assert isinstance(err.__cause__, exc)
        mgr.flush_nowait()
        return True
    return False


@pytest.mark.parametrize("variant", ["torch", "reference", "npu-rows"])
@given(raw=host_ops, seed=st.integers(0, 2**16), faults=st.lists(st.integers(0, 80), max_size=20), data=st.data())
@settings(max_examples=25)
def test_the_oracle_agrees_with_the_manager_with_a_fault_in_any_flush(
    variant: str, raw: list[tuple[str, int, int]], seed: int, faults: list[int], data: st.DataObject
) -> None:
    kind = data.draw(st.sampled_from(kinds_for(variant)), label="pool")
    with _open(VARIANTS[variant](), kind) as mgr:
        oracle, driver = _start(mgr, seed)
        step = 0
        for op, a, b in raw:
            if op != "flush":
                driver.apply(op, a, b)
                continue
            at = faults[step] if step < len(faults) else 0
            _flush_retrying(mgr, at, (MemoryError, RuntimeError, KeyboardInterrupt)[at % 3])
            oracle.assert_matches(mgr.pool, mgr.host_pool)
            driver.forward(step)
            step += 1
        mgr.flush_nowait()
        oracle.assert_matches(mgr.pool, mgr.host_pool)


def _step(mgr: mc.CacheManager, slots: list[int]) -> None:
    """A step with every stage kind: copies (a swap through a temporary: a rotate), a shifted copy, a clear, an
    offload and a restore."""
    a, b, c, d, e, t = slots[:6]
    mgr.submit(mc.CopyOnWrite(a, t), mc.CopyOnWrite(b, a), mc.CopyOnWrite(t, b), mc.Release(t))
    mgr.copy_on_write(c, d, shift=1)
    h = mgr.offload(e)
    mgr.clear(e)
    mgr.restore(h, c)


def _faulted_step(variant: str, at: int) -> int:
    """The ops of the step (none faulted) or, with ``at``, the step faulted there and flushed again; the pool
    must match the oracle either way."""
    with _open(VARIANTS[variant]()) as mgr:
        slots = mgr.alloc(6)
        mgr.flush_nowait()
        fill_random(mgr.pool, at)
        oracle = SequentialOracle(mgr.pool, mgr.host_pool)
        _step(mgr, slots)
        oracle.apply(mgr.queued())
        if at:
            assert _flush_retrying(mgr, at, RuntimeError), f"no fault before op {at}"
        else:
            with count_ops() as counted:
                mgr.flush_nowait()
        oracle.assert_matches(mgr.pool, mgr.host_pool)
        assert mgr.pool.unfinished == 0
        return at if at else counted.ops


@pytest.mark.parametrize("variant", ["torch", "reference", "npu-one-layer"])
def test_a_fault_before_each_op_then_a_retried_flush_gives_the_oracles_state(variant: str) -> None:
    total = _faulted_step(variant, 0)
    assert total > 10
    for at in fault_points(total):
        _faulted_step(variant, at)


def test_the_oracle_finds_a_pool_that_differs() -> None:
    pool = mc.StatePool(mc.StateSpec(num_layers=2, conv_shapes=[(3, 4)], temporal_shape=(2, 3)), 6)
    host = mc.HostPool(pool.spec, 2)
    with mc.CacheManager(pool, host_pool=host) as mgr:
        a, b = mgr.alloc(2)
        mgr.flush_nowait()
        fill_random(pool, 3)
        oracle = SequentialOracle(pool, host)
        (u,) = mgr.alloc(1, clear=False)
        mgr.copy_on_write(a, b)
        h = mgr.offload(a)
        oracle.apply(mgr.queued())
        mgr.flush_nowait()
        oracle.assert_matches(pool, host)
        pool.temporal[1, u] += 1  # a slot whose value no event defined: not compared
        oracle.assert_matches(pool, host)
        for tensor, index, what in (
            (pool.temporal, (1, b, 0, 2), f"tensor 1 slot {b} differs"),
            (host.tensors[0], (0, h, 1, 1), f"host tensor 0 slot {h} differs"),
            (pool.conv[0], (0, 0, 2, 3), "tensor 0: the padding slot was written"),
        ):
            kept = tensor[index].clone()
            tensor[index] = kept + 1
            with pytest.raises(AssertionError, match=what):
                oracle.assert_matches(pool, host)
            tensor[index] = kept
        oracle.assert_matches(pool, host)
        mgr.release(u)
        mgr.flush_nowait()
        with pytest.raises(AssertionError, match=rf"slots allocated: \[{a}, {b}\], expected \[{a}, {b}, {u}\]"):
            oracle.assert_matches(pool, host)


def test_the_oracle_refuses_what_is_not_an_event() -> None:
    oracle = SequentialOracle(mc.StatePool(mc.StateSpec(num_layers=1, conv_shapes=[], temporal_shape=(2,)), 2))
    with pytest.raises(mc.InvalidEventError, match="not a mambacache event"):
        oracle.apply([("alloc", 1)])


def test_count_ops_counts_and_fail_at_op_faults_at_the_op_it_names() -> None:
    x = torch.zeros(4)
    with count_ops() as counted:
        x.add_(1)
        x.mul_(2)
    assert counted.ops == 2
    with pytest.raises(RuntimeError, match="injected before op 2"), fail_at_op(2, RuntimeError) as fault:
        x.add_(1)
        x.mul_(5)
    assert fault.ops == 2 and x.tolist() == [3.0] * 4  # the first op ran, the second never did
    with fail_at_op(0):
        x.add_(1)
    for bad in (-1, 1.5, True):
        with pytest.raises(mc.InvalidArgumentError, match="at must be an int"):
            fail_at_op(bad)  # type: ignore[arg-type]
    with pytest.raises(mc.InvalidArgumentError, match="exc must be an exception class"):
        fail_at_op(1, "boom")  # type: ignore[arg-type]


def test_a_failing_executor_faults_at_the_calls_it_is_armed_with_then_the_next_flush_finishes() -> None:
    pool = mc.StatePool(mc.StateSpec(num_layers=2, conv_shapes=[(3, 4)], temporal_shape=(2, 3)), 6)
    failing = FailingExecutor(ReferenceExecutor(), RuntimeError)
    with mc.CacheManager(pool, executor=failing) as mgr:
        assert failing.calls > 0  # the manager ran each stage kind once when it was made
        a, b = mgr.alloc(2)
        mgr.flush_nowait()
        fill_random(pool, 1)
        oracle = SequentialOracle(pool)
        mgr.copy_on_write(a, b)
        mgr.clear(a)
        oracle.apply(mgr.queued())
        failing.arm({2, 4})  # the copy's second tensor, the zero's second
        with pytest.raises(mc.ExecutorError) as info:
            mgr.flush_nowait()
        assert isinstance(info.value.__cause__, RuntimeError) and failing.calls == 2
        with pytest.raises(mc.ExecutorError):
            mgr.flush_nowait()  # the copy's second tensor again, then the zero's first: call 4
        assert failing.calls == 4
        mgr.flush_nowait()
        oracle.assert_matches(pool)
        assert failing.name == "failing-reference"


def test_the_oracle_reads_a_pool_of_separate_layers() -> None:
    with mc.CacheManager(sweep_pool("layers", N)) as mgr:
        a, b = mgr.alloc(2)
        mgr.flush_nowait()
        fill_random(mgr.pool, 2)
        oracle = SequentialOracle(mgr.pool)
        mgr.copy_on_write(a, b, shift=1)
        oracle.apply(mgr.queued())
        mgr.flush_nowait()
        oracle.assert_matches(mgr.pool)
        pool_tensors(mgr.pool)[-1][:, b] = 9.0  # the last extra tensor, its every layer
        with pytest.raises(AssertionError, match=rf"slot {b} differs"):
            oracle.assert_matches(mgr.pool)


def test_the_module_imports_no_test_framework_and_loads_on_first_use() -> None:
    code = (
        "import sys, mambacache as mc\n"
        "assert 'mambacache.testing' not in sys.modules\n"
        "assert 'testing' in dir(mc)\n"
        "oracle = mc.testing.SequentialOracle\n"
        "assert 'mambacache.testing' in sys.modules\n"
        "loaded = {m.split('.')[0] for m in sys.modules}\n"
        "assert not loaded & {'pytest', 'hypothesis', '_pytest'}, loaded & {'pytest', 'hypothesis', '_pytest'}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
