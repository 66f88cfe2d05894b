"""CacheManager's reservation surface: slots kept for a tenant (a PrefixCache's checkpoints; each cache its own),
and what a request may take now.

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
    tenant aside): other tenants' allocations stop short of them. Several
    tenants may each have one (two prefix caches on one manager); each counts
    only its own tenant's slots.
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
        """Slots reserved by :meth:`reserve` (``PrefixCache(..., reserved=k)``'s checkpoints), all tenants together;
        0: none."""
        return self._pool.ledger.reserved

    @property
    def reservations(self) -> dict[str, int]:
        """Each standing reservation: its tenant and the slots it keeps (a copy)."""
        return {str(t): r[0] for t, r in self._pool.ledger.reservations.items()}

    def reserve(self, n: int, tenant: str) -> None:
        """Keep ``n`` slots for ``tenant``: every other tenant's allocation leaves ``n`` minus what ``tenant`` holds
        free, and raises :class:`PoolExhaustedError` (nothing allocated) beyond that.

        ``tenant``'s own allocations take any free slot not kept for another
        reservation. One reservation per tenant, beside other tenants' ones: the
        same tenant's call resizes it (0 ends it); all end when the manager
        closes. Raises :class:`InvalidArgumentError` when the reservations
        together would keep every slot, :class:`PoolExhaustedError` when fewer
        than ``n`` minus what ``tenant`` holds are free now (beyond those kept
        for the others), and :class:`ManagerClosedError` unless the manager is
        open. All or nothing.
        """
        if type(n) is not int or not 0 <= n < self._pool.num_slots:
            raise InvalidArgumentError(f"reserve takes an int in 0..{self._pool.num_slots - 1} slots, got {n!r}")
        if type(tenant) is not str:
            raise InvalidArgumentError(f"reserve: tenant must be a str, got {type(tenant).__name__}")
        self._queue.reserve(n, tenant)  # checks, under the lock, that the manager is open
