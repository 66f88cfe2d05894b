"""The tiers together, with faults: prefix cache, host tier, swaps and speculative commits, on every executor.

Random interleavings of admit (match + fork, or a plain alloc), insert, evict,
commit of a draft state, swap out (offload + release), swap in (alloc +
restore), abort of a swapped request (drop), copies, clears and releases, with a
fault raised before a drawn aten op of a flush; the flush after a fault repairs.
A plain-Python oracle knows what every running slot, every swapped request's
host slot and every checkpoint must hold: each request's state is a tag value
written across the whole slot, so any misplaced, stale or half-copied state
shows.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc

from .test_faults import VARIANTS, FaultAt

SPEC = mc.StateSpec(
    num_layers=2, conv_shapes=[(6, 3), (5, 2)], temporal_shape=(2, 3), conv_dtype=torch.float32, draft_tokens=2
)
B = 2
PROMPTS = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 9], [1, 2, 7, 7, 7], [8, 8, 8, 8, 8]]
OPS = (
    "admit", "admit", "insert", "insert", "fork", "evict", "commit", "commit", "swap-out", "swap-out", "swap-in",
    "swap-in", "abort", "cow", "clear", "release", "flush", "flush",
)  # fmt: skip
tier_ops = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 10**6), st.integers(0, 10**6)), min_size=4, max_size=50
)


def fill(tensors: list[torch.Tensor], slot: int, value: float) -> None:
    for t in tensors:
        t[:, slot] = value


def value_of(tensors: list[torch.Tensor], slot: int) -> float:
    values = {float(v) for t in tensors for v in t[:, slot].flatten().tolist()}
    assert len(values) == 1, f"slot {slot} holds a mix of states: {sorted(values)[:4]}"
    return values.pop()


class Oracle:
    """What sequential execution leaves: running slots, swapped requests' host slots, checkpoints."""

    def __init__(self) -> None:
        self.slots: dict[int, float] = {}
        self.prompt: dict[int, list[int]] = {}
        self.drafts: dict[tuple[int, int], float] = {}  # (slot, j) -> draft state j's tag, this step
        self.swapped: dict[int, tuple[float, list[int]]] = {}  # host slot -> (state, prompt)
        self.checkpoints: dict[tuple[int, ...], float] = {}
        self.tag = 1.0

    def fresh(self) -> float:
        self.tag += 1.0
        return self.tag


def flush(mgr: mc.CacheManager, at: int) -> None:
    """Flush with a fault before aten op ``at`` (0: none); a failed flush is repaired by the next."""
    try:
        with FaultAt(at, MemoryError if at % 2 else RuntimeError):
            mgr.flush_nowait()
    except mc.ExecutorError:
        assert at and mgr.pool.unfinished >= 1
        assert mgr.flush_nowait().resumed_stages >= 1


def forward(pool: mc.StatePool, o: Oracle) -> None:
    """A decode step writes every running slot, and a verify pass every draft state of it."""
    o.drafts.clear()
    for slot in o.slots:
        o.slots[slot] = o.fresh()
        fill(pool.tensors, slot, o.slots[slot])
        for j in range(SPEC.draft_tokens):
            o.drafts[slot, j] = o.fresh()
            for d in pool.draft_tensors:
                d[:, slot, j] = o.drafts[slot, j]


