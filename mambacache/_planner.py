"""The step planner: a step's event log in, the fewest device stages out.

Pure Python (no torch), so it can be tested alone and costs microseconds.

How it works: the log is executed symbolically. Each slot's value is tracked as
either ``ZERO`` or "slot s's content at the start of the step". At the end, every
live slot whose value is not itself needs one write: a zero or a copy from a
start-of-step source. Every copy therefore reads the start-of-step state, which
is what makes any event order (chains, overlaps, swaps, reads of slots cleared
later) exact. The copies are then ordered so that no slot is overwritten while a
later copy still needs its old content:

* copy stages ("waves"), leaves first: a wave holds copies whose destinations no
  pending copy reads, so inside a wave sources and destinations are disjoint and
  the wave may run in any order, or all at once, and re-running it is harmless;
* what is left after the waves is a set of disjoint cycles (swaps, rotations),
  run as one rotate stage that reads every member before writing any;
* one commit stage: slots that get a state from a draft buffer (speculative
  decoding's accepted token), after the copies that read their old content;
  draft buffers are only written by the forward, never by a flush, so a commit
  reads the same thing wherever it runs;
* one zero stage last (a zeroed slot may still be a copy source).

A slot's symbolic value is ``ZERO``, a start-of-step slot ``s`` (an int), or a
draft position ``(s, j)``: slot ``s``'s draft state ``j`` (a tuple).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ._events import Alloc, Clear, CommitDraft, CopyOnWrite, Event, Release

__all__ = [
    "CommitStage",
    "CopyRun",
    "CopyStage",
    "Plan",
    "RotateStage",
    "Run",
    "Stage",
    "ZeroStage",
    "decode_plan",
    "encode_plan",
    "plan_step",
]

_ZERO = 0  # slot 0 is the padding slot, never a source, so 0 can mean "zeros"


# Runs are named tuples, not frozen dataclasses: a plan makes one per run and a
# frozen dataclass's __init__ costs several times a tuple's on the decode-step path.
class Run(NamedTuple):
    """Slots ``start .. start + length - 1``."""

    start: int
    length: int


class CopyRun(NamedTuple):
    """Slots ``dst + i`` get ``src + i`` for ``i < length``."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True, slots=True)
class ZeroStage:
    """Zero ``slots`` (sorted, unique); ``runs`` is the same set coalesced."""

    slots: tuple[int, ...]
    runs: tuple[Run, ...]


@dataclass(frozen=True, slots=True)
class CopyStage:
    """``dst`` gets ``src`` for each pair; sources and destinations are disjoint.

    ``pairs`` is sorted by destination; ``runs`` is the same set coalesced.
    """

    pairs: tuple[tuple[int, int], ...]
    runs: tuple[CopyRun, ...]


@dataclass(frozen=True, slots=True)
class RotateStage:
    """For each cycle ``(c0, .., ck-1)``: ``c(i+1 mod k)`` gets ``ci``, all read first."""

    cycles: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class CommitStage:
    """Slot ``dst`` gets draft state ``pos`` of slot ``src`` for each ``(src, pos, dst)``; sorted by ``dst``.

    Sources are draft buffers, destinations pool slots: they never overlap, so the
    stage may run in any order, or all at once, and re-running it is harmless.
    """

    entries: tuple[tuple[int, int, int], ...]


Stage = ZeroStage | CopyStage | RotateStage | CommitStage


@dataclass(frozen=True, slots=True)
class Plan:
    """The device work of one step, in execution order, and what was elided."""

    stages: tuple[Stage, ...]
    events: int
    zeroed: int
    copied: int
    elided: int
    committed: int = 0


def zero_runs(slots: Sequence[int]) -> tuple[Run, ...]:
    """Coalesce sorted unique slots into runs of consecutive slots."""
    runs: list[Run] = []
    start = prev = -2
    for s in slots:
        if s != prev + 1:
            if prev >= 0:
                runs.append(Run(start, prev - start + 1))
            start = s
        prev = s
    if prev >= 0:
        runs.append(Run(start, prev - start + 1))
    return tuple(runs)


