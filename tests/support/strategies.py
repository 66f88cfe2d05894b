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

# With shifted copies ("shift": give events_from_ops a max_shift); a strategy of its own, so that the
# tests drawing `ops` keep their distribution.
shift_ops = st.lists(
    st.tuples(st.sampled_from((*KINDS, "shift", "shift")), st.integers(0, 10**6), st.integers(0, 10**6)),
    max_size=80,
)


def events_from_ops(
    raw: list[tuple[str, int, int]], num_slots: int, allocated: set[int], draft_tokens: int = 0, max_shift: int = 0
) -> list[tuple[list[object], set[int]]]:
    """Turn raw draws into valid event logs split at "flush", each with the slots live after it.

    "commit" draws become CommitDraft events only for pools with ``draft_tokens``; else nothing.
    "shift" draws become copies shifted by ``1..max_shift`` tokens (in place too), some with a ``temporal_src`` of
    their own (then some with shift 0); with ``max_shift=0`` nothing.
    """
    steps = _steps(raw, num_slots, allocated, draft_tokens, 0, set(), max_shift)
    return [(events, live) for events, live, _ in steps]


HOST_KINDS = (*KINDS, "offload", "offload", "restore", "restore", "drop")

host_ops = st.lists(
    st.tuples(st.sampled_from(HOST_KINDS), st.integers(0, 10**6), st.integers(0, 10**6)),
    max_size=80,
)


# The host kinds with shifted and split copies (give host_events_from_ops a max_shift).
host_shift_ops = st.lists(
    st.tuples(st.sampled_from((*HOST_KINDS, "shift", "shift")), st.integers(0, 10**6), st.integers(0, 10**6)),
    max_size=80,
)


def host_events_from_ops(
    raw: list[tuple[str, int, int]],
    num_slots: int,
    allocated: set[int],
    num_host: int,
    held: set[int],
    draft_tokens: int = 0,
    max_shift: int = 0,
) -> list[tuple[list[object], set[int], set[int]]]:
    """As :func:`events_from_ops` with the host tier: each step with the pool and host slots live after it.

    Host slots are picked anywhere among the free ones, a slot freed in this very
    step included (the planner must be exact for any such log).
    """
    return _steps(raw, num_slots, allocated, draft_tokens, num_host, held, max_shift)


def _steps(
    raw: list[tuple[str, int, int]],
    num_slots: int,
    allocated: set[int],
    draft_tokens: int,
    num_host: int,
    held: set[int],
    max_shift: int = 0,
) -> list[tuple[list[object], set[int], set[int]]]:
    steps: list[list[object]] = [[]]
    after: list[tuple[set[int], set[int]]] = []
    free = sorted(set(range(1, num_slots + 1)) - allocated)
    for kind, a, b in raw:
        live = sorted(allocated)
        host_live = sorted(held)
        if kind == "flush":
            after.append((set(allocated), set(held)))
            steps.append([])
        elif kind == "alloc" and free:
            slot = free.pop(a % len(free))
            allocated.add(slot)
            steps[-1].append(mc.Alloc(slot, clear=b % 4 != 0))
        elif kind == "clear" and live:
            steps[-1].append(mc.Clear(live[a % len(live)]))
        elif kind == "cow" and live:
            steps[-1].append(mc.CopyOnWrite(live[a % len(live)], live[b % len(live)]))
        elif kind == "shift" and live and max_shift:
            # Runs of shifted copies with one shift batch into one stage: draw the shift from `b // 7`
            # so that neighbouring draws often agree.
            # One draw in three also reads the temporal state from a slot of its own (a split copy, speculative
            # decoding's align mode), one in nine of those with shift 0.
            src, dst = live[a % len(live)], live[b % len(live)]
            k = 1 + (b // 7) % max_shift
            ts = live[(a // 11) % len(live)] if a % 3 == 0 else None
            steps[-1].append(mc.CopyOnWrite(src, dst, shift=0 if ts is not None and a % 9 == 0 else k, temporal_src=ts))
        elif kind == "commit" and live and draft_tokens:
            steps[-1].append(mc.CommitDraft(live[a % len(live)], b % (draft_tokens + 1)))
        elif kind == "release" and live:
            slot = live[a % len(live)]
            allocated.discard(slot)
            bisect.insort(free, slot)
            steps[-1].append(mc.Release(slot))
        elif kind == "offload" and live and len(held) < num_host:
            host_free = sorted(set(range(1, num_host + 1)) - held)
            h = host_free[b % len(host_free)]
            held.add(h)
            steps[-1].append(mc.Offload(live[a % len(live)], h))
        elif kind == "restore" and live and host_live:
            h = host_live[b % len(host_live)]
            keep = a % 3 == 0
            if not keep:
                held.discard(h)
            steps[-1].append(mc.Restore(h, live[a % len(live)], keep=keep))
        elif kind == "drop" and host_live:
            h = host_live[a % len(host_live)]
            held.discard(h)
            steps[-1].append(mc.DropHost(h))
    after.append((set(allocated), set(held)))
    return [(events, live, host) for events, (live, host) in zip(steps, after, strict=True)]
