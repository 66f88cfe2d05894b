"""A/B of the host path (events, submits, planning, the decode step) against another checkout, interleaved.

    PYTHONPATH=. python tools/benchmarks/ab_host.py --old ../tricks-base --rounds 40 --json ab-host.json

Two worker processes, one per checkout (each imports its own ``mambacache`` through its own PYTHONPATH),
build the same inputs from the same seed. For each metric the driver asks the two workers for one round
each in turn, the order flipped every round, so a slow spell of the shared machine hits both alike; the
worker not timing waits on its pipe, and both time a round on the same CPU (the next CPU every other
round: a CPU that another process keeps busy slows both alike). A round times many short batches and
keeps their median (a batch a preemption hit is an outlier of its round, not of the figure). Reported per
metric: each checkout's median over its rounds, new / old (below 1: the new checkout is faster), and the
median of the per-round ratios with their quartiles. The load average (``os.getloadavg``) is recorded
before and after.

Metrics (microseconds):

* ``event``: one event built (``Clear``, ``Release``, ``Alloc``, ``CopyOnWrite`` in turn), per event;
* ``report``: one ``StepReport.from_plan``;
* ``submit``: one single-event submit through the public API (``clear``, ``copy_on_write``, ``release``
  of a held slot then an ``alloc``), per event, on a manager that does no device work;
* ``plan_decode``: ``plan_step`` of the decode step's six events (2 releases, 2 allocs, 2 forks), per event;
* ``plan_plain``: ``plan_step`` of 100 plain events (clears, whole copies, releases and allocs; no copy reads
  a slot the step wrote), per event;
* ``plan_general``: ``plan_step`` of 100 events with chains, cycles, commits and the host tier, per event;
* ``decode``: ``bench``'s decode step (``mambacache/bench/_decode.py``: 2 releases, 2 allocs, 2 forks and
  ``await flush()`` on the torch executor), the median of 100 steps;
* ``host_10``, ``host_100``, ``host_1000``: ``bench --quick``'s host line (``host_overhead``: submit + plan
  + bookkeeping per event at 10, 100, 1000 events a flush).
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
import json, os, random, statistics, sys, time
import mambacache as E
from mambacache import CacheManager, StatePool, StateSpec, plan_step
from mambacache.bench._decode import decode_flush
from mambacache.bench._run import _NullExecutor, host_overhead

clock = time.perf_counter_ns
rng = random.Random(0)


def med(samples, per):
    return statistics.median(samples) / per / 1e3


def event_round():
    out = []
    Clear, Release, Alloc, CopyOnWrite = E.Clear, E.Release, E.Alloc, E.CopyOnWrite
    for _ in range(200):
        t0 = clock()
        for s in range(1, 26):
            Clear(s, "r")
            Release(s, "r")
            Alloc(s, "r", True)
            CopyOnWrite(s, s + 1, "r")
        out.append(clock() - t0)
    return med(out, 100)


class _Plan:
    events, zeroed, copied, elided, committed, offloaded, restored = 6, 2, 2, 2, 0, 0, 0
    stages = (1, 2)


def report_round():
    out, plan, make = [], _Plan(), E.StepReport.from_plan
    for _ in range(200):
        t0 = clock()
        for i in range(20):
            make(plan, i, 64, plan_s=1e-6, execute_s=1e-6)
        out.append(clock() - t0)
    return med(out, 20)


spec = StateSpec(num_layers=1, conv_shapes=(), temporal_shape=(1,))
mgr = CacheManager(StatePool(spec, 256), executor=_NullExecutor())
mgr.__enter__()
live = mgr.alloc(200, "r")
mgr.flush_nowait()


def submit_round():
    global live
    out = []
    for _ in range(100):
        picks = [(rng.choice(live[:100]), rng.choice(live[:100])) for _ in range(5)]
        gone = live[100:105]
        t0 = clock()
        for a, b in picks:
            mgr.clear(a, "r")
            mgr.copy_on_write(a, b, "r")
        for s in gone:
            mgr.release(s, "r")
        new = mgr.alloc(5, "r")
        out.append(clock() - t0)
        live = live[:100] + live[105:] + new
        mgr.flush_nowait()
    return med(out, 20)


def plain_log(n):
    # plain: no copy reads a slot the step wrote, no copy's source ends the step copied over
    log = []
    for _ in range(n):
        k = rng.random()
        if k < 0.4:
            log.append(E.Clear(rng.randrange(1, 50), None))
        elif k < 0.8:
            log.append(E.CopyOnWrite(rng.randrange(50, 100), rng.randrange(101, 200), None))
        elif k < 0.9:
            log.append(E.Release(rng.randrange(101, 200), None))
        else:
            log.append(E.Alloc(rng.randrange(101, 200), None, True))
    return log


def general_log(n):
    log, host = [], 1
    for _ in range(n):
        a, b, k = rng.randrange(1, 40), rng.randrange(1, 40), rng.random()
        if k < 0.3:
            log.append(E.CopyOnWrite(a, b, None))
        elif k < 0.45:
            log.append(E.Clear(a, None))
        elif k < 0.55:
            log.append(E.Release(a, None))
        elif k < 0.65:
            log.append(E.Alloc(a, None, rng.random() < 0.8))
        elif k < 0.75:
            log.append(E.CommitDraft(a, rng.randrange(0, 3), None))
        elif k < 0.85:
            log.append(E.Offload(a, host, None))
            host += 1
        elif k < 0.95 and host > 1:
            log.append(E.Restore(rng.randrange(1, host), b, None, rng.random() < 0.5))
        else:
            log.append(E.DropHost(rng.randrange(1, host + 1)))
    return log


decode_log = [
    E.Release(5, None), E.Release(6, None), E.Alloc(5, None, True), E.Alloc(6, None, True),
    E.CopyOnWrite(1, 5, None), E.CopyOnWrite(1, 6, None),
]
plain = plain_log(100)
general = general_log(100)


def plan_round(log, batch):
    out = []
    for _ in range(max(20, 2000 // (batch * len(log)))):
        t0 = clock()
        for _ in range(batch):
            plan_step(log)
        out.append(clock() - t0)
    return med(out, batch * len(log))


def decode_round():
    return decode_flush(1, steps=100)["flush_us"]


def host_round():
    return {f"host_{h['events_per_flush']}": h["us_per_event"] for h in host_overhead([10, 100, 1000], 7)}


METRICS = {
    "event": event_round,
    "report": report_round,
    "submit": submit_round,
    "plan_decode": lambda: plan_round(decode_log, 20),
    "plan_plain": lambda: plan_round(plain, 1),
    "plan_general": lambda: plan_round(general, 1),
    "decode": decode_round,
    "host": host_round,
}

for line in sys.stdin:
    cmd = json.loads(line)
    if "where" in cmd:
        import mambacache
        reply = {"file": mambacache.__file__, "metrics": list(METRICS)}
    else:
        os.sched_setaffinity(0, {cmd["cpu"]})
        got = METRICS[cmd["metric"]]()
        reply = {"values": got if isinstance(got, dict) else {cmd["metric"]: got}}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
"""


