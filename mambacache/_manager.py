"""CacheManager: queues slot events from any task and runs them once per step."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from . import _tracing
from ._errors import (
    ExecutorError,
    InvalidArgumentError,
    InvalidEventError,
    InvalidSlotError,
    MambaCacheError,
    ManagerClosedError,
    SlotStateError,
)
from ._events import Alloc, Clear, CopyOnWrite, Event, Release, StepReport
from ._executors import Executor, resolve_executor
from ._executors._base import on_stream
from ._planner import Plan, Stage, plan_step
from ._pool import StatePool

if TYPE_CHECKING:
    from ._distributed import PlanChannel

__all__ = ["CacheManager"]

_NEW, _OPEN, _CLOSED = range(3)
_REPORT_FIELDS = tuple(f.name for f in dataclasses.fields(StepReport) if not f.name.endswith("_s"))


class CacheManager:
    """Batches a step's slot events and applies them with exactly sequential semantics.

    Invariants:

    * the pool's allocated set is the allocation state at the *end* of the event
      queue: ``alloc`` and ``release`` update it at once, and every event is
      validated against the state at its own point of the order;
    * a flush leaves every allocated slot as running all queued events one at a
      time, in submission order, would (see ``docs/semantics.md``);
    * nothing is lost: a submit that fails changes nothing; a flush whose
      executor fails keeps the unfinished (stage, tensor) work, and the next flush
      runs it before anything newer.

    Submitting (``alloc``, ``clear``, ``copy_on_write``, ``release``, ``submit``)
    is synchronous and thread-safe; ``flush`` is awaited by one task at a time.
    """

    def __init__(
        self,
        pool: StatePool,
        executor: Any = None,
        copy_workspace_bytes: int = 64 << 20,
        *,
        group: Any = None,
        src_rank: int = 0,
        timeout: float = 300.0,
        clear_on_alloc: bool = True,
    ) -> None:
        if not isinstance(pool, StatePool):
            raise InvalidArgumentError(f"pool must be a StatePool, got {type(pool).__name__}")
        if type(copy_workspace_bytes) is not int or copy_workspace_bytes < 1:
            raise InvalidArgumentError(f"copy_workspace_bytes must be a positive int, got {copy_workspace_bytes!r}")
        self._pool = pool
        self._clear_on_alloc = bool(clear_on_alloc)
        self._executor: Executor = resolve_executor(executor, pool.device, copy_workspace_bytes)
        self._lock = threading.Lock()  # guards the queue, the step number and the pool's free list
        self._events: list[Event] = []
        self._step = 0
        self._state = _NEW
        self._flush_lock: anyio.Lock | None = None
        # Work of a failed flush: stages still to run, and the first tensor of the head stage.
        self._unfinished: collections.deque[Stage] = collections.deque()
        self._next_tensor = 0
        self._tp: PlanChannel | None = None
        if group is not None:
            from ._distributed import PlanChannel

            self._tp = PlanChannel(group, src_rank, pool, timeout)

    # -- lifecycle -------------------------------------------------------
    async def __aenter__(self) -> CacheManager:
        if self._state != _NEW:
            raise ManagerClosedError("a CacheManager can be entered once")
        if self._pool._manager is not None:
            raise InvalidArgumentError("this pool is already managed by another open CacheManager")
        self._pool._manager = self
        self._flush_lock = anyio.Lock()
        self._state = _OPEN
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            # In tensor-parallel mode every rank flushes on exit, so the ranks stay in step.
            if self._tp is not None or self._events or self._unfinished:
                with anyio.CancelScope(shield=True):
                    await self.flush()
        except MambaCacheError as flush_error:
            if exc is None:
                raise
            # The block is already failing: its error is the one to see, not this echo of it.
            if hasattr(exc, "add_note"):
                exc.add_note(f"mambacache: the flush on leaving the block failed too: {flush_error!r}")
        finally:
            self._state = _CLOSED
            self._pool._manager = None

    def _check_open(self) -> None:
        if self._state != _OPEN:
            what = "closed" if self._state == _CLOSED else "not entered (use `async with`)"
            raise ManagerClosedError(f"CacheManager is {what}")

    # -- properties ------------------------------------------------------
    @property
    def executor(self) -> Executor:
        return self._executor

    @property
    def pool(self) -> StatePool:
        return self._pool

    @property
    def step(self) -> int:
        """The step the next flush runs; queued events belong to it."""
        return self._step

    @property
    def clear_on_alloc(self) -> bool:
        """Whether ``alloc`` zeroes new slots by default."""
        return self._clear_on_alloc

    @property
    def pending(self) -> int:
        """Events queued for the next flush."""
        return len(self._events)

    # -- submitting ------------------------------------------------------
    def alloc(self, n: int, request_id: str | None = None, *, clear: bool | None = None) -> list[int]:
        """Allocate ``n`` slots; each reads as zeros after the next flush (unless a later copy targets it).

        ``clear=False`` (default: the manager's ``clear_on_alloc``) skips the zeroing, for
        a scheduler that always forks or clears a new slot itself.
        """
        self._check_open()
        if clear is None:
            clear = self._clear_on_alloc
        if type(n) is not int or n < 0:
            raise InvalidArgumentError(f"alloc count must be a non-negative int, got {n!r}")
        if self._tp is not None:
            self._tp.check_source("alloc")
        _check_request_id(request_id)
        with self._lock:
            slots = self._pool._take(n)
            self._events.extend([Alloc(s, request_id, clear) for s in slots])
            log, step = _tracing.state.slot_log, self._step
        if log is not None:
            for s in slots:
                log.debug("slot.alloc", slot=s, request_id=request_id, step=step, cleared=clear)
        return slots

    def clear(self, slot: int, request_id: str | None = None) -> None:
        self._check_open()
        self._submit((Clear(slot, request_id),))

    def release(self, slot: int, request_id: str | None = None) -> None:
        self._check_open()
        self._submit((Release(slot, request_id),))

    def copy_on_write(self, src: int, dst: int, request_id: str | None = None) -> None:
        self._check_open()
        self._submit((CopyOnWrite(src, dst, request_id),))

    def submit(self, *events: Clear | CopyOnWrite | Release) -> None:
        """Queue ``events`` in order, all or none: any invalid event raises and queues nothing."""
        self._check_open()
        self._submit(events)

    def _submit(self, events: tuple[Any, ...]) -> None:
        # One pass validates everything before anything changes; the hot path of
        # every submit, so checks are inlined.
        if self._tp is not None:
            self._tp.check_source("submit")
        pool = self._pool
        n = pool.num_slots
        with self._lock:
            allocated = pool._allocated
            released: dict[int, None] | None = None  # ordered: freed in release order
            for ev in events:
                t = type(ev)
                if t is CopyOnWrite:
                    a, b = ev.src, ev.dst
                    if type(a) is not int or not 0 < a <= n:
                        raise _bad_slot(a, n)
                    if type(b) is not int or not 0 < b <= n:
                        raise _bad_slot(b, n)
                    for slot, role in ((a, "source"), (b, "destination")):
                        if not allocated[slot] or (released is not None and slot in released):
                            raise _not_allocated(ev, role, slot)
                elif t is Clear or t is Release:
                    slot = ev.slot
                    if type(slot) is not int or not 0 < slot <= n:
                        raise _bad_slot(slot, n)
                    if not allocated[slot] or (released is not None and slot in released):
                        raise _not_allocated(ev, "the", slot)
                    if t is Release:
                        if released is None:
                            released = {}
                        released[slot] = None
                else:
                    raise InvalidEventError(
                        f"submit takes Clear, CopyOnWrite and Release events, got {ev!r}"
                        + ("; allocate with CacheManager.alloc" if isinstance(ev, Alloc) else "")
                    )
                _check_request_id(ev.request_id)
            self._events.extend(events)
            if released is not None:
                pool._give_back(released)
            log, step = _tracing.state.slot_log, self._step
        if log is not None:
            _trace_events(log, events, step)

    # -- flushing --------------------------------------------------------
    async def flush(self, stream: Any | None = None) -> StepReport:
        """Run everything queued so far on ``stream``; returns what the step did.

        The device work is enqueued, not waited for. If the executor raises, this
        raises :class:`ExecutorError` and the next flush finishes the work first.
        """
        self._check_open()
        lock = self._flush_lock
        assert lock is not None
        # No checkpoint when uncontended: a flush is a few microseconds of host work.
        try:
            lock.acquire_nowait()
        except anyio.WouldBlock:
            await lock.acquire()
        try:
            if self._tp is not None:
                return await self._tp.flush(self, stream)
            return self._flush_local(stream)
        finally:
            lock.release()

    def _take_events(self) -> tuple[list[Event], int]:
        """Swap the queue out (vLLM's take_events) and advance the step."""
        with self._lock:
            events, self._events = self._events, []
            step = self._step
            self._step += 1
        return events, step

    def _flush_local(self, stream: Any | None) -> StepReport:
        events, step = self._take_events()
        t0 = time.perf_counter()
        plan = plan_step(events)
        return self._execute(plan, step, stream, time.perf_counter() - t0)

    def _execute(self, plan: Plan, step: int, stream: Any | None, plan_s: float) -> StepReport:
        """Queue the plan behind any unfinished work and run it all, oldest first."""
        t1 = time.perf_counter()
        resumed = len(self._unfinished)  # stages of earlier, failed flushes
        self._unfinished.extend(plan.stages)
        done = self._run_unfinished(stream, step)
        resumed = min(resumed, done)
        t2 = time.perf_counter()
        slot_bytes = self._pool.spec.slot_bytes
        report = StepReport(
            step=step,
            events=plan.events,
            zeroed=plan.zeroed,
            copied=plan.copied,
            elided=plan.elided,
            bytes_zeroed=plan.zeroed * slot_bytes,
            bytes_copied=plan.copied * slot_bytes,
            stages=len(plan.stages),
            plan_s=plan_s,
            execute_s=t2 - t1,
            resumed_stages=resumed,
        )
        log = _tracing.state.step_log
        if log is not None:
            figures = {name: getattr(report, name) for name in _REPORT_FIELDS}
            log.info(
                "step.flush", **figures, plan_us=round(plan_s * 1e6, 1), execute_us=round(report.execute_s * 1e6, 1)
            )
        return report

    def _run_unfinished(self, stream: Any | None, step: int | None = None) -> int:
        """Run queued stages; on failure keep the failed (stage, tensor) and raise."""
        if not self._unfinished:
            return 0
        done = 0
        tensors = self._pool.tensors
        with on_stream(self._pool.device, stream):
            while self._unfinished:
                stage = self._unfinished[0]
                while self._next_tensor < len(tensors):
                    try:
                        self._executor.execute(stage, tensors[self._next_tensor])
                    except Exception as exc:
                        left = len(self._unfinished)
                        log = _tracing.state.step_log
                        if log is not None:
                            log.error("step.error", step=step, stage=type(stage).__name__, error=repr(exc))
                        raise ExecutorError(
                            f"executor {self._executor.name!r} failed on {type(stage).__name__} (tensor"
                            f" {self._next_tensor}); {left} stage(s) are kept and run first by the next flush"
                        ) from exc
                    self._next_tensor += 1
                self._unfinished.popleft()
                self._next_tensor = 0
                done += 1
        return done


def _bad_slot(slot: Any, num_slots: int) -> InvalidSlotError:
    if type(slot) is not int:  # bool is a subclass of int: excluded on purpose
        return InvalidSlotError(f"slot must be an int, got {type(slot).__name__} {slot!r}")
    return InvalidSlotError(
        f"slot {slot} is out of range 1..{num_slots}" + (" (0 is the padding slot)" if slot == 0 else "")
    )


def _not_allocated(ev: Any, role: str, slot: int) -> SlotStateError:
    return SlotStateError(
        f"{type(ev).__name__}: {role} slot {slot} is not allocated at this point"
        " of the event order (released, or never allocated)"
    )


def _check_request_id(request_id: Any) -> None:
    if request_id is not None and type(request_id) is not str:
        raise InvalidArgumentError(f"request_id must be a str or None, got {request_id!r}")


def _trace_events(log: Any, events: tuple[Event, ...], step: int) -> None:
    for ev in events:
        if type(ev) is CopyOnWrite:
            log.debug("slot.cow", src=ev.src, dst=ev.dst, request_id=ev.request_id, step=step)
        elif type(ev) is Clear:
            log.debug("slot.clear", slot=ev.slot, request_id=ev.request_id, step=step)
        else:
            log.debug("slot.release", slot=ev.slot, request_id=ev.request_id, step=step)  # type: ignore[union-attr]
