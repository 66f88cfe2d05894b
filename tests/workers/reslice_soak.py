"""Runs in spawned processes: a soak of the transfer between tensor-parallel sizes (``_handoff/_reslice.py``).

Two runs of three processes over gloo on 127.0.0.1:

* ``1to2``: rank 0 a prefill engine at TP 1 (whole states) with a
  :class:`ReslicingSender` to ranks 1 and 2, one decode engine at TP 2 (each rank
  a plain ``StateTransfer`` into a manager of the shard's spec);
* ``2to1``: ranks 0 and 1 a prefill engine at TP 2 (each a plain ``StateTransfer``
  of its shard), rank 2 a decode engine at TP 1 (a :class:`ReslicingReceiver`
  joining both shards).

Each prefill rank's step loop writes each request's state from the oracle
(bytes drawn from the request id over the whole model's state, cut to the
rank's shard where it holds one), exports it (half in place, half addressed to
the first decode rank) and flushes with a fault injected at a drawn aten op
(repaired by the next flush), while a sender thread sends. The ranks of one
prefill engine export the same requests in the same order (a TP engine's steps
are collective) but flush, fail and send on their own. Each decode rank
receives in a worker thread (sometimes sleeping past the timeout first, so the
sender's batch fails and is retried; its host pool is small, so batches are
refused for room), while its step loop imports, flushes with faults, checks every
byte against the oracle's shard as the layout cuts it (TP 1: the whole state,
joined from both shards) and releases. Each process writes what it saw to
``out/<name>.json``; ``tests/handoff/transfer/test_reslice_soak.py`` adds it up.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
import zlib
from collections import Counter
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

import mambacache as mc
from mambacache._handoff._reslice import ReslicingReceiver, ReslicingSender, StateLayout

from ..support.soak import Deadline, faulted_flush, import_each, write_stats

TIMEOUT = 1.0
DEADLINE = 120.0  # seconds: a thread still running after this is a hang
N, PREFILL_HOST, DECODE_HOST = 10, 6, 3


def layout() -> StateLayout:
    """Mamba2 with one group: x and the heads split, B and C replicated, and a replicated scalar extra, so both
    directions cut and join split and replicated segments (2 -> 1 checks that the replicated copies agree)."""
    cfg = SimpleNamespace(
        model_type="mamba2", num_hidden_layers=2, num_heads=4, head_dim=2, n_groups=1, state_size=3, expand=2,
        hidden_size=4, conv_kernel=4,
    )  # fmt: skip
    spec = mc.StateSpec.from_hf_config(cfg, extra_shapes={"scale": ((), torch.bfloat16)})
    return StateLayout.from_config(cfg, spec)


def oracle(rid: str, tp: int = 1, rank: int = 0) -> list[torch.Tensor]:
    """Request ``rid``'s state, one ``[layers, *state]`` tensor per pool tensor: the whole model's (``tp`` 1) or
    rank ``rank``'s shard of it at ``tp``, the same in every process."""
    lay = layout()
    g = torch.Generator().manual_seed(zlib.crc32(rid.encode()))
    full = [torch.randn((lay.spec.num_layers, *shape), generator=g).to(dtype) for shape, dtype in lay.spec.shapes()]
    return full if tp == 1 else lay.slice(full, tp, rank, dim=1)


def _raw(t: torch.Tensor) -> torch.Tensor:
    # Bytes, not values: the wire and the gather compare bytes (-0.0 is not 0.0 there).
    return t.contiguous().view(torch.uint8)


def _store() -> Any:
    from mambacache._handoff._link import root_store

    return root_store(dist.distributed_c10d._get_default_store())


def _debug(text: str) -> None:
    """A line per send outcome with ``SOAK_DEBUG`` set (``pytest -s``): how the soak's hang was traced."""
    if os.environ.get("SOAK_DEBUG"):
        print(f"{time.monotonic():.2f} {text}", flush=True)


