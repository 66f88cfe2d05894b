"""An interrupt at any line of a flush loses nothing: the next flush leaves exactly what sequential execution leaves.

The sweep: a step with every stage kind (a copy wave, a rotate, zeros, allocs
and releases; with a host tier, offloads, restores and drops too) is queued, and
one flush of it runs under :class:`~tests.support.util.InterruptAtLine`, which raises
``KeyboardInterrupt`` (or ``SystemExit``) at the k-th line executed inside the
package: while the flush takes the events, plans them, runs the stages, makes
the report or traces it. The interrupt must come out of the flush, and the next
flush (no interrupt) must leave every byte as the sequential oracle does, with
nothing left queued or unfinished. Between the two, what the manager says must
be true: nothing queued and nothing unfinished means the step ran.

Which k: every line of the flush under ``MAMBACACHE_FULL_SWEEP=1`` (CI), a
sample otherwise (``tests/support/sweep.py``). The sync flush (``flush_nowait``), the
async one on asyncio and trio, each with and without a host tier, and a flush
that first resumes work an earlier failed flush kept.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

import mambacache as mc
from mambacache import tracing
from mambacache.testing import SequentialOracle, fail_at_op

from ..support.layered import pool_tensors
from ..support.sweep import fault_points
from ..support.util import CancelAtSuspension, InterruptAtLine, every_stage_step, fill_random, small_spec, step_value

N, H = 10, 6


class _Case:
    """A manager with eight live slots, dirty, a step queued and its oracle; maybe work kept from a failed flush."""

    def __init__(self, host: bool, resume: bool) -> None:
        self.pool = mc.StatePool(small_spec(), N)
        self.host = mc.HostPool(self.pool.spec, H) if host else None
        self.mgr = mc.CacheManager(self.pool, host_pool=self.host, max_failed_flushes=1000)
        mgr = self.mgr
        mgr.__enter__()
        slots = mgr.alloc(8)
        mgr.flush_nowait()
        fill_random(self.pool, 7)
        h0 = mgr.offload(slots[7]) if host else None
        mgr.flush_nowait()
        self.oracle = SequentialOracle(self.pool, self.host)
        if resume:  # a failed flush keeps its stages; the swept flush runs them first
            mgr.copy_on_write(slots[6], slots[7])
            mgr.clear(slots[5])
            self.oracle.apply(mgr.queued())
            with pytest.raises(mc.ExecutorError), fail_at_op(2, RuntimeError):
                mgr.flush_nowait()
            assert self.pool.unfinished >= 1
        before = mgr.pending
        every_stage_step(mgr, slots, h0)
        self.oracle.apply(mgr.queued()[before:])
        self.queued, self.ticket = mgr.queued(), self.pool.backlog.taken

    def check_honest(self) -> None:
        """After the interrupted flush: the step's events are all queued, in order, under the ticket they had, or
        none is; a ticket taken and not run is not done; nothing queued and nothing unfinished means every byte
        is the oracle's."""
        backlog = self.pool.backlog
        assert self.mgr.queued() in ([], self.queued)
        if self.mgr.pending:
            assert backlog.taken == self.ticket and backlog.done <= self.ticket
        elif self.pool.unfinished:
            assert backlog.done <= self.ticket
        else:
            self.oracle.assert_matches(self.pool, self.host)

    def repair_and_check(self, report: mc.StepReport | None = None) -> None:
        assert self.mgr.broken is None
        self.oracle.assert_matches(self.pool, self.host)
        assert self.mgr.pending == 0 and self.pool.unfinished == 0
        empty = self.mgr.flush_nowait()
        assert empty.events == 0 and empty.resumed_stages == 0
        self.mgr.__exit__(None, None, None)
        assert self.pool.ledger.owner is None


