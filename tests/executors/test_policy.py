"""The torch executor's policy for large CPU stages (mambacache/_executors/_policy.py): per stage shape, the way
measured fastest, another way looked at again now and then, at a bounded cost.

Times here come from a fake clock: a way's cost is whatever the test says, so what is checked is the policy's
choice and its cost bound, never the host's speed.
"""

from __future__ import annotations

import ctypes
import math
from collections import Counter
from typing import Any

import pytest
import torch

import mambacache as mc
from mambacache._core._runner import run_stage
from mambacache._executors import _torch
from mambacache._executors._policy import SOON, Policy
from mambacache._executors._reference import ReferenceExecutor
from mambacache._executors._torch import TorchExecutor

from ..support.large import host_stages, make_pool, random_bytes, shared

WAYS = ("crew", "inline", "whole")


def _drive(policy: Policy, costs: dict[str, float], stages: int, key: str = "k") -> Counter[str]:
    """``stages`` stages of one shape, each way costing ``costs[way]`` seconds a byte; the ways picked."""
    picked: Counter[str] = Counter()
    for _ in range(stages):
        way = policy.pick(key, WAYS)
        picked[way] += 1
        policy.record(key, way, costs[way] * 1000, 1000)
    return picked


def test_the_fastest_way_runs_and_the_others_cost_a_bounded_share() -> None:
    policy = Policy(patience=128)
    costs = {"crew": 1.0, "inline": 2.0, "whole": 50.0}
    picked = _drive(policy, costs, 20_000)
    assert policy.best("k") == "crew"
    spent = sum(costs[w] * n for w, n in picked.items())
    # While the looks back off from SOON to the patience: a one-time 2 (r - 1) log2(patience / SOON) per way.
    backoff = sum(2 * (costs[w] - 1) * math.log2(128 / SOON) for w in ("inline", "whole"))
    assert spent <= 20_000 * costs["crew"] * (1 + 2 * 2 / 128) + backoff
    # Then each slower way costs under 2 / patience of the shape's time, whatever its slowdown.
    picked = _drive(policy, costs, 20_000)
    spent = sum(costs[w] * n for w, n in picked.items())
    assert spent <= 20_000 * costs["crew"] * (1 + 2 * 2 / 128)
    assert picked["whole"] >= 2  # it is looked at again, not dropped for good


def test_a_first_look_a_cold_run_misled_is_corrected_soon() -> None:
    # The whole way's first run is 20x its speed (the engine starting: pages touched for the first time), 10x
    # the crew's: one run only, and the shape runs the crew. Its looks start SOON, not after patience * 10.
    policy = Policy(patience=128)
    cold = {"crew": 2.0, "inline": 3.0, "whole": 20.0}
    _drive(policy, cold, len(WAYS))
    assert policy.best("k") == "crew"
    picked = _drive(policy, {"crew": 2.0, "inline": 3.0, "whole": 1.0}, 2 * SOON * 10 + 4)
    assert policy.best("k") == "whole"
    assert picked["whole"] >= 2
    # A look at each slower way starts soon again after the change, then backs off.
    assert _drive(policy, {"crew": 2.0, "inline": 3.0, "whole": 1.0}, 40)["whole"] >= 34


def test_a_change_of_load_moves_the_shape_to_the_way_now_fastest() -> None:
    policy = Policy(patience=128)
    _drive(policy, {"crew": 1.0, "inline": 2.0, "whole": 4.0}, 1000)
    assert policy.best("k") == "crew"
    # The crew's helpers now wait for a competing process: two slow runs of it, then a fresh look at the ways
    # that were faster than that: inline's one run beats it, and the shape runs inline from then on.
    picked = _drive(policy, {"crew": 6.0, "inline": 2.0, "whole": 40.0}, 8)
    assert policy.best("k") == "inline"
    assert picked == Counter({"inline": 6, "crew": 2})
    # Within 50 stages: the crew looked at again soon after the change, twice (one run each, backing off), and
    # whole once, due from its time before the change (4x inline's); its run shows 40x, and it waits its turn.
    assert _drive(policy, {"crew": 6.0, "inline": 2.0, "whole": 40.0}, 50) == Counter(
        {"inline": 47, "crew": 2, "whole": 1}
    )
    # The host quiet again: the crew is looked at again within patience * 6 / 2 stages, and wins back.
    _drive(policy, {"crew": 1.0, "inline": 2.0, "whole": 4.0}, 128 * 3 + 4)
    assert policy.best("k") == "crew"


def test_one_slow_run_does_not_exile_the_fastest_way() -> None:
    policy = Policy(patience=128)
    _drive(policy, {"crew": 1.0, "inline": 2.0, "whole": 4.0}, 100)
    policy.record("k", "crew", 50_000, 1000)  # a run descheduled for a while
    assert policy.best("k") == "crew"


