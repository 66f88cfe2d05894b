"""Runs in spawned processes: send_async / receive_async cancelled at each await, on a real gloo pair.

Rank 0 sends, rank 1 receives. Each case stages its own two states (slots 2
and 5 of a pool refilled from the case's seed), ends with both sides idle, and
the two ranks meet at a barrier before the next case, so every case after the
first also shows that the transfer still works after the one before. Timing:
the peer that must be slow is slow by ``DELAY``; the cancellation comes at
``CANCEL_AT`` into the call, while the batch is in flight.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import timedelta

import anyio
import torch
import torch.distributed as dist

import mambacache as mc
from mambacache._handoff._link import root_store

from .transfer import HOST, prefill_pool, spec

SRC, DST = [2, 5], [3, 7]
DELAY, CANCEL_AT, TIMEOUT = 1.0, 0.3, 5.0

Side = Callable[["_Rank", int], Awaitable[None]]


class SlowLand(mc.CacheManager):
    """A receiver's manager that takes ``delay`` seconds to land a batch, so the ack comes that much later."""

    delay = 0.0

    def land(
        self,
        request_ids: list[str],
        write: Callable[[list[int]], None] | None = None,
        *,
        arrived: Callable[[list[int]], None] | None = None,
    ) -> list[int]:
        time.sleep(self.delay)
        return super().land(request_ids, write, arrived=arrived)


class _Rank:
    """One side: its manager, pool and transfer, and the checks every case makes."""

    def __init__(self, mgr: SlowLand, pool: mc.StatePool, xfer: mc.StateTransfer) -> None:
        self.mgr, self.pool, self.xfer = mgr, pool, xfer

    @staticmethod
    def ids(k: int) -> list[str]:
        """Two states in even cases, one in odd ones: the kept buffers shrink and grow between batches."""
        return [f"{k}a", f"{k}b"][: 2 - k % 2]

    @staticmethod
    def slots(k: int, which: list[int]) -> list[int]:
        return which[: 2 - k % 2]

    def stage(self, k: int) -> list[str]:
        """Sender: the case's states into slots 2 and 5, exported and flushed (staged, not sent)."""
        ref, src = prefill_pool(100 + k), self.slots(k, SRC)
        for t, r in zip(self.pool.tensors, ref.tensors, strict=True):
            t[:, src] = r[:, src]
        for s, i in zip(src, self.ids(k), strict=True):
            self.mgr.alloc_slots([s], i, clear=False)
            self.mgr.export(s, i)
        self.mgr.flush_nowait()
        return self.ids(k)

    def still_holds(self, k: int, why: str) -> None:
        """Sender: nothing was delivered: both exports ready, their pool and staging slots held."""
        mgr, host = self.mgr, self.mgr.host_pool
        assert host is not None
        assert [ev.request_id for ev in mgr.exports_ready()] == self.ids(k), why
        assert mgr.held() == dict(zip(self.slots(k, SRC), self.ids(k), strict=True)), why
        assert host.num_held == len(self.ids(k)), why

    def landed(self, k: int, why: str) -> None:
        """Receiver: both states landed: import them, compare every byte with the sender's, free the slots."""
        mgr, src, dst = self.mgr, self.slots(k, SRC), self.slots(k, DST)
        for s, i in zip(dst, self.ids(k), strict=True):
            mgr.import_into(s, i)
        mgr.flush_nowait()
        ref = prefill_pool(100 + k)
        for got, want in zip(self.pool.tensors, ref.tensors, strict=True):
            assert torch.equal(got[:, dst], want[:, src]), why
        for s, i in zip(dst, self.ids(k), strict=True):
            mgr.release(s, i)
        mgr.flush_nowait()
        mgr.check_idle()

    def nothing_landed(self, why: str) -> None:
        assert self.mgr.host_pool is not None and self.mgr.host_pool.num_held == 0, why
        self.mgr.check_idle()


async def _cancelled(
    call: Callable[[], Awaitable[list[str]]], at: float | None
) -> tuple[bool, list[str] | None, float]:
    """Run ``call`` in a scope cancelled before it starts (``at`` None) or ``at`` seconds in, then one checkpoint.

    Returns (the scope caught the cancellation, what the call returned into the scope or None, seconds taken).
    """
    start, got = time.monotonic(), None
    with anyio.CancelScope() as scope:
        if at is None:
            scope.cancel()
        else:
            scope.deadline = anyio.current_time() + at
        got = await call()
        await anyio.lowlevel.checkpoint()  # a cancellation the call held back (its batch ran) comes here
    return scope.cancelled_caught, got, time.monotonic() - start


# -- send_async -----------------------------------------------------------------------------------------
async def send_before_start(me: _Rank, k: int) -> None:
    me.stage(k)
    caught, got, _ = await _cancelled(me.xfer.send_async, None)
    assert caught and got is None, "a send cancelled before it started was not cancelled"
    me.still_holds(k, "a send cancelled before it started sent something")
    assert await me.xfer.send_async() == me.ids(k)
    me.mgr.check_idle()


async def recv_plain(me: _Rank, k: int) -> None:
    assert await me.xfer.receive_async() == me.ids(k)
    me.landed(k, "the batch after a cancelled one")


