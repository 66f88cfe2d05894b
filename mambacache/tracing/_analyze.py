"""Reads a JSON-lines lifecycle trace back: per-slot timelines, a summary, anomalies, leaks.

Pure Python, so traces from production can be analysed anywhere. Every line is
checked before it is used: a malformed mambacache event (a missing or non-integer
slot, NaN, a string where a bool belongs, an integer past the parser's digit
limit, deep nesting, bytes that are not UTF-8) is named with its line number and
skipped, never crashed on. A file with no slot lifecycle events at all is refused
with the reason, never reported as clean.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._core._errors import TraceError
from ._handoff import Handoffs

__all__ = ["Anomaly", "BadLine", "Entry", "TraceAnalysis", "analyze", "analyze_lines", "parse_lines"]

SLOT_EVENTS = frozenset(
    {
        "slot.alloc",
        "slot.release",
        "slot.clear",
        "slot.cow",
        "slot.commit",
        "slot.offload",
        "slot.restore",
        "slot.handover",
        "slot.export",
        "slot.import",
        "slot.expect",
    }
)
STEP_EVENTS = frozenset({"step.flush", "step.error"})
TIER_EVENTS = frozenset({"host.drop", "prefix.hit", "prefix.miss", "prefix.insert", "prefix.evict", "prefix.fork"})
TRANSFER_EVENTS = frozenset(
    {"transfer.send", "transfer.receive", "transfer.failed", "transfer.withdraw", "transfer.discard"}
)
_PREFIXES = ("slot.", "step.", "host.", "prefix.", "transfer.")
ANOMALY_KINDS = (
    "double-release",
    "use-after-release",
    "copy-from-released",
    "uncleared-reuse",
    "double-alloc",
    "held-at-end",
    "host-held-at-end",
    "restore-from-dropped",
    "fork-from-evicted",
    "read-before-import",
    "import-never-completed",
    "export-undelivered",
    "export-misrouted",
)


@dataclass(frozen=True, slots=True)
class Entry:
    """One line of a slot's timeline."""

    line: int
    step: int | None
    action: str  # alloc, clear, fork-in, fork-out, commit, offload, restore, release, handover, export, sent, import
    request_id: str | None
    other: int | None = None  # the other slot of a fork; the accepted count of a commit; the host slot
    cleared: bool | None = None
    peer: int | None = None  # the rank an export was sent to (``sent``) or an import came from, when traced


