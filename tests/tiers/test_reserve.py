"""A reserved checkpoint budget (issue #21): slots kept for one tenant, that every other tenant's allocation leaves.

The ledger against a plain-dict model (every take, hand-over and reservation),
the manager's surface (alloc, alloc_slots, alloc_wait, hand_over, errors, the
reservation's lifetime) and PrefixCache(reserved=k) (its validation, inserts
below the reservation, forks that do not evict within it). The tiers together,
with faults, against the oracle: tests/tiers/test_tiers_property.py.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mambacache as mc
from mambacache._core._ledger import SlotLedger
from mambacache._tiers._prefix import CHECKPOINT_TENANT

SPEC = mc.StateSpec(num_layers=1, conv_shapes=[(4, 2)], temporal_shape=(2, 2), conv_dtype=torch.float32)
TENANTS = ["ck", "a", "b", None]

ops = st.lists(
    st.tuples(
        st.sampled_from(["take", "take", "exact", "give", "hand", "later", "reuse", "reserve"]),
        st.integers(0, 10**6),
        st.integers(0, 4),
        st.sampled_from(TENANTS),
    ),
    max_size=80,
)


class LedgerModel:
    """Held slots by tenant and each tenant's reservation, counted the obvious way (by walking everything)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.held: dict[int, str | None] = {}
        self.later: list[int] = []  # freed by free_later, reusable only after everything else
        self.reserved: dict[str, int] = {}  # tenant -> slots kept for it

    def free(self) -> list[int]:
        return sorted(set(range(1, self.size + 1)) - set(self.held) - set(self.later))

    def count(self, tenant: str | None) -> int:
        return sum(1 for t in self.held.values() if t == tenant)

    def kept_for_others(self, tenant: str | None) -> int:
        return sum(max(0, k - self.count(t)) for t, k in self.reserved.items() if t != tenant)

    def available(self, tenant: str | None) -> int:
        return max(0, self.size - len(self.held) - self.kept_for_others(tenant))


def _state(ledger: SlotLedger) -> tuple[Any, ...]:
    return ledger.held_by(), ledger.num_free, {t: list(r) for t, r in ledger.reservations.items()}, ledger.kept


@given(ops, st.integers(1, 8))
def test_the_reservation_matches_a_walking_model(raw: list[tuple[str, int, int, str | None]], size: int) -> None:
    ledger, m = SlotLedger(size), LedgerModel(size)
    for kind, a, n, tenant in raw:
        before = _state(ledger)
        if kind == "take":
            if n > m.available(tenant):
                with pytest.raises(mc.PoolExhaustedError):
                    ledger.take(n, tenant)
                assert _state(ledger) == before  # nothing taken
                continue
            free = m.free()
            got = ledger.take(n, tenant)
            assert got == free[:n] + m.later[: max(0, n - len(free))]
            del m.later[: max(0, n - len(free))]
            m.held.update(dict.fromkeys(got, tenant))
        elif kind == "exact" and m.free():
            free = m.free()
            slots = free[a % len(free) :][: max(1, n)]
            if len(slots) > m.available(tenant):
                with pytest.raises(mc.PoolExhaustedError):
                    ledger.check_available(len(slots), tenant)
                continue
            ledger.check_available(len(slots), tenant)
            ledger.take_exact(slots, tenant)
            m.held.update(dict.fromkeys(slots, tenant))
        elif kind == "give" and m.held:
            slots = sorted(m.held)[a % len(m.held) :][: max(1, n)]
            ledger.give_back(slots)
            for s in slots:
                del m.held[s]
        elif kind == "hand" and m.held:
            s = sorted(m.held)[a % len(m.held)]
            assert ledger.hand_over(s, tenant) == m.held[s]
            m.held[s] = tenant
        elif kind == "later" and m.held:
            s = sorted(m.held)[a % len(m.held)]
            ledger.free_later(s)
            del m.held[s]
            m.later.append(s)
        elif kind == "reuse":
            ledger.reuse_freed()
            m.later.clear()
        elif kind == "reserve" and tenant is not None:
            k = n % size
            others = sum(v for t, v in m.reserved.items() if t != tenant)
            if k and others + k >= size:  # every slot kept: none left for anyone else
                with pytest.raises(mc.InvalidArgumentError, match="must leave a slot"):
                    ledger.reserve(k, tenant)
                assert _state(ledger) == before
                continue
            if k and k - m.count(tenant) > size - len(m.held) - m.kept_for_others(tenant):
                with pytest.raises(mc.PoolExhaustedError, match="cannot reserve"):
                    ledger.reserve(k, tenant)
                assert _state(ledger) == before
                continue
            ledger.reserve(k, tenant)
            if k:
                m.reserved[tenant] = k
            else:
                m.reserved.pop(tenant, None)
        assert ledger.held_by() == dict(sorted(m.held.items()))
        assert {t: r[0] for t, r in ledger.reservations.items()} == m.reserved
        assert {t: r[1] for t, r in ledger.reservations.items()} == {t: m.count(t) for t in m.reserved}
        assert ledger.reserved == sum(m.reserved.values())
        assert ledger.kept == sum(max(0, k - m.count(t)) for t, k in m.reserved.items())
        for t in TENANTS:
            assert ledger.available(t) == m.available(t), t


