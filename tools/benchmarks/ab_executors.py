"""A/B of the CPU executors against another checkout, every cell interleaved in one run.

    PYTHONPATH=. python tools/benchmarks/ab_executors.py --old ../old-4d40453 \
        --presets qwen3-next-80b-a3b-tp8 --sizes 64,256 --contended --json ab.json

Two worker processes, one per checkout (each imports its own ``mambacache`` through its own
PYTHONPATH), build the same pool (the bench's preset, layers fitted to ``--budget-gb``, the same
random slots from the same seed) and the same cases as ``mambacache bench`` (``_preset_cases``:
clear, copy, offload, restore; memset/memcpy of the same bytes; the `sglang` path). For each cell the
driver asks the workers for one round each in turn, the order flipped every round, so a slow spell
of the shared machine hits both alike; a worker's round times each of its paths once (the bound,
the `sglang` path, each executor) in a fresh order, so no path always follows an OpenMP region.
The worker not timing waits on its pipe. Separate runs here differ
by 2x; these rounds do not.

Reported per cell: each path's median over its own worker's bound (x bound) and over its `sglang` path
(x sglang), and the old checkout's ``torch`` median over each new path's (x old: above 1, the new path
is faster). ``--contended`` runs every cell again with ``bench --contended``'s competing process.
The load average (``os.getloadavg``) is recorded before and after each preset and phase.
``--markdown FILE...`` prints the tables of ``--json`` files.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

WORKER = r"""
import json, random, sys, time
import torch
from mambacache import HostPool, StatePool
from mambacache.bench._presets import fit_layers, lookup
from mambacache.bench._run import DRAFTS, _preset_cases, _run_stage, make_executor

BASELINE_WARMUP = 16  # bench's measure(first=...) in this checkout; the old one may predate it

executors, sizes, budget, seed = sys.argv[1].split(","), [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), 0
device = torch.device("cpu")
cells, fns, preset, shuffle = {}, {}, None, random.Random(1)


def build(name):
    num_slots = 2 * max(sizes) + 8
    spec = fit_layers(lookup(name).spec, num_slots, budget // (2 + DRAFTS))
    pool = StatePool(spec, num_slots, device, draft_tokens=DRAFTS)
    for t in [*pool.tensors, *pool.draft_tensors]:
        t.fill_(1)
    host = HostPool(spec, max(sizes))
    rng = random.Random(seed)
    impls = {e: make_executor(e, device, 64 << 20) for e in executors}
    out = {}
    for n in sizes:
        for op, bound, stage, sglang_fn, bound_fn in _preset_cases(pool, host, num_slots, n, rng, device):
            paths = {"bound": bound_fn, "sglang": sglang_fn}
            paths.update({e: _run_stage(ex, stage, pool, host) for e, ex in impls.items()})
            out[(n, op)] = paths
    return spec.num_layers, spec.slot_bytes, out


for line in sys.stdin:
    cmd = json.loads(line)
    if "where" in cmd:
        import mambacache
        reply = {"file": mambacache.__file__}
    elif "preset" in cmd:
        cells = {}
        layers, slot_bytes, cells = build(cmd["preset"])
        reply = {"layers": layers, "slot_bytes": slot_bytes}
    elif "cell" in cmd:
        fns = cells[tuple(cmd["cell"])]
        for _ in range(BASELINE_WARMUP):  # as bench's measure(first=...): the baselines' first runs alone
            fns["bound"]()
            fns["sglang"]()
        reply = {"paths": list(fns)}
    else:
        names = list(fns)
        shuffle.shuffle(names)  # a fresh order each round: no path always runs after an OpenMP region
        times = {}
        for name in names:
            t0 = time.perf_counter()
            fns[name]()
            times[name] = time.perf_counter() - t0
        reply = {"times": times}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
"""

OPS = ("clear", "copy", "offload", "restore")


class Worker:
    """One checkout's process: builds a preset's cases, times a cell's paths once per round."""

    def __init__(self, label: str, checkout: str, executors: list[str], sizes: list[int], budget: int) -> None:
        self.label = label
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env["PYTHONPATH"] = os.path.abspath(checkout)
        args = [",".join(executors), ",".join(map(str, sizes)), str(budget)]
        # -P and the checkout as the working directory: ``python -c`` puts the working directory first on
        # sys.path, ahead of PYTHONPATH, and a worker started here would import this checkout whatever it was told.
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-c", WORKER, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            cwd=env["PYTHONPATH"],
        )
        self.imported = self.ask(where=True)["file"]
        if not self.imported.startswith(env["PYTHONPATH"] + os.sep):
            raise RuntimeError(f"worker {label} imported {self.imported}, not the checkout {checkout}")

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.label} exited (code {self.proc.wait()})")
        return dict(json.loads(line))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def cell(workers: list[Worker], n: int, op: str, rounds: int, warmup: int) -> dict[str, dict[str, float]]:
    """Median seconds of each worker's paths for one cell, the workers' rounds alternating."""
    times: dict[str, dict[str, list[float]]] = {}
    for w in workers:
        paths = w.ask(cell=[n, op])["paths"]
        times[w.label] = {p: [] for p in paths}
    for r in range(warmup + rounds):
        for w in workers if r % 2 == 0 else workers[::-1]:
            got = w.ask(round=True)["times"]
            if r >= warmup:
                for p, t in got.items():
                    times[w.label][p].append(t)
    return {label: {p: statistics.median(v) for p, v in paths.items()} for label, paths in times.items()}


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def run_phase(workers: list[Worker], args: argparse.Namespace, phase: str) -> list[dict[str, Any]]:
    rows = []
    for preset in args.presets:
        before = load()
        built = [w.ask(preset=preset) for w in workers]  # every worker builds the preset's cases
        layers = built[0]["layers"]
        for n in args.sizes:
            for op in OPS:
                med = cell(workers, n, op, args.rounds, args.warmup)
                new, old = med["new"], med["old"]
                row: dict[str, Any] = {"phase": phase, "preset": preset, "layers": layers, "slots": n, "op": op,
                                       "bound_ms": new["bound"] * 1e3, "old_bound_ms": old["bound"] * 1e3}  # fmt: skip
                for label, paths in med.items():
                    for p, t in paths.items():
                        if p in ("bound", "sglang"):
                            continue
                        name = p if label == "new" else f"old {p}"
                        row[f"{name} ms"] = t * 1e3
                        row[f"{name} x bound"] = paths["bound"] / t
                        row[f"{name} x sglang"] = paths["sglang"] / t
                        if label == "new":
                            row[f"{name} x old"] = old["torch"] / t
                rows.append(row)
                sys.stdout.write(json.dumps(row) + "\n")
        rows.append({"phase": phase, "preset": preset, "load_before": before, "load_after": load()})
        sys.stdout.write(json.dumps(rows[-1]) + "\n")
    return rows


