"""Runs in spawned processes: a soak of real StateTransfers (issue #32), one prefill engine and one or two decode ones.

Process 0 is the prefill engine: its step loop writes each request's state
(the oracle: bytes drawn from the request id), exports it to a decode rank and
flushes with a fault injected at a drawn aten op (a failed flush is repaired
by the next), while one worker thread per decode rank sends; half the exports
go in place (the send reads the pool slot while the step loop writes others). Each decode rank
receives in a worker thread (sometimes sleeping past the timeout first, so the
sender's batch fails and is retried) while its step loop imports, flushes with
faults, checks every byte against the oracle and releases; its host pool is
small, so batches are refused for room and retried, and its step loop keeps
two slots awaiting the next states of its rank (``expect_import``: they land in
place when the batch is all expected and settled, else in staging). In the three-rank run the
second decode rank exits at a clean point halfway and a new process (not in the
group's world: it joins through the store) takes its rank and receives the
rest. Each process writes what it saw to ``out/<name>.json``; the test adds it
up: every state delivered exactly once, to the rank it was exported to when the
manager routes (``export(..., to=)``), with its exact bytes; no thread past its
deadline (no hang).
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import mambacache as mc

from ..support.soak import Deadline, faulted_flush, import_each, write_stats

TIMEOUT = 1.0
# MAMBACACHE_SOAK_SCALE=k: a run k times as long (k times the states per decode rank,
# tests/handoff/transfer/test_transfer_soak.py).
SCALE = int(os.environ.get("MAMBACACHE_SOAK_SCALE", "1"))
DEADLINE = 150.0 * SCALE  # seconds: a thread still running after this is a hang
N, PREFILL_HOST, DECODE_HOST = 10, 8, 3


def spec() -> mc.StateSpec:
    return mc.StateSpec(
        num_layers=2, conv_shapes=[(4, 3)], temporal_shape=(3, 5), extra_shapes={"scale": ((), torch.bfloat16)}
    )


def oracle(rid: str, pool: mc.StatePool) -> list[torch.Tensor]:
    """Request ``rid``'s state, one ``[layers, *state]`` tensor per pool tensor: the same in every process."""
    g = torch.Generator().manual_seed(zlib.crc32(rid.encode()))
    return [torch.randn(t[:, 0].shape, generator=g).to(t.dtype) for t in pool.tensors]


def _store(port: int | None) -> Any:
    from mambacache._handoff._link import root_store

    if port is None:
        return root_store(dist.distributed_c10d._get_default_store())
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


# -- the prefill engine -------------------------------------------------------------------------------------
def prefill(peers: list[int], per_peer: int, out: str, seed: int, joiner: bool) -> None:
    rng, deadline = random.Random(seed), Deadline(DEADLINE)
    pool = mc.StatePool(spec(), N)
    start = time.monotonic()
    with mc.CacheManager(pool, host_pool=mc.HostPool(spec(), PREFILL_HOST)) as mgr:
        xfers = {p: mc.StateTransfer(mgr, dist.group.WORLD, peer=p, timeout=TIMEOUT) for p in peers}
        lock = threading.Lock()  # the step loop's manager calls vs. the senders' bookkeeping below
        stats: dict[str, Any] = {"batches": 0, "states": 0, "failed_sends": 0, "refusals": 0, "delivered": {}}
        done = threading.Event()

        def sender(p: int) -> None:
            while True:
                deadline.check(f"sender to {p}")
                try:
                    ids = xfers[p].send()
                except mc.TransferRefusedError:
                    with lock:
                        stats["refusals"] += 1
                    time.sleep(0.05)
                    continue
                except mc.TransferError:
                    with lock:
                        stats["failed_sends"] += 1
                    time.sleep(0.01)
                    continue
                if ids:
                    with lock:
                        stats["batches"] += 1
                        stats["states"] += len(ids)
                        for r in ids:
                            assert r not in stats["delivered"], f"{r} delivered twice"
                            stats["delivered"][r] = p
                elif done.is_set():
                    return
                else:
                    time.sleep(0.01)

        threads = [threading.Thread(target=sender, args=(p,), daemon=True) for p in peers]
        for t in threads:
            t.start()
        todo = [(f"r{p}-{i}", p) for i in range(per_peer) for p in peers]
        exported: dict[str, int] = {}
        store, extra = _store(None), 0
        while todo or mgr.held() or (joiner and not store.check(["soak/joiner-ok"])):
            deadline.check("the prefill step loop")
            if joiner and not todo and not store.check(["soak/joiner-ok"]) and len(mgr.held()) < 2:
                todo.append((f"r{peers[-1]}-x{extra}", peers[-1]))  # more work until the joined engine got some
                extra += 1
            host = mgr.host_pool
            assert host is not None
            if todo and pool.num_free and host.num_free:
                rid, p = todo.pop(0)
                (slot,) = mgr.alloc(1, rid, clear=False)
                faulted_flush(mgr, rng)
                for t, want in zip(pool.tensors, oracle(rid, pool), strict=True):
                    t[:, slot] = want  # the forward over the prompt
                mgr.export(slot, rid, to=p, in_place=rng.random() < 0.5)
                exported[rid] = p
            faulted_flush(mgr, rng)
            time.sleep(0.01)
        done.set()
        for t in threads:
            t.join(DEADLINE)
            assert not t.is_alive(), "a sender hung"
        mgr.check_idle(host=True)
    stats["exported"] = exported
    stats["wall_s"] = time.monotonic() - start
    write_stats(out, "prefill", stats)


