"""What the transfer soaks' workers share (``workers/transfer_soak.py``, ``workers/reslice_soak.py``): a deadline
that turns a hang into a failure, a flush with a fault at a drawn op, and the decode side's step loop."""

from __future__ import annotations

import json
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import mambacache as mc

from .util import flush_with_fault


class Deadline:
    """``seconds`` from now: a thread still running after it is a hang."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def check(self, what: str) -> None:
        if time.monotonic() > self.end:
            raise AssertionError(f"{what}: still running after {self.seconds:g}s (a hang)")


def faulted_flush(mgr: mc.CacheManager, rng: random.Random) -> None:
    """A flush with a fault before a drawn op half the time (repaired at once), else a plain one; a sender or
    receiver thread may queue releases and drops meanwhile (``alone=False``)."""
    flush_with_fault(mgr, rng.randint(1, 40) if rng.random() < 0.5 else 0, MemoryError, alone=False)


def free_slot(mgr: mc.CacheManager) -> int:
    held = mgr.held()
    return next(s for s in range(1, mgr.pool.num_slots + 1) if s not in held)


def report(line: str) -> None:
    """A soak's summary: printed (``pytest -s``), and appended to ``$MAMBACACHE_SOAK_LOG`` when it is set."""
    print(line)
    if os.environ.get("MAMBACACHE_SOAK_LOG"):
        with open(os.environ["MAMBACACHE_SOAK_LOG"], "a", encoding="utf-8") as f:
            f.write(line + "\n")


def write_stats(out: str, name: str, stats: dict[str, Any]) -> None:
    with open(os.path.join(out, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(stats, f)


def import_each(
    mgr: mc.CacheManager,
    arrived: queue.Queue[str],
    receiver: threading.Thread,
    upcoming: Iterator[str],
    check: Callable[[str, int], None],
    rng: random.Random,
    deadline: Deadline,
    stats: dict[str, Any],
    *,
    expect: bool = True,
    verified: Callable[[int], None] = lambda n: None,
) -> None:
    """The decode side's step loop until ``receiver`` (the thread that receives and puts each arrived id on
    ``arrived``) has ended: import each state, ``check(rid, slot)`` its bytes, release it, with a faulted flush
    between; ``expect``: keep two slots awaiting the next ids of ``upcoming`` (``expect_import``: a landing in
    place may follow). ``verified(n)`` after the n-th state checked. Ends idle (``check_idle``)."""
    pool = mgr.pool
    expected: dict[str, int] = {}  # request id -> the slot awaiting its state
    while True:
        deadline.check(f"the step loop beside {receiver.name}")
        while expect and len(expected) < 2 and pool.num_free > 2:
            rid = next(upcoming)
            slot = free_slot(mgr)
            try:
                mgr.expect_import(slot, rid)  # it may land in the receiver thread from here on
            except mc.SlotStateError:
                continue  # arrived in staging already: imported into a free slot below
            expected[rid] = slot
            stats["expected"] += 1
        try:
            rid = arrived.get(timeout=0.05)
        except queue.Empty:
            if not receiver.is_alive():
                break  # it ends only once nothing more can come
            faulted_flush(mgr, rng)  # the expected slots settle: a landing in place may follow
            continue
        while not pool.num_free:
            faulted_flush(mgr, rng)
        slot = expected.pop(rid, None) or free_slot(mgr)
        queued = len(mgr.queued())
        mgr.import_into(slot, rid)  # a landing may run in the receiver thread during this flush
        stats["in_place"] += len(mgr.queued()) == queued  # landed in the slot itself: nothing to copy
        faulted_flush(mgr, rng)
        check(rid, slot)
        mgr.release(slot, rid)
        faulted_flush(mgr, rng)
        stats["verified"].append(rid)
        verified(len(stats["verified"]))
    receiver.join(deadline.seconds)
    assert not receiver.is_alive(), f"{receiver.name} hung"
    for rid, slot in expected.items():  # states that went to another engine of this rank, or never came
        mgr.release(slot, rid)
    faulted_flush(mgr, rng)
    mgr.check_idle(host=True)
