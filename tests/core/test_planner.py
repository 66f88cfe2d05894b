"""The planner alone (no torch): plans against symbolic sequential execution."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mambacache as mc
from mambacache._core._planner import (
    CommitStage,
    CopyStage,
    OffloadStage,
    RestoreStage,
    RotateStage,
    ShiftStage,
    ZeroStage,
    _general_plan,
    _plain_plan,
    copy_runs,
    decode_plan,
    encode_plan,
    plan_step,
    temporal_sources,
    zero_runs,
)

from ..support.strategies import events_from_ops, host_events_from_ops, ops, shift_ops

N = 12


def sequential(events: list[object], start: dict[int, object]) -> dict[int, object]:
    state = dict(start)
    for ev in events:
        if isinstance(ev, mc.Clear) or (isinstance(ev, mc.Alloc) and ev.clear):
            state[ev.slot] = "Z"
        elif isinstance(ev, mc.CopyOnWrite):
            ts = ev.src if ev.temporal_src is None else ev.temporal_src
            state[ev.dst] = split(shifted(ev.shift, conv(state[ev.src])), temporal(state[ts]))
        elif isinstance(ev, mc.CommitDraft) and ev.accepted:
            state[ev.slot] = ("draft", ev.slot, ev.accepted - 1)  # draft buffers: constant during the step
    return state


def shifted(k: int, value: object) -> object:
    """A conv state's symbolic value after a copy shifted by ``k`` (0: the value itself); nothing defined stays so."""
    return value if k == 0 or value == "undefined" else ("S", k, value)


# A slot's value whose conv states and temporal state have different histories (a copy with a temporal source of
# its own, or a shifted one) is ("C", conv, temporal); any other value stands for all of its tensors.
def split(conv_value: object, temporal_value: object) -> object:
    return conv_value if conv_value == temporal_value else ("C", conv_value, temporal_value)


def conv(value: object) -> object:
    return value[1] if type(value) is tuple and value[0] == "C" else value


def temporal(value: object) -> object:
    return value[2] if type(value) is tuple and value[0] == "C" else value


def run_plan(plan: mc.Plan, start: dict[int, object]) -> dict[int, object]:
    state = dict(start)
    for stage in plan.stages:
        if isinstance(stage, ZeroStage):
            assert list(stage.slots) == sorted(set(stage.slots))
            for s in stage.slots:
                state[s] = "Z"
        elif isinstance(stage, CopyStage):
            srcs = {s for s, _ in stage.pairs}
            dsts = [d for _, d in stage.pairs]
            assert not srcs & set(dsts), "a copy stage must have disjoint sources and destinations"
            assert dsts == sorted(set(dsts))
            # Run in reverse to prove order inside a stage does not matter.
            for s, d in reversed(stage.pairs):
                state[d] = state[s]
        elif isinstance(stage, RotateStage):
            old = dict(state)
            members = [c for cycle in stage.cycles for c in cycle]
            assert len(members) == len(set(members))
            for cycle in stage.cycles:
                assert len(cycle) >= 2
                for i, c in enumerate(cycle):
                    state[cycle[(i + 1) % len(cycle)]] = old[c]
        elif isinstance(stage, CommitStage):
            dsts = [d for _, _, d in stage.entries]
            assert dsts == sorted(set(dsts))
            for src, pos, dst in reversed(stage.entries):
                state[dst] = ("draft", src, pos)
        elif isinstance(stage, ShiftStage):
            sources = temporal_sources(stage)
            slots = [x for (s, d), t in zip(stage.pairs, sources, strict=True) for x in {s, d, t}]
            assert len(slots) == len(set(slots)), "no slot may be in two pairs of a shift stage"
            assert [d for _, d in stage.pairs] == sorted(d for _, d in stage.pairs)
            # shift 0 only for a segment that a copy with a temporal source of its own started
            assert stage.shift > 0 or any(t != s for (s, _), t in zip(stage.pairs, sources, strict=True))
            assert stage.copy.pairs == tuple((t, d) for (_, d), t in zip(stage.pairs, sources, strict=True) if t != d)
            for (s, d), t in reversed(list(zip(stage.pairs, sources, strict=True))):  # pairs never see each other
                state[d] = split(shifted(stage.shift, conv(state[s])), temporal(state[t]))
    return state


