"""The receiving half of the hand-off's bookkeeping: states arriving from a peer, until imported.

A state arrives one of two ways (``docs/transfer.md``)::

    land():           staging host slot h ──LANDING: written──> ARRIVED ──import_into(t)──> Import(h -> t) restores it
    expect_import(t): pool slot t WAITING ──land_in_place: LANDING──> ARRIVED in t ──import_into(t)──> t's own

Each arriving state is one :class:`Arrival` record with one
:class:`ArrivalPhase`, and :class:`Arrivals` makes every transition of it.

*In place* (``expect_import``), the bytes go straight into the pool slot the
import will take: no staging host slot and no restore copy. The slot is
allocated to the request at once (``Alloc(t, clear=False)``) and every other
call on it, read or write, is refused until ``import_into`` (the engine must
not run the request before it either); a release withdraws it (refused while
its bytes are being written). A landing writes it only once the ticket of the
flush that took that alloc is done (:attr:`Backlog.done`): work on the slot's
previous tenant may still be unfinished before. A batch that cannot land in
place (an id not expected, or its slot's alloc not run yet) lands in staging host
slots, and ``import_into`` restores it from there. No torch.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .._core import _tracer
from .._core._errors import SlotStateError
from .._core._events import Alloc, DropHost, Event, Import

if TYPE_CHECKING:
    from .._core._backlog import Backlog
    from .._core._ledger import SlotLedger

__all__ = ["Arrival", "ArrivalPhase", "Arrivals", "QueueSide"]


class ArrivalPhase(enum.Enum):
    """Where an arriving state stands: awaited in place, being written, or written and importable."""

    WAITING = "waiting"  # a pool slot awaits it (expect_import); nothing of it written anywhere
    LANDING = "landing"  # its rows are being written, outside the lock (neither importable nor discardable)
    ARRIVED = "arrived"  # written: import_into() takes it (and discard_arrived() drops it, when in staging)


@dataclass(slots=True, eq=False)
class Arrival:
    """One request's state arriving from a peer, from :meth:`Arrivals.expect` or :meth:`Arrivals.land` until
    imported, discarded, released (in place) or not landed after all.

    ``slot``: the pool slot awaiting it in place (held by ``request_id``;
    ``ticket``: the backlog ticket of the take of its alloc, which must be
    done before a landing writes the slot), None when none awaits it.
    ``host``: the staging host slot it lands or arrived in (held by
    ``request_id``), None when it is not in staging.

    Invariants: WAITING has a ``slot`` and no ``host``; LANDING or ARRIVED
    without a ``host`` is in place, in ``slot``; with a ``host`` it is in
    staging, and a ``slot`` that still awaits it takes it by a restore at the
    import (a release of that slot gives up only the slot, the staged state
    stays). So a request id has one arriving state, written in one place.
    """

    request_id: str
    phase: ArrivalPhase
    slot: int | None = None
    ticket: int = 0
    host: int | None = None

    @property
    def in_place(self) -> bool:
        """Whether its bytes go, or went, into the pool slot that awaits it (no staging host slot)."""
        return self.host is None


WAITING, LANDING, ARRIVED = ArrivalPhase.WAITING, ArrivalPhase.LANDING, ArrivalPhase.ARRIVED


class QueueSide(Protocol):
    """What the book needs of the step queue (which owns the lock, the event list and the lifecycle)."""

    lock: threading.Lock
    step: int

    def check(self, ending_send: bool = False) -> None: ...

    def closed(self) -> bool: ...

    def enqueue(self, events: Sequence[Event]) -> None: ...

    def end_release(self) -> None: ...


class Arrivals:
    """The states arriving from a peer and not imported yet, one :class:`Arrival` each, and every transition of
    them; changed only under the queue's lock.

    ``states`` maps each request id to its record; ``slots`` (pool slot ->
    record) and ``hosts`` (staging host slot -> record) index the same
    records by where they are, and hold exactly the records with a ``slot``
    and with a ``host``. A slot in ``slots`` is held by its request and
    touched by no event until ``import_into`` or a release ends it. Methods
    named ``*_locked`` run under the lock the caller holds; the others take it.
    """

    __slots__ = ("_backlog", "_host", "_ledger", "_queue", "hosts", "slots", "states")

    def __init__(self, queue: QueueSide, ledger: SlotLedger, host: SlotLedger, backlog: Backlog) -> None:
        self._queue, self._ledger, self._host, self._backlog = queue, ledger, host, backlog
        self.states: dict[str, Arrival] = {}  # request id -> its arriving state
        self.slots: dict[int, Arrival] = {}  # pool slot awaiting a state in place -> that state
        self.hosts: dict[int, Arrival] = {}  # staging host slot -> the state landing or arrived there

    def writing(self) -> bool:
        """Under the lock: whether a landing writes its rows (a closed manager keeps the pools claimed meanwhile)."""
        return any(a.phase is LANDING for a in self.states.values())

    # -- checks other calls make (under the lock) --------------------------------
    def check_slot(self, what: str, slot: int) -> None:
        """:class:`SlotStateError` when ``slot`` awaits a state in place: nothing but the landing writes it, and
        nothing may read it before the import."""
        a = self.slots.get(slot)
        if a is not None:
            phase = a.phase.value if a.in_place else f"{a.phase.value} in a staging host slot"
            raise SlotStateError(
                f"{what}: slot {slot} awaits the state of {a.request_id!r} from a peer ({phase}); import_into() it"
                " first, or release() it to give the state up"
            )

    def awaiting_in(self, slot: int) -> str | None:
        """The request id awaiting its state in ``slot``, if any (under the lock: one consistent read)."""
        with self._queue.lock:
            a = self.slots.get(slot)
            return None if a is None else a.request_id

    def withdraw_check_locked(self, slot: int) -> bool:
        """Whether a release of ``slot`` ends an arrival in place; raises, changing nothing, while its bytes are
        being written."""
        a = self.slots.get(slot)
        if a is None:
            return False
        if a.phase is LANDING and a.in_place:
            raise SlotStateError(
                f"Release: the state of {a.request_id!r} is being written into slot {slot}; release it after"
            )
        return True

    def withdraw_locked(self, slot: int) -> None:
        """After a release of ``slot`` was queued: the slot awaits nothing any more (a state arrived in it is given
        up; one in staging stays, for an import into another slot or a discard)."""
        a = self.slots.pop(slot)
        a.slot = None
        if a.in_place:
            del self.states[a.request_id]
            if a.phase is ARRIVED:
                _tracer.tracer.transfer("transfer.discard", None, [a.request_id], step=self._queue.step)

    # -- landing ------------------------------------------------------------------
    def room(self, request_ids: list[str] | None = None) -> int:
        """How many states :meth:`land` could take now: free host slots no queued event nor unfinished work
        reads (O(host slots)); with ``request_ids`` that all land in place now, their number."""
        with self._queue.lock:
            if request_ids and self._in_place_locked(request_ids):
                return len(request_ids)
            return self._host.num_free_now(self._backlog.done)

    def _in_place_locked(self, request_ids: list[str]) -> bool:
        """Whether every id awaits its state in a slot the landing may write now (its alloc's ticket is done) and
        nothing of it is written elsewhere (WAITING: not arriving in staging by another receive)."""
        done, states = self._backlog.done, self.states
        return all(
            (a := states.get(r)) is not None and a.phase is WAITING and a.ticket < done for r in request_ids
        ) and len(set(request_ids)) == len(request_ids)

    def land(
        self,
        request_ids: list[str],
        write: Callable[[list[int]], None] | None = None,
        arrived: Callable[[list[int]], None] | None = None,
    ) -> list[int]:
        """Staging host slots for states arriving for ``request_ids``, each held by its id; all or none.

        The rows are written at once, outside the step order, so only host
        slots that neither a queued event nor unfinished work (a flush in
        progress, a failed flush's backlog) still reads or writes will do
        (:meth:`SlotLedger.take_free_now`). ``write(slots)``: writes the rows,
        outside the lock; until it returns the states are *landing*, not
        arrived (an import or a discard of them is refused: the slot does not
        hold them yet), and if it raises the slots are freed and nothing arrived.
        So too when the manager closed (or broke) meanwhile: nothing could ever
        import them there (:class:`ManagerClosedError`, to be answered as not
        landed), and it kept the pools from the next manager until the write ended.
        ``arrived(slots)``: called in the lock hold that makes them arrived, so
        before any import of them (a transfer traces its receive line there).
        """
        host, q = self._host, self._queue
        with q.lock:
            q.check()
            self._check_new_locked(request_ids)
            slots = host.take_free_now(len(request_ids), None, self._backlog.done)
            landing = [self._land_locked(r, h) for r, h in zip(request_ids, slots, strict=True)]
            if write is None:
                try:
                    if arrived is not None:
                        arrived(slots)  # before they count: one that raises (a tracer's full disk) leaves none arrived
                except BaseException:
                    self._unland_locked(landing)
                    raise
                self._move_locked(landing, ARRIVED)
                return slots
        try:
            write(slots)
        except BaseException:
            with q.lock:
                self._unland_locked(landing)
                q.end_release()  # on a closed manager, the last write to end frees the pools
            raise
        with q.lock:
            try:
                q.check()  # a manager closed (or broken) meanwhile can never import them: not arrived
                if arrived is not None:
                    arrived(slots)  # before they count: one that raises (a tracer's full disk) leaves none arrived
            except BaseException:
                self._unland_locked(landing)
                q.end_release()
                raise
            # The caller's arrived(slots) ran just before in this lock hold: had it raised, none of them arrived
            # (the transfer then answers that nothing landed, and its sender must not hear that while they are here).
            self._move_locked(landing, ARRIVED)
        return slots

    def _land_locked(self, request_id: str, h: int) -> Arrival:
        """Staging host slot ``h`` (taken for no tenant) is now where the state of ``request_id`` lands."""
        self._host.tenants[h] = request_id
        a = self.states.get(request_id)
        if a is None:
            a = self.states[request_id] = Arrival(request_id, LANDING, host=h)
        else:  # awaited in place (WAITING, as _check_new_locked made sure): it lands in staging instead
            a.phase, a.host = LANDING, h
        self.hosts[h] = a
        return a

    def _unland_locked(self, landing: list[Arrival]) -> None:
        """A landing in staging that did not arrive: nothing queued reads its slots and only its write wrote them,
        so they are free at once; a slot that awaits one of them awaits it again."""
        host = self._host
        slots = []
        for a in landing:
            h = a.host
            assert h is not None
            del self.hosts[h]
            host.tenants[h] = None  # taken for no tenant (take_free_now): given back as such
            slots.append(h)
            if a.slot is None:
                del self.states[a.request_id]
            else:
                a.phase, a.host = WAITING, None
        host.give_back(slots)

    @staticmethod
    def _move_locked(states: list[Arrival], phase: ArrivalPhase) -> None:
        for a in states:
            a.phase = phase

    def _check_new_locked(self, request_ids: list[str]) -> None:
        states = self.states
        landed = [r for r in request_ids if (a := states.get(r)) is not None and a.phase is not WAITING]
        if landed or len(set(request_ids)) != len(request_ids):
            raise SlotStateError(f"states for {landed or request_ids} arrived twice without an import between")

    def land_in_place(
        self,
        request_ids: list[str],
        write: Callable[[list[int]], None],
        arrived: Callable[[list[int]], None] | None = None,
    ) -> list[int] | None:
        """The pool slots ``request_ids`` await their states in, written by ``write(slots)`` outside the lock;
        None (nothing changed) unless every id lands in place now (:meth:`expect`, its alloc's flush done).

        Until ``write`` returns they are landing (a release is refused); if it
        raises, or the manager closed (or broke) meanwhile (:class:`ManagerClosedError`),
        they await again, nothing arrived; once it returns they arrived, and
        ``import_into`` of each one's slot completes it without a copy
        (``arrived(slots)``: as in :meth:`land`).
        """
        q = self._queue
        with q.lock:
            q.check()
            if not self._in_place_locked(request_ids):
                self._check_new_locked(request_ids)
                return None
            landing = [self.states[r] for r in request_ids]
            slots = [a.slot for a in landing if a.slot is not None]
            self._move_locked(landing, LANDING)
        try:
            write(slots)
        except BaseException:
            with q.lock:
                self._move_locked(landing, WAITING)
                q.end_release()
            raise
        with q.lock:
            try:
                q.check()  # as in land(): a manager that closed meanwhile never imports them
                if arrived is not None:
                    arrived(slots)  # as in land(): before they count
            except BaseException:
                self._move_locked(landing, WAITING)
                q.end_release()
                raise
            self._move_locked(landing, ARRIVED)
        return slots

    # -- the engine's calls ---------------------------------------------------------
    def expect(self, slot: int, tenant: str) -> None:
        """Hold free ``slot`` for ``tenant`` without a clear, as the place its state lands in (see the module).

        :class:`SlotStateError` (nothing changed) when ``slot`` is held, or a
        state for ``tenant`` arrived or is expected already.
        """
        q, ledger = self._queue, self._ledger
        with q.lock:
            q.check()
            a = self.states.get(tenant)
            if a is not None:
                where = "a staging host slot" if a.slot is None else f"slot {a.slot}"
                raise SlotStateError(f"expect_import: the state of {tenant!r} is expected or arrived in {where}")
            if ledger.held[slot]:
                raise SlotStateError(f"expect_import: slot {slot} is held by {ledger.tenants[slot]!r}")
            ledger.check_available(1, tenant)
            ledger.take_exact([slot], tenant)
            # The events queued now are taken by the next take: its ticket done, no earlier work touches the slot.
            self.states[tenant] = self.slots[slot] = Arrival(tenant, WAITING, slot, self._backlog.taken)
            q.enqueue([Alloc(slot, tenant, False)])
            _tracer.tracer.note("slot.expect", slot=slot, request_id=tenant, step=q.step)

    def import_into(self, slot: int, tenant: str) -> None:
        """``slot`` reads the state that arrived for ``tenant``: a free slot is held for it without a clear and
        restores the staged state; the slot it awaits in (:meth:`expect`) takes it as it is, or restores it when
        it arrived in staging instead.

        :class:`SlotStateError` (nothing changed) when no state arrived for it, ``slot`` is held by another, or
        ``tenant`` awaits its state in another slot.
        """
        host, q, ledger = self._host, self._queue, self._ledger
        with q.lock:
            q.check()
            a = self.states.get(tenant)
            if a is not None and a.slot is not None and a.slot != slot:
                raise SlotStateError(f"import_into: the state of {tenant!r} lands in slot {a.slot}, not {slot}")
            if a is None or a.phase is not ARRIVED:
                raise SlotStateError(f"import_into: no state has arrived for {tenant!r} (receive it first)")
            h = a.host
            if h is None:  # arrived in place: its bytes are there, nothing to run
                self._forget_locked(a)
                _tracer.tracer.events([Import(None, slot, tenant)], q.step)
                return
            events: list[Event] = [Import(h, slot, tenant)]
            if a.slot is None:
                if ledger.held[slot]:
                    raise SlotStateError(f"import_into: slot {slot} is held by {ledger.tenants[slot]!r}")
                ledger.check_available(1, tenant)
                ledger.take_exact([slot], tenant)
                events.insert(0, Alloc(slot, tenant, False))
            # else it arrived in staging: restored into the slot that awaited it
            self._forget_locked(a)
            host.free_later(h)
            q.enqueue(events)

    def _forget_locked(self, a: Arrival) -> None:
        """``a`` leaves the book, and with it the slots it indexes (the caller frees or keeps them)."""
        del self.states[a.request_id]
        if a.slot is not None:
            del self.slots[a.slot]
        if a.host is not None:
            del self.hosts[a.host]

    def discard(self, tenant: str) -> int:
        """Drop the staging host slot of the state that arrived for ``tenant``; returns it. :class:`SlotStateError`
        (nothing changed) when none is waiting for an import in a staging host slot (one that arrived in place
        is given up by releasing its slot)."""
        host, q = self._host, self._queue
        with q.lock:
            q.check()
            a = self.states.get(tenant)
            h = None if a is None or a.phase is not ARRIVED else a.host
            if h is None:
                where = "" if a is None or a.slot is None else f"; it is in slot {a.slot}: release that"
                raise SlotStateError(f"discard_arrived: no state for {tenant!r} awaits an import{where}")
            del self.hosts[h]
            if a is not None and a.slot is not None:  # the slot that awaited it awaits a state again
                a.phase, a.host = WAITING, None
            else:
                del self.states[tenant]
            host.free_later(h)
            q.enqueue((DropHost(h),))
            _tracer.tracer.transfer("transfer.discard", None, [tenant], step=q.step)
        return h
