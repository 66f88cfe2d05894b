"""An interrupt at any line of a tensor-parallel flush, on any rank, parts no ranks and loses nothing.

The contract (docs/architecture.md, Interrupts): a rank's flush over a channel
that an interrupt stops anywhere comes out with the interrupt and leaves the
rank's step either undone (``mgr.step`` unchanged: the rank still owes that
flush, and the source's events are queued again) or this rank's (``mgr.step``
advanced: the plan left, or was pushed here, and the next flush finishes it).
Once every rank made the flush it owes and one more, each rank's shard is
exactly its sequential oracle's, with nothing queued or unfinished anywhere.
Where a rank cannot tell whether its plan left (only a channel without a
record of it, or a broadcast stopped as it was issued), every rank's flush
raises :class:`~mambacache.DistributedError` instead: rebuild the group.

The sweep: the step of ``tests/core/test_interrupts.py`` (every stage kind, with and
without a host tier, fresh and resuming kept work) is queued on the source of a
2-rank :class:`~mambacache.LoopbackChannel` group, and one rank's flush of it
runs under :class:`~tests.support.util.InterruptAtLine`: every line under
``MAMBACACHE_FULL_SWEEP=1``, a sample otherwise (``tests/support/sweep.py``). The
loopback channel lets a plan out to every rank at once or to none, so every
point must reach the oracles. ``tests/core/test_distributed.py`` runs the same sweep
over real torch.distributed (gloo).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch

import mambacache as mc
from mambacache.testing import SequentialOracle, fail_at_op

from ..support.layered import pool_tensors
from ..support.sweep import fault_points
from ..support.util import CancelAtSuspension, InterruptAtLine, every_stage_step, fill_random, step_value

N, H, WORLD = 10, 6, 2


def shard_spec(rank: int) -> mc.StateSpec:
    # Each rank its own shard: the same slots, other state sizes.
    return mc.StateSpec(num_layers=2, conv_shapes=[(3 + rank, 3)], temporal_shape=(2 + rank, 3))


class _Group:
    """A loopback group with eight live slots, dirty, a step queued on the source, and each rank's oracle;
    maybe work the source kept from a failed flush."""

    def __init__(self, host: bool, resume: bool, channel: type[mc.LoopbackChannel] = mc.LoopbackChannel) -> None:
        channels = channel.group(WORLD, timeout=5)
        self.pools = [mc.StatePool(shard_spec(r), N) for r in range(WORLD)]
        self.hosts = [mc.HostPool(shard_spec(r), H) if host else None for r in range(WORLD)]
        self.mgrs = [
            mc.CacheManager(p, host_pool=h, channel=c, max_failed_flushes=1000)
            for p, h, c in zip(self.pools, self.hosts, channels, strict=True)
        ]
        for m in self.mgrs:
            m.__enter__()
        src = self.src = self.mgrs[0]
        slots = src.alloc(8)
        self.flush_all()
        for r, p in enumerate(self.pools):
            fill_random(p, 7 + r)
        h0 = src.offload(slots[7]) if host else None
        self.flush_all()
        self.oracles = [self._oracle(r) for r in range(WORLD)]
        if resume:  # the source's run fails after the send: it keeps its stages, the receivers ran theirs
            src.copy_on_write(slots[6], slots[7])
            src.clear(slots[5])
            self.apply(src.queued())
            with pytest.raises(mc.ExecutorError), fail_at_op(2, RuntimeError):
                src.flush_nowait()
            self.flush_receivers()
            assert self.pools[0].unfinished >= 1
        before = src.pending
        every_stage_step(src, slots, h0)
        self.apply(src.queued()[before:])
        self.queued, self.step = src.queued(), src.step

    def _oracle(self, rank: int) -> SequentialOracle:
        """A rank's oracle; a receiver's pools keep no ledger (the source's says which slots are held)."""
        oracle = SequentialOracle(self.pools[rank], self.hosts[rank])
        oracle.allocated = set(self.pools[0].allocated_slots())
        oracle.defined = set(oracle.allocated)
        src_host = self.hosts[0]
        oracle.host_held = oracle.host_defined = set(src_host.held()) if src_host is not None else set()
        return oracle

    def apply(self, events: list[Any]) -> None:
        for o in self.oracles:
            o.apply(events)

    def flush_receivers(self) -> None:
        for m in self.mgrs[1:]:
            m.flush_nowait()

    def flush_all(self) -> None:
        """Every rank's flush, the source's first: a loopback send never waits, so no threads are needed."""
        self.src.flush_nowait()
        self.flush_receivers()

    def check_honest(self, rank: int) -> None:
        """After rank ``rank``'s interrupted flush: its step says whether it made the step (a source's events
        are queued exactly when it did not), and a ticket it holds no work of is not done."""
        mgr, backlog = self.mgrs[rank], self.pools[rank].backlog
        assert mgr.step in (self.step, self.step + 1)
        if rank == 0:
            assert mgr.queued() == (self.queued if mgr.step == self.step else [])
        if mgr.step == self.step:
            assert backlog.taken == backlog.last + 1 and backlog.done <= backlog.taken

    def finish_and_check(self) -> None:
        """Each rank makes the flush it owes, then all flush once more: every shard is its oracle's. Then a
        forward writes every live slot and all flush again: nothing of the step runs twice."""
        for m in self.mgrs:
            if m.step == self.step:
                m.flush_nowait()
        assert all(m.step == self.step + 1 for m in self.mgrs)
        self.flush_all()
        self.check(self.step + 2)
        for r, pool in enumerate(self.pools):
            for slot in sorted(self.oracles[r].allocated):
                self.oracles[r].write(slot, step_value(self.step, slot))
                for t in pool_tensors(pool):
                    t[:, slot] = step_value(self.step, slot)
        self.flush_all()
        self.check(self.step + 3)
        for m in self.mgrs:
            m.__exit__(None, None, None)

    def check(self, step: int) -> None:
        for r, (mgr, pool, host, oracle) in enumerate(
            zip(self.mgrs, self.pools, self.hosts, self.oracles, strict=True)
        ):
            assert mgr.pending == 0 and pool.unfinished == 0, r
            assert mgr.step == step, r
            if r == 0:
                oracle.assert_matches(pool, host)
            else:
                oracle.assert_matches_shard(pool)
                for want, got in zip(oracle.host, host.tensors if host is not None else [], strict=True):
                    for h in sorted(oracle.host_held & oracle.host_defined):
                        assert torch.equal(want[:, h], got[:, h]), (r, h)


def _interrupted(group: _Group, rank: int, at: int, exc: type[BaseException]) -> int:
    """Rank ``rank``'s flush of the step under an interrupt at its line ``at`` (0: none); a receiver's after the
    source's (so that it never waits). Returns the lines counted."""
    if rank:
        group.src.flush_nowait()
    with InterruptAtLine(at, exc) as trace:
        try:
            group.mgrs[rank].flush_nowait()
        except exc:
            assert at, "an interrupt came out of a flush with none injected"
        else:
            assert not trace.raised, f"the interrupt at line {at} of {trace.lines} did not come out of the flush"
    group.check_honest(rank)
    return trace.lines


def _points(total: int) -> list[tuple[int, type[BaseException]]]:
    excs: list[type[BaseException]] = [KeyboardInterrupt, KeyboardInterrupt, SystemExit]
    return [(at, excs[at % len(excs)]) for at in fault_points(total)]


def _sweep(rank: int, host: bool, resume: bool, run: Callable[[_Group, int, int, type[BaseException]], int]) -> None:
    group = _Group(host, resume)
    total = run(group, rank, 0, KeyboardInterrupt)
    group.finish_and_check()
    assert total > 30
    for at, exc in _points(total):
        group = _Group(host, resume)
        run(group, rank, at, exc)
        group.finish_and_check()


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
@pytest.mark.parametrize("host", [False, True], ids=["pool", "host"])
@pytest.mark.parametrize("rank", [0, 1], ids=["source", "receiver"])
def test_an_interrupt_at_any_line_of_a_flush_over_a_channel_parts_no_ranks(rank: int, host: bool, resume: bool) -> None:
    _sweep(rank, host, resume, _interrupted)


def _interrupted_after_calls(group: _Group, rank: int, at: int, exc: type[BaseException]) -> int:
    if rank:
        group.src.flush_nowait()
    with InterruptAtLine(at, exc, after_calls=True) as trace:
        try:
            group.mgrs[rank].flush_nowait()
        except exc:
            assert at
    group.check_honest(rank)
    return trace.lines


@pytest.mark.parametrize("rank", [0, 1], ids=["source", "receiver"])
def test_a_signal_as_any_call_of_a_flush_over_a_channel_returns_parts_no_ranks(rank: int) -> None:
    """A real signal is raised as a call returns, maybe before its result is stored."""
    _sweep(rank, True, True, _interrupted_after_calls)


# -- the async flush: the core's lines on the event loop's thread, the channel's call in a worker ----------------
async def _interrupted_async(group: _Group, rank: int, at: int, exc: type[BaseException]) -> int:
    if rank:
        group.src.flush_nowait()
    await anyio.to_thread.run_sync(lambda: None)  # a worker exists before the block: its lines are not counted
    with InterruptAtLine(at, exc, threads=False) as trace:
        try:
            await group.mgrs[rank].flush()
        except exc:
            assert at, "an interrupt came out of a flush with none injected"
        else:
            assert not trace.raised, f"the interrupt at line {at} of {trace.lines} did not come out of the flush"
    group.check_honest(rank)
    return trace.lines


async def _sweep_async(rank: int, run: Callable[[_Group, int, int, type[BaseException]], Awaitable[int]]) -> None:
    group = _Group(True, True)
    total = await run(group, rank, 0, KeyboardInterrupt)
    group.finish_and_check()
    assert total > 30
    for at, exc in _points(total):
        group = _Group(True, True)
        await run(group, rank, at, exc)
        group.finish_and_check()


@pytest.mark.anyio
@pytest.mark.parametrize("rank", [0, 1], ids=["source", "receiver"])
async def test_an_interrupt_at_any_line_of_an_async_flush_over_a_channel_parts_no_ranks(rank: int) -> None:
    await _sweep_async(rank, _interrupted_async)


@pytest.mark.anyio
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("rank", [0, 1], ids=["source", "receiver"])
async def test_an_interrupt_in_the_worker_of_an_async_flush_parts_no_ranks(
    rank: int, when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The channel's call runs in a worker thread: an interrupt there, before or after the plan crossed, comes
    out of the flush, and the rank's step is undone or kept as it crossed."""
    group = _Group(True, True)
    if rank:
        group.src.flush_nowait()
    name = "send" if rank == 0 else "receive"
    real = getattr(mc.LoopbackChannel, name)

    def interrupted(self: mc.LoopbackChannel, *args: Any) -> Any:
        if when == "before":
            raise KeyboardInterrupt(f"before the {name}")
        real(self, *args)
        raise KeyboardInterrupt(f"after the {name}")

    monkeypatch.setattr(mc.LoopbackChannel, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        await group.mgrs[rank].flush()
    monkeypatch.setattr(mc.LoopbackChannel, name, real)
    group.check_honest(rank)
    # The source's step is its own once the plan left; a receiver's is not until pushed.
    assert group.mgrs[rank].step == group.step + (rank == 0 and when == "after")
    group.finish_and_check()


# -- a channel that keeps no record: a typed error, never a step the ranks disagree on ------------------------------
class _Forgetful(mc.LoopbackChannel):
    """A channel with the defaults: :meth:`sent` cannot tell, :meth:`consumed` does nothing (its receive hands
    each plan out once)."""

    def sent(self, step: int) -> bool | None:
        return None

    def receive(self) -> tuple[int, mc.Plan]:
        got = super().receive()
        super().consumed(got[0])
        return got

    def consumed(self, step: int) -> None:
        pass


@pytest.mark.parametrize("rank", [0, 1], ids=["source", "receiver"])
def test_without_the_channels_record_an_interrupt_after_the_plan_crossed_is_a_typed_error(
    rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mambacache._core._flush as flush_module

    group = _Group(False, False, channel=_Forgetful)
    if rank:
        group.src.flush_nowait()
    real = flush_module.StepRunner.push

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt("between the plan's crossing and its push")

    monkeypatch.setattr(flush_module.StepRunner, "push", interrupted)
    with pytest.raises(KeyboardInterrupt):
        group.mgrs[rank].flush_nowait()
    monkeypatch.setattr(flush_module.StepRunner, "push", real)
    if rank:  # the receiver took the plan and lost it: the next one it receives is the step after
        group.src.flush_nowait()
    with pytest.raises(mc.DistributedError, match="rebuild the group"):
        group.mgrs[rank].flush_nowait()
    with pytest.raises(mc.DistributedError, match="rebuild the group"):  # for good
        group.mgrs[rank].flush_nowait()


# -- anyio cancellation at every checkpoint of an async flush over a channel ----------------------------------------
POLLS = 4  # suspensions of the cancelled flush while another flush holds the mutex


async def _cancelled(rank: int, at: int, how: str) -> int:
    """Rank ``rank``'s async flush of the step, waiting first for another flush (the mutex held for ``POLLS`` of
    its suspensions), cancelled at its suspension ``at``; then every rank finishes and checks."""
    group = _Group(True, True)
    if rank:
        group.src.flush_nowait()
    mgr = group.mgrs[rank]
    mutex = mgr._core._mutex
    mutex.acquire()

    def other_flush_ends(n: int) -> None:
        if n == POLLS:
            mutex.release()

    cancel = CancelAtSuspension(at, how, other_flush_ends)
    report = await cancel.run(mgr.flush())
    if cancel.suspensions < POLLS:
        mutex.release()
    assert cancel.cancelled == (report is None)
    # Cancelled while it waited, the flush took nothing; once it took its step it ran to the end (shielded).
    assert mgr.step == group.step + (report is not None)
    assert cancel.cancelled == (1 <= at <= POLLS)
    group.check_honest(rank)
    group.finish_and_check()
    return cancel.suspensions


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["cancel", "deadline"])
@pytest.mark.parametrize("rank", [0, 1], ids=["source", "receiver"])
async def test_an_async_flush_over_a_channel_cancelled_at_any_checkpoint_parts_no_ranks(rank: int, how: str) -> None:
    total = await _cancelled(rank, 0, how)
    assert total > POLLS  # the channel's call in its worker thread suspends the flush too
    for at in fault_points(total + 1):
        await _cancelled(rank, at, how)


# -- asyncio's own cancellation (Task.cancel(): asyncio.timeout, wait_for, a TaskGroup), which anyio's shield
# does not stop ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("rank", [0, 1], ids=["source", "receiver"])
async def test_an_async_flush_over_a_channel_cancelled_natively_while_its_plan_crosses_runs_to_its_end(
    anyio_backend: str, rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Task.cancel() while the worker thread sends (or receives) the plan: the flush runs to its end, as under
    anyio's shield, and the CancelledError comes out after it; the ranks stay in step."""
    import asyncio
    import threading
    import time

    group = _Group(True, True)
    if rank:
        group.src.flush_nowait()
    name = "send" if rank == 0 else "receive"
    real = getattr(mc.LoopbackChannel, name)
    crossing = threading.Event()

    def slow(self: mc.LoopbackChannel, *args: Any) -> Any:
        crossing.set()
        time.sleep(0.05)
        return real(self, *args)

    monkeypatch.setattr(mc.LoopbackChannel, name, slow)
    mgr = group.mgrs[rank]
    task = asyncio.ensure_future(mgr.flush())
    await anyio.to_thread.run_sync(crossing.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    monkeypatch.setattr(mc.LoopbackChannel, name, real)
    assert mgr.step == group.step + 1 and mgr.pending == 0 and group.pools[rank].unfinished == 0
    group.finish_and_check()


async def _natively_cancelled(rank: int, at: int) -> int:
    """Rank ``rank``'s async flush of the step, ``Task.cancel()`` as it suspends for the ``at``-th time (0: never);
    then every rank finishes and checks. Returns its suspensions."""
    import asyncio

    group = _Group(True, True)
    if rank:
        group.src.flush_nowait()
    mgr = group.mgrs[rank]
    suspensions = [0]

    async def flush() -> None:
        task = asyncio.current_task()
        assert task is not None

        def suspended(n: int) -> None:
            suspensions[0] = n
            if n == at:
                task.cancel()

        await CancelAtSuspension(0, on_suspend=suspended).run(mgr.flush())

    task = asyncio.ensure_future(flush())
    await asyncio.wait([task], timeout=30)
    assert task.done() and task.cancelled() == (1 <= at <= suspensions[0]), (at, task)
    assert mgr.step == group.step + 1 and mgr.pending == 0 and group.pools[rank].unfinished == 0, at
    group.finish_and_check()
    return suspensions[0]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("rank", [0, 1], ids=["source", "receiver"])
async def test_an_async_flush_over_a_channel_cancelled_natively_at_each_suspension_runs_to_its_end(
    anyio_backend: str, rank: int
) -> None:
    """Task.cancel() as the flush suspends for the k-th time, for every k: at the worker thread's call that is
    before the thread took it (anyio then never runs it, so it is made again) or while it runs (waited for);
    either way the flush runs to its end, the CancelledError comes out after it, and the ranks stay in step."""
    total = await _natively_cancelled(rank, 0)
    assert total >= 2
    for at in range(1, total + 1):
        await _natively_cancelled(rank, at)