def copy_runs(pairs: Sequence[tuple[int, int]]) -> tuple[CopyRun, ...]:
    """Coalesce pairs sorted by destination into runs where both sides advance by one."""
    runs: list[CopyRun] = []
    for src, dst in pairs:
        if runs:
            last = runs[-1]
            if src == last.src + last.length and dst == last.dst + last.length:
                runs[-1] = CopyRun(last.src, last.dst, last.length + 1)
                continue
        runs.append(CopyRun(src, dst, 1))
    return tuple(runs)


def _order_copies(src_of: dict[int, int]) -> tuple[list[CopyStage], RotateStage | None]:
    """Waves of copies, leaves first, then the cycles that remain."""
    if not src_of:
        return [], None
    if src_of.keys().isdisjoint(src_of.values()):  # no destination is read: one wave (the decode-step case)
        pairs = tuple([(s, d) for d, s in sorted(src_of.items())])
        return [CopyStage(pairs, copy_runs(pairs))], None
    readers: dict[int, int] = {}
    for s in src_of.values():
        readers[s] = readers.get(s, 0) + 1
    pending = dict(src_of)
    ready = [d for d in pending if d not in readers]
    waves: list[CopyStage] = []
    while ready:
        ready.sort()
        pairs = tuple((pending.pop(d), d) for d in ready)
        waves.append(CopyStage(pairs, copy_runs(pairs)))
        ready = []
        for s, _ in pairs:
            readers[s] -= 1
            if readers[s] == 0 and s in pending:
                ready.append(s)
    if not pending:
        return waves, None
    # Every remaining slot has one source and one reader left: disjoint cycles.
    cycles: list[tuple[int, ...]] = []
    for first in sorted(pending):
        if first not in pending:
            continue
        backwards = [first]
        s = pending.pop(first)
        while s != first:
            backwards.append(s)
            s = pending.pop(s)
        backwards.reverse()  # now c(i+1) gets c(i)
        cycles.append(tuple(backwards[-1:] + backwards[:-1]))
    return waves, RotateStage(tuple(cycles))


class Writes(NamedTuple):
    """What a step's log leaves, symbolically: every live slot's final write."""

    zero: list[int]  # slots to zero, sorted
    copies: dict[int, int]  # dst -> start-of-step src
    commits: list[tuple[int, int, int]]  # (src, draft pos, dst), sorted by dst
    events: int
    writes: int  # events that write a slot


def final_writes(events: Iterable[Event]) -> Writes:
    """Symbolically execute ``events``: see the module docstring."""
    value: dict[int, int | tuple[int, int]] = {}
    dead: set[int] = set()
    n = writes = 0
    for ev in events:
        n += 1
        t = type(ev)
        if t is CopyOnWrite:
            writes += 1
            value[ev.dst] = value.get(ev.src, ev.src)  # type: ignore[union-attr]
        elif t is Clear:
            writes += 1
            value[ev.slot] = _ZERO  # type: ignore[union-attr]
        elif t is Alloc:
            if ev.clear:  # type: ignore[union-attr]
                writes += 1
                value[ev.slot] = _ZERO  # type: ignore[union-attr]
            dead.discard(ev.slot)  # type: ignore[union-attr]
        elif t is Release:
            dead.add(ev.slot)  # type: ignore[union-attr]
        elif t is CommitDraft:
            writes += 1
            if ev.accepted:  # type: ignore[union-attr]
                value[ev.slot] = (ev.slot, ev.accepted - 1)  # type: ignore[union-attr]
        else:
            raise TypeError(f"not an event: {ev!r}")
    zero: list[int] = []
    src_of: dict[int, int] = {}
    commits: list[tuple[int, int, int]] = []
    for d, v in value.items():
        if v == d or d in dead:
            continue  # unchanged, or nobody may read it: a free slot is cleared on alloc
        if type(v) is tuple:
            commits.append((v[0], v[1], d))
        elif v == _ZERO:
            zero.append(d)
        else:
            src_of[d] = v  # type: ignore[assignment]
    zero.sort()
    commits.sort(key=lambda e: e[2])
    return Writes(zero, src_of, commits, n, writes)


