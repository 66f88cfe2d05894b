"""Runs in spawned processes: a link that recovers (issue #32, defects 5 and 6), rank 0 sending, rank 1 receiving.

Each case fails a batch one way (a receiver later than the sender's timeout,
one idle past its own, a batch refused for room, an acknowledgement that comes
too late, a receiver of another spec, headers that are impossible or lie), then
retries it on the same ``StateTransfer`` and checks every byte of what landed,
that it landed once, and that the sender holds nothing after the ack. The two
ranks meet at a barrier of the world group (which the transfer does not use)
between the steps of a case.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import mambacache as mc
from mambacache._handoff._control import MAGIC
from mambacache._handoff._link import fingerprint, root_store

from ..support.link import TRANSPORT_ENV
from .transfer import HOST, prefill_pool, spec

TIMEOUT = 2.0


class SlowLand(mc.CacheManager):
    """A receiver's manager that takes ``delay`` seconds to land a batch once its bytes arrived (the receive
    writes them inside ``land``), so its acknowledgement comes late; ``before``: seconds inside ``land`` before the
    write (the batch's slots taken, its ``go`` not written yet); ``fail``: a MemoryError there (``"before"``) or
    once the bytes were written (``"after"``)."""

    delay = 0.0
    before = 0.0
    fail = ""

    def land(
        self,
        request_ids: list[str],
        write: Callable[[list[int]], None] | None = None,
        *,
        arrived: Callable[[list[int]], None] | None = None,
    ) -> list[int]:
        def slow(hosts: list[int]) -> None:
            time.sleep(self.before)
            if self.fail == "before":
                raise MemoryError("injected: the landing failed before its go")
            if write is not None:
                write(hosts)
            if self.fail == "after":
                raise MemoryError("injected: the landing failed after its bytes")
            time.sleep(self.delay)

        return super().land(request_ids, slow, arrived=arrived)


class Side:
    """One rank's manager, pool and transfer, and the checks the cases share."""

    def __init__(self, rank: int, timeout: float = TIMEOUT) -> None:
        self.pool = prefill_pool(50 + rank)
        self.mgr = SlowLand(self.pool, host_pool=mc.HostPool(spec(), HOST))
        self.xfer = mc.StateTransfer(self.mgr, dist.group.WORLD, peer=1 - rank, timeout=timeout)

    def stage(self, ids: list[str], slots: list[int], seed: int) -> list[str]:
        """Sender: ``seed``'s states into ``slots``, exported under ``ids`` and flushed."""
        ref = prefill_pool(seed)
        for t, r in zip(self.pool.tensors, ref.tensors, strict=True):
            t[:, slots] = r[:, slots]
        for s, i in zip(slots, ids, strict=True):
            self.mgr.alloc_slots([s], i, clear=False)
            self.mgr.export(s, i)
        self.mgr.flush_nowait()
        return ids

    def holds(self, ids: list[str], why: str) -> None:
        """Sender: nothing of ``ids`` was delivered."""
        assert [ev.request_id for ev in self.mgr.exports_ready()] == ids, why
        host = self.mgr.host_pool
        assert host is not None and host.num_held == len(ids), why

    def imports(self, ids: list[str], slots: list[int], src: list[int], seed: int, why: str) -> None:
        """Receiver: import ``ids`` into ``slots``, compare with the sender's ``src`` slots of ``seed``, free all."""
        for s, i in zip(slots, ids, strict=True):
            self.mgr.import_into(s, i)
        self.mgr.flush_nowait()
        ref = prefill_pool(seed)
        for got, want in zip(self.pool.tensors, ref.tensors, strict=True):
            assert torch.equal(got[:, slots], want[:, src]), why
        for s, i in zip(slots, ids, strict=True):
            self.mgr.release(s, i)
        self.mgr.flush_nowait()

    def idle(self) -> None:
        self.mgr.check_idle(host=True)


def _fails(call: Callable[[], object], why: str, reason: str | None = None) -> mc.TransferError:
    """``call`` raises a TransferError within twice the timeout (and a bit): returns it."""
    start = time.monotonic()
    try:
        call()
    except mc.TransferError as exc:
        took = time.monotonic() - start
        assert took < 2 * TIMEOUT + 2, f"{why}: failed only after {took:.1f}s"
        if reason is not None:
            assert getattr(exc, "reason", None) == reason, f"{why}: {exc!r}"
        return exc
    raise AssertionError(f"{why}: no TransferError")


# -- the cases: (sender, receiver) ------------------------------------------------------------------------
def late_sender(me: Side) -> None:
    ids = me.stage(["late-a", "late-b"], [1, 2], 10)
    _fails(me.xfer.send, "a receiver later than the timeout")
    me.holds(ids, "a send that timed out delivered something")
    dist.barrier()
    assert me.xfer.send() == ids, "the retry after a late receiver"
    me.idle()


def late_receiver(me: Side) -> None:
    time.sleep(2.5 * TIMEOUT)  # the sender gives up waiting for us
    dist.barrier()
    assert me.xfer.receive() == ["late-a", "late-b"]
    me.imports(["late-a", "late-b"], [4, 5], [1, 2], 10, "a late receiver")
    me.idle()


def idle_sender(me: Side) -> None:
    ids = me.stage(["idle-a"], [3], 11)
    dist.barrier()
    assert me.xfer.send() == ids, "a send after the receiver's header wait timed out"
    me.idle()


def idle_receiver(me: Side) -> None:
    _fails(me.xfer.receive, "a receiver with nothing to receive")
    dist.barrier()
    assert me.xfer.receive() == ["idle-a"]
    me.imports(["idle-a"], [6], [3], 11, "after an idle receive")
    me.idle()


ROOM_X, ROOM_Y = ["x1", "x2", "x3", "x4"], ["y1", "y2", "y3"]


def room_sender(me: Side) -> None:
    assert me.xfer.send() == [], "nothing staged"
    me.stage(ROOM_X, [1, 2, 3, 4], 12)
    assert me.xfer.send() == ROOM_X  # the receiver keeps them: 2 of its 6 host slots left
    me.stage(ROOM_Y, [5, 6, 7], 13)
    # Refused (room for 2), cut to 2 and sent at once, then the last one refused (room 0): the two delivered.
    assert me.xfer.send() == ROOM_Y[:2], "a batch cut to the receiver's room"
    me.holds(ROOM_Y[2:], "a refused state was delivered")
    exc = _fails(me.xfer.send, "a batch the receiver has no room for", "room")
    assert getattr(exc, "room", None) == 0, repr(exc)
    me.holds(ROOM_Y[2:], "a refused state was delivered")
    dist.barrier()
    assert me.xfer.send() == ROOM_Y[2:], "the retry once the receiver has room"
    me.idle()


def room_receiver(me: Side) -> None:
    assert me.xfer.receive() == ROOM_X  # kept in staging: 2 host slots left
    _fails(me.xfer.receive, "a batch larger than the free host slots", "room")
    assert me.xfer.receive() == ROOM_Y[:2]
    for _ in range(2):  # the rest of the first send, then the second send: no room
        _fails(me.xfer.receive, "a batch when no host slot is free", "room")
    host = me.mgr.host_pool
    assert host is not None and host.num_held == 6, "a refused batch took host slots"
    me.imports(ROOM_X, [1, 2, 3, 4], [1, 2, 3, 4], 12, "the batch before the refused one")
    me.imports(ROOM_Y[:2], [5, 6], [5, 6], 13, "the batch cut to the room")
    dist.barrier()
    assert me.xfer.receive() == ROOM_Y[2:]
    me.imports(ROOM_Y[2:], [7], [7], 13, "the refused state, retried")
    me.idle()


def doubt_sender(me: Side) -> None:
    ids = me.stage(["d1", "d2"], [1, 2], 14)
    _fails(me.xfer.send, "an acknowledgement later than the timeout")
    me.holds(ids, "a send with no acknowledgement delivered something")
    dist.barrier()
    assert me.xfer.send() == ids, "the retry of a batch that landed: acknowledged again"
    more = me.stage(["d3"], [3], 15)
    assert me.xfer.send() == more
    me.idle()


def doubt_receiver(me: Side) -> None:
    me.mgr.delay = 2.5 * TIMEOUT  # lands after the sender stopped waiting for the ack
    try:
        assert me.xfer.receive() == ["d1", "d2"]
    finally:
        me.mgr.delay = 0.0
    dist.barrier()
    assert me.xfer.receive() == ["d3"], "the retry of d1, d2 was landed again, or d3 was lost"
    host = me.mgr.host_pool
    assert host is not None and host.num_held == 3, "a state landed twice"
    me.imports(["d1", "d2"], [4, 5], [1, 2], 14, "a batch whose ack was late")
    me.imports(["d3"], [6], [3], 15, "the batch after it")
    me.idle()


def full_doubt_sender(me: Side) -> None:
    ids = me.stage(["f1", "f2"], [1, 2], 20)
    _fails(me.xfer.send, "an acknowledgement later than the timeout")
    dist.barrier()  # the receiver has landed f1, f2 and filled its host pool since
    assert me.xfer.send() == ids, "the retry of a landed batch to a receiver with no room left: acknowledged"
    me.idle()


def full_doubt_receiver(me: Side) -> None:
    """The retry of a batch this side landed, arriving when its host pool is full: ``dup``, not a refusal for
    room (a refusal told the sender nothing landed, and it sent the states again as a new batch)."""
    me.mgr.delay = 2.5 * TIMEOUT
    try:
        assert me.xfer.receive() == ["f1", "f2"]
    finally:
        me.mgr.delay = 0.0
    host = me.mgr.host_pool
    assert host is not None
    fill = list(range(3, 3 + host.num_free))
    me.mgr.alloc_slots(fill, "fill", clear=False)
    held = me.mgr.offload_many(fill, "fill")
    me.mgr.flush_nowait()
    assert me.mgr.landing_room() == 0
    dist.barrier()
    _fails(me.xfer.receive, "nothing after the retry, which was acknowledged and not landed again")
    assert host.num_held == 2 + len(held), "the retry landed something"
    for h in held:
        me.mgr.drop(h)
    me.mgr.release_many(fill, "fill")
    me.mgr.flush_nowait()
    me.imports(["f1", "f2"], [3, 4], [1, 2], 20, "a batch acknowledged again to a full receiver")
    me.idle()


def spec_sender(me: Side) -> None:
    ids = me.stage(["s1"], [1], 16)
    _fails(me.xfer.send, "a receiver of another spec", "spec")
    me.holds(ids, "a batch refused for its spec delivered something")
    dist.barrier()
    assert me.xfer.send() == ids
    me.idle()


def spec_receiver(me: Side) -> None:
    other = mc.StateSpec(num_layers=3, conv_shapes=[(4, 3)], temporal_shape=(3, 5))
    with mc.CacheManager(mc.StatePool(other, 4), host_pool=mc.HostPool(other, 4)) as mgr:
        wrong = mc.StateTransfer(mgr, dist.group.WORLD, peer=0, timeout=TIMEOUT)
        _fails(wrong.receive, "a batch of another spec", "spec")
        mgr.check_idle(host=True)
    dist.barrier()
    assert me.xfer.receive() == ["s1"]
    me.imports(["s1"], [2], [1], 16, "after a spec refusal")
    me.idle()


def _post_raw(header: dict[str, object]) -> None:
    """A header in the store as a broken or foreign sender would post it."""
    store: Any = _direction(0, 1)
    store.set(f"hdr/{store.add('posted', 1)}", json.dumps(header))


def _fp() -> list[object]:
    return fingerprint(spec().num_layers, spec().shapes())


def lying_sender(me: Side) -> None:
    layers, shapes = spec().num_layers, spec().shapes()
    base = {"magic": MAGIC, "tok": "x", "seq": 1, "fp": _fp(), "pair": "x.0"}
    _post_raw({**base, "ids": [f"i{k}" for k in range(HOST + 1)], "bytes": [0] * len(shapes)})  # no room
    _post_raw({**base, "ids": ["huge"], "bytes": [2**40] * len(shapes)})  # a lie: 2**40 bytes for one state
    assert layers
    dist.barrier()
    ids = me.stage(["ok"], [2], 17)
    assert me.xfer.send() == ids
    me.idle()


def lying_receiver(me: Side) -> None:
    _fails(me.xfer.receive, "a header of more states than the host pool holds", "room")
    exc = _fails(me.xfer.receive, "a header whose byte sizes its fingerprint does not give")
    assert "byte sizes" in str(exc), exc
    me.idle()
    dist.barrier()
    assert me.xfer.receive() == ["ok"]
    me.imports(["ok"], [3], [2], 17, "after two impossible headers")
    me.idle()


def _direction(src: int, dst: int) -> Any:
    return dist.distributed_c10d.PrefixStore(
        f"mambacache/xfer/{src}>{dst}/", root_store(dist.distributed_c10d._get_default_store())
    )


def silent_sender(me: Side) -> None:
    """Posts a valid header and dies (never builds the pair): the receiver's error is typed, within its timeout."""
    header = {"magic": MAGIC, "tok": "gone", "seq": 1, "fp": _fp(), "pair": "gone.0", "ids": ["g"], "bytes": _sizes(1)}
    if os.environ.get(TRANSPORT_ENV, "gloo") != "gloo":  # a pulled wire's header names where its rows lie
        header["src"] = {"agent": "gone", "md": 1, "mem": "DRAM", "descs": [[0, b, 0] for b in _sizes(1)]}
    _post_raw(header)
    dist.barrier()
    ids = me.stage(["after"], [1], 18)
    assert me.xfer.send() == ids
    me.idle()


def _sizes(n: int) -> list[int]:
    return [
        spec().num_layers * n * t.numel() * t.element_size()
        for t in (torch.empty(s, dtype=d) for s, d in spec().shapes())
    ]


def receiver_of_silent(me: Side) -> None:
    exc = _fails(me.xfer.receive, "a sender that went silent after the receiver took its batch")
    # Nothing answers: gloo's pair and NIXL's metadata of the agent the header names wait out the timeout; the
    # Mooncake segment the header names resolves to no engine, a failed read at once.
    said = "failed" if os.environ.get(TRANSPORT_ENV, "gloo") == "mooncake" else "timed out"
    assert type(exc) is mc.TransferError and said in str(exc), repr(exc)
    me.idle()
    dist.barrier()
    assert me.xfer.receive() == ["after"]
    me.imports(["after"], [2], [1], 18, "after a silent sender")
    me.idle()


def sender_to_silent(me: Side) -> None:
    ids = me.stage(["s"], [1], 19)
    exc = _fails(me.xfer.send, "a receiver that took the batch and went silent")
    assert type(exc) is mc.TransferError and "timed out" in str(exc), repr(exc)
    me.holds(ids, "a batch never acknowledged was delivered")
    dist.barrier()
    assert me.xfer.send() == ids, "the retry after a silent receiver"
    me.idle()


def silent_receiver(me: Side) -> None:
    """Takes the next header ("go") and never builds the pair nor answers, as a receiver dying there would."""
    store = _direction(0, 1)
    m = int(store.add("taken", 0)) + 1
    store.wait([f"hdr/{m}"], timedelta(seconds=10))
    assert store.compare_set(f"state/{m}", "", "go:silent") == b"go:silent"
    store.add("taken", 1)
    time.sleep(2.5 * TIMEOUT)
    dist.barrier()
    assert me.xfer.receive() == ["s"]
    me.imports(["s"], [2], [1], 19, "the retry after a silent receiver")
    me.idle()


def failed_sender(me: Side) -> None:
    """The receiver took the bytes and landed none (it says so: ``fail``): the batch is not in doubt, so the next
    send ships it together with what became ready since. Before: in doubt, it went again alone and unchanged,
    which never converges against a re-slicing receiver whose ranks' batches differ (each rank's retry the same
    mismatched batch again)."""
    ids = me.stage(["f1"], [1], 20)
    exc = _fails(me.xfer.send, "a receiver that landed nothing", "failed")
    assert exc.request_ids == ids, repr(exc)
    me.holds(ids, "a batch the receiver did not land was delivered")
    more = me.stage(["f2"], [2], 20)
    dist.barrier()
    assert me.xfer.send() == ids + more, "the batch that failed went alone, as if in doubt"
    me.idle()


def failing_receiver(me: Side) -> None:
    ids, _ = me.xfer.receive_rows()
    assert ids == ["f1"]
    me.xfer.acknowledge(ids, landed=False, why="its ranks disagreed")
    dist.barrier()
    assert me.xfer.receive() == ["f1", "f2"]
    me.imports(["f1", "f2"], [3, 4], [1, 2], 20, "a batch after one that landed nothing")
    me.idle()


# Every layout of the wire (issue #32's cost): one message per pool tensor or one per layer (split), the
# sender's staging slots (or, exported in place, its pool slots) one run or not, the receiver's landing slots
# (staging host slots, or, expected in place, its pool slots) one run or not.
WIRE = [
    (split, srun, rrun, in_place, expected)
    for split in (True, False)
    for srun in (True, False)
    for rrun in (True, False)
    for in_place in (False, True)
    for expected in (False, True)
]


def _sources(srun: bool, in_place: bool) -> list[int]:
    """The sender's exported pool slots: staged, 1 and 3 (one run of staging slots or not by a third export
    between them); in place, one run of pool slots (1, 2) or not (1, 3)."""
    return [1, 2] if in_place and srun else [1, 3]


@contextlib.contextmanager
def _gathers() -> Iterator[list[int]]:
    """Counts (in its one item, which the caller may zero) the batches this process gathered into a transfer's
    kept buffers (``_Buffers.rows``): a batch that went straight from (or into) the rows gathers none."""
    import mambacache._handoff._transfer as xfer_mod

    count = [0]
    rows = xfer_mod._Buffers.rows

    def counted(self: Any, *args: Any) -> Any:
        count[0] += 1
        return rows(self, *args)

    xfer_mod._Buffers.rows = counted  # type: ignore[method-assign]
    try:
        yield count
    finally:
        xfer_mod._Buffers.rows = rows  # type: ignore[method-assign]


def _straight(split: bool, run: bool) -> bool:
    """Whether a batch goes straight from (or into) the rows: over gloo when split and one run; over a pulled
    wire (NIXL, Mooncake) always, its reads cut at the rows' own ranges."""
    return os.environ.get(TRANSPORT_ENV, "gloo") != "gloo" or (split and run)


def wire_sender(me: Side) -> None:
    import mambacache._handoff._transfer as xfer_mod

    real = xfer_mod.SPLIT_BYTES
    try:
        with _gathers() as gathered:
            for k, (split, srun, _, in_place, _) in enumerate(WIRE):
                # The sender alone decides; the receiver follows the header.
                xfer_mod.SPLIT_BYTES = 0 if split else 2**62
                ids = [f"w{k}a", f"w{k}b"]
                first, second = _sources(srun, in_place)
                ref = prefill_pool(30 + k)
                for t, r in zip(me.pool.tensors, ref.tensors, strict=True):
                    t[:, [1, 2, 3]] = r[:, [1, 2, 3]]
                me.mgr.alloc_slots([first], ids[0], clear=False)
                me.mgr.export(first, ids[0], in_place=in_place)
                if not srun and not in_place:  # an export for another peer between them: staging host slots 1 and 3
                    me.mgr.alloc_slots([2], "pad", clear=False)
                    me.mgr.export(2, "pad", to=7)
                me.mgr.alloc_slots([second], ids[1], clear=False)
                me.mgr.export(second, ids[1], in_place=in_place)
                me.mgr.flush_nowait()
                gathered[0] = 0
                dist.barrier()
                assert me.xfer.send() == ids, (split, srun, in_place)
                how = f"split {split}, one run {srun}, in place {in_place}: copied or not"
                assert (gathered[0] == 0) == _straight(split, srun), how
                if not srun and not in_place:
                    me.mgr.release(2, "pad")  # withdraws its export
                me.mgr.flush_nowait()
                me.idle()
    finally:
        xfer_mod.SPLIT_BYTES = real


def wire_receiver(me: Side) -> None:
    with _gathers() as gathered:
        for k, (split, srun, rrun, in_place, expected) in enumerate(WIRE):
            held: list[int] = []
            ids = [f"w{k}a", f"w{k}b"]
            targets = [4, 5] if rrun or not expected else [4, 6]
            if expected:  # the states land straight in the pool slots they await
                for s, i in zip(targets, ids, strict=True):
                    me.mgr.expect_import(s, i)
                me.mgr.flush_nowait()
            elif not rrun:  # host slot 2 held: the batch lands in 1 and 3
                me.mgr.alloc_slots([6, 7], "hold", clear=False)
                held = me.mgr.offload_many([6, 7], "hold")
                me.mgr.flush_nowait()
                me.mgr.drop(held.pop(0))
                me.mgr.flush_nowait()
            gathered[0] = 0
            dist.barrier()
            assert me.xfer.receive() == ids
            how = f"split {split}, one run {rrun}, in place {expected}: copied or not"
            assert (gathered[0] == 0) == _straight(split, rrun), how
            host = me.mgr.host_pool
            assert host is not None and (host.num_held == len(held) + (0 if expected else 2)), how
            why = f"the wire with split {split}, landing in one run {rrun}, from slots {_sources(srun, in_place)}"
            me.imports(ids, targets, _sources(srun, in_place), 30 + k, why)
            for h in held:
                me.mgr.drop(h)
            if held:
                me.mgr.release_many([6, 7], "hold")
            me.mgr.flush_nowait()
            me.idle()


CASES = {
    "late receiver": (late_sender, late_receiver),
    "idle receiver": (idle_sender, idle_receiver),
    "refused for room": (room_sender, room_receiver),
    "acknowledgement too late": (doubt_sender, doubt_receiver),
    "acknowledgement too late, then no room": (full_doubt_sender, full_doubt_receiver),
    "another spec": (spec_sender, spec_receiver),
    "impossible headers": (lying_sender, lying_receiver),
    "sender silent after go": (silent_sender, receiver_of_silent),
    "receiver silent after go": (sender_to_silent, silent_receiver),
    "landed nothing": (failed_sender, failing_receiver),
    "every wire layout": (wire_sender, wire_receiver),
}


def link_worker(rank: int, port: int, cases: list[str]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    try:
        me = Side(rank)
        with me.mgr:
            for name in cases:
                dist.barrier()
                try:
                    CASES[name][rank](me)
                except AssertionError as exc:
                    raise AssertionError(f"{name} (rank {rank}): {exc}") from exc
    finally:
        dist.destroy_process_group()
