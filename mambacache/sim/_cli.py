"""``mambacache simulate``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from .._console import (
    OutputError,
    Progress,
    UsageError,
    check_distinct,
    check_output_path,
    executor_name,
    float_in,
    int_at_least,
    output_path,
    say_written,
    table,
    write_json,
)
from ._config import CHECKPOINTS, FAULTS, MODELS, PD_FAULTS, PREEMPT, SCENARIOS, STATE_DTYPE_NAMES, SimConfig

if TYPE_CHECKING:
    from ._scheduler import SimReport

__all__ = ["add_parser", "run"]

_D = SimConfig()
DEFAULT_MODELS = ("toy", "mamba2", "qwen3-next")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], summary: str) -> None:
    """The ``simulate`` subcommand. One function because it is one flat list of options, read top to bottom."""
    p = sub.add_parser(
        "simulate",
        help=summary,
        description=(
            "Requests arrive (Poisson), share prefixes, fork cached prefix states, reuse dirty slots; every"
            " request is then run alone with greedy generate and the tokens compared. Exits 1 when the check"
            " fails: any mismatch without --fault, or none with one."
        ),
    )
    _add_model_options(p)
    p.add_argument(
        "--requests", type=int_at_least(1), default=_D.requests, help=f"requests per model (default {_D.requests})"
    )
    p.add_argument(
        "--max-running", type=int_at_least(1), default=None, help=f"default: the scenario's, else {_D.max_running}"
    )
    p.add_argument(
        "--prefix-share",
        type=float_in(0, 1),
        default=None,
        help=f"share of prompts with a common prefix (default: the scenario's, else {_D.prefix_share})",
    )
    given = ", ".join(f"{name} {fields['slots']}" for name, fields in SCENARIOS.items() if "slots" in fields)
    p.add_argument(
        "--slots",
        type=int_at_least(2),
        default=None,
        help=f"pool slots (default: the scenario's: {given}; pd takes none)",
    )
    p.add_argument(
        "--seed",
        type=int_at_least(0, SEED_MAX),
        default=_D.seed,
        help=f"seeds the models' weights, the prompts and the arrivals (default {_D.seed})",
    )
    p.add_argument(
        "--arrival-rate", type=float_in(0, low_open=True), default=_D.arrival_rate, help="requests per step (> 0)"
    )
    p.add_argument(
        "--fault",
        choices=[*FAULTS, *PD_FAULTS[1:]],
        default="none",
        help="break the manager's use on purpose (skip-import, kill-peer: --scenario pd)",
    )
    p.add_argument(
        "--speculative",
        type=int_at_least(0),
        default=0,
        metavar="K",
        help="speculative decoding: propose K draft tokens per decode step, verify, commit the accepted state",
    )
    p.add_argument(
        "--draft-accuracy",
        type=float_in(0, 1),
        default=_D.draft_accuracy,
        help="chance that each proposed token is the target's own choice (default 0.7)",
    )
    p.add_argument(
        "--scenario",
        choices=sorted([*SCENARIOS, "pd"]),
        default="prefix",
        help="prefix: checkpoints every block during chunked prefill (default); swap / recompute: fewer slots than"
        " running requests, preemption by swap to host memory or by recompute; host-tier: evicted checkpoints move"
        " to host memory; pd: prefill and decode engines in separate processes, states handed over"
        " (--tp-prefill, --tp-decode, --transfer-timeout). Options given explicitly override the scenario's",
    )
    p.add_argument(
        "--tp-prefill",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="--scenario pd: prefill ranks, each holding a shard that the decode side re-slices (default 1)",
    )
    p.add_argument(
        "--tp-decode",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="--scenario pd: decode ranks, each receiving only its shard; N and --tp-prefill: one divides the other"
        " (default 1)",
    )
    p.add_argument(
        "--transfer-timeout",
        type=float_in(0, low_open=True),
        default=10.0,
        metavar="S",
        help="--scenario pd: seconds one batch of a transfer may take (default 10)",
    )
    p.add_argument(
        "--transport",
        choices=["gloo", "nixl", "mooncake"],
        default="gloo",
        help="--scenario pd: the transfers' transport (nixl, mooncake: their extra installed; default gloo)",
    )
    p.add_argument(
        "--block-size", type=int_at_least(1), default=None, help="prefill chunk and prefix block (default 4)"
    )
    p.add_argument("--max-checkpoints", type=int_at_least(0), default=None, help="prefix checkpoints kept in the pool")
    p.add_argument(
        "--host-checkpoints", type=int_at_least(0), default=None, help="checkpoints kept in host memory once evicted"
    )
    p.add_argument(
        "--reserved",
        type=int_at_least(0),
        default=None,
        metavar="K",
        help="pool slots kept for checkpoints, that requests cannot take (at most --max-checkpoints)",
    )
    p.add_argument("--preempt", choices=PREEMPT, default=None, help="what to do when slots run out")
    _add_prefix_options(p)
    p.add_argument(
        "--threads",
        type=int_at_least(1, THREADS_MAX),
        default=1,
        metavar="N",
        help="torch intra-op threads (default 1: the models are tiny, and on a shared or loaded machine more threads"
        " wait on each other at every op)",
    )
    p.add_argument(
        "--executor",
        type=executor_name(),
        default=None,
        help="a registered executor: torch, npu, reference... (default: by device)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the isolated-generation check")
    p.add_argument(
        "--json", metavar="PATH", type=output_path(stdout=True), help="write the reports as JSON ('-' for stdout)"
    )
    p.add_argument(
        "--trace",
        metavar="PATH",
        type=output_path(),
        help="write the slot lifecycle trace (JSON lines; one file per model when several)",
    )
    p.add_argument("--append", action="store_true", help="append to an existing --trace file instead of refusing")
    p.set_defaults(func=run)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """``--model`` and the toy model's ``--state-dtype``."""
    p.add_argument(
        "--model",
        choices=[*MODELS, "all"],
        action="append",
        help="repeatable; default: all three (the toy model alone with a quantised --state-dtype)",
    )
    p.add_argument(
        "--state-dtype",
        choices=list(STATE_DTYPE_NAMES),
        default="float32",
        help="how the toy model stores its states: int8 or fp8 keep a float32 scale per slot and layer as extra"
        " pool tensors, which must move with the slot for outputs to stay exact (default float32)",
    )


