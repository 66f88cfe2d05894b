"""send_async / receive_async under asyncio's own deadlines (``asyncio.timeout``, ``wait_for``, a task cancelled
whose whole body is the call), the cancellation coming while the worker thread runs the batch (deterministic: the
thread waits, after its batch, for the cancellation to have come).

The contract asserted: the batch moved, so its ids come back, to the caller or as the task's result; the
cancellation comes at the caller's next checkpoint inside the scope that asked for it (``asyncio.timeout`` then
raises ``TimeoutError``), and never outside it: a block that ends first leaves the task uncancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import pytest

import mambacache as mc

from ...support import link
from ...support.util import small_spec

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(60),
    pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout and Task.cancelling() are 3.11's"),
]

SPEC = small_spec(1)
TIMEOUT = 10.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.contextmanager
def _pair() -> Iterator[tuple[mc.CacheManager, mc.StateTransfer, mc.CacheManager, mc.StateTransfer]]:
    master = link.store()
    with contextlib.ExitStack() as stack:
        sides = []
        for rank in (0, 1):
            mgr = stack.enter_context(mc.CacheManager(mc.StatePool(SPEC, 4), host_pool=mc.HostPool(SPEC, 4)))
            xfer = link.transfer(mgr, master, rank, 1 - rank, TIMEOUT)
            stack.callback(xfer.close)
            sides += [mgr, xfer]
        yield sides[0], sides[1], sides[2], sides[3]


def _export(mgr: mc.CacheManager, rid: str) -> None:
    (slot,) = mgr.alloc(1, rid, clear=False)
    mgr.export(slot, rid)
    mgr.flush_nowait()


def _held_until(xfer: mc.StateTransfer, name: str, came: Callable[[], bool]) -> threading.Event:
    """``xfer.<name>`` runs its real batch, then waits until ``came()`` (the cancellation reached the task).
    Returns the event it sets once the worker thread has taken the call."""
    real = getattr(xfer, name)
    started = threading.Event()

    def blocking() -> list[str]:
        started.set()
        ids: list[str] = real()
        deadline = TIMEOUT
        while not came() and deadline > 0:
            threading.Event().wait(0.001)
            deadline -= 0.001
        assert came(), "the cancellation never came"
        return ids

    setattr(xfer, name, blocking)
    return started


async def _with_peer(peer: Callable[[], list[str]], body: Callable[[], Awaitable[Any]]) -> tuple[Any, list[Any]]:
    thread, out = link.in_thread(peer)
    try:
        return await body(), out
    finally:
        await anyio.to_thread.run_sync(thread.join, 2 * TIMEOUT)


@pytest.mark.parametrize("which", ["send", "receive"])
async def test_a_timeout_that_expires_during_the_batch_keeps_its_ids_and_no_cancellation_leaks_past_it(
    which: str,
) -> None:
    """``async with asyncio.timeout(...)`` around the call, expiring while the thread runs the batch, the block
    ending right after the call: the ids come back and the task is not cancelled afterwards (the timeout that
    asked is over). It used to re-request the cancellation for good, so the task's next await, outside the
    block, raised a CancelledError no one had asked for (and ``cancelling()`` was 0)."""
    with _pair() as (smgr, sx, _, rx):
        _export(smgr, "a")
        me, peer = (sx, rx.receive) if which == "send" else (rx, sx.send)
        scope: list[asyncio.Timeout] = []
        started = _held_until(me, which, lambda: bool(scope) and scope[0].expired())

        async def direct() -> tuple[list[str], bool]:
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(None) as cm:
                scope.append(cm)
                threading.Thread(target=lambda: _expire_soon(loop, cm, started), daemon=True).start()
                ids = await getattr(me, f"{which}_async")()
            leaked = False
            try:
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                leaked = True
            return ids, leaked

        (ids, leaked), out = await _with_peer(peer, direct)
        assert ids == ["a"], ids
        assert out == [["a"]], out
        assert not leaked, "a cancellation the expired timeout asked for came after its block ended"
        assert (asyncio.current_task() or pytest.fail()).cancelling() == 0


def _expire_soon(loop: asyncio.AbstractEventLoop, cm: asyncio.Timeout, started: threading.Event) -> None:
    """From another thread: once the call's worker thread has taken it, make ``cm`` expire now."""
    assert started.wait(TIMEOUT)
    loop.call_soon_threadsafe(lambda: cm.reschedule(loop.time()))


