"""The commands at their edges: every bad input is one line and exit 2, before any work; no silent "all clear"."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mambacache._cli import main
from mambacache.tracing import analyze


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mambacache", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


BAD = [
    ("simulate", "--max-running", "0"),
    ("simulate", "--arrival-rate", "0"),
    ("simulate", "--arrival-rate", "nan"),
    ("simulate", "--requests", "-3"),
    ("simulate", "--prefix-share", "1.5"),
    ("simulate", "--prefix-share", "-1"),
    ("simulate", "--slots", "3", "--max-running", "3"),
    ("simulate", "--scenario", "bogus"),
    ("simulate", "--fault", "skip-restore"),  # needs --scenario swap
    ("simulate", "--block-size", "0"),
    ("simulate", "--max-checkpoints", "-1"),
    ("simulate", "--preempt", "later"),
    ("simulate", "--seed", "x"),
    ("simulate", "--json", "/no/such/folder/out.json"),
    ("bench", "--device", "cuda"),
    ("bench", "--device", "npu"),
    ("bench", "--device", "foo"),
    ("bench", "--sizes", "1,x"),
    ("bench", "--sizes", "0"),
    ("bench", "--executor", "foo"),
    ("bench", "--slots", "1"),
    ("bench", "--repeats", "0"),
    ("bench", "--budget-gb", "-1"),
    ("bench", "--json", "/no/such/folder/out.json"),
    ("bench", "--plot", "/no/such/folder/out.png"),
    ("bench", "--transfer", "--tp", "2"),
    ("trace",),
    ("trace", "/no/such/file.jsonl"),
    ("nope",),
]


@pytest.mark.parametrize("args", BAD, ids=" ".join)
def test_bad_input_is_one_line_and_exit_2_at_once(args: tuple[str, ...]) -> None:
    if args == ("bench", "--device", "cuda"):
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    t0 = time.monotonic()
    run = run_cli(*args)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stdout == ""
    assert time.monotonic() - t0 < 30  # refused before any work


def test_python_dash_m_runs_the_cli() -> None:
    run = run_cli("--version")
    assert run.returncode == 0 and run.stdout.startswith("mambacache ")


def test_simulate_trace_refuses_an_existing_file_unless_appending(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sim.jsonl"
    args = ["simulate", "--model", "toy", "--requests", "6", "--trace", str(path)]
    assert main(args) == 0
    assert f"trace of toy: {path}" in capsys.readouterr().out
    first = path.read_text()
    assert main(args) == 2
    assert "exists" in capsys.readouterr().err and path.read_text() == first
    assert main([*args, "--append"]) == 0
    assert path.read_text().startswith(first) and len(path.read_text()) > len(first)


def test_simulate_with_several_models_names_each_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "t.jsonl"
    assert main(["simulate", "--model", "toy", "--model", "mamba2", "--requests", "4", "--trace", str(base)]) == 0
    out = capsys.readouterr().out
    for model in ("toy", "mamba2"):
        path = tmp_path / f"t.{model}.jsonl"
        assert f"trace of {model}: {path}" in out
        assert analyze(path, expect_idle=False).anomalies == []


def test_simulate_no_verify_does_not_claim_zero_mismatches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "r.json"
    assert main(["simulate", "--model", "toy", "--requests", "6", "--no-verify", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "verification was off" in out
    row = next(line for line in out.splitlines() if line.startswith("toy"))
    assert row.split()[2] == "-"
    assert json.loads(out_json.read_text())[0]["verified"] is False


@pytest.mark.slow
def test_bench_reports_progress_off_a_terminal() -> None:
    run = run_cli("bench", "--quick", "--sizes", "1", "--repeats", "1", timeout=300)
    assert run.returncode == 0, run.stderr
    assert "bench: small done" in run.stderr
