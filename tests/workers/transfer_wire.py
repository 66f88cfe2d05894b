"""Runs in spawned processes: attacks on the wire of a state transfer (issue #32), rank 0 sending, rank 1 receiving.

Each case is a pair of functions (sender, receiver) over two real gloo
processes on 127.0.0.1; the ranks meet at barriers of the world group (which
the transfer does not use). A receiver's threads are real threads. Every case
ends with every state delivered exactly once, checked byte for byte, and both
sides idle (``tests/workers/transfer_link.py`` holds the shared checks).
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import mambacache as mc
from mambacache._handoff._link import Inbox, root_store

from .transfer import HOST, N
from .transfer_link import Side, _fails


class Waits:
    """Sets ``begun`` when the receiving side of the link starts to wait for a header (``Inbox.wait_key`` patched
    in this process only, for one case)."""

    def __init__(self) -> None:
        self.begun = threading.Event()
        self._real = Inbox.wait_key

    def __enter__(self) -> Waits:
        real, begun = self._real, self.begun

        def wait_key(inbox: Inbox, key: str, seconds: float) -> bytes | None:
            if key.startswith("hdr/"):
                begun.set()
            return real(inbox, key, seconds)

        Inbox.wait_key = wait_key  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Inbox.wait_key = self._real  # type: ignore[method-assign]


FIRST = [f"f{k}" for k in range(HOST)]


def room_freed_sender(me: Side) -> None:
    me.stage(FIRST, list(range(1, HOST + 1)), 40)
    assert me.xfer.send() == FIRST  # the receiver keeps them: no host slot left there
    ids = me.stage(["late1", "late2"], [1, 2], 41)
    dist.barrier()  # the receiver's step loop imported them all while its receive waited for this header
    assert me.xfer.send() == ids, "refused for the room the receiver had when it began to wait"
    me.idle()


def room_freed_receiver(me: Side) -> None:
    """A receive that begins to wait with a full host pool, while the step loop imports (frees) it all, judges the
    header that arrives by the room there is when it arrives. It judged it by the room when the wait began (0),
    refused the batch, and told the sender it had room for none."""
    assert me.xfer.receive() == FIRST
    got: list[Any] = []

    def receive() -> None:
        try:
            got.append(me.xfer.receive())
        except BaseException as exc:  # handed to the main thread's assertion
            got.append(exc)

    with Waits() as waits:
        thread = threading.Thread(target=receive)
        thread.start()
        assert waits.begun.wait(10)  # the receive waits for a header
        me.imports(FIRST, list(range(1, HOST + 1)), list(range(1, HOST + 1)), 40, "the batch before")
        assert me.mgr.landing_room() == HOST
        dist.barrier()
        thread.join()
    assert got == [["late1", "late2"]], got
    me.imports(["late1", "late2"], [1, 2], [1, 2], 41, "the batch judged by the room when it arrived")
    me.idle()


def _direction(src: int, dst: int) -> Any:
    """A plain client's view of direction ``src > dst`` in the store, as another process on that rank has it."""
    return dist.distributed_c10d.PrefixStore(
        f"mambacache/xfer/{src}>{dst}/", root_store(dist.distributed_c10d._get_default_store())
    )


def _until(call: Callable[[], list[str]], tries: int = 4) -> list[str]:
    """``call`` until it returns without a TransferError (a failed try costs one timeout), at most ``tries``."""
    for _ in range(tries - 1):
        try:
            return call()
        except mc.TransferError:
            pass
    return call()


def unwritten_sender(me: Side) -> None:
    _direction(0, 1).add("posted", 1)  # what a sender on this rank that died between its two writes leaves
    dist.barrier()
    ids = me.stage(["u1", "u2"], [1, 2], 42)
    assert _until(me.xfer.send) == ids, "after a header number that was never written"
    me.idle()


def unwritten_receiver(me: Side) -> None:
    """A sender dies after taking a header number (``posted``) and before writing the header; a new one takes the
    rank. The receiver waited for that header forever ("no batch" on every receive) and never took another."""
    dist.barrier()
    assert _until(me.xfer.receive) == ["u1", "u2"], "a header number never written stopped the direction"
    me.imports(["u1", "u2"], [4, 5], [1, 2], 42, "after a header number never written")
    me.idle()


def uncounted_sender(me: Side) -> None:
    ids = me.stage(["c1"], [3], 43)
    exc = _fails(me.xfer.send, "a receiver that refused and died", "room")
    assert exc.request_ids == ids, repr(exc)
    dist.barrier()
    assert _until(me.xfer.send) == ids, "after a header settled by a receiver that died before counting it"
    me.idle()


