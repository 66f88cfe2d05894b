"""Lifecycle: where a manager is in its life, one phase, and the only place that says so.

::

    NEW ──enter──> OPEN ──the failure budget spent──> BROKEN
                     └───────┬──── leave the block ─────┘
                             v
                          CLOSING ──the last flush──> FINISHING ──what no flush took, in the backlog──> RELEASING
                                                                                                           │
                              CLOSED <──no send awaiting its ack, no landing writing (the ledgers freed)───┘

The step queue moves it under the manager's lock, in the same hold as the
event queue it guards; the step runner reports a spent failure budget to it
(:meth:`Lifecycle.broke`); every refusal (closed, closing, broken, not
entered) is its :meth:`Lifecycle.error`. The phase is also the ledgers'
claim: from the open until the release the pool's (and host pool's) ledger
keeps this object as its ``owner``, so no other manager drives them, and a
lifecycle refers to no manager, so a pool never keeps its manager alive.
No torch.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ._errors import MambaCacheError, ManagerBrokenError, ManagerClosedError

if TYPE_CHECKING:
    import threading

    from ._ledger import SlotLedger

__all__ = ["Lifecycle", "Phase"]


class Phase(enum.Enum):
    """A manager's phase (:class:`Lifecycle`)."""

    NEW = "new"  # made, not entered: takes nothing
    OPEN = "open"  # entered: takes events and flushes
    BROKEN = "broken"  # open, but the failure budget is spent: refuses work, still ends sends taken before
    CLOSING = "closing"  # leaving its block: takes no new events, still ends sends; the last flush runs
    FINISHING = "finishing"  # closed for good, no flush again: what no flush took goes into the pool's backlog
    RELEASING = "releasing"  # closed, its work in the backlog: the ledgers stay claimed until nothing is in flight
    CLOSED = "closed"  # closed, the ledgers free for the next manager


NEW, OPEN, BROKEN, CLOSING = Phase.NEW, Phase.OPEN, Phase.BROKEN, Phase.CLOSING
FINISHING, RELEASING, CLOSED = Phase.FINISHING, Phase.RELEASING, Phase.CLOSED
_SENDS_END = (OPEN, BROKEN, CLOSING)  # the phases in which a send taken earlier still ends (delivered or returned)
_CLOSED = (FINISHING, RELEASING, CLOSED)  # no flush runs again


class Lifecycle:
    """A manager's phase, and why it broke; changed only under ``lock`` (the manager's).

    Invariants: the phase only moves forward along the module's diagram;
    ``why`` is set once the failure budget is spent and never cleared, so a
    broken manager's last flush is refused too, after it left BROKEN for
    CLOSING; the ledgers given to :meth:`open` keep this object as their
    owner from the open until the phase reaches CLOSED, which happens only
    once no send or landing is in flight. Reading ``phase`` without the lock
    is a hint (a manager's ``check_open``); every decision that queues
    something reads it under the lock.
    """

    __slots__ = ("lock", "phase", "why")

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.phase = NEW
        self.why: str | None = None  # why the failure budget broke the manager (kept once set)

    # -- what the phase refuses ----------------------------------------------
    def error(self) -> MambaCacheError:
        """The refusal of work in this phase (:class:`ManagerBrokenError` or :class:`ManagerClosedError`)."""
        phase = self.phase
        if phase is BROKEN:
            return ManagerBrokenError(self.why)
        if phase is NEW:
            return ManagerClosedError("CacheManager is not entered (use `with` or `async with`)")
        return ManagerClosedError("CacheManager is closed" + (" (closing)" if phase is CLOSING else ""))

    def check(self, ending_send: bool = False) -> None:
        """Raise :meth:`error` unless open; ``ending_send``: the outcome of a send taken earlier, which a broken or
        closing manager still takes (the peer may hold those states: a refusal would report them lost)."""
        phase = self.phase
        if phase is not OPEN and not (ending_send and phase in _SENDS_END):
            raise self.error()

    def raise_if_broken(self) -> None:
        """Raise :class:`ManagerBrokenError` once the failure budget is spent, in any phase (a flush's check)."""
        if self.why is not None:
            raise ManagerBrokenError(self.why)

    @property
    def closed(self) -> bool:
        """Closed for good (not merely closing): no flush runs again."""
        return self.phase in _CLOSED

    # -- the transitions (each under the lock, but broke's, which takes it) ----------
    def open(self, ledgers: Sequence[SlotLedger]) -> None:
        """NEW -> OPEN: claim ``ledgers`` (all or none) for this manager."""
        if self.phase is not NEW:
            raise ManagerClosedError("a CacheManager can be entered once")
        claimed: list[SlotLedger] = []
        try:
            for ledger in ledgers:
                ledger.claim(self)
                claimed.append(ledger)
        except BaseException:
            for ledger in claimed:
                ledger.unclaim(self)
            raise
        self.phase = OPEN

    def broke(self, why: str) -> None:
        """The runner spent its failure budget: refuse work from now on (OPEN -> BROKEN; in a later phase the
        phase stays, ``why`` refuses the flushes). Takes the lock: the runner holds none."""
        with self.lock:
            self.why, self.phase = why, BROKEN if self.phase is OPEN else self.phase

    def begin_close(self) -> None:
        """OPEN or BROKEN -> CLOSING: no new events, a send taken earlier still ends."""
        if self.phase is OPEN or self.phase is BROKEN:
            self.phase = CLOSING

    def finish(self) -> None:
        """-> FINISHING: closed for good; the ledgers stay claimed while the leftover work is planned."""
        self.phase = FINISHING

    def release(self, ledgers: Sequence[SlotLedger], in_flight: Callable[[], bool]) -> None:
        """FINISHING -> RELEASING, the leftover work in the backlog; then :meth:`end_release`."""
        if self.phase is FINISHING:
            self.phase = RELEASING
        self.end_release(ledgers, in_flight)

    def end_release(self, ledgers: Sequence[SlotLedger], in_flight: Callable[[], bool]) -> None:
        """RELEASING -> CLOSED, freeing ``ledgers`` for the next manager, unless ``in_flight()`` (a send awaits its
        ack or a landing writes): then the last of those to end calls this again. In another phase: nothing."""
        if self.phase is RELEASING and not in_flight():
            for ledger in reversed(ledgers):
                ledger.unclaim(self)
            self.phase = CLOSED