def _add_prefix_options(p: argparse.ArgumentParser) -> None:
    """Where the prefix cache's checkpoints go, and the extra key it keys them by."""
    p.add_argument(
        "--checkpoint",
        choices=CHECKPOINTS,
        default=_D.checkpoint,
        help="where prefills checkpoint: every block boundary (grid, default), or those and the end of the system"
        " prompt wherever it falls in a block (junction)",
    )
    p.add_argument(
        "--adapters",
        type=int_at_least(0),
        default=_D.adapters,
        metavar="N",
        help="requests run under one of N adapters or none (equal ids, another state); the prefix cache keys by it",
    )


SEED_MAX = 2**63 - 2  # torch's generators take an int64, and pd seeds one with seed + 1
THREADS_MAX = 1024  # torch.set_num_threads(100000) crashes the process instead of raising


def _trace_path(base: str | None, model: str, several: bool) -> str | None:
    if base is None or not several:
        return base
    path = Path(base)
    return str(path.with_name(f"{path.stem}.{model}{path.suffix}"))


def run(args: argparse.Namespace) -> int:
    if args.append and args.trace is None:
        raise UsageError("--append appends to a --trace file: give --trace PATH")
    import torch

    # Before any model runs: the tiny models' ops are too small to share between threads, and each op's
    # parallel region waits for every thread to be scheduled (docs/simulator.md, "Threads").
    torch.set_num_threads(args.threads)
    quantised = args.state_dtype != "float32"
    default = ["toy"] if quantised else ["all"]
    models = list(
        dict.fromkeys(
            m for choice in (args.model or default) for m in (DEFAULT_MODELS if choice == "all" else [choice])
        )
    )
    if quantised and models != ["toy"]:
        raise UsageError(f"--state-dtype {args.state_dtype} is for the toy model: the others keep float32 states")
    pd_tp = args.tp_prefill is not None or args.tp_decode is not None
    if args.scenario == "pd" or pd_tp or args.fault in PD_FAULTS[1:]:
        return _pd(args, models)
    scenario = _scenario(args)
    traces = _traces(args, models)
    _load_transformers(models)
    reports = _simulate_all(args, models, scenario, traces)
    if args.json != "-":
        sys.stdout.write(_table(args, scenario, reports) + "\n")
        if args.no_verify:
            sys.stdout.write("verification was off (--no-verify): outputs were not checked\n")
        for name, path in traces.items():
            if path is not None:
                sys.stdout.write(f"trace of {name}: {path}\n")
    if args.json:
        write_json(args.json, [{**dataclasses.asdict(r), "verified": not args.no_verify} for r in reports])
        say_written("JSON", args.json, args.json)
    bad = [r for r in reports if (r.mismatches > 0) == (args.fault == "none")]
    if args.no_verify:
        return 0
    for r in bad:
        what = f"{r.mismatches} mismatches: {', '.join(r.mismatched_requests[:5])}" if r.mismatches else "no mismatch"
        sys.stderr.write(f"{r.model}: {what} (fault {args.fault})\n")
    return 1 if bad else 0


