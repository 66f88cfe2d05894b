"""`mambacache trace` on bad input: one line, exit 2, never a traceback and never a false "no anomalies"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mambacache as mc
from mambacache._cli import main
from mambacache.tracing import analyze, analyze_lines

from ..support.util import CLEAN, line, small_spec

BAD_LINES: dict[str, bytes] = {
    "missing slot": b'{"event": "slot.clear", "step": 1}',
    "missing src": b'{"event": "slot.cow", "step": 1, "dst": 1}',
    "missing dst": b'{"event": "slot.cow", "step": 1, "src": 1}',
    "negative shift": b'{"event": "slot.cow", "step": 1, "src": 1, "dst": 1, "shift": -1}',
    "string shift": b'{"event": "slot.cow", "step": 1, "src": 1, "dst": 1, "shift": "1"}',
    "null slot": b'{"event": "slot.release", "step": 1, "slot": null}',
    "float slot": b'{"event": "slot.release", "step": 1, "slot": 1.5}',
    "string slot": b'{"event": "slot.release", "step": 1, "slot": "1"}',
    "bool slot": b'{"event": "slot.release", "step": 1, "slot": true}',
    "negative slot": b'{"event": "slot.release", "step": 1, "slot": -3}',
    "NaN slot": b'{"event": "slot.release", "step": 1, "slot": NaN}',
    "Infinity step": b'{"event": "slot.clear", "step": Infinity, "slot": 1}',
    "list slot": b'{"event": "slot.clear", "step": 1, "slot": [1]}',
    "dict slot": b'{"event": "slot.clear", "step": 1, "slot": {"a": 1}}',
    "list request_id": b'{"event": "slot.clear", "step": 1, "slot": 1, "request_id": ["a"]}',
    "string cleared": b'{"event": "slot.alloc", "step": 1, "slot": 1, "cleared": "false"}',
    "huge integer": b'{"event": "slot.clear", "step": 1, "slot": ' + b"9" * 5000 + b"}",
    "deep nesting": b'{"event": "slot.clear", "slot": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "not UTF-8": b'{"event": "slot.clear", "step": 1, "slot": 1, "request_id": "\xff\xfe"}',
    "truncated": b'{"event": "slot.clear", "step": 1, "sl',
    "string flush count": b'{"event": "step.flush", "step": 1, "events": "3"}',
    "unknown event": b'{"event": "slot.teleport", "slot": 1}',
}


def write(tmp_path: Path, name: str, content: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


def clean_bytes() -> bytes:
    return ("\n".join(CLEAN) + "\n").encode()


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_a_malformed_line_is_named_skipped_and_strict_refuses_it(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "t.jsonl", clean_bytes() + BAD_LINES[kind] + b"\n")
    bad_line = len(CLEAN) + 1
    analysis = analyze(path)
    assert [b.line for b in analysis.bad_lines] == [bad_line], analysis.bad_lines
    assert analysis.anomalies == [] and analysis.summary["bad_lines"] == 1
    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"skipped 1 malformed line(s) (--strict refuses them); first: line {bad_line}:" in out
    assert main(["trace", str(path), "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"line {bad_line}" in err and "Traceback" not in err


def test_a_utf8_bom_is_not_a_bad_line(tmp_path: Path) -> None:
    path = write(tmp_path, "bom.jsonl", b"\xef\xbb\xbf" + clean_bytes())
    assert analyze(path).bad_lines == [] and main(["trace", str(path), "--strict"]) == 0


UNUSABLE = {
    "empty": (b"", "empty"),
    "blank lines": (b"\n\n  \n", "not a mambacache trace"),
    "not a trace": (b"hello\nworld\n" + json.dumps({"event": "app.started"}).encode() + b"\n", "not a mambacache"),
    "info level": (
        (json.dumps({"event": "step.flush", "step": 0, "events": 3, "elided": 0}) + "\n").encode() * 3,
        "level='debug'",
    ),
    "only malformed": (BAD_LINES["missing slot"] + b"\n", "malformed"),
    "truncated mid-record": (b'{"event": "slot.alloc", "step": 0, "sl', "malformed"),
}


@pytest.mark.parametrize("kind", list(UNUSABLE))
def test_a_file_without_lifecycle_events_is_exit_2_with_the_reason(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, reason = UNUSABLE[kind]
    path = write(tmp_path, "t.jsonl", content)
    with pytest.raises(mc.TraceError, match=reason):
        analyze(path)
    assert main(["trace", str(path)]) == 2
    captured = capsys.readouterr()
    assert reason in captured.err and captured.err.count("\n") == 1
    assert "no anomalies" not in captured.out


def test_missing_files_and_directories_are_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for target, reason in ((tmp_path / "nope.jsonl", "no such file"), (tmp_path, "is a directory")):
        assert main(["trace", str(target)]) == 2
        err = capsys.readouterr().err
        assert reason in err and err.count("\n") == 1, err


def test_held_slots_are_listed_and_expect_idle_makes_them_anomalies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [*CLEAN, line("slot.alloc", 2, slot=2, request_id="leaky", cleared=True), line("step.flush", 2)]
    path = write(tmp_path, "t.jsonl", ("\n".join(lines) + "\n").encode())
    analysis = analyze(path)
    assert analysis.held == {1: "b", 2: "leaky"} and analysis.anomalies == []
    assert main(["trace", str(path)]) == 0
    assert "held at the end of the trace: 1 ('b'), 2 ('leaky')" in capsys.readouterr().out
    assert main(["trace", str(path), "--expect-idle"]) == 1
    assert "held-at-end" in capsys.readouterr().out
    idle = analyze(path, expect_idle=True)
    assert [(a.kind, a.slot, a.request_id) for a in idle.anomalies] == [
        ("held-at-end", 1, "b"),
        ("held-at-end", 2, "leaky"),
    ]


def test_filters_narrow_the_summary_and_say_when_nothing_matches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [*CLEAN, line("slot.alloc", 2, slot=2, request_id="c", cleared=True), line("slot.clear", 2, slot=2)]
    path = write(tmp_path, "t.jsonl", ("\n".join(lines) + "\n").encode())
    assert main(["trace", str(path), "--request", "c"]) == 0
    out = capsys.readouterr().out
    assert "summary (1 selected slot(s))" in out
    summary = analyze(path).summary_for([2])
    assert (summary["allocs"], summary["clears"], summary["releases"], summary["slots_used"]) == (1, 1, 0, 1)
    for args in (["--slot", "99"], ["--request", "nobody"]):
        assert main(["trace", str(path), *args]) == 2
        assert "no slot in" in capsys.readouterr().err


def test_analyze_is_public_and_analyze_lines_takes_str_or_bytes() -> None:
    assert mc.tracing.analyze is analyze
    a = analyze_lines(CLEAN)
    b = analyze_lines([x.encode() for x in CLEAN])
    assert a.summary == b.summary and a.timelines == b.timelines
    assert a.to_json()["held"] == {"1": "b"}


def test_trace_usage_errors_are_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "t.jsonl", clean_bytes())
    with pytest.raises(SystemExit) as info:  # checked when parsed, as every command's output paths
        main(["trace", str(path), "--json", str(tmp_path / "missing" / "out.json")])
    assert info.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["trace", str(path), "--max-entries", "0"])
    assert info.value.code == 2


def test_expect_idle_reports_host_slots_of_a_swapped_out_request_aborted_without_drop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real trace: request r swapped out (offload, release) and aborted, its host slot never dropped."""
    from mambacache import tracing

    path = tmp_path / "swap.jsonl"
    tracing.configure(str(path), level="debug")
    try:
        with mc.CacheManager(mc.StatePool(small_spec(), 4), host_pool=mc.HostPool(small_spec(), 2)) as mgr:
            (a,) = mgr.alloc(1, request_id="r")
            mgr.flush_nowait()
            h = mgr.offload(a, request_id="r")
            mgr.release(a, request_id="r")
            mgr.flush_nowait()
    finally:
        tracing.disable()
    analysis = analyze(path, expect_idle=True)
    assert analysis.held == {} and analysis.host_held == {h: "r"}
    assert [(a.kind, a.slot, a.request_id) for a in analysis.anomalies] == [("host-held-at-end", a, "r")]
    assert analyze(path).anomalies == [] and analyze(path).to_json()["host_held"] == {str(h): "r"}
    assert main(["trace", str(path)]) == 0
    assert f"host slots held at the end of the trace: {h} ('r')" in capsys.readouterr().out
    assert main(["trace", str(path), "--expect-idle"]) == 1
    assert "host-held-at-end" in capsys.readouterr().out
    # Dropped at the end: idle again.
    with path.open("a") as f:
        f.write(line("host.drop", 3, host=h) + "\n")
    assert analyze(path, expect_idle=True).anomalies == [] and main(["trace", str(path), "--expect-idle"]) == 0


