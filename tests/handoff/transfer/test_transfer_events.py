"""Export and Import (issue #20) go through the pure planner as the offload and restore they are staged as.

An export is an offload into a staging host slot (the state as of that point of
the event order leaves); an import is a restore from one that frees it. Their
semantics are the host tier's, property-tested against the oracle there: these
tests pin that the planner gives them exactly the stages of those events, for
any log, and that they are traced under their own names.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache._core._planner import plan_step
from mambacache._core._tracer import _fields

from ...support.strategies import host_events_from_ops, host_ops

pytestmark = pytest.mark.no_transport  # the planner and the trace's lines: no transfer made


def _as_transfer(events: list[object], picks: list[bool]) -> list[object]:
    """Some offloads as exports, some freeing restores as imports (the picks say which)."""
    out: list[object] = []
    for ev, pick in zip(events, picks, strict=False):
        if pick and isinstance(ev, mc.Offload):
            out.append(mc.Export(ev.slot, ev.host, ev.request_id, ev.slot % 3 or None))  # routed or not: same plan
        elif pick and isinstance(ev, mc.Restore) and not ev.keep:
            out.append(mc.Import(ev.host, ev.slot, ev.request_id))
        else:
            out.append(ev)
    return out + list(events[len(picks) :])


@settings(max_examples=300, deadline=None)
@given(raw=host_ops, picks=st.lists(st.booleans(), max_size=80), num_host=st.integers(1, 6))
def test_exports_and_imports_plan_exactly_as_offloads_and_freeing_restores(
    raw: list[tuple[str, int, int]], picks: list[bool], num_host: int
) -> None:
    for events, _live, _held in host_events_from_ops(raw, 6, set(), num_host, set(), draft_tokens=2):
        transfer = _as_transfer(events, picks)
        assert plan_step(transfer) == plan_step(events)  # type: ignore[arg-type]


def test_exports_and_imports_are_traced_under_their_own_names() -> None:
    assert _fields(mc.Export(3, 1, "r")) == ("slot.export", {"slot": 3, "host": 1, "request_id": "r"})
    assert _fields(mc.Import(1, 4, "r")) == ("slot.import", {"host": 1, "slot": 4, "request_id": "r"})


def test_a_routed_exports_trace_line_names_its_destination() -> None:
    assert _fields(mc.Export(3, 1, "r", 2)) == ("slot.export", {"slot": 3, "host": 1, "request_id": "r", "to": 2})


def test_a_send_to_another_rank_than_the_export_was_for_is_flagged_misrouted() -> None:
    from mambacache.tracing import analyze_lines

    from ...support.util import line

    def trace(peer: int, to: int | None) -> list[tuple[str, int | None, str | None]]:
        export = {"slot": 1, "host": 0, "request_id": "a"} | ({} if to is None else {"to": to})
        lines = [
            line("slot.alloc", 0, slot=1, request_id="a", cleared=True),
            line("step.flush", 0, events=1),
            line("slot.export", 1, **export),
            line("step.flush", 1, events=1),
            line("transfer.send", 2, peer=peer, request_ids=["a"], n=1, bytes=64),
            line("host.drop", 2, host=0),
            line("slot.release", 2, slot=1, request_id="a"),
            line("step.flush", 2, events=2),
        ]
        return [(a.kind, a.slot, a.request_id) for a in analyze_lines(lines, expect_idle=True).anomalies]

    assert trace(peer=2, to=2) == [] and trace(peer=2, to=None) == []
    assert trace(peer=1, to=2) == [("export-misrouted", 1, "a")]