def _pd(args: argparse.Namespace, models: list[str]) -> int:
    """``--scenario pd``, after refusing what only the other scenarios take (and pd's options elsewhere)."""
    from ._pd import run_cli

    if args.scenario != "pd":
        given = [f"--fault {args.fault}"] if args.fault in PD_FAULTS[1:] else []
        given += [f"--{f.replace('_', '-')}" for f in ("tp_prefill", "tp_decode") if getattr(args, f) is not None]
        raise UsageError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --scenario pd")
    if args.fault not in PD_FAULTS:
        raise UsageError(f"--scenario pd takes --fault {', '.join(PD_FAULTS)}")
    if args.speculative or args.trace or args.preempt or args.adapters or args.slots is not None:
        raise UsageError("--scenario pd takes none of --speculative, --trace, --preempt, --adapters, --slots")
    args.tp_prefill = args.tp_prefill or 1
    args.tp_decode = args.tp_decode or 1
    _load_transformers(models)
    return run_cli(args, models)


def _scenario(args: argparse.Namespace) -> dict[str, Any]:
    """The named scenario's SimConfig fields with the explicit options over them; UsageError when they clash."""
    if args.fault == "wrong-commit" and not args.speculative:
        raise UsageError("--fault wrong-commit needs --speculative K")
    scenario = dict(SCENARIOS[args.scenario])
    for key in ("slots", "block_size", "max_checkpoints", "host_checkpoints", "preempt", "reserved"):
        if getattr(args, key) is not None:
            scenario[key] = getattr(args, key)
    for key in ("max_running", "prefix_share"):  # given: it wins; else the scenario's, else SimConfig's default
        if getattr(args, key) is not None:
            scenario[key] = getattr(args, key)
        scenario.setdefault(key, getattr(_D, key))
    preempting = scenario.get("preempt", "none") != "none"
    slots, reserved = scenario.get("slots"), scenario.get("reserved", 0)
    if slots is not None and slots < scenario["max_running"] + max(1, reserved) and not preempting:
        if args.slots is None:
            need = scenario["max_running"] + max(1, reserved)
            raise UsageError(
                f"--scenario {args.scenario} has {slots} slots, too few for --max-running {scenario['max_running']}"
                f" without --preempt (at least max-running + max(1, reserved) = {need}): give --slots {need} or more"
            )
        raise UsageError(
            f"--slots ({slots}) must be at least --max-running ({scenario['max_running']}) + max(1, --reserved"
            f" ({reserved})) without --preempt"
        )
    from ._scheduler import pool_sizes

    try:
        pool_sizes(SimConfig(**scenario))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.fault == "skip-restore" and scenario.get("preempt") != "swap":
        raise UsageError("--fault skip-restore needs preemption by swap: --scenario swap")
    if args.fault == "ignore-key" and not args.adapters:
        raise UsageError("--fault ignore-key needs --adapters N")
    return scenario


def _traces(args: argparse.Namespace, models: list[str]) -> dict[str, str | None]:
    """Each model's trace file, checked to be writable and, without ``--append``, new."""
    traces = {name: _trace_path(args.trace, name, len(models) > 1) for name in models}
    for path in traces.values():
        check_output_path(path)
        check_distinct(("--json", args.json), ("--trace", path))
        if path is not None and Path(path).exists() and not args.append:
            raise UsageError(f"--trace {path} exists: a second run would read as double allocations; pass --append")
    return traces


def _load_transformers(models: list[str]) -> None:
    """Refuse the Hugging Face models without transformers, before any model runs; quiet it where present."""
    if any(m != "toy" for m in models):
        try:
            import transformers
        except ImportError:
            raise UsageError("--model mamba2/qwen3-next need transformers: pip install 'mambacache[hf]'") from None
    try:
        import transformers

        transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # the "falling back to PyTorch" notices
    except ImportError:
        pass


def _simulate_all(
    args: argparse.Namespace, models: list[str], scenario: dict[str, Any], traces: dict[str, str | None]
) -> list[SimReport]:
    """One simulation per model, in order, under one progress bar over all their requests; each trace is written
    under a temporary name beside its own and put in place (or appended, with ``--append``) once every run has
    ended, so an interrupted or failed run leaves the trace files as they were."""
    partial = {name: _partial(path) for name, path in traces.items()}
    try:
        reports = _run_models(args, models, scenario, partial)
    except BaseException:
        for path in partial.values():
            if path is not None:
                Path(path).unlink(missing_ok=True)
        raise
    for name, path in partial.items():
        if path is not None:
            _put_in_place(path, str(traces[name]), append=args.append)
    return reports