def uncounted_receiver(me: Side) -> None:
    """A receiver dies after writing its decision (or acknowledgement) and before counting the header
    (``taken``); its sender reads the decision and deletes the header. The next receiver on the rank waited for
    that header forever and never took another."""
    store = _direction(0, 1)
    store.wait(["hdr/1"], timedelta(seconds=10))
    assert store.compare_set("state/1", "", "refuse:room:0:dead") == b"refuse:room:0:dead"  # then dies
    dist.barrier()
    assert _until(me.xfer.receive) == ["c1"], "a header settled and never counted stopped the direction"
    me.imports(["c1"], [4], [3], 43, "after a header settled and never counted")
    me.idle()


def withdrawn_sender(me: Side) -> None:
    ids = me.stage(["w1"], [1], 44)
    done = root_store(dist.distributed_c10d._get_default_store())
    for _ in range(12):  # a sender that retries at once, as a send loop does, until the receiver gave up
        if done.check(["wire/received"]):
            break
        _fails(me.xfer.send, "a receiver whose landing outlasts this side's wait for its decision")
    dist.barrier()
    assert me.xfer.send() == ids, "the retry once the receiver lands in time"
    me.idle()


def withdrawn_receiver(me: Side) -> None:
    """A receive whose landing takes longer than its sender's wait for a decision (slots taken, ``go`` not written
    yet), while its sender retries at once: every header is withdrawn before the ``go``, and the receive went on to
    the next header, again and again, past its timeout for as long as the sender retried (a hang). It fails once
    its timeout is spent, with nothing landed."""
    me.mgr.before = 1.5 * me.xfer._in.timeout  # type: ignore[attr-defined]
    try:
        _fails(me.xfer.receive, "a receive whose every header is withdrawn before its go")
    finally:
        me.mgr.before = 0.0
        root_store(dist.distributed_c10d._get_default_store()).set("wire/received", "1")
    host = me.mgr.host_pool
    assert host is not None and host.num_held == 0, "a withdrawn batch kept its landing slots"
    dist.barrier()
    assert _until(me.xfer.receive) == ["w1"]
    me.imports(["w1"], [4], [1], 44, "after batches withdrawn before their go")
    me.idle()


# (split, where the landing fails): both wire layouts (the split batch lands straight into one run of slots)
FAILS = [(split, where) for split in (True, False) for where in ("before", "after")]


def failing_landing_sender(me: Side) -> None:
    import mambacache._handoff._transfer as xfer_mod

    real = xfer_mod.SPLIT_BYTES
    try:
        for k, (split, where) in enumerate(FAILS):
            xfer_mod.SPLIT_BYTES = 0 if split else 2**62
            ids = me.stage([f"l{k}a", f"l{k}b"], [1, 2], 45 + k)
            dist.barrier()
            exc = _fails(me.xfer.send, f"a landing that fails {where} (split {split})", "failed")
            assert exc.request_ids == ids, repr(exc)
            me.holds(ids, f"a batch whose landing failed {where} was delivered")
            dist.barrier()
            assert me.xfer.send() == ids, f"the retry after a landing that failed {where} (split {split})"
            me.idle()
    finally:
        xfer_mod.SPLIT_BYTES = real


def failing_landing_receiver(me: Side) -> None:
    """A landing that fails before its ``go`` (the batch's slots taken) or after its bytes arrived (straight into
    its slots, or through the buffers): the slots are freed, nothing arrived, the sender is told so (not in
    doubt), and the retry lands once, byte for byte."""
    host = me.mgr.host_pool
    assert host is not None
    for k, (split, where) in enumerate(FAILS):
        me.mgr.fail = where
        dist.barrier()
        try:
            me.xfer.receive()
        except (MemoryError, mc.TransferError):  # the landing's own error (or one typed as the transfer's)
            pass
        else:
            raise AssertionError(f"a landing that failed {where} (split {split}) returned")
        finally:
            me.mgr.fail = ""
        assert host.num_held == 0, f"a landing that failed {where} (split {split}) kept its slots"
        me.idle()
        dist.barrier()
        ids = [f"l{k}a", f"l{k}b"]
        assert me.xfer.receive() == ids
        me.imports(ids, [4, 5], [1, 2], 45 + k, f"the retry after a landing that failed {where} (split {split})")
        me.idle()


RANDOM_STATES = 40
RANDOM_FAULTS = ["none", "none", "none", "before", "after", "slow go", "late ack", "late receiver"]


def _oracle(rid: str, pool: mc.StatePool) -> list[torch.Tensor]:
    """Request ``rid``'s state, one ``[layers, *state]`` tensor per pool tensor: the same in both processes."""
    g = torch.Generator().manual_seed(zlib.crc32(rid.encode()))
    return [torch.randn(t[:, 0].shape, generator=g).to(t.dtype) for t in pool.tensors]


