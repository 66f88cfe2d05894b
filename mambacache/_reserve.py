"""CacheManager's reservation surface: slots kept for one tenant (a PrefixCache's checkpoints), and what a request
may take now.

A piece of its own so the manager's class stays small; the mechanism is
:class:`~mambacache._ledger.SlotLedger`'s (``reserve``, ``available``), driven
under the manager's lock by :class:`~mambacache._queue.StepQueue`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._errors import InvalidArgumentError

if TYPE_CHECKING:
    from ._pool import StatePool
    from ._queue import StepQueue

__all__ = ["Reservations"]


class Reservations:
    """The reservation methods of :class:`~mambacache.CacheManager` (a mixin over its pool and queue).

    Invariant: while a reservation of ``k`` slots for a tenant stands, at least
    ``k`` minus what that tenant holds are free (a hand-over away from the
    tenant aside): other tenants' allocations stop short of them.
    """

    _pool: StatePool
    _queue: StepQueue

    @property
    def available(self) -> int:
        """Slots a request can allocate now: ``pool.num_free`` less the reserved slots its tenant does not hold
        yet (``pool.num_available``; for a scheduler's admission check)."""
        return self._pool.num_available

    @property
    def reserved(self) -> int:
        """Slots kept for one tenant by :meth:`reserve` (a ``PrefixCache(..., reserved=k)``'s checkpoints); 0: none."""
        return self._pool.ledger.reserved

    def reserve(self, n: int, tenant: str) -> None:
        """Keep ``n`` slots for ``tenant``: every other tenant's allocation leaves ``n`` minus what ``tenant`` holds
        free, and raises :class:`PoolExhaustedError` (nothing allocated) beyond that.

        ``tenant``'s own allocations take any free slot. One reservation per
        manager: another tenant's raises :class:`InvalidArgumentError`, the same
        tenant's resizes it (0 ends it); it ends when the manager closes. Raises
        :class:`PoolExhaustedError` when fewer than ``n`` minus what ``tenant``
        holds are free now, and :class:`ManagerClosedError` unless the manager
        is open. All or nothing.
        """
        if type(n) is not int or not 0 <= n < self._pool.num_slots:
            raise InvalidArgumentError(f"reserve takes an int in 0..{self._pool.num_slots - 1} slots, got {n!r}")
        if type(tenant) is not str:
            raise InvalidArgumentError(f"reserve: tenant must be a str, got {type(tenant).__name__}")
        self._queue.reserve(n, tenant)  # checks, under the lock, that the manager is open