def markdown(*paths: str) -> str:
    """One table per phase from ``--json`` files: per preset, size and op, the default's x bound, each new
    path's x old (``torch-whole`` runs the old code's way: its x old is the measurement's own spread), the
    default's x sglang and its time against the better of torch-crew and torch-inline (below 1: slower); then
    the load before and after each preset."""
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            rows += json.load(f)["rows"]
    out = []
    for phase in dict.fromkeys(r["phase"] for r in rows):
        cells = [r for r in rows if r["phase"] == phase and "op" in r]
        news = [k[:-3] for k in cells[0] if k.endswith(" ms") and not k.startswith("old ")]
        head = ["preset", "slots", "op", "torch x bound", *(f"{p} x old" for p in news)]
        head += ["torch x sglang", "torch x better of crew, inline"]
        out.append(f"{phase}:\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|---|" + "---:|" * (len(head) - 1))
        for r in cells:
            vals = [r["preset"], str(r["slots"]), r["op"], f"{r['torch x bound']:.2f}"]
            vals += [f"{r[p + ' x old']:.2f}" for p in news] + [f"{r['torch x sglang']:.2f}"]
            better = min(r.get("torch-crew ms", float("inf")), r.get("torch-inline ms", float("inf")))
            vals.append(f"{better / r['torch ms']:.2f}")
            out.append("| " + " | ".join(vals) + " |")
        loads = [
            f"{r['preset']} {r['load_before']} -> {r['load_after']}"
            for r in rows
            if r["phase"] == phase and "op" not in r
        ]
        out.append("\nLoad average (1/5/15 min) before -> after each preset: " + "; ".join(loads) + ".\n")
    return "\n".join(out)


def main() -> int:
    if sys.argv[1:2] == ["--markdown"]:
        sys.stdout.write(markdown(*sys.argv[2:]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="the other checkout (its root, holding mambacache/)")
    p.add_argument("--new", default=".", help="this checkout (default .)")
    p.add_argument("--presets", type=lambda s: s.split(","), default=["qwen3-next-80b-a3b-tp8"])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256])
    p.add_argument("--executors", type=lambda s: s.split(","), default=["torch", "torch-crew", "torch-inline"])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--budget-gb", type=float, default=0.6, help="each worker's pool, drafts and host pool")
    p.add_argument("--contended", action="store_true", help="every cell again with a competing process")
    p.add_argument("--contended-only", action="store_true", help="only the cells with a competing process")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    budget = int(args.budget_gb * 2**30)
    workers = [
        Worker("new", args.new, args.executors, args.sizes, budget),
        Worker("old", args.old, ["torch"], args.sizes, budget),
    ]
    try:
        rows = [] if args.contended_only else run_phase(workers, args, "quiet")
        if args.contended or args.contended_only:
            sys.path.insert(0, os.path.abspath(args.new))
            from mambacache.bench._contend import competing_process

            with competing_process(2):
                rows += run_phase(workers, args, "contended")
    finally:
        for w in workers:
            w.close()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            imported = {w.label: w.imported for w in workers}
            json.dump({"argv": sys.argv, "nproc": os.cpu_count(), "imported": imported, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
