"""The benchmark runs and emits valid JSON (figures are for docs/benchmarks.md, not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mambacache._cli import main


@pytest.mark.slow
def test_bench_quick_emits_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--quick", "--sizes", "1,8", "--repeats", "2", "--json", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "x bound" in text and "host overhead" in text and "tracing off" in text
    data = json.loads(out.read_text())
    assert {"machine", "results", "host_overhead", "tracing_overhead"} <= set(data)
    paths = {(r["op"], r["path"]) for r in data["results"]}
    for op, bound in (("clear", "memset"), ("copy", "memcpy")):
        assert {(op, p) for p in (bound, "seed", "torch", "npu", "reference")} <= paths
    for r in data["results"]:
        assert r["median_s"] > 0 and r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["bytes"] == r["slots"] * data["results"][0]["bytes"] // data["results"][0]["slots"]
        if r["path"] == "npu":
            assert r["noncontiguous_input_bytes"] == 0  # the NPU-relevant figure
        if r["path"] == "seed" and r["op"] == "clear":
            assert r["noncontiguous_input_bytes"] == r["bytes"]  # the expanded zeros, in full
        if r["host_syncs"] is not None:
            assert r["host_syncs"] == 0
    assert [h["events_per_flush"] for h in data["host_overhead"]] == [10, 100, 1000]
