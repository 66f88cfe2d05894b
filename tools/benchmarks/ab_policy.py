"""A/B of the torch executor's stage policy (``_executors/_policy.py``) against another checkout's, in one process.

    PYTHONPATH=. python tools/benchmarks/ab_policy.py --old ../old-checkout \
        --presets small,qwen3.5-35b-a3b-tp8,nemotron-h-8b-tp8 --sizes 64,256 --contended --json ab.json

Two torch executors that differ only in their ``Policy`` class (the old one loaded from the old
checkout's ``_policy.py`` file) run the same stages of the same pool, with the crew and inline ways
and the memset/memcpy bound beside them, each round every path once in a shuffled order: the two
policies meet the same host, slice for slice, which two processes taking turns
(``ab_executors.py``) cannot give under a competing process (there the same code read 0.05-2.0x
itself). ``--contended`` runs every cell with ``bench --contended``'s competing process.
Reported per cell: each path's median ms, the new and old default over the bound, and over the
better of crew and inline.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

from mambacache import HostPool, StatePool
from mambacache._executors import _torch
from mambacache.bench._contend import competing_process
from mambacache.bench._presets import fit_layers, lookup
from mambacache.bench._run import DRAFTS, _preset_cases, _run_stage, make_executor

OPS = ("clear", "copy", "offload", "restore")


def old_policy(checkout: str) -> type:
    path = os.path.join(checkout, "mambacache", "_executors", "_policy.py")
    spec = importlib.util.spec_from_file_location("old_policy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Policy  # type: ignore[no-any-return]


def executors(old: type) -> dict[str, Any]:
    device = torch.device("cpu")
    out = {"new": make_executor("torch", device, 64 << 20)}
    new = _torch.Policy
    _torch.Policy = old  # the executor's policy is made at its construction: this one the old checkout's
    try:
        out["old"] = make_executor("torch", device, 64 << 20)
    finally:
        _torch.Policy = new
    out["crew"] = make_executor("torch-crew", device, 64 << 20)
    out["inline"] = make_executor("torch-inline", device, 64 << 20)
    return out


def preset_rows(name: str, sizes: list[int], old: type, rounds: int, warmup: int, phase: str) -> list[dict[str, Any]]:
    device = torch.device("cpu")
    num_slots = 2 * max(sizes) + 8
    spec = fit_layers(lookup(name).spec, num_slots, (6 << 30) // (2 + DRAFTS))
    pool = StatePool(spec, num_slots, device, draft_tokens=DRAFTS)
    for t in [*pool.tensors, *pool.draft_tensors]:
        t.fill_(1)
    host = HostPool(spec, max(sizes))
    rng = random.Random(0)
    impls = executors(old)
    rows = []
    for n in sizes:
        for op, _bound, stage, _sglang, bound_fn in _preset_cases(pool, host, num_slots, n, rng, device):
            if op not in OPS:
                continue
            fns = {"bound": bound_fn, **{k: _run_stage(ex, stage, pool, host) for k, ex in impls.items()}}
            times: dict[str, list[float]] = {k: [] for k in fns}
            keys = list(fns)
            order = random.Random(n)
            for r in range(warmup + rounds):
                # A fresh order each round: the path run right after an OpenMP region (the bound's memset, the
                # whole way) meets its threads still spinning, and a fixed neighbour would take that every round.
                order.shuffle(keys)
                for k in keys:
                    t0 = time.perf_counter()
                    fns[k]()
                    if r >= warmup:
                        times[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            better = min(med["crew"], med["inline"])
            row = {
                "phase": phase, "preset": name, "slots": n, "op": op, **{f"{k} ms": v * 1e3 for k, v in med.items()},
                "new x bound": med["bound"] / med["new"], "old x bound": med["bound"] / med["old"],
                "new x old": med["old"] / med["new"],
                "new x better": better / med["new"], "old x better": better / med["old"],
            }  # fmt: skip
            rows.append(row)
            sys.stdout.write(json.dumps(row) + "\n")
            sys.stdout.flush()
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    cols = ["new x old", "new x bound", "old x bound", "new x better", "old x better"]
    out = []
    for phase in dict.fromkeys(r["phase"] for r in rows):
        out += [f"{phase}:", "", "| preset | slots | op | " + " | ".join(cols) + " |", "|---|---:|---:|" + "---:|" * 5]
        out += [
            f"| {r['preset']} | {r['slots']} | {r['op']} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |"
            for r in rows
            if r["phase"] == phase
        ]
        out.append("")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", help="the other checkout's root")
    p.add_argument("--presets", default="small")
    p.add_argument("--sizes", default="64,256")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=12)
    p.add_argument("--contended", action="store_true", help="every cell with a competing process (only)")
    p.add_argument("--json")
    p.add_argument("--markdown", help="print the tables of a --json file")
    args = p.parse_args()
    if args.markdown:
        with open(args.markdown) as f:
            sys.stdout.write(markdown(json.load(f)["rows"]) + "\n")
        return 0
    if not args.old:
        p.error("--old is required")
    old = old_policy(args.old)
    phase = "contended" if args.contended else "quiet"
    sizes = [int(x) for x in args.sizes.split(",")]
    rows = []
    with competing_process(2) if args.contended else contextlib.nullcontext():
        for name in args.presets.split(","):
            load = "/".join(f"{x:.1f}" for x in os.getloadavg())
            rows += preset_rows(name, sizes, old, args.rounds, args.warmup, phase)
            sys.stderr.write(f"{name}: load {load} -> {'/'.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    sys.stdout.write(markdown(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