@given(ops, st.sets(st.integers(1, N)), st.sampled_from([0, 1, 3]))
def test_plan_equals_sequential_execution(raw: list[tuple[str, int, int]], initially: set[int], k: int) -> None:
    for events, allocated in events_from_ops(raw, N, set(initially), draft_tokens=k):
        start: dict[int, object] = {s: s for s in range(1, N + 1)}
        plan = plan_step(events)  # type: ignore[arg-type]
        want = sequential(events, start)
        got = run_plan(plan, start)
        for s in allocated:
            assert got[s] == want[s], (s, events, plan)
        # Minimal: one write per live slot whose value changed, nothing for dead or unchanged slots.
        changed = {s for s in allocated if want[s] != s}
        writes = plan.zeroed + plan.copied + plan.committed
        assert writes == len(changed)
        assert plan.events == len(events)
        writers = sum(
            isinstance(e, (mc.Clear, mc.CopyOnWrite, mc.CommitDraft)) or (isinstance(e, mc.Alloc) and e.clear)
            for e in events
        )
        assert plan.elided == writers - writes >= 0
        kinds = [type(st_) for st_ in plan.stages]
        assert kinds.count(ZeroStage) <= 1 and kinds.count(RotateStage) <= 1 and kinds.count(CommitStage) <= 1
        assert all(st_ is CopyStage for st_ in kinds[: kinds.count(CopyStage)])


@given(st.permutations(list(range(1, 9))))
def test_any_permutation_is_one_rotate_stage(perm: list[int]) -> None:
    # Sequential swaps realising `perm`: new[perm[i]] gets old[i + 1].
    events: list[object] = []
    pos = {s: s for s in range(1, 9)}  # where slot s's original content is now
    content = {s: s for s in range(1, 9)}
    for i, target in enumerate(perm, start=1):
        src = pos[i]
        if src == target:
            continue
        # swap contents of src and target through a three-copy dance is not possible without a
        # spare slot, so use slot 9 as the spare: it ends released.
        events += [mc.CopyOnWrite(target, 9), mc.CopyOnWrite(src, target), mc.CopyOnWrite(9, src)]
        moved = content[target]
        content[target], content[src] = content[src], moved
        pos[content[src]] = src
        pos[content[target]] = target
    events.append(mc.Release(9))
    plan = plan_step(events)  # type: ignore[arg-type]
    start: dict[int, object] = {s: s for s in range(1, 10)}
    got = run_plan(plan, start)
    want = sequential(events, start)
    assert all(got[s] == want[s] for s in range(1, 9))
    assert [type(s) for s in plan.stages] in ([], [RotateStage])
    assert plan.copied == sum(want[s] != s for s in range(1, 9))


def test_examples() -> None:
    # chain a->b, b->c: c gets a's content (b had it by then).
    p = plan_step([mc.CopyOnWrite(1, 2), mc.CopyOnWrite(2, 3)])
    assert [st_.pairs for st_ in p.stages] == [((1, 2), (1, 3))]  # type: ignore[union-attr]
    # copy from a slot cleared later in the step reads the old content, and before the zero.
    p = plan_step([mc.CopyOnWrite(1, 2), mc.Clear(1)])
    assert [type(s) for s in p.stages] == [CopyStage, ZeroStage]
    # a clear made dead by a later copy is elided.
    p = plan_step([mc.Clear(2), mc.CopyOnWrite(1, 2)])
    assert (p.zeroed, p.copied, p.elided) == (0, 1, 1)
    # self-copy and duplicates.
    p = plan_step([mc.CopyOnWrite(3, 3), mc.Clear(4), mc.Clear(4)])
    assert (p.zeroed, p.copied, p.elided) == (1, 0, 2)
    # a write to a slot released in the same step needs no device work.
    p = plan_step([mc.Clear(5), mc.Release(5)])
    assert p.stages == () and p.elided == 1
    # a swap through a spare slot becomes one rotate of two.
    p = plan_step([mc.CopyOnWrite(1, 9), mc.CopyOnWrite(2, 1), mc.CopyOnWrite(9, 2), mc.Release(9)])
    assert p.stages == (RotateStage(((1, 2),)),)


def test_a_hand_off_in_place_is_never_planned() -> None:
    """An export or import in place (no staging host slot) is never queued: planning one is a bug, named."""
    from mambacache._core._events import Export, Import

    for ev, what in ((Export(3, None), "export"), (Import(None, 3), "import")):
        with pytest.raises(TypeError, match=f"an {what} in place is never planned"):
            plan_step([mc.Clear(1), ev])


