"""Lifecycle tracing: event keys, the analyzer, the trace command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

import mambacache as mc
from mambacache import tracing
from mambacache._cli import main
from mambacache.tracing import analyze, analyze_lines

from ..support.util import CLEAN, line, small_spec

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _tracing_off() -> object:
    yield
    tracing.disable()


async def scenario(clear_new: bool = True) -> None:
    pool = mc.StatePool(small_spec(), 6)
    async with mc.CacheManager(pool) as mgr:
        a, b = mgr.alloc(2, "r1")
        await mgr.flush()
        (c,) = mgr.alloc(1, "r2", clear=clear_new)
        mgr.copy_on_write(a, c, "r2")
        mgr.clear(b, "r1")
        mgr.release(a, "r1")
        await mgr.flush()
        mgr.release(b, "r1")
        mgr.release(c, "r2")


async def test_event_keys_through_the_applications_structlog() -> None:
    tracing.configure(level="debug", use_structlog_config=True)
    with capture_logs() as logs:
        await scenario()
    events = [e["event"] for e in logs]
    assert events == [
        "slot.alloc", "slot.alloc", "step.flush",
        "slot.alloc", "slot.cow", "slot.clear", "slot.release", "step.flush",
        "slot.release", "slot.release", "step.flush",
    ]  # fmt: skip
    alloc, cow, clear, release = logs[0], logs[4], logs[5], logs[6]
    assert alloc == {"event": "slot.alloc", "slot": 1, "request_id": "r1", "step": 0, "cleared": True,
                     "log_level": "debug"}  # fmt: skip
    assert cow == {"event": "slot.cow", "src": 1, "dst": 3, "request_id": "r2", "step": 1, "log_level": "debug"}
    assert clear["slot"] == 2 and clear["step"] == 1
    assert release == {"event": "slot.release", "slot": 1, "request_id": "r1", "step": 1, "log_level": "debug"}
    flush = logs[7]
    assert flush["log_level"] == "info" and flush["step"] == 1
    assert (flush["events"], flush["zeroed"], flush["copied"], flush["elided"]) == (4, 1, 1, 1)
    assert flush["bytes_copied"] == small_spec().slot_bytes
    assert {"plan_us", "execute_us"} <= set(flush)


async def test_info_level_traces_only_flushes_and_off_traces_nothing() -> None:
    tracing.configure(level="info", use_structlog_config=True)
    with capture_logs() as logs:
        await scenario()
    assert {e["event"] for e in logs} == {"step.flush"}
    tracing.disable()
    with capture_logs() as logs:
        await scenario()
    assert logs == []


async def test_configure_writes_json_lines_and_leaves_structlog_alone(tmp_path: Path) -> None:
    before = structlog.get_config()
    path = tmp_path / "trace.jsonl"
    tracing.configure(path, level="debug")
    await scenario()
    tracing.disable()
    assert structlog.get_config() == before
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 11
    assert all({"event", "step", "timestamp", "level"} <= set(r) for r in records)
    assert records[0]["timestamp"].endswith("Z")


async def test_analyzer_on_a_clean_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    tracing.configure(path, level="debug")
    await scenario()
    tracing.disable()
    analysis = analyze(path)
    assert analysis.anomalies == []
    s = analysis.summary
    assert (s["steps"], s["allocs"], s["forks"], s["clears"], s["releases"], s["slots_used"]) == (3, 3, 1, 1, 3, 3)
    assert s["clears_elided"] == 1
    assert [e.action for e in analysis.timelines[1]] == ["alloc", "fork-out", "release"]
    assert [e.action for e in analysis.timelines[3]] == ["alloc", "fork-in", "release"]
    assert main(["trace", str(path)]) == 0


BROKEN = {
    "double-release": [*CLEAN, line("slot.release", 2, slot=1), line("slot.release", 2, slot=1)],
    "use-after-release": [*CLEAN, line("slot.release", 2, slot=1), line("slot.clear", 2, slot=1)],
    "copy-from-released": [
        *CLEAN,
        line("slot.alloc", 2, slot=2, cleared=True),
        line("slot.release", 2, slot=1),
        line("slot.cow", 2, src=1, dst=2),
    ],
    "uncleared-reuse": [*CLEAN, line("slot.alloc", 2, slot=2, cleared=False), line("step.flush", 2, events=1)],
    "double-alloc": [*CLEAN, line("slot.alloc", 2, slot=1, request_id="c", cleared=True)],
}


def test_analyzer_clean_hand_trace() -> None:
    assert analyze_lines(CLEAN).anomalies == []
    # A fork into an uncleared slot initialises it: no anomaly.
    forked = [*CLEAN, line("slot.alloc", 2, slot=2, cleared=False), line("slot.cow", 2, src=1, dst=2),
              line("step.flush", 2)]  # fmt: skip
    assert analyze_lines(forked).anomalies == []
    # A shifted fork (speculative decoding's accepted-token bias) is a fork: it initialises its target too.
    shifted = [*forked[:-2], line("slot.cow", 2, src=1, dst=2, shift=2), line("step.flush", 2)]
    analysis = analyze_lines(shifted)
    assert analysis.anomalies == [] and [e.action for e in analysis.timelines[2]] == ["alloc", "fork-in"]


def test_analyzer_reads_a_split_forks_temporal_source_as_a_source() -> None:
    """A fork whose temporal state comes from a second slot reads that slot too: free, it is flagged; never
    cleared, the target holds stale state; clean, the fork is clean and both sources' timelines show it."""
    base = [*CLEAN, line("slot.alloc", 2, slot=2, cleared=False), line("slot.alloc", 2, slot=3, cleared=True)]
    clean = [*base, line("slot.cow", 2, src=1, dst=2, shift=1, temporal_src=3), line("step.flush", 2)]
    analysis = analyze_lines(clean)
    assert analysis.anomalies == []
    assert [e.action for e in analysis.timelines[3]] == ["alloc", "fork-out"]
    stale = [*base, line("slot.alloc", 2, slot=4, cleared=False), line("slot.cow", 2, src=1, dst=2, temporal_src=4),
             line("step.flush", 2, events=1)]  # fmt: skip
    assert {a.kind for a in analyze_lines(stale).anomalies} == {"uncleared-reuse"}
    freed = [*base, line("slot.release", 2, slot=3), line("slot.cow", 2, src=1, dst=2, temporal_src=3)]
    assert [(a.kind, a.slot) for a in analyze_lines(freed).anomalies] == [("copy-from-released", 3)]


