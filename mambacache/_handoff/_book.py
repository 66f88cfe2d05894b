"""The hand-off's bookkeeping over the step queue: exports awaiting a peer's ack, states awaiting an import.

:class:`HandOffBook` holds that state and makes every transition of it itself,
together with the ledgers and the event queue, in one hold of the queue's lock
each, so the three never disagree (the queue's own invariant). The queue never
imports it: the book is the queue's :class:`~mambacache._core._queue.SubmitGuard`,
put on it by :class:`~mambacache.CacheManager` when a manager with a host
pool is made, and it sees the queue only through
:class:`QueueSide` (a weak proxy: no reference cycle). No torch.

An export's life on the sender::

    export() ──> queued ──its stage ran──> ready ──take──> sending ──ack──> delivered: slot released, staging dropped
                   │                         │  <──returned──┘ (send failed: retry or release)
                   └──── release() ──────────┴──> withdrawn: staging dropped, nothing sent

In the book an export is one :class:`Exported` record, *queued* and *ready*
its phase WAITING, *sending* its phase SENDING.

*Ready* is keyed on work done (:attr:`Backlog.done <mambacache._core._backlog.Backlog>`): an
export is ready once the flush that took it ran its staging copy, not when
that flush took it (a failed flush keeps it unready until the repair runs it).
A release is refused only while the export is *sending*, since the peer may
then hold the state or not; before and after a send it withdraws the export.

An export *in place* (``Export.host`` None) has no staging slot: the send reads
the pool slot itself, so from the export to its end every call that would
write that slot (a clear, a copy or commit into it, a restore into it) is
refused, and its ticket is the next take's, which runs every event queued
before it.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._core import _tracer
from .._core._errors import SlotStateError
from .._core._events import Clear, CommitDraft, CopyOnWrite, DropHost, Event, Export, Release
from ._arrivals import Arrivals, QueueSide

if TYPE_CHECKING:
    from .._core._backlog import Backlog
    from .._core._ledger import SlotLedger
    from .._core._queue import SlotUse

__all__ = ["ExportPhase", "Exported", "HandOffBook", "QueueSide"]


class ExportPhase(enum.Enum):
    """Where an export in the book stands. Whether it is ready is not a phase: that is work done (its ``ticket``
    below :attr:`Backlog.done <mambacache._core._backlog.Backlog>`), which changes without the book."""

    WAITING = "waiting"  # awaiting a send: queued (its staging copy not run yet) or ready
    SENDING = "sending"  # a send took it and has not ended (delivered, or returned to WAITING)


@dataclass(slots=True, eq=False)
class Exported:
    """One export in the book, from :meth:`HandOffBook.export` until the peer acknowledges it or a release
    withdraws it.

    ``ticket``: the backlog ticket of the take that runs its staging copy (in
    place: that runs every event queued before it); it is ready once that
    ticket is done. ``peer``: the peer a send to which failed after it may
    have landed there (in doubt); set only for an export addressed to no one,
    which is taken for ``peer`` only from then on. ``batch``: the batch it may
    have landed under at its peer, which every later sender to that peer sends
    it under again (None: not in doubt, or in doubt under none).

    Invariants: ``event.slot`` stays held by ``event.request_id`` (its tenant
    does not change); in place (``event.host`` None) nothing writes that slot;
    a release is refused while SENDING and withdraws it while WAITING.
    """

    event: Export
    ticket: int
    phase: ExportPhase = ExportPhase.WAITING
    peer: int | None = None
    batch: Hashable = None


WAITING, SENDING = ExportPhase.WAITING, ExportPhase.SENDING


class HandOffBook:
    """Exports not yet acknowledged, one :class:`Exported` each, and (in :attr:`arrivals`) the states arriving
    for an import; every transition of an export, made under the queue's lock. The queue's guard for both.

    ``exports`` maps each exported pool slot to its record, in export order
    (a slot has at most one export); ``hosts`` indexes the same records by
    staging host slot (exactly those not in place), which no call but the
    hand-off's own changes (a drop or a restore of one is refused), as the
    arrivals' own; ``ids`` counts the records of each request id, no two of
    which may go in one batch (a peer imports one state per id: both would
    be refused, every batch with them, for good), so they go to two peers.
    Methods named ``*_locked`` run under the lock the caller holds; the others
    take it.
    """

    __slots__ = ("_backlog", "_host", "_ledger", "_queue", "arrivals", "awaited", "exports", "hosts", "ids")

    def __init__(self, queue: QueueSide, ledger: SlotLedger, host: SlotLedger, backlog: Backlog) -> None:
        self._queue, self._ledger, self._host, self._backlog = queue, ledger, host, backlog
        self.exports: dict[int, Exported] = {}  # pool slot -> its export, in export order
        self.hosts: dict[int, Exported] = {}  # staging host slot -> its export
        self.ids: dict[str, int] = {}  # request id -> how many exports of it are in ``exports``
        self.arrivals = Arrivals(queue, ledger, host, backlog)
        self.awaited = self.arrivals.slots  # pool slots awaiting a state in place (the queue's second gate)

    def in_flight(self) -> bool:
        """Under the lock: whether a send awaits its ack or a landing writes its rows (a closed queue keeps the
        pools claimed until neither does)."""
        return any(x.phase is SENDING for x in self.exports.values()) or self.arrivals.writing()

    # -- checks other calls make (under the lock) --------------------------------
    def check_slot(self, what: str, slot: int, use: SlotUse) -> None:
        """:class:`SlotStateError` when the hand-off forbids ``use`` of pool slot ``slot``: any use while it awaits
        a state in place; a write while it is exported in place (the peer gets it as it is at the send); a
        hand-over (or another export) while it is exported at all."""
        self.arrivals.check_slot(what, slot)
        x = self.exports.get(slot)
        if x is None or use == "read":
            return
        ev = x.event
        if use == "hand_over":
            raise SlotStateError(
                f"{what}: slot {slot} is exporting for {ev.request_id!r} until the peer acknowledges"
                " (the transfer's send() then releases it; release() withdraws the export)"
            )
        if ev.host is None:
            raise SlotStateError(
                f"{what}: slot {slot} is exported in place for {ev.request_id!r}: the send reads it as it"
                " is, so nothing may write it until the peer acknowledges (release() withdraws the export)"
            )

    def check_host(self, what: str, host: int) -> None:
        """:class:`SlotStateError` when host slot ``host`` belongs to a transfer (an export's staging slot, or a
        state arrived for an import): only the hand-off's own calls change it."""
        if host in self.hosts:
            role, how = "exporting", "the transfer's send() or release()"
        elif (a := self.arrivals.hosts.get(host)) is not None:
            role = a.phase.value
            how = "its receive()" if role == "landing" else "import_into() or discard_arrived()"
        else:
            return
        raise SlotStateError(f"{what}: host slot {host} is a transfer's staging slot ({role}); {how} ends it")

    def withdraw_locked(self, events: Sequence[Event]) -> list[Export | int]:
        """What the releases among ``events`` withdraw (exports, and slots awaiting a state in place); raises,
        changing nothing, if one is sending or being landed, or if an event writes a slot exported in place or
        touches one awaiting a state."""
        out: list[Export | int] = []
        exports, arrivals = self.exports, self.arrivals
        for ev in events:
            if type(ev) is Release:
                x = exports.get(ev.slot)
                if x is None:
                    if arrivals.withdraw_check_locked(ev.slot):
                        out.append(ev.slot)
                elif x.phase is SENDING:
                    raise SlotStateError(
                        f"Release: slot {ev.slot} is being sent to the peer; release it after send() returns"
                        " (it releases the slot itself once the peer acknowledges)"
                    )
                else:
                    out.append(x.event)
            elif type(ev) is Clear or type(ev) is CommitDraft:
                self.check_slot(type(ev).__name__, ev.slot, "write")
            elif type(ev) is CopyOnWrite:
                self.check_slot("CopyOnWrite", ev.dst, "write")
                self.check_slot("CopyOnWrite", ev.src, "read")
                if ev.temporal_src is not None:
                    self.check_slot("CopyOnWrite", ev.temporal_src, "read")
        return out

    # -- the sender ----------------------------------------------------------------
    def export(self, slot: int, tenant: str, to: int | None, in_place: bool = False) -> int | None:
        """Queue an export of ``slot`` (held by ``tenant``) into a fresh staging host slot held by ``tenant``;
        ``in_place``: no staging slot (returns None), ``slot`` itself is sent and written by nothing until then."""
        host, q = self._host, self._queue
        with q.lock:
            q.check()
            self._ledger.check_held("Export", slot, tenant)
            self.check_slot("export", slot, "hand_over")
            if tenant in self.ids:
                self._check_one_per_batch(slot, tenant, to)
            h = None if in_place else host.take(1, tenant)[0]
            ev = Export(slot, h, tenant, to)
            # The events queued now are taken by the next take, which gets the backlog's next ticket: in place,
            # the export is ready once every event queued before it ran, though it queues none itself.
            x = self.exports[slot] = Exported(ev, self._backlog.taken)
            self.ids[tenant] = self.ids.get(tenant, 0) + 1
            if h is None:
                _tracer.tracer.events((ev,), q.step)
            else:
                self.hosts[h] = x
                q.enqueue((ev,))
        return h

    def _check_one_per_batch(self, slot: int, tenant: str, to: int | None) -> None:
        """:class:`SlotStateError` when an export of ``tenant`` in the book could go in one batch with an export of
        it to ``to`` (the same peer, or either to no one in particular)."""
        for x in self.exports.values():
            ev = x.event
            if ev.request_id == tenant and (to is None or ev.to is None or ev.to == to):
                raise SlotStateError(
                    f"export: slot {slot}: a state of {tenant!r} is exported already (slot {ev.slot}) until the peer"
                    " acknowledges it; the peer imports one state per request id (export the other to another peer)"
                )

    def ready(self, to: int | None, take: bool) -> list[Export]:
        """The exports whose staging copy ran, not acknowledged and not being sent, in export order; with ``to``
        only those addressed to ``to`` or to no one (``take``: now sending, refused on a closed manager)."""
        q = self._queue
        with q.lock:
            if take:
                q.check()
            done = self._backlog.done
            ready = [
                x
                for x in self.exports.values()
                if x.phase is WAITING
                and x.ticket < done
                and (to is None or x.event.to == to or (x.event.to is None and x.peer in (None, to)))
            ]
            if take:
                for x in ready:
                    x.phase = SENDING
        return [x.event for x in ready]

    def _mine(self, exports: Sequence[Export]) -> list[Exported]:
        """The records of those of ``exports`` still in the book (a repeated ack, or an export withdrawn since,
        is not)."""
        book = self.exports
        return [x for ev in exports if (x := book.get(ev.slot)) is not None and x.event is ev]

    def returned(self, exports: Sequence[Export], peer: int | None = None, batch: Hashable = None) -> None:
        """A send of ``exports`` failed: they wait for the next send, and a release may withdraw them again.

        ``peer``: the send to ``peer`` failed after it may have landed them (in
        doubt): those addressed to no one are taken for ``peer`` only from now
        on, so a transfer to another peer never delivers a state ``peer`` may hold.
        ``batch``: the batch they may have landed under there (:meth:`in_doubt`
        names it to every later sender); None with ``peer``: under none (a retry
        the peer refused: it never landed that batch). Without ``peer`` (sent
        nowhere, or refused on a first try) the record of each stays as it is.

        On a closed manager no send can follow: their slots and staging slots
        are freed at once (:meth:`_end_on_closed`), nothing is kept for the next
        manager on the pool.
        """
        q = self._queue
        with q.lock:
            mine = self._mine(exports)
            if q.closed():
                self._end_on_closed(mine, withdrawn=True)
                return
            for x in mine:
                x.phase = WAITING
                if peer is not None:
                    if x.event.to is None:
                        x.peer = peer
                    x.batch = batch

    def in_doubt(self, exports: Sequence[Export]) -> list[Hashable]:
        """Per export, the batch under which its send may have landed at its peer (:meth:`returned`'s ``batch``),
        None where there is none (not in doubt, or no longer in the book)."""
        with self._queue.lock:
            book = self.exports
            return [x.batch if (x := book.get(ev.slot)) is not None and x.event is ev else None for ev in exports]

    def delivered(self, exports: Sequence[Export]) -> None:
        """The peer acknowledged ``exports``: queue the release of each pool slot and the drop of each staging slot.

        One hold of the lock, so all of them or none. A closing manager still
        takes them (its last flush, or the backlog, runs them); a closed one
        frees the slots at once (:meth:`_end_on_closed`). Their tenants cannot
        have changed: a hand-over of an exporting slot is refused, and a release
        is refused while it is sending.
        """
        q = self._queue
        with q.lock:
            mine = self._mine(exports)
            if q.closed():
                self._end_on_closed(mine, withdrawn=False)
                return
            q.check(ending_send=True)
            releases = [Release(x.event.slot, x.event.request_id) for x in mine]
            self._ledger.apply_batch(releases, 0)
            q.enqueue(releases)
            self.drop_locked([x.event for x in mine], withdrawn=False)

    def drop_locked(self, exports: Sequence[Export | int], withdrawn: bool = True) -> None:
        """``exports`` leave the book and their staging host slots are dropped from here on (``withdrawn``: by a
        release, so traced as ``transfer.withdraw``; else delivered); a pool slot among them (a release of a
        slot awaiting a state in place) ends that arrival."""
        host = self._host
        gone = []
        for ev in exports:
            if type(ev) is int:
                self.arrivals.withdraw_locked(ev)
                continue
            assert type(ev) is Export
            x = self.exports.get(ev.slot)
            if x is not None and x.event is ev:
                self._forget_locked(x)
                gone.append(ev)
        drops = [DropHost(ev.host) for ev in gone if ev.host is not None]
        for d in drops:
            host.free_later(d.host)
        self._queue.enqueue(drops)
        if withdrawn and gone:
            ids = [ev.request_id or "" for ev in gone]
            _tracer.tracer.transfer(
                "transfer.withdraw", None, ids, slots=[ev.slot for ev in gone], step=self._queue.step
            )

    def _forget_locked(self, x: Exported) -> None:
        """``x`` leaves the book (``exports`` and its indices); the caller frees or drops its slots."""
        ev = x.event
        del self.exports[ev.slot]
        if ev.host is not None:
            del self.hosts[ev.host]
        rid = ev.request_id or ""
        left = self.ids[rid] - 1
        if left:
            self.ids[rid] = left
        else:
            del self.ids[rid]

    def _end_on_closed(self, exports: list[Exported], withdrawn: bool) -> None:
        """Under the lock, on a closed manager: a send taken before the close ended (``withdrawn``: it failed).

        The manager closed while the send awaited its ack, and no flush will
        run again; a release and a host drop need no device work (the staging
        copy ran before the send took it, and nothing else reads the staging
        slot), so the ledgers are changed directly. The closed manager kept the
        ledgers claimed while the send was in flight (:meth:`QueueSide.end_release`
        frees them with the last one), so no other manager changes them meanwhile.
        """
        for x in exports:
            self._forget_locked(x)
        evs = [x.event for x in exports]
        staged = [ev.host for ev in evs if ev.host is not None]
        self._ledger.give_back([ev.slot for ev in evs])
        self._host.give_back(staged)
        done: list[Event] = [Release(ev.slot, ev.request_id) for ev in evs]
        q = self._queue
        _tracer.tracer.events([*done, *(DropHost(h) for h in staged)], q.step)
        if withdrawn and evs:
            ids = [ev.request_id or "" for ev in evs]
            _tracer.tracer.transfer("transfer.withdraw", None, ids, slots=[ev.slot for ev in evs], step=q.step)
        q.end_release()
