"""The receiving half of the hand-off's bookkeeping: states arriving from a peer, until imported.

A state arrives one of two ways (``docs/transfer.md``)::

    land():           staging host slot h ──written──> arrived ──import_into(t)──> Import(h -> t) restores it
    expect_import(t): pool slot t awaits ──land_in_place: written──> arrived in t ──import_into(t)──> t's own

*In place* (``expect_import``), the bytes go straight into the pool slot the
import will take: no staging host slot and no restore copy. The slot is
allocated to the request at once (``Alloc(t, clear=False)``) and every other
call on it, read or write, is refused until ``import_into`` (the engine must
not run the request before it either); a release withdraws it (refused while
its bytes are being written). A landing writes it only once the ticket of the
flush that took that alloc is done (:attr:`Backlog.done`): work on the slot's
previous tenant may still be unfinished before. A batch that cannot land in
place (an id not expected, or its slot not settled yet) lands in staging host
slots, and ``import_into`` restores it from there. No torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from .. import _tracing
from .._errors import SlotStateError
from .._events import Alloc, DropHost, Event, Import

if TYPE_CHECKING:
    from .._backlog import Backlog
    from .._ledger import SlotLedger

__all__ = ["Arrivals", "QueueSide"]

WAITING, LANDING, ARRIVED = "waiting", "landing", "arrived"


class QueueSide(Protocol):
    """What the book needs of the step queue (which owns the lock, the event list and the lifecycle)."""

    lock: threading.Lock
    step: int

    def check(self, settling: bool = False) -> None: ...

    def closed(self) -> bool: ...

    def enqueue(self, events: Sequence[Event]) -> None: ...

    def settled(self) -> None: ...


class Arrivals:
    """States arrived (or arriving) and not imported yet; changed only under the queue's lock.

    Invariants: a request id has at most one state in ``arrived`` and
    ``landing`` together (``landing``: its rows not written yet, so neither
    importable nor discardable), and none there while it is ``awaiting`` in
    place in phase LANDING or ARRIVED; ``hosts`` holds exactly their staging
    host slots; ``awaiting`` and ``slots`` are one map both ways (request id
    <-> pool slot, with the ticket of the take of its alloc and its phase), each
    such slot held by its request, and touched by no event until
    ``import_into`` or a release ends it.
    """

    __slots__ = (
        "_backlog", "_host", "_ledger", "_queue", "arrived", "awaiting", "hosts", "landing", "slots", "writing",
    )  # fmt: skip

    def __init__(self, queue: QueueSide, ledger: SlotLedger, host: SlotLedger, backlog: Backlog) -> None:
        self._queue, self._ledger, self._host, self._backlog = queue, ledger, host, backlog
        self.arrived: dict[str, int] = {}  # request id -> staging host slot
        self.landing: dict[str, int] = {}  # request id -> staging host slot being written (not arrived yet)
        self.hosts: dict[int, str] = {}  # staging host slot -> "landing" | "arrived"
        self.awaiting: dict[str, tuple[int, int, str]] = {}  # request id -> (pool slot, ticket, phase), in place
        self.slots: dict[int, str] = {}  # pool slot -> the request id awaiting its state there
        self.writing = 0  # landings whose rows are being written (a closed manager keeps the pools claimed meanwhile)

    # -- checks other calls make (under the lock) --------------------------------
    def check_slot(self, what: str, slot: int) -> None:
        """:class:`SlotStateError` when ``slot`` awaits a state in place: nothing but the landing writes it, and
        nothing may read it before the import."""
        rid = self.slots.get(slot)
        if rid is not None:
            phase = self.awaiting[rid][2]
            raise SlotStateError(
                f"{what}: slot {slot} awaits the state of {rid!r} from a peer ({phase}); import_into() it first,"
                " or release() it to give the state up"
            )

    def awaiting_in(self, slot: int) -> str | None:
        """The request id awaiting its state in ``slot``, if any (under the lock: one consistent read)."""
        with self._queue.lock:
            return self.slots.get(slot)

    def withdraw_check_locked(self, slot: int) -> bool:
        """Whether a release of ``slot`` ends an arrival in place; raises, changing nothing, while its bytes are
        being written."""
        rid = self.slots.get(slot)
        if rid is None:
            return False
        if self.awaiting[rid][2] == LANDING:
            raise SlotStateError(f"Release: the state of {rid!r} is being written into slot {slot}; release it after")
        return True

    def withdraw_locked(self, slot: int) -> None:
        """After a release of ``slot`` was queued: the arrival in place ends (a state there is given up)."""
        rid = self.slots.pop(slot)
        phase = self.awaiting.pop(rid)[2]
        if phase == ARRIVED:
            _tracing.tracer.transfer("transfer.discard", None, [rid], step=self._queue.step)

    # -- landing ------------------------------------------------------------------
    def room(self, request_ids: list[str] | None = None) -> int:
        """How many states :meth:`land` could take now: free host slots no queued event nor unfinished work
        reads (O(host slots)); with ``request_ids`` that all land in place now, their number."""
        with self._queue.lock:
            if request_ids and self._in_place_locked(request_ids):
                return len(request_ids)
            return self._host.num_settled(self._backlog.done)

    def _in_place_locked(self, request_ids: list[str]) -> bool:
        """Whether every id awaits its state in a slot the landing may write now (its alloc's ticket is done)."""
        done, awaiting, arrived, landing = self._backlog.done, self.awaiting, self.arrived, self.landing
        return all(
            (a := awaiting.get(r)) is not None and a[2] == WAITING and a[1] < done and r not in arrived
            and r not in landing  # arriving in staging (another receive): that one is the state
            for r in request_ids
        ) and len(set(request_ids)) == len(request_ids)  # fmt: skip

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
        (:meth:`SlotLedger.take_settled`). ``write(slots)``: writes the rows,
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
            slots = host.take_settled(len(request_ids), None, self._backlog.done)
            for r, h in zip(request_ids, slots, strict=True):
                host.tenants[h] = r
                self.hosts[h] = "landing"
            if write is None:
                try:
                    if arrived is not None:
                        arrived(slots)  # before they count: one that raises (a tracer's full disk) leaves none arrived
                except BaseException:
                    self._free_locked(slots)
                    raise
                self._arrive_locked(request_ids, slots)
                return slots
            self.landing.update(zip(request_ids, slots, strict=True))
            self.writing += 1
        try:
            write(slots)
        except BaseException:
            with q.lock:
                self._unland_locked(request_ids, slots)
            raise
        with q.lock:
            try:
                q.check()  # a manager closed (or broken) meanwhile can never import them: not arrived
                if arrived is not None:
                    arrived(slots)  # before they count: one that raises (a tracer's full disk) leaves none arrived
            except BaseException:
                self._unland_locked(request_ids, slots)
                raise
            self.writing -= 1
            for r in request_ids:
                del self.landing[r]
            self._arrive_locked(request_ids, slots)
        return slots

    def _unland_locked(self, request_ids: list[str], slots: list[int]) -> None:
        """A landing in staging that did not arrive: nothing queued reads its slots and only its write wrote them,
        so they are free at once."""
        for r in request_ids:
            del self.landing[r]
        self._free_locked(slots)
        self._written_locked()

    def _free_locked(self, slots: list[int]) -> None:
        """Staging slots taken for states that did not arrive, free again."""
        host = self._host
        for h in slots:
            del self.hosts[h]
            host.tenants[h] = None  # taken for no tenant (take_settled): given back as such
        host.give_back(slots)

    def _written_locked(self) -> None:
        """A landing's write ended without an arrival: on a closed manager the last one frees the pools."""
        self.writing -= 1
        self._queue.settled()

    def _check_new_locked(self, request_ids: list[str]) -> None:
        landed = [r for r in request_ids if r in self.arrived or r in self.landing]
        landed += [r for r in request_ids if r in self.awaiting and self.awaiting[r][2] != WAITING]
        if landed or len(set(request_ids)) != len(request_ids):
            raise SlotStateError(f"states for {landed or request_ids} arrived twice without an import between")

    def _arrive_locked(self, request_ids: list[str], slots: list[int]) -> None:
        """Make the states arrived. The caller's ``arrived(slots)`` ran just before in this lock hold: if it raised,
        none of them did (the transfer then answers that nothing landed, and its sender must not hear that while
        they are here)."""
        for r, h in zip(request_ids, slots, strict=True):
            self.arrived[r] = h
            self.hosts[h] = "arrived"

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
        q, awaiting = self._queue, self.awaiting
        with q.lock:
            q.check()
            if not self._in_place_locked(request_ids):
                self._check_new_locked(request_ids)
                return None
            slots = [awaiting[r][0] for r in request_ids]
            self._phase_locked(request_ids, LANDING)
            self.writing += 1
        try:
            write(slots)
        except BaseException:
            with q.lock:
                self._phase_locked(request_ids, WAITING)
                self._written_locked()
            raise
        with q.lock:
            try:
                q.check()  # as in land(): a manager that closed meanwhile never imports them
                if arrived is not None:
                    arrived(slots)  # as in land(): before they count
            except BaseException:
                self._phase_locked(request_ids, WAITING)
                self._written_locked()
                raise
            self.writing -= 1
            self._phase_locked(request_ids, ARRIVED)
        return slots

    def _phase_locked(self, request_ids: list[str], phase: str) -> None:
        awaiting = self.awaiting
        for r in request_ids:
            slot, ticket, _ = awaiting[r]
            awaiting[r] = (slot, ticket, phase)

    # -- the engine's calls ---------------------------------------------------------
    def expect(self, slot: int, tenant: str) -> None:
        """Hold free ``slot`` for ``tenant`` without a clear, as the place its state lands in (see the module).

        :class:`SlotStateError` (nothing changed) when ``slot`` is held, or a
        state for ``tenant`` arrived or is expected already.
        """
        q, ledger = self._queue, self._ledger
        with q.lock:
            q.check()
            if tenant in self.arrived or tenant in self.landing or tenant in self.awaiting:
                where = f"slot {self.awaiting[tenant][0]}" if tenant in self.awaiting else "a staging host slot"
                raise SlotStateError(f"expect_import: the state of {tenant!r} is expected or arrived in {where}")
            if ledger.held[slot]:
                raise SlotStateError(f"expect_import: slot {slot} is held by {ledger.tenants[slot]!r}")
            ledger.check_available(1, tenant)
            ledger.take_exact([slot], tenant)
            # The events queued now are taken by the next take: its ticket done, no earlier work touches the slot.
            self.awaiting[tenant] = (slot, self._backlog.taken, WAITING)
            self.slots[slot] = tenant
            q.enqueue([Alloc(slot, tenant, False)])
            _tracing.tracer.note("slot.expect", slot=slot, request_id=tenant, step=q.step)

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
            awaited = self.awaiting.get(tenant)
            if awaited is not None and awaited[0] != slot:
                raise SlotStateError(f"import_into: the state of {tenant!r} lands in slot {awaited[0]}, not {slot}")
            if awaited is not None and awaited[2] == ARRIVED:
                del self.awaiting[tenant], self.slots[slot]
                _tracing.tracer.events([Import(None, slot, tenant)], q.step)  # its bytes are there: nothing to run
                return
            h = self.arrived.get(tenant)
            if h is None:
                raise SlotStateError(f"import_into: no state has arrived for {tenant!r} (receive it first)")
            events: list[Event] = [Import(h, slot, tenant)]
            if awaited is not None:  # it arrived in staging: restored into the slot that awaited it
                del self.awaiting[tenant], self.slots[slot]
            else:
                if ledger.held[slot]:
                    raise SlotStateError(f"import_into: slot {slot} is held by {ledger.tenants[slot]!r}")
                ledger.check_available(1, tenant)
                ledger.take_exact([slot], tenant)
                events.insert(0, Alloc(slot, tenant, False))
            del self.arrived[tenant]
            del self.hosts[h]
            host.free_later(h)
            q.enqueue(events)

    def discard(self, tenant: str) -> int:
        """Drop the staging host slot of the state that arrived for ``tenant``; returns it. :class:`SlotStateError`
        (nothing changed) when none is waiting for an import in a staging host slot (one that arrived in place
        is given up by releasing its slot)."""
        host, q = self._host, self._queue
        with q.lock:
            q.check()
            h = self.arrived.pop(tenant, None)
            if h is None:
                where = f"; it is in slot {self.awaiting[tenant][0]}: release that" if tenant in self.awaiting else ""
                raise SlotStateError(f"discard_arrived: no state for {tenant!r} awaits an import{where}")
            del self.hosts[h]
            host.free_later(h)
            q.enqueue((DropHost(h),))
            _tracing.tracer.transfer("transfer.discard", None, [tenant], step=q.step)
        return h
