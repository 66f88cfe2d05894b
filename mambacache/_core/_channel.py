"""Channels: how each step's plan gets from the source rank to every other rank.

In tensor-parallel mode one scheduler (the source rank) submits events and
plans; every rank applies the same plan to its own shard. A :class:`Channel` is
the only thing the manager needs for that: ``send`` on the source, ``receive``
elsewhere. :class:`DistributedChannel` (``mambacache._core._distributed``) carries
plans over ``torch.distributed``; :class:`LoopbackChannel` carries them between
managers of one process (tests, single-process multi-pool setups), through the
same wire format.

A flush can stop anywhere (an interrupt), so a channel also says what became of
a plan: on the source, :meth:`Channel.sent` tells whether a send that stopped
let the plan out (then the flush keeps the step, and the next flush finishes
the send), kept it in (the flush puts its events back), or cannot tell (the
ranks may disagree: the group must be rebuilt); on a receiver, a plan stays
the next one :meth:`Channel.receive` returns until :meth:`Channel.consumed`.
"""

from __future__ import annotations

import abc
import threading
import time

from ._errors import DistributedError, InvalidArgumentError
from ._planner import Plan, decode_plan, encode_plan

__all__ = ["Channel", "LoopbackChannel"]


class Channel(abc.ABC):
    """Carries plans from the source rank to the others, one per step, in order.

    Invariants an implementation keeps: every rank receives the plans the source
    sent, in order, each exactly once; a send or receive returns or raises
    :class:`DistributedError` within a bounded time (no hang on a dead peer);
    after a failure the channel refuses further use on that rank, since the
    ranks may no longer agree on the step.

    What an interrupted flush needs (the defaults are the safe answers of a
    channel that keeps no record): ``send(step, plan)`` again for the step
    whose plan left finishes that send and delivers nothing twice;
    :meth:`sent` says whether a plan left; :meth:`receive` returns the same
    plan again until :meth:`consumed` names its step. With the defaults, an
    interrupt between a source's send and its local push, or between a
    receiver's receive and its push, makes every later flush of that rank a
    :class:`DistributedError` (the group must be rebuilt) rather than a step
    the ranks disagree on.
    """

    is_source: bool
    """True on the rank that submits events and plans; the others only flush."""

    @abc.abstractmethod
    def send(self, step: int, plan: Plan) -> None:
        """On the source rank: deliver ``plan`` of ``step`` to every other rank (blocking, bounded)."""

    @abc.abstractmethod
    def receive(self) -> tuple[int, Plan]:
        """On any other rank: the next ``(step, plan)`` the source sent (blocking, bounded)."""

    def sent(self, step: int) -> bool | None:
        """On the source, after a send of ``step`` stopped (an interrupt) or was never made: True when the plan
        left (some rank may hold it: a repeat of the send finishes it), False when no rank has it nor will
        (the step may be planned again, with other events), None when this cannot be told (the default)."""
        return None

    def consumed(self, step: int) -> None:
        """On a receiver: the plan of ``step`` is this rank's now (pushed); the next :meth:`receive` returns
        the plan after it. The default does nothing (a channel whose receive hands each plan out once)."""
        return None

    def check_source(self, what: str) -> None:
        """Raise :class:`DistributedError` unless this is the source rank: only it submits events."""
        if not self.is_source:
            raise DistributedError(
                f"{what} on a receiving rank: in tensor-parallel mode only the source rank submits events;"
                " the other ranks only flush"
            )


class _Wire:
    """A loopback group's plans, shared by its ends: one list the source appends each message to (one C call,
    so a plan reaches every receiver at once or none), read by each receiver at its own position."""

    __slots__ = ("base", "cond", "log", "positions")

    TRIM = 64  # messages every receiver has consumed, dropped in one go

    def __init__(self, receivers: int) -> None:
        self.cond = threading.Condition()
        self.log: list[tuple[int, list[int]]] = []
        self.base = 0  # the position of log[0]
        self.positions = [0] * receivers

    def trim(self) -> None:
        """Under ``cond``: drop what every receiver consumed, never the last message (the source's record)."""
        n = min(min(self.positions, default=self.base + len(self.log)) - self.base, len(self.log) - 1)
        if n >= self.TRIM:
            del self.log[:n]
            self.base += n


class LoopbackChannel(Channel):
    """One end of an in-process channel; make all ends at once with :meth:`group`.

    Plans cross as the same int lists ``DistributedChannel`` broadcasts (the
    planner's wire format), so a loopback run checks the encoding too. A send
    reaches every receiving end at once or none (never some), so an interrupt
    anywhere in a flush leaves the ranks able to agree.
    """

    def __init__(self, wire: _Wire, index: int, timeout: float) -> None:
        """End ``index`` of ``wire`` (-1: the source's); :meth:`group` makes them."""
        self.is_source = index < 0
        self._wire = wire
        self._index = index
        self._timeout = timeout
        self._broken: str | None = None
        self._message: list[int] | None = None  # the source's last message: sent() finds it in the log

    @classmethod
    def group(cls, size: int, timeout: float = 30.0) -> list[LoopbackChannel]:
        """``size`` connected ends: the first is the source rank's, the others receive."""
        if type(size) is not int or size < 1:
            raise DistributedError(f"a loopback group needs a positive int size, got {size!r}")
        if type(timeout) not in (int, float) or not timeout > 0:
            raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}")
        wire = _Wire(size - 1)
        return [cls(wire, i, timeout) for i in range(-1, size - 1)]

    def _check(self) -> None:
        if self._broken is not None:
            raise DistributedError(f"the plan channel failed earlier: {self._broken}")

    def send(self, step: int, plan: Plan) -> None:
        """Queue the encoded plan for every receiving end; never blocks. A repeat of a sent step does nothing."""
        self._check()
        if not self.is_source:
            raise DistributedError("send() on a receiving end of a loopback channel")
        if self.sent(step):
            return
        message = self._message = encode_plan(plan, step)
        wire = self._wire
        with wire.cond:
            wire.log.append((step, message))  # every receiver has it from here
            wire.cond.notify_all()

    def sent(self, step: int) -> bool:
        """Whether this end's last message is in the log and is ``step``'s (exact: the append is one call)."""
        wire = self._wire
        with wire.cond:
            return bool(wire.log) and wire.log[-1][1] is self._message and wire.log[-1][0] == step

    def receive(self) -> tuple[int, Plan]:
        """The next plan the source sent (the same one until :meth:`consumed`); :class:`DistributedError` after
        ``timeout`` seconds without one."""
        self._check()
        if self.is_source:
            raise DistributedError("receive() on the source end of a loopback channel")
        wire, deadline = self._wire, time.monotonic() + self._timeout
        with wire.cond:
            # Waits in slices: a send stopped between its append and its notify wakes no one.
            while (at := wire.positions[self._index] - wire.base) >= len(wire.log):
                left = deadline - time.monotonic()
                if left <= 0:
                    self._broken = f"no plan within {self._timeout:g}s"
                    raise DistributedError(f"no plan from the source within {self._timeout:g}s (it stopped flushing)")
                wire.cond.wait(min(left, 0.05))
            message = wire.log[at][1]
        return decode_plan(message)

    def consumed(self, step: int) -> None:
        """The plan of ``step`` was pushed here: move past it (a repeat, or another step's, does nothing)."""
        wire = self._wire
        with wire.cond:
            at = wire.positions[self._index] - wire.base
            if at < len(wire.log) and wire.log[at][0] == step:
                wire.positions[self._index] += 1
                wire.trim()
