"""The commands at their edges: every bad input is one line and exit 2, before any work; no silent "all clear"."""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mambacache._cli import build_parser, main, subcommands
from mambacache.tracing import analyze

from ..support.util import CLEAN, line

SUBCOMMANDS = sorted(subcommands(build_parser()))
README = Path(__file__).resolve().parents[2] / "README.md"


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
    ("simulate", "--seed", "99999999999999999999999"),  # past torch's int64 seeds: a traceback
    ("simulate", "--threads", "100000"),  # torch.set_num_threads crashed the process
    ("simulate", "--model", "toy", "--json", "same.out", "--trace", "same.out"),  # one overwrote the other
    ("simulate", "--json", "/no/such/folder/out.json"),
    # Unwritable outputs: refused when parsed, not after the simulation (or never, for --trace: a traceback).
    ("simulate", "--trace", "/proc/t.jsonl"),
    ("simulate", "--json", "/proc/r.json"),
    ("simulate", "--json", "/"),
    ("simulate", "--trace", "/no/such/folder/t.jsonl", "--model", "toy", "--model", "mamba2"),
    ("simulate", "--executor", "bogus"),
    ("simulate", "--append"),
    ("simulate", "--bogus"),
    ("simulate", "--scenario", "pd", "--slots", "8"),  # pd sizes its own pools
    ("simulate", "--scenario", "pd", "--fault", "kill-peer", "--requests", "4"),  # one batch: the fault never fires
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
    ("bench", "--json", "/proc/b.json"),
    ("bench", "--plot", "/proc/b.png"),
    ("bench", "--quick", "--json", "/"),
    ("bench", "--transfer", "--tp", "2"),
    # A plot matplotlib cannot write, refused before the bench or the trace's analysis runs.
    ("bench", "--quick", "--plot", "b.txt"),
    ("simulate", "--json", "/etc/passwd/x.json"),  # a path under a file
    ("bench", "--quick", "--json", "same.png", "--plot", "same.png"),  # the plot replaced the JSON, exit 0
    ("trace",),
    ("trace", "/no/such/file.jsonl"),
    ("nope",),
]


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command's work (the simulations, the bench's rows, a pd run) fails the test if it starts: a bad input
    must be refused before any of it. Reading the trace is ``trace``'s check of its input, so it stays."""
    from mambacache.bench import _cli as bench_cli
    from mambacache.bench import _layers
    from mambacache.sim import _cli as sim_cli
    from mambacache.sim import _pd

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the work started before the input was refused")

    for module, name in [(sim_cli, "_simulate_all"), (_pd, "simulate_pd"), (bench_cli, "run_preset"),
                         (bench_cli, "run_transfer"), (bench_cli, "run_contended"), (_layers, "run")]:  # fmt: skip
        monkeypatch.setattr(module, name, started)


def exit_code(args: list[str]) -> int:
    """``main``'s exit code, argparse's SystemExit included."""
    try:
        return main(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)


