"""Runs in spawned processes: one rank of a tensor-parallel CacheManager."""

from __future__ import annotations

import os
import random
import time
from datetime import timedelta

import anyio
import torch
import torch.distributed as dist

import mambacache as mc

from .conftest import fill_random
from .oracle import SequentialOracle
from .strategies import KINDS, events_from_ops

N = 12


def spec() -> mc.StateSpec:
    return mc.StateSpec(num_layers=2, conv_shapes=[(4, 3)], temporal_shape=(3, 5))


def plan_of_steps(seed: int, n_ops: int) -> list[list[object]]:
    rng = random.Random(seed)
    raw = [(rng.choice(KINDS), 0, rng.randrange(10**6)) for _ in range(n_ops)]
    raw = [(k, 0 if k == "alloc" else rng.randrange(10**6), b) for k, _, b in raw]
    return [events for events, _ in events_from_ops(raw, N, set())]


def worker(rank: int, world: int, port: int, seed: int, mode: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    if mode in ("big", "mismatch"):
        anyio.run(_big_or_mismatch, rank, mode)
        dist.destroy_process_group()
        return
    pool = mc.StatePool(spec(), N)
    fill_random(pool, 1000 * seed + rank)  # each rank its own shard content
    oracle = SequentialOracle(pool)
    steps = plan_of_steps(seed, 60)

    async def main() -> None:
        timeout = 4.0 if mode != "ok" else 60.0
        async with mc.CacheManager(pool, group=dist.group.WORLD, src_rank=0, timeout=timeout) as mgr:
            for i, events in enumerate(steps):
                if rank == 0:
                    for ev in events:
                        if isinstance(ev, mc.Alloc):
                            assert mgr.alloc(1, clear=ev.clear) == [ev.slot]
                        else:
                            mgr.submit(ev)  # type: ignore[arg-type]
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
    t0 = time.monotonic()
    try:
        anyio.run(main)
    except mc.DistributedError as exc:
        assert "failed or timed out" in str(exc) or "failed earlier" in str(exc), exc
        assert time.monotonic() - t0 < 25
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