def test_runs() -> None:
    assert [(r.start, r.length) for r in zero_runs([1, 2, 3, 7, 9, 10])] == [(1, 3), (7, 1), (9, 2)]
    assert zero_runs([]) == ()
    runs = copy_runs([(10, 1), (11, 2), (12, 3), (5, 4), (20, 6)])
    assert [(r.src, r.dst, r.length) for r in runs] == [(10, 1, 3), (5, 4, 1), (20, 6, 1)]


def test_planner_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, importlib.util, types\n"
        "sys.modules['torch'] = None\n"  # any torch import now fails
        "spec = importlib.util.spec_from_file_location('p', 'mambacache/_core/_planner.py')\n"
        "pkg = types.ModuleType('mambacache'); pkg.__path__ = ['mambacache']; sys.modules['mambacache'] = pkg\n"
        "import mambacache._core._planner as p\n"
        "from mambacache._core._events import Clear\n"
        "print(p.plan_step([Clear(1)]).zeroed)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


@given(ops, st.sets(st.integers(1, N)), st.integers(0, 2**40))
def test_plan_wire_format_round_trips(raw: list[tuple[str, int, int]], initially: set[int], step: int) -> None:
    from mambacache._core._planner import decode_plan, encode_plan

    for events, _ in events_from_ops(raw, N, set(initially)):
        plan = plan_step(events)  # type: ignore[arg-type]
        assert decode_plan(encode_plan(plan, step)) == (step, plan)


def test_plan_wire_format_rejects_garbage() -> None:
    import pytest

    from mambacache._core._planner import decode_plan, encode_plan

    good = encode_plan(plan_step([mc.Clear(1), mc.CopyOnWrite(2, 3)]), 5)
    for bad in ([], [1, 2, 3, 4, 5, 6, 7], [*good, 0], [*good[:-1]], [*good[:9], 1, 9, 0]):
        with pytest.raises(ValueError):
            decode_plan(bad)


# -- the host tier with commits, and plans cut into segments ------------------------
UNDEFINED = "undefined"


def sequential_host(events: list[object], pool: dict[int, object], host: dict[int, object]) -> None:
    """One event at a time; a slot allocated without a clear holds nothing defined until written."""
    for ev in events:
        if isinstance(ev, mc.Alloc) and not ev.clear:
            pool[ev.slot] = UNDEFINED
        elif isinstance(ev, mc.Offload):
            host[ev.host] = pool[ev.slot]
        elif isinstance(ev, mc.Restore):
            pool[ev.slot] = host[ev.host]
        else:
            pool.update(sequential([ev], pool))


def agrees(got: object, want: object) -> bool:
    """``got`` is ``want`` where ``want`` is defined: its conv states and its temporal state each."""
    return all(w == UNDEFINED or g == w for g, w in ((conv(got), conv(want)), (temporal(got), temporal(want))))


def run_plan_host(plan: mc.Plan, pool: dict[int, object], host: dict[int, object]) -> None:
    for stage in plan.stages:
        if isinstance(stage, OffloadStage):
            assert [h for _, h in stage.pairs] == sorted({h for _, h in stage.pairs})
            for s, h in reversed(stage.pairs):
                host[h] = pool[s]
        elif isinstance(stage, RestoreStage):
            assert [s for _, s in stage.pairs] == sorted({s for _, s in stage.pairs})
            for h, s in reversed(stage.pairs):
                pool[s] = host[h]
        else:
            pool.update(run_plan(mc.Plan((stage,), 0, 0, 0, 0), pool))


# Long steps, weighted to what pins a slot (a write, then an offload of it) and what rewrites it
# (a release and a new tenant): a flush is rare so the interesting orders fall in one step.
dense_host_ops = st.lists(
    st.tuples(
        st.sampled_from(
            ("alloc", "clear", "cow", "commit", "release", "offload", "restore", "drop", "alloc", "offload", "commit")
            * 4
            + ("flush",)
        ),
        st.integers(0, 10**6),
        st.integers(0, 10**6),
    ),
    min_size=8,
    max_size=60,
)