def random_sender(me: Side) -> None:
    """The sender's step loop exports states one by one (staging slots in and out of one run) while a thread
    sends, each batch split or not at random, retrying every failure at once."""
    import mambacache._handoff._transfer as xfer_mod

    rng, exported, delivered = random.Random(7), [], []
    real = xfer_mod.SPLIT_BYTES

    def send_loop() -> None:
        while len(delivered) < RANDOM_STATES:
            xfer_mod.SPLIT_BYTES = 0 if rng.random() < 0.6 else 2**62
            with contextlib.suppress(mc.TransferError):  # every failure retried at once
                delivered.extend(me.xfer.send())
            time.sleep(rng.random() * 0.02)

    thread = threading.Thread(target=send_loop)
    thread.start()
    try:
        end = time.monotonic() + 60
        for k in range(RANDOM_STATES):
            while len(me.mgr.held()) >= HOST:  # every staging slot taken: wait for deliveries
                assert time.monotonic() < end, "the sender's exports were never delivered (a hang)"
                me.mgr.flush_nowait()
                time.sleep(0.01)
            rid = f"r{k}"
            (slot,) = me.mgr.alloc(1, rid, clear=False)
            me.mgr.flush_nowait()
            for t, want in zip(me.pool.tensors, _oracle(rid, me.pool), strict=True):
                t[:, slot] = want
            me.mgr.export(slot, rid)
            exported.append(rid)
            me.mgr.flush_nowait()
        thread.join(60)
        assert not thread.is_alive(), "the send loop hung"
    finally:
        xfer_mod.SPLIT_BYTES = real
    assert sorted(delivered) == sorted(exported), "a state was delivered twice or never"
    me.mgr.flush_nowait()
    me.idle()


def random_receiver(me: Side) -> None:
    """A receive thread whose landing fails before its go or after its bytes, outlasts the sender's wait for a
    decision (withdrawn) or for the acknowledgement (in doubt: the retry is acknowledged, not landed again), or
    comes late, at random, while the step loop imports each state that arrived and checks its bytes: every state
    arrives exactly once, none is lost, no call outlasts its timeouts (found the withdrawn-header hang)."""
    rng, timeout = random.Random(8), me.xfer._in.timeout  # type: ignore[attr-defined]
    arrived: queue.Queue[str] = queue.Queue()
    seen: list[str] = []

    def receive_loop() -> None:
        while len(seen) < RANDOM_STATES:
            fault = rng.choice(RANDOM_FAULTS)
            me.mgr.fail = {"before": "before", "after": "after"}.get(fault, "")
            me.mgr.before = timeout * rng.uniform(0.9, 1.1) if fault == "slow go" else 0.0
            me.mgr.delay = 1.3 * timeout if fault == "late ack" else 0.0
            if fault == "late receiver":
                time.sleep(1.3 * timeout)
            start = time.monotonic()
            try:
                ids = me.xfer.receive()
            except (mc.TransferError, MemoryError):
                ids = []
            finally:
                me.mgr.fail, me.mgr.before, me.mgr.delay = "", 0.0, 0.0
            assert time.monotonic() - start < 4 * timeout + 2, f"a receive ({fault}) outlasted its timeouts"
            seen.extend(ids)
            for rid in ids:
                arrived.put(rid)

    thread = threading.Thread(target=receive_loop)
    thread.start()
    end = time.monotonic() + 60
    done = 0
    while done < RANDOM_STATES:
        assert time.monotonic() < end and (thread.is_alive() or not arrived.empty()), "states never arrived"
        try:
            rid = arrived.get(timeout=0.05)
        except queue.Empty:
            continue
        slot = next(s for s in range(1, N + 1) if s not in me.mgr.held())
        me.mgr.import_into(slot, rid)
        me.mgr.flush_nowait()
        for got, want in zip(me.pool.tensors, _oracle(rid, me.pool), strict=True):
            assert torch.equal(got[:, slot], want), f"{rid} arrived with other bytes"
        me.mgr.release(slot, rid)
        me.mgr.flush_nowait()
        done += 1
    thread.join(60)
    assert not thread.is_alive(), "the receive loop hung"
    assert sorted(seen) == sorted(f"r{k}" for k in range(RANDOM_STATES)), "a state arrived twice or never"
    me.idle()


# name: (sender, receiver, the transfers' timeout)
CASES = {
    # long enough for the receiver's step loop to free its host pool inside the receive's wait
    "room freed while the receiver waits": (room_freed_sender, room_freed_receiver, 5.0),
    "a header number its sender never wrote": (unwritten_sender, unwritten_receiver, 1.0),
    "a header settled and never counted": (uncounted_sender, uncounted_receiver, 1.0),
    "every header withdrawn before its go": (withdrawn_sender, withdrawn_receiver, 1.0),
    "a landing that fails before its go or after its bytes": (failing_landing_sender, failing_landing_receiver, 2.0),
    "random landing faults": (random_sender, random_receiver, 0.5),
}


def wire_worker(rank: int, port: int, case: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    try:
        sender, receiver, timeout = CASES[case]
        me = Side(rank, timeout=timeout)
        with me.mgr:
            dist.barrier()
            try:
                (sender, receiver)[rank](me)
            except AssertionError as exc:
                raise AssertionError(f"{case} (rank {rank}): {exc}") from exc
    finally:
        dist.destroy_process_group()