# -- a prefill rank -----------------------------------------------------------------------------------------
def prefill(rank: int, tp: int, xfer: Any, mgr: mc.CacheManager, count: int, out: str, to: int, seed: int) -> None:
    """Rank ``rank`` of a prefill engine at ``tp``: the oracle's state (its shard) of ``count`` requests, exported
    and sent by ``xfer`` (a StateTransfer or a ReslicingSender) in a thread; ``to``: the first decode rank."""
    rng, deadline = random.Random(seed * 1000 + 7 + rank), Deadline(DEADLINE)
    pool = mgr.pool
    lock = threading.Lock()  # the sender thread's counts vs. the step loop's
    stats: dict[str, Any] = {"batches": 0, "states": 0, "failed_sends": 0, "delivered": [], "rank": rank}
    refusals: Counter[str] = Counter()
    done = threading.Event()

    def sender() -> None:
        while True:
            deadline.check(f"the sender of prefill rank {rank}")
            try:
                ids = xfer.send()
            except mc.TransferRefusedError as exc:
                _debug(f"P{rank} refused {exc.reason} {exc.request_ids} {exc}")
                with lock:
                    refusals[str(exc.reason)] += 1
                time.sleep(0.02)
                continue
            except mc.TransferError as exc:
                _debug(f"P{rank} failed {exc.request_ids} {exc}")
                with lock:
                    stats["failed_sends"] += 1
                time.sleep(0.01)
                continue
            if ids:
                _debug(f"P{rank} sent {ids}")
                with lock:
                    stats["batches"] += 1
                    stats["states"] += len(ids)
                    stats["delivered"] += ids
            elif done.is_set():
                return
            else:
                time.sleep(0.01)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    todo = [f"r-{i}" for i in range(count)]  # every rank of the engine: the same requests in the same order
    exported: list[str] = []
    while todo or mgr.held():
        deadline.check(f"the step loop of prefill rank {rank}")
        host = mgr.host_pool
        assert host is not None
        if todo and pool.num_free and host.num_free:
            rid = todo.pop(0)
            (slot,) = mgr.alloc(1, rid, clear=False)
            faulted_flush(mgr, rng)
            for t, want in zip(pool.tensors, oracle(rid, tp, rank), strict=True):
                t[:, slot] = want  # the forward over the prompt (this rank's shard of it)
            # Addressed to the first decode rank or to no one (a re-slicing sender takes both), in place or
            # staged: the engine's choice, so every rank of it makes the same one (drawn from the id). A rank's
            # batch holds exports of one kind only, so ranks that chose apart would never send one batch.
            engine = random.Random(zlib.crc32(rid.encode()))
            mgr.export(slot, rid, to=to if engine.random() < 0.5 else None, in_place=engine.random() < 0.5)
            exported.append(rid)
        faulted_flush(mgr, rng)
        time.sleep(0.005)
    done.set()
    thread.join(DEADLINE)
    assert not thread.is_alive(), f"the sender of prefill rank {rank} hung"
    mgr.check_idle(host=True)
    stats["exported"] = exported
    stats["refusals"] = dict(refusals)
    write_stats(out, f"prefill{rank}", stats)


