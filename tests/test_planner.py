"""The planner alone (no torch): plans against symbolic sequential execution."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

import mambacache as mc
from mambacache._planner import CommitStage, CopyStage, RotateStage, ZeroStage, copy_runs, plan_step, zero_runs

from .strategies import events_from_ops, ops

N = 12


def sequential(events: list[object], start: dict[int, object]) -> dict[int, object]:
    state = dict(start)
    for ev in events:
        if isinstance(ev, mc.Clear) or (isinstance(ev, mc.Alloc) and ev.clear):
            state[ev.slot] = "Z"
        elif isinstance(ev, mc.CopyOnWrite):
            state[ev.dst] = state[ev.src]
        elif isinstance(ev, mc.CommitDraft) and ev.accepted:
            state[ev.slot] = ("draft", ev.slot, ev.accepted - 1)  # draft buffers: constant during the step
    return state


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
        "spec = importlib.util.spec_from_file_location('p', 'mambacache/_planner.py')\n"
        "pkg = types.ModuleType('mambacache'); pkg.__path__ = ['mambacache']; sys.modules['mambacache'] = pkg\n"
        "import mambacache._planner as p\n"
        "from mambacache._events import Clear\n"
        "print(p.plan_step([Clear(1)]).zeroed)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


@given(ops, st.sets(st.integers(1, N)), st.integers(0, 2**40))
def test_plan_wire_format_round_trips(raw: list[tuple[str, int, int]], initially: set[int], step: int) -> None:
    from mambacache._planner import decode_plan, encode_plan

    for events, _ in events_from_ops(raw, N, set(initially)):
        plan = plan_step(events)  # type: ignore[arg-type]
        assert decode_plan(encode_plan(plan, step)) == (step, plan)


def test_plan_wire_format_rejects_garbage() -> None:
    import pytest

    from mambacache._planner import decode_plan, encode_plan

    good = encode_plan(plan_step([mc.Clear(1), mc.CopyOnWrite(2, 3)]), 5)
    for bad in ([], [1, 2, 3, 4, 5, 6, 7], [*good, 0], [*good[:-1]], [*good[:9], 1, 9, 0]):
        with pytest.raises(ValueError):
            decode_plan(bad)
