"""Large CPU states: the runs path cuts each view under ATen's grain, so no op is an OpenMP parallel region.

A parallel region ends only once every pool thread got a time slice; with another process computing on the
host, each region of a many-run stage waited a scheduler slice (issue 33: a clear at 0.02 of memset). These
tests pin the property that removes them (every op of a zero, copy or commit stage on a CPU pool touches
fewer than ``GRAIN`` elements) and that the pieces, wide integer or complex views of the rows, move exactly
the bytes the reference executor moves, signalling NaN payloads included.
"""

from __future__ import annotations

import ctypes
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import mambacache as mc
from mambacache._core._planner import plan_step
from mambacache._core._runner import run_stage
from mambacache._executors import _torch
from mambacache._executors._reference import ReferenceExecutor
from mambacache._executors._torch import GRAIN, TorchExecutor

from ..support.large import SPECS, host_stages, make_pool, random_bytes
from ..support.strategies import events_from_ops, host_events_from_ops, host_ops, ops
from ..support.util import drive


class MaxElements(TorchDispatchMode):
    """Records, per aten op, the largest tensor it was given (in a list or not), in elements."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]
        sizes = [a.numel() for a in flat if isinstance(a, torch.Tensor)]
        self.seen.append((str(func), max(sizes, default=0)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name", list(SPECS))
@given(raw=ops, seed=st.integers(0, 99))
@settings(max_examples=15)
def test_pieces_move_the_bytes_the_reference_moves(name: str, paged: bool, raw: list[Any], seed: int) -> None:
    raw0 = [(k, 0 if k == "alloc" else a, b) for k, a, b in raw]
    drafts = 0 if paged else 2
    pools = []
    for executor in (TorchExecutor(path="runs"), TorchExecutor(), "reference"):
        pool = make_pool(name, paged)
        random_bytes([*pool.tensors, *pool.draft_tensors], seed)
        with mc.CacheManager(pool, executor=executor) as mgr:
            for events, _ in events_from_ops(raw0, 8, set(), draft_tokens=drafts):
                drive(mgr, events)
                mgr.flush_nowait()
        pools.append(pool)
    for pool in pools[:2]:
        assert pool.allocated_slots() == pools[2].allocated_slots()
        for a, b in zip(pool.tensors, pools[2].tensors, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name", list(SPECS))
def test_no_op_of_a_runs_stage_reaches_the_grain(name: str, paged: bool) -> None:
    pool = make_pool(name, paged)
    assert pool.tensors[-1].shape[0] * pool.tensors[-1][0, 0].numel() >= GRAIN  # the case this is about
    rng = random.Random(0)
    chosen = rng.sample(range(1, 9), 6)
    events: list[list[Any]] = [
        [mc.Clear(s) for s in chosen[:3]],
        [mc.CopyOnWrite(s, d) for s, d in zip(chosen[:3], chosen[3:], strict=True)],
        [mc.Clear(1), mc.Clear(2), mc.Clear(3)],  # one run of three slots
        [mc.CopyOnWrite(1, 5), mc.CopyOnWrite(2, 6)],
    ]
    if not paged:
        events.append([mc.CommitDraft(s, 1 + s % 2) for s in chosen[:3]])
    ex = TorchExecutor(path="runs")
    for evs in events:
        (stage,) = plan_step(evs).stages
        for whole in (True, False):  # all tensors at once (execute_stage), and tensor by tensor (execute)
            with MaxElements() as seen:
                if whole:
                    run_stage(ex, stage, pool.exec_tensors, pool.exec_drafts)
                else:
                    for i, t in enumerate(pool.exec_tensors):
                        ex.execute(stage, t, pool.exec_drafts[i] if pool.exec_drafts else None)
            writes = [(f, n) for f, n in seen.seen if "_foreach" in f or "copy" in f or "zero" in f or "fill" in f]
            assert writes, seen.seen
            assert all(n < GRAIN for _, n in writes), writes


def test_a_run_of_slots_under_the_grain_is_cut_slot_by_slot_where_the_run_reaches_it() -> None:
    # Each slot's view (2 layers x 4 x 32 x 65 fp32, 16,640 elements) is under the grain, a run of two is past
    # it: one op over the run would be a parallel region (a clear of 256 slots took 6x a memset with another
    # process computing); each slot is one op under the grain, and the bytes are the reference's.
    spec = mc.StateSpec(num_layers=2, conv_shapes=[(8, 4)], temporal_shape=(4, 32, 65))
    events = [[mc.Clear(s) for s in (1, 2, 3, 6, 7)], [mc.CopyOnWrite(1, 5), mc.CopyOnWrite(2, 6)]]
    moved = []
    for ex in (TorchExecutor(path="runs"), ReferenceExecutor()):
        pool = mc.StatePool(spec, 8)
        random_bytes(pool.tensors, 5)
        for evs in events:
            (stage,) = plan_step(evs).stages
            assert any(r[-1] > 1 for r in stage.runs)  # a run of several slots
            with MaxElements() as seen:
                run_stage(ex, stage, pool.exec_tensors)
            if isinstance(ex, TorchExecutor):
                writes = [(f, n) for f, n in seen.seen if "_foreach" in f]
                assert writes and all(n < GRAIN for _, n in writes), writes
        moved.append([t.view(torch.uint8).clone() for t in pool.tensors])
    assert all(map(torch.equal, *moved))


def test_small_states_keep_one_view_per_slot() -> None:
    # Under the grain already: one strided op per slot and tensor, as before (the decode step's case).
    pool = mc.StatePool(mc.StateSpec(num_layers=4, conv_shapes=[(4, 2)], temporal_shape=(2, 2)), 16)
    ex = TorchExecutor(path="runs")
    (stage,) = plan_step([mc.Clear(3), mc.Clear(7)]).stages
    run_stage(ex, stage, pool.exec_tensors)  # builds the cached views
    with MaxElements() as seen:
        run_stage(ex, stage, pool.exec_tensors)
    assert [f for f, _ in seen.seen] == ["aten._foreach_zero_.default"]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name", list(SPECS))
def test_no_op_of_a_host_stage_reaches_the_grain_and_the_bytes_are_the_references(name: str, paged: bool) -> None:
    stages = host_stages()
    assert {type(s).__name__ for s in stages} == {"OffloadStage", "RestoreStage"}
    assert any(r.length > 1 for s in stages for r in s.runs)  # a run, not only single slots
    moved = []
    for ex in (TorchExecutor(), ReferenceExecutor()):
        pool = make_pool(name, paged)
        host = mc.HostPool(pool.spec, 6)
        random_bytes([*pool.tensors, *host.tensors], 7)
        for stage in stages:
            with MaxElements() as seen:
                run_stage(ex, stage, pool.exec_tensors, None, host.exec_tensors)
            if isinstance(ex, TorchExecutor):
                writes = [(f, n) for f, n in seen.seen if "_foreach" in f or "copy" in f]
                assert writes, seen.seen
                assert all(n < GRAIN for _, n in writes), (type(stage).__name__, writes)
        moved.append([t.view(torch.uint8).clone() for t in (*pool.tensors, *host.tensors)])
    for a, b in zip(*moved, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name", list(SPECS))
@given(raw=host_ops, seed=st.integers(0, 99))
@settings(max_examples=25)
def test_host_stages_in_pieces_move_the_bytes_the_reference_moves(
    name: str, paged: bool, raw: list[Any], seed: int
) -> None:
    moved = []
    for executor in (TorchExecutor(), "reference"):
        pool = make_pool(name, paged)
        host = mc.HostPool(pool.spec, 6)
        random_bytes([*pool.tensors, *host.tensors], seed)
        with mc.CacheManager(pool, executor=executor, host_pool=host) as mgr:
            mgr.alloc(8, clear=False)  # every slot held: the draws offload and restore from the start
            hosts: dict[int, int] = {}
            raw0 = [(k, 0 if k == "alloc" else a, b) for k, a, b in raw]  # alloc draws the lowest free slot
            for events, _, _ in host_events_from_ops(raw0, 8, set(range(1, 9)), 6, set()):
                drive(mgr, events, hosts=hosts)
                mgr.flush_nowait()
        moved.append((pool.allocated_slots(), [t.view(torch.uint8).clone() for t in (*pool.tensors, *host.tensors)]))
    assert moved[0][0] == moved[1][0]
    for a, b in zip(moved[0][1], moved[1][1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name", list(SPECS))
@given(raw=host_ops, seed=st.integers(0, 99))
@settings(max_examples=25)
def test_host_stages_by_memmove_move_the_bytes_the_reference_moves(
    name: str, paged: bool, raw: list[Any], seed: int
) -> None:
    """Every host stage on the calling thread goes by memmove (its threshold lowered to 0 from outside): the
    bytes are the reference's, and a paged pool (rows not one block per layer) keeps the foreach path."""
    calls: list[int] = []
    real = ctypes.memmove

    def spy(dst: int, src: int, count: int) -> int:
        calls.append(count)
        return int(real(dst, src, count))

    moved = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_torch, "MEMMOVE_BYTES", 0)
        mp.setattr(ctypes, "memmove", spy)
        for executor in (TorchExecutor(large_stages="inline"), "reference"):
            pool = make_pool(name, paged)
            host = mc.HostPool(pool.spec, 6)
            random_bytes([*pool.tensors, *host.tensors], seed)
            with mc.CacheManager(pool, executor=executor, host_pool=host) as mgr:
                mgr.alloc(8, clear=False)
                hosts: dict[int, int] = {}
                raw0 = [(k, 0 if k == "alloc" else a, b) for k, a, b in raw]
                for events, _, _ in host_events_from_ops(raw0, 8, set(range(1, 9)), 6, set()):
                    drive(mgr, events, hosts=hosts)
                    mgr.flush_nowait()
            if executor != "reference" and paged:
                assert not calls
            moved.append(
                (pool.allocated_slots(), [t.view(torch.uint8).clone() for t in (*pool.tensors, *host.tensors)])
            )
    assert moved[0][0] == moved[1][0]
    for a, b in zip(moved[0][1], moved[1][1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(SPECS))
def test_a_host_stage_under_a_dispatch_mode_keeps_its_ops_visible(name: str) -> None:
    """memmove bypasses the dispatcher: under a mode (a fault or op-counting one) every host stage keeps its
    torch ops; without one, a large stage is memmoves alone."""
    stages = host_stages()
    pool = make_pool(name, False)
    host = mc.HostPool(pool.spec, 6)
    random_bytes([*pool.tensors, *host.tensors], 3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_torch, "MEMMOVE_BYTES", 0)
        ex = TorchExecutor(large_stages="inline")
        for stage in stages:
            with MaxElements() as seen:
                run_stage(ex, stage, pool.exec_tensors, None, host.exec_tensors)
            assert any("_foreach" in f or "copy" in f for f, _ in seen.seen), seen.seen
        calls: list[int] = []
        real = ctypes.memmove
        mp.setattr(ctypes, "memmove", lambda d, s, n: calls.append(n) or real(d, s, n))
        before = [t.clone() for t in host.tensors]
        for stage in stages:
            run_stage(ex, stage, pool.exec_tensors, None, host.exec_tensors)
        assert calls and all(n > 0 for n in calls)
        assert any(not torch.equal(a, b) for a, b in zip(before, host.tensors, strict=True))
