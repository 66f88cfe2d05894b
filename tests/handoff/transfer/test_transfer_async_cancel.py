"""send_async / receive_async cancelled at each await of a real transfer (one process, gloo pairs on 127.0.0.1,
over each transport), by asyncio's own ``Task.cancel()`` (which an anyio shield does not stop: ``asyncio.timeout``,
``wait_for``, a ``TaskGroup``) and by anyio's cancel scopes (asyncio and trio).

The contract asserted: every state is delivered exactly once, its ids returned by the call that moved it, or
kept for the retry; a cancellation that came is delivered (at the caller's next checkpoint when the batch moved);
the peer sees the batch once; both sides end in their :class:`SequentialOracle`'s state, the received states
holding exactly the bytes the sender's oracle exported.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch

import mambacache as mc
from mambacache.testing import SequentialOracle

from ...support import link
from ...support.util import CancelAtSuspension, fill_random, small_spec

pytestmark = pytest.mark.anyio

SPEC = small_spec(2)
TIMEOUT = 10.0
THREADED = ("task-in-thread", "task-after-batch")  # Task.cancel() while the worker thread runs the call


class _Side:
    """One end: its manager and pools, their oracle, and its transfer to the other end."""

    def __init__(self, master: Any, rank: int, stack: contextlib.ExitStack) -> None:
        self.pool, self.host = mc.StatePool(SPEC, 6), mc.HostPool(SPEC, 4)
        self.mgr = stack.enter_context(mc.CacheManager(self.pool, host_pool=self.host))
        fill_random(self.pool, 10 + rank)
        self.oracle = SequentialOracle(self.pool, self.host)
        self.xfer = link.transfer(self.mgr, master, rank, 1 - rank, TIMEOUT)
        stack.callback(self.xfer.close)  # before the manager's exit

    def flush(self) -> None:
        """Flush, the oracle taking the same events first; then the two must agree."""
        self.oracle.apply(self.mgr.queued())
        self.mgr.flush_nowait()
        self.oracle.assert_matches(self.pool, self.host)

    def stage(self, k: int) -> dict[str, list[torch.Tensor]]:
        """Sender: two states written and exported (staged, flushed); their bytes as the oracle staged them."""
        rows: dict[str, list[torch.Tensor]] = {}
        for j in range(2):
            rid = f"{k}{'ab'[j]}"
            (slot,) = self.mgr.alloc(1, rid, clear=False)
            self.flush()
            for t in self.pool.tensors:
                t[:, slot] = 10 * k + j + 1
            self.oracle.write(slot, 10 * k + j + 1)
            host = self.mgr.export(slot, rid, to=1)
            self.flush()
            rows[rid] = [t[:, host].clone() for t in self.oracle.host]
        return rows

    def land(self, sent: dict[str, list[torch.Tensor]], ids: list[str]) -> None:
        """Receiver: ``ids`` arrived (and nothing else): each holds the bytes sent; import, compare, release."""
        held = {rid: h for h, rid in self.host.held().items()}
        assert sorted(held) == sorted(ids), f"arrived {sorted(held)}, returned {ids}"
        for rid in ids:
            self.oracle.land(held[rid], sent[rid], True)
        slots = [s for s in range(1, self.pool.num_slots + 1) if s not in self.mgr.held()][: len(ids)]
        for slot, rid in zip(slots, ids, strict=True):
            self.mgr.import_into(slot, rid)
        self.flush()
        for slot, rid in zip(slots, ids, strict=True):
            for got, want in zip(self.pool.tensors, sent[rid], strict=True):
                assert torch.equal(got[:, slot], want), f"{rid} landed other bytes than were exported"
            self.mgr.release(slot, rid)
        self.flush()
        self.mgr.check_idle()


class _Call:
    """The call under test, cancelled at its ``at``-th suspension (0: never): ``how`` ``"task"`` by asyncio's
    ``Task.cancel()`` as it suspends; ``"task-in-thread"`` by ``Task.cancel()`` once its worker thread has
    started the blocking call, which waits for it before its batch; ``"task-after-batch"`` by ``Task.cancel()``
    once the blocking call's batch moved, the thread waiting for it before it returns; ``"scope"`` by an anyio
    cancel scope. One checkpoint follows the call: a cancellation it held back comes there."""

    def __init__(self, xfer: mc.StateTransfer, name: str, how: str, at: int) -> None:
        self.xfer, self.name, self.how, self.at = xfer, name, how, at
        self.returned: list[str] | None = None
        self.cancelled = False
        self.suspensions = 0
        self.started, self.came = threading.Event(), threading.Event()
        real = getattr(xfer, name)

        def blocking() -> list[str]:
            if how == "task-in-thread":
                self.started.set()
                assert self.came.wait(TIMEOUT), "the cancellation never came"
            ids: list[str] = real()
            if how == "task-after-batch":
                self.started.set()
                assert self.came.wait(TIMEOUT), "the cancellation never came"
            return ids

        setattr(xfer, name, blocking)  # the instance's, deleted after the case (see _case)

    async def run(self) -> None:
        if self.how == "scope":
            cancel = CancelAtSuspension(self.at, "cancel")
            await cancel.run(self._call_then_checkpoint())
            self.cancelled, self.suspensions = cancel.cancelled, cancel.suspensions
            return
        task = asyncio.ensure_future(self._in_task())
        if self.how in THREADED:
            loop = asyncio.get_running_loop()

            def fire() -> None:
                task.cancel()
                self.came.set()

            await anyio.to_thread.run_sync(self.started.wait, TIMEOUT)
            loop.call_soon_threadsafe(fire)
        await asyncio.wait([task])
        self.cancelled = task.cancelled()
        if not self.cancelled:
            task.result()  # an error of the call, raised here

    async def _in_task(self) -> None:
        task = asyncio.current_task()
        assert task is not None

        def suspended(n: int) -> None:
            self.suspensions = n
            if self.how == "task" and n == self.at:
                task.cancel()

        await CancelAtSuspension(0, on_suspend=suspended).run(self._call_then_checkpoint())

    async def _call_then_checkpoint(self) -> None:
        call: Callable[[], Awaitable[list[str]]] = getattr(self.xfer, f"{self.name}_async")
        self.returned = await call()
        await anyio.lowlevel.checkpoint()


async def _case(s: _Side, r: _Side, k: int, which: str, how: str, at: int) -> int:
    """Batch ``k``: the side under test (``which``) calls, cancelled; the peer calls the blocking form in a thread.
    Checks the contract; returns the call's suspensions."""
    sent = s.stage(k)
    ids = list(sent)
    me, peer = (s, r) if which == "send" else (r, s)
    thread, out = link.in_thread(peer.xfer.receive if which == "send" else peer.xfer.send)
    call = _Call(me.xfer, which, how, at)
    try:
        await call.run()
    finally:
        delattr(me.xfer, which)
    where = f"{which} cancelled by {how} at suspension {at} of {call.suspensions}"
    if how in THREADED or 0 < at <= call.suspensions:
        assert call.cancelled, f"{where}: the cancellation was lost"
    else:
        assert not call.cancelled, where
    if call.returned is None:  # not moved: kept for the retry, which moves it
        if which == "send":
            ready = [ev.request_id for ev in s.mgr.exports_ready()]
            assert ready == ids, f"{where}: returned nothing but its states are not kept for a retry ({ready})"
        else:
            assert r.host.num_held == 0, f"{where}: returned nothing but states arrived: {r.host.held()}"
        retried = await (me.xfer.send_async() if which == "send" else me.xfer.receive_async())
        assert retried == ids, f"{where}: the retry moved {retried}"
    else:
        assert call.returned == ids, f"{where}: returned {call.returned}"
        if which == "send":
            assert s.mgr.exports_ready() == []
    await anyio.to_thread.run_sync(thread.join, 2 * TIMEOUT)
    assert not thread.is_alive() and out == [ids], f"{where}: the peer's call ended with {out}"
    s.flush()  # the sender released the delivered slots and their staging slots: its oracle takes that too
    for rid in ids:
        (slot,) = [slot for slot, tenant in s.mgr.held().items() if tenant == rid] or [None]
        assert slot is None, f"{where}: {rid} still held after its delivery"
    r.land(sent, ids)
    return call.suspensions


async def _cases(which: str, how: str) -> None:
    """A case uncancelled (counting the call's suspensions), then one cancelled at each suspension (threaded: the
    one, the batch's own), each on the same pair."""
    master = link.store()
    with contextlib.ExitStack() as stack:
        s, r = _Side(master, 0, stack), _Side(master, 1, stack)
        total = await _case(s, r, 0, which, how, 0)
        assert total >= 1
        for at in range(1, total + 1) if how not in THREADED else ():
            await _case(s, r, at, which, how, at)
        s.mgr.check_idle()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("which", ["send", "receive"])
@pytest.mark.parametrize("how", ["task", *THREADED])
async def test_a_transfer_task_cancelled_at_each_await_delivers_each_state_once_or_keeps_it(
    anyio_backend: str, which: str, how: str
) -> None:
    await _cases(which, how)


@pytest.mark.parametrize("which", ["send", "receive"])
async def test_a_transfer_scope_cancelled_at_each_await_delivers_each_state_once_or_keeps_it(which: str) -> None:
    await _cases(which, "scope")
