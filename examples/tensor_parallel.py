"""Two CPU processes, one scheduler: rank 0 submits, both ranks apply the same plan to their shard.

Each rank holds its half of every state (as with heads split across a TP group).
At the end every rank checks its shard against running the same events one at a
time on its own copy, and rank 0 prints both verdicts.

    python examples/tensor_parallel.py
"""

from __future__ import annotations

import socket
from datetime import timedelta

import anyio
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mambacache as mc

FULL_HEADS = 8
SPEC = mc.StateSpec(num_layers=2, conv_shapes=[(64, 4)], temporal_shape=(FULL_HEADS // 2, 16, 16))


def replay(tensors: list[torch.Tensor], events: list[object]) -> None:
    for ev in events:
        if isinstance(ev, (mc.Alloc, mc.Clear)):
            for t in tensors:
                t[:, ev.slot] = 0
        elif isinstance(ev, mc.CopyOnWrite):
            for t in tensors:
                t[:, ev.dst] = t[:, ev.src].clone()


def run(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))  # fmt: skip
    pool = mc.StatePool(SPEC, num_slots=16)
    torch.manual_seed(rank)
    for t in pool.tensors:
        t.normal_()  # each rank's own shard
    expected = [t.clone() for t in pool.tensors]
    log: list[object] = []

    async def main() -> None:
        async with mc.CacheManager(pool, group=dist.group.WORLD, src_rank=0, timeout=30) as mgr:
            for step in range(6):
                if rank == 0:  # the scheduler
                    for s in mgr.alloc(2, request_id=f"req{step}"):
                        log.append(mc.Alloc(s))
                    live = pool.allocated_slots()
                    events = [mc.CopyOnWrite(live[0], live[-1]), mc.Release(live[1])]
                    mgr.submit(*events)
                    log.extend(events)
                report = await mgr.flush()
                if rank == 0:
                    print(f"step {report.step}: {report.events} events -> {report.zeroed} zeroed, "
                          f"{report.copied} copied")  # fmt: skip

    anyio.run(main)
    # Rank 0 knows the event log; send it to the others to check their shards.
    box = [log]
    dist.broadcast_object_list(box, src=0)
    replay(expected, box[0])  # type: ignore[arg-type]
    live = [s for s in range(1, 17) if not any(isinstance(e, mc.Release) and e.slot == s for e in box[0])]
    ok = all(torch.equal(e[:, live], t[:, live]) for e, t in zip(expected, pool.tensors, strict=True))
    verdicts: list[object] = [None] * world
    dist.all_gather_object(verdicts, ok)
    if rank == 0:
        print("shards match sequential execution on every rank:", verdicts)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(2, port), nprocs=2, join=True)
