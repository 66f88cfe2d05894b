"""Backpressure on asyncio: request handlers wait for a slot with `alloc_wait` instead of failing.

Twenty handlers arrive at once for a pool of four slots; each waits its turn (first come,
first served), runs a few decode steps, and releases. A stepping task flushes before
every "forward". A handler that gives up (a client timeout) allocates nothing.

    python examples/asyncio_backpressure.py
"""

from __future__ import annotations

import asyncio

import mambacache as mc

SPEC = mc.StateSpec(num_layers=2, conv_shapes=[(16, 4)], temporal_shape=(2, 8, 8))


async def main() -> None:
    pool = mc.StatePool(SPEC, num_slots=4)
    order: list[str] = []
    gave_up = 0
    async with mc.CacheManager(pool) as mgr:
        step_done = asyncio.Condition()

        async def stepper() -> None:
            while True:
                await mgr.flush()  # clears of new slots land before the forward
                await asyncio.sleep(0.002)  # the forward
                async with step_done:
                    step_done.notify_all()

        async def handler(i: int) -> None:
            nonlocal gave_up
            rid = f"r{i}"
            try:
                (slot,) = await asyncio.wait_for(mgr.alloc_wait(1, request_id=rid), timeout=5 if i != 7 else 0.001)
            except TimeoutError:
                gave_up += 1  # nothing was allocated for it
                return
            order.append(rid)
            for _ in range(3):  # three decode steps
                async with step_done:
                    await step_done.wait()
            mgr.release(slot, request_id=rid)

        stepping = asyncio.create_task(stepper())
        await asyncio.gather(*(handler(i) for i in range(20)))
        stepping.cancel()
        mgr.check_idle()
    fifo = order == sorted(order, key=lambda r: int(r[1:]))
    print(f"backpressure: {len(order)} requests through {pool.num_slots} slots, {gave_up} gave up;"
          f" served first come first served: {fifo}; {pool.num_free} free")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
