"""Tensor-parallel mode on real torch.distributed (gloo on 127.0.0.1), in spawned processes.

The plan logic of every rank (each world size, every event kind, sync and async
flushes) is tested in one process over ``LoopbackChannel`` (tests/core/test_channel.py),
through the same wire format; here each behaviour runs once over the real
transport, at the world size that exercises it most (three ranks where a
receiver's order matters), plus what only processes can show (a killed peer,
a cancelled broadcast, a deadline).
"""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

import mambacache as mc

from ..support.link import free_port
from ..workers.dist import cancel_worker, host_worker, interrupt_worker, sync_worker, worker

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("world", "seed"), [(3, 2)])
def test_every_shard_matches_sequential_execution(world: int, seed: int) -> None:
    mp.spawn(worker, args=(world, free_port(), seed, "ok"), nprocs=world, join=True)


@pytest.mark.parametrize("mode", ["kill-peer", "kill-source"])
def test_a_dead_rank_is_reported_not_hung_on(mode: str) -> None:
    mp.spawn(worker, args=(2, free_port(), 3, mode), nprocs=2, join=True)


@pytest.mark.parametrize("mode", ["big", "mismatch"])
def test_long_plans_and_mismatched_pools(mode: str) -> None:
    mp.spawn(worker, args=(2, free_port(), 0, mode), nprocs=2, join=True)


def test_group_requires_initialized_distributed() -> None:
    spec = mc.StateSpec(num_layers=1, conv_shapes=[], temporal_shape=(2,))
    with pytest.raises(mc.DistributedError, match="not initialized"):
        mc.CacheManager(mc.StatePool(spec, 2), group=object())


@pytest.mark.parametrize(("world", "seed"), [(3, 12), (2, 13)])
def test_cancelled_flushes_never_part_the_ranks(world: int, seed: int) -> None:
    mp.spawn(cancel_worker, args=(world, free_port(), seed, "random"), nprocs=world, join=True)


def test_a_long_plan_under_a_deadline_reaches_every_rank_once() -> None:
    mp.spawn(cancel_worker, args=(2, free_port(), 0, "big"), nprocs=2, join=True)


@pytest.mark.parametrize("world", [3])
def test_the_synchronous_api_in_tensor_parallel_mode(world: int) -> None:
    mp.spawn(sync_worker, args=(world, free_port(), 21), nprocs=world, join=True)


@pytest.mark.parametrize("world", [3])
def test_offload_restore_and_drop_apply_on_every_rank(world: int) -> None:
    mp.spawn(host_worker, args=(world, free_port(), 5), nprocs=world, join=True)


@pytest.mark.parametrize("swept", [0, 1], ids=["source", "receiver"])
def test_an_interrupt_at_any_line_of_a_flush_over_gloo_parts_no_ranks(swept: int) -> None:
    """tests/core/test_channel_interrupts.py's sweep over real torch.distributed: every shard reaches its oracle, or
    (only where a broadcast was stopped as it was issued) every rank raises DistributedError."""
    mp.spawn(interrupt_worker, args=(2, free_port(), swept), nprocs=2, join=True)