async def test_a_split_copy_traces_its_temporal_source() -> None:
    tracing.configure(level="debug", use_structlog_config=True)
    pool = mc.StatePool(small_spec(), 4)
    with capture_logs() as logs:
        async with mc.CacheManager(pool) as mgr:
            a, b, c = mgr.alloc(3, "r")
            mgr.copy_on_write(a, b, "r", shift=1, temporal_src=c)
            mgr.copy_on_write(a, b, "r", temporal_src=a)  # the same slot: a plain copy
            await mgr.flush()
    forks = [{k: e.get(k) for k in ("src", "dst", "shift", "temporal_src")} for e in logs if e["event"] == "slot.cow"]
    assert forks == [
        {"src": a, "dst": b, "shift": 1, "temporal_src": c},
        {"src": a, "dst": b, "shift": None, "temporal_src": None},
    ]
    tracing.disable()


async def test_a_shifted_copy_traces_its_shift_and_a_plain_one_does_not() -> None:
    tracing.configure(level="debug", use_structlog_config=True)
    pool = mc.StatePool(small_spec(), 4)
    with capture_logs() as logs:
        async with mc.CacheManager(pool) as mgr:
            a, b = mgr.alloc(2, "r")
            mgr.copy_on_write(a, b, "r", shift=1)
            mgr.copy_on_write(b, a, "r")
            mgr.copy_many([a], [b], "r", shift=1)
            await mgr.flush()
    forks = [{k: e.get(k) for k in ("src", "dst", "shift")} for e in logs if e["event"] == "slot.cow"]
    assert forks == [
        {"src": a, "dst": b, "shift": 1},
        {"src": b, "dst": a, "shift": None},
        {"src": a, "dst": b, "shift": 1},
    ]
    assert all("shift" not in e for e in logs if e["event"] == "slot.cow" and e["src"] == b)
    tracing.disable()


@pytest.mark.parametrize("kind", list(BROKEN))
def test_analyzer_flags_each_anomaly(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    analysis = analyze_lines(BROKEN[kind])
    assert [a.kind for a in analysis.anomalies] == [kind]
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(["not json", *BROKEN[kind]]) + "\n")
    assert main(["trace", str(path)]) == 1
    assert kind in capsys.readouterr().out


def test_trace_json_filters_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(BROKEN["copy-from-released"]) + "\n")
    assert main(["trace", str(path), "--json", "-", "--slot", "2"]) == 0  # the anomaly is on slot 1
    data = json.loads(capsys.readouterr().out)
    assert list(data["slots"]) == ["2"]
    assert data["anomalies"] == [] and data["summary"]["allocs"] == 1 and data["summary"]["anomalies"] == 0
    assert main(["trace", str(path), "--json", "-", "--request", "b"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert list(data["slots"]) == ["1"] and data["anomalies"][0]["kind"] == "copy-from-released"
    png = tmp_path / "occupancy.png"
    main(["trace", str(path), "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulator_trace_names_the_same_tenant_at_alloc_and_release(tmp_path: Path) -> None:
    path = tmp_path / "sim.jsonl"
    assert main(["simulate", "--model", "toy", "--requests", "30", "--trace", str(path)]) == 0
    analysis = analyze(path)
    assert analysis.anomalies == []
    assert analysis.summary["releases"] > 0
    for entries in analysis.timelines.values():
        tenant = None
        for e in entries:
            if e.action == "alloc":
                tenant = e.request_id
            elif e.action == "release":
                assert e.request_id == tenant
