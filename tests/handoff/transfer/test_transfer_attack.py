"""Adversarial checks of the merged state transfer (issue #32): found by attacking it, each fails on the old code.

The wire is replaced by :class:`Wire`, which keeps the receiver's promise of
``_link.Inbox``: a batch is a ``seq`` of the sending transfer, and a batch
that landed already is acknowledged again (``dup``) and not landed twice.
"""

from __future__ import annotations

import gc
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch

import mambacache as mc
from mambacache._handoff._transfer import Batches, send_exports

from ...support.loopback import OneBatch
from ...support.util import flush_with_fault, small_spec

SPEC = small_spec(2)


def _mgr(slots: int = 4, host: int = 2) -> mc.CacheManager:
    return mc.CacheManager(mc.StatePool(SPEC, slots), host_pool=mc.HostPool(SPEC, host))


class Wire:
    """A receiver behind a fake wire: lands each batch's rows by its ``(token, seq)`` (a repeated one lands nothing);
    ``lose_ack``: the next batch lands but its acknowledgement is lost (the sender sees a TransferError)."""

    def __init__(self, sender: mc.CacheManager, peer: int = 1) -> None:
        self.sender, self.peer = sender, peer
        self.landed: dict[str, list[torch.Tensor]] = {}
        self.seqs: list[int] = []
        self.last: tuple[str, int] | None = None
        self.lose_ack = False

    def ship(self, batch: list[mc.Export], ids: list[str], ident: tuple[str, int], retry: bool) -> None:
        host = self.sender.host_pool
        assert host is not None
        self.seqs.append(ident[1])
        if ident != self.last:  # "go": the bytes land
            for ev, rid in zip(batch, ids, strict=True):
                self.landed[rid] = [t[:, ev.host].clone() for t in host.tensors]
            self.last = ident
        if self.lose_ack:
            self.lose_ack = False
            raise mc.TransferError("the acknowledgement timed out", ids)

    def send(self, batches: Batches) -> list[str]:
        return send_exports(self.sender, self.ship, [self.peer], batches)


def _export(mgr: mc.CacheManager, rid: str, value: float) -> int:
    (slot,) = mgr.alloc(1, rid, clear=False)
    mgr.flush_nowait()
    for t in mgr.pool.tensors:
        t[:, slot] = value
    mgr.export(slot, rid, to=1)
    mgr.flush_nowait()
    return slot


@pytest.mark.no_transport
def test_a_re_export_after_withdrawing_a_batch_in_doubt_is_a_new_batch_not_its_retry() -> None:
    """A batch in doubt (landed, ack lost) whose export is released (withdrawn), then the same request exported
    again from the same slot: the new export lands the same staging host slot, so it is *equal* to the withdrawn
    one (a frozen dataclass). Taken for the batch in doubt, it went again under the old number, the receiver
    acknowledged it as a duplicate and landed nothing, and the sender released the new state: lost (the receiver
    holds the first export's bytes under that id)."""
    with _mgr() as mgr:
        wire, batches = Wire(mgr), Batches()
        slot = _export(mgr, "r", 1.0)
        wire.lose_ack = True
        with pytest.raises(mc.TransferError):
            wire.send(batches)
        assert wire.landed["r"][0].eq(1.0).all()
        mgr.release(slot, "r")  # withdraws the export in doubt
        mgr.flush_nowait()
        del wire.landed["r"]  # the receiver's engine discards the state it got for the withdrawn request
        assert _export(mgr, "r", 2.0) == slot
        assert wire.send(batches) == ["r"]
        assert wire.seqs[-1] != wire.seqs[0], "the new export went as the retry of the withdrawn batch"
        assert "r" in wire.landed and wire.landed["r"][0].eq(2.0).all(), "the new state never landed"
        mgr.flush_nowait()
        mgr.check_idle(host=True)