# -- a decode rank ------------------------------------------------------------------------------------------
def decode(
    rank: int,
    tp: int,
    shard: int,
    receive: Any,
    mgr: mc.CacheManager,
    out: str,
    prefill_ranks: int,
    expect: bool,
    seed: int,
) -> None:
    """Rank ``rank`` of a decode engine at ``tp`` (holding shard ``shard``): ``receive()`` in a worker thread (a
    StateTransfer's or a ReslicingReceiver's) until every prefill rank is done; the step loop imports, checks
    each byte against the oracle and releases. ``expect``: keep two slots awaiting the next states
    (``expect_import``: a plain transfer lands in them in place, a re-slicing receiver in staging)."""
    rng, wire_rng = random.Random(seed * 1000 + 100 + rank), random.Random(seed * 1000 + 200 + rank)
    deadline = Deadline(DEADLINE)
    pool, store = mgr.pool, _store()
    stats: dict[str, Any] = {"verified": [], "failed_receives": 0, "delays": 0, "rank": rank}
    stats.update(expected=0, in_place=0)
    refusals: Counter[str] = Counter()
    arrived: queue.Queue[str] = queue.Queue()

    def finished() -> bool:
        return int(store.add("soak/done", 0)) >= prefill_ranks

    def receiver() -> None:
        while True:
            deadline.check(f"the receiver of decode rank {rank}")
            if wire_rng.random() < 0.05:
                stats["delays"] += 1
                time.sleep(1.5 * TIMEOUT)  # delayed past the sender's timeout
            try:
                ids = receive()
            except mc.TransferRefusedError as exc:
                refusals[str(exc.reason)] += 1
                continue
            except mc.TransferError as exc:
                if "not one batch" in str(exc):
                    refusals["not one batch"] += 1
                else:
                    stats["failed_receives"] += 1
                if finished():
                    return
                continue
            for r in ids:
                arrived.put(r)

    def check(rid: str, slot: int) -> None:
        for got, want in zip(pool.tensors, oracle(rid, tp, shard), strict=True):
            assert torch.equal(_raw(got[:, slot]), _raw(want)), f"decode rank {rank}: {rid} arrived with other bytes"

    thread = threading.Thread(target=receiver, daemon=True, name=f"the receiver of decode rank {rank}")
    thread.start()
    upcoming = (f"r-{i}" for i in range(10**6))  # the ids in export order
    import_each(mgr, arrived, thread, upcoming, check, rng, deadline, stats, expect=expect)
    stats["refusals"] = dict(refusals)
    write_stats(out, f"decode{rank}", stats)


# -- the processes ------------------------------------------------------------------------------------------
def _run(rank: int, mode: str, count: int, out: str, seed: int) -> None:
    lay, world = layout(), dist.group.WORLD
    if mode == "1to2":
        if rank == 0:
            with mc.CacheManager(mc.StatePool(lay.spec, N), host_pool=mc.HostPool(lay.spec, PREFILL_HOST)) as mgr:
                sender = ReslicingSender(mgr, world, [1, 2], lay, timeout=TIMEOUT)
                prefill(0, 1, sender, mgr, count, out, to=1, seed=seed)
            return
        spec = lay.shard_spec(2)
        with mc.CacheManager(mc.StatePool(spec, N), host_pool=mc.HostPool(spec, DECODE_HOST)) as mgr:
            xfer = mc.StateTransfer(mgr, world, peer=0, timeout=TIMEOUT)
            decode(rank, 2, rank - 1, xfer.receive, mgr, out, 1, expect=True, seed=seed)
        return
    if rank < 2:
        spec = lay.shard_spec(2)
        with mc.CacheManager(mc.StatePool(spec, N), host_pool=mc.HostPool(spec, PREFILL_HOST)) as mgr:
            xfer = mc.StateTransfer(mgr, world, peer=2, timeout=TIMEOUT)
            prefill(rank, 2, xfer, mgr, count, out, to=2, seed=seed)
        return
    with mc.CacheManager(mc.StatePool(lay.spec, N), host_pool=mc.HostPool(lay.spec, DECODE_HOST)) as mgr:
        xfers = [mc.StateTransfer(mgr, world, peer=k, timeout=TIMEOUT) for k in (0, 1)]
        receiver = ReslicingReceiver(mgr, xfers, lay)
        decode(2, 1, 0, receiver.receive, mgr, out, 2, expect=True, seed=seed)


def reslice_soak_worker(rank: int, port: int, mode: str, count: int, out: str, seed: int) -> None:
    """Process ``rank`` of three; ``mode`` ``1to2`` (rank 0 prefills) or ``2to1`` (ranks 0 and 1 prefill)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3, timeout=timedelta(seconds=60)
    )
    store = _store()
    try:
        _run(rank, mode, count, out, seed)
        prefilling = rank == 0 or (mode == "2to1" and rank == 1)
        store.add("soak/done" if prefilling else "soak/left", 1)
        if rank == 0:  # it holds the store: kept up until every other process is through with it
            left = 2 if mode == "1to2" else 1
            end = time.monotonic() + DEADLINE
            while int(store.add("soak/left", 0)) < left or (mode == "2to1" and int(store.add("soak/done", 0)) < 2):
                assert time.monotonic() < end, "a process never finished"
                time.sleep(0.05)
    finally:
        dist.destroy_process_group()
