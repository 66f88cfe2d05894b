"""What a send reports and keeps when a batch's outcome is uncertain: a batch in doubt (its acknowledgement lost)
goes again alone under its number and lands once, to its peer and no other; a batch that failed before its
header was posted is not in doubt; a batch delivered is returned, whatever comes after it (a close, an interrupt).

Some replace the wire by :class:`Wire`, which keeps the receiver's promise of ``_link.Inbox`` (a batch is a
``seq`` of the sending transfer, and one that landed already is acknowledged again and not landed twice); others
run the real link in one process (``tests/support/link.py``).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import mambacache as mc
from mambacache._handoff._transfer import Batches, send_exports

from ...support.link import deliver as _deliver
from ...support.link import export_valued as _export
from ...support.link import fail_once, staged_and_in_place
from ...support.link import imported as _imported
from ...support.link import in_thread as _in_thread
from ...support.link import small_manager as _mgr
from ...support.link import store as _store
from ...support.link import transfer as _transfer
from ...support.util import flush_with_fault, quant_spec, small_spec

SPEC = small_spec(2)


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


def _fail_reading_once(monkeypatch: pytest.MonkeyPatch, transport: str, error: BaseException) -> None:
    """The next read of a batch's rows for a send raises ``error``: gathering them into the kept buffers (gloo,
    whose one-state batch is gathered), or finding where they lie (a pulled wire reads them there)."""
    import mambacache._handoff._transfer as transfer

    if transport == "gloo":
        fail_once(monkeypatch, transfer, "export_rows", error)
    else:
        fail_once(monkeypatch, transfer._Rows, "pieces", error)


@pytest.mark.no_transport
def test_a_re_export_after_withdrawing_a_batch_in_doubt_is_a_new_batch_not_its_retry() -> None:
    """A batch in doubt (landed, ack lost) whose export is released (withdrawn), then the same request exported
    again from the same slot: the new export lands the same staging host slot, so it is *equal* to the withdrawn
    one (a frozen dataclass). Taken for the batch in doubt, it went again under the old number, the receiver
    acknowledged it as a duplicate and landed nothing, and the sender released the new state: lost (the receiver
    holds the first export's bytes under that id)."""
    with _mgr() as mgr:
        wire, batches = Wire(mgr), Batches()
        slot = _export(mgr, "r", 1.0, to=1)
        wire.lose_ack = True
        with pytest.raises(mc.TransferError):
            wire.send(batches)
        assert wire.landed["r"][0].eq(1.0).all()
        mgr.release(slot, "r")  # withdraws the export in doubt
        mgr.flush_nowait()
        del wire.landed["r"]  # the receiver's engine discards the state it got for the withdrawn request
        assert _export(mgr, "r", 2.0, to=1) == slot
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
        _export(mgr, "a", 1.0, to=1)
        wire.lose_ack = True
        with pytest.raises(mc.TransferError):
            wire.send(batches)
        _export(mgr, "b", 2.0, to=1)
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


@pytest.mark.no_transport
def test_a_send_that_delivered_a_batch_before_the_manager_closed_returns_it() -> None:
    """A staged and an in-place export go in two batches. The manager closes (another thread leaves its ``with``)
    while the first is on the wire: its delivery is still taken (the slots freed), but the send then asked for
    the next batch and raised ManagerClosedError, so the caller heard that nothing went although the peer holds
    ``a``. A send in flight at the close is no failure: it returns what it delivered."""
    mgr = _mgr()
    mgr.__enter__()
    a, _ = staged_and_in_place(mgr)
    shipped: list[list[str]] = []

    def ship(batch: list[mc.Export], ids: list[str], ident: tuple[str, int], retry: bool) -> None:
        shipped.append(ids)
        if len(shipped) == 1:  # the engine shuts down while this batch awaits its ack
            closing = threading.Thread(target=mgr.__exit__, args=(None, None, None))
            closing.start()
            closing.join(10)

    assert send_exports(mgr, ship, [1], Batches()) == ["a"], "a delivered batch was reported as a failure"
    assert shipped == [["a"]]
    assert a not in mgr.pool.allocated_slots(), "the delivered export's slot was kept"


def test_an_unaddressed_export_withdrawn_before_a_peer_took_it_may_still_go_to_another_peer() -> None:
    """``export(to=None)``, sent to peer 1, which never receives: the sender withdraws its header at the timeout
    (first writer wins, so peer 1 can never take it: "nothing was sent"). It was counted in doubt all the same
    and pinned to peer 1, so the transfer to peer 2 never took it: one dead or slow peer kept the state for good.
    A retry of a batch in doubt that is withdrawn stays in doubt (an earlier try may have landed)."""
    master = _store()
    with _mgr() as mgr, _mgr() as peer2:
        to1 = _transfer(mgr, master, 0, 1, 0.3)
        to2 = _transfer(mgr, master, 0, 2, 5.0)
        at2 = _transfer(peer2, master, 2, 0, 5.0)
        _export(mgr, "r", 4.0)
        with pytest.raises(mc.TransferError, match="nothing was sent"):
            to1.send()
        assert [ev.request_id for ev in mgr.exports_ready(to=2)] == ["r"], "kept for a peer that never took it"
        _deliver(to2, at2, "r")
        _imported(peer2, 1, "r", 4.0)
        mgr.flush_nowait()
        peer2.flush_nowait()
        mgr.check_idle(host=True)
        peer2.check_idle(host=True)


@pytest.mark.no_transport
def test_a_retry_in_doubt_that_is_withdrawn_stays_with_its_peer() -> None:
    """The other half of the test above: the first try's acknowledgement was lost (it may have landed at peer 1),
    the retry is withdrawn before peer 1's go; the state must still go to peer 1 alone, as a retry of its number."""
    from mambacache._handoff._link import NothingSent

    with _mgr() as mgr:
        seqs: list[int] = []

        def ship(batch: list[mc.Export], ids: list[str], ident: tuple[str, int], retry: bool) -> None:
            seqs.append(ident[1])
            if len(seqs) == 1:
                raise mc.TransferError("the acknowledgement timed out", ids)
            if len(seqs) == 2:
                raise NothingSent("withdrawn before the peer's go", ids)

        batches = Batches()
        _export(mgr, "r", 1.0)
        for _ in range(2):
            with pytest.raises(mc.TransferError):
                send_exports(mgr, ship, [1], batches)
        assert mgr.exports_ready(to=2) == [], "an export that may be at peer 1 is offered to peer 2"
        assert send_exports(mgr, ship, [1], batches) == ["r"] and seqs == [1, 1, 1]
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def test_a_batch_that_could_not_be_read_before_its_header_is_not_in_doubt(
    monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """A send that fails while it reads the batch's rows (growing the kept buffers ran out of memory, an
    accelerator's event wait failed), before any header is posted, put nothing anywhere. It raised that error
    bare (not a TransferError, as every failure of a send is documented to be) and counted the batch in doubt:
    an export to no one was pinned to the peer that never saw a byte of it, and the transfer to another peer
    never took it again."""
    spec = quant_spec(2)
    master = _store()
    with (
        mc.CacheManager(mc.StatePool(spec, 4), host_pool=mc.HostPool(spec, 2)) as mgr,
        mc.CacheManager(mc.StatePool(spec, 4), host_pool=mc.HostPool(spec, 2)) as peer2,
    ):
        to1, to2 = _transfer(mgr, master, 0, 1, 2.0), _transfer(mgr, master, 0, 2, 2.0)
        at2 = _transfer(peer2, master, 2, 0, 2.0)
        (slot,) = mgr.alloc(1, "r", clear=False)
        mgr.flush_nowait()
        mgr.export(slot, "r")
        mgr.flush_nowait()
        _fail_reading_once(monkeypatch, transport, MemoryError("the kept send buffers could not grow"))
        with pytest.raises(mc.TransferError, match="nothing was sent") as caught:
            to1.send()
        assert isinstance(caught.value.__cause__, MemoryError)
        assert [ev.request_id for ev in mgr.exports_ready(to=2)] == ["r"], "pinned to a peer that got nothing"
        thread, sent = _in_thread(to2.send)
        try:
            assert at2.receive() == ["r"]
        finally:
            thread.join(10)
        assert sent == [["r"]]
        peer2.discard_arrived("r")
        peer2.flush_nowait()
        mgr.flush_nowait()
        mgr.check_idle(host=True)
        peer2.check_idle(host=True)


def test_a_batch_in_doubt_is_not_landed_twice_after_another_sender_of_the_direction_landed_one() -> None:
    """Two transfers on rank 0 send to one receiver (supported: they take turns on the direction). S1's batch
    lands but its acknowledgement is lost, so it is in doubt; S2's batch lands next. The receiver remembered only
    the last batch landed, S2's, so S1's retry was not known for a retry: landed again (refused as "arrived twice"
    while the first copy waited for its import, so S1 took back states the peer held; landed a second time once
    it was imported). A retry of the last batch each sender landed is acknowledged again."""
    spec = quant_spec(2)
    master = _store()
    with (
        mc.CacheManager(mc.StatePool(spec, 4), host_pool=mc.HostPool(spec, 2)) as m1,
        mc.CacheManager(mc.StatePool(spec, 4), host_pool=mc.HostPool(spec, 2)) as m2,
        mc.CacheManager(mc.StatePool(spec, 4), host_pool=mc.HostPool(spec, 4)) as peer,
    ):
        # The senders wait out no timeout here: 4 s for the receiver's go (2 s missed it at load 50 over Mooncake).
        s1, s2 = _transfer(m1, master, 0, 1, 4.0), _transfer(m2, master, 0, 1, 4.0)
        into = _transfer(peer, master, 1, 0, 2.0)
        for mgr, rid in ((m1, "a"), (m2, "b")):
            (slot,) = mgr.alloc(1, rid, clear=False)
            mgr.flush_nowait()
            mgr.export(slot, rid)
            mgr.flush_nowait()
        outbox, lost = s1._out, []
        real = outbox.wait_key

        def lossy(key: str, seconds: float) -> str | None:
            got = real(key, seconds)
            if key.startswith("ack/") and not lost:
                lost.append(got)
                return None  # the answer was written, and this side never read it: as if it timed out
            return got

        outbox.wait_key = lossy  # type: ignore[method-assign]
        thread, sent = _in_thread(s1.send)
        assert into.receive() == ["a"]
        thread.join(10)
        assert lost == [b"ok:1"] and isinstance(sent[0], mc.TransferError), sent  # in doubt
        thread, sent = _in_thread(s2.send)
        assert into.receive() == ["b"]
        thread.join(10)
        assert sent == [["b"]]
        thread, sent = _in_thread(s1.send)  # the retry: acknowledged again, not landed again
        try:
            with pytest.raises(mc.TransferError, match="no batch"):
                into.receive()  # nothing new arrives (the retry was answered "dup" inside the wait)
        finally:
            thread.join(10)
        assert sent == [["a"]], sent
        for rid in ("a", "b"):
            assert peer.discard_arrived(rid) > 0  # each arrived once, and is here
        peer.flush_nowait()
        peer.check_idle(host=True)
        for mgr in (m1, m2):
            mgr.flush_nowait()
            mgr.check_idle(host=True)


@pytest.mark.no_transport
def test_an_interrupt_after_a_delivered_batch_is_raised_not_swallowed() -> None:
    """A staged and an in-place export go in two batches; the first is delivered, and a KeyboardInterrupt comes
    while the second is on the wire. A send that delivered something returns it rather than raise the next
    batch's failure, and it swallowed the interrupt with it (``except BaseException``): Ctrl-C was lost. A
    failure returns what went; an interrupt goes on up (the first batch stays delivered: its slots are free)."""
    from mambacache._handoff._transfer import Batches, send_exports

    spec = quant_spec(2)
    with mc.CacheManager(mc.StatePool(spec, 4), host_pool=mc.HostPool(spec, 2)) as mgr:
        a, b = staged_and_in_place(mgr)
        shipped: list[list[str]] = []

        def ship(batch: list[mc.Export], ids: list[str], ident: tuple[str, int], retry: bool) -> None:
            shipped.append(ids)
            if len(shipped) == 2:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            send_exports(mgr, ship, [1], Batches())
        assert shipped == [["a"], ["b"]]
        assert a not in mgr.pool.allocated_slots(), "the delivered export's slot was kept"
        mgr.release(b, "b")  # withdraws the export the interrupt left
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def test_a_stop_iteration_while_the_batch_is_read_is_nothing_sent_too(
    monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """``ReadingBatch`` was first a generator context manager, and NothingSent is a RuntimeError: a StopIteration
    raised in its body, wrapped as NothingSent ``from`` it, looks to contextlib like PEP 479's conversion of a
    StopIteration the generator let out, and contextlib re-raised the bare StopIteration instead. The batch, read
    before any header, was then counted in doubt and pinned to a peer that never saw it (the inline ``except
    Exception`` before it made it a NothingSent as any other failure of the read)."""
    spec = quant_spec(2)
    master = _store()
    with mc.CacheManager(mc.StatePool(spec, 4), host_pool=mc.HostPool(spec, 2)) as mgr:
        to1 = _transfer(mgr, master, 0, 1, 2.0)
        (slot,) = mgr.alloc(1, "r", clear=False)
        mgr.flush_nowait()
        mgr.export(slot, "r")
        mgr.flush_nowait()
        _fail_reading_once(monkeypatch, transport, StopIteration("an iterator ran dry"))
        with pytest.raises(mc.TransferError, match="nothing was sent") as caught:
            to1.send()
        assert isinstance(caught.value.__cause__, StopIteration)
        assert [ev.request_id for ev in mgr.exports_ready(to=2)] == ["r"], "pinned to a peer that got nothing"
        mgr.release(slot, "r")
        mgr.flush_nowait()
        mgr.check_idle(host=True)
