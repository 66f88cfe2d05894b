"""PrefixCache against a model of what each fork must read, interleaved with every other event."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

import mambacache as mc
from mambacache import tracing

# float32 throughout: the test tags states with counters that bfloat16 would round.
SPEC = mc.StateSpec(num_layers=2, conv_shapes=[(6, 3), (5, 2)], temporal_shape=(2, 3), conv_dtype=torch.float32)
B = 2  # block size
PROMPTS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9], [1, 2, 7, 7, 7, 7], [8, 8, 8, 8, 8, 8]]
KEYS = (None, None, "lora-a", 7)  # extra keys: the same prompt under another key is another prefix

OPS = ("admit", "admit", "insert", "insert", "fork", "release", "cow", "clear", "flush", "flush", "evict")
prefix_ops = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 10**6), st.integers(0, 10**6)), min_size=1, max_size=60
)


def fill(pool: mc.StatePool, slot: int, value: float) -> None:
    for t in pool.tensors:
        t[:, slot] = value


def value_of(pool: mc.StatePool, slot: int) -> float:
    values = {float(v) for t in pool.tensors for v in t[:, slot].flatten().tolist()}
    assert len(values) == 1, f"slot {slot} holds a mix of states: {sorted(values)[:4]}"
    return values.pop()


class Model:
    """Each running request's slot value as sequential execution defines it, and each checkpoint's."""

    def __init__(self) -> None:
        self.slots: dict[int, float] = {}  # running slot -> the value it must hold
        self.prompt: dict[int, list[int]] = {}
        self.key: dict[int, Any] = {}  # running slot -> the extra key its prompt runs under
        self.checkpoints: dict[tuple[Any, tuple[int, ...]], float] = {}  # every (key, prefix) checkpointed -> value
        self.tag = 1.0

    def fresh(self) -> float:
        self.tag += 1.0
        return self.tag


def run(raw: list[tuple[str, int, int]], num_slots: int, max_ckpt: int, host_ckpt: int) -> mc.PrefixStats:
    pool = mc.StatePool(SPEC, num_slots)
    host = mc.HostPool(SPEC, 3) if host_ckpt else None
    model = Model()
    with mc.CacheManager(pool, host_pool=host) as mgr:
        cache = mc.PrefixCache(mgr, block_size=B, max_checkpoints=max_ckpt, host_checkpoints=host_ckpt)
        for kind, a, b in raw:
            running = sorted(model.slots)
            if kind == "admit":
                prompt, space = PROMPTS[a % len(PROMPTS)], KEYS[b % len(KEYS)]
                hit = cache.match(prompt[:-1], key=space)
                try:
                    if hit is not None:
                        assert 0 < hit.length <= len(prompt) - 1
                        key = (space, tuple(prompt[: hit.length]))
                        assert key in model.checkpoints, "a hit on a prefix never inserted under that key"
                        slot = cache.fork(hit, request_id=f"r{a}")
                        model.slots[slot] = model.checkpoints[key]
                    else:
                        (slot,) = mgr.alloc(1, request_id=f"r{a}")
                        model.slots[slot] = 0.0
                except mc.PoolExhaustedError:
                    continue
                model.prompt[slot], model.key[slot] = prompt, space
            elif kind == "insert" and running:
                slot = running[a % len(running)]
                n = 1 + b % 6  # on the block grid and off it
                if cache.insert(model.prompt[slot][:n], slot, key=model.key[slot]):
                    model.checkpoints[model.key[slot], tuple(model.prompt[slot][:n])] = model.slots[slot]
            elif kind == "fork" and running:
                # Match and fork in separate calls with other events in between: the hit stays exact.
                owner = running[a % len(running)]
                prompt, space = model.prompt[owner], model.key[owner]
                hit = cache.match(prompt, key=space)
                if hit is not None and running:
                    victim = running[b % len(running)]
                    mgr.release(victim)
                    del model.slots[victim], model.prompt[victim], model.key[victim]
                    try:
                        slot = cache.fork(hit)
                    except mc.StaleHitError:
                        assert hit._node is not None and not hit._node.live
                        continue
                    except mc.PoolExhaustedError:
                        continue
                    model.slots[slot] = model.checkpoints[space, tuple(prompt[: hit.length])]
                    model.prompt[slot], model.key[slot] = prompt, space
            elif kind == "release" and running:
                slot = running[a % len(running)]
                mgr.release(slot)
                del model.slots[slot], model.prompt[slot], model.key[slot]
            elif kind == "cow" and len(running) > 1:
                src, dst = running[a % len(running)], running[b % len(running)]
                mgr.copy_on_write(src, dst)
                model.slots[dst] = model.slots[src]
                model.prompt[dst], model.key[dst] = model.prompt[src], model.key[src]
            elif kind == "clear" and running:
                slot = running[a % len(running)]
                mgr.clear(slot)
                model.slots[slot] = 0.0
            elif kind == "evict":
                cache.evict()
            elif kind == "flush":
                mgr.flush_nowait()
                for slot, want in model.slots.items():
                    assert value_of(pool, slot) == want, (slot, want)
                for slot in model.slots:  # a forward writes every running slot
                    model.slots[slot] = model.fresh()
                    fill(pool, slot, model.slots[slot])
            stats = cache.stats
            assert stats.device_checkpoints <= max_ckpt and stats.host_checkpoints <= host_ckpt
            held = mgr.held()
            assert sum(t == "prefix-cache" for t in held.values()) == stats.device_checkpoints
        mgr.flush_nowait()
        for slot, want in model.slots.items():
            assert value_of(pool, slot) == want
        cache.clear()
        for slot in list(model.slots):
            mgr.release(slot)
        mgr.flush_nowait()
        mgr.check_idle()
        assert host is None or host.num_held == 0
    return cache.stats


@given(raw=prefix_ops, num_slots=st.integers(3, 8), max_ckpt=st.integers(0, 4), host_ckpt=st.sampled_from([0, 2, 3]))
@settings(max_examples=150)
def test_every_fork_reads_its_checkpoint_as_inserted(
    raw: list[tuple[str, int, int]], num_slots: int, max_ckpt: int, host_ckpt: int
) -> None:
    run(raw, num_slots, max_ckpt, host_ckpt)


def test_a_long_run_exercises_every_path() -> None:
    import random

    rng = random.Random(0)
    raw = [(rng.choice(OPS), rng.randrange(10**6), rng.randrange(10**6)) for _ in range(3000)]
    stats = run(raw, 7, 3, 2)
    assert stats.hits and stats.misses and stats.evictions and stats.offloads and stats.restores
    assert stats.host_drops and stats.tokens_saved >= 2 * stats.hits


def _cache(num_slots: int = 8, **kwargs: Any) -> tuple[mc.StatePool, mc.CacheManager, mc.PrefixCache]:
    pool = mc.StatePool(SPEC, num_slots)
    host = mc.HostPool(SPEC, 4)
    mgr = mc.CacheManager(pool, host_pool=host).__enter__()
    return pool, mgr, mc.PrefixCache(mgr, block_size=B, **kwargs)


def test_longest_block_aligned_prefix_on_either_tier() -> None:
    _pool, mgr, cache = _cache(max_checkpoints=1, host_checkpoints=2)
    (s,) = mgr.alloc(1, request_id="a")
    assert cache.match([1, 2, 3]) is None
    assert cache.insert([1, 2], s, payload="kv-2")
    assert cache.insert([1, 2, 3, 4], s, payload="kv-4")  # evicts [1, 2] to the host (the budget is 1)
    hit = cache.match([1, 2, 3, 4, 5])
    assert hit is not None and (hit.length, hit.tier, hit.payload) == (4, "device", "kv-4")
    hit = cache.match([1, 2, 3, 9])
    assert hit is not None and (hit.length, hit.tier, hit.payload) == (2, "host", "kv-2")
    assert cache.match([1, 2, 3, 4]).length == 4  # type: ignore[union-attr]  # a hit may cover every token
    assert not cache.insert([1, 2], s)  # cached already (on the host): nothing new
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.inserts, stats.evictions, stats.offloads) == (3, 1, 2, 1, 1)
    assert stats.hit_rate == 0.75


def test_eviction_takes_the_least_recently_used_leaf() -> None:
    _pool, mgr, cache = _cache(max_checkpoints=3)
    (s,) = mgr.alloc(1)
    cache.insert([1, 1], s)
    cache.insert([1, 1, 2, 2], s)  # [1 1] is now interior: not a leaf
    cache.insert([3, 3], s)
    cache.match([3, 3])  # [3 3] is the most recently used
    cache.insert([4, 4], s)  # evicts the LRU leaf: [1 1 2 2], not the older interior [1 1]
    assert cache.match([1, 1, 2, 2]).length == 2  # type: ignore[union-attr]
    cache.insert([5, 5], s)  # [1 1] was just matched: the least recently used leaf is [3 3]
    assert cache.match([3, 3]) is None and cache.match([1, 1]) is not None


def test_a_checkpoint_evicted_after_a_fork_in_the_same_step_still_feeds_it() -> None:
    pool, mgr, cache = _cache(num_slots=3, max_checkpoints=1)
    (s,) = mgr.alloc(1)
    mgr.flush_nowait()
    fill(pool, s, 7.0)
    cache.insert([1, 1], s)
    hit = cache.match([1, 1, 1])
    assert hit is not None
    r = cache.fork(hit, request_id="r")
    mgr.clear(s)  # after the insert in the event order: the checkpoint keeps 7
    cache.insert([2, 2], s)  # budget 1: evicts [1 1], dropping it (no host tier), in this same step
    mgr.flush_nowait()
    assert value_of(pool, r) == 7.0
    assert value_of(pool, s) == 0.0 and value_of(pool, cache.match([2, 2])._node.slot) == 0.0  # type: ignore[union-attr]
    with pytest.raises(mc.StaleHitError):
        cache.fork(hit)


def test_bad_input_is_refused_and_changes_nothing() -> None:
    _pool, mgr, cache = _cache()
    (s,) = mgr.alloc(1)
    with pytest.raises(mc.InvalidArgumentError, match="at least one token"):
        cache.insert([], s)
    for bad_key in ([1], {"a": 1}, {2}):
        with pytest.raises(mc.InvalidArgumentError, match="key must be hashable"):
            cache.insert([1, 2], s, key=bad_key)
        with pytest.raises(mc.InvalidArgumentError, match="key must be hashable"):
            cache.match([1, 2], key=bad_key)
    with pytest.raises(mc.SlotStateError):
        cache.insert([1, 2], 5)
    with pytest.raises(mc.InvalidArgumentError, match="tokens must be"):
        cache.match("abc")  # type: ignore[arg-type]
    with pytest.raises(mc.InvalidArgumentError, match="tokens must be ints"):
        cache.match([1.0, 2.0])  # type: ignore[list-item]
    with pytest.raises(mc.InvalidArgumentError, match="PrefixHit"):
        cache.fork(mc.PrefixHit(2, "device"))
    assert len(cache) == 0 and mgr.pending == 1  # the alloc only
    with pytest.raises(mc.InvalidArgumentError, match="needs a manager with a host pool"):
        mc.PrefixCache(mc.CacheManager(mc.StatePool(SPEC, 2)), host_checkpoints=1)
    with pytest.raises(mc.InvalidArgumentError, match="block_size"):
        mc.PrefixCache(mgr, block_size=0)
    assert cache.match(torch.tensor([1, 2])) is None  # CPU tensors of token ids are taken


def test_trace_events_for_every_prefix_operation() -> None:
    tracing.configure(level="debug", use_structlog_config=True)
    try:
        with capture_logs() as logs:
            _pool, mgr, cache = _cache(max_checkpoints=1, host_checkpoints=1)
            (s,) = mgr.alloc(1, request_id="a")
            cache.match([1, 1])
            cache.insert([1, 1], s)
            cache.insert([2, 2], s)
            cache.fork(cache.match([1, 1]), request_id="b")  # type: ignore[arg-type]
            mgr.flush_nowait()
    finally:
        tracing.disable()
    names = [e["event"] for e in logs]
    for name in ("prefix.miss", "prefix.insert", "prefix.evict", "prefix.hit", "prefix.fork", "slot.offload"):
        assert name in names, name
    assert "slot.restore" in names


def test_the_trace_of_a_long_run_is_clean_and_counts_the_tiers(tmp_path: Any) -> None:
    import random

    path = tmp_path / "trace.jsonl"
    tracing.configure(str(path), level="debug")
    try:
        rng = random.Random(1)
        stats = run([(rng.choice(OPS), rng.randrange(10**6), rng.randrange(10**6)) for _ in range(1500)], 7, 3, 2)
    finally:
        tracing.disable()
    analysis = tracing.analyze(path, expect_idle=True)
    assert analysis.anomalies == [] and analysis.bad_lines == []
    summary = analysis.summary
    assert summary["prefix_hits"] == stats.hits and summary["prefix_misses"] == stats.misses
    assert summary["prefix_evictions"] == stats.evictions and summary["offloads"] >= stats.offloads > 0
    assert summary["restores"] >= stats.restores > 0 and summary["host_held_at_end"] == 0


def test_the_analyzer_flags_a_restore_of_a_dropped_host_slot_and_a_fork_from_an_evicted_checkpoint() -> None:
    import json

    def lines(*records: dict[str, Any]) -> list[str]:
        return [json.dumps({"step": 0, "request_id": None, **r}) for r in records]

    trace = lines(
        {"event": "slot.alloc", "slot": 1, "cleared": True},
        {"event": "slot.alloc", "slot": 2, "cleared": False},
        {"event": "prefix.insert", "slot": 2, "src": 1, "length": 4},
        {"event": "slot.cow", "src": 1, "dst": 2},
        {"event": "slot.offload", "slot": 1, "host": 3},
        {"event": "host.drop", "host": 3},
        {"event": "slot.restore", "host": 3, "slot": 1, "keep": False},
        {"event": "slot.release", "slot": 2},
        {"event": "prefix.evict", "slot": 2, "length": 4, "to": "dropped"},
        {"event": "prefix.fork", "slot": 1, "src": 2, "length": 4},
        {"event": "slot.cow", "src": 2, "dst": 1},
    )
    analysis = tracing.analyze_lines(trace)
    kinds = [a.kind for a in analysis.anomalies]
    assert kinds.count("restore-from-dropped") == 1 and kinds.count("fork-from-evicted") == 2
    assert "copy-from-released" in kinds  # the cow also reads a free slot
    bad = tracing.analyze_lines([*trace, json.dumps({"event": "slot.restore", "slot": 1, "host": "3"})])
    assert bad.bad_lines and "'host' must be an integer" in bad.bad_lines[0].reason


@pytest.mark.parametrize("filled_by_swap", [False, True], ids=["tier-sized", "filled-by-swap"])
def test_a_full_host_tier_drops_exactly_its_least_recently_used_checkpoint(filled_by_swap: bool) -> None:
    """A HostPool of exactly host_checkpoints slots (or one a swap filled): each eviction to the host drops one
    host checkpoint, the least recently used; every other one survives and restores exactly."""
    k = 3
    pool = mc.StatePool(SPEC, 8)
    host = mc.HostPool(SPEC, k + 1 if filled_by_swap else k)
    prompts = [[i, i] for i in range(10, 16)]
    with mc.CacheManager(pool, host_pool=host) as mgr:
        cache = mc.PrefixCache(mgr, block_size=B, max_checkpoints=1, host_checkpoints=k)
        if filled_by_swap:
            (r,) = mgr.alloc(1, request_id="swapped")
            mgr.offload(r, request_id="swapped")  # a preempted request holds one host slot
            mgr.release(r, request_id="swapped")
        (src,) = mgr.alloc(1, request_id="src")
        mgr.flush_nowait()
        for i, prompt in enumerate(prompts):  # each insert evicts the previous checkpoint to the host tier
            fill(pool, src, 100.0 + i)
            assert cache.insert(prompt, src)
            mgr.flush_nowait()
        # 6 checkpoints made: 1 on the device, 3 on the host, the 2 oldest dropped, one at a time.
        stats = cache.stats
        assert (stats.device_checkpoints, stats.host_checkpoints, stats.host_drops) == (1, k, 2)
        for i, prompt in enumerate(prompts):
            hit = cache.match(prompt)
            if i < 2:
                assert hit is None, f"checkpoint {i} should have been the LRU one dropped"
                continue
            assert hit is not None and hit.tier == ("device" if i == 5 else "host")
            slot = cache.fork(hit, request_id=f"q{i}")
            mgr.flush_nowait()
            assert value_of(pool, slot) == 100.0 + i
            mgr.release(slot, request_id=f"q{i}")
        mgr.release(src, request_id="src")
        cache.clear()
        mgr.flush_nowait()
        if filled_by_swap:
            assert list(host.held().values()) == ["swapped"]
        else:
            mgr.check_idle()


@pytest.mark.parametrize("bad", [1.0, "1", None, True, torch.tensor([1]), 0, 99, -1])
def test_insert_with_a_bad_slot_is_a_typed_error_that_changes_nothing(bad: Any) -> None:
    np = pytest.importorskip("numpy")
    pool = mc.StatePool(SPEC, 4)
    host = mc.HostPool(SPEC, 2)
    with mc.CacheManager(pool, host_pool=host) as mgr:
        cache = mc.PrefixCache(mgr, block_size=B, max_checkpoints=1, host_checkpoints=1)
        (a,) = mgr.alloc(1, request_id="a")
        assert cache.insert([1, 2], a)
        mgr.flush_nowait()
        before = (mgr.held(), host.held(), cache.stats, len(cache), mgr.pending)
        for value in (bad, np.float64(1)):
            with pytest.raises((mc.InvalidSlotError, mc.SlotStateError)):
                cache.insert([3, 4], value)
            assert (mgr.held(), host.held(), cache.stats, len(cache), mgr.pending) == before
        assert cache.match([1, 2]) is not None  # nothing evicted
        mgr.release(a, request_id="a")
        cache.clear()
        mgr.flush_nowait()
        mgr.check_idle()


def trie(cache: mc.PrefixCache) -> dict[tuple[int, ...], tuple[str, int]]:
    """Every checkpoint the cache holds under the default key: its prefix -> (tier, pool or host slot)."""
    return {
        prefix: ("device", node.slot) if node.slot else ("host", node.host)
        for space, prefix, node in cache._trie.nodes()
        if space is None and (node.slot or node.host)
    }


def host_value(host: mc.HostPool, h: int) -> float:
    values = {float(v) for t in host.tensors for v in t[:, h].flatten().tolist()}
    assert len(values) == 1, f"host slot {h} holds a mix of states: {sorted(values)[:4]}"
    return values.pop()


def _snapshot(mgr: mc.CacheManager, cache: mc.PrefixCache) -> tuple[Any, ...]:
    host = mgr.host_pool
    assert host is not None
    return (mgr.held(), host.held(), trie(cache), len(cache), cache.stats, mgr.pending, list(cache._device))


def _full_tiers() -> tuple[mc.StatePool, mc.CacheManager, mc.PrefixCache, int, mc.PrefixHit]:
    """A cache whose device budget and host tier are both full, so any insert or fork would evict."""
    pool = mc.StatePool(SPEC, 5)
    host = mc.HostPool(SPEC, 2)
    mgr = mc.CacheManager(pool, host_pool=host).__enter__()
    cache = mc.PrefixCache(mgr, block_size=B, max_checkpoints=1, host_checkpoints=2)
    (s,) = mgr.alloc(1, request_id="s")
    for i in range(3):
        assert cache.insert([i, i], s)
    mgr.flush_nowait()
    hit = cache.match([2, 2])
    assert hit is not None and hit.tier == "device"
    assert (cache.stats.device_checkpoints, cache.stats.host_checkpoints, host.num_free) == (1, 2, 0)
    return pool, mgr, cache, s, hit


BAD_CACHE_KWARGS: list[dict[str, Any]] = [
    {"block_size": 0}, {"block_size": True}, {"block_size": 2.0}, {"max_checkpoints": -1},
    {"max_checkpoints": None}, {"host_checkpoints": "1"}, {"host_checkpoints": -1},
]  # fmt: skip


def test_every_public_call_with_a_bad_argument_is_a_typed_error_that_changes_nothing() -> None:
    np = pytest.importorskip("numpy")
    pool, mgr, cache, s, hit = _full_tiers()
    other_pool = mc.StatePool(SPEC, 3)
    with mc.CacheManager(other_pool) as other_mgr:
        other = mc.PrefixCache(other_mgr, block_size=B, max_checkpoints=1)
        (o,) = other_mgr.alloc(1)
        assert other.insert([2, 2], o)
        foreign = other.match([2, 2])
        assert foreign is not None
        before = _snapshot(mgr, cache)
        bad_calls: list[tuple[Any, type[Exception]]] = [
            # the constructor
            (lambda: mc.PrefixCache(pool), mc.InvalidArgumentError),  # type: ignore[arg-type]
            *[(lambda kw=kw: mc.PrefixCache(mgr, **kw), mc.InvalidArgumentError) for kw in BAD_CACHE_KWARGS],
            # match: tokens only
            *[
                (lambda t=t: cache.match(t), mc.InvalidArgumentError)
                for t in ("ab", b"ab", 5, None, [1.0, 2.0], [True, 2], [np.int64(2), 2], np.array([1.5, 2.5]))
            ],
            (lambda: cache.match(torch.tensor([[2, 2]])), mc.InvalidArgumentError),
            # fork: the hit and the request id
            *[
                (lambda h=h: cache.fork(h), mc.InvalidArgumentError)
                for h in (None, mc.PrefixHit(2, "device"), (2, "device"), foreign)
            ],
            *[(lambda r=r: cache.fork(hit, request_id=r), mc.InvalidArgumentError) for r in (1, b"r", ["r"])],
            # insert: the tokens, then the slot
            *[(lambda t=t: cache.insert(t, s), mc.InvalidArgumentError) for t in ([], "ab", [3.0, 3], [3, None])],
            # the extra key: hashable, checked before the slot and before any eviction
            *[(lambda k=k: cache.insert([3], s, key=k), mc.InvalidArgumentError) for k in ([1], {}, {1}, ([1],))],
            *[(lambda k=k: cache.match([2, 2], key=k), mc.InvalidArgumentError) for k in ([1], {}, {1}, ([1],))],
            *[
                (lambda v=v: cache.insert([3, 3], v), mc.InvalidSlotError)
                for v in (1.0, "1", None, True, np.float64(1), np.bool_(True), torch.tensor([1]), 0, 99, -1)
            ],
            (lambda: cache.insert([3, 3], 5), mc.SlotStateError),  # in range, not allocated
        ]
        for call, error in bad_calls:
            with pytest.raises(error):
                call()
            assert _snapshot(mgr, cache) == before
        assert foreign._node is not None and foreign._node.slot  # the other cache was not touched either
    mgr.flush_nowait()
    mgr.release(s, request_id="s")
    cache.clear()
    mgr.flush_nowait()
    mgr.check_idle()
    mgr.__exit__(None, None, None)


def test_calls_on_a_closed_manager_are_refused_before_anything_changes() -> None:
    """insert, fork, evict and clear on a full cache would each evict, drop or release: the manager's refusal
    comes first, so the cache still tracks every checkpoint (no checkpoint lost, no slot untracked)."""
    _pool, mgr, cache, s, hit = _full_tiers()
    host_hit = cache.match([0, 0])
    assert host_hit is not None and host_hit.tier == "host"
    mgr.__exit__(None, None, None)
    before = _snapshot(mgr, cache)
    for call in (
        lambda: cache.insert([7, 7], s),
        lambda: cache.fork(hit),
        lambda: cache.fork(host_hit),
        cache.evict,
        cache.clear,
    ):
        with pytest.raises(mc.ManagerClosedError):
            call()
        assert _snapshot(mgr, cache) == before


def test_the_host_tier_evicts_in_recency_order_many_times_in_one_step() -> None:
    """A full host tier (HostPool of exactly host_checkpoints slots): a match refreshes a host checkpoint, and two
    evictions in one step drop exactly the two least recently used, each new host checkpoint taking a slot freed
    in that step; the survivors and the new ones restore exactly."""
    k = 3
    pool, host = mc.StatePool(SPEC, 8), mc.HostPool(SPEC, k)
    with mc.CacheManager(pool, host_pool=host) as mgr:
        cache = mc.PrefixCache(mgr, block_size=B, max_checkpoints=1, host_checkpoints=k)
        (src,) = mgr.alloc(1, request_id="src")
        mgr.flush_nowait()
        for i in range(k + 1):  # [0 0] [1 1] [2 2] on the host, [3 3] on the device
            fill(pool, src, 100.0 + i)
            assert cache.insert([i, i], src)
            mgr.flush_nowait()
        assert cache.match([0, 0]) is not None  # host LRU order now: [1 1] [2 2] [0 0]
        held_before = host.held()
        for i in (4, 5):  # one step: [3 3] then [4 4] go to the host, dropping [1 1] then [2 2]
            fill(pool, src, 100.0 + i)  # the insert's copy reads src at the flush; both read this value
            assert cache.insert([i, i], src)
        assert cache.stats.host_drops == 2 and host.num_free == 0
        assert set(host.held()) == set(held_before)  # the two new host checkpoints took the two freed slots
        mgr.flush_nowait()
        want = {(0, 0): 100.0, (3, 3): 103.0, (4, 4): 105.0, (5, 5): 105.0}
        assert {key: tier for key, (tier, _) in trie(cache).items()} == {
            (0, 0): "host", (3, 3): "host", (4, 4): "host", (5, 5): "device",
        }  # fmt: skip
        for key, value in want.items():
            got = cache.match(list(key))
            assert got is not None and got.length == 2
            slot = cache.fork(got, request_id="q")
            mgr.flush_nowait()
            assert value_of(pool, slot) == value, key
            mgr.release(slot, request_id="q")
        mgr.release(src, request_id="src")
        cache.clear()
        mgr.flush_nowait()
        mgr.check_idle()


@pytest.mark.parametrize("filled_by_swap", [False, True], ids=["tier-sized", "filled-by-swap"])
def test_a_restore_reads_a_host_checkpoint_dropped_and_rewritten_later_in_its_step(filled_by_swap: bool) -> None:
    """Fork from a host checkpoint, then evict it in the same step: the offload that takes its host slot runs after
    the restore read the old state."""
    k = 2
    pool, host = mc.StatePool(SPEC, 8), mc.HostPool(SPEC, k + filled_by_swap)
    with mc.CacheManager(pool, host_pool=host) as mgr:
        cache = mc.PrefixCache(mgr, block_size=B, max_checkpoints=1, host_checkpoints=k)
        if filled_by_swap:
            (r,) = mgr.alloc(1, request_id="swapped")
            mgr.flush_nowait()
            fill(pool, r, 55.0)
            swapped = mgr.offload(r, request_id="swapped")
            mgr.release(r, request_id="swapped")
        (src,) = mgr.alloc(1, request_id="src")
        mgr.flush_nowait()
        for i in range(k + 1):  # [0 0] [1 1] on the host, [2 2] on the device
            fill(pool, src, 100.0 + i)
            assert cache.insert([i, i], src)
            mgr.flush_nowait()
        assert host.num_free == 0
        hit = cache.match([0, 0])
        assert hit is not None and hit.tier == "host"
        (h0,) = (h for key, (tier, h) in trie(cache).items() if key == (0, 0))
        forked = cache.fork(hit, request_id="f")  # restore(h0, keep=True)
        cache.match([1, 1])  # [0 0] is the least recently used host checkpoint again
        fill(pool, src, 103.0)
        assert cache.insert([3, 3], src)  # evicts [2 2] to the host: drops [0 0] and takes h0
        assert trie(cache)[(2, 2)] == ("host", h0) and cache.match([0, 0]) is None
        assert trie(cache)[(1, 1)][0] == "host" and cache.stats.host_drops == 1  # only the LRU one went
        mgr.flush_nowait()
        assert value_of(pool, forked) == 100.0
        assert host_value(host, h0) == 102.0
        if filled_by_swap:
            assert host_value(host, swapped) == 55.0
            mgr.drop(swapped)
        mgr.release(forked, request_id="f")
        mgr.release(src, request_id="src")
        cache.clear()
        mgr.flush_nowait()
        mgr.check_idle()


def test_an_insert_from_a_slot_awaiting_a_state_is_refused_before_anything_changes() -> None:
    """A slot that awaits its state from a peer (``expect_import``) holds nothing to checkpoint, and the manager
    refuses the fork out of it; the insert refused that only after evicting, allocating the checkpoint slot and
    linking the prefix, so the slot stayed held by the cache's tenant, tracked by no checkpoint (a leak)."""
    _pool, mgr, cache, s, _hit = _full_tiers()
    held = mgr.held()
    t = next(x for x in range(1, mgr.pool.num_slots + 1) if x not in held)
    mgr.expect_import(t, "a")
    assert (mgr.awaiting_import(t), mgr.awaiting_import(s)) == ("a", None)
    before = _snapshot(mgr, cache)
    with pytest.raises(mc.SlotStateError, match="awaits"):
        cache.insert([7, 7], t)
    assert _snapshot(mgr, cache) == before
    mgr.release(t, request_id="a")
    mgr.release(s, request_id="s")
    cache.clear()
    mgr.flush_nowait()
    mgr.check_idle()
    mgr.__exit__(None, None, None)
