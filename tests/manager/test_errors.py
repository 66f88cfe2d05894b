"""Bad input: a typed error, raised at submit time, and nothing changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mambacache as mc

from ..support.util import fill_random, small_spec

pytestmark = pytest.mark.anyio


def snapshot(mgr: mc.CacheManager) -> tuple[object, ...]:
    pool = mgr.pool
    return (mgr.pending, pool.num_free, tuple(pool.allocated_slots()), [t.clone() for t in pool.tensors])


def assert_unchanged(mgr: mc.CacheManager, before: tuple[object, ...]) -> None:
    after = snapshot(mgr)
    assert after[:3] == before[:3]
    assert all(torch.equal(a, b) for a, b in zip(after[3], before[3], strict=True))  # type: ignore[call-overload]


BAD_SLOTS = [
    0,
    -1,
    9,
    10**9,
    1.0,
    True,
    False,
    "1",
    None,
    torch.tensor(1.0),
    torch.tensor([1]),
    torch.tensor(True),
    torch.tensor(1, device="meta"),  # a device tensor: reading it would sync
    np.float64(1),
    np.True_,
    np.int64(0),
]


@pytest.mark.parametrize("bad", BAD_SLOTS, ids=repr)
async def test_invalid_slots(bad: object) -> None:
    pool = mc.StatePool(small_spec(), 8)
    async with mc.CacheManager(pool) as mgr:
        (a,) = mgr.alloc(1)
        before = snapshot(mgr)
        for call in (
            lambda: mgr.clear(bad),  # type: ignore[arg-type]
            lambda: mgr.release(bad),  # type: ignore[arg-type]
            lambda: mgr.copy_on_write(bad, a),  # type: ignore[arg-type]
            lambda: mgr.copy_on_write(a, bad),  # type: ignore[arg-type]
        ):
            with pytest.raises(mc.InvalidSlotError):
                call()
            with pytest.raises(ValueError):  # also a ValueError
                call()
        assert_unchanged(mgr, before)


async def test_slot_state_errors_are_atomic() -> None:
    pool = mc.StatePool(small_spec(), 8)
    async with mc.CacheManager(pool) as mgr:
        a, b = mgr.alloc(2)
        await mgr.flush()
        fill_random(pool, 3)
        mgr.clear(a)
        before = snapshot(mgr)
        with pytest.raises(mc.SlotStateError):
            mgr.submit(mc.Release(b), mc.Release(b))  # double release inside one submit
        with pytest.raises(mc.SlotStateError):
            mgr.submit(mc.Release(b), mc.Clear(b))  # use after release
        with pytest.raises(mc.SlotStateError):
            mgr.submit(mc.Release(b), mc.CopyOnWrite(b, a))  # copy from a released slot
        with pytest.raises(mc.SlotStateError):
            mgr.clear(5)  # never allocated
        with pytest.raises(mc.SlotStateError):
            mgr.copy_on_write(a, 6)
        assert_unchanged(mgr, before)
        mgr.release(b)
        with pytest.raises(mc.SlotStateError, match="not allocated"):
            mgr.release(b)


async def test_invalid_events_and_arguments() -> None:
    pool = mc.StatePool(small_spec(), 4)
    async with mc.CacheManager(pool) as mgr:
        (a,) = mgr.alloc(1)
        before = snapshot(mgr)
        with pytest.raises(mc.InvalidEventError, match="alloc"):
            mgr.submit(mc.Alloc(2))
        with pytest.raises(mc.InvalidEventError):
            mgr.submit(mc.Clear(a), "clear")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            mgr.submit(object())  # type: ignore[arg-type]
        for n in (-1, 1.5, True, "2"):
            with pytest.raises(mc.InvalidArgumentError):
                mgr.alloc(n)  # type: ignore[arg-type]
        with pytest.raises(mc.InvalidArgumentError):
            mgr.clear(a, request_id=5)  # type: ignore[arg-type]
        assert_unchanged(mgr, before)


async def test_pool_exhausted_allocates_nothing() -> None:
    pool = mc.StatePool(small_spec(), 4)
    async with mc.CacheManager(pool) as mgr:
        mgr.alloc(3)
        before = snapshot(mgr)
        with pytest.raises(mc.PoolExhaustedError, match="1 of 4"):
            mgr.alloc(2)
        assert_unchanged(mgr, before)
        assert mgr.alloc(1) == [4]
        assert mgr.alloc(0) == []


async def test_release_frees_at_once_and_earlier_events_see_old_tenant() -> None:
    pool = mc.StatePool(small_spec(), 2)
    async with mc.CacheManager(pool) as mgr:
        a, b = mgr.alloc(2)
        await mgr.flush()
        for t in pool.tensors:
            t[:, a] = 7
        mgr.copy_on_write(a, b)  # b must get the old tenant's 7s
        mgr.release(a)
        assert pool.num_free == 1
        assert mgr.alloc(1) == [a]  # reusable at once, and cleared by the next flush
        await mgr.flush()
        for t in pool.tensors:
            assert bool((t[:, b] == 7).all()) and bool((t[:, a] == 0).all())


async def test_closed_manager() -> None:
    pool = mc.StatePool(small_spec(), 4)
    mgr = mc.CacheManager(pool)
    with pytest.raises(mc.ManagerClosedError, match="not entered"):
        mgr.alloc(1)
    async with mgr:
        (a,) = mgr.alloc(1)
    for call in (lambda: mgr.alloc(1), lambda: mgr.clear(a), lambda: mgr.release(a), lambda: mgr.submit()):
        with pytest.raises(mc.ManagerClosedError):
            call()
    with pytest.raises(mc.ManagerClosedError):
        await mgr.flush()
    with pytest.raises(mc.ManagerClosedError):
        async with mgr:
            pass


async def test_exit_flushes_pending() -> None:
    pool = mc.StatePool(small_spec(), 4)
    fill_random(pool, 2)
    async with mc.CacheManager(pool) as mgr:
        (a,) = mgr.alloc(1)
        assert mgr.pending == 1
    assert all(bool((t[:, a] == 0).all()) for t in pool.tensors)
    # The padding slot is never written.
    assert all(bool((t[:, 0] != 0).any()) for t in pool.tensors)


async def test_one_open_manager_per_pool() -> None:
    pool = mc.StatePool(small_spec(), 4)
    async with mc.CacheManager(pool) as mgr:
        mgr.alloc(1)
        with pytest.raises(mc.InvalidArgumentError, match="already managed"):
            async with mc.CacheManager(pool):
                pass
        assert mgr.pending == 1  # the refused one changed nothing
    async with mc.CacheManager(pool) as again:  # free once the first has closed
        assert pool.num_free == 3
        again.alloc(1)


def test_is_allocated_checks_its_slot_like_the_manager() -> None:
    pool = mc.StatePool(small_spec(), 4)
    with mc.CacheManager(pool) as mgr:
        (a,) = mgr.alloc(1)
        assert pool.is_allocated(a) and pool.is_allocated(np.int64(a)) and not pool.is_allocated(a + 1)
        for bad in (True, 1.0, "1", 0, 5, -1):
            with pytest.raises(mc.InvalidSlotError):
                pool.is_allocated(bad)  # type: ignore[arg-type]


def test_check_idle_with_host_true_needs_a_host_pool() -> None:
    with mc.CacheManager(mc.StatePool(small_spec(), 2)) as mgr:
        mgr.check_idle()
        mgr.check_idle(host=False)
        with pytest.raises(mc.InvalidArgumentError, match="without a host pool"):
            mgr.check_idle(host=True)
        with pytest.raises(mc.InvalidArgumentError, match="bool or None"):
            mgr.check_idle(host=1)  # type: ignore[arg-type]


def test_check_open_queued_and_waiting_report_the_manager_state() -> None:
    pool = mc.StatePool(small_spec(), 3)
    mgr = mc.CacheManager(pool)
    with pytest.raises(mc.ManagerClosedError, match="not entered"):
        mgr.check_open()
    with mgr:
        mgr.check_open()
        (a,) = mgr.alloc(1, "r")
        mgr.clear(a, "r")
        assert mgr.queued() == [mc.Alloc(a, "r", True), mc.Clear(a, "r")] and mgr.waiting == 0
        queued = mgr.queued()
        queued.clear()  # a copy: the manager's queue is untouched
        assert mgr.pending == 2
        mgr.release(a)
    with pytest.raises(mc.ManagerClosedError, match="closed"):
        mgr.check_open()
