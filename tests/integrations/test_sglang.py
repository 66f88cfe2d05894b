"""mambacache inside SGLang (0.5.23, CPU): the plugin changes no byte of SGLang's mamba pool, step by step.

Each run is a fresh process in the SGLang venv (``tests/workers/sglang_run.py``): SGLang
applies a plugin's hooks to its classes for the life of the process, so SGLang
alone and SGLang with the plugin cannot share one. Skipped where SGLang is not
installed (the main venv); ``.ci/run`` runs this file in ``.venv-sglang``, where
``MAMBACACHE_REQUIRE_SGLANG=1`` turns a missing SGLang into a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("MAMBACACHE_REQUIRE_SGLANG"):
    import sglang  # noqa: F401  (CI: a missing SGLang is a failure, not a skip)
else:
    pytest.importorskip("sglang", reason="SGLang is not installed (run through .ci/run, or set up .venv-sglang)")

from ..workers.sglang_run import run_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 16


def run(mode: str, seed: int, steps: int = STEPS, trace: str | None = None) -> dict[str, Any]:
    return run_json(
        "tests.workers.sglang_run", mode, seed, steps, env=None if trace is None else {"MAMBACACHE_TRACE": trace}
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_plugin_leaves_every_byte_as_sglang_alone_does(seed: int, tmp_path: Path) -> None:
    plain, plugin = run("plain", seed), run("plugin", seed, trace=str(tmp_path / "trace.jsonl"))
    work = plain["work"]
    # The workload clears, forks, checkpoints and retracts with a backup.
    assert work["clears"] and work["cows"] and work["checkpoints"] and work["retractions"], work
    assert plugin["work"] == work
    assert plugin["digests"] == plain["digests"]  # the pool's bytes after every step
    counts = plugin["counts"]
    # Each forward step's clears and copies: one flush; each checkpoint's copy: one flush; each retraction: an
    # offload flushed and a restore flushed; nothing left to SGLang.
    n = work["retractions"]
    assert counts == {
        "steps": STEPS, "direct": work["checkpoints"], "fallbacks": 0, "offloads": n, "restores": n
    }, counts  # fmt: skip
    assert plugin["manager_steps"] == STEPS + work["checkpoints"] + 2 * n
    # Device-to-host reads from mambacache's code (a synchronisation each on CUDA): none at an allocation, a free,
    # a match or a tree insert; at most one per forward step (its allocations, frees and indices in one transfer);
    # one per direct call that needs its own slot ids (a backup, its load, a checkpoint's copy).
    reads = plugin["reads"]
    assert sum(reads["schedule"]) == 0, reads
    assert max(reads["step"]) == 1, reads
    assert reads["retract"] == [2 * k for k in reads["retractions"]], reads
    assert sum(reads["checkpoint"]) == work["checkpoints"], reads
    assert plugin["held_matches"] is True  # held() is SGLang's allocator's held set
    assert plugin["tenant_errors"] == []  # after every step: each running request's slot, and the tree's checkpoints
    assert plugin["idle"] is True  # after cache.reset() and pool.clear(), check_idle passes
    assert plugin["trace_anomalies"] == []  # MAMBACACHE_TRACE: `mambacache trace --expect-idle` is clean


def test_skipping_the_clears_shows_in_the_bytes_and_in_the_trace(tmp_path: Path) -> None:
    plain, fault = run("plain", 1), run("fault", 1, trace=str(tmp_path / "trace.jsonl"))
    assert fault["digests"] != plain["digests"]
    assert "uncleared-reuse" in fault["trace_anomalies"]


@pytest.mark.parametrize("plugins", [None, "", "someone-else"])
def test_the_plugin_changes_nothing_unless_named(plugins: str | None) -> None:
    """SGLang loads every installed plugin when SGLANG_PLUGINS is unset: mambacache must then do nothing."""
    code = (
        "from sglang.srt.plugins import load_plugins\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "load_plugins()\n"
        "from mambacache.integrations import sglang as plugin\n"
        "ours = [t for t, hooks in HookRegistry._hooks.items() for _, fn, _ in hooks"
        " if fn.__module__ == plugin.__name__]\n"
        "assert not ours and not plugin.managers(), ours\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=300)


def kits(mode: str) -> dict[str, Any]:
    return run_json("tests.workers.sglang_kits", mode)


def test_sglangs_own_test_kits_see_the_same_with_the_plugin() -> None:
    """The wheel's unified-radix-cache kits (LRU refresh, checkpoint grid, finished overshoot), with and without."""
    plain, plugin = kits("plain"), kits("plugin")
    assert plugin.pop("views_agree") is True  # the manager's held slots are the allocator's after each kit
    assert plugin == plain
    assert plain["lru"]["before"] != plain["lru"]["after"]  # the match did refresh the LRU
    assert any(v is not None for v in plain["grid"].values())  # and some matches branched at a checkpoint


def test_a_request_aborted_while_retracted_frees_its_backup() -> None:
    """SGLang's abort of a retracted request (``discard_kv_cache_backup``) only lets go of the backup: the host
    slots its ``HostCopy`` holds are freed at the next step, while the other request's backup loads back."""
    out = run_json("tests.workers.sglang_abort")
    assert out["host_held_retracted"] == 2  # both retractions backed up in the plugin's host pool
    assert out["resumed_state"] is True
    assert out["host_held_after_step"] == {}
    assert out["idle"] is True
