"""CacheManager's host-tier surface: states copied to host slots and back (swap, checkpoints on the host).

A piece of its own so the manager's class stays small; the events are queued by
:class:`~mambacache._queue.StepQueue` and planned like every other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._args import host_slot, many, need_host, paired, slot_of
from ._errors import InvalidSlotError
from ._queue import drop_host, offload_batch, restore_batch
from ._validate import slot_list

if TYPE_CHECKING:
    from ._host import HostPool
    from ._pool import StatePool
    from ._queue import StepQueue

__all__ = ["HostTier"]


class HostTier:
    """The host-tier methods of :class:`~mambacache.CacheManager` (a mixin over its pools and queue).

    Invariant: a host slot is held from the offload that fills it to the drop or
    freeing restore that ends it; reads queued before its end see its state.
    """

    _pool: StatePool
    _host: HostPool | None
    _queue: StepQueue

    @property
    def host_pool(self) -> HostPool | None:
        """The host pool (None without one)."""
        return self._host

    if TYPE_CHECKING:

        @property
        def pool(self) -> StatePool: ...

        def check_open(self) -> None: ...

    def offload(self, slot: int, request_id: str | None = None) -> int:
        """Copy ``slot``'s state as of this point of the event order to a free host slot; returns the host slot.

        Later events on ``slot`` (a release and a new tenant, a clear) do not reach the copy, so ``offload`` then
        ``release`` is preemption by swap. The copy runs on the next flush's stream, before anything in that step
        writes the slot. Raises :class:`PoolExhaustedError` when the host pool is full.
        """
        need_host(self, "offload")
        return offload_batch(self._queue, [slot_of(self._pool, slot, request_id)], request_id)[0]

    def offload_many(self, slots: Any, request_id: str | None = None) -> list[int]:
        """``[offload(s) for s in slots]``, all or none (too few free host slots: nothing taken); the host slots."""
        return offload_batch(self._queue, many(self, slots, request_id, "offload_many"), request_id)

    def restore(self, host: int, slot: int, request_id: str | None = None, *, keep: bool = False) -> None:
        """``slot`` gets host slot ``host``'s state as of this point of the event order.

        ``host`` is freed after the read unless ``keep`` (a checkpoint restored many times). A host slot freed in a
        step is handed out again in that step only when no other is free, and the planner orders this read before
        the offload that rewrites it, so the read always sees the offloaded state.
        """
        h = host_slot(need_host(self, "restore"), host)
        restore_batch(self._queue, [h], [slot_of(self._pool, slot, request_id)], request_id, keep)

    def restore_many(self, hosts: Any, slots: Any, request_id: str | None = None, *, keep: bool = False) -> None:
        """``restore(hosts[i], slots[i], keep=keep)`` for each ``i``, in order, all or none."""
        restore_batch(self._queue, *_restores(self, hosts, slots, request_id), request_id, keep)

    def drop(self, host: int) -> None:
        """Free host slot ``host`` from this point; earlier restores still read it."""
        drop_host(self._queue, host_slot(need_host(self, "drop"), host))


def _restores(mgr: HostTier, hosts: Any, slots: Any, request_id: Any) -> tuple[list[int], list[int]]:
    """``restore_many``'s host slots and slots, in range and as many."""
    hp = need_host(mgr, "restore_many")
    try:
        hs = slot_list(hosts, hp.num_slots)
    except InvalidSlotError as exc:
        raise InvalidSlotError(f"host {exc}") from None
    return hs, paired("restore_many", hs, many(mgr, slots, request_id))
