"""Two PrefixCaches on one manager, each with its own reservation (issue #31): each cache's checkpoints are held by
its own tenant, its reservation counts those only, and neither uses up the other's budget.

A property test against :class:`tests.support.cache_model.CacheModel` (two of them on one
:class:`~tests.support.cache_model.PoolModel`): random requests admitted (a plain alloc or
a fork from either cache), inserts into either cache, evictions, releases,
clears and flushes; after each step the checkpoints, their states, the free and
available slot counts and the tenants ``held()`` shows match the model, and each
cache below its reservation finds a slot for an insert whatever the requests
and the other cache hold.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mambacache as mc

from ..support.cache_model import CacheModel, PoolModel, key_of, value_of

SPEC = mc.StateSpec(num_layers=1, conv_shapes=[(3, 2)], temporal_shape=(2,), conv_dtype=torch.float32)
PROMPTS = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 7, 7], [1, 9], [8, 8, 8, 8]]
OPS = ("admit", "admit", "admit", "fork", "fork", "fork", "insert", "insert", "insert", "evict", "release", "release",
       "clear-cache", "flush")  # fmt: skip


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """Pool slots, and each cache's (max_checkpoints, reserved): the reservations leave a slot for requests."""
    num_slots = draw(st.integers(3, 9))
    caps = (draw(st.integers(0, 4)), draw(st.integers(0, 4)))
    ra = draw(st.integers(0, min(caps[0], num_slots - 2)))
    rb = draw(st.integers(0, min(caps[1], num_slots - 1 - ra - 1)))
    return num_slots, (caps[0], ra), (caps[1], rb)


def fill(pool: mc.StatePool, slot: int, value: float) -> None:
    for t in pool.tensors:
        t[:, slot] = value


class Run:
    """The real manager and caches, the models, and each running request's state tag and prompt."""

    def __init__(self, mgr: mc.CacheManager, caches: list[mc.PrefixCache], models: list[CacheModel]) -> None:
        self.mgr, self.caches, self.models = mgr, caches, models
        self.slots: dict[int, tuple[float, list[int]]] = {}
        self.tag = 0.0

    def start(self, slot: int, prompt: list[int], value: float) -> None:
        """A request is running in ``slot``: flush its alloc or fork, check the state it got, give it its own."""
        self.mgr.flush_nowait()
        assert value_of(self.mgr.pool.tensors, slot) == value, ("the state a request starts from", slot)
        self.tag += 1.0
        fill(self.mgr.pool, slot, self.tag)
        self.slots[slot] = (self.tag, prompt)

    def check(self) -> None:
        pool, mgr = self.mgr.pool, self.mgr
        held = mgr.held()
        for cache, m in zip(self.caches, self.models, strict=True):
            assert [key_of(n)[1] for n in cache._device] == [k[1] for k in m.device], cache.tenant
            assert sum(t == cache.tenant for t in held.values()) == len(m.device), cache.tenant
            assert cache.stats.evictions == m.counts["evictions"] and cache.stats.skipped == m.counts["skipped"]
        assert pool.num_free == self.models[0].pool.free
        assert mgr.available == self.models[0].pool.available()
        # Each budget kept: the free slots cover what every reservation still lacks.
        assert pool.num_free >= sum(max(0, c.reserved - len(c._device)) for c in self.caches)
        assert mgr.reservations == {c.tenant: c.reserved for c in self.caches if c.reserved}

    def check_states(self) -> None:
        """After a flush: every checkpoint holds the state its insert saw."""
        for cache, m in zip(self.caches, self.models, strict=True):
            for node in cache._device:
                assert value_of(self.mgr.pool.tensors, node.slot) == m.device[key_of(node)], cache.tenant


def play(run: Run, kind: str, which: int, a: int, b: int) -> None:
    """One drawn operation, on the real manager and caches and on the models; then the check, refused or not."""
    step(run, kind, which, a, b)
    run.check()