@given(dense_host_ops, st.sets(st.integers(1, 4)), st.sets(st.integers(1, 3)), st.sampled_from([1, 3]))
def test_plan_with_host_events_and_commits_equals_sequential_execution(
    raw: list[tuple[str, int, int]], initially: set[int], held: set[int], k: int
) -> None:
    """Every event kind mixed: offloads of committed, cleared, copied and restored slots among them.

    Few slots on purpose, so that a slot is offloaded, released and reused, and a host
    slot restored and rewritten, within one step often.
    """
    n, n_host = 4, 3
    for events, live, host_live in host_events_from_ops(raw, n, set(initially), n_host, set(held), draft_tokens=k):
        start_pool: dict[int, object] = {s: ("P", s) for s in range(1, n + 1)}
        start_host: dict[int, object] = {h: ("H", h) for h in range(1, n_host + 1)}
        want_pool, want_host = dict(start_pool), dict(start_host)
        sequential_host(events, want_pool, want_host)
        plan = plan_step(events)  # type: ignore[arg-type]
        got_pool, got_host = dict(start_pool), dict(start_host)
        run_plan_host(plan, got_pool, got_host)
        for s in live:
            assert agrees(got_pool[s], want_pool[s]), (s, events, plan)
        for h in host_live:
            assert agrees(got_host[h], want_host[h]), (h, events, plan)
        assert plan.events == len(events) and plan.elided >= 0
        assert decode_plan(encode_plan(plan, 3)) == (3, plan)


def _commit_and_swap(n: int, realloc: bool = False) -> list[object]:
    """Speculative decoding's step end with preemption by swap, per request: commit, offload, release."""
    events: list[object] = []
    for s in range(1, n + 1):
        events += [mc.CommitDraft(s, 1 + s % 2), mc.Offload(s, s), mc.Release(s)]
        if realloc:  # a new tenant takes the slot in the same step
            events.append(mc.Alloc(s))
    return events


def test_commit_then_swap_is_one_segment() -> None:
    plan = plan_step(_commit_and_swap(5))  # type: ignore[arg-type]
    assert [type(s) for s in plan.stages] == [CommitStage, OffloadStage]
    assert (plan.committed, plan.offloaded, plan.events) == (5, 5, 15)
    assert plan.stages[1].runs == ((1, 1, 5),)  # type: ignore[union-attr]
    # Released after the offload: the commit still lands, since the offload reads it.
    pool = {s: ("P", s) for s in range(1, 6)}
    host: dict[int, object] = {}
    run_plan_host(plan, pool, host)
    assert host == {s: ("draft", s, s % 2) for s in range(1, 6)}


def test_rewriting_a_pinned_slot_cuts_the_log_and_stays_exact() -> None:
    events = _commit_and_swap(4, realloc=True)
    plan = plan_step(events)  # type: ignore[arg-type]
    pool: dict[int, object] = {s: ("P", s) for s in range(1, 5)}
    host: dict[int, object] = {}
    want_pool, want_host = dict(pool), dict(host)
    sequential_host(events, want_pool, want_host)
    run_plan_host(plan, pool, host)
    assert (pool, host) == (want_pool, want_host)
    assert host[3] == ("draft", 3, 1) and pool[3] == "Z"


def test_planning_is_linear_and_iterative() -> None:
    """10,000 requests committed and swapped in one step, also cut at every request: no recursion limit hit.

    (That planning is linear is measured by ``mambacache bench``'s planner rows, not timed here.)
    """
    import sys

    for realloc in (False, True):
        events = _commit_and_swap(10_000, realloc)
        assert len(events) > sys.getrecursionlimit()
        plan = plan_step(events)  # type: ignore[arg-type]
        assert plan.committed == plan.offloaded == 10_000 and plan.events == len(events)
        # The swapped states are the committed ones, slot by slot.
        host: dict[int, object] = {}
        run_plan_host(plan, {s: ("P", s) for s in range(1, 10_001)}, host)
        assert all(host[s] == ("draft", s, s % 2) for s in range(1, 10_001))


# -- shifted copies -------------------------------------------------------------------
@given(shift_ops, st.sets(st.integers(1, N)), st.sampled_from([0, 2]), st.sampled_from([1, 3]))
def test_plan_with_shifts_equals_sequential_execution(
    raw: list[tuple[str, int, int]], initially: set[int], k: int, max_shift: int
) -> None:
    for events, allocated in events_from_ops(raw, N, set(initially), draft_tokens=k, max_shift=max_shift):
        start: dict[int, object] = {s: s for s in range(1, N + 1)}
        plan = plan_step(events)  # type: ignore[arg-type]
        want, got = sequential(events, start), run_plan(plan, start)
        for s in allocated:
            assert got[s] == want[s], (s, events, plan)
        assert plan.events == len(events) and plan.elided >= 0
        assert decode_plan(encode_plan(plan, 7)) == (7, plan)


