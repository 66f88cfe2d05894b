"""Runs in spawned processes: rank 0 a prefill engine that exports, rank 1 a decode engine that imports."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

import mambacache as mc

from ..support.util import fill_random

N, HOST = 8, 6


def spec() -> mc.StateSpec:
    return mc.StateSpec(
        num_layers=2, conv_shapes=[(4, 3)], temporal_shape=(3, 5), extra_shapes={"scale": ((), torch.bfloat16)}
    )


def prefill_pool(seed: int) -> mc.StatePool:
    pool = mc.StatePool(spec(), N)
    fill_random(pool, seed)
    return pool


def transfer_worker(rank: int, port: int, seed: int, mode: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    try:
        (_prefill if rank == 0 else _decode)(seed, mode)
    finally:
        if mode != "kill-prefill" or rank == 1:
            dist.destroy_process_group()


def _prefill(seed: int, mode: str) -> None:
    pool = prefill_pool(seed)
    with mc.CacheManager(pool, host_pool=mc.HostPool(spec(), HOST)) as mgr:
        mgr.alloc_slots([2, 5, 6], "old", clear=False)
        xfer = mc.StateTransfer(mgr, dist.group.WORLD, peer=1, timeout=5.0)
        dist.barrier()  # both transfers made (each opens its store connections): a peer dies after start-up
        mgr.hand_over(2, "a")
        mgr.hand_over(5, "b")
        mgr.export(2, "a")
        mgr.export(5, "b")
        mgr.clear(2, "a")  # after the export: never reaches what is sent
        mgr.copy_on_write(6, 5)  # the same for b
        if mode == "kill-prefill":
            os._exit(0)  # dies before sending: the decode side must raise, not hang
        assert xfer.send() == []  # nothing flushed yet: nothing sent
        mgr.flush_nowait()
        assert xfer.send() == ["a", "b"]
        assert mgr.held() == {6: "old"} and mgr.host_pool is not None and mgr.host_pool.num_held == 0
        mgr.release(6, "old")
        mgr.flush_nowait()
        mgr.check_idle()


def _decode(seed: int, mode: str) -> None:
    sent = prefill_pool(seed)  # what the prefill side held: the same seed
    pool = mc.StatePool(spec(), N)
    fill_random(pool, seed + 1)  # dirty: an old tenant's bytes
    with mc.CacheManager(pool, host_pool=mc.HostPool(spec(), HOST)) as mgr:
        xfer = mc.StateTransfer(mgr, dist.group.WORLD, peer=0, timeout=5.0)
        dist.barrier()
        (old,) = mgr.alloc_slots([3], "old", clear=False)
        if mode == "kill-prefill":
            try:
                xfer.receive()
            except mc.TransferError as exc:
                # Noticed by the transfer itself: the store's connection to the dead rank, or its own 5 s timeout,
                # not the process group's 30 s one (nor a hang, which pytest's timeout ends).
                assert "store failed" in str(exc) or "timed out after 5s" in str(exc), exc
                assert mgr.held() == {3: "old"} and mgr.host_pool is not None and mgr.host_pool.num_held == 0, exc
                return
            raise AssertionError("a dead peer went unnoticed")
        assert xfer.receive() == ["a", "b"]
        with_nothing = pool.temporal.clone()
        mgr.release(old, "old")  # queued before the import of slot 3: must not wipe it
        mgr.import_into(old, "a")
        mgr.import_into(7, "b")
        if mode == "clear-after":
            mgr.clear(7, "b")
        try:
            mgr.import_into(1, "a")  # imported already
        except mc.SlotStateError:
            pass
        else:
            raise AssertionError("a state was imported twice")
        assert torch.equal(pool.temporal, with_nothing)  # nothing moves before the flush
        mgr.flush_nowait()
        for got, want in zip(pool.tensors, sent.tensors, strict=True):
            assert torch.equal(got[:, 3], want[:, 2])
            if mode == "clear-after":
                assert not got[:, 7].any()
            else:
                assert torch.equal(got[:, 7], want[:, 5])
        mgr.release(3, "a")
        mgr.release(7, "b")
        mgr.flush_nowait()
        mgr.check_idle()