# -- the manager ---------------------------------------------------------------


def test_requests_never_take_reserved_slots_and_the_tenant_takes_any() -> None:
    pool = mc.StatePool(SPEC, 6)
    with mc.CacheManager(pool) as mgr:
        mgr.reserve(2, "ck")
        assert (mgr.reserved, mgr.available, pool.num_available, pool.num_free) == (2, 4, 4, 6)
        before = (mgr.held(), mgr.pending, pool.num_free)
        with pytest.raises(mc.PoolExhaustedError, match="2 of them kept for 'ck'"):
            mgr.alloc(5, request_id="r")
        assert (mgr.held(), mgr.pending, pool.num_free) == before
        assert mgr.alloc(4, request_id="r") == [1, 2, 3, 4]
        for attempt in (lambda: mgr.alloc(1), lambda: mgr.alloc_slots([6], request_id="x")):
            with pytest.raises(mc.PoolExhaustedError):
                attempt()
            assert (pool.num_free, mgr.available, 6 in mgr.held()) == (2, 0, False)
        assert mgr.alloc(1, request_id="ck") == [5]  # within the reservation: requests still see none
        assert (pool.num_free, mgr.available) == (1, 0)
        mgr.release(1, request_id="r")
        mgr.release(2, request_id="r")
        assert (pool.num_free, mgr.available) == (3, 2)
        assert mgr.alloc(3, request_id="ck") == [1, 2, 6]  # above it, the tenant takes unreserved slots too
        assert (pool.num_free, mgr.available) == (0, 0)
        mgr.release(6, request_id="ck")  # a checkpoint above the reservation: its slot is anyone's
        assert mgr.available == 1
        mgr.release_many([1, 2, 5], request_id="ck")
        assert (pool.num_free, mgr.available) == (4, 2)
        mgr.release_many([3, 4], request_id="r")
        mgr.flush_nowait()
        mgr.check_idle()


