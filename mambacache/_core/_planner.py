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

A slot's symbolic value is ``ZERO``, a start-of-step slot ``s`` (an int), a
draft position ``(s, j)``: slot ``s``'s draft state ``j`` (a tuple), or host
slot ``h``'s start-of-step content (the int ``-h``).

The host tier adds stages around the device ones:

* an offload stage first ("early" offloads): host slots that get a start-of-step
  pool slot, read before any pool slot is written;
* a restore stage after the commits: pool slots that get a start-of-step host
  slot;
* an offload stage last ("late" offloads): an offload of a slot whose value the
  step wrote before it (cleared, copied, committed or restored: speculative
  decoding's commit-then-swap), or into a host slot whose start-of-step content
  a restore reads. It reads the slot after every other stage, so that slot is
  *pinned*: its final write is the value the offload saw, made even if the slot
  is released.

A log where a pinned slot is later written with another value (offload, release,
then a new tenant's clear of the same slot) cannot be one set of stages: it is cut
into segments before such a write, and the segments planned one after the other,
each against the state the previous one leaves: exact by composition. Planning is
one pass over the log in all cases (no recursion), so it stays linear in the
events of a step however many segments it has::

    log:      c(1) o(1->h1) r(1) | a(1) c(2) o(2->h2) r(2) | a(2) ...
    segment:  <------ 1 -------> | <-------- 2 ---------->  | ...
    stages:   commit, late offload | commit, zero, late offload | ...

A *plain* step (the decode step: releases, allocs, clears and whole copies, no
copy reading a slot the step wrote, the copies one wave) needs none of that
state: :func:`_plain_plan` plans it in one pass, and everything else takes the
general pass; both give the same plan (a property test checks it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ._events import (
    Alloc,
    Clear,
    CommitDraft,
    CopyOnWrite,
    DropHost,
    Event,
    Export,
    Import,
    Offload,
    Release,
    Restore,
    fast_init,
)

__all__ = [
    "CommitStage",
    "CopyRun",
    "CopyStage",
    "OffloadStage",
    "Plan",
    "RestoreStage",
    "RotateStage",
    "Run",
    "ShiftStage",
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


@fast_init
@dataclass(frozen=True, slots=True)
class ZeroStage:
    """Zero ``slots`` (sorted, unique); ``runs`` is the same set coalesced."""

    slots: tuple[int, ...]
    runs: tuple[Run, ...]


@fast_init
@dataclass(frozen=True, slots=True)
class CopyStage:
    """``dst`` gets ``src`` for each pair; sources and destinations are disjoint.

    ``pairs`` is sorted by destination; ``runs`` is the same set coalesced.
    """

    pairs: tuple[tuple[int, int], ...]
    runs: tuple[CopyRun, ...]


@fast_init
@dataclass(frozen=True, slots=True)
class RotateStage:
    """For each cycle ``(c0, .., ck-1)``: ``c(i+1 mod k)`` gets ``ci``, all read first."""

    cycles: tuple[tuple[int, ...], ...]


@fast_init
@dataclass(frozen=True, slots=True)
class CommitStage:
    """Slot ``dst`` gets draft state ``pos`` of slot ``src`` for each ``(src, pos, dst)``; sorted by ``dst``.

    Sources are draft buffers, destinations pool slots: they never overlap, so the
    stage may run in any order, or all at once, and re-running it is harmless.
    """

    entries: tuple[tuple[int, int, int], ...]


@fast_init
@dataclass(frozen=True, slots=True)
class _TierStage:
    """Copies between the pool and the host pool: ``pairs`` sorted by destination, ``runs`` the same coalesced.

    Each side is read or written, never both, so re-running the stage is harmless.
    """

    pairs: tuple[tuple[int, int], ...]
    runs: tuple[CopyRun, ...]


@fast_init
@dataclass(frozen=True, slots=True)
class OffloadStage(_TierStage):
    """Host slot ``host`` gets pool slot ``slot`` for each ``(slot, host)``; runs are ``CopyRun(slot, host, n)``."""


@fast_init
@dataclass(frozen=True, slots=True)
class RestoreStage(_TierStage):
    """Pool slot ``slot`` gets host slot ``host`` for each ``(host, slot)``; runs are ``CopyRun(host, slot, n)``."""


@fast_init
@dataclass(frozen=True, slots=True)
class ShiftStage:
    """Slot ``dst`` gets slot ``src`` for each pair, every conv state shifted ``shift`` (>= 0) tokens to the front.

    On a conv tensor (time is its last axis, of width ``w``): ``dst[..., :w - shift]
    = src[..., shift:]`` and ``dst[..., w - shift:] = 0``; every other tensor runs
    ``copy``: each pair's destination gets its *temporal source* whole (the pair's
    ``src`` unless a copy named another, :attr:`CopyOnWrite.temporal_src`), the
    pairs whose temporal source is their destination left out. No slot is in two
    pairs (a pair's temporal source included), but a pair may be ``(a, a)`` (a shift
    in place): each pair reads its sources before writing, and pairs never see each
    other, so they run in any order, or all at once. ``pairs`` is sorted by
    destination. Not idempotent (a shift in place repeated shifts twice): executors
    keep a :class:`~mambacache._executors._base.Progress`.
    """

    shift: int
    pairs: tuple[tuple[int, int], ...]
    copy: CopyStage


def shift_stage(shift: int, pairs: Sequence[tuple[int, int]], temporal: Sequence[int] | None = None) -> ShiftStage:
    """The :class:`ShiftStage` of ``pairs``, sorted by destination, with its whole-copy part derived:
    ``temporal[i]`` is pair ``i``'s temporal source (None: each pair's own source)."""
    sources = [s for s, _ in pairs] if temporal is None else temporal
    ordered = sorted(zip(pairs, sources, strict=True), key=lambda e: e[0][1])
    whole = tuple((t, d) for (_, d), t in ordered if t != d)
    return ShiftStage(shift, tuple(p for p, _ in ordered), CopyStage(whole, copy_runs(whole)))


def temporal_sources(stage: ShiftStage) -> list[int]:
    """Each pair's temporal source, in ``stage.pairs`` order: the inverse of :func:`shift_stage`'s derivation."""
    src_of = {d: s for s, d in stage.copy.pairs}
    return [src_of.get(d, d) for _, d in stage.pairs]


Stage = ZeroStage | CopyStage | RotateStage | CommitStage | OffloadStage | RestoreStage | ShiftStage
HostStage = OffloadStage | RestoreStage


@fast_init
@dataclass(frozen=True, slots=True)
class Plan:
    """The device work of one step, in execution order, and what was elided."""

    stages: tuple[Stage, ...]
    events: int
    zeroed: int
    copied: int
    elided: int
    committed: int = 0
    offloaded: int = 0
    restored: int = 0


# ``tuple.__new__(Run, (a, b))`` is what a named tuple's own ``__new__`` calls, without that Python-level frame.
_tuple = tuple.__new__


def zero_runs(slots: Sequence[int]) -> tuple[Run, ...]:
    """Coalesce sorted unique slots into runs of consecutive slots."""
    runs: list[Run] = []
    start = n = 0
    for s in slots:
        if n and s == start + n:
            n += 1
            continue
        if n:
            runs.append(_tuple(Run, (start, n)))
        start, n = s, 1
    if n:
        runs.append(_tuple(Run, (start, n)))
    return tuple(runs)


def copy_runs(pairs: Sequence[tuple[int, int]]) -> tuple[CopyRun, ...]:
    """Coalesce pairs sorted by destination into runs where both sides advance by one."""
    runs: list[CopyRun] = []
    src0 = dst0 = n = 0
    for src, dst in pairs:
        if n and src == src0 + n and dst == dst0 + n:
            n += 1
            continue
        if n:
            runs.append(_tuple(CopyRun, (src0, dst0, n)))
        src0, dst0, n = src, dst, 1
    if n:
        runs.append(_tuple(CopyRun, (src0, dst0, n)))
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
    """What a segment of a step's log leaves, symbolically: every live slot's final write."""

    zero: list[int]  # slots to zero, sorted
    copies: dict[int, int]  # dst -> start-of-step src
    commits: list[tuple[int, int, int]]  # (src, draft pos, dst), sorted by dst
    events: int
    writes: int  # events that write a slot (pool or host)
    offloads: list[tuple[int, int]]  # (start-of-step slot, host), sorted by host: run first
    restores: list[tuple[int, int]]  # (start-of-step host, slot), sorted by slot
    late: list[tuple[int, int]]  # (slot, host), sorted by host: run last, reading the slot's final value
    end: int  # index one past the segment's last event: the next segment starts there
    shift: ShiftStage | None = None  # a segment of shifted copies only (then every list above is empty)


def _shift_writes(events: Sequence[Event], start: int, k: int) -> Writes:
    """The segment of shifted copies (or copies with a temporal source of their own, shift 0 or not) that starts
    at ``events[start]``: one :class:`ShiftStage`.

    It takes the copies with the same shift that follow, up to the first other
    event or the first copy touching a slot the segment already reads or writes
    (its source, temporal source or destination): inside the segment no copy sees
    another's write, so its one stage is exactly the copies one at a time. Such a
    copy is never merged with the symbolic values of the events around it (each
    conv tensor would need its own source position, its temporal state another);
    the segments before and after are planned against the state it leaves, exact
    by composition, as a pinned slot's segments are. ``k``: the first copy's shift.
    """
    pairs: list[tuple[int, int]] = []
    temporal: list[int] = []
    used: set[int] = set()
    i = start
    while i < len(events):
        ev = events[i]
        if type(ev) is not CopyOnWrite or ev.shift != k:
            break
        a, b = ev.src, ev.dst
        ts = a if ev.temporal_src is None else ev.temporal_src
        if a in used or b in used or ts in used:
            break
        pairs.append((a, b))
        temporal.append(ts)
        used.add(a)
        used.add(b)
        used.add(ts)
        i += 1
    n = i - start
    return Writes([], {}, [], n, n, [], [], [], i, shift_stage(k, pairs, temporal))


def final_writes(events: Sequence[Event], start: int = 0) -> Writes:
    """Symbolically execute ``events[start:]`` up to the first event the stages cannot express.

    See the module docstring. An offload is *early* (the offload stage, first)
    when it reads a plain start-of-step slot into a host slot whose start-of-step
    content nothing read; else it is *late* (an offload stage after the zeros),
    which reads its slot's final value, so that slot is pinned: its final value
    must be the one the offload saw, and it is written even if released. The
    segment ends before the first event that writes a pinned slot with another
    value.

    One function because it is the planner's single pass over the log: the
    seven maps of symbolic state are locals shared by every event kind, and a
    call per event (or an object holding them) would cost on every step of the
    hot path what the flat per-event figures in docs/benchmarks.md measure.
    """
    value: dict[int, int | tuple[int, int]] = {}
    dead: set[int] = set()
    pinned: dict[int, int | tuple[int, int]] = {}  # pool slot -> the value a late offload reads there
    host_value: dict[int, int | tuple[int, int]] = {}  # host slot -> the symbolic value it got this segment
    host_from: dict[int, tuple[bool, int]] = {}  # host slot -> (late, slot) of the offload that wrote it last
    host_dead: set[int] = set()
    host_read: set[int] = set()  # host slots whose start-of-step content some event read
    h = 0  # the host slot of the event at hand (a restore's or an import's, an offload's)
    writes = 0
    end = len(events)  # one past the segment's last event
    # The kinds in the decode step's order of frequency: each test costs every event that passes it.
    for i in range(start, end):
        ev = events[i]
        if type(ev) is CopyOnWrite:
            ts = ev.temporal_src
            if ev.shift or (ts is not None and ts != ev.src):  # shifted, or two sources
                if i == start:
                    return _shift_writes(events, start, ev.shift)
                end = i  # planned as a segment of its own, after this one
                break
            new: int | tuple[int, int] = value.get(ev.src, ev.src)
            slot = ev.dst
        elif type(ev) is Release:
            dead.add(ev.slot)
            continue
        elif type(ev) is Alloc:
            dead.discard(ev.slot)  # before the pinned test below: a pinned slot is written, dead or not
            if not ev.clear:
                continue
            new, slot = _ZERO, ev.slot
        elif type(ev) is Clear:
            new, slot = _ZERO, ev.slot
        elif type(ev) is CommitDraft:
            slot = ev.slot
            if not ev.accepted:
                writes += 1  # counted (and elided): the slot keeps its value
                continue
            new = (slot, ev.accepted - 1)
        elif type(ev) is Restore or type(ev) is Import:
            if ev.host is None:  # the hand-off traces an arrival in place, never queues it
                raise TypeError(f"an import in place is never planned: {ev!r}")
            h = ev.host
            got = host_value.get(h)
            new, slot = -h if got is None else got, ev.slot
            if pinned and slot in pinned and pinned[slot] != new:
                end = i  # as below, before the host slot's effects too
                break
            if h not in host_value:
                host_read.add(h)
            if not (type(ev) is Restore and ev.keep):  # an import always frees its staging slot
                host_dead.add(h)
        elif type(ev) is Offload or type(ev) is Export:
            slot = ev.slot
            if ev.host is None:  # the hand-off book never queues one: the send reads the slot itself
                raise TypeError(f"an export in place is never planned: {ev!r}")
            h = ev.host
            v = value.get(slot, slot)
            if type(v) is int and v > 0 and h not in host_read:
                host_from[h] = (False, v)
            else:
                pinned[slot] = v  # a pinned slot keeps its value: a write of another one ends the segment
                host_from[h] = (True, slot)
            writes += 1
            host_value[h] = v
            host_dead.discard(h)
            continue
        elif type(ev) is DropHost:
            host_dead.add(ev.host)
            continue
        else:
            raise TypeError(f"not an event: {ev!r}")
        # A pool write: the segment ends here, before its effects, if it changes a pinned slot.
        if pinned and slot in pinned and pinned[slot] != new:
            end = i
            break
        writes += 1
        value[slot] = new
    zero: list[int] = []
    src_of: dict[int, int] = {}
    commits: list[tuple[int, int, int]] = []
    restores: list[tuple[int, int]] = []
    for d, v in value.items():
        if v == d or (d in dead and d not in pinned):
            continue  # unchanged, or nobody may read it: a free slot is cleared on alloc
        if isinstance(v, tuple):
            commits.append((v[0], v[1], d))
        elif v == _ZERO:
            zero.append(d)
        elif v < 0:
            restores.append((-v, d))
        else:
            src_of[d] = v
    zero.sort()
    commits.sort(key=lambda e: e[2])
    restores.sort(key=lambda e: e[1])
    offloads: list[tuple[int, int]] = []
    late: list[tuple[int, int]] = []
    for h in sorted(host_from):
        if h not in host_dead:
            is_late, s = host_from[h]
            (late if is_late else offloads).append((s, h))
    return Writes(zero, src_of, commits, end - start, writes, offloads, restores, late, end)


def _plain_plan(log: Sequence[Event]) -> Plan | None:
    """The plan of a *plain* step, or None: the decode step's fast path.

    Plain: only releases, allocs, clears and whole copies of one source; no copy reads a slot
    written before it in the step (no chain: every copy reads a start-of-step
    value, so a slot's symbolic value is just its last write); no slot that a
    copy reads ends the step with a copy of another slot (the copies are one
    wave). Such a log has one segment, no pinned slot, no host stage and no
    rotate, so the general pass (:func:`final_writes`, :func:`_order_copies`)
    reduces to this one: the same values, dead slots, write count and stages,
    without the state those conditions leave unused. Any other log returns None
    and takes the general path. ``tests/core/test_planner.py`` checks both give one plan on random logs, plain
    and just not.

    What the second pass buys (``tools/benchmarks/ab_host.py``, 40 interleaved rounds, docs/benchmarks.md):
    planning the decode step 1.34 -> 0.80 us an event, 100 plain events 0.77 -> 0.62, the bench's decode step
    55.8 -> 49.9 us (11 %); a log that is not plain pays for the attempt (planning 100 mixed events 3 % more,
    the bench's host line 2-7 %).
    """
    value: dict[int, int] = {}
    dead: set[int] = set()
    read: set[int] = set()
    writes = 0
    for ev in log:
        if type(ev) is CopyOnWrite:
            src = ev.src
            # shifted, a temporal source of its own (even one equal to src: not a plain copy's form), a chain, a host
            if ev.shift or ev.temporal_src is not None or src in value or src < 0:
                return None
            value[ev.dst] = src
            read.add(src)
        elif type(ev) is Release:
            dead.add(ev.slot)
            continue
        elif type(ev) is Alloc:
            dead.discard(ev.slot)
            if not ev.clear:
                continue
            value[ev.slot] = _ZERO
        elif type(ev) is Clear:
            value[ev.slot] = _ZERO
        else:
            return None
        writes += 1
    zero: list[int] = []
    copies: list[tuple[int, int]] = []  # (dst, src): sorted, they are ordered by destination
    for d, v in value.items():
        if v == d or d in dead:
            continue  # unchanged, or nobody may read it
        if v == _ZERO:
            zero.append(d)
        elif d in read:
            return None  # a source that is overwritten by a copy: more than one wave, or a cycle
        else:
            copies.append((d, v))
    stages: list[Stage] = []
    if copies:
        copies.sort()
        pairs = tuple([(s, d) for d, s in copies])
        stages.append(CopyStage(pairs, copy_runs(pairs)))
    if zero:
        zero.sort()
        slots = tuple(zero)
        stages.append(ZeroStage(slots, zero_runs(slots)))
    return Plan(tuple(stages), len(log), len(zero), len(copies), writes - len(zero) - len(copies))


def plan_step(events: Iterable[Event]) -> Plan:
    """Plan one step: see the module docstring for the guarantees.

    Iterative and linear in the events: each segment of the log is read once.
    A plain step (the decode step's releases, allocs, clears and whole copies,
    no copy reading a slot the step wrote) is planned in one pass that keeps
    only each slot's last write; it gives the plan the general pass would.
    """
    log = events if type(events) is list or type(events) is tuple else list(events)
    plain = _plain_plan(log)
    return plain if plain is not None else _general_plan(log)


def _general_plan(log: Sequence[Event]) -> Plan:
    """:func:`plan_step` of any log: segment by segment, each one pass of :func:`final_writes`."""
    stages: list[Stage] = []
    n = zeroed = copied = elided = committed = offloaded = restored = 0
    start = 0
    while start < len(log):
        zero, src_of, commits, count, writes, offloads, restores, late, start, shifted = final_writes(log, start)
        if shifted is not None:
            stages.append(shifted)
            n += count
            copied += len(shifted.pairs)
            continue
        if offloads:
            pairs = tuple(offloads)
            stages.append(OffloadStage(pairs, copy_runs(pairs)))
        waves, rotate = _order_copies(src_of)
        stages += waves
        if rotate is not None:
            stages.append(rotate)
        if commits:
            stages.append(CommitStage(tuple(commits)))
        if restores:
            pairs = tuple(restores)
            stages.append(RestoreStage(pairs, copy_runs(pairs)))
        if zero:
            stages.append(ZeroStage(tuple(zero), zero_runs(zero)))
        if late:
            pairs = tuple(late)
            stages.append(OffloadStage(pairs, copy_runs(pairs)))
        n += count
        zeroed += len(zero)
        copied += len(src_of)
        committed += len(commits)
        offloaded += len(offloads) + len(late)
        restored += len(restores)
        elided += writes - (len(zero) + len(src_of) + len(commits) + len(offloads) + len(late) + len(restores))
    return Plan(tuple(stages), n, zeroed, copied, elided, committed, offloaded, restored)


# -- wire format -------------------------------------------------------------
# A plan as a flat list of ints, for one int64 tensor message per step:
#   [MAGIC, step, events, zeroed, copied, elided, committed, offloaded, restored, n_stages, stage...]
#   zero stage:    [1, n, slot * n]
#   copy stage:    [2, n, (src, dst) * n]
#   rotate stage:  [3, n_cycles, (len, member * len) * n_cycles]
#   commit stage:  [4, n, (src, pos, dst) * n]
#   offload stage: [5, n, (slot, host) * n]
#   restore stage: [6, n, (host, slot) * n]
#   shift stage:   [7, n, shift, (src, dst, temporal source) * n]
MAGIC = 0x6D63_0005  # 4: shift stages; 5: their pairs' temporal sources
_HEADER = 10
_ZERO_KIND, _COPY_KIND, _ROTATE_KIND, _COMMIT_KIND, _OFFLOAD_KIND, _RESTORE_KIND, _SHIFT_KIND = 1, 2, 3, 4, 5, 6, 7
_PAIR_KINDS: dict[type, int] = {CopyStage: _COPY_KIND, OffloadStage: _OFFLOAD_KIND, RestoreStage: _RESTORE_KIND}
_PAIR_STAGES: dict[int, type[CopyStage | OffloadStage | RestoreStage]] = {k: t for t, k in _PAIR_KINDS.items()}


def encode_plan(plan: Plan, step: int) -> list[int]:
    out = [
        MAGIC, step, plan.events, plan.zeroed, plan.copied, plan.elided, plan.committed, plan.offloaded,
        plan.restored, len(plan.stages),
    ]  # fmt: skip
    for stage in plan.stages:
        if isinstance(stage, ZeroStage):
            out += [_ZERO_KIND, len(stage.slots), *stage.slots]
        elif isinstance(stage, CopyStage | OffloadStage | RestoreStage):
            out += [_PAIR_KINDS[type(stage)], len(stage.pairs)]
            for a, b in stage.pairs:
                out += [a, b]
        elif isinstance(stage, CommitStage):
            out += [_COMMIT_KIND, len(stage.entries)]
            for entry in stage.entries:
                out += entry
        elif isinstance(stage, ShiftStage):
            out += [_SHIFT_KIND, len(stage.pairs), stage.shift]
            for (a, b), ts in zip(stage.pairs, temporal_sources(stage), strict=True):
                out += [a, b, ts]
        else:
            out += [_ROTATE_KIND, len(stage.cycles)]
            for cycle in stage.cycles:
                out += [len(cycle), *cycle]
    return out


def decode_plan(data: Sequence[int]) -> tuple[int, Plan]:
    """Inverse of :func:`encode_plan`; raises ValueError on a malformed message."""
    if len(data) < _HEADER or data[0] != MAGIC:
        raise ValueError("not a mambacache plan message")
    try:
        return _decode(data)
    except IndexError:
        raise ValueError("truncated plan message") from None


def _decode(data: Sequence[int]) -> tuple[int, Plan]:
    step, events, zeroed, copied, elided, committed, offloaded, restored, n_stages = data[1:_HEADER]
    pos = _HEADER
    stages: list[Stage] = []
    for _ in range(n_stages):
        kind, n = data[pos], data[pos + 1]
        pos += 2
        if kind == _ZERO_KIND:
            slots = tuple(data[pos : pos + n])
            pos += n
            stages.append(ZeroStage(slots, zero_runs(slots)))
        elif kind in _PAIR_STAGES:
            flat = data[pos : pos + 2 * n]
            pos += 2 * n
            pairs = tuple(zip(flat[0::2], flat[1::2], strict=True))
            stages.append(_PAIR_STAGES[kind](pairs, copy_runs(pairs)))
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
        elif kind == _SHIFT_KIND:
            shift = data[pos]
            flat = data[pos + 1 : pos + 1 + 3 * n]
            pos += 1 + 3 * n
            stages.append(shift_stage(shift, list(zip(flat[0::3], flat[1::3], strict=True)), flat[2::3]))
        else:
            raise ValueError(f"unknown stage kind {kind} in plan message")
    if pos != len(data):
        raise ValueError("trailing data in plan message")
    return step, Plan(tuple(stages), events, zeroed, copied, elided, committed, offloaded, restored)
