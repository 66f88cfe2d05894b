"""Many tasks and threads submitting; asyncio and trio."""

from __future__ import annotations

import sys
import threading
import time

import anyio
import anyio.lowlevel
import pytest

import mambacache as mc

from ..support.util import small_spec

pytestmark = pytest.mark.anyio


async def test_many_tasks_submit_while_a_scheduler_flushes() -> None:
    pool = mc.StatePool(small_spec(), 64)
    owners: dict[int, str] = {}
    async with mc.CacheManager(pool) as mgr:

        async def request(i: int) -> None:
            rid = f"r{i}"
            for _ in range(5):
                (slot,) = mgr.alloc(1, request_id=rid)
                owners[slot] = rid
                await anyio.lowlevel.checkpoint()
                for t in pool.tensors:
                    t[:, slot] = i + 1  # the request's "forward" writes
                mgr.copy_on_write(slot, slot, request_id=rid)
                await anyio.lowlevel.checkpoint()
                mgr.release(slot, request_id=rid)

        async def scheduler(stop: anyio.Event) -> None:
            while not stop.is_set():
                await mgr.flush()
                await anyio.lowlevel.checkpoint()

        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(scheduler, stop)
            async with anyio.create_task_group() as requests:
                for i in range(32):
                    requests.start_soon(request, i)
            stop.set()
        assert pool.num_free == 64  # every release is booked at submit time
        await mgr.flush()  # the scheduler may have stopped before the last releases
        assert mgr.pending == 0


async def test_concurrent_flushes_are_serialised() -> None:
    pool = mc.StatePool(small_spec(), 16)
    steps: list[int] = []
    async with mc.CacheManager(pool) as mgr:

        async def flusher() -> None:
            mgr.alloc(1)
            steps.append((await mgr.flush()).step)

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(flusher)
    assert sorted(steps) == list(range(8))


async def test_submit_from_worker_threads() -> None:
    pool = mc.StatePool(small_spec(), 200)
    async with mc.CacheManager(pool) as mgr:
        mine: list[list[int]] = [[] for _ in range(4)]
        barrier = threading.Barrier(4)

        def worker(k: int) -> None:
            for _ in range(50):
                mine[k].extend(mgr.alloc(1, request_id=f"t{k}"))
            barrier.wait()  # releases only after every alloc, so no slot is reused
            for s in mine[k][::2]:
                mgr.release(s)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            await anyio.to_thread.run_sync(th.join)
        all_slots = [s for m in mine for s in m]
        assert len(set(all_slots)) == 200  # no slot handed out twice
        report = await mgr.flush()
        assert report.events == 300 and pool.num_free == 100
        kept = [s for m in mine for s in m[1::2]]
        assert all(bool((t[:, kept] == 0).all()) for t in pool.tensors)


async def test_alloc_wait_never_raises_while_another_thread_allocates() -> None:
    """A real competing thread allocates and releases as fast as it can for seconds; alloc_wait must only
    ever wait, never raise PoolExhaustedError, and what it returns is held by its caller. Every third wait
    gets a deadline of half a millisecond: a cancelled wait holds nothing."""
    pool = mc.StatePool(small_spec(), 4)
    stop = threading.Event()
    thread_allocs = [0]

    def competitor(mgr: mc.CacheManager) -> None:
        while not stop.is_set():
            try:
                slots = mgr.alloc(2, request_id="thread")  # 2 of 4: the waiter's 3 fit only while it holds none
            except mc.PoolExhaustedError:
                continue
            thread_allocs[0] += 1
            mgr.release_many(slots, request_id="thread")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: a race window gets hit
    async with mc.CacheManager(pool) as mgr:
        thread = threading.Thread(target=competitor, args=(mgr,))
        thread.start()
        waits = attempts = cancelled = 0
        start = time.monotonic()

        def contended() -> bool:  # both sides really ran against each other, for the seconds a race needs
            return waits > 10 and thread_allocs[0] > 10 and cancelled > 0 and time.monotonic() - start > 2.5

        try:
            # Until contention was seen, however late a loaded machine schedules the thread; a run that never sees
            # it fails at the deadline rather than passing on a quiet pool.
            with anyio.fail_after(120):
                while not contended():
                    attempts += 1
                    with anyio.move_on_after(0.0005 if attempts % 3 == 0 else 60) as scope:
                        slots = await mgr.alloc_wait(3, request_id="waiter")
                    if scope.cancelled_caught:
                        cancelled += 1
                        assert "waiter" not in mgr.held().values() and mgr.waiting == 0
                        continue
                    held = mgr.held()
                    assert len(slots) == 3 and all(held[s] == "waiter" for s in slots)
                    mgr.release_many(slots, request_id="waiter")
                    waits += 1
                    await anyio.lowlevel.checkpoint()  # an uncontended alloc_wait returns without one
                    if waits % 50 == 0:
                        await mgr.flush()
        finally:
            stop.set()
            thread.join(10)
            sys.setswitchinterval(interval)
        await mgr.flush()


async def test_a_waiter_blocked_when_the_manager_closes_raises_closed_and_takes_nothing() -> None:
    pool = mc.StatePool(small_spec(), 2)
    mgr = mc.CacheManager(pool)
    raised: list[mc.ManagerClosedError] = []

    async def waiter() -> None:
        try:
            await mgr.alloc_wait(1, request_id="w")
        except mc.ManagerClosedError as exc:
            raised.append(exc)

    async with anyio.create_task_group() as tg, mgr:
        a, b = mgr.alloc(2, request_id="r")
        tg.start_soon(waiter)
        with anyio.fail_after(10):  # generous: CI machines are shared
            while True:
                if mgr.waiting:
                    break
                await anyio.sleep(0.001)
        # A slot is free while the manager closes: the waiter sees it and must still not take it.
        mgr.release(a, request_id="r")
    assert len(raised) == 1 and "closed" in str(raised[0])
    assert mgr.held() == {b: "r"} and pool.num_free == 1 and mgr.waiting == 0
    with pytest.raises(mc.ManagerClosedError):
        await mgr.alloc_wait(1)
