"""The plugin inside vLLM's CPU build: outputs with it equal outputs without it and transformers'.

Needs vLLM (``.ci/run`` makes a venv with ``mambacache[vllm]`` and runs this file
there). Elsewhere it is skipped, unless ``MAMBACACHE_REQUIRE_VLLM=1`` (set by
``.ci/run``) makes a missing vLLM a failure. Each case runs
``examples/vllm_plugin.py``: vLLM without and with the plugin in subprocesses,
and transformers' greedy ``generate``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import mambacache as mc
from mambacache.integrations.vllm import CACHED

from ..support.engine_faults.mambacache_test_faults import subprocess_env

ROOT = Path(__file__).parents[2]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

if not HAVE_VLLM and os.environ.get("MAMBACACHE_REQUIRE_VLLM") != "1":
    pytest.skip("vLLM is not installed (run through .ci/run, or set up .venv-vllm)", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert HAVE_VLLM, "MAMBACACHE_REQUIRE_VLLM=1 but vLLM is not importable"
    return tmp_path_factory.mktemp("model") / "mamba2-tiny"


def example(model_dir: Path, *args: str, script: str = "vllm_plugin.py", fault: str | None = None) -> dict[str, Any]:
    """An example's ``--json`` result (with its exit status), run on the tiny model in ``model_dir``; ``fault``:
    one of tests/support/engine_faults' faults, injected into every process of the run."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--json", "--model-dir", str(model_dir), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=None if fault is None else subprocess_env(fault),
    )
    assert done.returncode in (0, 1) and done.stdout.strip(), done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["returncode"] = done.returncode
    return result


def test_plugin_outputs_equal_vllm_and_transformers_with_blocks_reused(model_dir: Path, tmp_path: Path) -> None:
    trace = tmp_path / "vllm.jsonl"
    r = example(model_dir, "--requests", "12", "--blocks", "6", "--trace", str(trace))
    assert r["returncode"] == 0 and r["all_agree"], r
    assert r["plugin"]["allocs"] == 12 and r["plugin"]["clears"] == 12 and r["plugin"]["releases"] == 12
    analysis = mc.tracing.analyze(trace, expect_idle=True)
    assert analysis.anomalies == [] and analysis.bad_lines == []
    s = analysis.summary
    assert s["allocs"] == s["releases"] == 12 and s["allocs_uncleared"] == 0 and s["requests"] == 12
    assert s["slots_used"] < 12  # more requests than blocks: blocks were reused
    assert subprocess.run([sys.executable, "-m", "mambacache", "trace", str(trace), "--expect-idle"]).returncode == 0


def test_the_engine_serves_on_after_the_plugin_is_closed(model_dir: Path) -> None:
    # #32.7: the steps after mambacache_close ran into the closed managers (ManagerClosedError in _update_states).
    r = example(model_dir, "--requests", "8", "--blocks", "6", "--close-midway")
    assert r["returncode"] == 0 and r["all_agree"], r
    assert r["plugin"]["allocs"] == 4  # the first half went through the plugin, the rest did not


def test_chunked_prefill(model_dir: Path) -> None:
    r = example(model_dir, "--requests", "8", "--chunked")
    assert r["returncode"] == 0 and r["all_agree"], r


def test_without_vllms_masking_only_the_plugins_clears_keep_outputs_right(model_dir: Path) -> None:
    r = example(model_dir, "--requests", "8", "--unmask")
    assert r["returncode"] == 0 and r["plugin_matches_transformers"] == 8, r
    assert r["vllm_matches_transformers"] < 8  # vLLM alone reads the stale blocks
    bad = example(model_dir, "--requests", "8", "--unmask", fault="vllm-skip-clear")
    assert bad["returncode"] == 1 and bad["plugin_matches_transformers"] < 8, bad  # the test can fail


def prefix_example(model_dir: Path, *args: str, fault: str | None = None) -> dict[str, Any]:
    return example(model_dir, *args, script="vllm_prefix_cpu.py", fault=fault)


