"""Adversarial checks of the state transfer, second round: each fails on the code before its fix.

Some run the real link in one process: two ``StateTransfer`` built from
clients of one ``TCPStore`` on 127.0.0.1 (``store=``, ``rank=``), each side in
its own thread, the gloo pair between them built as between two processes.
Others replace the wire by a ``ship`` callable, as ``test_transfer_attack``.
"""

from __future__ import annotations

import threading

import mambacache as mc
from mambacache._handoff._transfer import Batches, send_exports

from .util import small_spec

SPEC = small_spec(2)


def _mgr(slots: int = 4, host: int = 2) -> mc.CacheManager:
    return mc.CacheManager(mc.StatePool(SPEC, slots), host_pool=mc.HostPool(SPEC, host))


def _export(mgr: mc.CacheManager, rid: str, value: float, *, in_place: bool = False, to: int | None = None) -> int:
    (slot,) = mgr.alloc(1, rid, clear=False)
    mgr.flush_nowait()
    for t in mgr.pool.tensors:
        t[:, slot] = value
    mgr.export(slot, rid, to=to, in_place=in_place)
    mgr.flush_nowait()
    return slot


def test_a_send_that_delivered_a_batch_before_the_manager_closed_returns_it() -> None:
    """A staged and an in-place export go in two batches. The manager closes (another thread leaves its ``with``)
    while the first is on the wire: its delivery is still taken (the slots freed), but the send then asked for
    the next batch and raised ManagerClosedError, so the caller heard that nothing went although the peer holds
    ``a``. A send in flight at the close is no failure: it returns what it delivered."""
    mgr = _mgr()
    mgr.__enter__()
    (a,) = mgr.alloc(1, "a", clear=False)
    (b,) = mgr.alloc(1, "b", clear=False)
    mgr.flush_nowait()
    mgr.export(a, "a")
    mgr.export(b, "b", in_place=True)
    mgr.flush_nowait()
    shipped: list[list[str]] = []

    def ship(batch: list[mc.Export], ids: list[str], seq: int) -> None:
        shipped.append(ids)
        if len(shipped) == 1:  # the engine shuts down while this batch awaits its ack
            closing = threading.Thread(target=mgr.__exit__, args=(None, None, None))
            closing.start()
            closing.join(10)

    assert send_exports(mgr, ship, [1], Batches()) == ["a"], "a delivered batch was reported as a failure"
    assert shipped == [["a"]]
    assert a not in mgr.pool.allocated_slots(), "the delivered export's slot was kept"