def test_hand_over_moves_slots_in_and_out_of_the_reservation() -> None:
    pool = mc.StatePool(SPEC, 5)
    with mc.CacheManager(pool) as mgr:
        mgr.reserve(2, CHECKPOINT_TENANT)
        r = mgr.alloc(3, request_id="r")
        assert mgr.available == 0
        mgr.hand_over(r[0], CHECKPOINT_TENANT, request_id="r")  # a finished request's slot becomes a checkpoint
        assert (pool.num_free, mgr.available) == (2, 1)
        assert mgr.alloc(1, request_id="r2") == [4]
        assert mgr.available == 0
        mgr.hand_over(r[0], "r3", request_id=CHECKPOINT_TENANT)  # and back: the reservation is short again
        assert (pool.num_free, mgr.available) == (1, 0)  # clamped: one free, two kept
        mgr.release(r[0], request_id="r3")
        assert (pool.num_free, mgr.available) == (2, 0)
        mgr.release(4)
        assert mgr.available == 1


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((-1, "ck"), mc.InvalidArgumentError),
        ((4, "ck"), mc.InvalidArgumentError),  # the pool's size: a request could never run
        ((1.0, "ck"), mc.InvalidArgumentError),
        ((True, "ck"), mc.InvalidArgumentError),
        ((1, None), mc.InvalidArgumentError),
        ((1, 3), mc.InvalidArgumentError),
        ((3, "other"), mc.InvalidArgumentError),  # with ck's 1, every slot kept: none left for a request
        ((2, "other"), mc.PoolExhaustedError),  # 1 free: 2 cannot be kept beside ck's
        ((3, "ck"), mc.PoolExhaustedError),  # 1 free, and ck holds 1: 3 cannot be kept
    ],
)
def test_a_bad_reservation_is_a_typed_error_that_changes_nothing(args: tuple[Any, Any], error: type) -> None:
    pool = mc.StatePool(SPEC, 4)
    with mc.CacheManager(pool) as mgr:
        mgr.alloc(2, request_id="r")
        mgr.reserve(1, "ck")
        mgr.alloc(1, request_id="ck")
        before = (mgr.held(), mgr.reserved, mgr.available, pool.num_free, mgr.pending)
        with pytest.raises(error):
            mgr.reserve(*args)
        assert (mgr.held(), mgr.reserved, mgr.available, pool.num_free, mgr.pending) == before


def test_the_reservation_is_resized_or_ended_by_its_tenant_and_ends_with_the_manager() -> None:
    pool = mc.StatePool(SPEC, 4)
    mgr = mc.CacheManager(pool)
    with pytest.raises(mc.ManagerClosedError):
        mgr.reserve(1, "ck")  # before `with`: nothing to attach it to
    with mgr:
        mgr.reserve(2, "ck")
        mgr.reserve(1, "ck")
        assert (mgr.reserved, mgr.available) == (1, 3)
        mgr.reserve(0, "ck")
        assert (mgr.reserved, mgr.available) == (0, 4)
        mgr.reserve(3, "other")  # ended: another tenant may reserve
        assert mgr.available == 1
    with pytest.raises(mc.ManagerClosedError):
        mgr.reserve(1, "other")
    assert (pool.num_available, pool.num_free) == (4, 4)  # the reservation was the closed manager's
    with mc.CacheManager(pool) as again:
        assert again.reserved == 0
        assert again.alloc(4, request_id="r") == [1, 2, 3, 4]
        again.release_many([1, 2, 3, 4], request_id="r")


