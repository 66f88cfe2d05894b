"""Runs in spawned processes: a peer of a transfer dies after the receiver's ``go`` and a new process takes its
rank through the store, while the other side goes on with the same ``StateTransfer``.

Process 0 hosts the store (so neither peer's death takes the control plane with it) and waits for the others;
process 1 is the prefill engine (rank 1), process 2 the decode engine (rank 2), process 3 the engine that joins
in place of the one that dies (a new process: over NIXL a new agent, over Mooncake a new segment, over gloo a new
pair token). ``mode`` says which dies:

* ``"sender"``: the prefill engine dies once the decode side answered ``go`` for its batch, before a byte was
  read or sent; the decode side's receive is a typed :class:`~mambacache.TransferError` with nothing landed, and
  its next receives take the joined engine's batch, bytes exact.
* ``"receiver"``: the decode engine dies once it answered ``go``; the prefill side's send is a
  :class:`~mambacache.TransferError` with its slots kept (the batch in doubt), and its next sends deliver the
  batch to the joined decode engine, which lands it once, bytes exact.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import mambacache as mc

from ..support.util import small_spec

TIMEOUT = 3.0
DEADLINE = 60.0  # seconds for any wait of a process on another: past it, the test fails instead of hanging
SPEC = small_spec(2)
SENDER, RECEIVER = 1, 2


def _client(port: int) -> Any:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=DEADLINE))


def _mgr() -> mc.CacheManager:
    return mc.CacheManager(mc.StatePool(SPEC, 4), host_pool=mc.HostPool(SPEC, 2))


def _transfer(mgr: mc.CacheManager, port: int, rank: int) -> mc.StateTransfer:
    peer = RECEIVER if rank == SENDER else SENDER
    return mc.StateTransfer(mgr, None, peer=peer, store=_client(port), rank=rank, timeout=TIMEOUT)


def _until(call: Any, what: str) -> Any:
    """``call()`` again after each TransferError (a receive with no batch yet, a send the new peer does not take
    yet) until it succeeds, within :data:`DEADLINE`."""
    end = time.monotonic() + DEADLINE
    while True:
        try:
            return call()
        except mc.TransferError:
            if time.monotonic() > end:
                raise AssertionError(f"{what}: no success within {DEADLINE:g}s") from None


def _dies_after_go(xfer: mc.StateTransfer, store: Any) -> None:
    """Make this receiving side die as its bytes would be read (after its ``go``), as an engine killed there."""
    inbox = xfer._in  # type: ignore[attr-defined]

    def die(*args: Any) -> None:
        store.set("peer/dead", "1")
        os._exit(0)

    inbox.wire.pull = die


def _reads_after_death(xfer: mc.StateTransfer, store: Any) -> None:
    """Make this receiving side read its first batch's bytes only once the sender has died."""
    wire = xfer._in.wire  # type: ignore[attr-defined]
    real = wire.pull

    def late(*args: Any) -> None:
        wire.pull = real
        store.wait(["peer/dead"], timedelta(seconds=DEADLINE))
        time.sleep(1.0)  # its process is gone by now: sockets closed, nothing left to read from
        real(*args)

    wire.pull = late


def _export(mgr: mc.CacheManager, rid: str, value: float) -> None:
    (slot,) = mgr.alloc(1, rid, clear=False)
    mgr.flush_nowait()
    for t in mgr.pool.tensors:
        t[:, slot] = value
    mgr.export(slot, rid)
    mgr.flush_nowait()


def _imports(mgr: mc.CacheManager, rid: str, value: float) -> None:
    (slot,) = mgr.alloc(1)
    mgr.release(slot)
    mgr.flush_nowait()
    mgr.import_into(slot, request_id=rid)
    mgr.flush_nowait()
    for t in mgr.pool.tensors:
        assert t[:, slot].eq(value).all(), f"{rid} arrived with other bytes"
    mgr.release(slot, rid)
    mgr.flush_nowait()
    mgr.check_idle(host=True)


