"""Reads a JSON-lines lifecycle trace back: per-slot timelines, summary, anomalies.

Pure Python, so traces from production can be analysed anywhere.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Analysis", "Anomaly", "Entry", "analyze", "read_trace"]

SLOT_EVENTS = frozenset({"slot.alloc", "slot.release", "slot.clear", "slot.cow"})


@dataclass(frozen=True, slots=True)
class Entry:
    """One line of a slot's timeline."""

    line: int
    step: int | None
    action: str  # alloc, clear, fork-in, fork-out, release
    request_id: str | None
    other: int | None = None  # the other slot of a fork
    cleared: bool | None = None


@dataclass(frozen=True, slots=True)
class Anomaly:
    kind: str  # double-release, use-after-release, copy-from-released, uncleared-reuse, double-alloc
    slot: int
    step: int | None
    line: int
    request_id: str | None
    message: str


@dataclass(slots=True)
class Analysis:
    timelines: dict[int, list[Entry]] = field(default_factory=dict)
    anomalies: list[Anomaly] = field(default_factory=list)
    summary: dict[str, int] = field(default_factory=dict)

    def to_json(self, slots: Iterable[int] | None = None) -> dict[str, Any]:
        keep = set(self.timelines) if slots is None else set(slots)
        return {
            "summary": self.summary,
            "slots": {str(s): [asdict(e) for e in self.timelines[s]] for s in sorted(keep) if s in self.timelines},
            "anomalies": [asdict(a) for a in self.anomalies if a.slot in keep],
        }


def read_trace(lines: Iterable[str]) -> list[tuple[int, dict[str, Any]]]:
    """Parse JSON lines, keeping mambacache events with their line numbers; other lines are skipped."""
    records: list[tuple[int, dict[str, Any]]] = []
    for number, text in enumerate(lines, start=1):
        text = text.strip()
        if not text.startswith("{"):
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and (record.get("event") in SLOT_EVENTS or record.get("event") == "step.flush"):
            records.append((number, record))
    return records


@dataclass(slots=True)
class _Slot:
    allocated: bool = False
    initialized: bool = False
    released_at: int | None = None  # line of the release that freed it
    tenant: str | None = None
    flagged_uncleared: bool = False
    taint: str = ""  # why an uninitialised slot is so, for the message


def analyze(records: Iterable[tuple[int, dict[str, Any]]]) -> Analysis:
    out = Analysis()
    slots: dict[int, _Slot] = {}
    counts = dict.fromkeys(
        ("steps", "allocs", "allocs_uncleared", "clears", "forks", "releases", "clears_elided", "events_flushed"), 0
    )
    requests: set[str] = set()

    def flag(kind: str, slot: int, line: int, step: int | None, rid: str | None, message: str) -> None:
        out.anomalies.append(Anomaly(kind, slot, step, line, rid, message))

    def entry(slot: int, e: Entry) -> None:
        out.timelines.setdefault(slot, []).append(e)

    for line, r in records:
        event, step, rid = r.get("event"), r.get("step"), r.get("request_id")
        if rid is not None:
            requests.add(str(rid))
        if event == "step.flush":
            counts["steps"] += 1
            counts["clears_elided"] += int(r.get("elided", 0))
            counts["events_flushed"] += int(r.get("events", 0))
            for s, st in slots.items():
                if st.allocated and not st.initialized and not st.flagged_uncleared:
                    st.flagged_uncleared = True
                    why = st.taint or "with neither a clear nor a fork into it since its alloc"
                    message = f"slot {s} (tenant {st.tenant}) was used by step {step} {why}: it holds stale state"
                    flag("uncleared-reuse", s, line, step, st.tenant, message)
            continue
        if event == "slot.cow":
            src, dst = int(r["src"]), int(r["dst"])
            s_src, s_dst = slots.setdefault(src, _Slot()), slots.setdefault(dst, _Slot())
            counts["forks"] += 1
            if not s_src.allocated:
                flag("copy-from-released", src, line, step, rid, f"fork {src} -> {dst} reads slot {src}, which is free")
            if not s_dst.allocated:
                flag("use-after-release", dst, line, step, rid, f"fork {src} -> {dst} writes slot {dst}, which is free")
            s_dst.initialized = s_src.initialized
            s_dst.taint = "" if s_src.initialized else f"forked from slot {src}, itself never cleared"
            entry(src, Entry(line, step, "fork-out", rid, other=dst))
            entry(dst, Entry(line, step, "fork-in", rid, other=src))
            continue
        slot = int(r["slot"])
        st = slots.setdefault(slot, _Slot())
        if event == "slot.alloc":
            counts["allocs"] += 1
            cleared = bool(r.get("cleared", True))
            counts["allocs_uncleared"] += not cleared
            if st.allocated:
                message = f"slot {slot} allocated to {rid} while {st.tenant} holds it"
                flag("double-alloc", slot, line, step, rid, message)
            st.allocated, st.initialized, st.tenant, st.flagged_uncleared = True, cleared, rid, False
            st.taint = ""
            entry(slot, Entry(line, step, "alloc", rid, cleared=cleared))
        elif event == "slot.clear":
            counts["clears"] += 1
            if not st.allocated:
                flag("use-after-release", slot, line, step, rid, f"clear of slot {slot}, which is free")
            st.initialized, st.taint = True, ""
            entry(slot, Entry(line, step, "clear", rid))
        elif event == "slot.release":
            counts["releases"] += 1
            if not st.allocated:
                kind = "double-release" if st.released_at is not None else "use-after-release"
                where = f" (first released on line {st.released_at})" if st.released_at is not None else ""
                flag(kind, slot, line, step, rid, f"release of slot {slot}, which is already free{where}")
            st.allocated, st.released_at = False, line
            entry(slot, Entry(line, step, "release", rid))
    counts["slots_used"] = len(out.timelines)
    counts["requests"] = len(requests)
    counts["anomalies"] = len(out.anomalies)
    out.summary = counts
    return out