def test_slot_and_request_views_narrow_host_slots_to_the_slots_they_were_offloaded_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Host slot 0 holds r's state from slot 1; host slot 1 held q's from slot 2, was dropped, and now holds
    p's from slot 3: it goes with slot 3 only."""
    lines = [
        line("slot.alloc", 0, slot=1, request_id="r", cleared=True),
        line("slot.alloc", 0, slot=2, request_id="q", cleared=True),
        line("step.flush", 0, events=2, elided=0),
        line("slot.offload", 1, slot=1, host=0, request_id="r"),
        line("slot.release", 1, slot=1, request_id="r"),
        line("slot.offload", 1, slot=2, host=1, request_id="q"),
        line("slot.release", 1, slot=2, request_id="q"),
        line("host.drop", 1, host=1),
        line("step.flush", 1, events=5, elided=0),
        line("slot.alloc", 2, slot=3, request_id="p", cleared=True),
        line("step.flush", 2, events=1, elided=0),
        line("slot.offload", 3, slot=3, host=1, request_id="p"),
        line("slot.release", 3, slot=3, request_id="p"),
        line("step.flush", 3, events=2, elided=0),
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    analysis = analyze(path, expect_idle=True)
    assert analysis.held == {} and analysis.host_held == {0: "r", 1: "p"}
    assert [(a.kind, a.slot, a.request_id) for a in analysis.anomalies] == [
        ("host-held-at-end", 1, "r"),
        ("host-held-at-end", 3, "p"),
    ]
    assert analysis.summary["host_held_at_end"] == 2
    assert [analysis.summary_for([s])["host_held_at_end"] for s in (1, 2, 3)] == [1, 0, 1]

    assert main(["trace", str(path), "--expect-idle", "--json", "-", "--slot", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host_held"] == {} and data["anomalies"] == [] and data["summary"]["host_held_at_end"] == 0
    assert main(["trace", str(path), "--expect-idle", "--json", "-", "--slot", "3"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["host_held"] == {"1": "p"} and data["summary"]["host_held_at_end"] == 1
    assert [(a["kind"], a["slot"], a["request_id"]) for a in data["anomalies"]] == [("host-held-at-end", 3, "p")]
    assert main(["trace", str(path), "--expect-idle", "--json", "-"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["host_held"] == {"0": "r", "1": "p"} and data["summary"]["host_held_at_end"] == 2

    assert main(["trace", str(path), "--expect-idle", "--request", "r"]) == 1
    out = capsys.readouterr().out
    assert "host slots held at the end of the trace: 0 ('r')\n" in out and "'p'" not in out
    assert "host_held_at_end      1" in out and "host-held-at-end: host slot 0 still holds the state 'r'" in out
