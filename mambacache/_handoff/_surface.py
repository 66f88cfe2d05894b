"""CacheManager's hand-off surface: a slot's state leaving for another engine, or arriving from one.

:class:`HandOff` checks arguments and delegates to the manager's
:class:`~mambacache._handoff._book.HandOffBook`, which owns every transition;
it puts the book on the core's queue as its
:class:`~mambacache._queue.SubmitGuard`. :class:`CacheManager` is the public
class: the core's :class:`~mambacache._manager.ManagerCore` with this surface,
assembled here, above the core, so the core imports no layer. The events are
planned as the host tier's offload and freeing restore (``docs/transfer.md``);
a :class:`~mambacache._handoff._transfer.StateTransfer` moves the staged bytes between
engines.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Literal, overload

from .._errors import InvalidArgumentError
from .._events import Export
from .._manager import ManagerCore
from .._validate import as_slot, check_request_id
from ._book import HandOffBook, check_exports

if TYPE_CHECKING:
    from .._host import HostPool
    from .._pool import StatePool
    from .._queue import StepQueue

__all__ = ["CacheManager", "HandOff"]


def _check_ids(what: str, request_ids: Any) -> None:
    if type(request_ids) is not list or not all(type(r) is str for r in request_ids):
        raise InvalidArgumentError(f"{what} takes a list of request ids (str), got {request_ids!r}")


def _check_arrived(what: str, arrived: Any) -> None:
    if arrived is not None and not callable(arrived):
        raise InvalidArgumentError(f"{what}'s arrived must be a callable or None, got {arrived!r}")


def _check_to(to: Any) -> int | None:
    """A destination: a non-negative int (a peer's rank) or None (any peer)."""
    if to is not None and (type(to) is not int or to < 0):
        raise InvalidArgumentError(f"to must be a peer's rank (a non-negative int) or None, got {to!r}")
    return to


class HandOff:
    """The export and import methods of :class:`~mambacache.CacheManager` (a mixin over its pools and queue).

    Invariant: an export's staging host slot and the exported pool slot stay
    held by the request until the peer acknowledges; an import reads exactly the
    state that arrived for its request, once; a host slot that belongs to a
    transfer is changed by no other call.
    """

    _pool: StatePool
    _host: HostPool | None
    _queue: StepQueue

    def __init__(self) -> None:
        """Called by :class:`~mambacache._manager.ManagerCore`'s ``__init__`` last, over the finished core: with a
        host pool, the book, put on the queue as its guard (without one there is nothing to stage in, and the
        queue keeps its no-op guard: the decode step asks nothing more)."""
        super().__init__()
        host, queue = self._host, self._queue
        self._handoff: HandOffBook | None = None
        if host is not None:
            # A proxy, not the queue: the queue holds the book, and a cycle would keep the manager's
            # graph (its process group with it) alive until the cyclic GC ran, at exit after
            # destroy_process_group at worst, where gloo's destructor aborts the process.
            self._handoff = HandOffBook(weakref.proxy(queue), queue.ledger, host.ledger, self._pool.backlog)
            queue.guard_with(self._handoff)

    def _book(self, what: str) -> HandOffBook:
        book = self._handoff
        if book is None:
            raise InvalidArgumentError(f"{what} needs a host pool to stage in: CacheManager(pool, host_pool=...)")
        return book

    @overload
    def export(self, slot: int, request_id: str, *, to: int | None = None, in_place: Literal[False] = False) -> int: ...

    @overload
    def export(self, slot: int, request_id: str, *, to: int | None = None, in_place: Literal[True]) -> None: ...

    @overload
    def export(self, slot: int, request_id: str, *, to: int | None = None, in_place: bool) -> int | None: ...

    def export(self, slot: int, request_id: str, *, to: int | None = None, in_place: bool = False) -> int | None:
        """``slot``'s state as of this point of the event order goes to the peer (on the transfer's next send).

        Later events on ``slot`` do not reach what is sent. ``slot`` stays held by
        ``request_id`` until the peer acknowledges; the transfer then releases it.
        Releasing it first withdraws the export (refused while a send of it awaits
        the ack); handing it over or exporting it again is refused. ``to``: the
        peer's rank it is for (a transfer to another peer leaves it alone), or
        None for whichever transfer sends first. Returns the staging host slot.
        Needs a host pool (the staging area).

        ``in_place=True``: no staging copy and no host slot (returns None): the
        send reads ``slot`` itself once every event queued before the export ran.
        Until the peer acknowledges, every call that would write ``slot`` (a
        clear, a copy or commit into it, a restore into it) is refused
        (:class:`SlotStateError`, nothing changed), and the engine must not write
        it either (no forward pass of the request): for a request whose prefill is
        done and that waits only to be sent, as a disaggregated prefill engine's
        are. It saves one pass over the state's bytes.
        """
        check_request_id(request_id)
        if type(request_id) is not str:
            raise InvalidArgumentError("export needs the request's id: the peer imports by it")
        if type(in_place) is not bool:
            raise InvalidArgumentError(f"in_place must be a bool, got {in_place!r}")
        dest = _check_to(to)
        return self._book("export").export(as_slot(slot, self._pool.num_slots), request_id, dest, in_place)

    def import_into(self, slot: int, request_id: str) -> None:
        """Allocate free ``slot`` to ``request_id`` without a clear; it reads the state received for it.

        A clear or release of ``slot`` queued before this never wipes the imported
        state, one queued after it does. The state must have arrived (the
        transfer's ``receive``); else :class:`SlotStateError`, nothing changed.
        After :meth:`expect_import`, ``slot`` must be the slot it named: a state
        that arrived in it is taken as it is (nothing to copy), one that arrived
        in staging is restored into it.
        """
        check_request_id(request_id)
        if type(request_id) is not str:
            raise InvalidArgumentError("import_into needs the request's id: the state arrived under it")
        self._book("import_into").arrivals.import_into(as_slot(slot, self._pool.num_slots), request_id)

    def expect_import(self, slot: int, request_id: str) -> None:
        """Allocate free ``slot`` to ``request_id`` without a clear, as the place its state lands in on arrival.

        A receive that brings the state once the flush that takes this alloc has
        run writes it straight into ``slot``: no staging host slot and no copy at
        the import (one arriving earlier lands in staging as without this call).
        Until :meth:`import_into` of ``slot`` every other call on it, read or
        write, is refused (:class:`SlotStateError`, nothing changed), and the
        engine must not run the request; releasing it gives the state up
        (refused while its bytes are being written). :class:`SlotStateError`,
        nothing changed, when ``slot`` is held or a state of ``request_id`` is
        expected or has arrived already. Needs a host pool, as every hand-off call.
        """
        check_request_id(request_id)
        if type(request_id) is not str:
            raise InvalidArgumentError("expect_import needs the request's id: the state arrives under it")
        self._book("expect_import").arrivals.expect(as_slot(slot, self._pool.num_slots), request_id)

    def awaiting_import(self, slot: int) -> str | None:
        """The request whose state ``slot`` awaits from a peer (:meth:`expect_import`, not imported or released
        since), else None: such a slot holds no state yet, so every call that reads or writes it is refused."""
        slot = as_slot(slot, self._pool.num_slots)
        book = self._handoff
        return None if book is None else book.arrivals.awaiting_in(slot)

    def discard_arrived(self, request_id: str) -> int:
        """The state that arrived for ``request_id`` will not be imported (the request was aborted): its staging
        host slot is dropped from this point. Returns it; :class:`SlotStateError`, nothing changed, when no state
        for ``request_id`` awaits an import."""
        check_request_id(request_id)
        return self._book("discard_arrived").arrivals.discard(request_id)

    # -- the transfer's side (StateTransfer calls these; engines call the two above) --------
    def exports_ready(self, to: int | None = None) -> list[Export]:
        """The exports whose staging copy has run (work done, not a step number), not acknowledged and not being
        sent, in export order; with ``to``, only those addressed to ``to`` or to no one."""
        dest = _check_to(to)
        return self._book("exports_ready").ready(dest, take=False)

    def take_exports(self, to: int | None = None) -> list[Export]:
        """:meth:`exports_ready`, now being sent: until :meth:`exports_delivered` or :meth:`exports_returned`,
        a release of their slots is refused (the peer may or may not hold their states). On a closed or
        closing manager :class:`ManagerClosedError`, before anything is taken."""
        dest = _check_to(to)
        return self._book("take_exports").ready(dest, take=True)

    def exports_returned(self, exports: list[Export], *, peer: int | None = None, batch: Hashable = None) -> None:
        """The send of ``exports`` failed: they wait for the next send, and releasing a slot withdraws its export.

        ``peer``: the send to that rank failed after it may have landed them (in doubt): those exported to no
        one in particular are from now on taken only for ``peer``, never delivered to a second peer. ``batch``
        (with ``peer``): the batch they may have landed under, which :meth:`exports_in_doubt` names to every
        later sender to ``peer``, so that whichever sends them again sends that batch (the peer acknowledges it
        without landing it twice); ``peer`` without it: under no batch (a retry the peer refused). Without
        ``peer`` (sent nowhere, or refused on a first try) each export's record stays as it was."""
        dest = _check_to(peer)
        if batch is not None and (dest is None or not isinstance(batch, Hashable)):
            raise InvalidArgumentError(f"exports_returned's batch needs a peer and must be hashable, got {batch!r}")
        self._book("exports_returned").returned(check_exports("exports_returned", exports), dest, batch)

    def exports_in_doubt(self, exports: list[Export]) -> list[Hashable]:
        """Per export (as :meth:`take_exports` gave it), the batch under which its send may have landed at its
        peer (:meth:`exports_returned`'s ``batch``): send it again as that batch; None where it is in doubt under
        none. The record is the manager's, not a transfer's: any transfer of the manager to that peer finds it."""
        return self._book("exports_in_doubt").in_doubt(check_exports("exports_in_doubt", exports))

    def exports_delivered(self, exports: list[Export]) -> None:
        """The peer acknowledged ``exports``: release their pool slots and drop their staging slots (all or none).

        Taken on a closing manager too (its last flush runs the releases); on a
        closed one the slots and staging slots are freed at once, and the closed
        manager's ledgers stay claimed until its last send in flight settles."""
        self._book("exports_delivered").delivered(check_exports("exports_delivered", exports))

    def landing_room(self, request_ids: list[str] | None = None) -> int:
        """How many states :meth:`land` could take at once now: the free host slots that no queued event and no
        unfinished work reads (``host_pool.num_free`` also counts those freed in this step, which a landing
        cannot take until the step's flush has run); with ``request_ids`` that all land in place now
        (:meth:`land_in_place`), their number. Needs a host pool."""
        if request_ids is not None:
            _check_ids("landing_room", request_ids)
        return self._book("landing_room").arrivals.room(request_ids)

    def land(
        self,
        request_ids: list[str],
        write: Callable[[list[int]], None] | None = None,
        *,
        arrived: Callable[[list[int]], None] | None = None,
    ) -> list[int]:
        """Staging host slots for states arriving for ``request_ids`` (each held by its id until imported).

        ``write(slots)`` (a transfer's receive): writes the arrived rows into the
        slots, called outside the manager's lock; the states count as arrived
        (importable, discardable) only once it returned, and if it raises the
        slots are freed and nothing arrived (its error is raised).
        ``arrived(slots)``: called under the manager's lock in the hold that
        makes them arrived, so before any import of them can be (a transfer
        traces its receive line there), before they count: if it raises, none
        arrived and its error is raised; it must not call the manager.
        All or none: :class:`InvalidArgumentError` unless a list of str,
        :class:`SlotStateError` when a state for one of them arrived already and
        is not imported yet, :class:`PoolExhaustedError` when too few host slots
        are free of every queued or unfinished read and write (a flush in
        progress, a failed flush awaiting its repair).
        """
        _check_ids("land", request_ids)
        if write is not None and not callable(write):
            raise InvalidArgumentError(f"land's write must be a callable or None, got {write!r}")
        _check_arrived("land", arrived)
        return self._book("land").arrivals.land(request_ids, write, arrived)

    def land_in_place(
        self,
        request_ids: list[str],
        write: Callable[[list[int]], None],
        *,
        arrived: Callable[[list[int]], None] | None = None,
    ) -> list[int] | None:
        """The pool slots ``request_ids`` await their states in (:meth:`expect_import`), for ``write(slots)`` (a
        transfer's receive) to write the arrived rows into, outside the manager's lock; None, with nothing
        changed, unless every one of them lands in place now (expected, and the flush that took its alloc
        ran). Until ``write`` returns a release of those slots is refused; if it raises nothing arrived.
        ``arrived(slots)``: as in :meth:`land`.
        :class:`SlotStateError` (nothing changed) when a state for one of them arrived already."""
        _check_ids("land_in_place", request_ids)
        if not callable(write):
            raise InvalidArgumentError(f"land_in_place's write must be a callable, got {write!r}")
        _check_arrived("land_in_place", arrived)
        return self._book("land_in_place").arrivals.land_in_place(request_ids, write, arrived)


class CacheManager(ManagerCore, HandOff):
    """Batches a step's slot events and applies them with exactly sequential semantics.

    Invariants:

    * the pool's held slots (and each slot's tenant) are the state at the *end*
      of the event queue: ``alloc`` and ``release`` update them at once, and
      every event is validated against the state at its own point of the order;
    * a flush leaves every held slot as running all queued events one at a
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
