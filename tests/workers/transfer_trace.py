"""Runs in spawned processes, each tracing to its own file: rank 0 exports two states, rank 1 imports them.

Modes: ``ok`` (a correct hand-off: a clear after the export, a release before
the import); ``skip-import`` (the decode side allocates a slot for ``a``
instead of importing: LMCache#2863's state never loaded); ``failed-flush`` (the
flush that carries the imports fails; the engine forks from ``a``'s slot
anyway, and from ``b``'s only after the repair); ``silent-peer`` (the decode
side never receives: the send times out and the exports stay held).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

import mambacache as mc
from mambacache import tracing
from mambacache.testing import fail_at_op

from .transfer import HOST, prefill_pool, spec

SILENT_S = 0.5  # the sender's timeout when its peer never receives


MODES = ("ok", "skip-import", "failed-flush", "silent-peer")  # silent-peer last: it leaves a send unmatched


def trace_worker(rank: int, port: int, directory: str) -> None:
    """Every mode in turn, one trace file per mode and rank (``{mode}-{rank}.jsonl``): one spawn for all."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    try:
        for mode in MODES:
            if mode == "silent-peer" and rank == 1:
                time.sleep(SILENT_S * 2)  # never receives: the sender's wait must time out, not hang
                continue
            tracing.configure(Path(directory) / f"{mode}-{rank}.jsonl", level="debug")
            try:
                (_prefill if rank == 0 else _decode)(mode)
            finally:
                tracing.disable()
    finally:
        dist.destroy_process_group()


def _prefill(mode: str) -> None:
    with mc.CacheManager(prefill_pool(11), host_pool=mc.HostPool(spec(), HOST)) as mgr:
        xfer = mc.StateTransfer(mgr, dist.group.WORLD, peer=1, timeout=SILENT_S if mode == "silent-peer" else 10.0)
        a, b = mgr.alloc(2, "a")
        mgr.hand_over(b, "b")
        mgr.flush_nowait()
        mgr.export(a, "a")
        mgr.export(b, "b")
        mgr.clear(a, "a")  # after the export: a correct hand-off, never what is sent
        mgr.flush_nowait()
        if mode == "silent-peer":
            try:
                xfer.send()
            except mc.TransferError:
                return  # the sender still holds both slots: the trace ends with the exports undelivered
            raise AssertionError("a dead peer went unnoticed")
        assert xfer.send() == ["a", "b"]  # the transfer releases both slots
        mgr.flush_nowait()
        mgr.check_idle()


def _decode(mode: str) -> None:
    with mc.CacheManager(mc.StatePool(spec(), 8), host_pool=mc.HostPool(spec(), HOST)) as mgr:
        xfer = mc.StateTransfer(mgr, dist.group.WORLD, peer=0, timeout=10.0)
        (old,) = mgr.alloc(1, "old")
        mgr.flush_nowait()
        assert xfer.receive() == ["a", "b"]
        mgr.release(old, "old")  # before the import of the same slot: never wipes it
        if mode == "skip-import":
            (slot_a,) = mgr.alloc(1, "a")  # the bug: a's state never loaded
        else:
            mgr.import_into(old, "a")
            slot_a = old
        mgr.import_into(5, "b")
        if mode == "failed-flush":
            try:
                with fail_at_op(1):
                    mgr.flush_nowait()
            except mc.ExecutorError:
                pass
            else:
                raise AssertionError("the injected fault did not fail the flush")
            (fork_a,) = mgr.alloc(1, "a2", clear=False)
            mgr.copy_on_write(slot_a, fork_a, "a2")  # reads a's slot before its import landed: the bug
            mgr.flush_nowait()  # the repair: the kept imports run first
            (fork_b,) = mgr.alloc(1, "b2", clear=False)
            mgr.copy_on_write(5, fork_b, "b2")  # after the repair: correct
            mgr.flush_nowait()
            mgr.release(fork_a, "a2")
            mgr.release(fork_b, "b2")
        else:
            mgr.flush_nowait()
        mgr.release(slot_a, "a")
        mgr.release(5, "b")
        mgr.flush_nowait()
        if mode == "ok":
            mgr.check_idle()
