"""hand_over: a held slot changes tenant without an event (an engine's cache takes a finished request's slot)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache import tracing

from ..support.util import fill_random, small_spec

N = 5
TENANTS = [None, "a", "b", "tree"]


@settings(max_examples=60)
@given(
    st.lists(st.tuples(st.sampled_from(["alloc", "hand", "release", "clear"]), st.integers(0, 9), st.integers(0, 3)))
)
def test_tenants_follow_a_plain_model_and_a_refused_hand_over_changes_nothing(ops: list[tuple[str, int, int]]) -> None:
    pool = mc.StatePool(small_spec(), N)
    model: dict[int, str | None] = {}  # the obviously-correct reference: held slot -> tenant
    with mc.CacheManager(pool) as mgr:
        for kind, a, t in ops:
            tenant = TENANTS[t]
            slot = 1 + a % N
            before = (mgr.held(), mgr.pending)
            if kind == "alloc" and len(model) < N:
                (s,) = mgr.alloc(1, tenant)
                model[s] = tenant
            elif kind == "hand":
                check = TENANTS[(t + a) % len(TENANTS)]  # sometimes the tenant, sometimes another
                ok = slot in model and (check is None or model[slot] == check)
                if ok:
                    mgr.hand_over(slot, tenant, request_id=check)
                    model[slot] = tenant
                    assert mgr.pending == before[1]  # bookkeeping only: nothing queued
                else:
                    with pytest.raises(mc.SlotStateError):
                        mgr.hand_over(slot, tenant, request_id=check)
                    assert (mgr.held(), mgr.pending) == before
            elif kind == "release" and slot in model:
                # The tenant check of a later event uses the new tenant.
                if model[slot] is not None and model[slot] != "b":
                    with pytest.raises(mc.SlotStateError, match="belongs to"):
                        mgr.release(slot, "b")
                mgr.release(slot, model.pop(slot))
            elif kind == "clear" and slot in model:
                mgr.clear(slot, model[slot])
            assert mgr.held() == dict(sorted(model.items()))
            if a % 4 == 0:
                mgr.flush_nowait()
        if model:
            with pytest.raises(mc.SlotLeakError) as info:
                mgr.check_idle()
            assert info.value.held == dict(sorted(model.items()))
        mgr.release_many(sorted(model))


def test_bad_arguments_raise_typed_errors_and_change_nothing() -> None:
    pool = mc.StatePool(small_spec(), N)
    with mc.CacheManager(pool) as mgr:
        (s,) = mgr.alloc(1, "a")
        for args, error in [
            ((0, "x"), mc.InvalidSlotError),
            ((N + 1, "x"), mc.InvalidSlotError),
            ((True, "x"), mc.InvalidSlotError),
            ((s, 7), mc.InvalidArgumentError),
            ((s + 1, "x"), mc.SlotStateError),
        ]:
            with pytest.raises(error):
                mgr.hand_over(*args)  # type: ignore[arg-type]
            assert mgr.held() == {s: "a"}
        with pytest.raises(mc.SlotStateError, match="belongs to 'a'"):
            mgr.hand_over(s, "tree", request_id="b")
        mgr.release(s)
    with pytest.raises(mc.ManagerClosedError):
        mgr.hand_over(s, "x")


def test_the_trace_and_its_analysis_follow_the_new_tenant(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    pool = mc.StatePool(small_spec(), N)
    fill_random(pool, 0)
    tracing.configure(path, level="debug")
    try:
        with mc.CacheManager(pool) as mgr:
            (s,) = mgr.alloc(1, "req-1")
            mgr.flush_nowait()
            mgr.hand_over(s, "tree", request_id="req-1")
            mgr.flush_nowait()
    finally:
        tracing.disable()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    handovers = [x for x in lines if x["event"] == "slot.handover"]
    assert [(h["slot"], h["request_id"], h["to"]) for h in handovers] == [(s, "req-1", "tree")]
    analysis = tracing.analyze(path, expect_idle=True)
    assert analysis.held == {s: "tree"}
    assert [a.kind for a in analysis.anomalies] == ["held-at-end"] and analysis.anomalies[0].request_id == "tree"
    assert [e.action for e in analysis.timelines[s]] == ["alloc", "handover"]


def test_the_analyzer_flags_a_hand_over_of_a_free_slot() -> None:
    records = [
        {"event": "slot.alloc", "slot": 1, "request_id": "a", "cleared": True, "step": 0},
        {"event": "slot.release", "slot": 1, "request_id": "a", "step": 0},
        {"event": "slot.handover", "slot": 1, "request_id": "a", "to": "tree", "step": 0},
        {"event": "slot.handover", "slot": 1, "request_id": "a", "to": 3, "step": 0},
    ]
    analysis = tracing.analyze_lines([json.dumps(r) for r in records])
    assert [a.kind for a in analysis.anomalies] == ["use-after-release"]
    assert [b.line for b in analysis.bad_lines] == [4]  # 'to' must be a string or null