def _sender_dies(port: int) -> None:
    store = _client(port)
    with _mgr() as mgr:
        xfer = _transfer(mgr, port, SENDER)
        _export(mgr, "a", 7.0)
        threading.Thread(target=xfer.send, daemon=True).start()
        direction = dist.PrefixStore(f"mambacache/xfer/{SENDER}>{RECEIVER}/", store)
        direction.wait(["state/1"], timedelta(seconds=DEADLINE))  # the receiver's go
        store.set("peer/dead", "1")
        os._exit(0)


def _receiver_of_the_dead(port: int) -> None:
    store = _client(port)
    with _mgr() as mgr:
        xfer = _transfer(mgr, port, RECEIVER)
        _reads_after_death(xfer, store)
        try:
            xfer.receive()
        except mc.TransferError as exc:
            assert not isinstance(exc, mc.TransferRefusedError), repr(exc)
            # The wire's own error (its bytes failed), not a stray one of the transport's package caught above it.
            assert exc.request_ids == ["a"] and "bytes" in str(exc), repr(exc)
        else:
            raise AssertionError("a batch whose sender died before its bytes moved was received")
        assert mgr.host_pool is not None and mgr.host_pool.num_held == 0, "a landing was left behind"
        store.set("peer/noticed", "1")
        assert _until(xfer.receive, "the joined sender's batch") == ["b"]
        _imports(mgr, "b", 9.0)


def _joined_sender(port: int) -> None:
    store = _client(port)
    store.wait(["peer/noticed"], timedelta(seconds=DEADLINE))
    with _mgr() as mgr:
        xfer = _transfer(mgr, port, SENDER)
        _export(mgr, "b", 9.0)
        assert _until(xfer.send, "the joined sender's send") == ["b"]
        mgr.check_idle(host=True)


def _sender_to_the_dead(port: int) -> None:
    store = _client(port)
    with _mgr() as mgr:
        xfer = _transfer(mgr, port, SENDER)
        _export(mgr, "a", 7.0)
        try:
            xfer.send()
        except mc.TransferError as exc:
            assert not isinstance(exc, mc.TransferRefusedError), repr(exc)
            assert exc.request_ids == ["a"], repr(exc)
        else:
            raise AssertionError("a batch whose receiver died after its go was delivered")
        assert len(mgr.held()) == 1, "the slot of a batch never acknowledged was released"
        store.set("peer/noticed", "1")
        assert _until(xfer.send, "the send to the joined receiver") == ["a"]
        assert mgr.held() == {}
        mgr.check_idle(host=True)


def _receiver_dies(port: int) -> None:
    store = _client(port)
    with _mgr() as mgr:
        xfer = _transfer(mgr, port, RECEIVER)
        _dies_after_go(xfer, store)
        xfer.receive()
        raise AssertionError("the receiver lived on")


def _joined_receiver(port: int) -> None:
    store = _client(port)
    store.wait(["peer/noticed"], timedelta(seconds=DEADLINE))
    with _mgr() as mgr:
        xfer = _transfer(mgr, port, RECEIVER)
        assert _until(xfer.receive, "the batch in doubt at the joined receiver") == ["a"]
        _imports(mgr, "a", 7.0)


ROLES = {
    "sender": {SENDER: _sender_dies, RECEIVER: _receiver_of_the_dead, 3: _joined_sender},
    "receiver": {SENDER: _sender_to_the_dead, RECEIVER: _receiver_dies, 3: _joined_receiver},
}


def peer_worker(index: int, port: int, mode: str) -> None:
    if index == 0:  # the store's host outlives both peers
        master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=DEADLINE))
        master.wait(["peer/finished"], timedelta(seconds=DEADLINE * 2))
        return
    dies = SENDER if mode == "sender" else RECEIVER
    ROLES[mode][index](port)
    if index != dies:
        store = _client(port)
        if int(store.add("peer/left", 1)) == 2:  # the survivor and the joined engine
            store.set("peer/finished", "1")