@pytest.mark.parametrize("args", BAD, ids=" ".join)
def test_bad_input_is_one_line_and_exit_2_at_once(
    args: tuple[str, ...], no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    if args == ("bench", "--device", "cuda"):
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    code = exit_code(list(args))
    captured = capsys.readouterr()
    assert code == 2, (captured.out, captured.err)
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert captured.out == ""
    # The subcommand's own name, whoever reports it (argparse, the command's checks).
    assert captured.err.startswith(f"mambacache {args[0]}:" if args[0] in SUBCOMMANDS else "mambacache:"), captured.err


@pytest.mark.parametrize("command", ["", *SUBCOMMANDS])
def test_every_help_exits_0(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"] if command else ["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mambacache") and f"mambacache {command}".rstrip() in out


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_a_usage_error_names_a_help_that_works(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--no-such-option"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mambacache {command}: error: ") and err.count("\n") == 1, err
    hint = re.search(r"\(see mambacache (\S+) --help\)$", err.strip())
    assert hint is not None and hint.group(1) == command, err
    with pytest.raises(SystemExit) as exit_:
        main([hint.group(1), "--help"])
    assert exit_.value.code == 0


def _trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(CLEAN) + "\n")
    return path


@pytest.mark.parametrize(
    "bad",
    [
        ("--json", "/proc/a.json"),
        ("--plot", "/proc/occ.png"),
        ("--json", "{tmp}"),
        ("--plot", "{tmp}/no/o.png"),
        ("--plot", "{tmp}/x.txt"),  # matplotlib writes no .txt
    ],
)
def test_trace_refuses_an_unwritable_output_before_reading_the_trace(
    bad: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mambacache.tracing import _report

    def no_analysis(*args: object, **kwargs: object) -> None:
        raise AssertionError("the trace was read before the output path was checked")

    monkeypatch.setattr(_report, "analyze", no_analysis)
    flag, path = bad[0], bad[1].format(tmp=tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["trace", str(_trace_file(tmp_path)), flag, path])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mambacache trace: error: argument {flag}:") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == [tmp_path / "t.jsonl"]


@pytest.mark.parametrize("outputs", [["--json", "{trace}"], ["--json", "{o}", "--plot", "{o}"]])
def test_trace_refuses_outputs_naming_one_file(
    outputs: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An output over the trace it reads, or two outputs on one file: one line, exit 2, every file as it was."""
    trace = _trace_file(tmp_path)
    before = trace.read_bytes()
    args = [a.format(trace=trace, o=tmp_path / "o.png") for a in outputs]
    assert exit_code(["trace", str(trace), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mambacache trace:") and "name one file" in err and err.count("\n") == 1, err
    assert trace.read_bytes() == before and list(tmp_path.iterdir()) == [trace]


def test_an_output_check_leaves_no_file_behind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a.json"
    with pytest.raises(SystemExit):  # the check passes, then the missing trace is the error
        main(["trace", str(tmp_path / "missing.jsonl"), "--json", str(out), "--bogus"])
    assert not out.exists()
    existing = tmp_path / "b.json"
    existing.write_text("kept")
    assert main(["trace", str(_trace_file(tmp_path)), "--json", str(existing)]) == 0
    assert json.loads(existing.read_text())["summary"]["allocs"] == 2
    capsys.readouterr()


def test_trace_plot_draws_only_the_selected_slots_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from mambacache.tracing import _report

    lines = [line("slot.alloc", 0, slot=s, request_id=f"r{s}", cleared=True) for s in (1, 2, 3, 4)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([*lines, line("step.flush", 0, events=4, elided=0)]) + "\n")
    drawn: list[list[int]] = []
    real_plot = _report.plot

    def spy(analysis: object, out: str, slots: list[int] | None = None) -> None:
        drawn.append(sorted(analysis.timelines if slots is None else slots))  # type: ignore[attr-defined]
        real_plot(analysis, out, slots)  # type: ignore[arg-type]

    monkeypatch.setattr(_report, "plot", spy)
    png = tmp_path / "occ.png"
    assert main(["trace", str(path), "--plot", str(png), "--slot", "3"]) == 0
    assert drawn == [[3]] and png.read_bytes()[:4] == b"\x89PNG"
    assert f"occupancy plot of 1 slot(s): {png}" in capsys.readouterr().out
    assert main(["trace", str(path), "--plot", str(png), "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert drawn[-1] == [1, 2, 3, 4] and json.loads(captured.out)["summary"]["allocs"] == 4
    assert f"occupancy plot of 4 slot(s): {png}" in captured.err


def test_no_tenant_bar_has_the_anomaly_colour(monkeypatch: pytest.MonkeyPatch) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.colors as mcolors

    from mambacache.tracing import analyze_lines
    from mambacache.tracing._report import ANOMALY_COLOUR, plot

    # Old code coloured tenants by first appearance from tab20: the 7th (index 6) was red, as anomalies are.
    # Here the prefix cache's checkpoints come 7th, among 40 tenants (the palette wraps round).
    tenants = [f"r{i}" for i in range(6)] + ["prefix-cache"] + [f"r{i}" for i in range(6, 40)]
    lines = [line("slot.alloc", 0, slot=i + 1, request_id=t, cleared=True) for i, t in enumerate(tenants)]
    analysis = analyze_lines([*lines, line("step.flush", 0, events=len(lines), elided=0)], expect_idle=False)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: list[object] = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its bars
    plot(analysis, str(Path("/dev/null")))
    fig = figures[0]
    bars = [tuple(c) for coll in fig.axes[0].collections for c in coll.get_facecolors()]  # type: ignore[attr-defined]
    assert len(bars) == len(tenants)
    anomaly = mcolors.to_rgba(ANOMALY_COLOUR)
    for r, g, b, a in bars:
        assert (r, g, b, a) != anomaly and not (r > 0.8 and g < 0.7 and abs(g - b) < 0.1), (r, g, b)  # no red
    monkeypatch.undo()
    plt.close(fig)  # type: ignore[arg-type]


def test_readme_commands_table_names_every_option_and_choice() -> None:
    """Every option (and each choice of a choices option) of every subcommand, read from the parsers, is in the
    README's commands table row of that subcommand: a new option without a README entry fails here."""
    rows = {}
    for text in README.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| `mambacache (\w+)(.*?)` \|", text)
        if m:
            rows[m.group(1)] = m.group(2).replace("\\|", "|")
    missing: list[str] = []
    for name, parser in subcommands(build_parser()).items():
        row = rows.get(name)
        if row is None:
            missing.append(f"no row for `mambacache {name}`")
            continue
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if not action.option_strings:  # a positional: its metavar
                word = str(action.metavar or action.dest.upper())
                if not re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", row):
                    missing.append(f"mambacache {name} {word}")
                continue
            flag = max(action.option_strings, key=len)
            m = re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])( [^\s\]]+)?", row)
            if m is None:
                missing.append(f"mambacache {name} {flag}")
                continue
            if action.choices is not None:
                listed = set((m.group(1) or "").strip().split("|"))
                lacking = [str(c) for c in action.choices if str(c) not in listed]
                if lacking:
                    missing.append(f"mambacache {name} {flag} {'|'.join(lacking)}")
    assert not missing, "README.md's commands table lacks: " + "; ".join(missing)


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


