"""The accelerator copy path, forced on CPU: exact, temporary-free, and a constant op count per stage."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache._core._planner import plan_step
from mambacache._executors._torch import TorchExecutor
from mambacache.audit import OpAudit

from ..support.strategies import events_from_ops, ops
from ..support.util import drive

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint16]


def spec(dtype: torch.dtype, layers: int = 3) -> mc.StateSpec:
    return mc.StateSpec(
        num_layers=layers,
        conv_shapes=[(6, 3), (5, 2)],
        temporal_shape=(2, 3, 4),
        conv_dtype=dtype,
        temporal_dtype=dtype,
    )


def random_bytes(pool: mc.StatePool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in pool.tensors:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(raw=ops, seed=st.integers(0, 99))
@settings(max_examples=30)
def test_direct_path_equals_the_reference_on_every_stage_kind(
    dtype: torch.dtype, raw: list[tuple[str, int, int]], seed: int
) -> None:
    raw0 = [(k, 0 if k == "alloc" else a, b) for k, a, b in raw]
    pools = []
    for executor in (TorchExecutor(path="direct"), "reference"):
        pool = mc.StatePool(spec(dtype), 10)
        random_bytes(pool, seed)
        with mc.CacheManager(pool, executor=executor) as mgr:
            for events, _ in events_from_ops(raw0, 10, set()):
                drive(mgr, events)
                mgr.flush_nowait()
        pools.append(pool)
    direct, ref = pools
    assert direct.allocated_slots() == ref.allocated_slots()
    for a, b in zip(direct.tensors, ref.tensors, strict=True):
        # Every slot, free ones too: both executors ran the same plans on the same bytes.
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def stage_for(kind: str, n: int, runs: bool, rng: random.Random, num_slots: int) -> object:
    # Consecutive slots make few runs; random ones about one run each.
    slots = list(range(1, 2 * n + 1)) if runs else rng.sample(range(1, num_slots + 1), 2 * n)
    if kind == "zero":
        events: list[object] = [mc.Clear(s) for s in slots[:n]]
    else:
        events = [mc.CopyOnWrite(s, d) for s, d in zip(slots[:n], slots[n:], strict=True)]
    (stage,) = plan_step(events).stages  # type: ignore[arg-type]
    return stage


@pytest.mark.parametrize("kind", ["zero", "copy"])
def test_direct_path_allocates_nothing_syncs_nothing_and_its_op_count_is_constant(kind: str) -> None:
    rng = random.Random(0)
    pool = mc.StatePool(spec(torch.bfloat16, layers=4), 300)
    ex = TorchExecutor(path="direct")
    counts = set()
    for n in (1, 8, 64, 128):
        for runs in (False, True):
            stage = stage_for(kind, n, runs, rng, pool.num_slots)
            for t in pool.tensors:
                ex.execute(stage, t)  # type: ignore[arg-type]  # warm: the row table is built once per tensor
            with OpAudit() as audit:
                for t in pool.tensors:
                    ex.execute(stage, t)  # type: ignore[arg-type]
            report = audit.report()
            assert report.total_temp_bytes == 0 and report.peak_temp_bytes == 0, report
            assert report.sync_ops == () and report.noncontiguous_input_bytes == 0, report
            counts.add(tuple(sorted(report.op_counts.items())))
    (only,) = counts  # the same ops for 1 slot as for 128, in runs or scattered
    assert only == ((f"_foreach_{'zero_' if kind == 'zero' else 'copy_'}", 3),)  # one per pool tensor


def test_the_index_path_is_what_it_replaces() -> None:
    """For scale: the index path's copy allocates a gather temporary of every copied byte."""
    pool = mc.StatePool(spec(torch.bfloat16, layers=4), 300)
    stage = stage_for("copy", 64, False, random.Random(1), pool.num_slots)
    ex = TorchExecutor(path="index")
    with OpAudit() as audit:
        for t in pool.tensors:
            ex.execute(stage, t)  # type: ignore[arg-type]
    assert audit.report().peak_state_temp_bytes >= 64 * max(pool.spec.layer_bytes()) * 4


def test_auto_rule() -> None:
    ex = TorchExecutor()
    cpu = torch.zeros(2, 10, 4)
    assert ex._choose(cpu, 2, 2) == "runs"  # few runs
    assert ex._choose(cpu, 8, 8) == "index"  # many runs of tiny slots on CPU
    big = torch.zeros(2, 10, 64 << 10)
    assert ex._choose(big, 8, 8) == "runs"  # each run moves enough bytes
    assert ex._choose(big, 8, 8, zero=True) == "runs"  # a zero as a copy: pieces shared with the crew
    assert ex._choose(cpu, 8, 8, zero=True) == "index"
    assert ex._choose(big, 2, 2, zero=True) == "runs"  # few runs (a decode step): a few ops under the grain
    inline = TorchExecutor(share_stages=False)  # on the calling thread alone, one index_fill_ per tensor is faster
    assert inline._choose(big, 8, 8, zero=True) == "index"
    assert inline._choose(big, 8, 8) == "runs"
    meta = torch.zeros(2, 10, 4, device="meta")
    assert ex._choose(meta, 8, 8) == "direct"  # any accelerator: no temporary, constant ops
    with pytest.raises(mc.InvalidArgumentError):
        TorchExecutor(path="fast")


def test_an_executor_shared_by_two_managers_runs_each_stage_on_its_own_tensors() -> None:
    """The executor keeps the last group of pool tensors a stage ran on; another manager's flush on another
    thread may replace it at any point, even between a stage's check of the group and its use of it, and the
    stage must still run on its own tensors."""
    import threading

    spec = mc.StateSpec(num_layers=2, conv_shapes=[(8, 4)], temporal_shape=(4, 8))
    executor = TorchExecutor()
    a, b = mc.StatePool(spec, 8), mc.StatePool(spec, 8)
    with mc.CacheManager(a, executor=executor) as ma, mc.CacheManager(b, executor=executor) as mb:
        ma.alloc(4, clear=False)
        ma.flush_nowait()
        mb.alloc(4, clear=False)
        mb.flush_nowait()
        for pool, value in ((a, 7.0), (b, 5.0)):
            for t in pool.tensors:
                t[:, 1] = value
        want_b = [t.clone() for t in b.tensors]
        real = executor._cpu_group
        interleave = [True]

        def cpu_group(tensors: list[torch.Tensor]) -> object:
            got = real(tensors)
            if interleave.pop() if interleave else False:  # b's flush, on its own thread, runs right here
                mb.clear_many([3])
                thread = threading.Thread(target=mb.flush_nowait)
                thread.start()
                thread.join()
            return got

        executor._cpu_group = cpu_group  # type: ignore[method-assign]
        ma.copy_many([1], [2])
        ma.flush_nowait()
    assert not interleave
    assert all(bool((t[:, 2] == 7.0).all()) for t in a.tensors), "a's copy did not happen in a"
    for t in want_b:
        t[:, 3] = 0
    assert all(map(torch.equal, b.tensors, want_b)), "a's copy ran on b's tensors"
