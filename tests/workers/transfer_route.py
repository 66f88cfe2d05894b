"""Runs in spawned processes: one prefill engine (rank 0) exporting to two decode engines (ranks 1 and 2).

Each export names its decode rank (``export(slot, request_id, to=rank)``); the
prefill side runs one ``StateTransfer`` per rank, and each must ship only the
exports addressed to its peer (or to no one). Each decode rank checks that it
received exactly its own states, with their bytes.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import mambacache as mc

from .transfer_soak import oracle, spec

IDS = {1: ["a1", "b1", "c1"], 2: ["a2", "b2"]}


def route_worker(rank: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3, timeout=timedelta(seconds=30)
    )
    try:
        pool = mc.StatePool(spec(), 8)
        with mc.CacheManager(pool, host_pool=mc.HostPool(spec(), 6)) as mgr:
            if rank == 0:
                xfers = {p: mc.StateTransfer(mgr, dist.group.WORLD, peer=p, timeout=10.0) for p in (1, 2)}
                order = ["a1", "a2", "b1", "b2", "c1"]  # interleaved: a send must pick its peer's out of the mix
                for rid in order:
                    (slot,) = mgr.alloc(1, rid, clear=False)
                    mgr.flush_nowait()
                    for t, want in zip(pool.tensors, oracle(rid, pool), strict=True):
                        t[:, slot] = want
                    mgr.export(slot, rid, to=int(rid[1]))  # type: ignore[call-arg]
                mgr.flush_nowait()
                assert xfers[2].send() == IDS[2], "the transfer to rank 2 shipped another rank's states"
                assert xfers[1].send() == IDS[1], "the transfer to rank 1 shipped another rank's states"
                mgr.check_idle(host=True)
            else:
                xfer = mc.StateTransfer(mgr, dist.group.WORLD, peer=0, timeout=10.0)
                ids = xfer.receive()
                assert ids == IDS[rank], f"rank {rank} received {ids}"
                for k, rid in enumerate(ids, 1):
                    mgr.import_into(k, rid)
                mgr.flush_nowait()
                for k, rid in enumerate(ids, 1):
                    for got, want in zip(pool.tensors, oracle(rid, pool), strict=True):
                        assert torch.equal(got[:, k], want), f"{rid} arrived with other bytes"
                    mgr.release(k, rid)
                mgr.flush_nowait()
                mgr.check_idle(host=True)
    finally:
        dist.destroy_process_group()
