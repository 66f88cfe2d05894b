"""The hand-off's bookkeeping under the step queue: exports awaiting a peer's ack, states awaiting an import.

:class:`HandOffBook` holds the state; the functions below change it together
with the ledgers and the event queue, in one hold of the queue's lock each, so
the three never disagree (the queue's own invariant). No torch.

An export's life on the sender::

    export() ──> queued ──flush──> ready ──take──> sending ──ack──> delivered: slot released, staging dropped
                   │                 │  <──returned──┘ (send failed: retry or release)
                   └── release() ────┴──> withdrawn: staging dropped, nothing sent

A release is refused only while the export is *sending*, since the peer may
then hold the state or not; before and after a send it withdraws the export.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import _tracing
from ._errors import PoolExhaustedError, SlotStateError
from ._events import Alloc, DropHost, Event, Export, Import, Release

if TYPE_CHECKING:
    from ._queue import StepQueue

__all__ = [
    "HandOffBook",
    "deliver_exports",
    "discard_arrived",
    "drop_exports",
    "export_slot",
    "exports_ready",
    "import_slot",
    "land",
    "return_exports",
]


class HandOffBook:
    """Exports not yet acknowledged and states arrived but not yet imported; changed only under the queue's lock.

    Invariants: a pool slot has at most one export in ``exports`` (in export
    order, with the step whose flush stages it), and while it is there its
    tenant does not change; ``sending`` is a subset of ``exports``' slots; a
    request id has at most one state in ``arrived``.
    """

    __slots__ = ("arrived", "exports", "sending")

    def __init__(self) -> None:
        self.exports: dict[int, tuple[int, Export]] = {}  # pool slot -> (step, export)
        self.sending: set[int] = set()  # pool slots whose export a send has taken and not settled
        self.arrived: dict[str, int] = {}  # request id -> staging host slot

    def check_not_exporting(self, what: str, slot: int) -> None:
        """:class:`SlotStateError` when ``slot`` has an export awaiting its ack."""
        if slot in self.exports:
            ev = self.exports[slot][1]
            raise SlotStateError(
                f"{what}: slot {slot} is exporting for {ev.request_id!r} until the peer acknowledges"
                " (the transfer's send() then releases it; release() withdraws the export)"
            )

    def released_exports(self, events: Sequence[Event]) -> list[Export]:
        """The exports that the releases among ``events`` withdraw; raises, changing nothing, if one is sending."""
        out = []
        for ev in events:
            if type(ev) is Release and ev.slot in self.exports:
                if ev.slot in self.sending:
                    raise SlotStateError(
                        f"Release: slot {ev.slot} is being sent to the peer; release it after send() returns"
                        " (it releases the slot itself once the peer acknowledges)"
                    )
                out.append(self.exports[ev.slot][1])
        return out

    def forget(self, exports: Sequence[Export]) -> list[Export]:
        """``exports`` that are still in the book, removed from it."""
        gone = []
        for ev in exports:
            entry = self.exports.get(ev.slot)
            if entry is not None and entry[1] is ev:
                del self.exports[ev.slot]
                self.sending.discard(ev.slot)
                gone.append(ev)
        return gone


def export_slot(queue: StepQueue, slot: int, tenant: str) -> int:
    """Queue an export of ``slot`` (held by ``tenant``) into a fresh staging host slot held by ``tenant``."""
    host = queue.host_ledger
    assert host is not None
    with queue.lock:
        queue.check()
        queue.ledger.check_held("Export", slot, tenant)
        queue.handoff.check_not_exporting("export", slot)
        h = host.take(1, tenant)[0]
        ev = Export(slot, h, tenant)
        queue.events.append(ev)
        queue.handoff.exports[slot] = (queue.step, ev)
        _tracing.tracer.events((ev,), queue.step)
    return h


def import_slot(queue: StepQueue, slot: int, tenant: str) -> None:
    """Hold free ``slot`` for ``tenant`` without a clear, reading the state that arrived for ``tenant``.

    :class:`SlotStateError` (nothing changed) when no state arrived for it, or ``slot`` is held.
    """
    host = queue.host_ledger
    assert host is not None
    with queue.lock:
        queue.check()
        h = queue.handoff.arrived.get(tenant)
        if h is None:
            raise SlotStateError(f"import_into: no state has arrived for {tenant!r} (receive it first)")
        ledger = queue.ledger
        if ledger.held[slot]:
            raise SlotStateError(f"import_into: slot {slot} is held by {ledger.tenants[slot]!r}")
        ledger.check_available(1, tenant)
        ledger.take_exact([slot], tenant)
        del queue.handoff.arrived[tenant]
        events: list[Event] = [Alloc(slot, tenant, False), Import(h, slot, tenant)]
        queue.events.extend(events)
        host.free_later(h)
        _tracing.tracer.events(events, queue.step)


def discard_arrived(queue: StepQueue, tenant: str) -> int:
    """Drop the staging host slot of the state that arrived for ``tenant``; returns it. :class:`SlotStateError`
    (nothing changed) when none is waiting for an import."""
    host = queue.host_ledger
    assert host is not None
    with queue.lock:
        queue.check()
        h = queue.handoff.arrived.pop(tenant, None)
        if h is None:
            raise SlotStateError(f"discard_arrived: no state for {tenant!r} awaits an import")
        ev = DropHost(h)
        queue.events.append(ev)
        host.free_later(h)
        _tracing.tracer.events((ev,), queue.step)
        _tracing.tracer.transfer("transfer.discard", None, [tenant], step=queue.step)
    return h


def exports_ready(queue: StepQueue, take: bool) -> list[Export]:
    """The exports whose flush has run, not acknowledged and not being sent, in export order (``take``: now sending)."""
    with queue.lock:
        book = queue.handoff
        ready = [ev for step, ev in book.exports.values() if step < queue.step and ev.slot not in book.sending]
        if take:
            book.sending.update(ev.slot for ev in ready)
    return ready


def return_exports(queue: StepQueue, exports: Sequence[Export]) -> None:
    """A send of ``exports`` failed: they wait for the next send, and a release may withdraw them again."""
    with queue.lock:
        for ev in exports:
            queue.handoff.sending.discard(ev.slot)


def deliver_exports(queue: StepQueue, exports: Sequence[Export]) -> None:
    """The peer acknowledged ``exports``: queue the release of each pool slot and the drop of each staging slot.

    One hold of the lock, so all of them or (on a closed manager) none. Their
    tenants cannot have changed: a hand-over of an exporting slot is refused,
    and a release is refused while it is sending.
    """
    with queue.lock:
        queue.check()
        book = queue.handoff
        mine = [ev for ev in exports if book.exports.get(ev.slot, (0, None))[1] is ev]
        releases = [Release(ev.slot, ev.request_id) for ev in mine]
        queue.ledger.apply_batch(releases, 0)
        queue.events.extend(releases)
        _tracing.tracer.events(releases, queue.step)
        drop_exports(queue, mine, withdrawn=False)


def drop_exports(queue: StepQueue, exports: Sequence[Export], withdrawn: bool = True) -> None:
    """Under the lock: ``exports`` leave the book and their staging host slots are dropped from here on
    (``withdrawn``: by a release, so traced as ``transfer.withdraw``; else delivered)."""
    host = queue.host_ledger
    assert host is not None
    gone = queue.handoff.forget(exports)
    drops = [DropHost(ev.host) for ev in gone]
    for ev in drops:
        host.free_later(ev.host)
    queue.events.extend(drops)
    _tracing.tracer.events(drops, queue.step)
    if withdrawn and gone:
        ids = [ev.request_id or "" for ev in gone]
        _tracing.tracer.transfer("transfer.withdraw", None, ids, slots=[ev.slot for ev in gone], step=queue.step)


def land(queue: StepQueue, request_ids: list[str]) -> list[int]:
    """Staging host slots for states arriving for ``request_ids``, each held by its id; all or none."""
    host = queue.host_ledger
    assert host is not None
    with queue.lock:
        queue.check()
        arrived = queue.handoff.arrived
        clash = [r for r in request_ids if r in arrived]
        if clash or len(set(request_ids)) != len(request_ids):
            raise SlotStateError(f"states for {clash or request_ids} arrived twice without an import between")
        if len(request_ids) > host.num_free_now:
            # The rows are written at once, not in the step's order: a slot freed by an event queued in this
            # step (a restore, an import) is still to be read by it, so only slots free now will do.
            later = host.num_free - host.num_free_now
            more = f" (and {later} once the next flush has read them)" if later else ""
            raise PoolExhaustedError(f"{len(request_ids)} states arrived, {host.num_free_now} host slots free{more}")
        slots = [host.take(1, r)[0] for r in request_ids]
        arrived.update(zip(request_ids, slots, strict=True))
    return slots
