"""Submitting from a worker thread: a detokenizer thread releases finished requests.

Submitting is thread-safe; flushing stays on the event loop that owns the forward.

    python examples/worker_thread.py
"""

from __future__ import annotations

import queue
import threading

import anyio

import mambacache as mc

SPEC = mc.StateSpec(num_layers=2, conv_shapes=[(32, 4)], temporal_shape=(2, 8, 8))


def detokenizer(mgr: mc.CacheManager, finished: queue.Queue[tuple[str, int] | None]) -> None:
    while (item := finished.get()) is not None:
        rid, slot = item
        mgr.release(slot, request_id=rid)  # from this thread, while the loop flushes


async def main() -> None:
    pool = mc.StatePool(SPEC, num_slots=8)
    finished: queue.Queue[tuple[str, int] | None] = queue.Queue()
    async with mc.CacheManager(pool) as mgr:
        thread = threading.Thread(target=detokenizer, args=(mgr, finished))
        thread.start()
        served = 0
        for _ in range(40):
            while served < 30 and pool.num_free:
                (slot,) = mgr.alloc(1, request_id=f"r{served}")
                finished.put((f"r{served}", slot))  # "finishes" a few steps later, in the thread
                served += 1
            await mgr.flush()
            await anyio.sleep(0.001)
        finished.put(None)
        await anyio.to_thread.run_sync(thread.join)
        await mgr.flush()
    print(f"served {served} requests through {pool.num_slots} slots; {pool.num_free} free at the end")


if __name__ == "__main__":
    anyio.run(main)
