"""Runs in spawned processes: one rank of a tensor-parallel CacheManager."""

from __future__ import annotations

import os
import random
from datetime import timedelta

import anyio
import torch
import torch.distributed as dist

import mambacache as mc
from mambacache.testing import SequentialOracle

from ..support.strategies import KINDS, events_from_ops
from ..support.util import drive, fill_random

N = 12


def spec() -> mc.StateSpec:
    return mc.StateSpec(num_layers=2, conv_shapes=[(4, 3)], temporal_shape=(3, 5))


DRAFTS = 2  # every rank's pool keeps draft states, so commits cross the wire too


def plan_of_steps(seed: int, n_ops: int) -> list[list[object]]:
    rng = random.Random(seed)
    raw = [(rng.choice((*KINDS, "shift")), 0, rng.randrange(10**6)) for _ in range(n_ops)]
    raw = [(k, 0 if k == "alloc" else rng.randrange(10**6), b) for k, _, b in raw]
    # Shifted copies cross the wire as shift stages (conv width 3: shifts 1 and 2).
    return [events for events, _ in events_from_ops(raw, N, set(), draft_tokens=DRAFTS, max_shift=2)]


def submit_all(mgr: mc.CacheManager, events: list[object]) -> None:
    """The source rank's submits: allocs reproduce the drawn slot (the lowest free one)."""
    drive(mgr, events)


def shard_pool(seed: int, rank: int) -> mc.StatePool:
    """This rank's shard: its own random state and draft content."""
    pool = mc.StatePool(spec(), N, draft_tokens=DRAFTS)
    fill_random(pool, 1000 * seed + rank)
    g = torch.Generator().manual_seed(7 * seed + rank)
    for d in pool.draft_tensors:
        d.copy_(torch.randn(d.shape, generator=g))
    return pool