@given(dense_host_ops, st.sets(st.integers(1, 4)), st.sets(st.integers(1, 3)), st.lists(st.integers(0, 59)))
def test_plan_with_shifts_and_host_events_equals_sequential_execution(
    raw: list[tuple[str, int, int]], initially: set[int], held: set[int], at: list[int]
) -> None:
    """Shifted copies among offloads of pinned slots, restores and commits (draws at ``at`` become shifts)."""
    raw = [("shift", a, b) if i in at else (kind, a, b) for i, (kind, a, b) in enumerate(raw)]
    n, n_host = 4, 3
    for events, live, host_live in host_events_from_ops(raw, n, set(initially), n_host, set(held), 2, max_shift=2):
        want_pool: dict[int, object] = {s: ("P", s) for s in range(1, n + 1)}
        want_host: dict[int, object] = {h: ("H", h) for h in range(1, n_host + 1)}
        got_pool, got_host = dict(want_pool), dict(want_host)
        sequential_host(events, want_pool, want_host)
        plan = plan_step(events)  # type: ignore[arg-type]
        run_plan_host(plan, got_pool, got_host)
        for s in live:
            assert agrees(got_pool[s], want_pool[s]), (s, events, plan)
        for h in host_live:
            assert agrees(got_host[h], want_host[h]), (h, events, plan)
        assert decode_plan(encode_plan(plan, 3)) == (3, plan)


def test_shifted_copies_are_never_batched_with_plain_ones_or_each_other_when_they_touch() -> None:
    cow = mc.CopyOnWrite
    # Plain copies around a shifted one: three stages, in order, each against the state the one before leaves.
    plan = plan_step([cow(1, 2), cow(3, 4, shift=1), cow(5, 6), cow(4, 7)])
    assert [type(s) for s in plan.stages] == [CopyStage, ShiftStage, CopyStage]
    assert plan.stages[1] == ShiftStage(1, ((3, 4),), CopyStage(((3, 4),), copy_runs([(3, 4)])))
    assert plan.stages[2].pairs == ((5, 6), (4, 7))  # type: ignore[union-attr]  # sorted by destination
    # Disjoint shifted copies with one shift, in place too: one stage; a read of a slot written: a new one.
    plan = plan_step([cow(1, 1, shift=2), cow(2, 3, shift=2), cow(3, 4, shift=2), cow(5, 6, shift=1)])
    assert [(s.shift, s.pairs) for s in plan.stages] == [  # type: ignore[union-attr]
        (2, ((1, 1), (2, 3))),
        (2, ((3, 4),)),
        (1, ((5, 6),)),
    ]
    assert plan.copied == 4 and plan.events == 4
    # shift=0 is a plain copy: the log plans exactly as before.
    assert plan_step([cow(1, 2, shift=0), cow(2, 1)]) == plan_step([cow(1, 2), cow(2, 1)])


def test_a_split_copy_reads_its_temporal_state_from_its_own_source_and_crosses_the_wire() -> None:
    cow = mc.CopyOnWrite
    # Speculative decoding's align copies: conv window of s shifted, temporal state of s + k; in place too.
    plan = plan_step([cow(1, 4, shift=1, temporal_src=2), cow(5, 5, shift=1, temporal_src=6), cow(7, 8, shift=1)])
    (stage,) = plan.stages
    whole = ((2, 4), (6, 5), (7, 8))  # each destination's temporal source, the in-place pair's too
    assert stage == ShiftStage(1, ((1, 4), (5, 5), (7, 8)), CopyStage(whole, copy_runs(whole)))
    assert temporal_sources(stage) == [2, 6, 7]  # type: ignore[arg-type]
    assert decode_plan(encode_plan(plan, 3)) == (3, plan)
    # Shift 0 with a temporal source of its own is a segment of its own; one reading a slot the segment wrote
    # (here its temporal source) starts the next; the temporal source equal to the source is a plain copy.
    plan = plan_step([cow(1, 2), cow(3, 4, temporal_src=5), cow(6, 7, temporal_src=4), cow(8, 9, temporal_src=8)])
    assert [(type(s).__name__, getattr(s, "pairs", None)) for s in plan.stages] == [
        ("CopyStage", ((1, 2),)),
        ("ShiftStage", ((3, 4),)),
        ("ShiftStage", ((6, 7), (8, 9))),
    ]
    assert [s.copy.pairs for s in plan.stages[1:]] == [((5, 4),), ((4, 7), (8, 9))]  # type: ignore[union-attr]
    assert plan.copied == 4 and plan.events == 4
    # The wire carries each pair's temporal source: one that differs from the source's changes the message.
    split, plain = plan_step([cow(1, 2, shift=1, temporal_src=3)]), plan_step([cow(1, 2, shift=1)])
    assert encode_plan(split, 0) != encode_plan(plain, 0)
    assert decode_plan(encode_plan(split, 0))[1].stages[0].copy.pairs == ((3, 2),)  # type: ignore[union-attr]