@dataclass(frozen=True, slots=True)
class Anomaly:
    """Something the trace shows went wrong; ``kind`` is one of ``ANOMALY_KINDS``.

    ``slot`` is the pool slot it concerns; None only for a received state that
    never reached one (``import-never-completed``), which goes with its request.
    """

    kind: str
    slot: int | None
    step: int | None
    line: int
    request_id: str | None
    message: str


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that was skipped, and why."""

    line: int
    reason: str


@dataclass(slots=True)
class TraceAnalysis:
    """What :func:`analyze` found.

    ``timelines``: per slot, its entries in trace order. ``held``: slots still
    allocated at the end of the trace, with their tenants (a leak if the engine
    was idle); ``host_held``: host slots still holding an offloaded state at the
    end, with the offload's tenant (a swapped-out request never restored or
    dropped). ``bad_lines``: malformed mambacache events that were skipped.
    ``summary``: counts over the whole trace (see :meth:`summary_for` for a subset).
    """

    timelines: dict[int, list[Entry]] = field(default_factory=dict)
    anomalies: list[Anomaly] = field(default_factory=list)
    summary: dict[str, int] = field(default_factory=dict)
    held: dict[int, str | None] = field(default_factory=dict)
    host_held: dict[int, str | None] = field(default_factory=dict)
    bad_lines: list[BadLine] = field(default_factory=list)
    lines: int = 0
    other_lines: int = 0  # lines that are not mambacache events (an application's own log lines)

    def select(self, slots: Iterable[int] | None = None, requests: Iterable[str] | None = None) -> list[int]:
        """Slots in the trace, narrowed to ``slots`` and to those any of ``requests`` touched."""
        chosen = set(self.timelines)
        if slots is not None:
            chosen &= set(slots)
        if requests is not None:
            wanted = set(requests)
            chosen = {s for s in chosen if any(e.request_id in wanted for e in self.timelines[s])}
        return sorted(chosen)

    def summary_for(self, slots: Iterable[int]) -> dict[str, int]:
        """The summary counted over ``slots`` only (steps stay whole-trace)."""
        keep = set(slots)
        entries = [e for s in keep for e in self.timelines.get(s, [])]
        count = {a: sum(e.action == a for e in entries) for a in ("alloc", "clear", "fork-in", "release")}
        return {
            "steps": self.summary.get("steps", 0),
            "slots_used": len(keep & set(self.timelines)),
            "requests": len({e.request_id for e in entries if e.request_id is not None}),
            "allocs": count["alloc"],
            "allocs_uncleared": sum(e.action == "alloc" and e.cleared is False for e in entries),
            "clears": count["clear"],
            "forks": count["fork-in"],
            "releases": count["release"],
            "held_at_end": len(keep & set(self.held)),
            "host_held_at_end": len(self.host_held_for(keep)),
            "anomalies": len(self.anomalies_for(keep)),
            "bad_lines": len(self.bad_lines),
        }

    def anomalies_for(self, slots: Iterable[int]) -> list[Anomaly]:
        """The anomalies on ``slots``, and those on no pool slot (a received state never imported) whose request
        touched one of them: all of those when ``slots`` covers the whole trace."""
        keep = set(slots)
        slotless = [a for a in self.anomalies if a.slot is None]
        if slotless and not keep >= set(self.timelines):
            touched = {e.request_id for s in keep for e in self.timelines.get(s, ())}
            slotless = [a for a in slotless if a.request_id in touched]
        chosen = {id(a) for a in slotless}
        return [a for a in self.anomalies if a.slot in keep or id(a) in chosen]

    def host_held_for(self, slots: Iterable[int]) -> dict[int, str | None]:
        """``host_held`` narrowed to host slots offloaded from one of ``slots``: a ``--slot`` or ``--request``
        view shows the swapped-out states of what it selected, as ``held`` shows its slots."""
        keep = set(slots)
        latest: dict[int, tuple[int, int]] = {}  # host slot -> (line, pool slot) of the offload that filled it
        for s, entries in self.timelines.items():
            for e in entries:
                if e.action == "offload" and e.other in self.host_held and e.line >= latest.get(e.other, (-1, 0))[0]:
                    latest[e.other] = (e.line, s)
        return {h: t for h, t in self.host_held.items() if h in latest and latest[h][1] in keep}

    def to_json(self, slots: Iterable[int] | None = None) -> dict[str, Any]:
        """The analysis as JSON-ready data, narrowed to ``slots`` (summary included) when given."""
        keep = set(self.timelines) if slots is None else set(slots)
        return {
            "summary": self.summary if slots is None else self.summary_for(keep),
            "slots": {str(s): [asdict(e) for e in self.timelines[s]] for s in sorted(keep) if s in self.timelines},
            "held": {str(s): t for s, t in sorted(self.held.items()) if s in keep},
            "host_held": {str(h): t for h, t in sorted(self.host_held_for(keep).items())},
            "anomalies": [asdict(a) for a in self.anomalies_for(keep)],
            "bad_lines": [asdict(b) for b in self.bad_lines],
        }


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _int(record: dict[str, Any], key: str, *, required: bool) -> int | None:
    value = record.get(key)
    if value is None and not required:
        return None
    if type(value) is not int:  # bool, float, str, list, dict, null: all refused
        what = "missing" if key not in record else f"{type(value).__name__} {value!r}"[:60]
        raise ValueError(f"{key!r} must be an integer, got {what}")
    if value < 0:
        raise ValueError(f"{key!r} must be >= 0, got {value}")
    return value


def _checked(record: dict[str, Any]) -> dict[str, Any]:
    """The fields the analysis reads, type-checked; raises ValueError naming the first bad one."""
    event = record["event"]
    out: dict[str, Any] = {"event": event, "step": _int(record, "step", required=False)}
    rid = record.get("request_id")
    if rid is not None and type(rid) is not str:
        raise ValueError(f"'request_id' must be a string or null, got {type(rid).__name__}")
    out["request_id"] = rid
    if event == "slot.cow":
        out["src"], out["dst"] = _int(record, "src", required=True), _int(record, "dst", required=True)
        out["shift"] = _int(record, "shift", required=False) or 0  # a shifted copy forks as a copy does
        out["temporal_src"] = _int(record, "temporal_src", required=False)  # a second source, read as src is
    elif event in _HOST_EVENTS:
        out["slot"] = _int(record, "slot", required=True)
        if "host" not in record:  # present on every such line: null only for an export or import in place
            raise ValueError("'host' must be an integer (null: in place), got missing")
        out["host"] = _int(record, "host", required=event in _STAGED)
        out["peer"] = _int(record, "peer", required=False)
        out["to"] = _int(record, "to", required=False)  # an export's destination rank, when routed
        keep = record.get("keep", False)
        if type(keep) is not bool:
            raise ValueError(f"'keep' must be true or false, got {type(keep).__name__} {keep!r}"[:80])
        out["keep"] = keep
    elif event == "host.drop":
        out["host"] = _int(record, "host", required=True)
    elif event.startswith("prefix."):
        for key in ("slot", "src", "host", "length"):
            out[key] = _int(record, key, required=key == "length" and event != "prefix.miss")
    elif event in SLOT_EVENTS:
        out["slot"] = _int(record, "slot", required=True)
        if event == "slot.commit":
            out["accepted"] = _int(record, "accepted", required=True)
        if event == "slot.handover":
            to = record.get("to")
            if to is not None and type(to) is not str:
                raise ValueError(f"'to' must be a string or null, got {type(to).__name__}")
            out["to"] = to
        if event == "slot.alloc":
            cleared = record.get("cleared", True)
            if type(cleared) is not bool:
                raise ValueError(f"'cleared' must be true or false, got {type(cleared).__name__} {cleared!r}"[:80])
            out["cleared"] = cleared
    elif event == "step.flush":
        for key in ("events", "elided"):
            out[key] = _int(record, key, required=False) or 0
    elif event in TRANSFER_EVENTS:
        _check_transfer(record, out)
    return out


_HOST_EVENTS = frozenset({"slot.offload", "slot.restore", "slot.export", "slot.import"})
_STAGED = frozenset({"slot.offload", "slot.restore"})  # always through a host slot


def _check_transfer(record: dict[str, Any], out: dict[str, Any]) -> None:
    """A transfer line's ``peer`` (none on a withdraw or discard) and ``request_ids``, and a receive's ``hosts``
    or, landed in place, ``slots`` (one per id)."""
    out["peer"] = _int(record, "peer", required=record["event"] not in ("transfer.withdraw", "transfer.discard"))
    ids = record.get("request_ids")
    if type(ids) is not list or not all(type(r) is str for r in ids):
        raise ValueError(f"'request_ids' must be a list of strings, got {type(ids).__name__}")
    out["request_ids"] = ids
    if record["event"] == "transfer.receive":
        key = "slots" if "slots" in record else "hosts"
        where = record.get(key)
        if type(where) is not list or len(where) != len(ids) or not all(type(h) is int and h >= 0 for h in where):
            raise ValueError(f"{key!r} must list one {key[:-1]} (an integer >= 0) per request id")
        out[key] = where
    error = record.get("error")
    out["error"] = error if type(error) is str else None


def parse_lines(lines: Iterable[bytes | str]) -> tuple[list[tuple[int, dict[str, Any]]], list[BadLine], int, int]:
    """Checked mambacache records with their line numbers, the bad lines, the line count, other lines."""
    records: list[tuple[int, dict[str, Any]]] = []
    bad: list[BadLine] = []
    other = number = 0
    for number, raw in enumerate(lines, start=1):
        if isinstance(raw, bytes):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad.append(BadLine(number, f"not UTF-8 (byte {exc.start})"))
                continue
        else:
            text = raw
        if number == 1:
            text = text.removeprefix("\ufeff")  # a UTF-8 BOM from an editor
        text = text.strip()
        if not text:
            continue
        try:
            record = json.loads(text, parse_constant=_reject_constant)
        except RecursionError:
            bad.append(BadLine(number, "nested too deeply to be a trace record"))
            continue
        except ValueError as exc:  # JSONDecodeError, NaN/Infinity, an integer past the digit limit
            if text.startswith("{"):
                bad.append(BadLine(number, f"not valid JSON: {str(exc).splitlines()[0][:80]}"))
            else:
                other += 1
            continue
        event = record.get("event") if isinstance(record, dict) else None
        if not isinstance(event, str) or not (
            event in SLOT_EVENTS or event in STEP_EVENTS or event in TIER_EVENTS or event in TRANSFER_EVENTS
        ):
            if isinstance(event, str) and event.startswith(_PREFIXES):
                bad.append(BadLine(number, f"unknown mambacache event {event!r}"[:80]))
            else:
                other += 1
            continue
        try:
            records.append((number, _checked(record)))
        except ValueError as exc:
            bad.append(BadLine(number, f"{event}: {exc}"))
    return records, bad, number, other


def analyze(path: str | Path, *, expect_idle: bool = False, strict: bool = False) -> TraceAnalysis:
    """Analyse the trace file at ``path``.

    Raises :class:`TraceError` (a ``ValueError``) when the file cannot be used:
    missing, a directory, unreadable, with no slot lifecycle events (empty,
    truncated, not a trace, or traced at info level), or, with ``strict``, with
    any malformed line. ``expect_idle`` makes every slot still held at the end an
    anomaly (``held-at-end``), as an idle engine's leak check would.
    """
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file")
    if p.is_dir():
        raise TraceError(f"{p}: is a directory, not a trace file")
    try:
        with p.open("rb") as f:
            analysis = analyze_lines(f, expect_idle=expect_idle, strict=strict, name=str(p))
    except OSError as exc:
        raise TraceError(f"{p}: cannot read: {exc.strerror or exc}") from None
    return analysis


def analyze_lines(
    lines: Iterable[bytes | str], *, expect_idle: bool = False, strict: bool = False, name: str = "trace"
) -> TraceAnalysis:
    """:func:`analyze` on lines already read (bytes or str)."""
    records, bad, count, other = parse_lines(lines)
    if strict and bad:
        first = bad[0]
        raise TraceError(f"{name}: {len(bad)} malformed line(s) (--strict); line {first.line}: {first.reason}")
    if not any(r["event"] in SLOT_EVENTS for _, r in records):
        raise TraceError(f"{name}: {_why_unusable(records, bad, count, other)}")
    out = _analyze_records(records, expect_idle)
    out.bad_lines, out.lines, out.other_lines = bad, count, other
    out.summary["bad_lines"] = len(bad)
    return out


def _why_unusable(records: list[tuple[int, dict[str, Any]]], bad: list[BadLine], count: int, other: int) -> str:
    if count == 0:
        return "empty: no slot lifecycle events to analyse"
    flushes = sum(r["event"] == "step.flush" for _, r in records)
    if flushes:
        return (
            f"no slot lifecycle events, only {flushes} step.flush summaries: the trace was written at info level;"
            " trace at debug to record slots: tracing.configure(path, level='debug')"
        )
    if bad:
        return (
            f"no usable slot lifecycle events: all {len(bad)} mambacache line(s) are malformed"
            f" (first: line {bad[0].line}: {bad[0].reason})"
        )
    return f"not a mambacache trace: none of its {count} line(s) is a slot lifecycle event"


@dataclass(slots=True)
class _Slot:
    allocated: bool = False
    initialized: bool = False
    released_at: int | None = None  # line of the release that freed it
    tenant: str | None = None
    flagged_uncleared: bool = False
    flagged_import: bool = False  # read-before-import reported for this tenancy (its state never imported)
    awaiting: bool = False  # allocated to await its state in place: not run before its import
    since: int = 0  # line of the alloc that began this tenancy
    taint: str = ""  # why an uninitialised slot is so, for the message


_COUNTS = (
    "steps",
    "allocs",
    "allocs_uncleared",
    "clears",
    "forks",
    "commits",
    "releases",
    "clears_elided",
    "events_flushed",
    "offloads",
    "restores",
    "host_drops",
    "prefix_hits",
    "prefix_misses",
    "prefix_inserts",
    "prefix_evictions",
    "exports",
    "imports",
    "states_sent",
    "states_received",
    "transfer_failures",
)


class _Pass:
    """One pass over the records: each slot's state, the counts, and what the analysis has found so far.

    Each ``slot.*`` event has its handler below, called in trace order; anomalies
    are appended as they are seen, so their order is the trace's.
    """

    __slots__ = ("counts", "evicted", "handoffs", "host_from", "host_held", "out", "requests", "slots")

    def __init__(self) -> None:
        self.out = TraceAnalysis()
        self.slots: dict[int, _Slot] = {}
        self.counts = dict.fromkeys(_COUNTS, 0)
        self.handoffs = Handoffs(self.flag, self.counts)
        self.host_held: dict[int, bool] = {}  # held host slot -> whether its state was initialised
        self.host_from: dict[int, tuple[int, str | None]] = {}  # held host slot -> (pool slot, tenant) of its offload
        self.evicted: dict[int, int] = {}  # checkpoint slot evicted (and not allocated since) -> line of the eviction
        self.requests: set[str] = set()

    def flag(self, kind: str, slot: int | None, line: int, step: int | None, rid: str | None, message: str) -> None:
        """Record an anomaly."""
        self.out.anomalies.append(Anomaly(kind, slot, step, line, rid, message))

    def awaited_read(self, slot: int, st: _Slot, line: int, step: int | None, rid: str | None, what: str) -> None:
        """``what`` reads ``slot``: a read-before-import when it awaits its tenant's state from a peer
        (``slot.expect``, no import since), since it holds no state yet (the manager refuses such a read)."""
        if st.awaiting and not st.flagged_import:
            st.flagged_import = True
            message = (
                f"{what} slot {slot} while it awaits the state of {st.tenant!r} from a peer (a slot.expect with no"
                " slot.import since): it holds no state yet"
            )
            self.flag("read-before-import", slot, line, step, rid, message)

    def entry(self, slot: int, e: Entry) -> None:
        """Append ``e`` to the slot's timeline."""
        self.out.timelines.setdefault(slot, []).append(e)

    def flush(self, r: dict[str, Any], line: int, step: int | None) -> None:
        """``step.flush``: a step ran, so every allocated slot still uninitialised was used with stale state,
        and so was every slot held by a request whose received state is still waiting to be imported."""
        self.counts["steps"] += 1
        self.counts["clears_elided"] += r["elided"]
        self.counts["events_flushed"] += r["events"]
        handoffs = self.handoffs
        handoffs.flushed(step)
        for s, st in self.slots.items():
            if st.allocated and not st.initialized and not st.flagged_uncleared and not st.awaiting:
                st.flagged_uncleared = True
                why = st.taint or "with neither a clear nor a fork into it since its alloc"
                message = f"slot {s} (tenant {st.tenant}) was used by step {step} {why}: it holds stale state"
                self.flag("uncleared-reuse", s, line, step, st.tenant, message)
            waiting = handoffs.waiting(st.tenant) if st.allocated and not st.flagged_import else None
            if waiting is not None and waiting[2] < st.since:  # a tenancy begun after the state arrived, not by it
                st.flagged_import = True
                where, peer, at = waiting
                message = (
                    f"slot {s} (tenant {st.tenant}) was used by step {step} while the state received for"
                    f" {st.tenant!r} from rank {peer} (line {at}) still waits in {where}, never"
                    " imported: the slot does not hold it"
                )
                self.flag("read-before-import", s, line, step, st.tenant, message)

    def cow(self, r: dict[str, Any], line: int, step: int | None, rid: str | None) -> None:
        """``slot.cow``: the fork's target inherits its sources' initialisation (or lack of it): ``src``, and
        ``temporal_src`` when the copy reads its temporal state from a second slot, each checked as a read."""
        src, dst, second = r["src"], r["dst"], r["temporal_src"]
        sources = [src] if second is None or second == src else [src, second]
        s_dst = self.slots.setdefault(dst, _Slot())
        self.counts["forks"] += 1
        initialized, taint = True, ""
        for s in sources:
            s_src = self.slots.setdefault(s, _Slot())
            if not s_src.allocated:
                message = f"fork {src} -> {dst} reads slot {s}, which is free"
                self.flag("copy-from-released", s, line, step, rid, message)
            if s in self.evicted:
                message = f"fork {src} -> {dst} reads checkpoint slot {s}, evicted on line {self.evicted[s]}"
                self.flag("fork-from-evicted", s, line, step, rid, message)
            self.handoffs.read(s, line, step, rid, f"fork {src} -> {dst} reads")
            self.awaited_read(s, s_src, line, step, rid, f"fork {src} -> {dst} reads")
            if initialized and not s_src.initialized:
                initialized, taint = False, f"forked from slot {s}, itself never cleared"
        if not s_dst.allocated:
            message = f"fork {src} -> {dst} writes slot {dst}, which is free"
            self.flag("use-after-release", dst, line, step, rid, message)
        s_dst.initialized, s_dst.taint = initialized, taint
        for s in sources:
            self.entry(s, Entry(line, step, "fork-out", rid, other=dst))
        self.entry(dst, Entry(line, step, "fork-in", rid, other=src))

    def alloc(self, slot: int, st: _Slot, r: dict[str, Any], line: int, step: int | None, rid: str | None) -> None:
        """``slot.alloc``: a new tenant; its state is initialised only if the alloc cleared it."""
        self.counts["allocs"] += 1
        cleared = r["cleared"]
        self.counts["allocs_uncleared"] += not cleared
        if st.allocated:
            message = f"slot {slot} allocated to {rid} while {st.tenant} holds it"
            self.flag("double-alloc", slot, line, step, rid, message)
        st.allocated, st.initialized, st.tenant, st.flagged_uncleared = True, cleared, rid, False
        st.taint, st.flagged_import, st.since, st.awaiting = "", False, line, False
        self.handoffs.gone(slot)
        self.evicted.pop(slot, None)
        self.entry(slot, Entry(line, step, "alloc", rid, cleared=cleared))

    def commit(self, slot: int, st: _Slot, r: dict[str, Any], line: int, step: int | None, rid: str | None) -> None:
        """``slot.commit``: a speculative step's accepted state written into the slot."""
        self.counts["commits"] += 1
        if not st.allocated:
            self.flag("use-after-release", slot, line, step, rid, f"commit into slot {slot}, which is free")
        self.handoffs.read(slot, line, step, rid, "a commit of draft tokens into")
        self.awaited_read(slot, st, line, step, rid, "a commit of draft tokens into")
        self.entry(slot, Entry(line, step, "commit", rid, other=r["accepted"]))

    def clear(self, slot: int, st: _Slot, r: dict[str, Any], line: int, step: int | None, rid: str | None) -> None:
        """``slot.clear``: the slot's state is initialised from here on."""
        self.counts["clears"] += 1
        if not st.allocated:
            self.flag("use-after-release", slot, line, step, rid, f"clear of slot {slot}, which is free")
        st.initialized, st.taint = True, ""
        self.entry(slot, Entry(line, step, "clear", rid))

    def offload(self, slot: int, st: _Slot, r: dict[str, Any], line: int, step: int | None, rid: str | None) -> None:
        """``slot.offload``: the host slot now holds this slot's state, initialised or not."""
        self.counts["offloads"] += 1
        if not st.allocated:
            self.flag("use-after-release", slot, line, step, rid, f"offload of slot {slot}, which is free")
        self.handoffs.read(slot, line, step, rid, "an offload reads")
        self.awaited_read(slot, st, line, step, rid, "an offload reads")
        self.host_held[r["host"]] = st.initialized
        self.host_from[r["host"]] = (slot, rid)
        self.entry(slot, Entry(line, step, "offload", rid, other=r["host"]))

    def restore(self, slot: int, st: _Slot, r: dict[str, Any], line: int, step: int | None, rid: str | None) -> None:
        """``slot.restore``: the slot takes the host slot's state, which stays held only with ``keep``."""
        self.counts["restores"] += 1
        h = r["host"]
        if h not in self.host_held:
            message = f"restore of host slot {h} into slot {slot}: the host slot holds no state (dropped or freed)"
            self.flag("restore-from-dropped", slot, line, step, rid, message)
        if not st.allocated:
            self.flag("use-after-release", slot, line, step, rid, f"restore into slot {slot}, which is free")
        st.initialized, st.taint = self.host_held.get(h, False), ""
        if not r["keep"]:
            self.host_held.pop(h, None)
            self.host_from.pop(h, None)
        self.entry(slot, Entry(line, step, "restore", rid, other=h))

    def handover(self, slot: int, st: _Slot, r: dict[str, Any], line: int, step: int | None, rid: str | None) -> None:
        """``slot.handover``: the slot keeps its state and gets a new tenant (the timeline names the new one)."""
        if not st.allocated:
            self.flag("use-after-release", slot, line, step, rid, f"hand-over of slot {slot}, which is free")
        st.tenant = r["to"]
        if r["to"] is not None:
            self.requests.add(r["to"])
        self.entry(slot, Entry(line, step, "handover", r["to"]))

    def expect(self, slot: int, st: _Slot, r: dict[str, Any], line: int, step: int | None, rid: str | None) -> None:
        """``slot.expect``: the slot, just allocated without a clear, awaits its tenant's state from a peer (the
        manager refuses every event on it until the import, and the engine runs nothing on it)."""
        if not st.allocated or st.tenant != rid:
            self.flag("use-after-release", slot, line, step, rid, f"slot {slot} awaits a state while not held by {rid}")
        st.awaiting = True
        self.entry(slot, Entry(line, step, "expect", rid))

    def release(self, slot: int, st: _Slot, r: dict[str, Any], line: int, step: int | None, rid: str | None) -> None:
        """``slot.release``: the slot is free; the line is kept to name it in a later double release."""
        self.counts["releases"] += 1
        if not st.allocated:
            kind = "double-release" if st.released_at is not None else "use-after-release"
            where = f" (first released on line {st.released_at})" if st.released_at is not None else ""
            self.flag(kind, slot, line, step, rid, f"release of slot {slot}, which is already free{where}")
        st.allocated, st.released_at, st.awaiting = False, line, False
        self.handoffs.gone(slot)
        self.entry(slot, Entry(line, step, "release", rid))

    def export(self, slot: int, st: _Slot, r: dict[str, Any], line: int, step: int | None, rid: str | None) -> None:
        """``slot.export``: the slot's state as of here is staged in a host slot for a peer (an offload's read)."""
        if not st.allocated:
            self.flag("use-after-release", slot, line, step, rid, f"export of slot {slot}, which is free")
        self.handoffs.read(slot, line, step, rid, "an export reads")
        self.awaited_read(slot, st, line, step, rid, "an export reads")
        self.handoffs.exported(slot, r["host"], line, rid, r["to"])
        self.entry(slot, Entry(line, step, "export", rid, other=r["host"]))

    def import_(self, slot: int, st: _Slot, r: dict[str, Any], line: int, step: int | None, rid: str | None) -> None:
        """``slot.import``: the slot takes the state received for ``rid`` (once its flush has run)."""
        if not st.allocated:
            self.flag("use-after-release", slot, line, step, rid, f"import into slot {slot}, which is free")
        st.initialized, st.taint, st.awaiting = True, "", False
        peer = self.handoffs.imported(slot, r["host"], line, step, rid, r["peer"])
        self.entry(slot, Entry(line, step, "import", rid, other=r["host"], peer=peer))

    def transfer(self, r: dict[str, Any], line: int, step: int | None) -> None:
        """``transfer.*``: a send's delivered exports go on their slots' timelines as ``sent``, with the peer."""
        for slot, rid in self.handoffs.transfer(r, line):
            self.entry(slot, Entry(line, step, "sent", rid, peer=r["peer"]))

    def finish(self, last_line: int, last_step: int | None, expect_idle: bool) -> TraceAnalysis:
        """The analysis: what is still held at the end (anomalies with ``expect_idle``), and the summary."""
        out, counts, host_from = self.out, self.counts, self.host_from
        out.held = {s: st.tenant for s, st in sorted(self.slots.items()) if st.allocated}
        out.host_held = {h: host_from[h][1] for h in sorted(host_from)}
        if expect_idle:
            for s, tenant in out.held.items():
                message = f"slot {s} is still held by {tenant!r} at the end"
                self.flag("held-at-end", s, last_line, last_step, tenant, message)
            for h, (src, tenant) in sorted(host_from.items()):
                message = (
                    f"host slot {h} still holds the state {tenant!r} offloaded from slot {src} at the end"
                    " (neither dropped nor restored without keep since)"
                )
                self.flag("host-held-at-end", src, last_line, last_step, tenant, message)
            self.handoffs.finish(last_line, last_step)
        counts["slots_used"] = len(out.timelines)
        counts["requests"] = len(self.requests)
        counts["held_at_end"] = len(out.held)
        counts["host_held_at_end"] = len(out.host_held)
        counts["anomalies"] = len(out.anomalies)
        out.summary = counts
        return out


