"""StepQueue: the next step's events, checked against the pools' ledgers as they are queued.

The coordinator under :class:`~mambacache.CacheManager` (which only checks
arguments and delegates): it owns the event queue and the step number, moves
the manager's :class:`~mambacache._core._lifecycle.Lifecycle` under the manager's
lock, and changes the ledgers only under that lock, in the same hold as the
queue, so the two never disagree. No torch.

A layer above that holds slots of its own beyond the ledgers (the hand-off:
exports awaiting a peer's ack, states arrived for an import) puts a
:class:`SubmitGuard` on the queue, which asks it, in the same hold of the lock,
before it queues a release, hands a slot over, reads or drops a host slot, or
frees the ledgers at the close. The queue never imports that layer: without
one it asks :data:`NO_GUARD`, which refuses nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized
from typing import TYPE_CHECKING, Literal, Protocol

import anyio

from . import _tracer
from ._errors import InvalidArgumentError, SlotLeakError, SlotStateError
from ._events import Alloc, Event, Export
from ._ledger import SlotLedger
from ._lifecycle import OPEN, Lifecycle, Phase

if TYPE_CHECKING:
    from ._backlog import Backlog
    from ._channel import Channel

__all__ = ["NO_GUARD", "SlotUse", "StepQueue", "SubmitGuard"]

SlotUse = Literal["read", "write", "hand_over"]
"""What a call does to a pool slot, for :meth:`SubmitGuard.check_slot`: reads it (an offload, a copy's source),
writes it (a clear, a commit, a copy's or a restore's destination), or changes its tenant or hands its state to
a peer (a hand-over, an export)."""


class SubmitGuard(Protocol):
    """What the queue asks, under its lock, of the layer that holds slots beyond the ledgers (the hand-off book).

    Each check raises, changing nothing, to refuse the call it guards; the
    queue makes it before it changes anything, in the hold of the lock that
    queues the call's events.
    """

    @property
    def exports(self) -> Sized:
        """The pool slots a release withdraws from the guard (empty: :meth:`withdraw_locked` need not be asked,
        the decode step's one test)."""
        ...

    def in_flight(self) -> bool:
        """Whether a send awaits its ack or a landing writes its rows: a closed queue keeps the ledgers claimed
        while one does (:meth:`StepQueue.end_release`)."""
        ...

    @property
    def awaited(self) -> Sized:
        """The pool slots awaiting a state from a peer: with ``exports``, the gate of :meth:`withdraw_locked`."""
        ...

    def withdraw_locked(self, events: Sequence[Event]) -> list[Export | int]:
        """What the releases among ``events`` withdraw (exports, and slots awaiting a state); raises, changing
        nothing, if one may not be released, or if one of ``events`` writes a slot whose state goes to a peer
        as it is (an export in place) or touches one awaiting a state."""
        ...

    def drop_locked(self, exports: Sequence[Export | int]) -> None:
        """After the events are queued: what :meth:`withdraw_locked` gave leaves the guard."""
        ...

    def check_slot(self, what: str, slot: int, use: SlotUse) -> None:
        """Raise when pool slot ``slot`` may not be put to ``use`` (it awaits a state from a peer; or, for a write,
        its state goes to a peer as it is; or, for a hand-over, it is being handed to a peer)."""
        ...

    def check_host(self, what: str, host: int) -> None:
        """Raise when host slot ``host`` may not be restored from or dropped."""
        ...


class _NoGuard:
    """The guard of a queue without a layer above: holds nothing, refuses nothing."""

    __slots__ = ()
    exports: tuple[()] = ()
    awaited: tuple[()] = ()

    def in_flight(self) -> bool:
        return False

    def withdraw_locked(self, events: Sequence[Event]) -> list[Export | int]:
        return []

    def drop_locked(self, exports: Sequence[Export | int]) -> None:
        pass

    def check_slot(self, what: str, slot: int, use: SlotUse) -> None:
        pass

    def check_host(self, what: str, host: int) -> None:
        pass


NO_GUARD: SubmitGuard = _NoGuard()


class StepQueue:
    """Events of the step that the next flush takes, in submission order.

    Invariants (each holds whenever ``lock`` is free):

    * the ledgers describe the state at the *end* of the queue: an alloc or an
      offload holds its slots at once, a release frees its slot at once, and a
      drop or a restore without ``keep`` frees its host slot for the next step;
    * every queued event was valid at its own point of the order, checked
      against the ledgers in the same hold of the lock that queued it, so a
      batch is queued whole or not at all and a failed submit changes nothing;
    * the trace records events in queue order: each is traced in the lock hold
      that queues it (a no-op call with tracing off), so another thread's
      release of a slot is never traced before the alloc it follows;
    * nothing is queued unless the lifecycle is OPEN (so not broken) and this
      is the channel's source rank, both read under the lock: a submit is
      either taken by a flush or raises, never both.
    """

    __slots__ = (
        "__weakref__", "_backlog", "_channel", "_draft_tokens", "_host", "_ticket", "_waiters", "events", "guard",
        "ledger", "life", "lock", "step",
    )  # fmt: skip

    def __init__(
        self,
        life: Lifecycle,
        ledger: SlotLedger,
        host: SlotLedger | None,
        draft_tokens: int,
        backlog: Backlog,
        channel: Channel | None,
    ) -> None:
        self.life = life
        self.lock = life.lock
        self.ledger = ledger
        self._host = host
        self._draft_tokens = draft_tokens
        self._channel = channel
        self.events: list[Event] = []
        self._backlog = backlog  # hands out the tickets a take runs under (work done: Backlog.done)
        # What a layer above holds beyond the ledgers (guard_with); it must see this queue through a
        # weak proxy, not the queue: a cycle would keep the manager's graph (its process group with
        # it) alive until the cyclic GC ran, at exit after destroy_process_group at worst, where
        # gloo's destructor aborts the process.
        self.guard: SubmitGuard = NO_GUARD
        self.step = 0
        self._waiters: list[int] = []  # alloc_wait tickets, first come first served
        self._ticket = 0

    def guard_with(self, guard: SubmitGuard) -> None:
        """Put ``guard`` on the queue's submits (the layer above's book); once, before :meth:`open`."""
        if self.life.phase is not Phase.NEW or self.guard is not NO_GUARD:
            raise InvalidArgumentError("a StepQueue takes one guard, before it opens")
        self.guard = guard

    # -- lifecycle -------------------------------------------------------
    def check(self, ending_send: bool = False) -> None:
        """Under the lock: the authoritative check before anything is queued (:meth:`Lifecycle.check`: open, or
        ``ending_send``, the outcome of a send taken earlier), and that this is the source rank."""
        self.life.check(ending_send)
        if self._channel is not None:
            self._channel.check_source("submit")

    def _ledgers(self) -> tuple[SlotLedger, ...]:
        return (self.ledger,) if self._host is None else (self.ledger, self._host)

    def open(self) -> None:
        """Claim the ledgers for this queue's manager and take events from now on."""
        with self.lock:
            self.life.open(self._ledgers())

    def begin_close(self) -> bool:
        """Refuse new events from here on (a send in flight may still end: :meth:`check`); True when
        events are queued."""
        with self.lock:
            self.life.begin_close()
            return bool(self.events)

    def close(self) -> tuple[list[Event], int]:
        """Closed for good: returns what no flush took, with the backlog ticket it runs under. The ledgers stay
        claimed until :meth:`release`."""
        with self.lock:
            events, self.events = self.events, []
            self.life.finish()
            ticket = self._backlog.take_ticket()
            if self._host is not None:
                self._host.reuse_freed(ticket)
        return events, ticket

    def release(self) -> None:
        """Free the ledgers for the next manager, once this one's leftover work is in the pool's backlog and
        no send of its exports awaits an ack and no landing writes (else the last one to end frees them:
        :meth:`end_release`)."""
        with self.lock:
            self.life.release(self._ledgers(), self.guard.in_flight)

    def end_release(self) -> None:
        """Under the lock, once a send or a landing ended: on a closed manager, free the ledgers unless another
        one is still in flight (:meth:`Lifecycle.end_release`; nothing before the close)."""
        self.life.end_release(self._ledgers(), self.guard.in_flight)

    # -- queueing --------------------------------------------------------
    def submit(self, events: Sequence[Event]) -> None:
        """Queue clears, copies, commits and releases, all or none (see :meth:`SlotLedger.apply_batch`)."""
        with self.lock:
            if self.life.phase is not OPEN or self._channel is not None:
                self.check()  # the common case in one test, inline: 3 % of a submit (docs/benchmarks.md)
            guard = self.guard
            withdrawn = guard.withdraw_locked(events) if guard.exports or guard.awaited else None
            self.ledger.apply_batch(events, self._draft_tokens)
            self.events.extend(events)
            _tracer.tracer.events(events, self.step)
            if withdrawn:
                guard.drop_locked(withdrawn)

    def closed(self) -> bool:
        """Closed for good (not merely closing): no flush runs again."""
        return self.life.closed

    def enqueue(self, events: Sequence[Event]) -> None:
        """Under the lock: queue ``events`` (checked by the caller against the ledgers) and trace them."""
        self.events.extend(events)
        _tracer.tracer.events(events, self.step)

    def alloc(self, n: int, tenant: str | None, clear: bool) -> list[int]:
        """The ``n`` lowest free slots, held by ``tenant``, each with its queued alloc."""
        with self.lock:
            self.check()
            slots = self.ledger.take(n, tenant)
            events = self._queue_allocs(slots, tenant, clear)
            _tracer.tracer.events(events, self.step)
        return slots

    def alloc_exact(self, slots: list[int], tenant: str | None, clear: bool) -> None:
        """Hold exactly ``slots`` (in range, unique) for ``tenant``; :class:`SlotStateError` if one is held."""
        with self.lock:
            self.check()
            ledger = self.ledger
            taken = [s for s in slots if ledger.held[s]]
            if taken:
                tenants = [ledger.tenants[s] for s in taken[:20]]
                raise SlotStateError(f"alloc_slots: slot(s) {taken[:20]} already held (tenants {tenants})")
            ledger.check_available(len(slots), tenant)  # picking slot ids does not get round a reservation
            ledger.take_exact(slots, tenant)
            events = self._queue_allocs(slots, tenant, clear)
            _tracer.tracer.events(events, self.step)

    def _queue_allocs(self, slots: list[int], tenant: str | None, clear: bool) -> list[Event]:
        events: list[Event] = [Alloc(s, tenant, clear) for s in slots]
        self.events.extend(events)
        return events

    async def alloc_in_turn(self, n: int, tenant: str | None, clear: bool, check_open: Callable[[], None]) -> list[int]:
        """:meth:`alloc` once ``n`` slots are free and every earlier caller was served (first come, first served).

        The check that it is this call's turn and that ``n`` are free, and the
        allocation, happen in one hold of the lock, so another thread's alloc
        cannot take the slots in between. ``check_open`` runs between polls, so
        a manager that closes or breaks wakes the waiter with its error.
        Cancelled, the call leaves the line and holds nothing.
        """
        with self.lock:
            ticket = self._ticket
            self._ticket += 1
            self._waiters.append(ticket)
        try:
            delay = 0.0
            while True:
                with self.lock:
                    ledger = self.ledger
                    ledger.check_ever_available(n, tenant, f"alloc_wait({n})")
                    if self._waiters[0] == ticket and ledger.available(tenant) >= n:
                        self.check()
                        slots = self.ledger.take(n, tenant)
                        _tracer.tracer.events(self._queue_allocs(slots, tenant, clear), self.step)
                        break
                check_open()
                # Releases come from any thread, so this polls (briefly, then every ms).
                await anyio.sleep(delay)
                delay = min(0.001, delay + 0.0001)
        finally:
            with self.lock:
                self._waiters.remove(ticket)
        return slots

    @property
    def waiting(self) -> int:
        """Tickets in the ``alloc_wait`` line."""
        return len(self._waiters)

    def hand_over(self, slot: int, tenant: str | None, to: str | None) -> None:
        """``slot``'s tenant becomes ``to`` (checked to be ``tenant`` first, unless None): no event, no device work."""
        with self.lock:
            self.check()
            self.ledger.check_held("HandOver", slot, tenant)
            self.guard.check_slot("hand_over", slot, "hand_over")
            old = self.ledger.hand_over(slot, to)
            _tracer.tracer.note("slot.handover", slot=slot, request_id=old, to=to, step=self.step)

    def reserve(self, n: int, tenant: str) -> None:
        """Keep ``n`` pool slots for ``tenant`` until this manager releases the pool (:meth:`SlotLedger.reserve`)."""
        with self.lock:
            self.check()
            self.ledger.reserve(n, tenant)
            _tracer.tracer.note("pool.reserve", slots=n, tenant=tenant, step=self.step)

    # -- the flush's side ------------------------------------------------
    def mark(self) -> tuple[list[Event], int, int]:
        """What :meth:`untake` restores: the queue (the list a take swaps out), the step and the next ticket (no
        lock: a submit only appends to the list, and only the flush that asks, or the close, changes them)."""
        return self.events, self.step, self._backlog.taken

    def take(self) -> tuple[list[Event], int, int]:
        """Swap the queue out (vLLM's ``take_events``), advance the step: ``(events, step, backlog ticket)``."""
        with self.lock:
            events, step, ticket = self.events, self.step, self._backlog.take_ticket()
            self.events, self.step = [], step + 1
            if self._host is not None:
                self._host.reuse_freed(ticket)  # host slots freed by these events: their reads are planned now
        return events, step, ticket

    def untake(self, mark: tuple[list[Event], int, int]) -> bool:
        """Undo a take begun after ``mark``, wherever it stopped, unless the backlog holds its work (False): the
        events go back in front, in order, with step and ticket (host slots they freed stay busy till it runs).
        A repeat does nothing (a stopped flush over a channel is resolved as it stops, and again in the next flush)."""
        with self.lock:
            events, step, ticket = mark
            if self._backlog.holds(ticket):
                return False
            if self.step != step:  # swapped out (one statement with the step): the events since go after them
                self.events, self.step = events + self.events, step  # one statement: a repeat finds it done
                if self._host is not None:
                    self._host.reuse_freed(ticket)  # the take's own, finished (a repeat is harmless)
            self._backlog.untake(ticket)
        return True

    def follow(self, step: int) -> int:
        """On a receiving rank: the source ran ``step``, the next is ours; the plan's ticket (:meth:`untake`: undo)."""
        with self.lock:
            self.step = step + 1
            return self._backlog.take_ticket()

    def snapshot(self) -> list[Event]:
        """A copy of the queued events."""
        with self.lock:
            return list(self.events)

    def held(self) -> dict[int, str | None]:
        """Held pool slots and their tenants."""
        with self.lock:
            return self.ledger.held_by()

    def check_idle(self, host: bool | None) -> None:
        """Raise :class:`SlotLeakError` if a slot (or, unless ``host`` is False, a host slot) is held.

        One hold of the lock: a swap in or out between two reads could hide a request from both. ``host``
        is checked by the caller (True only with a host pool).
        """
        with self.lock:
            held = self.ledger.held_by()
            host_held = self._host.held_by() if self._host is not None and host is not False else {}
        if held or host_held:
            parts = [_listed(held, "slot"), _listed(host_held, "host slot")]
            raise SlotLeakError("; ".join(p for p in parts if p), held, host_held)


def _listed(held: dict[int, str | None], what: str) -> str:
    if not held:
        return ""
    shown = ", ".join(f"{s} ({t!r})" for s, t in list(held.items())[:20])
    more = f" and {len(held) - 20} more" if len(held) > 20 else ""
    return f"{len(held)} {what}(s) held while idle: {shown}{more}"