@pytest.mark.anyio
async def test_alloc_wait_waits_for_an_available_slot_never_a_reserved_one() -> None:
    pool = mc.StatePool(SPEC, 4)
    async with mc.CacheManager(pool) as mgr:
        mgr.reserve(2, "ck")
        with pytest.raises(mc.InvalidArgumentError, match="reserved for 'ck'"):
            await mgr.alloc_wait(3, request_id="r")  # only 2 are ever a request's
        assert mgr.waiting == 0
        held = mgr.alloc(2, request_id="r")
        got: list[list[int]] = []

        async def want() -> None:
            got.append(await mgr.alloc_wait(1, request_id="w"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(want)
            with anyio.fail_after(10):  # generous: CI machines are shared
                while True:
                    if mgr.waiting == 1:
                        break
                    await anyio.sleep(0.001)
            (ck,) = mgr.alloc(1, request_id="ck")  # the tenant takes a reserved slot meanwhile
            mgr.release(ck, request_id="ck")  # two free again, both reserved
            await anyio.sleep(0.02)
            assert got == [] and pool.num_free == 2
            mgr.release(held[0], request_id="r")
        assert got == [[1]] and mgr.available == 0


# -- PrefixCache(reserved=k) ---------------------------------------------------


def _fill(pool: mc.StatePool, slot: int, value: float) -> None:
    for t in pool.tensors:
        t[:, slot] = value


def _value(pool: mc.StatePool, slot: int) -> float:
    return float(pool.temporal[0, slot, 0, 0])


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_checkpoints": 2, "reserved": 3}, mc.InvalidArgumentError),  # more than the cap
        ({"max_checkpoints": 8, "reserved": 5}, mc.InvalidArgumentError),  # the whole pool
        ({"reserved": -1}, mc.InvalidArgumentError),
        ({"reserved": 1.0}, mc.InvalidArgumentError),
        ({"reserved": True}, mc.InvalidArgumentError),
        ({"reserved": 4}, mc.PoolExhaustedError),  # 3 free now
    ],
)
def test_prefix_cache_refuses_a_bad_reservation_and_reserves_nothing(kwargs: dict[str, Any], error: type) -> None:
    pool = mc.StatePool(SPEC, 5)
    with mc.CacheManager(pool) as mgr:
        mgr.alloc(2, request_id="r")
        with pytest.raises(error):
            mc.PrefixCache(mgr, block_size=2, **kwargs)
        assert (mgr.reserved, mgr.available, len(mgr.held())) == (0, 3, 2)
        mc.PrefixCache(mgr, block_size=2, max_checkpoints=4, reserved=3)
        assert (mgr.reserved, mgr.available) == (3, 0)
        with pytest.raises(mc.PoolExhaustedError, match="kept for other reservations"):  # every free one is kept
            mc.PrefixCache(mgr, block_size=2, reserved=1)
        assert mgr.reservations == {"prefix-cache": 3}
        assert mc.PrefixCache(mgr, block_size=2).tenant == "prefix-cache-2"  # the refused cache took no name
    with pytest.raises(mc.ManagerClosedError):
        mc.PrefixCache(mgr, block_size=2, reserved=1)


def test_inserts_find_a_slot_below_the_reservation_however_many_requests_run() -> None:
    pool = mc.StatePool(SPEC, 6)
    with mc.CacheManager(pool) as mgr:
        cache = mc.PrefixCache(mgr, block_size=2, max_checkpoints=3, reserved=2)
        slots = mgr.alloc(mgr.available, request_id="r")  # requests take everything they may
        assert len(slots) == 4 and mgr.available == 0
        with pytest.raises(mc.PoolExhaustedError):
            mgr.alloc(1, request_id="late")
        mgr.flush_nowait()  # the allocs' clears run before the forward writes the slots
        for i, s in enumerate(slots[:2]):
            _fill(pool, s, 10.0 + i)
            assert cache.insert([i, i], s)
        mgr.flush_nowait()
        # A third is above the reservation and the pool is full: it replaces the least recently used one.
        _fill(pool, slots[2], 12.0)
        assert cache.insert([7, 7], slots[2])
        assert (cache.stats.evictions, cache.stats.device_checkpoints, cache.match([0, 0])) == (1, 2, None)
        mgr.flush_nowait()
        hit = cache.match([1, 1, 5])
        assert hit is not None
        mgr.release(slots[3], request_id="r")
        fork = cache.fork(hit, request_id="r2")
        mgr.flush_nowait()
        assert _value(pool, fork) == 11.0
        cache.clear()
        mgr.release_many([*slots[:3], fork], request_id=None)
        mgr.flush_nowait()
        mgr.check_idle()


