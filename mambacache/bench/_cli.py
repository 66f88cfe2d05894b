"""``mambacache bench``."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

import torch

from .._console import (
    Progress,
    UsageError,
    check_distinct,
    executor_name,
    float_in,
    int_at_least,
    need_matplotlib,
    output_path,
    plot_path,
    save_figure,
    say_written,
    table,
    write_json,
)
from .._core._errors import PoolAllocationError
from . import _layers
from ._decode import decode_flush
from ._presets import PRESETS, lookup, shard
from ._run import (
    BENCH_EXECUTORS,
    BOUND_SPREAD,
    Result,
    bulk_vs_loop,
    embedding_overhead,
    host_overhead,
    host_tier_overhead,
    planner_scaling,
    run_preset,
    tracing_overhead,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], summary: str) -> None:
    """Add the ``bench`` command to the ``mambacache`` command line."""
    p = sub.add_parser(
        "bench",
        help=summary,
        description="Medians of repeated runs after warm-up; ratios are measured in the same run.",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or npu (default cpu)")
    p.add_argument(
        "--executor",
        action="append",
        type=executor_name(*BENCH_EXECUTORS),
        help="repeatable: a registered executor, or torch-runs / torch-index / torch-direct (the torch executor with"
        " a forced path), torch-inline (no helper threads share a large CPU stage); default: torch, torch-direct,"
        " npu, reference",
    )
    p.add_argument(
        "--preset",
        action="append",
        choices=sorted(PRESETS),
        help="repeatable (default: the real models, whole and sharded as tensor-parallel ranks hold them)",
    )
    p.add_argument(
        "--tp", type=int_at_least(1), default=1, help="shard every preset N ways (heads and conv channels / N)"
    )
    p.add_argument("--sizes", type=_sizes, default=None, help="slots per step, comma-separated (default 1,8,64,256)")
    p.add_argument(
        "--repeats",
        type=int_at_least(1),
        default=None,
        help="timed rounds per figure, after a warm-up; the median is reported (default 9, --quick 5; --transfer 15,"
        " --contended 7)",
    )
    p.add_argument(
        "--budget-gb",
        type=float_in(0, low_open=True),
        default=5.0,
        help=f"peak memory of the run, pools and buffers together (default 5); the pool gets {POOL_SHARE:.0%}% of it"
        " and layers are cut to fit",
    )
    p.add_argument(
        "--workspace-mb", type=float_in(0, low_open=True), default=64.0, help="copy workspace bound of the npu executor"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="the small preset, sizes 1,8,64, 5 repeats: from 15 s to over a minute on a 2-core machine, with its load",
    )
    p.add_argument(
        "--plot", metavar="PNG", type=plot_path(), help="ratio to the bandwidth bound per path and size (matplotlib)"
    )
    p.add_argument(
        "--json", metavar="PATH", type=output_path(stdout=True), help="write every figure as JSON ('-' for stdout)"
    )
    _add_single_rows(p)
    p.set_defaults(func=run)


def _add_single_rows(p: argparse.ArgumentParser) -> None:
    """The options that run one row of the bench alone (each starts its own processes or layouts)."""
    p.add_argument(
        "--transfer",
        action="store_true",
        help="only the state transfer row: StateTransfer of n slots against a plain send/recv of the same bytes,"
        " two gloo processes on 127.0.0.1 (CPU; default preset qwen3-next-80b-a3b-tp8, --quick: small)",
    )
    p.add_argument(
        "--transport",
        choices=["gloo", "nixl", "mooncake"],
        default="gloo",
        help="--transfer: the transport of the transfer and of its plain baseline, a raw transfer of the same bytes"
        " (nixl, mooncake: their extra installed; default gloo)",
    )
    p.add_argument(
        "--contended",
        action="store_true",
        help="only clear, copy, offload and restore, quiet and then with a competing 2-thread torch process that the"
        " bench starts and stops: both ratios side by side (CPU; default preset qwen3-next-80b-a3b-tp8, executor torch;"
        " --quick: small)",
    )
    p.add_argument(
        "--layers",
        action="store_true",
        help="only the per-layer row: a decode step on 36 layers held as per-layer tensors (from_layers) and as one"
        " manager per layer, against the stacked pool (--quick: tiny states only)",
    )


# Besides the pool, a run holds the bandwidth-bound buffers (two of n slots), the sglang
# path's expanded temporaries and the index path's gathers: measured peak RSS is about
# 2.9x the pool on CPU (5.9 GB at a 2 GB pool), so the pool gets a third of --budget-gb.
POOL_SHARE = 0.33


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be at least 1, got {text!r}")
    return sizes


def _check_args(args: argparse.Namespace) -> torch.device:
    """Every argument checked before minutes of work: one line and exit 2 on the first bad one."""
    from .._core._errors import MambaCacheError
    from .._core._torchutil import as_device

    if str(args.device).startswith("npu"):
        from .._executors._npu import import_torch_npu

        try:
            import_torch_npu()  # registers the npu device type with torch
        except Exception as exc:  # ImportError, or the toolkit's own failure to load
            raise UsageError(f"--device npu needs torch_npu and the Ascend toolkit: {exc}") from None
    try:
        device = as_device(args.device)
    except MambaCacheError as exc:
        raise UsageError(f"--device {args.device}: {exc}") from None
    if args.transfer and (device.type != "cpu" or args.plot or args.tp > 1):
        raise UsageError(
            "--transfer runs on CPU over gloo and has no --plot or --tp (pick a sharded --preset);"
            " examples/transfer_gpu_check.py is the GPU check"
        )
    if args.transport != "gloo":
        _check_transport(args)
    if args.contended and (device.type != "cpu" or args.plot or args.transfer):
        raise UsageError("--contended times CPU stages under CPU contention: --device cpu, no --plot or --transfer")
    if args.plot:
        need_matplotlib("--plot")
    check_distinct(("--json", args.json), ("--plot", args.plot))
    return device


def _check_transport(args: argparse.Namespace) -> None:
    from .._core._errors import TransportUnavailableError
    from .._handoff._transports._pick import check_transport, one_host_ucx

    if not args.transfer:
        raise UsageError(f"--transport {args.transport} is the transport of --transfer: give --transfer")
    try:
        check_transport(args.transport)
    except TransportUnavailableError as exc:
        raise UsageError(f"--transport {args.transport}: {exc}") from None
    if args.transport == "nixl":
        one_host_ucx()


def machine(device: torch.device) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
                            "torch_threads": torch.get_num_threads(), "device": str(device)}  # fmt: skip
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f}"


def _bytes(x: int | None) -> str:
    if x is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024  # type: ignore[assignment]
    return str(x)


def render(results: list[Result]) -> str:
    out = []
    for preset in dict.fromkeys(r.preset for r in results):
        rows = [
            [r.slots, r.op, r.path, _ms(r.median_s), f"{_ms(r.min_s)}-{_ms(r.max_s)}", r.gb_s, _vs_bound(r),
             f"{r.vs_sglang:.2f}", _bytes(r.peak_temp_bytes), _bytes(r.noncontiguous_input_bytes),
             "-" if r.host_syncs is None else r.host_syncs, "-" if r.ops is None else r.ops,
             "-" if r.launches is None else r.launches]
            for r in results if r.preset == preset
        ]  # fmt: skip
        layers = next(r.layers for r in results if r.preset == preset)
        spec = lookup(preset).spec
        mib = spec.slot_bytes * layers / spec.num_layers / 2**20
        title = f"{preset}: {layers}/{spec.num_layers} layers, {mib:.2f} MiB per slot as benchmarked"
        headers = [
            "slots",
            "op",
            "path",
            "ms",
            "min-max",
            "GB/s",
            "x bound",
            "x sglang",
            "peak temp",
            "non-contig",
            "syncs",
            "ops",
            "launches",
        ]
        out.append(table(headers, rows, title=title))
    if not all(r.bound_steady for r in results):
        out.append(UNSTEADY_NOTE)
    return "\n\n".join(out)


UNSTEADY_NOTE = (
    f"?: the memset/memcpy baseline moved between rounds (the middle half of its rounds spans more than"
    f" {BOUND_SPREAD:.0%} of its median): that x bound is not a result; rerun on a quieter machine"
)


def _vs_bound(r: Result) -> str:
    return f"{r.vs_bound:.2f}" + ("" if r.bound_steady else "?")


def plot(results: list[Result], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r.preset for r in results))
    ops = ("clear", "copy", "commit", "offload", "restore")
    fig, axes = plt.subplots(len(presets), len(ops), figsize=(5 * len(ops), 3.2 * len(presets)), squeeze=False)
    for row, preset in enumerate(presets):
        for col, op in enumerate(ops):
            ax = axes[row][col]
            sel = [r for r in results if r.preset == preset and r.op == op and r.path not in ("memset", "memcpy")]
            for name in dict.fromkeys(r.path for r in sel):
                pts = [(r.slots, r.vs_bound) for r in sel if r.path == name and r.bound_steady]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            unsteady = [r for r in sel if not r.bound_steady]
            if unsteady:  # a flag along the top at each size, not a point: no ratio is drawn for them
                ax.scatter([r.slots for r in unsteady], [0.95] * len(unsteady), marker="$?$", color="grey", s=60,
                           transform=ax.get_xaxis_transform(), label="baseline unsteady: no ratio")  # fmt: skip
            ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
            ax.set_xscale("log", base=2)
            if sel:  # the sizes timed, drawn or flagged (a flag alone sets no data limits)
                ax.set_xlim(min(r.slots for r in sel) / 1.5, max(r.slots for r in sel) * 1.5)
            ax.set_title(f"{preset}: {op} (1.0 = {'memset' if op == 'clear' else 'memcpy'})", fontsize=9)
            ax.set_xlabel("slots per step")
            ax.set_ylabel("fraction of bandwidth bound")
            if ax.get_legend_handles_labels()[0]:  # an op this run did not time has none
                ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out, dpi=110)


def _bulk_table(rows: list[dict[str, float]]) -> str:
    kinds, forms = ("commit", "offload", "restore"), ("loop", "bulk")
    return table(
        ["n", *(f"{k} {f} us" for k in kinds for f in forms), *(f"{k} x" for k in kinds)],
        [[b["n"], *(b[f"{k}_{f}_us"] for k in kinds for f in forms), *(b[f"{k}_ratio"] for k in kinds)] for b in rows],
        title="bulk forms vs single calls: queue + flush of n, interleaved (x: loop / bulk)",
    )


def _plain(transport: str) -> str:
    return "dist.send/recv" if transport == "gloo" else f"a raw {transport} read"


def _transfer_table(rows: list[dict[str, Any]]) -> str:
    return "\n\n".join(
        table(["slots", "MiB", "transfer ms", "send ms", "x send", "best x", "stage ms", "wire ms", "land ms",
               "in place ms", "x send", "spread ms", "x send", "awaiting ms", "paired x"],
              [[r["slots"], round(r["bytes"] / 2**20, 1), r["transfer_ms"], r["send_ms"], r["ratio"], r["best_ratio"],
                r["stage_ms"], r["wire_ms"], r["land_ms"], r["in_place_ms"], r["in_place_ratio"],
                r["in_place_spread_ms"], r["in_place_spread_ratio"], r["staged_awaiting_ms"],
                "/".join(f"{r[k]:.2f}" for k in ("ratio_paired", "in_place_ratio_paired",
                                                 "in_place_spread_ratio_paired", "staged_awaiting_ratio_paired"))]
               for r in rows if r["preset"] == preset],
              title=f"{preset}: {rows[0]['layers']} layers; StateTransfer vs {_plain(rows[0]['transport'])} of the"
                    f" same bytes ({rows[0]['transport']}, 127.0.0.1), interleaved; x send = transfer / send (medians);"
                    " in place: export(..., in_place=True) of one run of slots, spread: of the transfer's spread slots;"
                    " awaiting: staged into receiver slots that await the states (expect_import);"
                    " paired x: the median of each round's ratio (transfer / in place / spread / awaiting)")
        for preset in dict.fromkeys(r["preset"] for r in rows)
    )  # fmt: skip


def run_transfer(args: argparse.Namespace, device: torch.device) -> int:
    """``bench --transfer``: the transfer row alone (it spawns two processes)."""
    from ._xfer import transfer_vs_send

    presets = args.preset or (["small"] if args.quick else ["qwen3-next-80b-a3b-tp8"])
    sizes, repeats = args.sizes or [1, 8, 64], args.repeats or (5 if args.quick else 15)
    try:
        budget = int(args.budget_gb * 2**30)
        rows = [r for p in presets for r in transfer_vs_send(p, sizes, repeats, budget, transport=args.transport)]
    except Exception as exc:  # a rank's error as the spawn reports it: wrong bytes, a dead peer, a timeout
        last = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        sys.stderr.write(f"mambacache bench --transfer: a rank failed: {last[0]}\n")
        return 1
    info = {**machine(device), "rank_threads": 1}  # each of the two ranks runs one torch thread
    if args.json != "-":
        sys.stdout.write(f"machine: {info}\n\n{_transfer_table(rows)}\n")
    if args.json:
        write_json(args.json, {"machine": info, "transfer": rows})
        say_written("JSON", args.json, args.json)
    return 0


def _contended_table(rows: list[dict[str, Any]]) -> str:
    return "\n\n".join(
        table(["slots", "op", "path", "quiet ms", "x bound", "x sglang", "contended ms", "x bound", "x sglang"],
              [[r["slots"], r["op"], r["path"], r["quiet_ms"], f"{r['quiet_x_bound']:.2f}",
                f"{r['quiet_x_sglang']:.2f}", r["contended_ms"], f"{r['contended_x_bound']:.2f}",
                f"{r['contended_x_sglang']:.2f}"] for r in rows if r["preset"] == preset],
              title=f"{preset}: {rows[0]['layers']} layers; quiet, then with a 2-thread torch process computing"
                    " (x bound: memset/memcpy time over this one; x sglang: SGLang's pre-fix path's)")
        for preset in dict.fromkeys(r["preset"] for r in rows)
    )  # fmt: skip


def run_contended(args: argparse.Namespace, device: torch.device) -> int:
    """``bench --contended``: clear, copy, offload and restore, quiet and under a competing process (it starts
    and stops it)."""
    from ._contend import contended

    presets = args.preset or (["small"] if args.quick else ["qwen3-next-80b-a3b-tp8"])
    sizes, repeats = args.sizes or ([8, 64] if args.quick else [8, 64, 256]), args.repeats or (5 if args.quick else 7)
    rows = contended(presets, sizes, args.executor or ["torch"], device, repeats,
                     int(args.budget_gb * POOL_SHARE * 2**30), int(args.workspace_mb * 2**20))  # fmt: skip
    info = {**machine(device), "competitor_threads": 2}
    if args.json != "-":
        sys.stdout.write(f"machine: {info}\n\n{_contended_table(rows)}\n")
    if args.json:
        write_json(args.json, {"machine": info, "contended": rows})
        say_written("JSON", args.json, args.json)
    return 0


def run(args: argparse.Namespace) -> int:
    """``mambacache bench``. One function because it is the report's layout, row after row, as printed."""
    device = _check_args(args)
    if args.transfer:
        return run_transfer(args, device)
    if args.contended:
        return run_contended(args, device)
    if args.layers:
        return _layers.run(args.repeats or (5 if args.quick else 9), args.json, args.quick)
    presets = args.preset or (["small"] if args.quick else [p for p in PRESETS if p != "small"])
    if args.tp > 1:
        try:
            presets = list(dict.fromkeys(shard(p.split("-tp")[0], args.tp).name for p in presets))
        except ValueError as exc:
            raise UsageError(f"--tp {args.tp}: {exc}") from None
    sizes = args.sizes or ([1, 8, 64] if args.quick else [1, 8, 64, 256])
    repeats = args.repeats or (5 if args.quick else 9)
    executors = args.executor or ["torch", "torch-direct", "npu", "reference"]
    started = time.perf_counter()
    results: list[Result] = []
    with Progress(len(presets) * len(sizes) * 5 * (len(executors) + 2), "bench") as progress:
        for preset in presets:
            try:
                budget, workspace = int(args.budget_gb * POOL_SHARE * 2**30), int(args.workspace_mb * 2**20)
                for r in run_preset(preset, sizes, executors, device, repeats, budget, workspace):
                    results.append(r)
                    progress.advance(1, f"{preset} {r.op} {r.path} n={r.slots}")
            except PoolAllocationError as exc:  # a preset's pool for the largest size: before its first row
                raise UsageError(f"--sizes {max(sizes)}: {exc}") from None
            progress.line(f"{preset} done")
    host = host_overhead([10, 100, 1000], repeats)
    trace = tracing_overhead(1000, repeats)
    embed = embedding_overhead(repeats)
    decode = decode_flush(repeats)
    tier = host_tier_overhead(repeats)
    layered = _layers.layer_overhead(repeats, quick=args.quick)
    planning, bulk = planner_scaling([10, 100, 1000, 10000], repeats), bulk_vs_loop([1, 64, 1000], repeats)
    info = machine(device)
    if args.json != "-":
        lines = [f"machine: {info}", "", render(results), "",
                 table(["events/flush", "us/event", "min", "max"],
                       [[h["events_per_flush"], h["us_per_event"], h["min_us"], h["max_us"]] for h in host],
                       title="host overhead: submit + plan + bookkeeping"),
                 "",
                 f"tracing off: {trace['checks']} checks x {trace['check_ns']:.0f} ns in a"
                 f" {trace['flush_us_tracing_off']:.0f} us flush of {trace['events']} events"
                 f" = {100 * trace['overhead_fraction']:.2f}% overhead",
                 "",
                 table(["call", "us/event"],
                       [[f"{name}_many x {embed['bulk_events']:.0f}", embed[f"bulk_{name}_us_per_event"]]
                        for name in ("clear", "copy", "release")],
                       title="bulk submits (numpy arrays, tenant-checked)"),
                 f"decode step (8 events: submit + plan + execute via flush_nowait): median"
                 f" {embed['decode_step_us']:.1f} us, min {embed['decode_step_min_us']:.1f} us",
                 f"decode flush (2 releases, 2 allocs, 2 forks; await flush) vs its one op (_foreach_copy_ +"
                 f" an anyio checkpoint): {decode['flush_us']:.1f} vs {decode['op_us']:.1f} us ="
                 f" {decode['ratio']:.2f}x; the floor, the same step in Python with nothing but its work (no lock,"
                 f" tenants, trace or report): {decode['floor_us']:.1f} us = {decode['floor_ratio']:.2f}x",
                 f"host tier, per slot (submit + plan, {tier['events']:.0f} a step): offload + release"
                 f" {tier['offload_release_us_per_slot']:.2f} us, alloc + restore"
                 f" {tier['alloc_restore_us_per_slot']:.2f} us",
                 "",
                 table(["events/step", "swap us/event", "swap+refill us/event"],
                       [[p["events"], p["swap_us_per_event"], p["swap+refill_us_per_event"]] for p in planning],
                       title="planner alone: commit + offload + release per request (flat = linear)"),
                 "\n" + _bulk_table(bulk),
                 "\n" + _layers.render(layered),
                 f"({time.perf_counter() - started:.1f} s)"]  # fmt: skip
        sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        write_json(args.json, {"machine": info, "results": [r.to_json() for r in results], "host_overhead": host,
                               "tracing_overhead": trace, "embedding_overhead": embed, "bulk_vs_loop": bulk,
                               "host_tier_overhead": tier, "planner_scaling": planning,
                               "decode_flush": decode, "layer_overhead": layered})  # fmt: skip
        say_written("JSON", args.json, args.json)
    if args.plot:
        plot(results, args.plot)
        say_written("plot", args.plot, args.json)
    return 0
