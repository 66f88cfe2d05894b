"""The step runner: planned stages onto a pool's tensors, with the failure budget.

One dispatch, :func:`run_stage`, turns a stage into executor calls (the manager,
the benchmark and ``check_executor`` all use it); :class:`StepRunner` runs a
pool's backlog through it, oldest stage first, and owns what a fault leaves:
the stage and tensor to resume at (in the pool's :class:`Backlog`, which
outlives the manager) and the count of failures in a row; when that budget is
spent it reports it to the manager's :class:`~mambacache._core._lifecycle.Lifecycle`,
which then refuses work.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from .._executors._base import Executor, on_stream
from . import _tracer
from ._backlog import Backlog
from ._errors import ExecutorError, InvalidArgumentError, ManagerBrokenError, UnsupportedDtypeError
from ._lifecycle import Lifecycle
from ._planner import (
    CommitStage,
    CopyStage,
    OffloadStage,
    RestoreStage,
    RotateStage,
    ShiftStage,
    Stage,
    ZeroStage,
    copy_runs,
    shift_stage,
    zero_runs,
)

__all__ = ["StepRunner", "check_executor", "run_stage"]


class _Cursor:
    __slots__ = ("next_tensor",)

    def __init__(self) -> None:
        self.next_tensor = 0


def run_stage(
    executor: Executor,
    stage: Stage,
    tensors: list[torch.Tensor],
    drafts: list[torch.Tensor] | None = None,
    host: list[torch.Tensor] | None = None,
    cursor: Backlog | _Cursor | None = None,
    convs: int = 0,
) -> None:
    """Run ``stage`` on each of ``tensors`` from ``cursor.next_tensor`` on, advancing it per tensor done.

    The one place a stage becomes executor calls: offloads and restores go to
    ``execute_host`` with the matching ``host`` tensor, commits to ``execute``
    with the matching draft buffer, and a zero or copy stage not yet started to
    ``execute_stage`` first (all tensors at once; idempotent, so a fault inside
    it just leaves the whole stage to redo), then to ``execute`` per tensor.
    A shift stage goes to ``execute`` on the first ``convs`` tensors (the conv
    states, whose last axis is time) and as its whole-copy part on the others.
    A raise leaves ``cursor`` at the tensor that failed: calling again resumes.
    """
    cur = cursor if cursor is not None else _Cursor()
    kind = type(stage)
    others: list[torch.Tensor] | None = None
    if kind is OffloadStage or kind is RestoreStage:
        if host is None:  # a tensor-parallel rank made without the source rank's host_pool
            raise InvalidArgumentError("an offload or restore reached a CacheManager made without host_pool")
        others, run = host, executor.execute_host
    else:
        if (kind is ZeroStage or kind is CopyStage) and cur.next_tensor == 0 and executor.execute_stage(stage, tensors):
            cur.next_tensor = len(tensors)
            return
        run = executor.execute  # type: ignore[assignment]
        if kind is CommitStage:
            others = drafts
        elif kind is ShiftStage:
            _run_shift(executor, stage, tensors, cur, convs)  # type: ignore[arg-type]
            return
    n = len(tensors)
    while cur.next_tensor < n:
        i = cur.next_tensor
        if others is None:
            run(stage, tensors[i])  # type: ignore[call-arg, arg-type]
        else:
            run(stage, tensors[i], others[i])  # type: ignore[arg-type]
        cur.next_tensor = i + 1


def _run_shift(executor: Executor, stage: ShiftStage, tensors: list[torch.Tensor], cur: Any, convs: int) -> None:
    """A shift stage, tensor by tensor: shifted on the conv tensors, its whole-copy part (each pair's temporal
    source to its destination, :class:`ShiftStage`) on the rest."""
    whole = stage.copy
    for i in range(cur.next_tensor, len(tensors)):
        if i < convs:
            executor.execute(stage, tensors[i])
        elif whole.pairs:
            executor.execute(whole, tensors[i])
        cur.next_tensor = i + 1


def _probe_stages() -> list[Stage]:
    # One of each stage kind, few runs and many, so that every code path an
    # executor picks by run count is taken: 11 slots + padding.
    def zero(*slots: int) -> ZeroStage:
        return ZeroStage(slots, zero_runs(slots))

    def copy(*pairs: tuple[int, int]) -> CopyStage:
        return CopyStage(pairs, copy_runs(pairs))

    return [
        zero(1, 2),
        zero(1, 3, 5, 7, 9, 11),
        copy((1, 2)),
        copy((1, 2), (3, 4), (5, 6), (7, 8), (9, 10)),
        RotateStage(((1, 2), (3, 4, 5))),
    ]


def check_executor(
    executor: Executor, tensors: list[torch.Tensor], drafts: list[torch.Tensor] | None = None, convs: int = 0
) -> None:
    """Run every stage kind once on a small scratch tensor of each dtype in ``tensors``.

    The first ``convs`` tensors are conv states: they are probed with a shift
    stage too, on a scratch of their whole state shape (time last).

    Stages go through :func:`run_stage`, so the probe takes the paths a flush takes.
    Raises :class:`InvalidArgumentError` for a paged pool on an executor that
    does not take one, and :class:`UnsupportedDtypeError` naming the dtype and executor when one
    fails, so a pool that could zero and copy but never swap is refused when the
    manager is made, not on the first swap with work piling up behind it.
    """
    if not executor.takes_paged and not all(t.is_contiguous() for t in [*tensors, *(drafts or [])]):
        raise InvalidArgumentError(
            f"executor {executor.name!r} needs contiguous pool tensors; this pool's are paged (only each"
            " (layer, slot) row is contiguous): use the torch executor"
        )
    with torch._C._InferenceMode(True):  # the mode the runner runs stages under (StepRunner.run)
        _probe(executor, tensors, drafts, convs)


def _probe(executor: Executor, tensors: list[torch.Tensor], drafts: list[torch.Tensor] | None, convs: int) -> None:
    seen: set[tuple[torch.dtype, tuple[int, ...]]] = set()
    for i, t in enumerate(tensors):
        key = (t.dtype, tuple(t.shape[2:] if i < convs else t.shape[2:3]))  # a conv's width matters to a shift
        if key in seen:
            continue
        seen.add(key)
        # Keep the state's leading dim (rows), so a workspace bound is probed on real row sizes.
        scratch = torch.zeros((2, 12, *t.shape[2:3]), dtype=t.dtype, device=t.device)
        # (stage, the tensor it runs on, the draft buffer a commit reads)
        probes: list[tuple[Stage, torch.Tensor, torch.Tensor | None]] = [(s, scratch, None) for s in _probe_stages()]
        if drafts:
            k = drafts[i].shape[2]
            draft = torch.zeros((2, 12, k, *t.shape[2:3]), dtype=t.dtype, device=t.device)
            probes.append((CommitStage(((1, 0, 2), (3, k - 1, 4), (5, 0, 5))), scratch, draft))
        if i < convs and t.shape[-1] > 1:
            windows = torch.zeros((2, 12, *t.shape[2:]), dtype=t.dtype, device=t.device)
            probes.append((shift_stage(1, [(1, 2), (3, 3), (5, 4)]), windows, None))
            probes.append((shift_stage(0, [(1, 2), (3, 3)], [6, 7]), windows, None))  # a split copy's shift 0
        for stage, target, draft_scratch in probes:
            try:
                # convs=1: a shift stage treats its one tensor as a conv state; other stages ignore it
                run_stage(executor, stage, [target], None if draft_scratch is None else [draft_scratch], convs=1)
            except Exception as exc:
                raise UnsupportedDtypeError(
                    f"executor {executor.name!r} cannot run a {type(stage).__name__} on {t.dtype} tensors on"
                    f" {t.device}: {exc}"
                ) from exc


class StepRunner:
    """Runs a pool's backlog, oldest stage first, and counts flushes that failed in a row.

    Invariants: a stage leaves the backlog only once every tensor ran it; a
    fault leaves the backlog at the stage and tensor that failed, so running
    again resumes exactly there (see the resume contract of :class:`Executor`);
    after ``max_failures`` failures in a row it reports the manager broken for good
    to its lifecycle (:meth:`Lifecycle.broke`), which refuses work from then on,
    while the backlog stays in the pool for the next manager opened on it.
    """

    __slots__ = (
        "_convs", "_cpu", "_device", "_drafts", "_failures", "_max_failures", "_tensors", "backlog", "life",
    )  # fmt: skip

    def __init__(self, pool: Any, max_failures: int, life: Lifecycle | None = None) -> None:
        """``life``: the manager's lifecycle, told when the budget is spent (a runner of its own without one)."""
        self.backlog: Backlog = pool.backlog  # the flush core reads its length on every step: no property
        self._tensors: list[torch.Tensor] = pool.exec_tensors
        self._drafts: list[torch.Tensor] = pool.exec_drafts
        self._convs: int = pool.exec_convs  # exec_tensors start with the conv states' layer groups
        self._device: torch.device = pool.device
        self._cpu = self._device.type == "cpu"  # on_stream would be a no-op
        self._max_failures = max_failures
        self._failures = 0
        self.life = life if life is not None else Lifecycle(threading.Lock())

    @property
    def broken(self) -> str | None:
        """Why the failure budget broke the manager (its lifecycle's record), or None."""
        return self.life.why

    def raise_if_broken(self) -> None:
        """Raise :class:`ManagerBrokenError` once the failure budget is spent."""
        self.life.raise_if_broken()

    @property
    def pending(self) -> int:
        """Stages in the backlog: kept by failed flushes, or pushed and not run yet."""
        return len(self.backlog)

    def push(self, stages: Sequence[Stage], executor: Executor, host: list[torch.Tensor] | None, ticket: int) -> None:
        """Queue ``stages`` of ``ticket`` behind the backlog, to run on ``executor`` (with ``host``'s tensors)."""
        self.backlog.push(stages, executor, host, ticket)

    def check(self, executor: Executor) -> None:
        """:func:`check_executor` on this pool's tensors: refuse an executor that cannot run a dtype."""
        check_executor(executor, self._tensors, self._drafts, self._convs)

    def run(self, stream: Any | None, step: int) -> int:
        """Run the backlog to the end on ``stream``; returns the stages run.

        On a fault the failed stage stays at the head of the backlog and this
        raises :class:`ExecutorError` (or :class:`ManagerBrokenError` once the
        budget is spent).

        Stages run under inference mode, whatever the caller's (a thread's own):
        a pool allocated under it holds inference tensors, which refuse an
        in-place op outside it, and what an executor keeps from one flush to the
        next (views of the pool, a workspace, a rotate's saved reads) made under
        it is an inference tensor too, so a pool flushed in and out of the mode,
        from any thread, must see one mode only. On normal tensors the ops and
        their results are the same. The guard is the C one: entered and left
        with no Python line between, where an interrupt could strand it.
        """
        if not torch.is_inference_mode_enabled():
            with torch._C._InferenceMode(True):
                return self.run(stream, step)
        if self._cpu:  # no stream to make current: the decode step's path skips the context manager
            return self._run(step)
        with on_stream(self._device, stream):
            return self._run(step)

    def _run(self, step: int) -> int:
        backlog = self.backlog
        stages = backlog.stages
        done = 0
        while stages:
            entry = stages[0]
            if backlog.head is not entry:  # else it ran part-way: resume at next_tensor
                backlog.begin(entry)
            stage, executor, host, _ = entry
            try:
                run_stage(executor, stage, self._tensors, self._drafts, host, backlog, self._convs)
            except Exception as exc:
                raise self._failed(exc, executor, stage, step) from exc
            backlog.pop_done()  # its ticket's work may now count as done (Backlog.done)
            done += 1
        self._failures = 0
        return done

    def _failed(self, exc: Exception, executor: Executor, stage: Stage, step: int) -> ExecutorError:
        left = len(self.backlog)
        self._failures += 1
        where = f"executor {executor.name!r} failed on {type(stage).__name__} (tensor {self.backlog.next_tensor})"
        _tracer.tracer.failed(step, type(stage).__name__, repr(exc), self._failures)
        if self._failures >= self._max_failures:
            why = (
                f"CacheManager is broken: {self._failures} flushes in a row failed (last: {where}: {exc!r});"
                f" the pool keeps {left} unfinished stage(s) for the next manager opened on it"
            )
            self.life.broke(why)
            return ManagerBrokenError(why)
        return ExecutorError(f"{where}; {left} stage(s) are kept and run first by the next flush")
