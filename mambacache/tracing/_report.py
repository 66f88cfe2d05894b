"""``mambacache trace``: the analysis as text, JSON or an occupancy plot."""

from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path
from typing import Any

from .._console import output_path, plot_path, save_figure, say_written, table, write_json
from .._core._errors import TraceError
from ._analyze import Entry, TraceAnalysis, analyze

__all__ = ["add_parser", "render_text"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], summary: str) -> None:
    p = sub.add_parser(
        "trace",
        help=summary,
        description="Per-slot timelines of tenants, clears, forks and releases, slots held at the end, anomalies."
        " Exit codes: 0 clean, 1 anomalies found, 2 unusable input or a usage error.",
    )
    p.add_argument("file", type=Path, help="trace written by mambacache.tracing.configure(path, level='debug')")
    p.add_argument("--slot", type=int, action="append", help="only this slot (repeatable)")
    p.add_argument("--request", action="append", help="only slots this request id touched (repeatable)")
    p.add_argument(
        "--expect-idle", action="store_true", help="slots and host slots still held at the end are anomalies (leaks)"
    )
    p.add_argument("--strict", action="store_true", help="any malformed line makes the trace unusable (exit 2)")
    p.add_argument(
        "--json",
        metavar="PATH",
        type=output_path(stdout=True),
        help="write the analysis as JSON to PATH ('-' for stdout)",
    )
    p.add_argument(
        "--plot",
        metavar="PNG",
        type=plot_path(),
        help="draw the selected slots' occupancy over steps (needs matplotlib)",
    )
    p.add_argument("--max-entries", type=_positive, default=50, help="timeline lines shown per slot (default 50)")
    p.set_defaults(func=run)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _describe(e: Entry) -> str:
    if e.action == "alloc":
        return "" if e.cleared else "NOT cleared"
    if e.action == "fork-in":
        return f"<- slot {e.other}"
    if e.action == "fork-out":
        return f"-> slot {e.other}"
    if e.action == "commit":
        return f"{e.other} draft token(s) accepted"
    if e.action == "export":
        return f"-> host slot {e.other}"
    if e.action == "sent":
        return f"to rank {e.peer}, acknowledged"
    if e.action == "import":
        return f"<- host slot {e.other}" + (f", from rank {e.peer}" if e.peer is not None else "")
    return ""


def render_text(analysis: TraceAnalysis, slots: list[int], max_entries: int = 50) -> str:
    out: list[str] = []
    for s in slots:
        entries = analysis.timelines[s]
        tenants = [e.request_id for e in entries if e.action == "alloc"]
        out.append(f"slot {s}: {len(tenants)} tenant(s): {', '.join(str(t) for t in tenants[:8])}")
        for e in entries[:max_entries]:
            step = "-" if e.step is None else e.step
            out.append(f"  step {step:>5}  {e.action:<9} {e.request_id or '-':<12} {_describe(e)}".rstrip())
        if len(entries) > max_entries:
            out.append(f"  ... {len(entries) - max_entries} more")
    out.append("")
    filtered = set(slots) != set(analysis.timelines)
    summary = analysis.summary_for(slots) if filtered else analysis.summary
    title = f"summary ({len(slots)} selected slot(s))" if filtered else "summary"
    out.append(table(["figure", "value"], list(summary.items()), title=title))
    held = {s: t for s, t in analysis.held.items() if s in set(slots)}
    if held:
        out.append(f"held at the end of the trace: {_held_text(held)}")
    host_held = analysis.host_held_for(slots)
    if host_held:
        out.append(f"host slots held at the end of the trace: {_held_text(host_held)}")
    if analysis.bad_lines:
        first = analysis.bad_lines[0]
        out.append(
            f"skipped {len(analysis.bad_lines)} malformed line(s) (--strict refuses them); first: line"
            f" {first.line}: {first.reason}"
        )
    shown = analysis.anomalies_for(slots)
    out.append("")
    if shown:
        out.append(f"anomalies ({len(shown)}):")
        out += [f"  line {a.line}  step {a.step}  {_where(a.slot)}  {a.kind}: {a.message}" for a in shown]
    else:
        out.append("no anomalies")
    return "\n".join(out)


ANOMALY_COLOUR = "red"
"""The anomaly markers' colour: no tenant's bar has it (nor tab20's other red)."""

# Two greys by turns for a prefix cache's checkpoints, so that one checkpoint after another in a slot reads as two.
_CHECKPOINT_GREYS = ((0.45, 0.45, 0.45, 1.0), (0.68, 0.68, 0.68, 1.0))
# tab20's reds (6, 7) would read as anomalies, its greys (14, 15) as checkpoints: requests get the other 16.
_REQUEST_PALETTE = tuple(i for i in range(20) if i not in (6, 7, 14, 15))
# The marks a timeline's entries get: (entry actions, marker, legend text); the legend lists those drawn.
_MARKS = (
    (("fork-in",), ">", "state forked in (copy-on-write)"),
    (("clear",), "x", "cleared (slot.clear; allocations clear on their own line)"),
    (("offload", "export"), "^", "state out to host or a peer"),
    (("restore", "import"), "v", "state in from host or a peer"),
)


def tenant_colour(tenant: str | None) -> tuple[float, ...]:
    """A request's bar colour: one of tab20's non-red, non-grey colours, picked by the request id itself, so a
    request has its colour in every slot and every plot of the trace, whatever else is drawn (ids share the 16
    colours: each bar also names its request where it is wide enough)."""
    import matplotlib

    index = _REQUEST_PALETTE[zlib.crc32(str(tenant).encode()) % len(_REQUEST_PALETTE)]
    return tuple(matplotlib.colormaps["tab20"](index))