# -- a decode engine ----------------------------------------------------------------------------------------
def decode(rank: int, out: str, seed: int, *, store_port: int | None = None, stop_after: int = 0) -> None:
    """Receive and import until the prefill side says it is done; ``stop_after``: exit at a clean point after
    that many states (a killed engine); ``store_port``: join through the store (not in the group's world)."""
    rng, wire_rng, deadline = random.Random(seed), random.Random(seed + 1), Deadline(DEADLINE)
    pool = mc.StatePool(spec(), N)
    store = _store(store_port)
    name = f"decode{rank}" + ("-joined" if store_port else "")
    stats: dict[str, Any] = {"verified": [], "failed_receives": 0, "delays": 0, "rank": rank}
    stats.update(expected=0, in_place=0)
    with mc.CacheManager(pool, host_pool=mc.HostPool(spec(), DECODE_HOST)) as mgr:
        if store_port is None:
            xfer = mc.StateTransfer(mgr, dist.group.WORLD, peer=0, timeout=TIMEOUT)
        else:
            xfer = mc.StateTransfer(mgr, None, peer=0, timeout=TIMEOUT, store=store, rank=rank)
        arrived: queue.Queue[str] = queue.Queue()
        quit_ = threading.Event()

        def receiver() -> None:
            while not quit_.is_set():
                deadline.check(f"receiver {name}")
                if wire_rng.random() < 0.05:
                    stats["delays"] += 1
                    time.sleep(1.5 * TIMEOUT)  # delayed past the sender's timeout
                try:
                    ids = xfer.receive()
                except mc.TransferError:
                    stats["failed_receives"] += 1
                    if store.check(["soak/done"]):
                        return
                    continue
                for r in ids:
                    arrived.put(r)

        def check(rid: str, slot: int) -> None:
            for got, want in zip(pool.tensors, oracle(rid, pool), strict=True):
                assert torch.equal(got[:, slot], want), f"{name}: {rid} arrived with other bytes"

        def verified(n: int) -> None:
            if store_port is not None and n == 3:
                store.set("soak/joiner-ok", "1")  # the prefill side may stop producing
            if stop_after and n >= stop_after:
                quit_.set()  # a clean point: the receiver ends after its current receive; what it got is checked

        thread = threading.Thread(target=receiver, daemon=True, name=f"the receiver of {name}")
        thread.start()
        upcoming = (f"r{rank}-{i}" for i in range(10**6))  # this rank's ids, in export order
        import_each(mgr, arrived, thread, upcoming, check, rng, deadline, stats, verified=verified)
    stats["stopped_early"] = bool(stop_after)
    write_stats(out, name, stats)


def soak_worker(index: int, port: int, decoders: int, per_peer: int, out: str) -> None:
    """Process ``index``: 0 the prefill, 1..decoders the decode ranks, decoders + 1 (three-rank run) the joiner."""
    world = decoders + 1
    if index == world:  # joins later through the store, as decode rank `decoders`
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        store.wait(["soak/killed"], timedelta(seconds=DEADLINE))
        decode(decoders, out, 1000 + index, store_port=port)
        store.add("soak/left", 1)
        if int(store.add("soak/left", 0)) >= decoders:
            store.set("soak/finished", "1")
        return
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world, timeout=timedelta(seconds=60)
    )
    store = _store(None)
    try:
        if index == 0:
            prefill(list(range(1, world)), per_peer, out, 7, decoders == 2)
            store.set("soak/done", "1")
            store.wait(["soak/finished"], timedelta(seconds=DEADLINE))  # keeps the store up for the others
        elif decoders == 2 and index == 2:
            decode(index, out, 1000 + index, stop_after=per_peer // 3)
            store.set("soak/killed", "1")
            os._exit(0)  # the engine is gone; its rank's states go to the process that joins
        else:
            decode(index, out, 1000 + index)
        if index != 0:
            store.add("soak/left", 1)
            if int(store.add("soak/left", 0)) >= decoders:
                store.set("soak/finished", "1")
    finally:
        if index == 0:
            dist.destroy_process_group()
