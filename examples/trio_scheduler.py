"""The same manager under trio (anyio runs it on either): a nursery of request tasks.

python examples/trio_scheduler.py
"""

from __future__ import annotations

import sys

try:
    import trio
except ImportError:
    sys.exit("this example needs trio: pip install 'mambacache[trio]'")

import mambacache as mc

SPEC = mc.StateSpec(num_layers=2, conv_shapes=[(32, 4)], temporal_shape=(2, 8, 8))


async def request(mgr: mc.CacheManager, rid: str, tokens: int) -> None:
    (slot,) = mgr.alloc(1, request_id=rid)
    for _ in range(tokens):
        await trio.sleep(0.001)
    mgr.release(slot, request_id=rid)


async def main() -> None:
    pool = mc.StatePool(SPEC, num_slots=16)
    async with mc.CacheManager(pool) as mgr:
        finished = trio.Event()

        async def step_loop() -> None:
            while not finished.is_set():
                report = await mgr.flush()
                if report.events:
                    print(f"step {report.step}: {report.events} events, {report.zeroed} slots zeroed")
                await trio.sleep(0.002)  # the forward step

        async with trio.open_nursery() as nursery:
            nursery.start_soon(step_loop)
            async with trio.open_nursery() as requests:
                for i in range(12):
                    requests.start_soon(request, mgr, f"r{i}", 2 + i % 3)
            finished.set()
    print(f"done: {pool.num_free}/{pool.num_slots} slots free")


if __name__ == "__main__":
    trio.run(main)