def test_shapes_are_kept_apart() -> None:
    policy = Policy()
    _drive(policy, {"crew": 1.0, "inline": 2.0, "whole": 4.0}, 50, key="a")
    _drive(policy, {"crew": 3.0, "inline": 2.0, "whole": 1.0}, 50, key="b")
    assert (policy.best("a"), policy.best("b")) == ("crew", "whole")


class _Clock:
    """A fake ``time`` module for the executor: each way advances it by its cost; nothing else does."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_the_executor_runs_a_large_stage_the_way_measured_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    # Costs injected per way (crew 3, inline 1, whole 10 units a stage): after each way's first look the copy
    # stages run inline, and the bytes are the reference executor's whichever way ran.
    clock = _Clock()
    real_views, real_whole = _torch._run_views, _torch._whole_runs

    def views(stage: Any, entries: Any, share: bool, slot_bytes: Any = None) -> None:
        clock.now += 3.0 if share else 1.0
        real_views(stage, entries, share, slot_bytes)

    def whole(stage: Any, entries: Any) -> None:
        clock.now += 10.0
        real_whole(stage, entries)

    monkeypatch.setattr(_torch, "time", clock)
    monkeypatch.setattr(_torch, "_run_views", views)
    monkeypatch.setattr(_torch, "_whole_runs", whole)
    executor = TorchExecutor()
    pools = []
    for ex in (executor, "reference"):
        pool = make_pool("wide", False)
        random_bytes(pool.tensors, 3)
        with shared(), mc.CacheManager(pool, executor=ex) as mgr:
            mgr.alloc(8, clear=False)
            for step in range(12):
                srcs, dsts = ([1, 2, 3, 4], [5, 6, 7, 8]) if step % 2 else ([5, 6, 7, 8], [1, 3, 2, 4])
                mgr.copy_many(srcs, dsts)
                mgr.flush_nowait()
        pools.append(pool)
    keys = list(executor.policy._shapes)
    assert keys and {executor.policy.best(k) for k in keys if k[0] == "copy"} == {"inline"}
    for a, b in zip(pools[0].tensors, pools[1].tensors, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_the_first_looks_run_each_way_twice_in_turn() -> None:
    # One run alone may be a scheduler slice slower than its way: each way runs twice, interleaved, before the
    # fastest is picked, and a way's time is the lower of its two.
    policy = Policy()
    costs = {"crew": [9.0, 1.0], "inline": [2.0, 2.0], "whole": [4.0, 4.0]}  # the crew's first run descheduled
    picked = []
    for _ in range(2 * len(WAYS)):
        way = policy.pick("k", WAYS)
        picked.append(way)
        policy.record("k", way, costs[way].pop(0) * 1000, 1000)
    assert picked == [*WAYS, *WAYS]
    assert policy.best("k") == "crew"


def test_a_way_far_slower_at_its_first_run_is_not_run_twice() -> None:
    # A parallel region per op under contention is tens of times slower: its first look is one run.
    policy = Policy()
    costs = {"crew": 1.0, "inline": 2.0, "whole": 60.0}
    picked = _drive(policy, costs, 2 * len(WAYS))
    assert picked == Counter({"crew": 3, "inline": 2, "whole": 1})
    assert policy.best("k") == "crew"


@pytest.mark.parametrize("name", ["wide", "narrow"])
def test_the_policys_inline_way_moves_a_host_stage_by_memmove(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``large_stages="auto"``, a host stage the policy runs inline goes by memmove, as every host stage of
    the inline setting does (the way the policy times is the one the inline executor runs), with the
    reference's bytes."""

    class Inline(Policy):
        def pick(self, key: Any, ways: Any) -> str:
            super().pick(key, ways)
            return "inline"

    calls: list[int] = []
    real = ctypes.memmove
    monkeypatch.setattr(_torch, "Policy", Inline)
    monkeypatch.setattr(_torch, "MEMMOVE_BYTES", 0)
    monkeypatch.setattr(ctypes, "memmove", lambda d, s, n: calls.append(n) or real(d, s, n))
    moved = []
    with shared(chunk_bytes=64):
        for ex in (TorchExecutor(large_stages="auto"), ReferenceExecutor()):
            pool = make_pool(name, False)
            host = mc.HostPool(pool.spec, 6)
            random_bytes([*pool.tensors, *host.tensors], 5)
            for stage in host_stages():
                run_stage(ex, stage, pool.exec_tensors, None, host.exec_tensors)
            moved.append([t.view(torch.uint8).clone() for t in (*pool.tensors, *host.tensors)])
            if isinstance(ex, TorchExecutor):
                assert calls and ex.policy is not None
                assert all(way == "inline" for way in (ex.policy.best(k) for k in ex.policy._shapes) if way)
    for a, b in zip(*moved, strict=True):
        assert torch.equal(a, b)