@pytest.mark.parametrize("reserved", [0, 2])
def test_a_fork_evicts_only_checkpoints_above_the_reservation(reserved: int) -> None:
    """Two checkpoints, requests in every other slot: with reserved=2 evicting one frees only a reserved slot,
    so the fork raises and evicts nothing; without a reservation it evicts one. A third checkpoint (above the
    reservation) is evicted for the fork either way, never the one forked from."""
    pool = mc.StatePool(SPEC, 5)
    with mc.CacheManager(pool) as mgr:
        cache = mc.PrefixCache(mgr, block_size=2, max_checkpoints=3, reserved=reserved)
        (r,) = mgr.alloc(1, request_id="r")
        for i in range(2):
            _fill(pool, r, float(i))
            assert cache.insert([i, i], r)
            mgr.flush_nowait()
        others = mgr.alloc(mgr.available, request_id="o")
        assert len(others) == 2 and pool.num_free == 0
        hit = cache.match([0, 0, 1])
        assert hit is not None
        before = (mgr.held(), mgr.pending, cache.stats)
        if reserved:
            with pytest.raises(mc.PoolExhaustedError):
                cache.fork(hit, request_id="f")
            assert (mgr.held(), mgr.pending, cache.stats) == before  # nothing evicted uselessly
            mgr.release(others[1], request_id="o")
            _fill(pool, r, 2.0)
            assert cache.insert([2, 2], r)  # takes the freed slot: a third checkpoint, above the reservation
            mgr.flush_nowait()
            hit = cache.match([0, 0, 1])
            assert hit is not None
        fork = cache.fork(hit, request_id="f")
        assert cache.stats.evictions == 1 and cache.match([0, 0]) is not None  # the hit's checkpoint stays
        mgr.flush_nowait()
        assert _value(pool, fork) == 0.0
        assert sum(t == CHECKPOINT_TENANT for t in mgr.held().values()) == (2 if reserved else 1)


def test_each_caches_reservation_counts_its_own_checkpoints() -> None:
    """Each cache holds its checkpoints under its own tenant, and its reservation counts those only (issue #31;
    they used to share one tenant, so a cache without a reservation could not evict its own checkpoints for a
    fork: they counted as the other cache's reserved ones): a cache without a reservation evicts its own for a
    fork, and the other's reserved slots stay kept. A closed cache's reservation ends, so a new one may reserve."""
    spec = mc.StateSpec(num_layers=1, conv_shapes=(), temporal_shape=(2,))
    with mc.CacheManager(mc.StatePool(spec, 6)) as mgr:
        first = mc.PrefixCache(mgr, block_size=2, max_checkpoints=4, reserved=2)
        first.close()
        assert mgr.reserved == 0 and first.reserved == 0
        again = mc.PrefixCache(mgr, block_size=2, max_checkpoints=4, reserved=2)
        plain = mc.PrefixCache(mgr, block_size=2, max_checkpoints=4)
        assert (first.tenant, again.tenant, plain.tenant) == ("prefix-cache", "prefix-cache-2", "prefix-cache-3")
        runners = mgr.alloc(2, "a")
        mgr.flush_nowait()
        assert plain.insert([1, 2], runners[0]) and plain.insert([5, 6], runners[1])
        assert mgr.available == 0 and mgr.pool.num_free == 2  # both kept for `again`, not used up by `plain`
        assert sorted(mgr.held().values()) == ["a", "a", "prefix-cache-3", "prefix-cache-3"]
        hit = plain.match([1, 2, 3])
        assert hit is not None
        fork = plain.fork(hit, "c")  # evicts plain's other checkpoint: above plain's (zero) reservation
        assert plain.stats.evictions == 1 and plain.match([5, 6]) is None and plain.match([1, 2]) is not None
        assert mgr.available == 0 and mgr.pool.num_free == 2  # `again`'s two are still kept
        assert again.insert([7], runners[0]) and again.insert([8], runners[1])  # and its inserts find them
        assert again.stats.evictions == plain.stats.skipped == 0
        assert mgr.reservations == {"prefix-cache-2": 2}
        for cache in (again, plain):
            cache.close()
        mgr.release_many([*runners, fork], None)
        mgr.flush_nowait()
        mgr.check_idle()