def step(run: Run, kind: str, which: int, a: int, b: int) -> None:
    mgr, cache, m = run.mgr, run.caches[which], run.models[which]
    running = sorted(run.slots)
    if kind == "admit":  # a plain request: it evicts nothing
        prompt = PROMPTS[a % len(PROMPTS)]
        if not m.pool.available():
            with pytest.raises(mc.PoolExhaustedError):
                mgr.alloc(1, request_id="r")
            return
        (slot,) = mgr.alloc(1, request_id="r")
        m.pool.free -= 1
        run.start(slot, prompt, 0.0)
    elif kind == "fork":
        prompt = PROMPTS[a % len(PROMPTS)]
        hit = cache.match(prompt[:-1])
        want = m.match(prompt[:-1])
        assert (None if hit is None else ((None, tuple(prompt[: hit.length])), hit.tier)) == want
        if hit is None or want is None:
            return
        try:
            value = m.fork(want[0])
        except mc.PoolExhaustedError:
            with pytest.raises(mc.PoolExhaustedError):
                cache.fork(hit, request_id="r")
            return
        run.start(cache.fork(hit, request_id="r"), prompt, value)
    elif kind == "insert" and running:
        slot = running[a % len(running)]
        value, prompt = run.slots[slot]
        tokens = prompt[: 1 + b % len(prompt)]
        fresh, below = (None, tuple(tokens)) not in m.device, len(m.device) < m.reserved
        made = cache.insert(tokens, slot)
        assert made == m.insert((None, tuple(tokens)), value)
        if fresh and below:  # below its reservation, an insert finds a slot whatever the others hold
            assert made, (cache.tenant, mgr.held())
    elif kind == "evict":
        assert cache.evict() == m.evict(None)
    elif kind == "release" and running:
        slot = running[a % len(running)]
        mgr.release(slot, request_id="r")
        del run.slots[slot]
        m.pool.free += 1
    elif kind == "clear-cache":
        cache.clear()
        m.clear()
    elif kind == "flush":
        mgr.flush_nowait()
        run.check_states()


@given(
    layouts(),
    st.lists(
        st.tuples(st.sampled_from(OPS), st.integers(0, 1), st.integers(0, 99), st.integers(0, 99)),
        min_size=20,
        max_size=80,
    ),
)
def test_two_caches_each_keep_their_own_reservation(
    layout: tuple[int, tuple[int, int], tuple[int, int]], raw: list[tuple[str, int, int, int]]
) -> None:
    num_slots, (cap_a, ra), (cap_b, rb) = layout
    pool = mc.StatePool(SPEC, num_slots)
    shared = PoolModel(num_slots)
    models = [CacheModel(cap_a, 0, num_slots, 0, ra, pool=shared), CacheModel(cap_b, 0, num_slots, 0, rb, pool=shared)]
    with mc.CacheManager(pool) as mgr:
        caches = [
            mc.PrefixCache(mgr, block_size=2, max_checkpoints=cap_a, reserved=ra),
            mc.PrefixCache(mgr, block_size=2, max_checkpoints=cap_b, reserved=rb),
        ]
        assert [c.tenant for c in caches] == ["prefix-cache", "prefix-cache-2"]
        run = Run(mgr, caches, models)
        run.check()
        for kind, which, a, b in raw:
            play(run, kind, which, a, b)
        mgr.flush_nowait()
        run.check_states()
        for cache in caches:
            cache.close()
        mgr.release_many(sorted(run.slots), request_id="r")
        mgr.flush_nowait()
        mgr.check_idle()


def test_a_second_caches_checkpoints_do_not_use_up_the_firsts_reservation() -> None:
    """The issue's case: the first cache reserves 2, the second (none) fills the pool with checkpoints; requests
    take what is left. The first cache still finds both its reserved slots, and ``held()`` names each cache."""
    pool = mc.StatePool(SPEC, 6)
    with mc.CacheManager(pool) as mgr:
        first = mc.PrefixCache(mgr, block_size=2, max_checkpoints=2, reserved=2)
        second = mc.PrefixCache(mgr, block_size=2, max_checkpoints=8)
        (src,) = mgr.alloc(1, request_id="r")
        assert all(second.insert([i], src) for i in range(8))  # each beyond the third evicts the oldest
        assert (len(second), second.stats.evictions) == (3, 5)  # 6 slots: the request's, 3, and 2 kept for `first`
        assert mgr.available == 0 and pool.num_free == 2
        with pytest.raises(mc.PoolExhaustedError, match="2 of them kept for 'prefix-cache'"):
            mgr.alloc(1, request_id="r2")
        assert first.insert([1, 2], src) and first.insert([3, 4], src)
        held = mgr.held()
        assert sorted(held.values()) == ["prefix-cache"] * 2 + ["prefix-cache-2"] * 3 + ["r"]
        for cache in (first, second):
            cache.close()
        mgr.release(src, request_id="r")
        mgr.flush_nowait()
        mgr.check_idle()