def _sync_flush(case: _Case, at: int, exc: type[BaseException]) -> int:
    with InterruptAtLine(at, exc) as trace:
        try:
            case.mgr.flush_nowait()
        except exc:
            assert at, "an interrupt came out of a flush with none injected"
        else:
            assert not trace.raised, f"the interrupt at line {at} of {trace.lines} did not come out of the flush"
    return trace.lines


async def _async_flush(case: _Case, at: int, exc: type[BaseException]) -> int:
    with InterruptAtLine(at, exc) as trace:
        try:
            await case.mgr.flush()
        except exc:
            assert at, "an interrupt came out of a flush with none injected"
        else:
            assert not trace.raised, f"the interrupt at line {at} of {trace.lines} did not come out of the flush"
    return trace.lines


def _one(host: bool, resume: bool, at: int, exc: type[BaseException], flush: Callable[..., int]) -> int:
    case = _Case(host, resume)
    lines = flush(case, at, exc)
    case.check_honest()
    case.mgr.flush_nowait()
    case.repair_and_check()
    return lines


async def _one_async(
    host: bool, resume: bool, at: int, exc: type[BaseException], flush: Callable[..., Awaitable[int]]
) -> int:
    case = _Case(host, resume)
    lines = await flush(case, at, exc)
    case.check_honest()
    await case.mgr.flush()
    case.repair_and_check()
    return lines


def _points(total: int) -> list[tuple[int, type[BaseException]]]:
    excs: list[type[BaseException]] = [KeyboardInterrupt, KeyboardInterrupt, SystemExit]
    return [(at, excs[at % len(excs)]) for at in fault_points(total)]


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
@pytest.mark.parametrize("host", [False, True], ids=["pool", "host"])
def test_an_interrupt_at_any_line_of_a_sync_flush_loses_nothing(host: bool, resume: bool) -> None:
    total = _one(host, resume, 0, KeyboardInterrupt, _sync_flush)
    assert total > 50
    for at, exc in _points(total):
        _one(host, resume, at, exc, _sync_flush)


def test_an_interrupt_at_any_line_of_a_traced_flush_loses_nothing(tmp_path: Path) -> None:
    """Tracing on at debug: the flush's trace line is made and written inside the package too."""
    tracing.configure(tmp_path / "trace.jsonl", level="debug")
    try:
        total = _one(True, True, 0, KeyboardInterrupt, _sync_flush)
        for at, exc in _points(total):
            _one(True, True, at, exc, _sync_flush)
    finally:
        tracing.disable()
    assert "step.flush" in (tmp_path / "trace.jsonl").read_text()


@pytest.mark.anyio
@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
@pytest.mark.parametrize("host", [False, True], ids=["pool", "host"])
async def test_an_interrupt_at_any_line_of_an_async_flush_loses_nothing(host: bool, resume: bool) -> None:
    total = await _one_async(host, resume, 0, KeyboardInterrupt, _async_flush)
    assert total > 50
    for at, exc in _points(total):
        await _one_async(host, resume, at, exc, _async_flush)