def _partial(path: str | None) -> str | None:
    """A hidden name beside ``path`` for the trace while it is written (one folder, so the move is a rename)."""
    if path is None:
        return None
    p = Path(path)
    return str(p.with_name(f".{p.name}.{os.getpid()}.partial"))


def _put_in_place(partial: str, path: str, append: bool) -> None:
    """The finished trace at ``path``: renamed to it (it did not exist: an existing one is refused without
    ``append``), or appended to it; :class:`OutputError` when that cannot be written (the partial trace is
    removed: the run is reported, its trace is not)."""
    try:
        if not append or not Path(path).exists():
            os.replace(partial, path)
            return
        with open(path, "ab") as out, open(partial, "rb") as written:
            shutil.copyfileobj(written, out)
    except OSError as exc:
        raise OutputError(path, exc) from None
    finally:
        Path(partial).unlink(missing_ok=True)


def _run_models(
    args: argparse.Namespace, models: list[str], scenario: dict[str, Any], traces: dict[str, str | None]
) -> list[SimReport]:
    """The simulations themselves, each writing its trace to ``traces``, under one progress bar over their
    requests, run and then verified."""
    phases = 1 if args.no_verify else 2
    with Progress(args.requests * len(models) * phases, "simulate") as progress:
        return [_run_model(args, name, scenario, traces[name], progress) for name in models]


def _run_model(
    args: argparse.Namespace, name: str, scenario: dict[str, Any], trace: str | None, progress: Progress
) -> SimReport:
    cfg = SimConfig(
        model=name,
        requests=args.requests,
        seed=args.seed,
        arrival_rate=args.arrival_rate,
        fault=args.fault,
        executor=args.executor,
        verify=not args.no_verify,
        trace=trace,
        speculative=args.speculative,
        draft_accuracy=args.draft_accuracy,
        state_dtype=args.state_dtype,
        checkpoint=args.checkpoint,
        adapters=args.adapters,
        **scenario,
    )
    from ._models import build_model
    from ._scheduler import simulate

    model = build_model(name, args.seed, args.state_dtype)
    return anyio.run(
        simulate,
        cfg,
        model,
        lambda _r: progress.advance(1, f"{name}: running"),
        lambda: progress.advance(1, f"{name}: verifying"),
    )


def _table(args: argparse.Namespace, scenario: dict[str, Any], reports: list[SimReport]) -> str:
    """The reports as the text table, one row per model."""
    rows = [
        [r.model, r.completed, "-" if args.no_verify else r.mismatches, r.forks,
         f"{r.prefix_hits} ({100 * r.hit_rate:.0f}%)", r.tokens_saved, r.clears, r.clears_elided, r.evictions,
         r.host_offloads, r.swaps or r.recomputes,
         f"{r.peak_slots_in_use}/{r.num_slots}", r.steps, r.tokens_per_s, f"{100 * r.manager_overhead_fraction:.1f}%"]
        + ([f"{r.drafts_accepted}/{r.drafts_proposed}", r.commits] if args.speculative else [])
        + ([r.cross_key_hits] if args.adapters else [])
        for r in reports
    ]  # fmt: skip
    headers = (
        [
            "model",
            "done",
            "mismatch",
            "forks",
            "hits",
            "saved",
            "clears",
            "elided",
            "evicted",
            "to host",
            "swaps" if scenario.get("preempt") != "recompute" else "recomputes",
            "peak",
            "steps",
            "tok/s",
            "mgr",
        ]
        + (["accepted", "commits"] if args.speculative else [])
        + (["x-key hits"] if args.adapters else [])
    )
    title = (
        f"mambacache simulate: scenario {args.scenario}, {args.requests} requests, max running"
        f" {scenario['max_running']}, fault {args.fault}"
    )
    if args.speculative:
        title += f", speculative {args.speculative} draft tokens"
    if scenario.get("reserved") is not None:  # the reserved scenario, or --reserved: 0 too, for comparison
        kept = ", ".join(f"{r.model} {r.checkpoints_kept}" for r in reports)
        title += (
            f", {scenario['reserved']} slots reserved for checkpoints (evicted for requests:"
            f" {sum(r.evicted_for_requests for r in reports)}; fewest kept once filled: {kept})"
        )
    if args.state_dtype != "float32":
        title += f", {args.state_dtype} states with per-slot scales"
    if args.checkpoint != _D.checkpoint:
        title += f", checkpoints at the {args.checkpoint}"
    if args.adapters:
        title += f", {args.adapters} adapters"
    return table(headers, rows, title=title)
