"""The examples run as a user would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize(
    ("name", "expect"),
    [
        ("asyncio_scheduler.py", "16 requests finished"),
        ("trio_scheduler.py", "done: 16/16 slots free"),
        ("worker_thread.py", "served 30 requests through 8 slots; 8 free"),
        ("sync_engine_loop.py", "sync loop: 12 requests in 15 steps through 6 slots; outputs exact; 0 slots held"),
        ("asyncio_backpressure.py", "19 requests through 4 slots, 1 gave up; served first come first served: True"),
        pytest.param("tensor_parallel.py", "every rank: [True, True]", marks=pytest.mark.slow),
    ],
)
def test_example(name: str, expect: str) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=120, check=True
    )
    assert expect in out.stdout, out.stdout + out.stderr


def test_cuda_check_runs_on_the_cpu() -> None:
    """The prepared accelerator check (examples/cuda_check.py) runs its own differential check on CPU pools."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "cuda_check.py"), "--device", "cpu", "--quick"],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    assert out.stdout.count(": equal") == 6, out.stdout + out.stderr
    assert "decode step host reads: none" in out.stdout, out.stdout


@pytest.mark.slow
def test_transfer_gpu_check_runs_its_gloo_parts_on_cpu() -> None:
    """``--cpu``: the prepared GPU check's own check, on CPU pools (it used to say "pools on CPU pools")."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "transfer_gpu_check.py"), "--cpu", "--quick"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert "pools on CPU (--cpu), backend" in out.stdout and "CPU pools" not in out.stdout, out.stdout
    assert "transfer check: bytes exact" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("name", "needs"),
    [("vllm_prefix_cpu.py", ["vllm"]), ("sglang_gpu_check.py", ["sglang", "cuda"])],
)
def test_an_engine_example_without_its_engine_says_what_is_missing(name: str, needs: list[str]) -> None:
    import importlib.util

    import torch

    have = [n for n in needs if (torch.cuda.is_available() if n == "cuda" else importlib.util.find_spec(n))]
    if have == needs:
        pytest.skip(f"this machine has {' and '.join(needs)}")
    run = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == "", run
    assert run.stderr.startswith(f"{name} needs ") and run.stderr.count("\n") == 1, run.stderr