# Plain-step draws: releases, allocs (cleared or not), clears and copies on a few slots, so that
# a log often just misses the fast path's conditions (a chain, a source overwritten by a copy, a
# shifted copy, one event of another kind) as well as meeting them.
_PLAIN_KINDS = ("release", "alloc", "alloc_keep", "clear", "cow", "cow", "cow", "shift", "split", "offload", "commit")
_plain_ops = st.lists(
    st.tuples(st.sampled_from(_PLAIN_KINDS), st.integers(0, 7), st.integers(0, 7), st.integers(0, 30)),
    max_size=14,
)


def _plain_log(raw: list[tuple[str, int, int, int]]) -> list[object]:
    """Any log (not only a valid one: the planner is a pure function of it), mostly plain, rarely otherwise."""
    events: list[object] = []
    for kind, a, b, rare in raw:
        if kind == "release":
            events.append(mc.Release(a))
        elif kind in ("alloc", "alloc_keep"):
            events.append(mc.Alloc(a, None, kind == "alloc"))
        elif kind == "clear":
            events.append(mc.Clear(a))
        elif kind == "cow" or rare > 3:  # the rare kinds below stay rare
            events.append(mc.CopyOnWrite(a, b))
        elif kind == "shift":
            events.append(mc.CopyOnWrite(a, b, shift=1))
        elif kind == "split":
            events.append(mc.CopyOnWrite(a, b, temporal_src=rare % 8))  # shift 0: the source's own slot too
        elif kind == "offload":
            events.append(mc.Offload(a, b + 1))
        else:
            events.append(mc.CommitDraft(a, 1))
    return events


@given(_plain_ops)
def test_plain_fast_path_plans_what_the_general_planner_plans(raw: list[tuple[str, int, int, int]]) -> None:
    log = _plain_log(raw)
    fast = _plain_plan(log)  # type: ignore[arg-type]
    general = _general_plan(log)  # type: ignore[arg-type]
    assert plan_step(log) == general  # type: ignore[arg-type]
    if fast is not None:
        assert fast == general, log
        # and it is sequential execution on every slot the step leaves live (slot 0, the padding, reads as
        # zeros to the planner: those logs are checked against the general planner only)
        last: dict[int, object] = {}
        for e in log:
            if isinstance(e, mc.Release | mc.Alloc):
                last[e.slot] = e
        live = [s for s in range(1, 8) if not isinstance(last.get(s), mc.Release)]
        if not any(0 in (getattr(e, "slot", 1), getattr(e, "src", 1), getattr(e, "dst", 1)) for e in log):
            start: dict[int, object] = {s: s for s in range(1, 8)}
            want, got = sequential(log, start), run_plan(fast, start)
            assert all(got[s] == want[s] for s in live), log


def test_plain_fast_path_takes_the_decode_step_and_declines_the_rest() -> None:
    cow, rel, alloc = mc.CopyOnWrite, mc.Release, mc.Alloc
    decode = [rel(3), rel(4), alloc(3), alloc(4), cow(1, 3), cow(1, 4), mc.Clear(5), mc.Clear(6)]
    fast = _plain_plan(decode)  # type: ignore[arg-type]
    assert fast is not None and fast == _general_plan(decode)  # type: ignore[arg-type]
    assert fast.stages == (CopyStage(((1, 3), (1, 4)), copy_runs(((1, 3), (1, 4)))), ZeroStage((5, 6), ((5, 2),)))
    assert (fast.events, fast.zeroed, fast.copied, fast.elided) == (8, 2, 2, 2)
    declined = [
        [cow(1, 2), cow(2, 3)],  # a chain: 3 reads what the step wrote into 2
        [cow(1, 2), cow(3, 1)],  # a source overwritten by a copy: two waves
        [cow(1, 2), cow(2, 1)],  # a swap: a rotate
        [cow(1, 2, shift=1)],
        [mc.Offload(1, 1)],
        [mc.CommitDraft(1, 1)],
        [mc.Restore(1, 2)],
    ]
    for log in declined:
        assert _plain_plan(log) is None, log  # type: ignore[arg-type]