def test_align_mode_prefix_caching_fails_alone_on_cpu_and_is_token_exact_with_the_plugin(
    model_dir: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "prefix.jsonl"
    r = prefix_example(
        model_dir, "--modes", "off,align,plugin", "--systems", "4", "--per-system", "3", "--blocks", "16",
        "--trace", str(trace),
    )  # fmt: skip
    runs = r["runs"]
    assert runs["align"]["error"].startswith("IndexError: index"), runs["align"]  # vLLM alone
    assert "varlen_states[last_chunk_indices_p]" in runs["align"]["where"][-1]
    plug = runs["plugin"]
    assert r["returncode"] == 0 and plug["matches_transformers"] == plug["matches_off"] == 12, r
    assert plug["cached"][:4] == [0] * 4 and all(c > 0 for c in plug["cached"][4:]), plug  # the later waves hit
    assert plug["plugin"]["copies"] > 0 and plug["plugin"]["reclaimed"] > 0  # blocks reused under pressure
    # The plugin's close released what the prefix cache kept: the trace ends idle, the copies are forks.
    analysis = mc.tracing.analyze(trace, expect_idle=True)
    assert analysis.anomalies == [] and analysis.bad_lines == [] and analysis.held == {}, analysis.anomalies[:3]
    assert analysis.summary["forks"] == plug["plugin"]["copies"] and r["trace"]["anomalies"] == 0
    forks = [e for line in analysis.timelines.values() for e in line if e.action == "fork-in"]
    assert forks and all(e.request_id is not None and e.request_id != CACHED for e in forks)
    assert subprocess.run([sys.executable, "-m", "mambacache", "trace", str(trace), "--expect-idle"]).returncode == 0
    bad = prefix_example(model_dir, "--modes", "plugin", "--systems", "4", "--per-system", "3", "--blocks", "16",
                         fault="vllm-skip-copy")  # fmt: skip
    assert bad["returncode"] == 1 and bad["runs"]["plugin"]["matches_transformers"] < 12, bad  # the test can fail


def test_speculative_decoding_in_align_mode_fails_alone_on_cpu_and_runs_with_the_plugin(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """ngram drafts on a tiny hybrid Qwen3-Next: vLLM alone dies in its fused pre-copy kernel (Triton); with the
    plugin the run finishes with prefix-cache hits and copies that carry an accepted-token bias.

    The copies themselves are checked byte for byte against vLLM's kernels in test_vllm_kernels.py: this
    tiny model's greedy tokens hardly depend on its linear-attention state (measured: vLLM with every
    align-mode copy dropped gives the same tokens), so equal tokens here show the run, not the copies.
    """
    model = tmp_path_factory.mktemp("model") / "qwen3-next-tiny"
    args = ("--model", "qwen3-next", "--spec", "2", "--systems", "3", "--per-system", "2", "--system-tokens", "230",
            "--new-tokens", "32", "--batch-tokens", "64")  # fmt: skip
    r = example(model, *args, "--modes", "off,align,plugin", script="vllm_prefix_cpu.py")
    runs = r["runs"]
    assert runs["align"]["error"].startswith("TypeError"), runs["align"]  # vLLM alone: Triton has no CPU backend
    assert "run_fused_precopy" in runs["align"]["where"][-1]
    plug = runs["plugin"]
    assert r["returncode"] == 0 and plug["matches_transformers"] == plug["matches_off"] == 6, r
    assert plug["plugin"]["shifted"] > 0 and plug["plugin"]["copies"] > plug["plugin"]["shifted"], plug
    assert sum(c > 0 for c in plug["cached"]) == 3, plug  # the second wave hits


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two tensor-parallel workers need two CPUs")
def test_tensor_parallel_2_each_rank_adopts_its_own_shard_and_stays_exact(model_dir: Path) -> None:
    args = ("--modes", "plugin", "--systems", "4", "--per-system", "2", "--blocks", "16")
    one = prefix_example(model_dir, *args)["runs"]["plugin"]
    r = prefix_example(model_dir, *args, "--tp", "2")
    two = r["runs"]["plugin"]
    assert r["returncode"] == 0 and two["matches_transformers"] == 8 and two["cached"][4:] == [64] * 4, r
    (whole,) = one["ranks"]
    assert len(two["ranks"]) == 2 and all(rank["stats"] == whole["stats"] for rank in two["ranks"]), two["ranks"]
    # Each rank's pool is its own shard of the heads: the same blocks, smaller pages.
    assert all(rank["pools"][0][:2] == whole["pools"][0][:2] for rank in two["ranks"])
    assert all(rank["pools"][0][2] < whole["pools"][0][2] for rank in two["ranks"])


def test_measure_splits_the_plugins_host_time_from_its_stages(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``--measure`` (the #33 per-layer figures): every step timed, and the time inside ``run_stage`` taken out
    for the host-only figure; the forks' copies make the two differ at the p95."""
    model = tmp_path_factory.mktemp("model") / "qwen3-next-tiny"
    r = example(model, "--model", "qwen3-next", "--spec", "2", "--measure", "--modes", "plugin", "--rounds", "2",
                "--linear-layers", "3", script="vllm_prefix_cpu.py")  # fmt: skip
    plug = r["plugin"]
    assert r["returncode"] == 0 and "error" not in plug, plug
    whole, host = plug["plugin_host_per_step"], plug["plugin_host_per_step_without_stages"]
    assert whole["n"] == host["n"] > 20, plug
    assert 0 < host["median_ms"] <= whole["median_ms"] and host["p95_ms"] < whole["p95_ms"], plug
