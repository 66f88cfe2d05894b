"""FlushCore: one step's flush, the same core for the sync and the async form.

A flush takes the queued events (or, on a receiving tensor-parallel rank, the
source's plan), plans them, queues the stages behind any unfinished work and
runs it all through the :class:`~mambacache._core._runner.StepRunner`. The two forms
differ only in how they wait: without a channel nothing waits, and both call
:meth:`FlushCore.flush_without_channel` directly (no generator on the
decode-step path); with one, :meth:`FlushCore.over_channel` yields each
blocking call (a plan's send or receive), which the sync driver makes in place
(:func:`drive_in_thread`) and the async one in a worker thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from functools import partial
from typing import Any

import anyio

from .._executors import Executor
from . import _tracer
from ._channel import Channel
from ._errors import DistributedError, InvalidArgumentError, MambaCacheError, PlanError
from ._events import StepReport
from ._planner import Plan, plan_step
from ._queue import StepQueue
from ._runner import StepRunner
from ._worker import run_in_worker, unwrap

__all__ = ["FlushCore"]

Core = Generator[Callable[[], Any], Any, StepReport]
_NO_WAIT = (False,)  # the argument of a non-blocking acquire


class _Open:
    """A flush over a channel between its take (a receiver: its receive) and its push: the queue's mark from
    before it (:meth:`StepQueue.mark`: the step and the ticket it takes), and on the source the plan once made.
    While one is recorded the flush core finishes or undoes it before anything else
    (:meth:`FlushCore.resolve_stopped`)."""

    __slots__ = ("mark", "plan")

    def __init__(self, mark: tuple[list[Any], int, int]) -> None:
        self.mark = mark
        self.plan: Plan | None = None

    @property
    def step(self) -> int:
        return self.mark[1]

    @property
    def ticket(self) -> int:
        return self.mark[2]


class FlushCore:
    """Runs flushes one at a time, from any thread or task.

    Invariants: at most one flush runs (``_mutex``, held across the whole flush,
    the channel's wait included); unfinished work runs before anything newer,
    and while it fails new events stay queued and unplanned, so kept work never
    grows past one step's plan; an exception of any kind (an interrupt included)
    from the take to the push puts the events back (:meth:`take_plan`), and from
    the push on the backlog keeps the work until it ran; once the source has
    taken its events the broadcast and the local run both happen (shielded), or
    the ranks would part. Over a channel, a flush stopped between its take (or
    receive) and its push is resolved (:meth:`resolve_stopped`): its step kept where the
    plan left this rank, undone where it did not, and where the channel cannot
    tell, every later flush is a :class:`DistributedError`.
    """

    __slots__ = (
        "_executor", "_flusher", "_host", "_mutex", "_open", "_parted", "_queue", "_runner", "_slot_bytes", "channel",
    )  # fmt: skip

    def __init__(
        self,
        queue: StepQueue,
        runner: StepRunner,
        executor: Executor,
        host_tensors: list[Any] | None,
        slot_bytes: int,
        channel: Channel | None,
    ) -> None:
        self._queue = queue
        self._runner = runner
        self._executor = executor
        self._host = host_tensors
        self._slot_bytes = slot_bytes
        self.channel = channel
        self._mutex = threading.Lock()
        self._flusher: int | None = None  # the thread holding _mutex
        self._open: _Open | None = None  # a flush over the channel stopped before its push (resolve_stopped)
        self._parted: str | None = None  # why the ranks may disagree: every flush over the channel refuses

    # -- the core --------------------------------------------------------
    def flush_without_channel(self, stream: Any | None) -> StepReport:
        """The whole flush, when no channel makes it wait."""
        runner = self._runner
        if runner.broken is not None:
            runner.raise_if_broken()
        resumed = 0
        if runner.backlog.stages:  # the deque, not the backlog's __len__: this runs on every flush
            # Earlier work first; if it fails again the new events stay queued, unplanned.
            resumed = runner.run(stream, self._queue.step)
        plan, step, _, plan_s = self.take_plan(push=True)
        return self._apply(plan, step, stream, plan_s, resumed)

    def over_channel(self, channel: Channel, stream: Any | None) -> Core:
        """The flush of a tensor-parallel rank, yielding each blocking call (the plan's send or receive).

        First what an earlier flush stopped before its push left (:meth:`resolve_stopped`;
        on the source, a send it began is finished first), then this step.
        """
        self._runner.raise_if_broken()
        opened = self._open
        if opened is not None:
            if opened.plan is not None and channel.sent(opened.step):
                yield partial(channel.send, opened.step, opened.plan)  # finishes it; sends nothing twice
            self.resolve_stopped(send_finished=True)
        if self._parted is not None:
            raise DistributedError(self._parted)
        resumed = len(self._runner.backlog.stages)
        if channel.is_source:
            opened = self._open = _Open(self._queue.mark())
            plan, step, ticket, plan_s = self.take_plan(push=False)
            opened.plan = plan
            yield partial(channel.send, step, plan)
        else:
            opened = self._open = _Open(self._queue.mark())
            step, plan = yield channel.receive
            plan_s = 0.0
            if step != opened.step:
                self._parted = (
                    f"this rank received the plan of step {step} where it awaited step {opened.step}: a plan was"
                    " lost or repeated (a receive stopped before its push, over a channel that keeps no plan),"
                    " so the ranks disagree; rebuild the group"
                )
                raise DistributedError(self._parted)
            ticket = self._queue.follow(step)
        self._runner.push(plan.stages, self._executor, self._host, ticket)
        if not channel.is_source:
            channel.consumed(step)
        self._open = None
        return self._apply(plan, step, stream, plan_s, resumed)

    def resolve_stopped(self, send_finished: bool = False) -> None:
        """Resolve a flush over the channel that stopped between its take (or receive) and its push, wherever
        it stopped: called as it stops and by the next flush (whichever comes first; a repeat is harmless).

        Where the step's plan stayed on this rank (the source's send never let it out, a receiver never pushed
        what it received) the step is undone: the source's events go back to the queue (the next flush plans
        them with whatever came since), a receiver's step and ticket go back, and the channel still holds the
        plan for its next receive. Where it left (the channel's :meth:`~Channel.sent`), or was pushed, the
        step is this rank's: its stages are pushed here, and the next flush finishes the send first
        (``send_finished``: it has). Where the channel cannot tell, the events go back and every later flush over
        the channel raises :class:`DistributedError`: the ranks may disagree, and the group must be rebuilt.
        """
        opened = self._open
        if opened is None:
            return
        channel, queue = self.channel, self._queue
        assert channel is not None
        pushed = self._runner.backlog.holds(opened.ticket)
        if not channel.is_source:
            if pushed:
                channel.consumed(opened.step)
            else:
                queue.untake(opened.mark)  # its step and ticket (a receiver swaps no events out)
        else:
            plan = opened.plan
            sent = channel.sent(opened.step) if plan is not None else False
            if plan is not None and sent:
                if not pushed:
                    self._runner.push(plan.stages, self._executor, self._host, opened.ticket)
                if not send_finished:
                    return  # the next flush finishes the send (a broadcast may be half made), then forgets it
            else:
                queue.untake(opened.mark)  # does nothing once pushed
                if sent is None:
                    self._parted = (
                        f"a flush stopped while its plan of step {opened.step} was being sent, and the channel"
                        " cannot tell whether any rank has it: the ranks may disagree; rebuild the group (new"
                        " channels and managers, the slots' states made again)"
                    )
        self._open = None

    def take_plan(self, push: bool) -> tuple[Plan, int, int, float]:
        """Take the queued events and plan them (and, with ``push``, queue the stages behind any unfinished work):
        ``(plan, step, backlog ticket, seconds)``.

        The one owner of a flush's interrupt contract before its stages run: an
        exception of any kind raised anywhere from the take up to the push
        (an interrupt included) puts the events back at the front of the queue,
        in order, with their step and ticket (:meth:`StepQueue.untake`), then
        propagates: the next flush plans them again, as if this one never ran.
        Once pushed they are the backlog's, which keeps them until they ran.
        A plain failure (out of memory on a huge step, say) comes out as
        :class:`PlanError`; an interrupt as itself.
        """
        queue = self._queue
        mark = queue.mark()
        try:
            events, step, ticket = queue.take()
            t0 = time.perf_counter()
            plan = plan_step(events)
            plan_s = time.perf_counter() - t0
            if push:
                self._runner.push(plan.stages, self._executor, self._host, ticket)
        except BaseException as exc:
            if queue.untake(mark) and isinstance(exc, Exception):
                raise PlanError(
                    f"planning step {mark[1]} ({len(mark[0])} events) failed: {exc!r}; the events are queued again"
                ) from exc
            raise
        return plan, step, ticket, plan_s

    def _apply(self, plan: Plan, step: int, stream: Any | None, plan_s: float, resumed: int) -> StepReport:
        """Run the backlog, the plan's stages pushed last, oldest first, and report the step.

        The plan was pushed under its ticket even with no stages, so that the
        ticket counts as done (``Backlog.done``) exactly when all it took ran.
        """
        t1 = time.perf_counter()
        runner = self._runner
        if runner.backlog.stages:
            runner.run(stream, step)
        report = StepReport.from_plan(
            plan, step, self._slot_bytes, plan_s=plan_s, execute_s=time.perf_counter() - t1, resumed_stages=resumed
        )
        _tracer.tracer.flushed(report)
        return report

    # -- closing ---------------------------------------------------------
    def _begin_close(self) -> bool:
        """Refuse new submits (and new sends) from here on; True when a final flush has work to do."""
        queued = self._queue.begin_close()
        # In tensor-parallel mode every rank flushes on exit, so the ranks stay in step.
        return queued or self.channel is not None or bool(self._runner.pending)

    def _finish_close(self) -> None:
        # What no flush took (the manager was broken, or the backlog failed) is planned
        # into the pool's backlog, so the next manager on this pool runs it first.
        # The pool stays claimed until then: a manager opened on it meanwhile would run newer work first.
        events, ticket = self._queue.close()
        try:
            self._runner.push(plan_step(events).stages if events else (), self._executor, self._host, ticket)
        finally:
            self._queue.release()

    def close_sync(self, exc: BaseException | None) -> None:
        """Leave the manager's ``with`` block: a last flush, then closed for good (``exc``: the block's error)."""
        try:
            if self._begin_close():
                self.flush_sync(None)
        except MambaCacheError as flush_error:
            _raise_unless_masking(exc, flush_error)
        finally:
            self._finish_close()

    async def close_async(self, exc: BaseException | None) -> None:
        """:meth:`close_sync` for ``async with``; the last flush is shielded from cancellation."""
        try:
            if self._begin_close():
                with anyio.CancelScope(shield=True):
                    await self.flush_async(None)
        except MambaCacheError as flush_error:
            _raise_unless_masking(exc, flush_error)
        finally:
            self._finish_close()

    # -- the two drivers -------------------------------------------------
    async def flush_async(self, stream: Any | None) -> StepReport:
        mutex = self._mutex
        # No checkpoint when uncontended: a flush is a few microseconds of host work.
        # Contended (another thread flushes, or a tensor-parallel flush awaits its
        # broadcast): poll, so that cancelling the wait is clean. `held` is filled by the
        # call that acquires (a slice store consuming a map, all in C): an interrupt from a
        # signal, raised as a call returns, cannot come between the acquire and its record.
        delay = 0.0
        held = [False]
        try:
            held[:] = map(mutex.acquire, _NO_WAIT)
            while not held[0]:
                await anyio.sleep(delay)
                delay = min(0.001, delay + 0.0001)
                held[:] = map(mutex.acquire, _NO_WAIT)
            if self.channel is None:
                return self.flush_without_channel(stream)  # no wait, no checkpoint
            self._flusher = threading.get_ident()
            core = self.over_channel(self.channel, stream)
            # Shielded, bounded by the channel's timeout: see the class invariants.
            cancelled: list[BaseException] = []  # asyncio's own cancellation, raised once the flush ran
            with anyio.CancelScope(shield=True):
                try:
                    call = next(core)
                    while True:
                        call = core.send(await _in_worker(call, cancelled))
                except StopIteration as done:
                    report: StepReport = done.value
                except BaseException:
                    self.resolve_stopped()
                    raise
            if cancelled:
                raise cancelled[0]
            return report
        finally:
            if held[0]:
                self._flusher = None
                mutex.release()

    def flush_sync(self, stream: Any | None) -> StepReport:
        me = threading.get_ident()
        if self._flusher == me and self._mutex.locked():
            raise InvalidArgumentError(
                "flush_nowait() while a flush of this thread is awaiting (a tensor-parallel broadcast):"
                " it would deadlock; await that flush instead"
            )
        with self._mutex:
            if self.channel is None:
                return self.flush_without_channel(stream)
            self._flusher = me  # only a flush over a channel waits
            try:
                return drive_in_thread(self.over_channel(self.channel, stream))
            except BaseException:
                self.resolve_stopped()
                raise
            finally:
                self._flusher = None


async def _in_worker(call: Callable[[], Any], cancelled: list[BaseException]) -> Any:
    """``call()`` in a worker thread, waited for to its end even when the task is cancelled meanwhile.

    Under the flush's shield anyio's cancellation never comes here, but
    asyncio's own does (``Task.cancel()``: ``asyncio.timeout``, ``wait_for``, a
    ``TaskGroup``), and the thread runs on regardless: this waits for it, so
    that the flush knows what the call did, and the cancellation (appended
    to ``cancelled``) is raised at the flush's end, as the shield would have
    delivered it. A call the cancellation came before is made again: the flush
    runs to its end either way.
    """
    while (outcome := await run_in_worker(call, cancelled)) is None:
        pass
    return unwrap(outcome)


def drive_in_thread(core: Core) -> StepReport:
    """Drive a flush core, making each blocking call it yields in this thread."""
    try:
        call = next(core)
        while True:
            call = core.send(call())
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def _raise_unless_masking(exc: BaseException | None, flush_error: MambaCacheError) -> None:
    if exc is None:
        raise flush_error
    # The block is already failing: its error is the one to see, not this echo of it.
    if hasattr(exc, "add_note"):
        exc.add_note(f"mambacache: the flush on leaving the block failed too: {flush_error!r}")