class Worker:
    """One checkout's process: times one round of a metric when asked."""

    def __init__(self, label: str, checkout: str) -> None:
        self.label = label
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env["PYTHONPATH"] = os.path.abspath(checkout)
        env["OMP_NUM_THREADS"] = "1"  # the decode step's ops are tiny: no thread pool to wake
        # -P and the checkout as the working directory: ``python -c`` puts the working directory first on
        # sys.path, ahead of PYTHONPATH, and a worker started here would import this checkout whatever it was told.
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-c", WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            cwd=env["PYTHONPATH"],
        )
        where = self.ask(where=True)
        self.imported, self.metrics = where["file"], where["metrics"]
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


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def measure(
    workers: list[Worker], metric: str, rounds: int, warmup: int, times: dict[str, dict[str, list[float]]]
) -> None:
    """``rounds`` rounds of ``metric`` on each worker, alternating, after ``warmup``: into ``times[label][figure]``."""
    cpus = sorted(os.sched_getaffinity(0))
    for r in range(warmup + rounds):
        for w in workers if r % 2 == 0 else workers[::-1]:
            got = w.ask(metric=metric, cpu=cpus[r // 2 % len(cpus)])["values"]
            if r >= warmup:
                for name, v in got.items():
                    times[w.label].setdefault(name, []).append(v)


def summary(times: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    """Per figure: both checkouts' medians over their rounds, new / old, and the per-round ratios' median."""
    rows = []
    for name, new in times["new"].items():
        old = times["old"][name]
        ratios = [n / o for n, o in zip(new, old, strict=True)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        rows.append({"metric": name, "new_us": statistics.median(new), "old_us": statistics.median(old),
                     "new/old": statistics.median(new) / statistics.median(old),
                     "paired": statistics.median(ratios), "paired_iqr": [q[0], q[2]], "rounds": len(new)})  # fmt: skip
    return rows


def markdown(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    out = ["| metric | old µs | new µs | new / old | paired ratio (IQR) |", "|---|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lo, hi = r["paired_iqr"]
        out.append(
            f"| {r['metric']} | {r['old_us']:.3f} | {r['new_us']:.3f} | {r['new/old']:.3f} "
            f"| {r['paired']:.3f} ({lo:.3f}-{hi:.3f}) |"
        )
    out.append(
        f"\n{data['rounds']} rounds in {data.get('processes', 1)} worker pairs; load average (1/5/15 min) "
        f"{data['load_before']} -> {data['load_after']}."
    )
    return "\n".join(out) + "\n"


def main() -> int:
    if sys.argv[1:2] == ["--markdown"]:
        sys.stdout.write(markdown(sys.argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="the other checkout (its root, holding mambacache/)")
    p.add_argument("--new", default=".", help="this checkout (default .)")
    p.add_argument("--metrics", type=lambda s: s.split(","), default=None, help="default: all")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--processes", type=int, default=3, help="fresh worker pairs that share the rounds")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    before, rows, imported = load(), [], {}
    raw: dict[str, dict[str, list[float]]] = {}
    metrics: list[str] = args.metrics
    # A process's own layout (addresses, hash seeds) moves its figures by a few per cent, whatever it runs:
    # fresh pairs of workers share the rounds, so no one process decides a figure.
    for _ in range(args.processes):
        workers = [Worker("new", args.new), Worker("old", args.old)]
        imported = {w.label: w.imported for w in workers}
        try:
            for metric in metrics or workers[0].metrics:
                times: dict[str, dict[str, list[float]]] = {"new": {}, "old": {}}
                measure(workers, metric, args.rounds // args.processes, args.warmup, times)
                for row in summary(times):
                    sys.stdout.write(json.dumps(row) + "\n")
                    sys.stdout.flush()
                for label, figures in times.items():
                    for name, values in figures.items():
                        raw.setdefault(label, {}).setdefault(name, []).extend(values)
        finally:
            for w in workers:
                w.close()
    rows = summary(raw)
    for row in rows:
        sys.stdout.write("all: " + json.dumps(row) + "\n")
    after = load()
    sys.stdout.write(f"load average {before} -> {after}\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"argv": sys.argv, "nproc": os.cpu_count(), "imported": imported, "rounds": args.rounds,
                       "processes": args.processes, "load_before": before, "load_after": after, "rows": rows},
                      f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
