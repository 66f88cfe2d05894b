"""CacheManager's hand-off surface: a slot's state leaving for another engine, or arriving from one (issue #20).

A piece of its own so the manager's class stays small. The events are planned as
the host tier's offload and freeing restore (``docs/transfer.md``); a
:class:`~mambacache._transfer.StateTransfer` moves the staged bytes between
engines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._errors import InvalidArgumentError
from ._events import Export
from ._exports import deliver_exports, discard_arrived, export_slot, exports_ready, import_slot, land, return_exports
from ._validate import as_slot, check_request_id

if TYPE_CHECKING:
    from ._host import HostPool
    from ._pool import StatePool
    from ._queue import StepQueue

__all__ = ["HandOff"]


class HandOff:
    """The export and import methods of :class:`~mambacache.CacheManager` (a mixin over its pools and queue).

    Invariant: an export's staging host slot and the exported pool slot stay
    held by the request until the peer acknowledges; an import reads exactly the
    state that arrived for its request, once.
    """

    _pool: StatePool
    _host: HostPool | None
    _queue: StepQueue

    def export(self, slot: int, request_id: str) -> int:
        """``slot``'s state as of this point of the event order goes to the peer (on the transfer's next send).

        Later events on ``slot`` do not reach what is sent. ``slot`` stays held by
        ``request_id`` until the peer acknowledges; the transfer then releases it.
        Releasing it first withdraws the export (refused while a send of it awaits
        the ack); handing it over or exporting it again is refused. Returns the
        staging host slot. Needs a host pool (the staging area).
        """
        check_request_id(request_id)
        if type(request_id) is not str:
            raise InvalidArgumentError("export needs the request's id: the peer imports by it")
        if self._host is None:
            raise InvalidArgumentError("export needs a host pool to stage in: CacheManager(pool, host_pool=...)")
        return export_slot(self._queue, as_slot(slot, self._pool.num_slots), request_id)

    def import_into(self, slot: int, request_id: str) -> None:
        """Allocate free ``slot`` to ``request_id`` without a clear; it reads the state received for it.

        A clear or release of ``slot`` queued before this never wipes the imported
        state, one queued after it does. The state must have arrived (the
        transfer's ``receive``); else :class:`SlotStateError`, nothing changed.
        """
        check_request_id(request_id)
        if type(request_id) is not str:
            raise InvalidArgumentError("import_into needs the request's id: the state arrived under it")
        if self._host is None:
            raise InvalidArgumentError("import_into needs a host pool to stage in: CacheManager(pool, host_pool=...)")
        import_slot(self._queue, as_slot(slot, self._pool.num_slots), request_id)

    def discard_arrived(self, request_id: str) -> int:
        """The state that arrived for ``request_id`` will not be imported (the request was aborted): its staging
        host slot is dropped from this point. Returns it; :class:`SlotStateError`, nothing changed, when no state
        for ``request_id`` awaits an import."""
        check_request_id(request_id)
        if self._host is None:
            raise InvalidArgumentError("discard_arrived needs a host pool: CacheManager(pool, host_pool=...)")
        return discard_arrived(self._queue, request_id)

    # -- the transfer's side (StateTransfer calls these; engines call the two above) --------
    def exports_ready(self) -> list[Export]:
        """The exports whose flush has run, not acknowledged and not being sent, in export order."""
        return exports_ready(self._queue, take=False)

    def take_exports(self) -> list[Export]:
        """:meth:`exports_ready`, now being sent: until :meth:`exports_delivered` or :meth:`exports_returned`,
        a release of their slots is refused (the peer may or may not hold their states)."""
        return exports_ready(self._queue, take=True)

    def exports_returned(self, exports: list[Export]) -> None:
        """The send of ``exports`` failed: they wait for the next send, and releasing a slot withdraws its export."""
        return_exports(self._queue, exports)

    def exports_delivered(self, exports: list[Export]) -> None:
        """The peer acknowledged ``exports``: release their pool slots and drop their staging slots (all or none)."""
        deliver_exports(self._queue, exports)

    def land(self, request_ids: list[str]) -> list[int]:
        """Staging host slots for states arriving for ``request_ids`` (each held by its id until imported).

        All or none: :class:`SlotStateError` when a state for one of them arrived
        already and is not imported yet, :class:`PoolExhaustedError` when the host
        pool lacks room.
        """
        return land(self._queue, request_ids)