def plan_step(events: Iterable[Event]) -> Plan:
    """Plan one step: see the module docstring for the guarantees."""
    zero, src_of, commits, n, writes = final_writes(events)
    waves, rotate = _order_copies(src_of)
    stages: list[Stage] = list(waves)
    if rotate is not None:
        stages.append(rotate)
    if commits:
        stages.append(CommitStage(tuple(commits)))
    if zero:
        stages.append(ZeroStage(tuple(zero), zero_runs(zero)))
    written = len(zero) + len(src_of) + len(commits)
    return Plan(tuple(stages), n, len(zero), len(src_of), writes - written, len(commits))


# -- wire format -------------------------------------------------------------
# A plan as a flat list of ints, for one int64 tensor message per step:
#   [MAGIC, step, events, zeroed, copied, elided, committed, n_stages, stage...]
#   zero stage:   [1, n, slot * n]
#   copy stage:   [2, n, (src, dst) * n]
#   rotate stage: [3, n_cycles, (len, member * len) * n_cycles]
#   commit stage: [4, n, (src, pos, dst) * n]
MAGIC = 0x6D63_0002  # 2: commit stages and the committed count
_ZERO_KIND, _COPY_KIND, _ROTATE_KIND, _COMMIT_KIND = 1, 2, 3, 4


def encode_plan(plan: Plan, step: int) -> list[int]:
    out = [MAGIC, step, plan.events, plan.zeroed, plan.copied, plan.elided, plan.committed, len(plan.stages)]
    for stage in plan.stages:
        if isinstance(stage, ZeroStage):
            out += [_ZERO_KIND, len(stage.slots), *stage.slots]
        elif isinstance(stage, CopyStage):
            out += [_COPY_KIND, len(stage.pairs)]
            for src, dst in stage.pairs:
                out += [src, dst]
        elif isinstance(stage, CommitStage):
            out += [_COMMIT_KIND, len(stage.entries)]
            for entry in stage.entries:
                out += entry
        else:
            out += [_ROTATE_KIND, len(stage.cycles)]
            for cycle in stage.cycles:
                out += [len(cycle), *cycle]
    return out


def decode_plan(data: Sequence[int]) -> tuple[int, Plan]:
    """Inverse of :func:`encode_plan`; raises ValueError on a malformed message."""
    if len(data) < 8 or data[0] != MAGIC:
        raise ValueError("not a mambacache plan message")
    try:
        return _decode(data)
    except IndexError:
        raise ValueError("truncated plan message") from None


def _decode(data: Sequence[int]) -> tuple[int, Plan]:
    step, events, zeroed, copied, elided, committed, n_stages = data[1:8]
    pos = 8
    stages: list[Stage] = []
    for _ in range(n_stages):
        kind, n = data[pos], data[pos + 1]
        pos += 2
        if kind == _ZERO_KIND:
            slots = tuple(data[pos : pos + n])
            pos += n
            stages.append(ZeroStage(slots, zero_runs(slots)))
        elif kind == _COPY_KIND:
            flat = data[pos : pos + 2 * n]
            pos += 2 * n
            pairs = tuple(zip(flat[0::2], flat[1::2], strict=True))
            stages.append(CopyStage(pairs, copy_runs(pairs)))
        elif kind == _ROTATE_KIND:
            cycles = []
            for _ in range(n):
                length = data[pos]
                cycles.append(tuple(data[pos + 1 : pos + 1 + length]))
                pos += 1 + length
            stages.append(RotateStage(tuple(cycles)))
        elif kind == _COMMIT_KIND:
            flat = data[pos : pos + 3 * n]
            pos += 3 * n
            stages.append(CommitStage(tuple(zip(flat[0::3], flat[1::3], flat[2::3], strict=True))))
        else:
            raise ValueError(f"unknown stage kind {kind} in plan message")
    if pos != len(data):
        raise ValueError("trailing data in plan message")
    return step, Plan(tuple(stages), events, zeroed, copied, elided, committed)
