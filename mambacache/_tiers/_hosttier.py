"""HostTier: a manager's host tier, states copied to host slots and back (swap, checkpoints on the host).

The part of :class:`~mambacache.CacheManager` that queues offloads, restores and
drops: it checks each batch against the pool's and the host pool's ledgers and
the queue's guard, and queues its events, in one hold of the manager's lock,
so the ledgers stay the state at the end of the queue; the planner plans the
events like every other. Arguments are checked before (``_validate``). No torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._core._errors import SlotStateError
from .._core._events import DropHost, Offload, Restore

if TYPE_CHECKING:
    from .._core._ledger import SlotLedger
    from .._core._queue import StepQueue
    from ._hostpool import HostPool

__all__ = ["HostTier"]


class HostTier:
    """Offloads, restores and drops of a manager's host pool, queued on its step queue.

    Invariant: a host slot is held from the offload that fills it to the drop or
    freeing restore that ends it; reads queued before its end see its state.
    Each call is one batch, queued whole or not at all, under the queue's lock.
    """

    __slots__ = ("_ledger", "_queue", "pool")

    def __init__(self, queue: StepQueue, pool: HostPool) -> None:
        self._queue = queue
        self.pool = pool
        self._ledger: SlotLedger = pool.ledger  # the queue's host ledger too (it frees slots at each take)

    def offload(self, slots: list[int], tenant: str | None) -> list[int]:
        """An offload of each of ``slots`` (in range), in order, in one hold: all or none; returns the host slots.

        The error is the one the first failing single call would raise: a slot not held (or another
        tenant's) before the host pool runs out, else :class:`PoolExhaustedError`.
        """
        queue, host = self._queue, self._ledger
        with queue.lock:
            queue.check()
            held, tenants, guard = queue.ledger.held, queue.ledger.tenants, queue.guard
            for i, s in enumerate(slots):  # offloads change no pool slot's state: one ledger serves every check
                if not held[s] or (tenant is not None and tenants[s] != tenant):
                    if i > host.num_free:
                        break  # one call per slot would run out of host slots first: take raises that
                    queue.ledger.check_held("Offload", s, tenant)
                if guard.awaited:
                    try:
                        guard.check_slot("Offload", s, "read")
                    except SlotStateError:
                        if i > host.num_free:
                            break  # as above: the host pool runs out first
                        raise
            hosts = host.take(len(slots), tenant)  # the lowest first, as one take(1) per slot hands them out
            queue.enqueue([Offload(s, h, tenant) for s, h in zip(slots, hosts, strict=True)])
        return hosts

    def restore(self, hosts: list[int], slots: list[int], tenant: str | None, keep: bool) -> None:
        """A restore of ``hosts[i]`` into ``slots[i]`` (in range, as many) for each ``i``, in one hold: all or
        none. Without ``keep`` a host slot read earlier in the batch holds nothing for a later read."""
        queue, host = self._queue, self._ledger
        with queue.lock:
            queue.check()
            host_held, held, tenants = host.held, queue.ledger.held, queue.ledger.tenants
            read: dict[int, None] = {}  # ordered: freed in restore order, as one call each would
            for h, s in zip(hosts, slots, strict=True):
                if not host_held[h] or h in read:
                    raise _host_gone("Restore", h)
                queue.guard.check_host("Restore", h)
                if not held[s] or (tenant is not None and tenants[s] != tenant):
                    queue.ledger.check_held("Restore", s, tenant)
                queue.guard.check_slot("Restore", s, "write")
                if not keep:
                    read[h] = None
            queue.enqueue([Restore(h, s, tenant, keep) for h, s in zip(hosts, slots, strict=True)])
            for h in read:
                host.free_later(h)

    def drop(self, host: int) -> None:
        """Queue the end of host slot ``host`` (in range): free for the next step, earlier reads still see it."""
        queue, ledger = self._queue, self._ledger
        with queue.lock:
            queue.check()
            if not ledger.held[host]:
                raise _host_gone("DropHost", host)
            queue.guard.check_host("DropHost", host)
            queue.enqueue((DropHost(host),))
            ledger.free_later(host)


def _host_gone(kind: str, host: int) -> SlotStateError:
    return SlotStateError(f"{kind}: host slot {host} holds no state (dropped, restored, or never offloaded)")
