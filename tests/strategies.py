"""Hypothesis strategies for valid event logs."""

from __future__ import annotations

import bisect

from hypothesis import strategies as st

import mambacache as mc

KINDS = ("alloc", "clear", "cow", "cow", "cow", "release", "flush", "commit", "commit")

ops = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 10**6), st.integers(0, 10**6)),
    max_size=80,
)


def events_from_ops(
    raw: list[tuple[str, int, int]], num_slots: int, allocated: set[int], draft_tokens: int = 0
) -> list[tuple[list[object], set[int]]]:
    """Turn raw draws into valid event logs split at "flush", each with the slots live after it.

    "commit" draws become CommitDraft events only for pools with ``draft_tokens``; else nothing.
    """
    steps: list[list[object]] = [[]]
    live_after: list[set[int]] = []
    free = sorted(set(range(1, num_slots + 1)) - allocated)
    for kind, a, b in raw:
        live = sorted(allocated)
        if kind == "flush":
            live_after.append(set(allocated))
            steps.append([])
        elif kind == "alloc" and free:
            slot = free.pop(a % len(free))
            allocated.add(slot)
            steps[-1].append(mc.Alloc(slot, clear=b % 4 != 0))
        elif kind == "clear" and live:
            steps[-1].append(mc.Clear(live[a % len(live)]))
        elif kind == "cow" and live:
            steps[-1].append(mc.CopyOnWrite(live[a % len(live)], live[b % len(live)]))
        elif kind == "commit" and live and draft_tokens:
            steps[-1].append(mc.CommitDraft(live[a % len(live)], b % (draft_tokens + 1)))
        elif kind == "release" and live:
            slot = live[a % len(live)]
            allocated.discard(slot)
            bisect.insort(free, slot)
            steps[-1].append(mc.Release(slot))
    live_after.append(set(allocated))
    return list(zip(steps, live_after, strict=True))
