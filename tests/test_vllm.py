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

ROOT = Path(__file__).parent.parent
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

if not HAVE_VLLM and os.environ.get("MAMBACACHE_REQUIRE_VLLM") != "1":
    pytest.skip("vLLM is not installed (run through .ci/run, or set up .venv-vllm)", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert HAVE_VLLM, "MAMBACACHE_REQUIRE_VLLM=1 but vLLM is not importable"
    return tmp_path_factory.mktemp("model") / "mamba2-tiny"


def example(model_dir: Path, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_plugin.py"), "--json", "--model-dir", str(model_dir), *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
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


def test_chunked_prefill(model_dir: Path) -> None:
    r = example(model_dir, "--requests", "8", "--chunked")
    assert r["returncode"] == 0 and r["all_agree"], r


def test_without_vllms_masking_only_the_plugins_clears_keep_outputs_right(model_dir: Path) -> None:
    r = example(model_dir, "--requests", "8", "--unmask")
    assert r["returncode"] == 0 and r["plugin_matches_transformers"] == 8, r
    assert r["vllm_matches_transformers"] < 8  # vLLM alone reads the stale blocks
    bad = example(model_dir, "--requests", "8", "--unmask", "--fault", "skip-clear")
    assert bad["returncode"] == 0 and bad["plugin_matches_transformers"] < 8, bad  # the test can fail
    assert bad["plugin"]["clears"] == 0