async def send_during_ack(me: _Rank, k: int) -> None:
    me.stage(k)
    caught, got, took = await _cancelled(me.xfer.send_async, CANCEL_AT)
    assert caught, "the cancellation was lost"
    assert got == me.ids(k), f"the delivered batch's ids were not returned: {got}"
    assert took > 0.8 * DELAY, f"the cancelled send returned after {took:.2f}s, before the peer's ack"
    me.mgr.check_idle()  # acknowledged: the exported slots and their staging slots are free


async def recv_slow_ack(me: _Rank, k: int) -> None:
    me.mgr.delay = DELAY
    try:
        assert await me.xfer.receive_async() == me.ids(k)
    finally:
        me.mgr.delay = 0.0
    me.landed(k, "a batch whose ack came late")


async def send_during_refused_ack(me: _Rank, k: int) -> None:
    me.stage(k)
    try:
        await _cancelled(me.xfer.send_async, CANCEL_AT)
    except mc.TransferError as exc:
        assert "did not land" in str(exc), exc
    else:
        raise AssertionError("a batch the peer did not land went unnoticed")
    me.still_holds(k, "slots were released without the peer's acknowledgement")
    assert await me.xfer.send_async() == me.ids(k)  # the retry
    me.mgr.check_idle()


async def recv_refusing(me: _Rank, k: int) -> None:
    ids, _ = me.xfer.receive_rows()
    await anyio.sleep(DELAY)
    try:
        me.xfer.acknowledge(ids[:1])  # not the batch: refused, nothing answered
    except mc.TransferError:
        pass
    else:
        raise AssertionError("an acknowledgement of another batch was accepted")
    me.xfer.acknowledge(ids, landed=False, why="the test refuses it")  # the sender must keep its slots
    me.nothing_landed("receive_rows landed something")
    assert await me.xfer.receive_async() == me.ids(k)  # the sender's retry
    me.landed(k, "the retried batch")


# -- receive_async --------------------------------------------------------------------------------------
async def recv_before_start(me: _Rank, k: int) -> None:
    caught, got, _ = await _cancelled(me.xfer.receive_async, None)
    assert caught and got is None, "a receive cancelled before it started was not cancelled"
    me.nothing_landed("a receive cancelled before it started landed something")
    assert await me.xfer.receive_async() == me.ids(k)
    me.landed(k, "the batch after a cancelled receive")


async def send_plain(me: _Rank, k: int) -> None:
    me.stage(k)
    assert await me.xfer.send_async() == me.ids(k)
    me.mgr.check_idle()


async def recv_during_header(me: _Rank, k: int) -> None:
    caught, got, took = await _cancelled(me.xfer.receive_async, CANCEL_AT)
    assert caught, "the cancellation was lost"
    assert got == me.ids(k), f"the arrived batch's ids were not returned: {got}"
    assert took > 0.8 * DELAY, f"the cancelled receive returned after {took:.2f}s, before the batch came"
    me.landed(k, "a batch received under a cancellation")


async def send_late(me: _Rank, k: int) -> None:
    me.stage(k)
    await anyio.sleep(DELAY)
    assert await me.xfer.send_async() == me.ids(k)
    me.mgr.check_idle()


async def recv_during_bad_batch(me: _Rank, k: int) -> None:
    try:
        await _cancelled(me.xfer.receive_async, CANCEL_AT)
    except mc.TransferError as exc:
        assert "not a transfer header" in str(exc), exc
    else:
        raise AssertionError("a malformed batch went unnoticed")
    me.nothing_landed("a failed batch landed something")
    assert await me.xfer.receive_async() == me.ids(k)
    me.landed(k, "the batch after a failed one")


async def send_bad_then_good(me: _Rank, k: int) -> None:
    """A header in the store that is not one (as a foreign or broken sender would post): refused, nothing moves."""
    await anyio.sleep(DELAY)
    store = dist.PrefixStore("mambacache/xfer/0>1/", root_store(dist.distributed_c10d._get_default_store()))
    store.set(f"hdr/{store.add('posted', 1)}", '{"magic": 1, "ids": ["only-one"]}')
    await send_plain(me, k)


CASES: dict[str, tuple[Side, Side]] = {
    "send cancelled before it starts": (send_before_start, recv_plain),
    "send cancelled waiting for the ack": (send_during_ack, recv_slow_ack),
    "send cancelled waiting for an ack that refuses": (send_during_refused_ack, recv_refusing),
    "receive cancelled before it starts": (send_plain, recv_before_start),
    "receive cancelled waiting for the header": (send_late, recv_during_header),
    "receive cancelled waiting for a batch that fails": (send_bad_then_good, recv_during_bad_batch),
}


async def _run(rank: int, seed: int) -> None:
    pool = prefill_pool(seed + rank)
    with SlowLand(pool, host_pool=mc.HostPool(spec(), HOST)) as mgr:
        me = _Rank(mgr, pool, mc.StateTransfer(mgr, dist.group.WORLD, peer=1 - rank, timeout=TIMEOUT))
        for k, (name, sides) in enumerate(CASES.items()):
            dist.barrier()
            try:
                await sides[rank](me, k)
            except AssertionError as exc:
                raise AssertionError(f"{name} (rank {rank}): {exc}") from exc


def cancel_worker(rank: int, port: int, backend: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=20)
    )
    try:
        anyio.run(_run, rank, 7, backend=backend)
    finally:
        dist.destroy_process_group()