def run(raw: list[tuple[str, int, int]], variant: str, faults: list[int], num_slots: int, host_slots: int) -> None:
    pool, host = mc.StatePool(SPEC, num_slots), mc.HostPool(SPEC, host_slots)
    o = Oracle()
    fault_iter = iter(faults)
    with mc.CacheManager(pool, executor=VARIANTS[variant](), host_pool=host, max_failed_flushes=1000) as mgr:
        cache = mc.PrefixCache(mgr, block_size=B, max_checkpoints=2, host_checkpoints=2)
        for kind, a, b in raw:
            running = sorted(o.slots)
            try:
                if kind == "admit":
                    prompt = PROMPTS[a % len(PROMPTS)]
                    hit = cache.match(prompt[:-1])
                    if hit is not None:
                        slot = cache.fork(hit, request_id="r")
                        o.slots[slot] = o.checkpoints[tuple(prompt[: hit.length])]
                    else:
                        (slot,) = mgr.alloc(1, request_id="r")
                        o.slots[slot] = 0.0
                    o.prompt[slot] = prompt
                elif kind == "insert" and running:
                    slot = running[a % len(running)]
                    n = B * (1 + b % 2)
                    if cache.insert(o.prompt[slot][:n], slot):
                        o.checkpoints[tuple(o.prompt[slot][:n])] = o.slots[slot]
                elif kind == "fork" and running:
                    prompt = o.prompt[running[a % len(running)]]
                    hit = cache.match(prompt)
                    if hit is not None:
                        slot = cache.fork(hit, request_id="r")
                        o.slots[slot], o.prompt[slot] = o.checkpoints[tuple(prompt[: hit.length])], prompt
                elif kind == "evict":
                    cache.evict()
                elif kind == "commit" and running:
                    slot = running[a % len(running)]
                    accepted = b % (SPEC.draft_tokens + 1)
                    mgr.commit_draft(slot, accepted, request_id="r")
                    if accepted and (slot, accepted - 1) in o.drafts:
                        o.slots[slot] = o.drafts[slot, accepted - 1]
                    elif accepted:
                        o.slots.pop(slot)  # drafts not written since its admission: undefined, stop tracking
                        running.remove(slot)
                        mgr.release(slot, request_id="r")
                        o.prompt.pop(slot)
                elif kind == "swap-out" and running:
                    slot = running[a % len(running)]
                    h = mgr.offload(slot, request_id="r")
                    mgr.release(slot, request_id="r")
                    o.swapped[h] = (o.slots.pop(slot), o.prompt.pop(slot))
                elif kind == "swap-in" and o.swapped:
                    h = sorted(o.swapped)[a % len(o.swapped)]
                    (slot,) = mgr.alloc(1, request_id="r", clear=False)
                    mgr.restore(h, slot, request_id="r")
                    o.slots[slot], o.prompt[slot] = o.swapped.pop(h)
                elif kind == "abort" and o.swapped:
                    h = sorted(o.swapped)[a % len(o.swapped)]
                    mgr.drop(h)
                    del o.swapped[h]
                elif kind == "cow" and len(running) > 1:
                    src, dst = running[a % len(running)], running[b % len(running)]
                    mgr.copy_on_write(src, dst)
                    o.slots[dst], o.prompt[dst] = o.slots[src], o.prompt[src]
                elif kind == "clear" and running:
                    slot = running[a % len(running)]
                    mgr.clear(slot)
                    o.slots[slot] = 0.0
                elif kind == "release" and running:
                    slot = running[a % len(running)]
                    mgr.release(slot)
                    del o.slots[slot], o.prompt[slot]
                elif kind == "flush":
                    flush(mgr, next(fault_iter, 0))
                    check(pool, host, cache, o, mgr)
                    forward(pool, o)
            except mc.PoolExhaustedError:
                continue  # a full pool or host pool refuses the call and changes nothing
        flush(mgr, next(fault_iter, 0))
        check(pool, host, cache, o, mgr)
        # Every checkpoint the cache still holds forks exactly what was inserted, from either tier.
        for prompt in PROMPTS:
            for n in (B, 2 * B):
                key = tuple(prompt[:n])
                hit = cache.match(list(key))
                if hit is None or hit.length != n:
                    continue
                try:
                    slot = cache.fork(hit, request_id="probe")
                except mc.PoolExhaustedError:
                    continue
                flush(mgr, 0)
                assert value_of(pool.tensors, slot) == o.checkpoints[key], (key, hit.tier)
                mgr.release(slot, request_id="probe")
        cache.clear()
        for slot in list(o.slots):
            mgr.release(slot)
        for h in list(o.swapped):
            mgr.drop(h)
        flush(mgr, 0)
        mgr.check_idle()


def check(pool: mc.StatePool, host: mc.HostPool, cache: mc.PrefixCache, o: Oracle, mgr: mc.CacheManager) -> None:
    assert pool.unfinished == 0
    for slot, want in o.slots.items():
        assert value_of(pool.tensors, slot) == want, ("slot", slot)
    for h, (want, _) in o.swapped.items():
        assert value_of(host.tensors, h) == want, ("host slot", h)
    stats = cache.stats
    # The host pool holds exactly the swapped requests and the cache's host checkpoints, nothing leaked.
    assert host.num_held == len(o.swapped) + stats.host_checkpoints
    assert sum(t == mc._tiers._prefix.CHECKPOINT_TENANT for t in mgr.held().values()) == stats.device_checkpoints


@given(
    raw=tier_ops,
    variant=st.sampled_from(sorted(VARIANTS)),
    faults=st.lists(st.integers(0, 60), max_size=8),
    num_slots=st.integers(3, 7),
    host_slots=st.integers(2, 5),
)
@settings(max_examples=60)
def test_tiers_with_faults_match_the_oracle(
    raw: list[tuple[str, int, int]], variant: str, faults: list[int], num_slots: int, host_slots: int
) -> None:
    run(raw, variant, faults, num_slots, host_slots)


def test_every_op_of_a_tier_heavy_step_faulted_on_every_executor() -> None:
    """One fixed step with every tier event in it, a fault before each of its ops in turn (sampled unless
    MAMBACACHE_FULL_SWEEP is set), on every executor variant."""
    from .sweep import fault_points

    raw: list[Any] = [
        ("admit", 0, 0), ("admit", 1, 0), ("admit", 3, 0), ("flush", 0, 0), ("insert", 0, 1), ("insert", 1, 0),
        ("commit", 0, 2), ("swap-out", 0, 0), ("swap-out", 0, 0), ("flush", 0, 0), ("evict", 0, 0),
        ("admit", 0, 0), ("swap-in", 0, 0), ("commit", 0, 1), ("swap-out", 0, 0), ("abort", 1, 0), ("cow", 0, 1),
        ("clear", 1, 0), ("flush", 0, 0),
    ]  # fmt: skip
    for variant in sorted(VARIANTS):
        for at in fault_points(40):
            run(raw, variant, [0, at, at], 6, 3)  # the two steps with tier events each take the fault
