"""CacheManager: queues slot events from any task or thread and runs them once per step."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Generator, Iterable
from functools import partial
from types import TracebackType
from typing import Any

import anyio

from . import _tracing
from ._channel import Channel
from ._errors import (
    InvalidArgumentError,
    InvalidEventError,
    InvalidSlotError,
    MambaCacheError,
    ManagerClosedError,
    PlanError,
    SlotLeakError,
    SlotStateError,
)
from ._events import Alloc, Clear, CommitDraft, CopyOnWrite, DropHost, Event, Offload, Release, Restore, StepReport
from ._executors import Executor, resolve_executor
from ._host import HostPool
from ._planner import Plan, plan_step
from ._pool import StatePool
from ._runner import StepRunner, check_executor
from ._validate import as_slot, check_request_id, normalised, slot_list

__all__ = ["CacheManager"]

_NEW, _OPEN, _CLOSING, _CLOSED = range(4)
_REPORT_FIELDS = tuple(f.name for f in dataclasses.fields(StepReport) if not f.name.endswith("_s"))


class CacheManager:
    """Batches a step's slot events and applies them with exactly sequential semantics.

    Invariants:

    * the pool's allocated set (and each slot's tenant) is the state at the
      *end* of the event queue: ``alloc`` and ``release`` update it at once, and
      every event is validated against the state at its own point of the order;
    * a flush leaves every allocated slot as running all queued events one at a
      time, in submission order, would (see ``docs/semantics.md``);
    * nothing is lost: a submit that fails changes nothing; a flush whose
      executor fails keeps the unfinished work in the pool's backlog, and the
      next flush (of this manager, or of the next one opened on the pool) runs
      it before anything newer; a submit either is taken by a flush or raises
      ``ManagerClosedError``, never both nor neither;
    * kept work is bounded: while the backlog fails, new events stay queued and
      are not planned, and after ``max_failed_flushes`` failures in a row the
      manager is broken and refuses work (``ManagerBrokenError``).

    Submitting (``alloc``, ``clear``, ``copy_on_write``, ``release``, ``submit``
    and the bulk forms) is synchronous and thread-safe; flushes (``await
    flush()`` or ``flush_nowait()``) run one at a time.
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
        max_failed_flushes: int = 8,
        host_pool: HostPool | None = None,
        channel: Channel | None = None,
    ) -> None:
        if not isinstance(pool, StatePool):
            raise InvalidArgumentError(f"pool must be a StatePool, got {type(pool).__name__}")
        if type(copy_workspace_bytes) is not int or copy_workspace_bytes < 1:
            raise InvalidArgumentError(f"copy_workspace_bytes must be a positive int, got {copy_workspace_bytes!r}")
        if type(clear_on_alloc) is not bool:
            raise InvalidArgumentError(f"clear_on_alloc must be a bool, got {clear_on_alloc!r}")
        if type(max_failed_flushes) is not int or max_failed_flushes < 1:
            raise InvalidArgumentError(f"max_failed_flushes must be a positive int, got {max_failed_flushes!r}")
        if channel is not None and (group is not None or not isinstance(channel, Channel)):
            raise InvalidArgumentError(
                f"channel must be a mambacache Channel, and not given with group=; got {type(channel).__name__}"
            )
        if host_pool is not None:
            if not isinstance(host_pool, HostPool):
                raise InvalidArgumentError(f"host_pool must be a HostPool, got {type(host_pool).__name__}")
            if not host_pool.compatible_with(pool.spec):
                raise InvalidArgumentError(
                    f"host_pool holds states of {host_pool.spec}, the pool {pool.spec}: make it with the pool's spec"
                )
        self._host = host_pool
        self._pool = pool
        self._device = pool.device
        self._draft_tokens = pool.spec.draft_tokens
        self._clear_on_alloc = clear_on_alloc
        self._executor: Executor = resolve_executor(executor, pool.device, copy_workspace_bytes)
        check_executor(self._executor, pool._exec_tensors, pool._exec_drafts)
        self._lock = threading.Lock()  # guards the queue, the step number, the state and the pool's slots
        self._mutex = threading.Lock()  # one flush at a time, async or sync, from any thread
        self._flusher: int | None = None  # thread holding _mutex
        self._events: list[Event] = []
        self._step = 0
        self._state = _NEW
        self._runner = StepRunner(pool, max_failed_flushes)
        self._waiters: list[int] = []  # alloc_wait tickets, first come first served
        self._ticket = 0
        self._tp: Channel | None = channel
        if group is not None:
            from ._distributed import DistributedChannel

            self._tp = DistributedChannel(group, src_rank, pool.num_slots, timeout)

    # -- lifecycle -------------------------------------------------------
    def _open(self) -> None:
        if self._state != _NEW:
            raise ManagerClosedError("a CacheManager can be entered once")
        with self._lock:
            if self._pool._manager is not None:
                raise InvalidArgumentError("this pool is already managed by another open CacheManager")
            if self._host is not None:
                if self._host._manager is not None:
                    raise InvalidArgumentError("this host pool is attached to another open CacheManager")
                self._host._manager = self
            self._pool._manager = self
            self._state = _OPEN

    def _begin_close(self) -> bool:
        """Refuse new submits from here on; True when a final flush has work to do."""
        with self._lock:
            if self._state == _OPEN:
                self._state = _CLOSING
            return self._tp is not None or bool(self._events) or bool(self._pool._backlog)

    def _finish_close(self) -> None:
        # What no flush took (the manager was broken, or the backlog failed) is planned
        # into the pool's backlog, so the next manager on this pool runs it first.
        with self._lock:
            events, self._events = self._events, []
            self._state = _CLOSED
        if self._host is not None:
            self._host.ledger.reuse_freed()
        if events:
            self._pool._backlog.push(plan_step(events).stages, self._executor, self._host_tensors())
        self._pool._manager = None
        if self._host is not None:
            self._host._manager = None

    def _host_tensors(self) -> list[Any] | None:
        return self._host._exec_tensors if self._host is not None else None

    async def __aenter__(self) -> CacheManager:
        self._open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._begin_close():
                # In tensor-parallel mode every rank flushes on exit, so the ranks stay in step.
                with anyio.CancelScope(shield=True):
                    await self._flush_async(None)
        except MambaCacheError as flush_error:
            _raise_unless_masking(exc, flush_error)
        finally:
            self._finish_close()

    def __enter__(self) -> CacheManager:
        self._open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._begin_close():
                self._flush_sync(None)
        except MambaCacheError as flush_error:
            _raise_unless_masking(exc, flush_error)
        finally:
            self._finish_close()

    def _check_open(self) -> None:
        # Read without the lock for the common case; submits re-check under it.
        if self._state != _OPEN:
            raise self._closed_error()
        self._runner.raise_if_broken()

    def _closed_error(self) -> ManagerClosedError:
        if self._state == _NEW:
            return ManagerClosedError("CacheManager is not entered (use `with` or `async with`)")
        return ManagerClosedError("CacheManager is closed" + (" (closing)" if self._state == _CLOSING else ""))

    # -- properties ------------------------------------------------------
    @property
    def executor(self) -> Executor:
        """The executor that runs this manager's new work."""
        return self._executor

    @property
    def pool(self) -> StatePool:
        """The pool this manager drives."""
        return self._pool

    @property
    def host_pool(self) -> HostPool | None:
        """The host pool that ``offload`` fills and ``restore`` reads, if any."""
        return self._host

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

    @property
    def unfinished(self) -> int:
        """Stages of failed flushes that the next flush runs first (the pool's backlog)."""
        return len(self._pool._backlog)

    @property
    def broken(self) -> str | None:
        """Why the manager refuses work after too many failed flushes in a row, or None."""
        return self._runner.broken

    def held(self) -> dict[int, str | None]:
        """Allocated slots and their tenants (the ``request_id`` they were allocated with)."""
        with self._lock:
            return self._pool.ledger.held_by()

    def check_idle(self, host: bool | None = None) -> None:
        """Raise :class:`SlotLeakError` naming every held slot and its tenant, if any is held.

        For an engine's idle check: with no request running, no slot should be
        held, and no host slot either (a swapped-out request aborted without
        ``drop``). ``host``: whether to check the host pool too; None (default)
        checks it when one is attached. The error's ``held`` and ``host_held``
        map the slots and host slots to their tenants (a host slot's is the
        ``request_id`` of the offload that filled it).
        """
        if host is not None and type(host) is not bool:
            raise InvalidArgumentError(f"host must be a bool or None, got {host!r}")
        hp = self._host
        with self._lock:  # one snapshot: a swap in or out between two reads could hide a request from both
            held = self._pool.ledger.held_by()
            host_held = hp.ledger.held_by() if hp is not None and host is not False else {}
        if held or host_held:
            parts = [_listed(held, "slot"), _listed(host_held, "host slot")]
            raise SlotLeakError("; ".join(p for p in parts if p), held, host_held)

    # -- allocating ------------------------------------------------------
    def alloc(self, n: int, request_id: str | None = None, *, clear: bool | None = None) -> list[int]:
        """Allocate the ``n`` lowest free slots to ``request_id``; returns them.

        Each reads as zeros after the next flush (unless a later copy targets it).
        ``clear=False`` (default: the manager's ``clear_on_alloc``) skips the zeroing,
        for a scheduler that always forks or clears a new slot itself. Raises
        :class:`PoolExhaustedError` (nothing allocated) when fewer than ``n`` are free.
        """
        self._check_open()
        if type(n) is not int or n < 0:
            raise InvalidArgumentError(f"alloc count must be a non-negative int, got {n!r}")
        clear = self._check_alloc_args(request_id, clear)
        with self._lock:
            self._check_submittable()
            slots = self._pool.ledger.take(n, request_id)
            self._record_alloc(slots, request_id, clear)
        return slots

    def alloc_slots(self, slots: Any, request_id: str | None = None, *, clear: bool | None = None) -> list[int]:
        """Allocate exactly ``slots`` (for engines that pick slot ids); returns them as ints.

        All or nothing: a slot that is out of range or repeated raises
        :class:`InvalidSlotError`, one already held raises :class:`SlotStateError`.
        """
        self._check_open()
        wanted = slot_list(slots, self._pool.num_slots)
        clear = self._check_alloc_args(request_id, clear)
        if len(set(wanted)) != len(wanted):
            raise InvalidSlotError(f"alloc_slots: a slot is repeated in {wanted[:20]}")
        with self._lock:
            self._check_submittable()
            ledger = self._pool.ledger
            taken = [s for s in wanted if ledger.held[s]]
            if taken:
                tenants = [ledger.tenants[s] for s in taken[:20]]
                raise SlotStateError(f"alloc_slots: slot(s) {taken[:20]} already held (tenants {tenants})")
            ledger.take_exact(wanted, request_id)
            self._record_alloc(wanted, request_id, clear)
        return wanted

    async def alloc_wait(self, n: int, request_id: str | None = None, *, clear: bool | None = None) -> list[int]:
        """Like :meth:`alloc`, but wait until ``n`` slots are free instead of raising: backpressure.

        Waiters are served first come, first served; a count larger than the pool
        raises :class:`InvalidArgumentError` at once, since it could never be met.
        The check that ``n`` are free and the allocation happen under one hold of
        the manager's lock, so a concurrent ``alloc`` from another thread makes it
        wait longer, never raise :class:`PoolExhaustedError`. Cancelling the wait
        allocates nothing.
        """
        self._check_open()
        if type(n) is not int or n < 0:
            raise InvalidArgumentError(f"alloc count must be a non-negative int, got {n!r}")
        if n > self._pool.num_slots:
            raise InvalidArgumentError(f"alloc_wait({n}) can never be met: the pool has {self._pool.num_slots} slots")
        cleared = self._check_alloc_args(request_id, clear)
        with self._lock:
            ticket = self._ticket
            self._ticket += 1
            self._waiters.append(ticket)
        try:
            delay = 0.0
            while True:
                with self._lock:
                    # The check and the allocation under one hold of the lock: another
                    # thread's alloc can no longer take the slots in between.
                    if self._waiters[0] == ticket and self._pool.num_free >= n:
                        self._check_submittable()
                        slots = self._pool.ledger.take(n, request_id)
                        self._record_alloc(slots, request_id, cleared)
                        return slots
                self._check_open()
                # Releases come from any thread, so this polls (briefly, then every ms).
                await anyio.sleep(delay)
                delay = min(0.001, delay + 0.0001)
        finally:
            with self._lock:
                self._waiters.remove(ticket)

    def _check_alloc_args(self, request_id: Any, clear: Any) -> bool:
        check_request_id(request_id)
        if clear is None:
            return self._clear_on_alloc
        if type(clear) is not bool:
            raise InvalidArgumentError(f"clear must be a bool or None, got {clear!r}")
        return bool(clear)

    def _check_submittable(self) -> None:
        """Under the lock: the authoritative check, so no submit lands after the final flush's take."""
        if self._state != _OPEN:
            raise self._closed_error()
        self._runner.raise_if_broken()
        if self._tp is not None:
            self._tp.check_source("submit")

    def _record_alloc(self, slots: list[int], request_id: str | None, clear: bool) -> None:
        """Under the lock: queue the allocs of ``slots``, which the ledger already holds for ``request_id``."""
        self._events.extend([Alloc(s, request_id, clear) for s in slots])
        log = _tracing.state.slot_log
        if log is not None:
            for s in slots:
                log.debug("slot.alloc", slot=s, request_id=request_id, step=self._step, cleared=clear)

    # -- submitting ------------------------------------------------------
    # The single-event forms are the decode-step hot path: plain int slots and str
    # ids skip normalisation; the open/closed check happens under the lock.
    def clear(self, slot: int, request_id: str | None = None) -> None:
        """Zero ``slot`` at this point of the event order (on the next flush)."""
        n = self._pool.num_slots
        plain = type(slot) is int and 0 < slot <= n and (request_id is None or type(request_id) is str)
        self._submit((Clear(slot, request_id),), checked=plain)

    def release(self, slot: int, request_id: str | None = None) -> None:
        """Free ``slot`` from this point; events queued before still see its content."""
        n = self._pool.num_slots
        plain = type(slot) is int and 0 < slot <= n and (request_id is None or type(request_id) is str)
        self._submit((Release(slot, request_id),), checked=plain)

    def copy_on_write(self, src: int, dst: int, request_id: str | None = None) -> None:
        """``dst`` gets ``src``'s state as of this point of the event order (a fork)."""
        n = self._pool.num_slots
        plain = (
            type(src) is int
            and type(dst) is int
            and 0 < src <= n
            and 0 < dst <= n
            and (request_id is None or type(request_id) is str)
        )
        self._submit((CopyOnWrite(src, dst, request_id),), checked=plain)

    def commit_draft(self, slot: int, accepted: int, request_id: str | None = None) -> None:
        """``slot`` becomes the state after ``accepted`` draft tokens (0: unchanged), read from its draft buffer
        at this point of the event order: a fork after the commit carries the committed state, one before does not.
        """
        self._submit((CommitDraft(slot, accepted, request_id),))

    def submit(self, *events: Clear | CopyOnWrite | Release | CommitDraft) -> None:
        """Queue ``events`` in order, all or none: any invalid event raises and queues nothing."""
        self._submit(events)

    def clear_many(self, slots: Any, request_id: str | None = None) -> None:
        """``clear`` for each of ``slots`` (a list, numpy array or 1-D CPU int tensor), all or none."""
        self._check_open()
        check_request_id(request_id)
        self._submit([Clear(s, request_id) for s in slot_list(slots, self._pool.num_slots)], checked=True)

    def release_many(self, slots: Any, request_id: str | None = None) -> None:
        """``release`` for each of ``slots``, in order, all or none."""
        self._check_open()
        check_request_id(request_id)
        self._submit([Release(s, request_id) for s in slot_list(slots, self._pool.num_slots)], checked=True)

    def copy_many(self, srcs: Any, dsts: Any, request_id: str | None = None) -> None:
        """``copy_on_write(srcs[i], dsts[i])`` for each ``i``, in order, all or none."""
        self._check_open()
        check_request_id(request_id)
        n = self._pool.num_slots
        a, b = slot_list(srcs, n), slot_list(dsts, n)
        if len(a) != len(b):
            raise InvalidArgumentError(f"copy_many: {len(a)} sources but {len(b)} destinations")
        self._submit([CopyOnWrite(s, d, request_id) for s, d in zip(a, b, strict=True)], checked=True)

    # -- the host tier ---------------------------------------------------
    def offload(self, slot: int, request_id: str | None = None) -> int:
        """Copy ``slot``'s state as of this point of the event order to a free host slot; returns the host slot.

        Later events on ``slot`` (a release and a new tenant, a clear) do not reach
        the copy, so ``offload`` then ``release`` is preemption by swap. The copy
        runs on the next flush's stream, before anything in that step writes the
        slot. Raises :class:`PoolExhaustedError` when the host pool is full.
        """
        host = self._need_host("offload")
        slot = as_slot(slot, self._pool.num_slots)
        check_request_id(request_id)
        with self._lock:
            self._check_submittable()
            self._check_held(Offload, slot, request_id)
            h = host.ledger.take(1, request_id)[0]
            self._events.append(Offload(slot, h, request_id))
            log, step = _tracing.state.slot_log, self._step
        if log is not None:
            log.debug("slot.offload", slot=slot, host=h, request_id=request_id, step=step)
        return h

    def restore(self, host: int, slot: int, request_id: str | None = None, *, keep: bool = False) -> None:
        """``slot`` gets host slot ``host``'s state as of this point of the event order.

        ``host`` is freed after the read unless ``keep`` (a checkpoint restored many
        times). A host slot freed in a step is handed out again in that step only
        when no other is free, and the planner orders this read before the offload
        that rewrites it, so the read always sees the offloaded state.
        """
        hp = self._need_host("restore")
        h = self._host_slot(hp, host)
        slot = as_slot(slot, self._pool.num_slots)
        check_request_id(request_id)
        if type(keep) is not bool:
            raise InvalidArgumentError(f"keep must be a bool, got {keep!r}")
        with self._lock:
            self._check_submittable()
            if not hp.ledger.held[h]:
                raise SlotStateError(f"Restore: host slot {h} holds no state (dropped, restored, or never offloaded)")
            self._check_held(Restore, slot, request_id)
            self._events.append(Restore(h, slot, request_id, keep))
            if not keep:
                hp.ledger.free_later(h)
            log, step = _tracing.state.slot_log, self._step
        if log is not None:
            log.debug("slot.restore", host=h, slot=slot, request_id=request_id, keep=keep, step=step)

    def drop(self, host: int) -> None:
        """Free host slot ``host`` from this point; earlier restores still read it."""
        hp = self._need_host("drop")
        h = self._host_slot(hp, host)
        with self._lock:
            self._check_submittable()
            if not hp.ledger.held[h]:
                raise SlotStateError(f"DropHost: host slot {h} holds no state (dropped, restored, or never offloaded)")
            self._events.append(DropHost(h))
            hp.ledger.free_later(h)
            log, step = _tracing.state.slot_log, self._step
        if log is not None:
            log.debug("host.drop", host=h, step=step)

    def _need_host(self, what: str) -> HostPool:
        self._check_open()
        if self._host is None:
            raise InvalidArgumentError(f"{what} needs a host pool: CacheManager(pool, host_pool=HostPool(spec, n))")
        return self._host

    @staticmethod
    def _host_slot(hp: HostPool, host: Any) -> int:
        try:
            return as_slot(host, hp.num_slots)
        except InvalidSlotError as exc:
            raise InvalidSlotError(f"host {exc}") from None

    def _check_held(self, kind: type, slot: int, request_id: str | None) -> None:
        """Under the lock: ``slot`` is allocated, to ``request_id`` when one is given."""
        ledger = self._pool.ledger
        if not ledger.held[slot]:
            raise _not_allocated(kind, "the", slot)
        tenant = ledger.tenants[slot]
        if request_id is not None and tenant != request_id:
            raise _tenant_error(kind.__name__, slot, tenant, request_id)

    def _submit(self, events: Any, checked: bool = False) -> None:
        # One pass validates everything before anything changes. The hot path of
        # every submit, so the checks are inlined. `checked`: slots and request
        # ids were already validated (the bulk forms).
        n = self._pool.num_slots
        if not checked:
            events = normalised(events, n)
        with self._lock:
            if self._state != _OPEN or self._runner.broken is not None or self._tp is not None:
                self._check_submittable()  # the common case is one test; this raises or checks the source rank
            pool = self._pool
            ledger = pool.ledger
            allocated, tenants, draft_tokens = ledger.held, ledger.tenants, self._draft_tokens
            released: dict[int, None] | None = None  # ordered: freed in release order
            for ev in events:
                t = type(ev)
                rid = ev.request_id
                if t is CopyOnWrite:
                    a, b = ev.src, ev.dst
                    if not allocated[a] or (released is not None and a in released):
                        raise _not_allocated(ev, "source", a)
                    if not allocated[b] or (released is not None and b in released):
                        raise _not_allocated(ev, "destination", b)
                    if rid is not None and tenants[b] != rid:
                        raise _wrong_tenant(ev, b, tenants[b])
                else:
                    slot = ev.slot
                    if not allocated[slot] or (released is not None and slot in released):
                        raise _not_allocated(ev, "the", slot)
                    if t is CommitDraft and not 0 <= ev.accepted <= draft_tokens:
                        if not draft_tokens:
                            raise InvalidEventError(
                                "CommitDraft on a pool without draft buffers: make it with StatePool(...,"
                                " draft_tokens=k)"
                            )
                        raise InvalidArgumentError(
                            f"CommitDraft: accepted must be in 0..{draft_tokens} (the pool's draft_tokens),"
                            f" got {ev.accepted}"
                        )
                    if rid is not None and tenants[slot] != rid:
                        raise _wrong_tenant(ev, slot, tenants[slot])
                    if t is Release:
                        if released is None:
                            released = {}
                        released[slot] = None
            self._events.extend(events)
            if released is not None:
                ledger.give_back(released)
            log, step = _tracing.state.slot_log, self._step
        if log is not None:
            _trace_events(log, events, step)

    # -- flushing --------------------------------------------------------
    async def flush(self, stream: Any | None = None) -> StepReport:
        """Run everything queued so far on ``stream``; returns what the step did.

        The device work is enqueued, not waited for. If the executor raises, this
        raises :class:`ExecutorError`; the work is kept and the next flush runs it
        first. Cancellation: before the step's events are taken, a cancelled flush
        takes nothing; once taken (at once when uncontended), the step runs to the
        end, shielded. In tensor-parallel mode the broadcast is shielded too, so a
        cancelled flush never leaves ranks apart.
        """
        self._check_open()
        return await self._flush_async(stream)

    def flush_nowait(self, stream: Any | None = None) -> StepReport:
        """The synchronous flush, for schedulers without an event loop; same semantics and report.

        Safe against a concurrent async flush or one in another thread: one runs at
        a time (this blocks while another thread flushes). In tensor-parallel mode
        it blocks on the plan broadcast (up to ``timeout``).
        """
        self._check_open()
        return self._flush_sync(stream)

    # One flush core, two drivers. Without a channel the core never waits, and both
    # drivers call _flush_local (no generator on the decode-step path). With one,
    # _flush_channel yields each blocking call (a plan's send or receive): the sync
    # driver makes it in place, the async one in a worker thread.
    def _flush_local(self, stream: Any | None) -> StepReport:
        self._runner.raise_if_broken()
        resumed = 0
        if self._pool._backlog:
            # Earlier work first; if it fails again the new events stay queued,
            # unplanned, so kept work never grows past one step's plan.
            resumed = self._runner.run(stream, self._step)
        plan, step, plan_s = self._take_plan()
        return self._apply(plan, step, stream, plan_s, resumed)

    def _flush_channel(self, channel: Channel, stream: Any | None) -> Generator[Callable[[], Any], Any, StepReport]:
        self._runner.raise_if_broken()
        if channel.is_source:
            plan, step, plan_s = self._take_plan()
            yield partial(channel.send, step, plan)
        else:
            step, plan = yield channel.receive
            plan_s = 0.0
            with self._lock:
                self._step = step + 1
        return self._apply(plan, step, stream, plan_s, 0)

    async def _flush_async(self, stream: Any | None) -> StepReport:
        mutex = self._mutex
        # No checkpoint when uncontended: a flush is a few microseconds of host work.
        # Contended (another thread flushes, or a tensor-parallel flush awaits its
        # broadcast): poll, so that cancelling the wait is clean.
        delay = 0.0
        while not mutex.acquire(blocking=False):
            await anyio.sleep(delay)
            delay = min(0.001, delay + 0.0001)
        self._flusher = threading.get_ident()
        try:
            if self._tp is None:
                return self._flush_local(stream)  # no wait, no checkpoint
            core = self._flush_channel(self._tp, stream)
            # Once the source has taken the events, the broadcast and the local apply must
            # both happen, or the ranks part: shielded, bounded by the channel's timeout.
            with anyio.CancelScope(shield=True):
                try:
                    call = next(core)
                    while True:
                        call = core.send(await anyio.to_thread.run_sync(call))
                except StopIteration as done:
                    report: StepReport = done.value
            return report
        finally:
            self._flusher = None
            mutex.release()

    def _flush_sync(self, stream: Any | None) -> StepReport:
        me = threading.get_ident()
        if self._flusher == me:
            raise InvalidArgumentError(
                "flush_nowait() while a flush of this thread is awaiting (a tensor-parallel broadcast):"
                " it would deadlock; await that flush instead"
            )
        with self._mutex:
            self._flusher = me
            try:
                if self._tp is None:
                    return self._flush_local(stream)
                return _finish(self._flush_channel(self._tp, stream))
            finally:
                self._flusher = None

    def _take_events(self) -> tuple[list[Event], int]:
        """Swap the queue out (vLLM's ``take_events``) and advance the step: ``(events, step)``."""
        with self._lock:
            events, self._events = self._events, []
            step = self._step
            self._step += 1
            if self._host is not None:
                self._host.ledger.reuse_freed()  # host slots freed by these events: their reads are planned now
        return events, step

    def _take_plan(self) -> tuple[Plan, int, float]:
        """Take the queued events and plan them: ``(plan, step, seconds)``.

        The planner is pure, so if it fails (out of memory on a huge step, say) the
        events go back to the front of the queue, in order, and the step number
        with them: the next flush plans them again, as if this one never ran.
        """
        events, step = self._take_events()
        t0 = time.perf_counter()
        try:
            plan = plan_step(events)
        except Exception as exc:
            with self._lock:
                self._events[:0] = events
                self._step = step
            raise PlanError(
                f"planning step {step} ({len(events)} events) failed: {exc!r}; the events are queued again"
            ) from exc
        return plan, step, time.perf_counter() - t0

    def _apply(self, plan: Plan, step: int, stream: Any | None, plan_s: float, resumed: int) -> StepReport:
        """Queue the plan behind any unfinished work and run it all, oldest first."""
        t1 = time.perf_counter()
        backlog = self._pool._backlog
        resumed += len(backlog)
        if plan.stages:
            backlog.push(plan.stages, self._executor, self._host_tensors())
        if backlog:
            self._runner.run(stream, step)
        t2 = time.perf_counter()
        report = StepReport.from_plan(
            plan, step, self._pool.spec.slot_bytes, plan_s=plan_s, execute_s=t2 - t1, resumed_stages=resumed
        )
        log = _tracing.state.step_log
        if log is not None:
            figures = {name: getattr(report, name) for name in _REPORT_FIELDS}
            log.info(
                "step.flush", **figures, plan_us=round(plan_s * 1e6, 1), execute_us=round(report.execute_s * 1e6, 1)
            )
        return report


