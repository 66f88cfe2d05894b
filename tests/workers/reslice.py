"""Runs in spawned processes: rank 0 a prefill engine at TP 1 (whole states), ranks 1 and 2 a decode engine at TP 2."""

from __future__ import annotations

import os
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

import mambacache as mc
from mambacache._handoff._reslice import ReslicingSender, StateLayout

from ..support.util import fill_random

N, HOST = 6, 4


def layout() -> StateLayout:
    """Mamba2 with one group: x and the heads split, B and C replicated (both ranks get them)."""
    config = SimpleNamespace(
        model_type="mamba2", num_hidden_layers=2, num_heads=4, head_dim=2, n_groups=1, state_size=3, expand=2,
        hidden_size=4, conv_kernel=4,
    )  # fmt: skip
    return StateLayout.from_config(config)


def prefill_pool(seed: int) -> mc.StatePool:
    pool = mc.StatePool(layout().spec, N)
    fill_random(pool, seed)
    return pool


def reslice_worker(rank: int, port: int, seed: int, mode: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3, timeout=timedelta(seconds=30)
    )
    if mode == f"kill-decode-{rank}":
        os._exit(0)  # a decode rank dies before its shard arrives
    try:
        (_prefill if rank == 0 else _decode)(rank, seed, mode)
    finally:
        dist.destroy_process_group()


def _prefill(rank: int, seed: int, mode: str) -> None:
    pool = prefill_pool(seed)
    with mc.CacheManager(pool, host_pool=mc.HostPool(pool.spec, HOST)) as mgr:
        sender = ReslicingSender(mgr, dist.group.WORLD, [1, 2], layout(), timeout=5.0)
        mgr.alloc_slots([2, 5], "old", clear=False)
        mgr.hand_over(2, "a")
        mgr.hand_over(5, "b")
        mgr.export(2, "a")
        mgr.export(5, "b")
        mgr.clear(2, "a")  # after the export: never reaches what is sent
        assert sender.send() == []  # nothing flushed yet: nothing sent
        mgr.flush_nowait()
        if mode.startswith("kill-decode"):
            try:
                sender.send()
            except mc.TransferError as exc:
                # Ended by the sender's own 5 s timeout, not the process group's 30 s one (nor a hang, which
                # pytest's timeout ends).
                assert "rank 1 took no batch: timed out after 5s" in str(exc), exc
                assert exc.request_ids == ["a", "b"], exc.request_ids
                assert mgr.held() == {2: "a", 5: "b"}, mgr.held()  # kept: send again or release
                assert mgr.host_pool is not None and mgr.host_pool.num_held == 2
                return
            raise AssertionError("a dead decode rank went unnoticed")
        assert sender.send() == ["a", "b"]
        assert mgr.held() == {} and mgr.host_pool is not None and mgr.host_pool.num_held == 0
        mgr.check_idle()


def _decode(rank: int, seed: int, mode: str) -> None:
    shard = layout().slice(prefill_pool(seed).tensors, 2, rank - 1)  # what this rank must hold: its shard only
    spec = layout().shard_spec(2)
    pool = mc.StatePool(spec, N)
    fill_random(pool, seed + rank)  # dirty: an old tenant's bytes
    with mc.CacheManager(pool, host_pool=mc.HostPool(spec, HOST)) as mgr:
        xfer = mc.StateTransfer(mgr, dist.group.WORLD, peer=0, timeout=5.0)
        assert xfer.receive() == ["a", "b"]  # sized for the shard: a whole state would not fit the messages
        mgr.import_into(3, "a")
        mgr.import_into(1, "b")
        mgr.flush_nowait()
        for got, want in zip(pool.tensors, shard, strict=True):
            assert torch.equal(got[:, 3].view(torch.uint8), want[:, 2].view(torch.uint8))
            assert torch.equal(got[:, 1].view(torch.uint8), want[:, 5].view(torch.uint8))
        mgr.release_many([3, 1])
        mgr.flush_nowait()
        mgr.check_idle()
