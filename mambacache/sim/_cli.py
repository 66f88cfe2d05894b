"""``mambacache simulate``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import anyio

from .._console import Progress, table, write_json
from ._models import MODELS, build_model
from ._scheduler import FAULTS, SimConfig, SimReport, simulate

__all__ = ["add_parser", "run"]

_D = SimConfig()
DEFAULT_MODELS = ("toy", "mamba2", "qwen3-next")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate",
        help="run a continuous-batching workload on real models and check outputs against isolated generation",
        description=(
            "Requests arrive (Poisson), share prefixes, fork cached prefix states, reuse dirty slots; every"
            " request is then run alone with greedy generate and the tokens compared. Exits 1 when the check"
            " fails: any mismatch without --fault, or none with one."
        ),
    )
    p.add_argument("--model", choices=[*MODELS, "all"], action="append", help="repeatable; default: all three")
    p.add_argument("--requests", type=int, default=_D.requests)
    p.add_argument("--max-running", type=int, default=_D.max_running)
    p.add_argument("--prefix-share", type=float, default=_D.prefix_share, help="share of prompts with a common prefix")
    p.add_argument("--slots", type=int, default=None, help="pool slots (default: max-running * 1.5)")
    p.add_argument("--seed", type=int, default=_D.seed)
    p.add_argument("--arrival-rate", type=float, default=_D.arrival_rate, help="requests per step")
    p.add_argument("--fault", choices=FAULTS, default="none", help="break the manager's use on purpose")
    p.add_argument("--executor", default=None, help="torch, npu or reference (default: by device)")
    p.add_argument("--no-verify", action="store_true", help="skip the isolated-generation check")
    p.add_argument("--json", metavar="PATH", help="write the reports as JSON ('-' for stdout)")
    p.add_argument("--trace", metavar="PATH", help="write the slot lifecycle trace (JSON lines)")
    p.set_defaults(func=run)


def _trace_path(base: str | None, model: str, several: bool) -> str | None:
    if base is None or not several:
        return base
    path = Path(base)
    return str(path.with_name(f"{path.stem}.{model}{path.suffix}"))


def run(args: argparse.Namespace) -> int:
    models = list(
        dict.fromkeys(
            m for choice in (args.model or ["all"]) for m in (DEFAULT_MODELS if choice == "all" else [choice])
        )
    )
    try:
        import transformers

        transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # the "falling back to PyTorch" notices
    except ImportError:
        pass
    progress = Progress(args.requests * len(models), "simulate")
    reports: list[SimReport] = []
    for name in models:
        cfg = SimConfig(
            model=name,
            requests=args.requests,
            max_running=args.max_running,
            prefix_share=args.prefix_share,
            seed=args.seed,
            slots=args.slots,
            arrival_rate=args.arrival_rate,
            fault=args.fault,
            executor=args.executor,
            verify=not args.no_verify,
            trace=_trace_path(args.trace, name, len(models) > 1),
        )
        model = build_model(name, args.seed)
        reports.append(anyio.run(simulate, cfg, model, lambda _r, n=name: progress.advance(1, n)))
    progress.close()
    rows = [
        [r.model, r.completed, r.mismatches, r.forks, r.prefix_hits, r.clears, r.clears_elided, r.evictions,
         f"{r.peak_slots_in_use}/{r.num_slots}", r.steps, r.tokens_per_s, f"{100 * r.manager_overhead_fraction:.1f}%"]
        for r in reports
    ]  # fmt: skip
    headers = [
        "model",
        "done",
        "mismatch",
        "forks",
        "hits",
        "clears",
        "elided",
        "evicted",
        "peak",
        "steps",
        "tok/s",
        "mgr",
    ]
    title = f"mambacache simulate: {args.requests} requests, max running {args.max_running}, fault {args.fault}"
    if args.json != "-":
        sys.stdout.write(table(headers, rows, title=title) + "\n")
    if args.json:
        write_json(args.json, [dataclasses.asdict(r) for r in reports])
    bad = [r for r in reports if (r.mismatches > 0) == (args.fault == "none")]
    if args.no_verify:
        return 0
    for r in bad:
        what = f"{r.mismatches} mismatches: {', '.join(r.mismatched_requests[:5])}" if r.mismatches else "no mismatch"
        sys.stderr.write(f"{r.model}: {what} (fault {args.fault})\n")
    return 1 if bad else 0