def _listed(held: dict[int, str | None], what: str) -> str:
    if not held:
        return ""
    shown = ", ".join(f"{s} ({t!r})" for s, t in list(held.items())[:20])
    more = f" and {len(held) - 20} more" if len(held) > 20 else ""
    return f"{len(held)} {what}(s) held while idle: {shown}{more}"


def _finish(core: Generator[Callable[[], Any], Any, StepReport]) -> StepReport:
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


def _not_allocated(ev: Any, role: str, slot: int) -> SlotStateError:
    name = ev.__name__ if isinstance(ev, type) else type(ev).__name__
    return SlotStateError(
        f"{name}: {role} slot {slot} is not allocated at this point of the event order (released, or never allocated)"
    )


def _wrong_tenant(ev: Any, slot: int, tenant: str | None) -> SlotStateError:
    return _tenant_error(type(ev).__name__, slot, tenant, ev.request_id)


def _tenant_error(kind: str, slot: int, tenant: str | None, request_id: str | None) -> SlotStateError:
    return SlotStateError(
        f"{kind}: slot {slot} belongs to {tenant!r}, not {request_id!r} (pass request_id=None to skip the check)"
    )


def _trace_events(log: Any, events: Iterable[Event], step: int) -> None:
    for ev in events:
        if type(ev) is CopyOnWrite:
            log.debug("slot.cow", src=ev.src, dst=ev.dst, request_id=ev.request_id, step=step)
        elif type(ev) is CommitDraft:
            log.debug("slot.commit", slot=ev.slot, accepted=ev.accepted, request_id=ev.request_id, step=step)
        elif type(ev) is Clear:
            log.debug("slot.clear", slot=ev.slot, request_id=ev.request_id, step=step)
        else:
            log.debug("slot.release", slot=ev.slot, request_id=ev.request_id, step=step)  # type: ignore[union-attr]
