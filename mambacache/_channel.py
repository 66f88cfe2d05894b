"""Channels: how each step's plan gets from the source rank to every other rank.

In tensor-parallel mode one scheduler (the source rank) submits events and
plans; every rank applies the same plan to its own shard. A :class:`Channel` is
the only thing the manager needs for that: ``send`` on the source, ``receive``
elsewhere. :class:`DistributedChannel` (``mambacache._distributed``) carries
plans over ``torch.distributed``; :class:`LoopbackChannel` carries them between
managers of one process (tests, single-process multi-pool setups), through the
same wire format.
"""

from __future__ import annotations

import abc
import queue

from ._errors import DistributedError
from ._planner import Plan, decode_plan, encode_plan

__all__ = ["Channel", "LoopbackChannel"]


class Channel(abc.ABC):
    """Carries plans from the source rank to the others, one per step, in order.

    Invariants an implementation keeps: every rank receives the plans the source
    sent, in order, each exactly once; a send or receive returns or raises
    :class:`DistributedError` within a bounded time (no hang on a dead peer);
    after a failure the channel refuses further use on that rank, since the
    ranks may no longer agree on the step.
    """

    is_source: bool
    """True on the rank that submits events and plans; the others only flush."""

    @abc.abstractmethod
    def send(self, step: int, plan: Plan) -> None:
        """On the source rank: deliver ``plan`` of ``step`` to every other rank (blocking, bounded)."""

    @abc.abstractmethod
    def receive(self) -> tuple[int, Plan]:
        """On any other rank: the next ``(step, plan)`` the source sent (blocking, bounded)."""

    def check_source(self, what: str) -> None:
        """Raise :class:`DistributedError` unless this is the source rank: only it submits events."""
        if not self.is_source:
            raise DistributedError(
                f"{what} on a receiving rank: in tensor-parallel mode only the source rank submits events;"
                " the other ranks only flush"
            )


class LoopbackChannel(Channel):
    """One end of an in-process channel; make all ends at once with :meth:`group`.

    Plans cross as the same int lists ``DistributedChannel`` broadcasts (the
    planner's wire format), so a loopback run checks the encoding too.
    """

    def __init__(self, inbox: queue.Queue[list[int]] | None, outboxes: list[queue.Queue[list[int]]], timeout: float):
        self.is_source = inbox is None
        self._inbox = inbox
        self._outboxes = outboxes
        self._timeout = timeout
        self._broken: str | None = None

    @classmethod
    def group(cls, size: int, timeout: float = 30.0) -> list[LoopbackChannel]:
        """``size`` connected ends: the first is the source rank's, the others receive."""
        if type(size) is not int or size < 1:
            raise DistributedError(f"a loopback group needs a positive int size, got {size!r}")
        inboxes: list[queue.Queue[list[int]]] = [queue.Queue() for _ in range(size - 1)]
        return [cls(None, inboxes, timeout)] + [cls(box, [], timeout) for box in inboxes]

    def _check(self) -> None:
        if self._broken is not None:
            raise DistributedError(f"the plan channel failed earlier: {self._broken}")

    def send(self, step: int, plan: Plan) -> None:
        """Queue the encoded plan for every receiving end; never blocks."""
        self._check()
        message = encode_plan(plan, step)
        for box in self._outboxes:
            box.put(list(message))

    def receive(self) -> tuple[int, Plan]:
        """The next plan the source sent; :class:`DistributedError` after ``timeout`` seconds without one."""
        self._check()
        if self._inbox is None:
            raise DistributedError("receive() on the source end of a loopback channel")
        try:
            message = self._inbox.get(timeout=self._timeout)
        except queue.Empty:
            self._broken = f"no plan within {self._timeout:g}s"
            raise DistributedError(f"no plan from the source within {self._timeout:g}s (it stopped flushing)") from None
        return decode_plan(message)
