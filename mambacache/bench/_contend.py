"""``mambacache bench --contended``: the clear, copy, offload and restore rows, quiet and with another process
computing.

Engines share hosts and run under CPU quotas, so a pool's stages often run while
another process holds CPU time. The competing process here is a plain torch
matmul loop on ``threads`` threads (not niced), started and stopped by the bench
itself: it exits on its own after ``seconds`` or once its parent is gone, and the
bench kills it on the way out, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ._run import run_preset

__all__ = ["competing_process", "contended"]

# The competitor: two torch threads at 100 % until its deadline or its parent's exit (checked every few ms).
_COMPETITOR = """
import os, sys, time
import torch
threads, seconds = int(sys.argv[1]), float(sys.argv[2])
torch.set_num_threads(threads)
parent, end = os.getppid(), time.monotonic() + seconds
a = torch.randn(512, 512)
print("ready", flush=True)
while time.monotonic() < end and os.getppid() == parent:
    a @ a
"""

OPS = ("clear", "copy", "offload", "restore")


@contextlib.contextmanager
def competing_process(threads: int = 2, seconds: float = 900.0) -> Iterator[subprocess.Popen[bytes]]:
    """A process computing on ``threads`` torch threads for the block (at most ``seconds``), killed after it."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _COMPETITOR, str(threads), str(seconds)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":  # torch imported and the loop about to start
            raise RuntimeError(f"the competing process exited early (code {proc.wait()})")
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def contended(
    presets: Sequence[str],
    sizes: Sequence[int],
    executors: Sequence[str],
    device: torch.device,
    repeats: int,
    budget_bytes: int,
    workspace_bytes: int,
    threads: int = 2,
) -> list[dict[str, Any]]:
    """Clear, copy, offload and restore of each preset and size, quiet then with :func:`competing_process`
    running: one row per (preset, slots, op, path) with both medians and both ratios (to the bound and to the
    `sglang` path)."""

    def rows() -> list[Any]:
        args = (sizes, executors, device, repeats, budget_bytes, workspace_bytes)
        return [r for p in presets for r in run_preset(p, *args, only=OPS)]

    quiet = rows()
    with competing_process(threads):
        loaded = rows()
    out = []
    for q, c in zip(quiet, loaded, strict=True):
        assert (q.preset, q.slots, q.op, q.path) == (c.preset, c.slots, c.op, c.path)
        out.append({
            "preset": q.preset, "layers": q.layers, "slots": q.slots, "op": q.op, "path": q.path,
            "quiet_ms": q.median_s * 1e3, "quiet_x_bound": q.vs_bound, "quiet_x_sglang": q.vs_sglang,
            "contended_ms": c.median_s * 1e3, "contended_x_bound": c.vs_bound, "contended_x_sglang": c.vs_sglang,
        })  # fmt: skip
    return out
