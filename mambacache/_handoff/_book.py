"""The hand-off's bookkeeping over the step queue: exports awaiting a peer's ack, states awaiting an import.

:class:`HandOffBook` holds that state and makes every transition of it itself,
together with the ledgers and the event queue, in one hold of the queue's lock
each, so the three never disagree (the queue's own invariant). The queue never
imports it: the book is the queue's :class:`~mambacache._queue.SubmitGuard`,
put on it by :class:`~mambacache.CacheManager` when a manager with a host
pool is made, and it sees the queue only through
:class:`QueueSide` (a weak proxy: no reference cycle). No torch.

An export's life on the sender::

    export() ──> queued ──its stage ran──> ready ──take──> sending ──ack──> delivered: slot released, staging dropped
                   │                         │  <──returned──┘ (send failed: retry or release)
                   └──── release() ──────────┴──> withdrawn: staging dropped, nothing sent

*Ready* is keyed on work done (:attr:`Backlog.done <mambacache._backlog.Backlog>`): an
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

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from .. import _tracing
from .._errors import SlotStateError
from .._events import Clear, CommitDraft, CopyOnWrite, DropHost, Event, Export, Release
from ._arrivals import Arrivals, QueueSide

if TYPE_CHECKING:
    from .._backlog import Backlog
    from .._ledger import SlotLedger

__all__ = ["HandOffBook", "QueueSide"]


class HandOffBook:
    """Exports not yet acknowledged, and (in :attr:`arrivals`) states arrived but not yet imported; changed only
    under the queue's lock. The queue's guard for both.

    Invariants: a pool slot has at most one export in ``exports`` (in export
    order, with the backlog ticket of the flush that stages it), and while it
    is there its tenant does not change; ``sending`` and ``pinned`` are subsets of
    ``exports``' slots, and an export in ``pinned`` is taken for that peer
    only (its batch to that peer is in doubt: it may have landed there);
    ``doubt`` (a subset of ``exports``' slots, addressed or not) names the batch
    under which an export's send to its peer may have landed, for every sender
    of the manager to that peer (another transfer object, or one built after
    the failure) to send it again under that batch, which the peer recognises
    and acknowledges without landing it twice;
    ``ids`` counts the exports of each request id in ``exports``, and no two
    of them may go in one batch (a peer imports one state per id: both would
    be refused, every batch with them, for good), so they go to two peers;
    ``hosts`` holds exactly the staging host slots of ``exports`` (those not in
    place), which no call but the hand-off's own changes (drop, restore of one
    are refused), as the arrivals' own; a slot exported in place is written by
    no event while it is in ``exports``. Methods named ``*_locked`` run under
    the lock the caller holds; the others take it.
    """

    __slots__ = (
        "_backlog", "_host", "_ledger", "_queue", "arrivals", "awaited", "doubt", "exports", "hosts", "ids", "pinned",
        "sending",
    )  # fmt: skip

    def __init__(self, queue: QueueSide, ledger: SlotLedger, host: SlotLedger, backlog: Backlog) -> None:
        self._queue, self._ledger, self._host, self._backlog = queue, ledger, host, backlog
        self.exports: dict[int, tuple[int, Export]] = {}  # pool slot -> (ticket, export)
        self.sending: set[int] = set()  # pool slots whose export a send has taken and not settled
        self.pinned: dict[int, int] = {}  # pool slot -> the peer that may hold its unaddressed export (in doubt)
        self.doubt: dict[int, Hashable] = {}  # pool slot -> the batch its export may have landed under (in doubt)
        self.hosts: dict[int, str] = {}  # staging host slot of an export -> "exporting"
        self.ids: dict[str, int] = {}  # request id -> how many exports of it are in ``exports``
        self.arrivals = Arrivals(queue, ledger, host, backlog)
        self.awaited = self.arrivals.slots  # pool slots awaiting a state in place (the queue's second gate)

    def in_flight(self) -> bool:
        """Under the lock: whether a send awaits its ack or a landing writes its rows (a closed queue keeps the
        pools claimed until neither does)."""
        return bool(self.sending) or self.arrivals.writing > 0

    # -- checks other calls make (under the lock) --------------------------------
    def check_not_exporting(self, what: str, slot: int) -> None:
        """:class:`SlotStateError` when ``slot`` has an export awaiting its ack, or awaits a state in place."""
        self.arrivals.check_slot(what, slot)
        if slot in self.exports:
            ev = self.exports[slot][1]
            raise SlotStateError(
                f"{what}: slot {slot} is exporting for {ev.request_id!r} until the peer acknowledges"
                " (the transfer's send() then releases it; release() withdraws the export)"
            )

    def check_host(self, what: str, host: int) -> None:
        """:class:`SlotStateError` when host slot ``host`` belongs to a transfer (an export's staging slot, or a
        state arrived for an import): only the hand-off's own calls change it."""
        role = self.hosts.get(host) or self.arrivals.hosts.get(host)
        if role is not None:
            how = {"arrived": "import_into() or discard_arrived()", "landing": "its receive()"}.get(
                role, "the transfer's send() or release()"
            )
            raise SlotStateError(f"{what}: host slot {host} is a transfer's staging slot ({role}); {how} ends it")

    def check_read(self, what: str, slot: int) -> None:
        """:class:`SlotStateError` when ``slot`` awaits a state in place (it holds no state to read yet)."""
        self.arrivals.check_slot(what, slot)

    def check_write(self, what: str, slot: int) -> None:
        """:class:`SlotStateError` when ``slot`` is exported in place (the peer gets it as it is at the send), or
        awaits a state in place."""
        self.arrivals.check_slot(what, slot)
        entry = self.exports.get(slot)
        if entry is not None and entry[1].host is None:
            raise SlotStateError(
                f"{what}: slot {slot} is exported in place for {entry[1].request_id!r}: the send reads it as it"
                " is, so nothing may write it until the peer acknowledges (release() withdraws the export)"
            )

    def withdraw_locked(self, events: Sequence[Event]) -> list[Export | int]:
        """What the releases among ``events`` withdraw (exports, and slots awaiting a state in place); raises,
        changing nothing, if one is sending or being landed, or if an event writes a slot exported in place or
        touches one awaiting a state."""
        out: list[Export | int] = []
        exports, arrivals = self.exports, self.arrivals
        for ev in events:
            if type(ev) is Release:
                if ev.slot not in exports:
                    if arrivals.withdraw_check_locked(ev.slot):
                        out.append(ev.slot)
                    continue
                if ev.slot in self.sending:
                    raise SlotStateError(
                        f"Release: slot {ev.slot} is being sent to the peer; release it after send() returns"
                        " (it releases the slot itself once the peer acknowledges)"
                    )
                out.append(exports[ev.slot][1])
            elif type(ev) is Clear or type(ev) is CommitDraft:
                self.check_write(type(ev).__name__, ev.slot)
            elif type(ev) is CopyOnWrite:
                self.check_write("CopyOnWrite", ev.dst)
                arrivals.check_slot("CopyOnWrite", ev.src)
                if ev.temporal_src is not None:
                    arrivals.check_slot("CopyOnWrite", ev.temporal_src)
        return out

    # -- the sender ----------------------------------------------------------------
    def export(self, slot: int, tenant: str, to: int | None, in_place: bool = False) -> int | None:
        """Queue an export of ``slot`` (held by ``tenant``) into a fresh staging host slot held by ``tenant``;
        ``in_place``: no staging slot (returns None), ``slot`` itself is sent and written by nothing until then."""
        host, q = self._host, self._queue
        with q.lock:
            q.check()
            self._ledger.check_held("Export", slot, tenant)
            self.check_not_exporting("export", slot)
            if tenant in self.ids:
                self._check_one_per_batch(slot, tenant, to)
            h = None if in_place else host.take(1, tenant)[0]
            ev = Export(slot, h, tenant, to)
            # The events queued now are taken by the next take, which gets the backlog's next ticket: in place,
            # the export is ready once every event queued before it ran, though it queues none itself.
            self.exports[slot] = (self._backlog.taken, ev)
            self.ids[tenant] = self.ids.get(tenant, 0) + 1
            if h is None:
                _tracing.tracer.events((ev,), q.step)
            else:
                self.hosts[h] = "exporting"
                q.enqueue((ev,))
        return h

    def _check_one_per_batch(self, slot: int, tenant: str, to: int | None) -> None:
        """:class:`SlotStateError` when an export of ``tenant`` in the book could go in one batch with an export of
        it to ``to`` (the same peer, or either to no one in particular)."""
        for ticket_ev in self.exports.values():
            ev = ticket_ev[1]
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
            sending = self.sending
            pinned = self.pinned
            ready = [
                ev
                for ticket, ev in self.exports.values()
                if ticket < done
                and ev.slot not in sending
                and (to is None or (ev.to is None and pinned.get(ev.slot, to) == to) or ev.to == to)
            ]
            if take:
                sending.update(ev.slot for ev in ready)
        return ready

    def _mine(self, exports: Sequence[Export]) -> list[Export]:
        """Those of ``exports`` still in the book (a repeated ack, or an export withdrawn since, is not)."""
        return [ev for ev in exports if self.exports.get(ev.slot, (0, None))[1] is ev]

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
        are freed at once (:meth:`_settle_closed`), nothing is kept for the next
        manager on the pool.
        """
        q = self._queue
        with q.lock:
            mine = self._mine(exports)
            if q.closed():
                self._settle_closed(mine, withdrawn=True)
                return
            for ev in mine:
                self.sending.discard(ev.slot)
                if peer is not None and ev.to is None:
                    self.pinned[ev.slot] = peer
                if peer is not None and batch is not None:
                    self.doubt[ev.slot] = batch
                elif peer is not None:
                    self.doubt.pop(ev.slot, None)

    def in_doubt(self, exports: Sequence[Export]) -> list[Hashable]:
        """Per export, the batch under which its send may have landed at its peer (:meth:`returned`'s ``batch``),
        None where there is none (not in doubt, or no longer in the book)."""
        with self._queue.lock:
            mine = {id(ev) for ev in self._mine(exports)}
            return [self.doubt.get(ev.slot) if id(ev) in mine else None for ev in exports]

    def delivered(self, exports: Sequence[Export]) -> None:
        """The peer acknowledged ``exports``: queue the release of each pool slot and the drop of each staging slot.

        One hold of the lock, so all of them or none. A closing manager still
        takes them (its last flush, or the backlog, runs them); a closed one
        frees the slots at once (:meth:`_settle_closed`). Their tenants cannot
        have changed: a hand-over of an exporting slot is refused, and a release
        is refused while it is sending.
        """
        q = self._queue
        with q.lock:
            mine = self._mine(exports)
            if q.closed():
                self._settle_closed(mine, withdrawn=False)
                return
            q.check(settling=True)
            releases = [Release(ev.slot, ev.request_id) for ev in mine]
            self._ledger.apply_batch(releases, 0)
            q.enqueue(releases)
            self.drop_locked(mine, withdrawn=False)

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
            entry = self.exports.get(ev.slot)
            if entry is not None and entry[1] is ev:
                del self.exports[ev.slot]
                self._forget_id(ev)
                self.sending.discard(ev.slot)
                self.pinned.pop(ev.slot, None)
                self.doubt.pop(ev.slot, None)
                if ev.host is not None:
                    del self.hosts[ev.host]
                gone.append(ev)
        drops = [DropHost(ev.host) for ev in gone if ev.host is not None]
        for d in drops:
            host.free_later(d.host)
        self._queue.enqueue(drops)
        if withdrawn and gone:
            ids = [ev.request_id or "" for ev in gone]
            _tracing.tracer.transfer(
                "transfer.withdraw", None, ids, slots=[ev.slot for ev in gone], step=self._queue.step
            )

    def _forget_id(self, ev: Export) -> None:
        rid = ev.request_id or ""
        left = self.ids[rid] - 1
        if left:
            self.ids[rid] = left
        else:
            del self.ids[rid]

    def _settle_closed(self, exports: list[Export], withdrawn: bool) -> None:
        """Under the lock, on a closed manager: a send taken before the close settled (``withdrawn``: it failed).

        The manager closed while the send awaited its ack, and no flush will
        run again; a release and a host drop need no device work (the staging
        copy ran before the send took it, and nothing else reads the staging
        slot), so the ledgers are changed directly. The closed manager kept the
        ledgers claimed while the send was in flight (:meth:`QueueSide.settled`
        frees them with the last one), so no other manager changes them meanwhile.
        """
        host = self._host
        staged = [ev.host for ev in exports if ev.host is not None]
        for ev in exports:
            del self.exports[ev.slot]
            self._forget_id(ev)
            self.sending.discard(ev.slot)
            self.pinned.pop(ev.slot, None)
            self.doubt.pop(ev.slot, None)
        for h in staged:
            del self.hosts[h]
        self._ledger.give_back([ev.slot for ev in exports])
        host.give_back(staged)
        done: list[Event] = [Release(ev.slot, ev.request_id) for ev in exports]
        q = self._queue
        _tracing.tracer.events([*done, *(DropHost(h) for h in staged)], q.step)
        if withdrawn and exports:
            ids = [ev.request_id or "" for ev in exports]
            _tracing.tracer.transfer("transfer.withdraw", None, ids, slots=[ev.slot for ev in exports], step=q.step)
        q.settled()
