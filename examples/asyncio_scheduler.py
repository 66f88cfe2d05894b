"""A continuous-batching step loop on asyncio, with request handlers as tasks.

Handlers allocate, fork and release from their own tasks at any time; the step
loop flushes once per forward step, before running the model.

    python examples/asyncio_scheduler.py
"""

from __future__ import annotations

import asyncio

import torch

import mambacache as mc

SPEC = mc.StateSpec(num_layers=4, conv_shapes=[(64, 4)], temporal_shape=(4, 16, 16))


async def handle(mgr: mc.CacheManager, rid: str, prefix_slot: int, tokens: int, done: asyncio.Queue[str]) -> None:
    (slot,) = mgr.alloc(1, request_id=rid)  # reads as zeros after the next flush...
    mgr.copy_on_write(prefix_slot, slot, request_id=rid)  # ...unless a fork overwrites it
    for _ in range(tokens):
        await asyncio.sleep(0.001)  # the request waits for forward steps
    mgr.release(slot, request_id=rid)
    await done.put(rid)


async def main() -> None:
    pool = mc.StatePool(SPEC, num_slots=32)
    async with mc.CacheManager(pool) as mgr:
        (prefix,) = mgr.alloc(1, request_id="system-prompt")
        await mgr.flush()
        pool.temporal[:, prefix] = 1.0  # a "prefilled" shared prefix
        done: asyncio.Queue[str] = asyncio.Queue()
        tasks = [asyncio.create_task(handle(mgr, f"r{i}", prefix, 3 + i % 4, done)) for i in range(16)]
        steps = 0
        while not all(t.done() for t in tasks):
            report = await mgr.flush()  # on the forward stream, right before the forward
            steps += 1
            if report.events:
                print(f"step {report.step}: {report.events} events, {report.copied} forks, "
                      f"{report.zeroed} zeroed, {report.elided} elided")  # fmt: skip
            await asyncio.sleep(0.001)  # the forward step
        await asyncio.gather(*tasks)
        print(f"{done.qsize()} requests finished in {steps} steps; {pool.num_free} of {pool.num_slots} slots free")
        assert bool(torch.all(pool.temporal[:, prefix] == 1.0))


if __name__ == "__main__":
    asyncio.run(main())
