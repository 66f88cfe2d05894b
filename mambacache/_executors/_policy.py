"""Which way a large CPU stage runs, picked per stage shape from the stages' own measured times.

A large zero, copy or host stage on CPU can run several ways that move the same
bytes (``_torch.py``): its pieces under ATen's grain shared with the crew's
helper threads (``crew``), the same pieces on the calling thread alone
(``inline``), one strided op per run, each an OpenMP parallel region
(``whole``), or, for a zero stage, one ``index_fill_`` per tensor (``index``).
Which is fastest depends on the host's load more than on the stage: on a quiet
host the parallel regions reach memset speed and the calling thread alone about
half of it; with another process computing, a region waits a scheduler slice
for a descheduled pool thread and is many times slower, while pieces are not
(docs/benchmarks.md, "Contention"). No fixed rule wins both, so each stage
shape keeps the time per byte of each way, runs the fastest, and now and then
runs another again to see whether the host changed::

    shape (op, bytes, runs, each rounded to a power of two)
      first:  each way in turn, twice (c i w c i w), a way 8x slower than the
              fastest after its first run only once
      then:   the fastest way; another way again (once) once ``wait * r``
              stages of the shape ran since it last did, r its time over the
              fastest's, ``wait`` starting at ``SOON`` and doubling with each
              look that leaves the fastest where it was, up to ``patience``
              (a way 50x slower is tried every 6,400 stages in the end)

A way ``r`` times slower costs ``r - 1`` stages' time every ``patience * r``
stages once its looks have backed off: under ``1 / patience`` of the shape's
time for each way, whatever ``r``. A look is one run: the fastest way's time is
the lower of its last two runs, so one slow run of a looked-at way only puts
its next look off, and a faster one is what a changed host shows. The first looks are taken while the engine
starts (loading, compiling, the first pages touched), when one way's run can be
several times slower than that way is: backing off from ``SOON`` corrects a
first pick such a run misled within a few dozen stages, for a one-time
``(r - 1) log2(patience / SOON)`` stages' time.
A way's time is the lower of its last two runs: load only slows a run down, and
one slow run must not exile the fastest way for thousands of stages.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["FIRST", "LOOK", "PATIENCE", "SOON", "Policy"]

# Stages of a shape between two looks at a way, per unit of that way's time over the fastest's.
PATIENCE = 128
# The first wait (in stages, per unit of a way's slowdown) before a slower way is looked at again; doubled
# with each look that does not change the fastest way, up to the patience.
SOON = 4
# The first looks: each way runs this many times, in turn, before the fastest is picked (one run alone, on a
# loaded host, may be a scheduler slice slower than the way is).
FIRST = 2
# ... except a way whose first run took more than this many times the fastest way's.
SLOWER = 8
# Runs of a slower way in each later look.
LOOK = 1


class _Shape:
    __slots__ = ("best", "count", "due", "last", "rate", "runs", "trying", "wait")

    def __init__(self) -> None:
        self.count = 0
        self.runs: dict[str, int] = {}  # runs of each way, ever
        self.rate: dict[str, float] = {}  # a way's seconds per byte: the lower of its last two runs
        self.last: dict[str, float] = {}  # its last run's seconds per byte
        self.due: dict[str, int] = {}  # the stage count at which a way is run again
        self.trying: dict[str, int] = {}  # runs a way still has in its current look
        self.wait: dict[str, int] = {}  # a way's current wait between looks, per unit of its slowdown
        self.best = ""


class Policy:
    """The ways' measured times per stage shape: :meth:`pick` a way, run it, :meth:`record` its time."""

    def __init__(self, patience: int = PATIENCE) -> None:
        self.patience = patience
        self._shapes: dict[Hashable, _Shape] = {}

    def pick(self, key: Hashable, ways: Sequence[str]) -> str:
        """The way to run the next stage of shape ``key`` with, one of ``ways``."""
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = _Shape()
        shape.count += 1
        for way, left in shape.trying.items():  # a look in progress
            if left:
                return way
        if shape.count <= FIRST * len(ways):  # the first looks: each way in turn, FIRST times
            fastest = min(shape.rate.values(), default=0.0)
            for times in range(1, FIRST + 1):
                for way in ways:
                    # A way already SLOWER x the fastest is not run again now (a parallel region per op with
                    # another process computing: tens of times slower, once is enough to know).
                    if shape.runs.get(way, 0) < times and not (times > 1 and shape.rate[way] > SLOWER * fastest):
                        return way
        for way in ways:
            if way != shape.best and shape.count >= shape.due.get(way, 0):
                shape.trying[way] = LOOK
                shape.last.pop(way, None)  # a fresh look: its old runs say nothing of the host now
                return way
        return shape.best

    def record(self, key: Hashable, way: str, seconds: float, nbytes: int) -> None:
        """A stage of shape ``key`` of ``nbytes`` bytes ran ``way`` in ``seconds``.

        The fastest way is replaced only by a way just looked at, whose time is as fresh as its own: when the
        fastest way slows down, the ways whose last looks were faster than it is now are looked at again
        first. Compared with their older times at once, a lucky run long ago would win the shape back to a
        way that is slower now, and the shape would swing between ways on a loaded host."""
        shape = self._shapes[key]
        rate = seconds / max(nbytes, 1)
        last = shape.last.get(way)
        shape.last[way] = rate
        shape.runs[way] = shape.runs.get(way, 0) + 1
        shape.rate[way] = rate if last is None else min(rate, last)
        if shape.trying.get(way):
            shape.trying[way] -= 1
            if shape.trying[way]:
                return  # the look goes on
        elif way == shape.best:
            now = shape.rate[way]
            for other, other_rate in shape.rate.items():
                if other != way and other_rate < now and not shape.trying.get(other):
                    shape.due[other] = shape.count  # looked at again from the next stage on
            return
        best = shape.best
        if not best or best not in shape.rate or shape.runs[way] <= FIRST:  # the first looks: the fastest
            best = min(shape.rate, key=shape.rate.__getitem__)
        elif shape.rate[way] < shape.rate[best]:
            best = way
        changed, shape.best = best != shape.best, best
        if changed:  # the host changed: every slower way's looks start soon again
            shape.wait.clear()
        for other in shape.rate if changed else (way,):
            if other != best and not shape.trying.get(other):
                prev = shape.wait.get(other)
                wait = shape.wait[other] = min(SOON if prev is None else 2 * prev, self.patience)
                shape.due[other] = shape.count + int(wait * shape.rate[other] / shape.rate[best])

    def best(self, key: Hashable) -> str | None:
        """The way stages of shape ``key`` run by now (None before any ran)."""
        shape = self._shapes.get(key)
        return shape.best if shape is not None and shape.best else None