_SlotHandler = Callable[[_Pass, int, _Slot, dict[str, Any], int, int | None, str | None], None]
# A dict lookup rather than a chain of comparisons: the pass runs once per line of traces of millions of lines.
_SLOT_HANDLERS: dict[str, _SlotHandler] = {
    "slot.alloc": _Pass.alloc,
    "slot.commit": _Pass.commit,
    "slot.handover": _Pass.handover,
    "slot.clear": _Pass.clear,
    "slot.offload": _Pass.offload,
    "slot.restore": _Pass.restore,
    "slot.release": _Pass.release,
    "slot.export": _Pass.export,
    "slot.import": _Pass.import_,
    "slot.expect": _Pass.expect,
}


def _analyze_records(records: Iterable[tuple[int, dict[str, Any]]], expect_idle: bool = False) -> TraceAnalysis:
    """Replay the checked records in order, each slot's state tracked as the engine's would be."""
    p = _Pass()
    last_line, last_step = 0, None
    for line, r in records:
        event, step, rid = r["event"], r["step"], r["request_id"]
        last_line, last_step = line, step if step is not None else last_step
        if rid is not None:
            p.requests.add(rid)
        if event == "step.error":
            p.handoffs.errored(line, step)
            continue
        if event.startswith("transfer."):
            p.transfer(r, line, step)
            continue
        if event.startswith(("prefix.", "host.")):
            _tier_event(r, line, p.counts, p.host_held, p.evicted, p.flag)
            if event == "host.drop":
                p.host_from.pop(r["host"], None)
        elif event == "step.flush":
            p.flush(r, line, step)
        elif event == "slot.cow":
            p.cow(r, line, step, rid)
        else:
            slot = r["slot"]
            st = p.slots.setdefault(slot, _Slot())
            handler = _SLOT_HANDLERS.get(event)
            if handler is not None:
                handler(p, slot, st, r, line, step, rid)
    return p.finish(last_line, last_step, expect_idle)


def _tier_event(
    r: dict[str, Any],
    line: int,
    counts: dict[str, int],
    host_held: dict[int, bool],
    evicted: dict[int, int],
    flag: Any,
) -> None:
    """Host drops and prefix-cache events: counts, and the two anomalies they can show."""
    event, step = r["event"], r["step"]
    if event == "host.drop":
        counts["host_drops"] += 1
        host_held.pop(r["host"], None)
    elif event == "prefix.hit":
        counts["prefix_hits"] += 1
    elif event == "prefix.miss":
        counts["prefix_misses"] += 1
    elif event == "prefix.insert":
        counts["prefix_inserts"] += 1
    elif event == "prefix.evict":
        if r["slot"] is not None:
            counts["prefix_evictions"] += 1
            evicted[r["slot"]] = line
    elif event == "prefix.fork" and r["src"] is not None and r["src"] in evicted:
        src = r["src"]
        message = f"prefix fork into slot {r['slot']} from checkpoint slot {src}, evicted on line {evicted[src]}"
        flag("fork-from-evicted", src, line, step, r["request_id"], message)
