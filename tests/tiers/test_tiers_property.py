"""The tiers together, with faults: prefix cache, host tier, swaps and speculative commits, on every executor.

Random interleavings of admit (match, then fork or a plain alloc), match alone,
insert, evict, commit of a draft state, swap out (offload + release), snapshot
(offload of a running slot), swap in (alloc + restore, with or without keep),
abort of a swapped request (drop), copies, clears, releases and cache clears,
with a fault raised before a drawn aten op of a flush; the flush after a fault
must repair everything.

The oracle is plain Python: what every running slot and every host slot of a
swapped request must hold, and a model of the cache itself (which prefixes are
cached, on which tier, in which recency order, holding which state, and the
counters), with the eviction policy written out again from the contract: LRU
leaves on the device, an LRU host tier that drops exactly what it must, the
host pool's slots shared with swapped requests. Each state is a tag value
written across the whole slot, so a misplaced, stale or half-copied state shows.
After every flush the real pool, host pool and trie must equal the oracle.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache._tiers._prefix import CHECKPOINT_TENANT

from ..support.cache_model import CacheModel, Key, key_of, value_of
from ..support.cache_ops import Interpreter, Prompt, Workload
from ..support.sweep import fault_points
from ..support.util import VARIANTS

# Extra tensors (a quantised state's scales) ride along as more pool, draft and host tensors; integer dtypes, since
# every element of a slot holds its tag exactly.
SPEC = mc.StateSpec(
    num_layers=2, conv_shapes=[(6, 3), (5, 2)], temporal_shape=(2, 3), conv_dtype=torch.float32, draft_tokens=2,
    extra_shapes={"conv_scale": ((), torch.int32), "ssm_scale": ((3,), torch.int16)},
)  # fmt: skip
B = 2
# Shared first blocks (a chain of checkpoints along one prompt, siblings under one parent) and enough distinct
# prefixes (10) to fill small tiers several times over.
PROMPTS = [
    [1, 2, 3, 4, 5], [1, 2, 3, 4, 9], [1, 2, 7, 7, 7], [8, 8, 8, 8, 8], [8, 8, 6, 6, 6], [5, 5, 5, 5, 5],
    [6, 6, 1, 1, 1], [7, 7, 7, 7, 7],
]  # fmt: skip
# Weighted towards the cache: most draws insert, admit (match + fork), match or evict.
OPS = (
    "admit", "admit", "admit", "match", "match", "insert", "insert", "insert", "insert", "evict", "evict", "commit",
    "commit", "swap-out", "swap-out", "snapshot", "swap-in", "swap-in", "abort", "cow", "clear", "release",
    "clear-cache", "flush", "flush", "flush",
)  # fmt: skip
tier_ops = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 10**6), st.integers(0, 10**6)), min_size=40, max_size=100
)


def _insert(own: Prompt, b: int) -> Prompt:
    # Chains of checkpoints along the request's own prompt, or any other prompt: more distinct prefixes fill the
    # tiers sooner.
    prompt = own[0] if b % 3 == 0 else PROMPTS[b % len(PROMPTS)]
    return prompt[: B * (1 + b // 3 % 2)], None


WORKLOAD = Workload(
    admit=lambda a, b: (PROMPTS[a % len(PROMPTS)], None),
    match=lambda a, b: (PROMPTS[a % len(PROMPTS)][: 1 + b % 5], None),
    insert=_insert,
)


def trie(cache: mc.PrefixCache) -> tuple[list[tuple[Key, int]], list[tuple[Key, int]]]:
    """The cache's device and host checkpoints, least recently used first: (key, pool or host slot)."""
    return [(key_of(n), n.slot) for n in cache._device], [(key_of(n), n.host) for n in cache._host]


def check(o: Interpreter) -> None:
    """After a flush: every slot, host slot and checkpoint holds what the oracle says, and nothing else is held."""
    pool, host, cache, mgr = o.pool, o.host, o.cache, o.mgr
    assert pool.unfinished == 0
    for slot, want in o.slots.items():
        assert value_of(pool.tensors, slot) == want, ("slot", slot)
    for h, (want, _) in o.swapped.items():
        assert value_of(host.tensors, h) == want, ("host slot", h)
    device, on_host = trie(cache)
    m = o.model
    assert [k for k, _ in device] == list(m.device), "device checkpoints or their recency order"
    assert [k for k, _ in on_host] == list(m.host), "host checkpoints or their recency order"
    for k, slot in device:
        assert value_of(pool.tensors, slot) == m.device[k], ("device checkpoint", k)
    for k, h in on_host:
        assert value_of(host.tensors, h) == m.host[k], ("host checkpoint", k)
    want_held = {s: "r" for s in o.slots} | {s: CHECKPOINT_TENANT for _, s in device}
    assert mgr.held() == want_held
    assert set(host.held()) == set(o.swapped) | {h for _, h in on_host}
    assert (pool.num_free, host.num_free) == (m.pool_free, m.host_free)
    assert pool.num_available == mgr.available == m.available()
    # The reservation is always backed by free slots (so an insert below it never lacks one), hence requests
    # hold at most num_slots - max(reserved, checkpoints).
    assert pool.num_free >= m.reserved - len(device)
    assert len(o.slots) <= pool.num_slots - max(m.reserved, len(device))
    stats = cache.stats
    assert {k: getattr(stats, k) for k in m.counts} == m.counts