@pytest.mark.no_transport
def test_a_batch_in_doubt_is_retried_alone_under_its_number_and_lands_once() -> None:
    """What held: the batch in doubt goes again alone under its number (acknowledged as a duplicate), the
    export made meanwhile in a batch of its own."""
    with _mgr() as mgr:
        wire, batches = Wire(mgr), Batches()
        _export(mgr, "a", 1.0)
        wire.lose_ack = True
        with pytest.raises(mc.TransferError):
            wire.send(batches)
        _export(mgr, "b", 2.0)
        assert wire.send(batches) == ["a", "b"]
        assert wire.seqs == [1, 1, 2]
        assert wire.landed["a"][0].eq(1.0).all() and wire.landed["b"][0].eq(2.0).all()
        mgr.flush_nowait()
        mgr.check_idle(host=True)


@pytest.mark.no_transport
def test_a_faulted_flush_beside_a_thread_that_submits_is_repaired_without_a_false_alarm() -> None:
    """The soak's flake (``test_transfer_soak``, about 1 run in 10): a sender thread's delivery queued its
    releases while the step loop's flush was failing, and ``flush_with_fault`` then asserted that the failed
    flush left nothing queued, a single-threaded invariant. Here the other thread submits at the moment of the
    fault, deterministically: ``alone=False`` (what the soak passes) accepts it, and the repair runs both."""
    with _mgr() as mgr:
        (other,) = mgr.alloc(1, "other", clear=False)
        mgr.alloc(1, "x")  # a clear: device work, so op 1 is in the flush

        class Fault(MemoryError):
            def __init__(self, *args: Any) -> None:
                super().__init__(*args)
                t = threading.Thread(target=mgr.release, args=(other, "other"))  # the sender thread's delivery
                t.start()
                t.join()

        with pytest.raises(AssertionError, match="events queued"):
            flush_with_fault(mgr, 1, Fault)  # the single-threaded check: a false alarm here
        mgr.flush_nowait()  # the repair it did not get to
        assert mgr.pool.unfinished == 0 and mgr.pending == 0
        (other,) = mgr.alloc(1, "other", clear=False)
        mgr.alloc(1, "y")
        assert flush_with_fault(mgr, 1, Fault, alone=False) >= 1
        assert mgr.pool.unfinished == 0 and mgr.pending == 0
        assert other not in mgr.held()


@pytest.mark.parametrize("store", ["x", object(), 5])
def test_a_transfer_with_something_else_than_a_store_is_a_typed_error(store: Any) -> None:
    """Was an AttributeError (``'str' object has no attribute 'clone'``)."""
    with _mgr() as mgr, pytest.raises(mc.InvalidArgumentError, match="a torch\\.distributed\\.Store"):
        mc.StateTransfer(mgr, None, peer=0, store=store, rank=1, timeout=1.0)


def test_a_transfer_built_on_a_store_whose_host_is_gone_is_a_transfer_error() -> None:
    """A joiner whose store host died: was a bare DistNetworkError from the store client's clone."""
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=1))
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=1))
    del master
    gc.collect()
    with _mgr() as mgr, pytest.raises(mc.TransferError, match="key-value store failed"):
        mc.StateTransfer(mgr, None, peer=0, store=client, rank=1, timeout=1.0)