@pytest.mark.parametrize("which", ["send", "receive"])
async def test_a_timeout_that_expires_during_the_batch_raises_at_the_blocks_next_checkpoint(which: str) -> None:
    """The same, with a checkpoint in the block after the call: the ids came back (kept by the caller) and the
    timeout raises ``TimeoutError`` there, as documented; the task is not cancelled after it."""
    with _pair() as (smgr, sx, _, rx):
        _export(smgr, "a")
        me, peer = (sx, rx.receive) if which == "send" else (rx, sx.send)
        scope: list[asyncio.Timeout] = []
        started = _held_until(me, which, lambda: bool(scope) and scope[0].expired())
        got: list[list[str]] = []

        async def body() -> bool:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None) as cm:
                    scope.append(cm)
                    threading.Thread(target=lambda: _expire_soon(loop, cm, started), daemon=True).start()
                    got.append(await getattr(me, f"{which}_async")())
                    await asyncio.sleep(0)
                return False
            return True

        timed_out, out = await _with_peer(peer, body)
        assert got == [["a"]] and out == [["a"]], (got, out)
        assert timed_out, "the timeout's cancellation was lost"
        await asyncio.sleep(0)  # nothing pending: not cancelled here


@pytest.mark.parametrize("which", ["send", "receive"])
async def test_a_task_of_the_call_alone_cancelled_during_the_batch_ends_with_its_ids(which: str) -> None:
    """``asyncio.ensure_future(xfer.send_async())`` (what ``wait_for`` and a ``TaskGroup`` make), cancelled while the
    thread runs the batch: the task has no checkpoint after the call, so it ends with the ids as its result (it
    used to end cancelled: the states had moved and no one could learn which)."""
    with _pair() as (smgr, sx, _, rx):
        _export(smgr, "a")
        me, peer = (sx, rx.receive) if which == "send" else (rx, sx.send)
        fired = threading.Event()
        started = _held_until(me, which, fired.is_set)

        async def body() -> asyncio.Future[list[str]]:
            loop = asyncio.get_running_loop()
            task = asyncio.ensure_future(getattr(me, f"{which}_async")())

            def cancel() -> None:
                task.cancel()
                fired.set()

            await anyio.to_thread.run_sync(started.wait, TIMEOUT)
            loop.call_soon(cancel)
            await asyncio.wait([task])
            return task

        task, out = await _with_peer(peer, body)
        assert out == [["a"]], out
        assert not task.cancelled(), "the batch moved, but the task that moved it ended cancelled: its ids lost"
        assert task.result() == ["a"]
        if which == "send":
            assert smgr.exports_ready() == [] and smgr.held() == {}


async def test_wait_for_that_times_out_during_the_batch_returns_its_ids() -> None:
    """``asyncio.wait_for(xfer.send_async(), t)`` expiring while the thread sends: the states were delivered, so
    ``wait_for`` returns their ids (it used to raise ``TimeoutError`` while the sender had released them)."""
    with _pair() as (smgr, sx, _, rx):
        _export(smgr, "a")
        late = threading.Event()
        _held_until(sx, "send", late.is_set)

        async def body() -> Any:
            asyncio.get_running_loop().call_later(1.0, late.set)  # well after wait_for's 0.5 s
            try:
                return await asyncio.wait_for(sx.send_async(), 0.5)
            except TimeoutError as exc:
                return exc

        got, out = await _with_peer(rx.receive, body)
        assert out == [["a"]], out
        assert got == ["a"], f"the states were delivered, wait_for gave {got!r}"
        assert smgr.exports_ready() == [] and smgr.held() == {}