def worker(rank: int, world: int, port: int, seed: int, mode: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    if mode in ("big", "mismatch"):
        anyio.run(_big_or_mismatch, rank, mode)
        dist.destroy_process_group()
        return
    pool = shard_pool(seed, rank)  # each rank its own shard content
    oracle = SequentialOracle(pool)
    steps = plan_of_steps(seed, 60)

    async def main() -> None:
        timeout = 4.0 if mode != "ok" else 60.0
        async with mc.CacheManager(pool, group=dist.group.WORLD, src_rank=0, timeout=timeout) as mgr:
            for i, events in enumerate(steps):
                if rank == 0:
                    submit_all(mgr, events)
                else:
                    try:
                        mgr.clear(1)
                    except mc.DistributedError:
                        pass
                    else:
                        raise AssertionError("a non-source rank accepted an event")
                oracle.apply(events)  # type: ignore[arg-type]
                report = await mgr.flush()
                assert report.step == i and report.events == len(events)
                for t_want, t_got in zip(oracle.tensors, pool.tensors, strict=True):
                    for s in oracle.allocated & oracle.defined:
                        assert torch.equal(t_want[:, s], t_got[:, s]), (rank, i, s)
                if mode == "kill-peer" and rank == 1 and i == 1:
                    os._exit(0)
                if mode == "kill-source" and rank == 0 and i == 1:
                    os._exit(0)

    if mode == "ok":
        anyio.run(main)
        dist.destroy_process_group()
        return
    try:
        anyio.run(main)
    except mc.DistributedError as exc:
        assert "failed or timed out" in str(exc) or "failed earlier" in str(exc), exc
        os._exit(0)  # skip a teardown that would wait on the dead peer
    raise AssertionError(f"rank {rank}: no DistributedError after the peer died")


async def _big_or_mismatch(rank: int, mode: str) -> None:
    """A plan longer than one message (1,500 zeroed slots), or pools of different sizes."""
    num_slots = 1500 if mode == "big" or rank == 0 else 1499
    pool = mc.StatePool(mc.StateSpec(num_layers=1, conv_shapes=(), temporal_shape=(2,)), num_slots)
    pool.temporal.fill_(7.0)
    try:
        async with mc.CacheManager(pool, group=dist.group.WORLD, src_rank=0, timeout=20) as mgr:
            if rank == 0:
                mgr.alloc(1500)
            report = await mgr.flush()
            assert report.zeroed == 1500
            assert bool((pool.temporal[:, 1:] == 0).all()) and bool((pool.temporal[:, 0] == 7).all())
    except mc.DistributedError as exc:
        assert mode == "mismatch", exc
        # Rank 1 finds the mismatch and leaves; rank 0 then finds its peer gone.
        assert ("pools differ" if rank == 1 else "failed or timed out") in str(exc), exc
        os._exit(0)
    if mode == "mismatch" and rank == 1:
        raise AssertionError("a pool of another size was accepted")
    if mode == "mismatch":
        os._exit(0)  # rank 1 has gone: skip the teardown


def cancel_worker(rank: int, world: int, port: int, seed: int, mode: str) -> None:
    """Flushes cancelled at random points on random ranks: every shard still matches its oracle."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    if mode == "big":
        anyio.run(_big_cancelled, rank)
        dist.destroy_process_group()
        return
    pool = shard_pool(seed, rank)
    oracle = SequentialOracle(pool)
    steps = plan_of_steps(seed, 120)
    rng = random.Random(seed * 7919 + rank)

    async def main() -> None:
        async with mc.CacheManager(pool, group=dist.group.WORLD, src_rank=0, timeout=20) as mgr:
            for events in steps:
                if rank == 0:
                    submit_all(mgr, events)
                oracle.apply(events)  # type: ignore[arg-type]
                before = mgr.step
                how = rng.randrange(5)
                if how == 0:
                    await mgr.flush()
                elif how == 1:  # cancelled before the flush is even called
                    with anyio.CancelScope() as scope:
                        scope.cancel()
                        await mgr.flush()
                elif how == 2:  # a deadline that may expire in the broadcast wait
                    with anyio.move_on_after(rng.uniform(0, 0.01)):
                        await mgr.flush()
                elif how == 3:  # this rank comes late, so its peers wait in the broadcast
                    await anyio.sleep(rng.uniform(0, 0.01))
                    await mgr.flush()
                else:  # cancelled by a sibling task while flushing
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(mgr.flush)
                        await anyio.sleep(rng.uniform(0, 0.005))
                        tg.cancel_scope.cancel()
                if mgr.step == before:
                    await mgr.flush()  # the cancelled flush took nothing: this rank still owes the step
                assert mgr.step == before + 1
                for t_want, t_got in zip(oracle.tensors, pool.tensors, strict=True):
                    for s in oracle.allocated & oracle.defined:
                        assert torch.equal(t_want[:, s], t_got[:, s]), (rank, mgr.step, s)
                assert pool.unfinished == 0 and mgr.pending == 0

    anyio.run(main)
    dist.destroy_process_group()


async def _big_cancelled(rank: int) -> None:
    """A plan longer than one message, its flush under a deadline shorter than the peer's delay."""
    pool = mc.StatePool(mc.StateSpec(num_layers=1, conv_shapes=(), temporal_shape=(2,)), 1500)
    pool.temporal.fill_(7.0)
    async with mc.CacheManager(pool, group=dist.group.WORLD, src_rank=0, timeout=20) as mgr:
        for step in range(3):
            if rank == 0:
                if step == 0:
                    mgr.alloc(1500)
                else:
                    mgr.copy_many(list(range(1, 751)), list(range(751, 1501)))
                with anyio.move_on_after(0.001):
                    await mgr.flush()
            else:
                await anyio.sleep(0.05)
                with anyio.move_on_after(0.001):
                    await mgr.flush()
            assert mgr.step == step + 1
            if step == 0:
                assert bool((pool.temporal[:, 1:] == 0).all()), rank
                pool.temporal[:, 1:751] = torch.arange(1, 751, dtype=torch.float32)[None, :, None]
            else:
                assert torch.equal(pool.temporal[:, 751:], pool.temporal[:, 1:751]), rank
    assert bool((pool.temporal[:, 0] == 7).all())


def sync_worker(rank: int, world: int, port: int, seed: int) -> None:
    """The synchronous API in tensor-parallel mode: `with` and flush_nowait() on every rank."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    pool = shard_pool(seed, rank)
    oracle = SequentialOracle(pool)
    with mc.CacheManager(pool, group=dist.group.WORLD, src_rank=0, timeout=20) as mgr:
        for i, events in enumerate(plan_of_steps(seed, 80)):
            if rank == 0:
                submit_all(mgr, events)
            oracle.apply(events)  # type: ignore[arg-type]
            report = mgr.flush_nowait()
            assert report.step == i and report.events == len(events)
            oracle.assert_matches_shard(pool)
    dist.destroy_process_group()


class _Recorder(SequentialOracle):
    """An oracle that also keeps the events it applied, for the source rank to send to its peers."""

    def __init__(self, pool: mc.StatePool, host: mc.HostPool) -> None:
        super().__init__(pool, host)
        self.log: list[object] = []

    def apply(self, events: object) -> None:  # type: ignore[override]
        events = list(events)  # type: ignore[call-overload]
        self.log += events
        super().apply(events)


def host_worker(rank: int, world: int, port: int, seed: int) -> None:
    """Offload, restore and drop cross the wire: every rank's pool and host shard match its oracle."""
    from ..support.util import Driver

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    pool = shard_pool(seed, rank)
    host = mc.HostPool(spec(), 6)
    g = torch.Generator().manual_seed(99 * seed + rank)
    for t in host.tensors:
        t.copy_(torch.randn(t.shape, generator=g))
    rng = random.Random(seed)
    kinds = ("alloc", "clear", "cow", "release", "offload", "offload", "restore", "drop", "flush")
    raw = [(rng.choice(kinds), rng.randrange(10**6), rng.randrange(10**6)) for _ in range(120)]
    with mc.CacheManager(pool, group=dist.group.WORLD, src_rank=0, timeout=60.0, host_pool=host) as mgr:
        oracle = _Recorder(pool, host)
        drive = Driver(mgr, oracle) if rank == 0 else None
        steps = offloads = restores = 0
        for kind, a, b in raw:
            if kind != "flush":
                if drive is not None:
                    drive.apply(kind, a, b)
                continue
            box = [oracle.log if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            if rank != 0:
                oracle.apply(box[0])  # type: ignore[arg-type]
            oracle.log = []
            report = mgr.flush_nowait()
            steps += 1
            oracle.assert_matches_shard(pool)
            for i, (want, got) in enumerate(zip(oracle.host, host.tensors, strict=True)):
                for h in sorted(oracle.host_held & oracle.host_defined):
                    assert torch.equal(want[:, h], got[:, h]), (rank, i, h)
            offloads += report.offloaded
            restores += report.restored
    assert steps > 5 and offloads > 0 and restores > 0  # the plans carried both stage kinds, on every rank
    dist.destroy_process_group()


def interrupt_worker(rank: int, world: int, port: int, swept: int) -> None:
    """The interrupt sweep of tests/core/test_channel_interrupts.py over real gloo: rank ``swept``'s flush of a step
    with every stage kind is interrupted at its line k (each of tests/support/sweep.py's points), every rank then makes
    the flush it owes and one more, and every shard must be its oracle's; or, where the swept rank could not
    tell whether its plan's broadcast was issued, every rank's flush must raise DistributedError. Each point on
    a group of its own (a failed one is left behind)."""
    from ..support.sweep import fault_points
    from ..support.util import InterruptAtLine, every_stage_step

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )

    def one(at: int) -> tuple[int, str, str]:
        group = dist.new_group(backend="gloo")
        pool = mc.StatePool(spec(), N)
        host = mc.HostPool(spec(), 6)
        mgr = mc.CacheManager(pool, group=group, src_rank=0, timeout=3.0, host_pool=host, max_failed_flushes=100)
        mgr.__enter__()
        slots = mgr.alloc(8) if rank == 0 else []
        mgr.flush_nowait()
        fill_random(pool, 7 + rank)
        h0 = mgr.offload(slots[7]) if rank == 0 else None
        mgr.flush_nowait()
        oracle = SequentialOracle(pool, host)
        # A receiver's pools keep no ledger: the source's says which slots are held.
        box: list[object] = [(sorted(pool.allocated_slots()), sorted(host.held())) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        held, host_held = box[0]  # type: ignore[misc]
        oracle.allocated, oracle.defined = set(held), set(held)
        oracle.host_held, oracle.host_defined = set(host_held), set(host_held)
        if rank == 0:
            every_stage_step(mgr, slots, h0)
        box = [mgr.queued() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        oracle.apply(box[0])  # type: ignore[arg-type]
        step, lines, outcome, where = mgr.step, 0, "ok", ""
        try:
            if rank == swept:
                with InterruptAtLine(at, KeyboardInterrupt) as trace:
                    try:
                        mgr.flush_nowait()
                    except KeyboardInterrupt as exc:
                        assert at
                        where = str(exc).rpartition("/")[2]
                lines = trace.lines
                assert mgr.step in (step, step + 1)
            else:
                mgr.flush_nowait()
            if mgr.step == step:  # the flush this rank owes
                mgr.flush_nowait()
            mgr.flush_nowait()
            assert mgr.step == step + 2 and mgr.pending == 0 and pool.unfinished == 0, (rank, at)
            oracle.assert_matches_shard(pool)
            for want, got in zip(oracle.host, host.tensors, strict=True):
                for h in sorted(oracle.host_held & oracle.host_defined):
                    assert torch.equal(want[:, h], got[:, h]), (rank, at, h)
            mgr.__exit__(None, None, None)
            # A thousand points' groups left alive are thousands of gloo threads per rank, which starve every
            # other process on the host (load average over 200 on 2 cores): each point's group goes with it.
            dist.destroy_process_group(group)
        except mc.DistributedError as exc:
            assert "rebuild the group" in str(exc) or "failed" in str(exc) or "no plan" in str(exc), exc
            outcome = "parted"
        return lines, outcome, where

    lines, _, _ = one(0)
    box: list[object] = [lines]
    dist.broadcast_object_list(box, src=swept)
    total = int(box[0])  # type: ignore[call-overload]
    assert total > 30, total
    parted: list[str] = []
    for at in fault_points(total):
        _, outcome, where = one(at)
        outcomes: list[object] = [None] * world
        dist.all_gather_object(outcomes, outcome)
        assert len(set(outcomes)) == 1, (at, where, outcomes)  # all reach the oracles, or all raise
        if outcome == "parted":
            parted.append(where)
    # Only a stop as a broadcast is issued parts the group: one line of the flush (a one-message plan).
    assert len(parted) <= 1 or rank != swept, parted
    if rank == swept:  # shown with pytest -s
        print(f"gloo sweep of rank {swept}: {total} lines, {len(fault_points(total))} points, parted at {parted}")
    dist.barrier()
    os._exit(0)  # the parted points' groups are left behind; their teardown would wait on broadcasts never made
