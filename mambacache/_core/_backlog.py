"""Backlog: device work taken from the event queue and not finished yet, and how far that work has run.

It belongs to the pool, not to the manager, so that it outlives the manager that
started it: a manager whose last flush failed leaves its work here, and the next
manager opened on the same pool runs it before anything newer.

It is also the one owner of *work done*: every flush (or close) that takes
events takes a **ticket** first, pushes the stages of those events under it,
and :attr:`Backlog.done` says which tickets have fully run. Readiness of an
export and the reuse of a host slot by a landing are keyed on it, never on
step numbers (a step number advances when a flush *takes* its events, long
before they ran, and a failed flush keeps them unrun until its repair).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

from .._executors import Executor
from ._planner import Stage

__all__ = ["Backlog"]


class Backlog:
    """Stages still to run, oldest first, each with the executor that runs it (and the host tensors of
    an offload or restore stage, so the work outlives the manager and its host pool argument) and the
    ticket of the flush that took it.

    Invariants: only the head stage can be partly done, and only up to tensor
    ``next_tensor`` (tensors before it are done); the head runs on the executor
    recorded with it, which may hold the saved reads of a half-done rotate
    (see ``Progress``), so it is never handed to another executor. Tickets are
    handed out in order (``taken``) and pushed in order; ``done`` is the first
    ticket some of whose work has not run (the head stage's, or, with nothing
    left, the one after the last pushed): every ticket below it ran to the end,
    and ``done`` never decreases. A ticket taken and not pushed yet (a flush
    planning or broadcasting) is not done.

    Interrupts: every change a flush depends on is one step that an exception
    raised between two lines cannot split: a ticket's stages join in one
    ``extend`` (:meth:`holds` says whether they did), and ``next_tensor`` counts
    for the entry in ``head`` only (:meth:`begin`), so a stage that left the
    backlog never passes its count to the next one.
    """

    __slots__ = ("done", "head", "last", "next_tensor", "stages", "taken")

    def __init__(self) -> None:
        self.stages: collections.deque[tuple[Stage, Executor, list[torch.Tensor] | None, int]] = collections.deque()
        self.next_tensor = 0
        self.head: object = None  # the entry next_tensor counts for
        self.taken = 0  # tickets handed out: the next take gets this one
        self.last = -1  # the newest ticket pushed
        self.done = 0  # every ticket below this one ran to the end (read without a lock: it only grows)

    def __len__(self) -> int:
        return len(self.stages)

    def take_ticket(self) -> int:
        """The ticket of the events being taken now (call under the queue's lock, so it matches their order)."""
        t = self.taken
        self.taken = t + 1
        return t

    def untake(self, ticket: int) -> None:
        """The take of ``ticket`` was undone (its plan failed before anything was pushed): it is handed out again."""
        self.taken = ticket

    def push(
        self, stages: Sequence[Stage], executor: Executor, host: list[torch.Tensor] | None = None, ticket: int = -1
    ) -> None:
        """Queue ``stages`` (maybe none) of ``ticket`` (default: the newest taken) behind the backlog."""
        t = self.taken - 1 if ticket < 0 else ticket
        if len(stages) == 1:  # a decode step: one stage
            self.stages.append((stages[0], executor, host, t))
        elif stages:  # a step with nothing to zero or copy has none: its ticket is done at once
            self.stages.extend([(stage, executor, host, t) for stage in stages])  # one call: all of them, or none
        if t > self.last:
            self.last = t
        self._advance_done()

    def holds(self, ticket: int) -> bool:
        """Whether the work of ``ticket`` was pushed (it may have run since)."""
        stages = self.stages
        return self.last >= ticket or (bool(stages) and stages[-1][3] == ticket)

    def begin(self, entry: object) -> None:
        """The runner starts on the head ``entry``, not the one ``next_tensor`` counted for: from tensor 0."""
        self.head, self.next_tensor = entry, 0

    def pop_done(self) -> None:
        """The head stage ran on every tensor: it leaves, and ``done`` moves on when its ticket is complete."""
        self.stages.popleft()
        self._advance_done()

    def _advance_done(self) -> None:
        stages = self.stages
        done = stages[0][3] if stages else self.last + 1
        if done > self.done:
            self.done = done

    def clear(self) -> int:
        """Drop every stage; returns how many there were (nothing unrun is left to read or write anything)."""
        n = len(self.stages)
        self.stages.clear()
        self.next_tensor = 0
        self._advance_done()
        return n
