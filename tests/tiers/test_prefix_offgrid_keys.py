"""PrefixCache checkpoints off the block grid and under extra keys (issue #21), against a plain-Python oracle.

The oracle is the cache's contract with nothing of its structure: a dict
``{(key, tokens): state}`` per tier in recency order, ``match`` the deepest
entry under the same key whose tokens are a prefix, eviction the least recently
used device entry that no longer device entry under the same key extends, the
host tier LRU. Random interleavings of admit (match, then fork or a plain
alloc), match, insert at any length under any key, evict, swaps that compete for
host slots, copies, releases and cache clears run on every executor with a fault
before a drawn op of each flush; after every flush the pool, the host pool, the
checkpoints (which prefixes, which tier, which recency order, which state), the
counters and the trie's shape must equal the oracle's.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

import mambacache as mc
from mambacache import tracing

from ..support.cache_model import CacheModel, key_of, value_of
from ..support.cache_ops import Interpreter, Prompt, Workload
from ..support.sweep import fault_points
from ..support.util import VARIANTS

SPEC = mc.StateSpec(num_layers=2, conv_shapes=[(6, 3), (5, 2)], temporal_shape=(2, 3), conv_dtype=torch.float32)
B = 4  # the engine's block: most lengths below are off it
# Shared heads that end on and off the grid (3, 4, 5 tokens), a prompt shorter than one block, no sharing.
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 9, 9], [1, 2, 3, 8, 8, 8], [1, 2, 6], [5, 5, 5, 5, 5, 5, 5],
    [1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1, 1],
]  # fmt: skip
KEYS: tuple[Hashable, ...] = (None, None, "lora-a", 3, ("image", 0xBEEF))
OPS = (
    "admit", "admit", "admit", "match", "match", "insert", "insert", "insert", "insert", "evict", "swap-out",
    "abort", "cow", "release", "release", "clear-cache", "flush", "flush", "flush",
)  # fmt: skip


def fill(pool: mc.StatePool, slot: int, value: float) -> None:
    for t in pool.tensors:
        t[:, slot] = value


def check_shape(cache: mc.PrefixCache) -> None:
    """The trie's invariants: edges compressed, children keyed by first token, ``below`` counts exact."""
    trie = cache._trie
    nodes = list(trie.nodes())
    device = {key_of(n) for n in cache._device}
    for space, tokens, node in nodes:
        assert node.live and node.key and node.parent.children[node.key[0]] is node
        assert node.length == len(tokens) == node.parent.length + len(node.key)
        assert node.slot or node.host or len(node.children) >= 2, ("an empty node that leads one way", tokens)
        below = sum(s == space and len(t) > len(tokens) and t[: len(tokens)] == tokens for s, t in device)
        assert node.below == below, ("below", tokens, node.below, below)
    assert all(root.children for root in trie.roots.values()), "an empty root was kept"
    held = {key_of(n) for n in (*cache._device, *cache._host)}
    assert held == {(s, t) for s, t, n in nodes if n.slot or n.host}