def run(
    raw: list[tuple[str, int, int]],
    variant: str,
    faults: list[int],
    sizes: tuple[int, int, int, int] | tuple[int, int, int, int, int],
    ops: list[int] | None = None,
) -> None:
    """Play ``raw`` against the oracle, the ``i``-th flush faulted at ``faults[i]``; ``ops`` gets each flush's op
    count."""
    num_slots, host_slots, max_ckpt, host_ckpt, *rest = sizes
    reserved = rest[0] if rest else 0
    pool, host = mc.StatePool(SPEC, num_slots), mc.HostPool(SPEC, host_slots)
    model = CacheModel(max_ckpt, host_ckpt, num_slots, host_slots, reserved)
    with mc.CacheManager(pool, executor=VARIANTS[variant](), host_pool=host, max_failed_flushes=1000) as mgr:
        cache = mc.PrefixCache(
            mgr, block_size=B, max_checkpoints=max_ckpt, host_checkpoints=host_ckpt, reserved=reserved
        )
        Interpreter(mgr, cache, model, WORKLOAD, check).run(raw, faults, ops)


@st.composite
def tier_sizes(draw: st.DrawFn) -> tuple[int, int, int, int, int]:
    """(pool slots, host slots, max_checkpoints, host_checkpoints, reserved): mostly a host pool about the size of
    the host tier, so swapped requests and host checkpoints compete for it (issue #19's full tier), sometimes no
    tier; half the time a reservation for checkpoints (issue #21), up to max_checkpoints."""
    host_ckpt = draw(st.sampled_from([0, 1, 2, 2, 3, 3]))
    host_slots = max(1, host_ckpt + draw(st.sampled_from([-1, 0, 0, 0, 1, 2])))
    num_slots, max_ckpt = draw(st.integers(3, 7)), draw(st.sampled_from([0, 1, 1, 2, 3]))
    reserved = draw(st.sampled_from([0, 0, 0, 1, 2, 3])) if max_ckpt else 0
    return num_slots, host_slots, max_ckpt, host_ckpt, min(reserved, max_ckpt, num_slots - 1)


@given(
    raw=tier_ops,
    variant=st.sampled_from(sorted(VARIANTS)),
    faults=st.lists(st.one_of(st.integers(0, 30), st.integers(0, 200)), max_size=10),  # steps run 4..200 ops
    sizes=tier_sizes(),
)
@settings(max_examples=400)  # what finds a wrong eviction order or a wiped host tier reliably (checked by mutation)
def test_tiers_with_faults_match_the_oracle(
    raw: list[tuple[str, int, int]], variant: str, faults: list[int], sizes: tuple[int, int, int, int, int]
) -> None:
    run(raw, variant, faults, sizes)


# Every tier event in two steps: a full host tier (HostPool of exactly host_checkpoints slots, one of them a
# swapped request's) drops its LRU checkpoint for an eviction while a fork restores from it in the same step.
SWEEP_SIZES = (7, 3, 1, 3)  # the host pool is exactly the host tier's size
HEAVY: list[tuple[str, int, int]] = [
    ("admit", 0, 0), ("admit", 1, 0), ("admit", 3, 0), ("flush", 0, 0), ("insert", 0, 1), ("insert", 1, 0),
    ("insert", 2, 0), ("insert", 0, 0), ("commit", 0, 2), ("swap-out", 0, 0), ("snapshot", 0, 0), ("flush", 0, 0),
    ("match", 3, 4), ("admit", 0, 0), ("evict", 0, 0), ("insert", 1, 1), ("swap-in", 1, 0), ("commit", 0, 1),
    ("swap-out", 0, 0), ("abort", 1, 0), ("swap-in", 0, 3), ("cow", 0, 1), ("clear", 1, 0), ("evict", 0, 0),
    ("flush", 0, 0),
]  # fmt: skip


def test_every_op_of_a_tier_heavy_step_faulted_on_every_executor() -> None:
    """The fixed steps above, a fault before each of their ops in turn (sampled unless MAMBACACHE_FULL_SWEEP is
    set), on every executor variant; each time the retried flush must leave exactly the oracle's state."""
    for variant in sorted(VARIANTS):
        ops: list[int] = []
        run(HEAVY, variant, [], SWEEP_SIZES, ops)
        assert len(ops) == 3 and min(ops[1:]) > 30, ops  # the sweep must reach into every stage of both steps
        for at in fault_points(max(ops)):
            run(HEAVY, variant, [0, at, at], SWEEP_SIZES)  # the two steps with tier events each take the fault
