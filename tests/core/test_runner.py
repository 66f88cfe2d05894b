"""The step runner alone, without a manager: one dispatch, resume after a fault, the failure budget."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mambacache as mc
from mambacache._core._planner import plan_step
from mambacache._core._runner import StepRunner, check_executor, run_stage
from mambacache._executors._base import as_executor, copy_host
from mambacache._executors._reference import ReferenceExecutor
from mambacache._executors._torch import TorchExecutor

from ..support.util import fill_random, small_spec


class Failing(mc.Executor):
    """A reference executor that raises on the calls listed in ``fail_at`` (1-based, counted per call)."""

    name = "failing"

    def __init__(self, fail_at: set[int]) -> None:
        self.inner, self.fail_at, self.calls = ReferenceExecutor(), fail_at, 0

    def _tick(self) -> None:
        self.calls += 1
        if self.calls in self.fail_at:
            raise MemoryError(f"call {self.calls}")

    def execute(self, stage: Any, tensor: torch.Tensor, draft: torch.Tensor | None = None) -> None:
        self._tick()
        self.inner.execute(stage, tensor, draft)

    def execute_host(self, stage: Any, tensor: torch.Tensor, host: torch.Tensor) -> None:
        self._tick()
        self.inner.execute_host(stage, tensor, host)


def mixed_plan() -> mc.Plan:
    return plan_step(
        [mc.CommitDraft(1, 2), mc.Offload(1, 1), mc.CopyOnWrite(2, 3), mc.CopyOnWrite(3, 2), mc.Clear(4),
         mc.Restore(2, 5), mc.CopyOnWrite(6, 7)]
    )  # fmt: skip


def run_all(executor: mc.Executor, pool: mc.StatePool, host: mc.HostPool, plan: mc.Plan) -> None:
    for stage in plan.stages:
        run_stage(executor, stage, pool.exec_tensors, pool.exec_drafts, host.exec_tensors)


@pytest.mark.parametrize("fail_at", [1, 2, 3, 5, 8, 11, 14])
def test_a_stage_resumes_at_the_tensor_that_failed_and_matches_an_uninterrupted_run(fail_at: int) -> None:
    plan = mixed_plan()
    assert len(plan.stages) >= 5
    want_pool, want_host = mc.StatePool(small_spec(), 8, draft_tokens=2), mc.HostPool(small_spec(), 3)
    got_pool, got_host = mc.StatePool(small_spec(), 8, draft_tokens=2), mc.HostPool(small_spec(), 3)
    for p, h in ((want_pool, want_host), (got_pool, got_host)):
        fill_random(p, 3)
        for t in [*p.draft_tensors, *h.tensors]:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())).to(t.dtype))
    run_all(ReferenceExecutor(), want_pool, want_host, plan)
    runner = StepRunner(got_pool, max_failures=3)
    executor = Failing({fail_at})
    got_pool.backlog.push(plan.stages, executor, got_host.exec_tensors)
    with pytest.raises(mc.ExecutorError, match="stage\\(s\\) are kept") as info:
        runner.run(None, 0)
    assert isinstance(info.value.__cause__, MemoryError)
    assert got_pool.unfinished > 0 and runner.broken is None
    left = got_pool.unfinished
    assert runner.run(None, 1) == left and got_pool.unfinished == 0
    for want, got in zip([*want_pool.tensors, *want_host.tensors], [*got_pool.tensors, *got_host.tensors], strict=True):
        assert torch.equal(want, got)


def test_the_failure_budget_breaks_the_runner_and_keeps_the_work() -> None:
    pool = mc.StatePool(small_spec(), 4)
    runner = StepRunner(pool, max_failures=2)
    pool.backlog.push(plan_step([mc.Clear(1)]).stages, Failing(set(range(1, 100))))
    with pytest.raises(mc.ExecutorError) as first:
        runner.run(None, 0)
    assert not isinstance(first.value, mc.ManagerBrokenError)
    with pytest.raises(mc.ManagerBrokenError, match="2 flushes in a row failed"):
        runner.run(None, 1)
    with pytest.raises(mc.ManagerBrokenError):
        runner.raise_if_broken()
    assert pool.unfinished == 1


def test_an_offload_without_host_tensors_is_a_typed_failure() -> None:
    pool = mc.StatePool(small_spec(), 4)
    runner = StepRunner(pool, max_failures=5)
    pool.backlog.push(plan_step([mc.Offload(1, 1)]).stages, ReferenceExecutor(), None)
    with pytest.raises(mc.ExecutorError, match="OffloadStage") as info:
        runner.run(None, 0)
    assert isinstance(info.value.__cause__, mc.InvalidArgumentError)
    assert "without host_pool" in str(info.value.__cause__)


def test_duck_typed_executors_are_adapted_once_and_keep_their_own_paths() -> None:
    calls: list[str] = []

    class Duck:
        name = "duck"

        def execute(self, stage: Any, tensor: torch.Tensor) -> None:  # the two-argument form
            calls.append("execute")
            ReferenceExecutor().execute(stage, tensor)

    class DuckWithHost(Duck):
        def execute_host(self, stage: Any, tensor: torch.Tensor, host: torch.Tensor) -> None:
            calls.append("host")
            copy_host(stage, tensor, host)

    duck = as_executor(Duck())
    assert isinstance(duck, mc.Executor) and duck.name == "duck"
    assert as_executor(duck) is duck and as_executor(object()) is None and as_executor("torch") is None
    pool, host = mc.StatePool(small_spec(), 4), mc.HostPool(small_spec(), 2)
    for stage in plan_step([mc.Clear(1), mc.Offload(2, 1)]).stages:
        run_stage(duck, stage, pool.exec_tensors, None, host.exec_tensors)
    assert calls == ["execute"] * len(pool.tensors)  # the offload took the default copy_host
    calls.clear()
    with_host = as_executor(DuckWithHost())
    assert with_host is not None
    run_stage(with_host, plan_step([mc.Offload(2, 1)]).stages[0], pool.exec_tensors, None, host.exec_tensors)
    assert calls == ["host"] * len(pool.tensors)
    with pytest.raises(TypeError):
        mc.Executor()  # type: ignore[abstract]


def test_whole_stage_paths_are_taken_only_for_a_zero_or_copy_stage_not_yet_started() -> None:
    seen: list[str] = []

    class Whole(TorchExecutor):
        def execute_stage(self, stage: Any, tensors: list[torch.Tensor]) -> bool:
            seen.append(type(stage).__name__)
            return super().execute_stage(stage, tensors)

    pool = mc.StatePool(small_spec(), 6, draft_tokens=1)
    ex = Whole()
    for stage in plan_step([mc.Clear(1), mc.CopyOnWrite(2, 3), mc.CommitDraft(4, 1)]).stages:
        run_stage(ex, stage, pool.exec_tensors, pool.exec_drafts)
    assert seen == ["CopyStage", "ZeroStage"]
    check_executor(ex, pool.exec_tensors, pool.exec_drafts)  # the probe goes through the same dispatch
    assert "RotateStage" not in seen and seen.count("ZeroStage") > 1