def test_an_interrupt_while_planning_puts_the_step_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner raising KeyboardInterrupt: the events go back, the interrupt comes out, the next flush runs them."""
    import mambacache._core._flush as flush_module

    case = _Case(host=True, resume=False)
    real = flush_module.plan_step
    n = case.mgr.pending

    def interrupted(events: Any) -> Any:
        raise KeyboardInterrupt("Ctrl-C while planning")

    monkeypatch.setattr(flush_module, "plan_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        case.mgr.flush_nowait()
    assert case.mgr.pending == n
    monkeypatch.setattr(flush_module, "plan_step", real)
    report = case.mgr.flush_nowait()
    assert report.events == n and report.step == 2
    case.repair_and_check()


async def _async_flush_after_calls(case: _Case, at: int, exc: type[BaseException]) -> int:
    with InterruptAtLine(at, exc, after_calls=True) as trace:
        try:
            await case.mgr.flush()
        except exc:
            assert at, "an interrupt came out of a flush with none injected"
        else:
            assert not trace.raised, f"the interrupt at call {at} of {trace.lines} did not come out of the flush"
    return trace.lines


@pytest.mark.anyio
# An interrupt between the call that makes the flush's coroutine and its await leaves that coroutine unawaited.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("host", [False, True], ids=["pool", "host"])
async def test_a_signal_as_any_call_of_an_async_flush_returns_loses_nothing(host: bool) -> None:
    """A real SIGINT is raised as a call returns, maybe before its result is stored (the async flush's
    non-blocking acquire of its mutex, say): the next flush runs, and leaves what the oracle leaves. Every such
    point of the flush's first calls (where it takes its mutex), a sample of the rest."""
    total = await _one_async(host, True, 0, KeyboardInterrupt, _async_flush_after_calls)
    assert total > 50
    for at, exc in _points(total) + [(at, KeyboardInterrupt) for at in range(1, 16)]:
        with anyio.fail_after(10):  # a mutex left held would make the next flush poll for ever
            await _one_async(host, True, at, exc, _async_flush_after_calls)


@pytest.mark.parametrize("host", [False, True], ids=["pool", "host"])
def test_a_signal_as_any_call_of_a_sync_flush_returns_loses_nothing(host: bool) -> None:
    """The sync flush takes its mutex by a ``with``: an interrupt as any of its calls returns leaves it free."""
    total = _one(host, True, 0, KeyboardInterrupt, _sync_flush_after_calls)
    for at, exc in _points(total):
        _one(host, True, at, exc, _sync_flush_after_calls)


def _sync_flush_after_calls(case: _Case, at: int, exc: type[BaseException]) -> int:
    with InterruptAtLine(at, exc, after_calls=True) as trace:
        try:
            case.mgr.flush_nowait()
        except exc:
            assert at, "an interrupt came out of a flush with none injected"
        else:
            assert not trace.raised, f"the interrupt at call {at} of {trace.lines} did not come out of the flush"
    return trace.lines


# -- anyio cancellation at every checkpoint of an async flush -----------------------------------------------------
POLLS = 4  # suspensions of the cancelled flush while another flush holds the mutex


async def _cancelled(host: bool, at: int, how: str) -> int:
    """The async flush of the step, waiting first for another flush (the mutex held for ``POLLS`` of its
    suspensions: without a channel it has no other), cancelled at its suspension ``at``. Cancelled, it took
    nothing; else it ran. Either way the next flush leaves the oracle's bytes, and after a forward writes every
    live slot, the flush after it too: nothing ran twice."""
    case = _Case(host, resume=True)
    mutex = case.mgr._core._mutex
    mutex.acquire()

    def other_flush_ends(n: int) -> None:
        if n == POLLS:
            mutex.release()

    cancel = CancelAtSuspension(at, how, other_flush_ends)
    report = await cancel.run(case.mgr.flush())
    if cancel.suspensions < POLLS:
        mutex.release()
    assert cancel.cancelled == (1 <= at <= POLLS) == (report is None)
    assert case.mgr.queued() == (case.queued if report is None else [])
    case.check_honest()
    await case.mgr.flush()
    case.oracle.assert_matches(case.pool, case.host)
    for slot in sorted(case.oracle.allocated):
        case.oracle.write(slot, step_value(9, slot))
        for t in pool_tensors(case.pool):
            t[:, slot] = step_value(9, slot)
    await case.mgr.flush()
    case.repair_and_check()
    return cancel.suspensions


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["cancel", "deadline"])
@pytest.mark.parametrize("host", [False, True], ids=["pool", "host"])
async def test_an_async_flush_cancelled_at_any_checkpoint_loses_nothing(host: bool, how: str) -> None:
    total = await _cancelled(host, 0, how)
    assert total == POLLS  # uncontended, the flush has no checkpoint
    for at in fault_points(total + 1):
        await _cancelled(host, at, how)