@pytest.mark.parametrize(
    "args", [["--version"], ["--help"], ["simulate", "--help"], ["trace", "--help"], ["trace", "{trace}"]]
)
def test_version_help_and_trace_import_no_torch(args: list[str], tmp_path: Path) -> None:
    args = [a.format(trace=_trace_file(tmp_path)) for a in args]
    code = (
        "import sys\nfrom mambacache._cli import main\n"
        f"try:\n    code = main({args!r})\nexcept SystemExit as exit_:\n    code = exit_.code\n"
        "assert code == 0, code\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0 and run.stdout.startswith(("mambacache ", "usage: mambacache", "slot 1")), run


def _started(proc: subprocess.Popen[str], module: str) -> list[str]:
    """``-X importtime`` lines the child wrote on stderr up to and including ``module``'s import."""
    assert proc.stderr is not None
    seen: list[str] = []
    for text in proc.stderr:
        seen.append(text)
        if text.rstrip().endswith(f"| {module}") or text.rstrip().endswith(f"|   {module}"):
            return seen
    raise AssertionError(f"{module} never imported: {seen[-5:]}")


def _console_script() -> list[str]:
    """The ``mambacache`` command as pyproject.toml's [project.scripts] names it, run by this Python."""
    text = (README.parent / "pyproject.toml").read_text(encoding="utf-8")
    target = re.search(r'^mambacache = "([\w.]+):(\w+)"$', text, re.MULTILINE)
    assert target is not None
    module, function = target.groups()
    return ["-c", f"import sys; from {module} import {function}; sys.argv[0] = 'mambacache'; sys.exit({function}())"]


@pytest.mark.parametrize("entry", ["python -m", "script"])
@pytest.mark.parametrize("args", [("simulate", "--model", "toy", "--requests", "200"), ("bench", "--quick")])
def test_an_interrupt_during_start_up_is_one_line_and_exit_130(entry: str, args: tuple[str, ...]) -> None:
    """SIGINT as the command starts (its module just imported, torch not yet): one line, 130, whichever moment
    of the start-up it lands in."""
    how = ["-m", "mambacache"] if entry == "python -m" else _console_script()
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", *how, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _started(proc, "mambacache._cli")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    said = [t for t in err.splitlines() if not t.startswith("import time:")]
    assert proc.returncode == 130 and said == ["mambacache: interrupted"], (proc.returncode, said[-10:])
    assert out == ""


def test_a_path_under_a_file_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace_file(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["trace", str(trace), "--json", str(trace / "x.json")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{trace} is a file, not a folder" in err, err


def test_a_plot_name_without_extension_is_the_png_written_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    trace = _trace_file(tmp_path)
    assert main(["trace", str(trace), "--plot", str(tmp_path / "noext")]) == 0
    assert (tmp_path / "noext.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "noext").exists()
    assert f"occupancy plot of 1 slot(s): {tmp_path / 'noext.png'}\n" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["trace", "{trace}"], ["simulate", "--model", "toy", "--requests", "2"]])
def test_a_report_on_a_full_disk_is_one_line_and_exit_1(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    args = [a.format(trace=_trace_file(tmp_path)) for a in command]
    assert main([*args, "--json", "/dev/full"]) == 1
    captured = capsys.readouterr()
    said = [t for t in captured.err.splitlines() if not t.startswith(f"{args[0]}: ")]  # progress lines aside
    assert said == [f"mambacache {args[0]}: cannot write /dev/full: No space left on device"], captured.err
    assert captured.out  # the work ran and was shown: only the report is missing


def test_a_trace_on_a_full_disk_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    args = ["simulate", "--model", "toy", "--requests", "2", "--trace", "/dev/full", "--append"]
    assert main(args) == 1
    err = capsys.readouterr().err
    said = [t for t in err.splitlines() if not t.startswith("simulate: ")]  # progress lines aside
    assert said == ["mambacache simulate: cannot write /dev/full: No space left on device"], err
    assert not list(Path("/dev").glob(".full.*.partial"))


def test_bench_says_where_it_wrote_its_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "layers.json"
    assert main(["bench", "--layers", "--quick", "--repeats", "1", "--json", str(out)]) == 0
    assert f"JSON: {out}\n" in capsys.readouterr().out and json.loads(out.read_text())["layer_overhead"]


@pytest.mark.parametrize("append", [False, True])
def test_an_interrupted_simulate_leaves_the_traces_as_they_were(
    append: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mambacache._console import Progress

    toy = tmp_path / "sim.toy.jsonl"
    before = "\n".join(CLEAN) + "\n"
    if append:
        toy.write_text(before)
    real_advance = Progress.advance

    def interrupt_on_the_sixth(self: Progress, n: int = 1, note: str = "") -> None:
        real_advance(self, n, note)
        if self.done == 6:  # toy's four requests done, mamba2's second
            raise KeyboardInterrupt

    monkeypatch.setattr(Progress, "advance", interrupt_on_the_sixth)
    args = [
        "simulate",
        "--model",
        "toy",
        "--model",
        "mamba2",
        "--requests",
        "4",
        "--trace",
        str(tmp_path / "sim.jsonl"),
    ]
    args += ["--append"] if append else []
    assert main(args) == 130
    assert capsys.readouterr().err.endswith("mambacache: interrupted\n")
    assert [p.name for p in tmp_path.iterdir()] == (["sim.toy.jsonl"] if append else [])  # nothing half-written
    assert not append or toy.read_text() == before
    monkeypatch.undo()
    assert main(args) == 0  # the rerun is not refused
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sim.mamba2.jsonl", "sim.toy.jsonl"]
    assert toy.read_text().startswith(before) == append
    assert analyze(tmp_path / "sim.mamba2.jsonl", expect_idle=False).anomalies == []


class _Clock:
    """time.perf_counter for _console, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_off_a_terminal_is_a_line_every_few_seconds_with_the_time_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io

    from mambacache import _console

    clock = _Clock()
    monkeypatch.setattr(_console.time, "perf_counter", clock)
    stream = io.StringIO()
    with _console.Progress(10, "simulate", stream=stream, every=5.0) as progress:
        for i in range(10):
            clock.now += 1.5
            progress.advance(1, "toy: running" if i < 5 else "toy: verifying")
    lines = stream.getvalue().splitlines()
    # A line once 5 s have passed since the last (at 6 s and 12 s), and the end's.
    assert lines == [
        "simulate: 4/10   6.0s, about 9s left toy: running",
        "simulate: 8/10  12.0s, about 3s left toy: verifying",
        "simulate: 10/10  15.0s toy: verifying",
    ]


def test_progress_on_a_terminal_shows_the_phase_and_the_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from mambacache import _console

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    clock = _Clock()
    monkeypatch.setattr(_console.time, "perf_counter", clock)
    stream = Terminal()
    with _console.Progress(4, "simulate", stream=stream) as progress:
        clock.now += 2.0
        progress.advance(1, "toy: running")
        clock.now += 2.0
        progress.advance(1, "toy: verifying")
    frames = stream.getvalue().split("\r")
    assert "2/4   4.0s, about 4s left toy: verifying" in frames[-1] and stream.getvalue().endswith("\n")


def test_simulate_off_a_terminal_reports_the_run_and_the_verification(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "toy", "--requests", "3"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("simulate: ") and err.endswith(" toy: verifying\n") and "6/6" in err, err


def test_every_option_has_help() -> None:
    bare = [
        f"mambacache {name} {max(a.option_strings, key=len)}"
        for name, parser in subcommands(build_parser()).items()
        for a in parser._actions
        if a.option_strings and not a.help
    ]
    assert not bare, bare


def test_simulate_slots_help_gives_each_scenarios_own() -> None:
    from mambacache.sim._scheduler import SCENARIOS

    parser = subcommands(build_parser())["simulate"]
    text = next(a.help for a in parser._actions if "--slots" in a.option_strings)
    assert text is not None
    for name, fields in SCENARIOS.items():
        if "slots" in fields:
            assert f"{name} {fields['slots']}" in text, (name, text)


def test_max_running_beyond_the_scenarios_slots_names_the_scenario_not_slots_never_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mambacache.sim._scheduler import SCENARIOS

    slots = SCENARIOS["prefix"]["slots"]
    assert main(["simulate", "--max-running", str(slots)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"mambacache simulate: --scenario prefix has {slots} slots, too few for --max-running {slots} without"
        f" --preempt (at least max-running + max(1, reserved) = {slots + 1}): give --slots {slots + 1} or more\n"
    )


def test_a_ratio_to_an_unsteady_baseline_is_flagged_not_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A memset timed through a neighbour's load (its rounds 1 ms and 100 ms by turns) makes a 'ratio' of many
    times the bound: the row says '?', the table says why, and the plot draws no point for it."""
    matplotlib = pytest.importorskip("matplotlib")
    import torch

    from mambacache.bench import _cli as bench_cli
    from mambacache.bench import _run

    def memset() -> None: ...

    def path() -> None: ...

    rounds = {memset: iter([1e-3, 0.1] * 200), path: iter([1e-3] * 400)}  # memset: 1 ms and 100 ms by turns

    def fake_time(fn: object, device: object) -> float:
        return next(rounds[fn])  # type: ignore[index]

    monkeypatch.setattr(_run, "_time_once", fake_time)
    timings = _run.measure({"memset": memset, "torch": path}, torch.device("cpu"), 6, warmup=0)
    assert timings["memset"][3] > _run.BOUND_SPREAD and timings["torch"][3] <= _run.BOUND_SPREAD
    fields = dict(preset="small", layers=8, op="clear", min_s=1e-3, max_s=1e-3, bytes=1, gb_s=1.0, vs_sglang=1.0)
    steady = _run.Result(slots=1, path="torch", median_s=1e-3, vs_bound=0.9, **fields)  # type: ignore[arg-type]
    unsteady = _run.Result(slots=8, path="torch", median_s=1e-3, vs_bound=225.0, bound_spread=3.0, **fields)  # type: ignore[arg-type]
    assert steady.bound_steady and not unsteady.bound_steady and unsteady.to_json()["bound_steady"] is False
    text = bench_cli.render([steady, unsteady])
    assert " 225.00? " in text and " 0.90 " in text and text.endswith(bench_cli.UNSTEADY_NOTE)
    assert "?" not in bench_cli.render([steady])
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: list[object] = []
    monkeypatch.setattr(plt, "close", figures.append)
    bench_cli.plot([steady, unsteady], "/dev/null.png")
    ax = figures[0].axes[0]  # type: ignore[attr-defined]
    drawn = [tuple(x) for line_ in ax.get_lines() for x in line_.get_xydata() if line_.get_label() == "torch"]
    assert drawn == [(1.0, 0.9)]  # the 225x is no point on the line
    assert any(c.get_label() == "baseline unsteady: no ratio" for c in ax.collections)
    bench_cli.plot([unsteady], "/dev/null.png")  # every figure of the run flagged: the plot is only flags
    labels = [line_.get_label() for line_ in figures[1].axes[0].get_lines()]  # type: ignore[attr-defined]
    assert all(label.startswith("_") for label in labels)  # the bound's line alone, no path's
    monkeypatch.undo()
    plt.close("all")


def _drawn(monkeypatch: pytest.MonkeyPatch, lines: list[str], slots: list[int] | None = None) -> object:
    """The occupancy figure of ``lines`` (kept from plt.close to be read; the caller closes it)."""
    matplotlib = pytest.importorskip("matplotlib")
    from mambacache.tracing import analyze_lines
    from mambacache.tracing._report import plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: list[object] = []
    with monkeypatch.context() as m:
        m.setattr(plt, "close", figures.append)
        plot(analyze_lines(lines, expect_idle=False), "/dev/null.png", slots)
    return figures[0]


def _bar_colours(fig: object) -> dict[tuple[int, float], tuple[float, ...]]:
    """Each bar's face colour by (row, start step)."""
    out = {}
    for coll in fig.axes[0].collections:  # type: ignore[attr-defined]
        (x, _), y = coll.get_paths()[0].vertices[0], coll.get_paths()[0].vertices[:, 1].min()
        out[(round(y + 0.4), float(x))] = tuple(coll.get_facecolors()[0])
    return out


def test_the_occupancy_plot_colours_a_request_alike_everywhere_and_splits_checkpoints(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import matplotlib.pyplot as plt

    lines = [
        line("slot.alloc", 0, slot=1, request_id="other", cleared=True),
        line("slot.alloc", 0, slot=2, request_id="r9", cleared=True),
        line("slot.release", 2, slot=2, request_id="r9"),
        line("slot.alloc", 3, slot=3, request_id="r9", cleared=True),  # the same request, another slot
        line("slot.alloc", 0, slot=4, request_id="prefix-cache", cleared=True),
        line("slot.release", 2, slot=4, request_id="prefix-cache"),
        line("slot.alloc", 2, slot=4, request_id="prefix-cache", cleared=True),  # a second checkpoint, at once
        line("step.flush", 3, events=7, elided=0),
    ]
    everything = _drawn(monkeypatch, lines)
    bars = _bar_colours(everything)
    assert bars[(1, 0.0)] == bars[(2, 3.0)]  # r9 in slots 2 and 3 (rows 1, 2)
    assert bars[(3, 0.0)] != bars[(3, 2.0)]  # two checkpoints back to back are two bars that read as two
    alone = _bar_colours(_drawn(monkeypatch, lines, slots=[3]))
    assert alone[(0, 3.0)] == bars[(2, 3.0)]  # r9's colour does not depend on what else is drawn
    texts = [t.get_text() for t in everything.axes[0].texts]  # type: ignore[attr-defined]
    assert "r9" in texts and "other" in texts
    plt.close("all")


def test_the_occupancy_legend_lists_what_was_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.pyplot as plt

    forked = [
        line("slot.alloc", 0, slot=1, request_id="prefix-cache", cleared=True),
        line("slot.alloc", 0, slot=2, request_id="a", cleared=True),
        line("slot.cow", 1, src=1, dst=2, request_id="a"),
        line("step.flush", 1, events=3, elided=0),
    ]
    fig = _drawn(monkeypatch, forked)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]  # type: ignore[attr-defined]
    assert legend == [
        "prefix-cache checkpoint",
        "request: a colour per request id, named on its bar",
        "state forked in (copy-on-write)",
    ]
    assert "x" not in fig.axes[0].get_title().split()  # type: ignore[attr-defined]  # no clear mark it cannot draw
    cleared = [*forked[:3], line("slot.clear", 1, slot=2, request_id="a"), forked[3]]
    fig = _drawn(monkeypatch, cleared)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]  # type: ignore[attr-defined]
    assert any(text.startswith("cleared") for text in legend)
    plt.close("all")


def test_bench_sizes_past_any_pool_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """The first preset's pool for the largest size cannot be made: one line naming --sizes, no traceback."""
    assert exit_code(["bench", "--quick", "--sizes", "99999999999999999999"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("mambacache bench: --sizes 99999999999999999999:"), err
    assert not any("Traceback" in e for e in err)
