"""Host time and aten ops per forward step: SGLang's own deferred clears and copies against the plugin's.

Run in the SGLang venv: ``python -m tests.workers.sglang_bench [ROUNDS] [STEPS]``. Each
round runs the same seeded workload (tests/workers/sglang_run.py) with SGLang alone and
with the plugin, alternately, each in a fresh process (SGLang's hooks are
per process), so drift of this shared machine hits both alike; then one audited
run of each counts the aten ops of every step. Prints a table and, last, one
JSON line. Only steps that had work (a clear or a copy) count; the scheduling
column is the host time of each step's finishes, matches and allocations (the
plugin's hooks there record device tensors, read at the step).
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

from tests.workers.sglang_run import run_json


def _run(mode: str, seed: int, steps: int, audit: bool = False) -> dict[str, Any]:
    return run_json(
        "tests.workers.sglang_run", mode, seed, steps, env={"MAMBACACHE_SGLANG_AUDIT": "1"} if audit else None
    )


def main(rounds: int, steps: int) -> dict[str, Any]:
    ops = {mode: _run(mode, 1, steps, audit=True)["step_ops"] for mode in ("plain", "plugin")}
    # Steps with a clear or a copy; the first few warm up caches and lazy imports.
    busy = [i for i, n in enumerate(ops["plain"]) if n and i >= 4]
    times: dict[str, list[float]] = {"plain": [], "plugin": []}
    # Scheduling's host time (finishes, tree inserts, matches, allocations: where the plugin's hooks record what
    # the step then reads and replays), every step after the fourth.
    schedule: dict[str, list[float]] = {"plain": [], "plugin": []}
    for r in range(rounds):
        for mode in ("plain", "plugin") if r % 2 == 0 else ("plugin", "plain"):
            got = _run(mode, 1, steps)
            times[mode] += [got["step_us"][i] for i in busy]
            schedule[mode] += got["schedule_us"][4:]
    result = {
        mode: {
            "median_us": statistics.median(times[mode]),
            "min_us": min(times[mode]),
            "ops_per_busy_step": statistics.mean(ops[mode][i] for i in busy),
            "schedule_median_us": statistics.median(schedule[mode]),
        }
        for mode in times
    }
    result["ratio_median"] = result["plugin"]["median_us"] / result["plain"]["median_us"]
    print(f"{'':8} {'median us':>10} {'min us':>8} {'aten ops/step':>14} {'scheduling us':>14}")
    for mode in ("plain", "plugin"):
        row = result[mode]
        print(
            f"{mode:8} {row['median_us']:>10.1f} {row['min_us']:>8.1f} {row['ops_per_busy_step']:>14.1f}"
            f" {row['schedule_median_us']:>14.1f}"
        )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6, int(sys.argv[2]) if len(sys.argv) > 2 else 40)