def _is_checkpoint(tenant: str | None) -> bool:
    return tenant is not None and tenant.startswith("prefix-cache")


def tenancies(entries: list[Entry], last: int) -> list[tuple[int, int, str | None]]:
    """``(start, end, tenant)`` of each tenancy in a slot's timeline: from an alloc (or a hand-over, which starts
    the new tenant's) to the release (or the next hand-over; ``last`` when the trace ends first)."""
    out: list[tuple[int, int, str | None]] = []
    start: tuple[int, str | None] | None = None
    for e in entries:
        step = e.step or 0
        if e.action in ("alloc", "handover"):
            if start is not None:
                out.append((start[0], step, start[1]))
            start = (step, e.request_id)
        elif e.action == "release" and start is not None:
            out.append((start[0], step, start[1]))
            start = None
    if start is not None:
        out.append((start[0], last, start[1]))
    return out


def plot(analysis: TraceAnalysis, path: str, slots: list[int] | None = None) -> None:
    """Occupancy of ``slots`` (default: all) over steps: one row per slot, a bar per tenancy (a request's colour
    and name; checkpoints in two greys by turns), the marks of :data:`_MARKS` that occur, anomalies ringed in red,
    and a legend of what was drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slots = sorted(analysis.timelines if slots is None else slots)
    last = max((e.step or 0 for s in slots for e in analysis.timelines[s]), default=0) + 1
    fig, ax = plt.subplots(figsize=(11, max(2.5, 0.22 * len(slots) + 1.6)))
    drawn: dict[str, Any] = {}
    for row, s in enumerate(slots):
        _bars(ax, row, tenancies(analysis.timelines[s], last), last, drawn)
        for actions, marker, text in _MARKS:
            steps = [e.step or 0 for e in analysis.timelines[s] if e.action in actions]
            if steps:
                drawn[text] = ax.plot(steps, [row] * len(steps), marker, color="black", markersize=4)[0]
    for a in analysis.anomalies:
        if a.slot is not None and a.slot in slots:
            drawn["anomaly"] = ax.plot(
                a.step or 0, slots.index(a.slot), marker="o", color=ANOMALY_COLOUR, fillstyle="none", markersize=9
            )[0]
    ax.set_yticks(range(len(slots)), [str(s) for s in slots], fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("slot")
    ax.set_title("slot occupancy: a bar per tenancy")
    ax.set_xlim(0, last)
    if drawn:
        ax.legend(drawn.values(), drawn.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    save_figure(fig, path)


def _bars(ax: Any, row: int, spans: list[tuple[int, int, str | None]], last: int, drawn: dict[str, Any]) -> None:
    """One slot's tenancies as bars, white-edged so that two in a row stay two, each request's named on it."""
    from matplotlib.patches import Patch

    checkpoints = 0
    colour: tuple[float, ...]
    for start, end, tenant in spans:
        if _is_checkpoint(tenant):
            colour = _CHECKPOINT_GREYS[checkpoints % 2]
            checkpoints += 1
            drawn.setdefault("prefix-cache checkpoint", Patch(facecolor=_CHECKPOINT_GREYS[0]))
        else:
            colour = tenant_colour(tenant)
            drawn.setdefault(
                "request: a colour per request id, named on its bar", Patch(facecolor="white", edgecolor="black")
            )
        width = max(end - start, 0.6)
        ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolors=colour, edgecolor="white", linewidth=1.0)
        if not _is_checkpoint(tenant) and tenant is not None and width >= 0.045 * last * max(len(tenant), 4) / 5:
            ax.text(start + 0.15, row, tenant, fontsize=5.5, va="center", ha="left", clip_on=True)


def run(args: argparse.Namespace) -> int:
    from .._console import check_distinct, need_matplotlib

    if args.plot:
        need_matplotlib("--plot")
    check_distinct(("the trace", args.file), ("--json", args.json), ("--plot", args.plot))
    try:
        analysis = analyze(args.file, expect_idle=args.expect_idle, strict=args.strict)
    except TraceError as exc:
        sys.stderr.write(f"mambacache trace: {exc}\n")
        return 2
    slots = analysis.select(args.slot, args.request)
    if not slots:
        asked = [f"--slot {s}" for s in args.slot or []] + [f"--request {r}" for r in args.request or []]
        sys.stderr.write(f"mambacache trace: no slot in {args.file} matches {' '.join(asked)}\n")
        return 2
    if args.json != "-":
        sys.stdout.write(render_text(analysis, slots, args.max_entries) + "\n")
    if args.json:
        write_json(args.json, analysis.to_json(slots))
        say_written("JSON", args.json, args.json)
    if args.plot:
        plot(analysis, args.plot, slots)
        where = sys.stderr if args.json == "-" else sys.stdout  # stdout is the JSON's then
        where.write(f"occupancy plot of {len(slots)} slot(s): {args.plot}\n")
    return 1 if analysis.anomalies_for(slots) else 0


def _where(slot: int | None) -> str:
    return "no slot" if slot is None else f"slot {slot}"


def _held_text(held: dict[int, str | None]) -> str:
    shown = ", ".join(f"{s} ({t!r})" for s, t in list(held.items())[:20])
    return shown + (f" and {len(held) - 20} more" if len(held) > 20 else "")
