"""The plugin's speculative-decoding copies against vLLM's own align-mode kernels (tests/workers/vllm_kernels.py).

vLLM's CPU build cannot run these Triton kernels (no Triton CPU backend), so
the worker runs their code in Triton's interpreter on CPU tensors laid out in
vLLM's block pages, next to the plugin's ``postprocess`` and ``copy_columns``
on a second copy of the same pool. Needs vLLM (``.ci/run`` runs this file in
its vLLM venv); skipped elsewhere unless ``MAMBACACHE_REQUIRE_VLLM=1``.
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

WORKER = Path(__file__).parents[1] / "workers" / "vllm_kernels.py"

if importlib.util.find_spec("vllm") is None and os.environ.get("MAMBACACHE_REQUIRE_VLLM") != "1":
    pytest.skip("vLLM is not installed (run through .ci/run, or set up .venv-vllm)", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def kernels(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_postprocess_and_precopy_equal_vllms_fused_kernels_byte_for_byte(layout: str) -> None:
    r = kernels("--layout", layout, "--cases", "60", "--seed", str(ord(layout[0])))
    assert r["mismatches"] == 0, r["first"]
    assert r["copies"] > 60 and r["shifted"] > 20, r  # copies were made, many with an accepted-token bias


def test_the_comparison_fails_when_the_bias_is_dropped() -> None:
    r = kernels("--cases", "20", "--wrong-bias")
    assert r["shifted"] == 0 and r["mismatches"] > 0, r