def _insert(own: Prompt, b: int) -> Prompt:
    # Its own prompt and key at any length, or another prompt or key.
    prompt, key = own if b % 3 else (PROMPTS[b % len(PROMPTS)], KEYS[b // 7 % len(KEYS)])
    return prompt[: 1 + b // 3 % len(prompt)], key


WORKLOAD = Workload(
    admit=lambda a, b: (PROMPTS[a % len(PROMPTS)], KEYS[b % len(KEYS)]),
    match=lambda a, b: (PROMPTS[a % len(PROMPTS)][: b % 9], KEYS[a % len(KEYS)]),
    insert=_insert,
)


def check(o: Interpreter) -> None:
    """After a flush: every slot, host slot and checkpoint holds what the oracle says, in its recency order."""
    pool, host, cache, m = o.pool, o.host, o.cache, o.model
    for slot, want in o.slots.items():
        assert value_of(pool.tensors, slot) == want, ("slot", slot)
    for h, (want, _) in o.swapped.items():
        assert value_of(host.tensors, h) == want, ("host slot", h)
    assert [key_of(n) for n in cache._device] == list(m.device), "device checkpoints or their recency order"
    assert [key_of(n) for n in cache._host] == list(m.host), "host checkpoints or their recency order"
    for n in cache._device:
        assert value_of(pool.tensors, n.slot) == m.device[key_of(n)], ("device checkpoint", key_of(n))
    for n in cache._host:
        assert value_of(host.tensors, n.host) == m.host[key_of(n)], ("host checkpoint", key_of(n))
    assert (pool.num_free, host.num_free) == (m.pool_free, m.host_free)
    stats = cache.stats
    assert {k: getattr(stats, k) for k in m.counts} == m.counts
    check_shape(cache)


def run(
    raw: list[tuple[str, int, int]],
    variant: str,
    faults: list[int],
    sizes: tuple[int, int, int, int],
    ops: list[int] | None = None,
) -> None:
    """Play ``raw``, the ``i``-th flush faulted at ``faults[i]``; ``ops`` gets each flush's op count."""
    num_slots, host_slots, max_ckpt, host_ckpt = sizes
    pool, host = mc.StatePool(SPEC, num_slots), mc.HostPool(SPEC, host_slots)
    model = CacheModel(max_ckpt, host_ckpt, num_slots, host_slots)
    with mc.CacheManager(pool, executor=VARIANTS[variant](), host_pool=host, max_failed_flushes=1000) as mgr:
        cache = mc.PrefixCache(mgr, block_size=B, max_checkpoints=max_ckpt, host_checkpoints=host_ckpt)
        Interpreter(mgr, cache, model, WORKLOAD, check).run(raw, faults, ops)
        assert cache._trie.roots == {}


@st.composite
def sizes(draw: st.DrawFn) -> tuple[int, int, int, int]:
    """(pool slots, host slots, max_checkpoints, host_checkpoints): small, so every eviction path runs."""
    host_ckpt = draw(st.sampled_from([0, 1, 2, 3]))
    host_slots = max(1, host_ckpt + draw(st.sampled_from([-1, 0, 0, 1])))
    return draw(st.integers(3, 7)), host_slots, draw(st.sampled_from([0, 1, 2, 3, 5])), host_ckpt


@given(
    raw=st.lists(
        st.tuples(st.sampled_from(OPS), st.integers(0, 10**6), st.integers(0, 10**6)), min_size=30, max_size=90
    ),
    variant=st.sampled_from(sorted(VARIANTS)),
    faults=st.lists(st.one_of(st.integers(0, 30), st.integers(0, 150)), max_size=8),
    sizes=sizes(),
)
@settings(max_examples=250)
def test_off_grid_and_keyed_checkpoints_with_faults_match_the_oracle(
    raw: list[tuple[str, int, int]], variant: str, faults: list[int], sizes: tuple[int, int, int, int]
) -> None:
    run(raw, variant, faults, sizes)


# Two steps with tier events: tail checkpoints (3, 5, 6 tokens) along prompts shared under two keys, the same
# tokens under another key, a device budget of 2 that pushes them to a host tier the size of the host pool, a
# swapped request competing for it, and forks that restore from it.
SWEEP_SIZES = (7, 3, 2, 3)
HEAVY: list[tuple[str, int, int]] = [
    ("admit", 0, 0), ("admit", 1, 2), ("admit", 2, 3), ("flush", 0, 0), ("insert", 0, 7), ("insert", 0, 13),
    ("insert", 1, 4), ("insert", 2, 14), ("insert", 1, 16), ("swap-out", 2, 0), ("match", 0, 3), ("admit", 0, 0),
    ("flush", 0, 0), ("admit", 3, 0), ("admit", 1, 2), ("insert", 0, 10), ("evict", 0, 0), ("cow", 0, 1),
    ("abort", 0, 0), ("admit", 2, 3), ("insert", 1, 5), ("release", 1, 0), ("flush", 0, 0),
]  # fmt: skip


def test_every_op_of_a_step_with_off_grid_keyed_checkpoints_faulted_on_every_executor() -> None:
    """The fixed steps above, a fault before each of their ops in turn (sampled unless MAMBACACHE_FULL_SWEEP is
    set), on every executor variant; each time the retried flush must leave exactly the oracle's state."""
    for variant in sorted(VARIANTS):
        ops: list[int] = []
        run(HEAVY, variant, [], SWEEP_SIZES, ops)
        assert len(ops) == 3 and min(ops[1:]) > 15, ops  # the sweep reaches into every stage of both steps
        for at in fault_points(max(ops)):
            run(HEAVY, variant, [0, at, at], SWEEP_SIZES)


def test_the_heavy_steps_cover_tails_keys_and_the_host_tier() -> None:
    """What the sweep above exercises, so a change to HEAVY cannot quietly drop it."""
    pool, host = mc.StatePool(SPEC, SWEEP_SIZES[0]), mc.HostPool(SPEC, SWEEP_SIZES[1])
    model = CacheModel(*SWEEP_SIZES[2:], SWEEP_SIZES[0], SWEEP_SIZES[1])
    lengths: set[int] = set()
    spaces: set[Hashable] = set()
    with mc.CacheManager(pool, host_pool=host) as mgr:
        cache = mc.PrefixCache(mgr, block_size=B, max_checkpoints=SWEEP_SIZES[2], host_checkpoints=SWEEP_SIZES[3])
        o = Interpreter(mgr, cache, model, WORKLOAD, check)
        for kind, a, b in HEAVY:
            if kind == "flush":
                mgr.flush_nowait()
            else:
                o.play(kind, a, b)
            for space, tokens in (*model.device, *model.host):
                lengths.add(len(tokens))
                spaces.add(space)
        stats = cache.stats
        assert stats.offloads and stats.restores and stats.host_drops and stats.hits > 2
        assert any(n % B for n in lengths) and len(spaces) >= 2
        mgr.flush_nowait()
        cache.clear()
        for slot in list(o.slots):
            mgr.release(slot)
        for h in list(o.swapped):
            mgr.drop(h)
        mgr.flush_nowait()
        mgr.check_idle()


# -- the contract, case by case ------------------------------------------
def _cache(num_slots: int = 8, **kwargs: Any) -> tuple[mc.StatePool, mc.CacheManager, mc.PrefixCache]:
    pool = mc.StatePool(SPEC, num_slots)
    mgr = mc.CacheManager(pool).__enter__()
    return pool, mgr, mc.PrefixCache(mgr, block_size=B, **kwargs)


def _fork_value(pool: mc.StatePool, mgr: mc.CacheManager, cache: mc.PrefixCache, hit: mc.PrefixHit | None) -> float:
    assert hit is not None
    slot = cache.fork(hit, request_id="probe")
    mgr.flush_nowait()
    value = value_of(pool.tensors, slot)
    mgr.release(slot, request_id="probe")
    return value


def test_a_prompt_shorter_than_one_block_hits_its_junction_checkpoint() -> None:
    """vllm#40696: a 3-token shared prefix and a block of 4. A grid checkpoint cannot hold it; one at 3 can."""
    pool, mgr, cache = _cache()
    (s,) = mgr.alloc(1, request_id="a")
    mgr.flush_nowait()
    fill(pool, s, 30.0)  # the state after the system prompt [9 9 9]
    assert cache.insert([9, 9, 9], s)
    mgr.flush_nowait()
    fill(pool, s, 31.0)  # the request runs on: the checkpoint keeps 30
    hit = cache.match([9, 9, 9, 4, 2])
    assert hit is not None and hit.length == 3
    assert _fork_value(pool, mgr, cache, hit) == 30.0
    assert cache.match([9, 9]) is None and cache.match([9, 9, 8]) is None  # shorter or diverging: no prefix


def test_the_deepest_checkpoint_wins_on_and_off_the_grid() -> None:
    pool, mgr, cache = _cache()
    (s,) = mgr.alloc(1, request_id="a")
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    for n in (3, 4, 6, 8):  # off, on, off, on the grid of 4
        mgr.flush_nowait()
        fill(pool, s, float(n))
        assert cache.insert(prompt[:n], s)
    mgr.flush_nowait()
    for n in range(10):
        hit = cache.match(prompt[:n])
        want = max((k for k in (3, 4, 6, 8) if k <= n), default=None)
        assert (hit.length if hit is not None else None) == want, n
        if hit is not None:
            assert _fork_value(pool, mgr, cache, hit) == float(want)  # type: ignore[arg-type]
    # A prompt that leaves the cached one inside an edge (after 5 tokens) splits it: [1..5] stands alone.
    fill(pool, s, 55.0)
    assert cache.insert([1, 2, 3, 4, 5, 0], s)
    mgr.flush_nowait()
    assert cache.match([1, 2, 3, 4, 5, 0, 1]).length == 6  # type: ignore[union-attr]
    assert cache.match([1, 2, 3, 4, 5, 6, 7]).length == 6  # type: ignore[union-attr]
    assert not cache.insert(prompt[:6], s)  # cached already: refreshed, not copied again
    check_shape(cache)


def test_equal_tokens_under_different_keys_never_share_a_state() -> None:
    """vllm#43587: the same placeholder ids with other image content (or another adapter) are another prefix."""
    pool, mgr, cache = _cache()
    (s,) = mgr.alloc(1, request_id="a")
    tokens = [7, 7, 7, 7, 7]
    keys: list[Hashable] = [None, "lora-a", ("image", 0xBEEF), ("image", 0xF00D), 3]
    for i, key in enumerate(keys):
        mgr.flush_nowait()
        fill(pool, s, 100.0 + i)
        assert cache.insert(tokens, s, key=key)
    mgr.flush_nowait()
    for i, key in enumerate(keys):
        hit = cache.match(tokens, key=key)
        assert hit is not None and hit.length == 5
        assert _fork_value(pool, mgr, cache, hit) == 100.0 + i
    assert cache.match(tokens, key="lora-b") is None and cache.match(tokens, key=("image", 1)) is None
    assert cache.stats.misses == 2 and len(cache) == len(keys)
    check_shape(cache)


def test_a_tail_checkpoint_is_interior_while_a_longer_prefix_extends_it() -> None:
    """Eviction takes leaves by the prefix relation: [1 2 3] (off the grid) is below nothing only once [1 2 3 4 5]
    is gone, and a checkpoint under another key never shields it."""
    _pool, mgr, cache = _cache(max_checkpoints=3)
    (s,) = mgr.alloc(1, request_id="a")
    cache.insert([1, 2, 3], s)
    cache.insert([1, 2, 3, 4, 5], s)
    cache.insert([1, 2, 3, 4, 5, 6], s, key="other")  # another key: not below [1 2 3 4 5]
    cache.insert([8], s)  # evicts the LRU leaf: [1 2 3 4 5], not the older interior [1 2 3]
    assert cache.match([1, 2, 3, 4, 5]).length == 3  # type: ignore[union-attr]
    assert cache.match([1, 2, 3, 4, 5, 6], key="other").length == 6  # type: ignore[union-attr]
    cache.insert([9], s)  # [1 2 3] and "other" were just matched: the LRU leaf is [8]
    assert cache.match([8]) is None and cache.match([1, 2, 3]) is not None
    check_shape(cache)


def test_clear_drops_every_keys_checkpoints_and_their_hits_go_stale() -> None:
    _pool, mgr, cache = _cache()
    (s,) = mgr.alloc(1, request_id="a")
    for key in (None, "x", 5):
        cache.insert([1, 2, 3], s, key=key)
    hits = [cache.match([1, 2, 3], key=key) for key in (None, "x", 5)]
    cache.clear()
    assert len(cache) == 0 and cache._trie.roots == {}
    for hit in hits:
        assert hit is not None
        with pytest.raises(mc.StaleHitError):
            cache.fork(hit)
    mgr.release(s, request_id="a")
    mgr.flush_nowait()
    mgr.check_idle()


def test_keys_no_longer_in_use_cost_nothing() -> None:
    """A cache salt per request: once each one's checkpoint is evicted, its root is gone too."""
    _pool, mgr, cache = _cache(max_checkpoints=2)
    (s,) = mgr.alloc(1, request_id="a")
    for salt in range(50):
        assert cache.insert([1, 2, 3], s, key=f"salt-{salt}")
    assert len(cache._trie.roots) == 2 and len(cache) == 2
    check_shape(cache)


def test_fork_refuses_a_keyed_hit_from_another_cache() -> None:
    _pool, mgr, cache = _cache()
    _other_pool, other_mgr, other = _cache()
    (s,) = mgr.alloc(1)
    (o,) = other_mgr.alloc(1)
    cache.insert([1, 2, 3], s, key="k")
    other.insert([1, 2, 3], o, key="k")
    foreign = other.match([1, 2, 3], key="k")
    assert foreign is not None
    before = (mgr.held(), mgr.pending, len(cache), cache.stats)
    with pytest.raises(mc.InvalidArgumentError, match="another cache"):
        cache.fork(foreign)
    assert (mgr.held(), mgr.pending, len(cache), cache.stats) == before


def test_trace_notes_carry_json_safe_keys_only(tmp_path: Any) -> None:
    tracing.configure(level="debug", use_structlog_config=True)
    try:
        with capture_logs() as logs:
            _pool, mgr, cache = _cache()
            (s,) = mgr.alloc(1, request_id="a")
            for key in ("lora-a", 3, ("image", 1), None):
                cache.insert([1, 2, 3], s, key=key)
                cache.match([1, 2, 3, 4], key=key)
            cache.match([5], key="lora-a")
    finally:
        tracing.disable()
    keyed = [(e["event"], e.get("key", "-")) for e in logs if e["event"].startswith("prefix.")]
    assert keyed == [
        ("prefix.insert", "lora-a"), ("prefix.hit", "lora-a"), ("prefix.insert", 3), ("prefix.hit", 3),
        ("prefix.insert", "-"), ("prefix.hit", "-"), ("prefix.insert", "-"), ("prefix.hit", "-"),
        ("prefix.miss", "lora-a"),
    ]  # fmt: skip
    path = tmp_path / "trace.jsonl"
    tracing.configure(str(path), level="debug")
    try:
        _pool, mgr, cache = _cache(max_checkpoints=1)
        (s,) = mgr.alloc(1, request_id="a")
        for key in ("lora-a", 3, ("image", 1)):
            cache.insert([1, 2, 3], s, key=key)
            cache.fork(cache.match([1, 2, 3, 4], key=key), request_id="b")  # type: ignore[arg-type]
            mgr.release(s, request_id="a")
            (s,) = mgr.alloc(1, request_id="a")
        mgr.flush_nowait()
        cache.clear()
    finally:
        tracing.disable()
    lines = path.read_text().splitlines()
    assert all(json.loads(line) for line in lines)
    analysis = tracing.analyze(path)
    assert analysis.anomalies == [] and analysis.bad_lines == []
    assert analysis.summary["prefix_hits"] == 3 and analysis.summary["prefix_inserts"] == 3


def test_a_hit_survives_the_merge_of_its_edge_and_goes_stale_when_its_checkpoint_leaves() -> None:
    """[1 2 3] and [1 2 9] share a branch node [1 2] that holds nothing. Evicting [1 2 9] merges the branch into
    [1 2 3]: a hit taken before still forks it exactly. Evicting [1 2 3] too (no host tier) makes the hit stale."""
    pool, mgr, cache = _cache(max_checkpoints=2)
    (s,) = mgr.alloc(1, request_id="a")
    for tokens, value in (([1, 2, 3], 3.0), ([1, 2, 9], 9.0)):
        mgr.flush_nowait()
        fill(pool, s, value)
        assert cache.insert(tokens, s)
    mgr.flush_nowait()
    assert [len(n.children) for _, t, n in cache._trie.nodes() if t == (1, 2)] == [2]
    hit = cache.match([1, 2, 3, 4])  # [1 2 9] is now the least recently used
    assert hit is not None and hit.length == 3
    assert cache.insert([5], s)  # evicts [1 2 9]: the empty branch [1 2] merges into [1 2 3]
    assert sorted(t for _, t, _ in cache._trie.nodes()) == [(1, 2, 3), (5,)]
    check_shape(cache)
    assert _fork_value(pool, mgr, cache, hit) == 3.0
    assert cache.insert([6], s) and cache.insert([7], s)  # [1 2 3] evicted and dropped
    with pytest.raises(mc.StaleHitError):
        cache.fork(hit)
    assert hit._node is not None and not hit._node.live
    check_shape(cache)


def test_a_hit_on_a_checkpoint_that_left_both_tiers_is_stale_even_if_its_node_lives_on() -> None:
    """A node that still branches outlives its checkpoint; a new checkpoint there is another state."""
    spec = mc.StateSpec(num_layers=1, conv_shapes=(), temporal_shape=(2,))
    with mc.CacheManager(mc.StatePool(spec, 8), host_pool=mc.HostPool(spec, 2)) as mgr:
        cache = mc.PrefixCache(mgr, block_size=2, max_checkpoints=2, host_checkpoints=1)
        a, b = mgr.alloc(2, "r")
        mgr.flush_nowait()
        assert cache.insert([1, 2], a)
        assert cache.evict()  # [1, 2] to the host tier
        assert cache.insert([1, 2, 3, 4], a) and cache.insert([1, 2, 5, 6], b)  # it now branches
        old = cache.match([1, 2, 7])
        assert old is not None and old.length == 2 and old.tier == "host"
        assert cache.evict()  # [1, 2, 3, 4] to the host tier: the full tier drops [1, 2]'s state
        assert cache.match([1, 2, 7]) is None
        assert cache.insert([1, 2], b, payload="new")  # the same node, a new state
        with pytest.raises(mc.StaleHitError):
            cache.fork(old, "x")
        fresh = cache.match([1, 2, 7])
        assert fresh is not None and fresh.payload == "new"
        cache.fork(fresh, "x")
        cache.clear()
        mgr.release_many([a, b], "r")
        for slot, tenant in mgr.held().items():
            mgr.release(slot, tenant)
        mgr.flush_nowait()