@pytest.mark.no_transport
def test_an_unaddressed_export_in_doubt_with_one_peer_is_never_sent_to_another() -> None:
    """``export(to=None)``: whichever transfer sends first. Its batch to peer 1 landed there and the ack was lost
    (in doubt); the transfer to peer 2 then took it, being unaddressed, and delivered it there too: one state at
    two peers. It must stay with peer 1 (whose retry is acknowledged as a duplicate)."""
    with _mgr() as mgr:
        one, two = Wire(mgr, 1), Wire(mgr, 2)
        b1, b2 = Batches(), Batches()
        (slot,) = mgr.alloc(1, "r", clear=False)
        mgr.export(slot, "r")  # to no one in particular
        mgr.flush_nowait()
        one.lose_ack = True
        with pytest.raises(mc.TransferError):
            one.send(b1)
        assert "r" in one.landed
        assert mgr.exports_ready(to=2) == [], "an export in doubt with peer 1 is offered to peer 2"
        assert two.send(b2) == [], "an export in doubt with peer 1 was delivered to peer 2 as well"
        assert one.send(b1) == ["r"] and one.seqs == [1, 1]
        assert "r" not in two.landed
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def test_a_state_landed_but_not_yet_written_is_neither_imported_nor_discarded() -> None:
    """``receive()`` lands a batch (host slots held by the ids) and writes the rows after, outside the lock. In
    between, the ids counted as arrived: a step loop importing a request it expects read the host slot before
    the write (another request's old bytes), and a discard freed a slot the write then wrote into. Now they are
    arrived only once written: import_into and discard_arrived refuse them until then."""
    import mambacache._handoff._transfer as xfer_mod

    with _mgr(host=2) as mgr:
        host = mgr.host_pool
        assert host is not None
        rows = [torch.full((t.shape[0], 1, *t.shape[2:]), 7.0).to(t.dtype) for t in host.tensors]
        xfer = OneBatch(rows).transfer(mgr)  # the wire stood in
        writing, written = threading.Event(), threading.Event()
        real = xfer_mod.write_staging
        seen: list[str] = []

        def slow_write(m: mc.CacheManager, slots: list[int], r: list[torch.Tensor]) -> None:
            writing.set()
            assert written.wait(10)
            real(m, slots, r)

        xfer_mod.write_staging = slow_write  # type: ignore[assignment]
        try:
            t = threading.Thread(target=lambda: seen.extend(xfer.receive()))
            t.start()
            assert writing.wait(10)
            with pytest.raises(mc.SlotStateError):
                mgr.import_into(1, "r")  # the state is not there yet
            with pytest.raises(mc.SlotStateError):
                mgr.discard_arrived("r")
            written.set()
            t.join(10)
        finally:
            xfer_mod.write_staging = real  # type: ignore[assignment]
        assert seen == ["r"]
        mgr.import_into(1, "r")
        mgr.flush_nowait()
        assert all(bool(t[:, 1].eq(7.0).all()) for t in mgr.pool.tensors)
        mgr.release(1, "r")
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def test_a_reslicing_receiver_whose_write_fails_answers_every_rank_and_keeps_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2 -> 1: the shards gathered and landed, then the write into the host slots fails. It used to run after
    the landing's try: no rank was answered (each sender waited out its timeout, then retried into a receiver
    whose ids had arrived already: "arrived twice", forever), and the slots stayed held with unwritten bytes."""
    import mambacache._handoff._reslice as reslice_mod
    from mambacache._handoff._reslice import ReslicingReceiver, StateLayout

    from ...support.reslice import FakeTransfer, mamba2, random_state

    layout = StateLayout.from_config(mamba2(4, 4, 1, 4))
    full = random_state(layout.spec, 2, 7)
    fakes = [FakeTransfer(["a", "b"], layout.slice(full, 2, k)) for k in range(2)]

    def broken(*_: Any) -> None:
        raise MemoryError("the host write failed")

    monkeypatch.setattr(reslice_mod, "write_staging", broken)
    with mc.CacheManager(mc.StatePool(layout.spec, 4), host_pool=mc.HostPool(layout.spec, 4)) as mgr:
        receiver = ReslicingReceiver(mgr, fakes, layout)  # type: ignore[arg-type]
        with pytest.raises(MemoryError):
            receiver.receive()
        assert [f.refused for f in fakes] == [[["a", "b"]], [["a", "b"]]], "a rank was left waiting"
        assert all(f.acked == [] for f in fakes)
        assert mgr.host_pool is not None and mgr.host_pool.num_held == 0, "unwritten states left held"
        with pytest.raises(mc.SlotStateError):
            mgr.import_into(1, "a")
        monkeypatch.undo()
        assert receiver.receive() == ["a", "b"]  # the retry lands them


@pytest.mark.no_transport
@pytest.mark.parametrize("bad", [-1, True, 1.5, "1"])
def test_the_new_arguments_refuse_bad_input_typed_and_change_nothing(bad: Any) -> None:
    with _mgr() as mgr:
        _export(mgr, "r", 1.0)
        taken = mgr.take_exports(to=1)
        with pytest.raises(mc.InvalidArgumentError, match="peer's rank"):
            mgr.exports_returned(taken, peer=bad)
        with pytest.raises(mc.InvalidArgumentError, match="callable"):
            mgr.land(["x"], bad)
        host = mgr.host_pool
        assert host is not None and host.num_held == 1 and mgr.exports_ready() == []  # still sending
        mgr.exports_returned(taken, peer=1)
        assert mgr.exports_ready(to=1) == taken


def test_a_receive_while_a_batch_of_receive_rows_awaits_its_answer_is_refused() -> None:
    """``receive_rows`` leaves its batch awaiting ``acknowledge``; a receive (either form) before that answer
    used to take the next header, leaving that batch's sender waiting and the answer meant for it to go to the
    next batch. Now it is a TransferError that touches nothing, and after the answer receiving works again."""

    with _mgr(host=2) as mgr:
        host = mgr.host_pool
        assert host is not None
        rows = [torch.full((t.shape[0], 1, *t.shape[2:]), 5.0).to(t.dtype) for t in host.tensors]
        inbox = OneBatch(rows)
        xfer = inbox.transfer(mgr)  # the wire stood in
        ids, got = xfer.receive_rows()
        assert ids == ["r"] and all(bool(g.eq(5.0).all()) for g in got)
        for call in (xfer.receive, xfer.receive_rows):
            with pytest.raises(mc.TransferError, match="awaits its answer"):
                call()
        assert inbox.offers == 1 and host.num_held == 0  # nothing taken, nothing landed
        xfer.acknowledge(ids)
        assert xfer.receive() == ["r"] and inbox.offers == 2
        mgr.import_into(1, "r")
        mgr.flush_nowait()
        assert all(bool(t[:, 1].eq(5.0).all()) for t in mgr.pool.tensors)
        mgr.release(1, "r")
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def test_the_room_a_receiver_reports_is_what_a_landing_can_take_now() -> None:
    """A host slot freed in the step not yet flushed counts in ``host_pool.num_free`` but a landing cannot take
    it (its old bytes may still be read). The receiver judged headers and reported its room after a refusal by
    ``num_free``: the sender cut its batch to a room that was not there and was refused again. Now both are
    ``landing_room()``: the settled free slots."""

    with _mgr(host=2) as mgr:
        host = mgr.host_pool
        assert host is not None
        (a,) = mgr.alloc(1, "old", clear=False)
        (h,) = mgr.offload_many([a], "old")
        mgr.flush_nowait()
        mgr.drop(h)  # freed by a queued event: num_free 2, but one slot only is settled
        assert host.num_free == 2 and mgr.landing_room() == 1
        rows = [torch.full((t.shape[0], 2, *t.shape[2:]), 3.0).to(t.dtype) for t in host.tensors]
        inbox = OneBatch(rows)  # a batch of two states
        xfer = inbox.transfer(mgr)  # the wire stood in
        with pytest.raises(mc.TransferRefusedError) as info:
            xfer.receive()
        assert info.value.reason == "room"
        assert inbox.rooms == [1] and inbox.answers[0][1].startswith("room:1:"), (inbox.rooms, inbox.answers)
        assert host.num_held == 0 and mgr.landing_room() == 1  # nothing taken
        mgr.flush_nowait()
        assert mgr.landing_room() == 2
        mgr.release(a, "old")
        mgr.flush_nowait()
        mgr.check_idle(host=True)
