"""Adversarial checks of the state transfer, second round: each fails on the code before its fix.

Some run the real link in one process: two ``StateTransfer`` built from
clients of one ``TCPStore`` on 127.0.0.1 (``store=``, ``rank=``), each side in
its own thread, the gloo pair between them built as between two processes.
Others replace the wire by a ``ship`` callable, as ``test_transfer_attack``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

import mambacache as mc
from mambacache._handoff._transfer import Batches, send_exports

from ...support.link import in_thread as _in_thread
from ...support.link import staged_and_in_place
from ...support.link import store as _store
from ...support.link import transfer as _transfer
from ...support.util import small_spec

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


# -- the real link in one process (tests/link.py) ----------------------------------------------------------


def _deliver(out: mc.StateTransfer, into: mc.StateTransfer, rid: str, why: str = "") -> None:
    """One batch of ``rid`` over the real link: sent in a thread, received and acknowledged here."""
    thread, sent = _in_thread(out.send)
    assert into.receive() == [rid], why
    thread.join(10)
    assert sent == [[rid]]


def _imported(mgr: mc.CacheManager, slot: int, rid: str, value: float, release: bool = True) -> None:
    """``rid``'s state imported into ``slot`` holds ``value`` in every pool tensor (then released)."""
    mgr.import_into(slot, rid)
    mgr.flush_nowait()
    assert all(bool(t[:, slot].eq(value).all()) for t in mgr.pool.tensors)
    if release:
        mgr.release(slot, rid)


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


class _FullDisk:
    """A tracer whose first ``event`` line raises, as structlog's WriteLogger does on a full disk."""

    def __init__(self, event: str) -> None:
        self.event, self.raised = event, 0

    def __enter__(self) -> _FullDisk:
        from mambacache._core import _tracer

        outer = self

        class Full(_tracer.Tracer):
            def transfer(self, event: str, peer: int | None, request_ids: Any, **fields: Any) -> None:
                if event == outer.event and not outer.raised:
                    outer.raised += 1
                    raise OSError(28, "No space left on device")

        self._old = _tracer.install(Full())
        return self

    def __exit__(self, *exc: object) -> None:
        from mambacache._core import _tracer

        _tracer.install(self._old)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_receive_whose_trace_line_fails_lands_nothing_and_the_retry_lands_once(in_place: bool) -> None:
    """The ``transfer.receive`` line is written in the hold of the lock that makes the states arrived. A tracer
    that raised there (a full disk) left them arrived, importable, while the receive raised and told the sender
    that nothing landed (``fail``): not in doubt, the sender sent the state again as a new batch, refused as
    "arrived twice" until the engine imported the first copy, then landed a second time."""
    master = _store()
    with _mgr() as mgr, _mgr() as peer:
        out, into = _transfer(mgr, master, 0, 1, 5.0), _transfer(peer, master, 1, 0, 5.0)
        _export(mgr, "r", 3.0)
        if in_place:
            peer.expect_import(2, "r")
            peer.flush_nowait()
        with _FullDisk("transfer.receive") as disk:
            thread, sent = _in_thread(out.send)
            with pytest.raises(mc.TransferError, match="nothing landed") as caught:
                into.receive()  # every failure of a receive is a TransferError, the tracer's cause chained
            thread.join(10)
            assert disk.raised == 1 and isinstance(caught.value.__cause__, OSError)
        assert isinstance(sent[0], mc.TransferRefusedError) and sent[0].reason == "failed", sent
        if in_place:
            assert peer.awaiting_import(2) == "r"
        else:
            with pytest.raises(mc.SlotStateError):
                peer.import_into(2, "r")  # told "not landed": it must not be here
            assert peer.host_pool is not None and peer.host_pool.num_held == 0
        _deliver(out, into, "r", "the retry of a state the sender heard did not land")
        _imported(peer, 2, "r", 3.0)
        mgr.flush_nowait()
        peer.flush_nowait()
        mgr.check_idle(host=True)
        peer.check_idle(host=True)


def test_a_send_whose_trace_line_fails_still_takes_the_acknowledged_delivery() -> None:
    """The ``transfer.send`` line came between the peer's acknowledgement and the delivery; a tracer that raised
    there left the export *sending* for good: never sent again, its release refused ("being sent") for ever, its
    pool and staging slots held by a state the peer holds. The delivery is taken whatever the tracer does."""
    master = _store()
    with _mgr() as mgr, _mgr() as peer:
        out, into = _transfer(mgr, master, 0, 1, 5.0), _transfer(peer, master, 1, 0, 5.0)
        slot = _export(mgr, "r", 3.0)
        with _FullDisk("transfer.send"):
            thread, sent = _in_thread(out.send)
            assert into.receive() == ["r"]
            thread.join(10)
        assert isinstance(sent[0], OSError), sent
        assert slot not in mgr.held(), "an acknowledged export's slot stayed held"
        mgr.flush_nowait()
        mgr.check_idle(host=True)
        peer.discard_arrived("r")
        peer.flush_nowait()
        peer.check_idle(host=True)


def test_a_header_withdrawn_while_the_receiver_is_busy_costs_no_gloo_pair() -> None:
    """A receiver busy past the sender's timeout is a normal event (the faults table: send again). Each time, the
    sender bumped its pair's epoch and retired its gloo pair, and the receiver retired its own at the next header:
    a ProcessGroupGloo each (about 5 file descriptors each here), kept for the life of the process, so a
    deployment whose decode side is sometimes late ran out of file descriptors. A withdrawal keeps the pair."""
    import mambacache._handoff._link as link

    master = _store()
    with _mgr() as mgr, _mgr() as peer:
        # The sender's timeout is waited out once per busy round; 1 s missed the receiver's go at load 50.
        out, into = _transfer(mgr, master, 0, 1, 2.0), _transfer(peer, master, 1, 0, 5.0)
        retired = []
        for k in range(2):
            for rid, busy in ((f"a{k}", False), (f"b{k}", True)):
                _export(mgr, rid, float(k))
                if busy:  # the receiver does not come within the sender's timeout: withdrawn, nothing sent
                    with pytest.raises(mc.TransferError, match="nothing was sent"):
                        out.send()
                _deliver(out, into, rid)
                peer.discard_arrived(rid)
                peer.flush_nowait()
            retired.append(len(link._RETIRED))
        assert retired[0] == retired[-1], f"gloo pairs retired after each round: {retired}"


def test_a_receiver_that_replaced_a_withdrawn_ones_rank_takes_the_next_batch() -> None:
    """A withdrawal keeps the sender's pair; a receiver that took the rank since (an engine restarted there) must
    still take the next batch, over a pair of its own: the pair's name carries the token of the receiver that
    answered go. Named by the sender alone, the new receiver would meet the pair built with its predecessor
    and fail a batch before it took one."""
    master = _store()
    with _mgr() as mgr, _mgr() as first:
        out, old = _transfer(mgr, master, 0, 1, 1.0), _transfer(first, master, 1, 0, 5.0)
        _export(mgr, "a", 1.0)
        _deliver(out, old, "a")  # the pair between the sender and the first receiver is built and used
        _export(mgr, "b", 2.0)
        with pytest.raises(mc.TransferError, match="nothing was sent"):
            out.send()  # the first receiver is gone: withdrawn at the timeout
        with _mgr() as second:
            new = _transfer(second, master, 1, 0, 5.0)
            _deliver(out, new, "b", "the new receiver did not take the first batch sent after it came")
            _imported(second, 1, "b", 2.0, release=False)
        first.discard_arrived("a")
        first.flush_nowait()
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def test_a_batch_refused_before_the_receivers_go_costs_no_gloo_pair() -> None:
    """A landing that fails before ``go`` (here: an id that arrived already and awaits its import) is answered
    as a refusal, ``refuse:failed``: nothing went over the pair, as for a withdrawn header. The sender took any
    ``failed`` for one after the bytes, bumped its epoch and retired its gloo pair, and the receiver retired its
    own at the next batch: a ProcessGroupGloo per side per such refusal, kept for the life of the process."""
    import mambacache._handoff._link as link

    master = _store()
    with _mgr(host=3) as mgr, _mgr(host=3) as peer:
        out, into = _transfer(mgr, master, 0, 1, 5.0), _transfer(peer, master, 1, 0, 5.0)
        retired = []
        for k in range(2):
            rid = f"a{k}"
            _export(mgr, rid, float(k))
            _deliver(out, into, rid)
            _export(mgr, rid, float(k))  # the same id again while the first awaits its import there
            thread, sent = _in_thread(out.send)
            with pytest.raises(mc.SlotStateError, match="arrived twice"):
                into.receive()
            thread.join(10)
            assert isinstance(sent[0], mc.TransferRefusedError) and sent[0].reason == "failed", sent
            peer.discard_arrived(rid)
            peer.flush_nowait()
            _deliver(out, into, rid, "the batch refused before go, sent again")
            peer.discard_arrived(rid)
            peer.flush_nowait()
            retired.append(len(link._RETIRED))
        assert retired[0] == retired[-1], f"gloo pairs retired after each round: {retired}"
        mgr.flush_nowait()
        mgr.check_idle(host=True)
        peer.check_idle(host=True)


def test_two_senders_of_one_rank_that_take_turns_to_one_receiver_deliver_every_batch() -> None:
    """Two transfers on rank 0 (two managers) send to one receiver on rank 1 in turns, sharing the direction.
    The receiver kept one gloo pair: S2's batch retired the pair it had with S1, and S1's next batch rebuilt a
    pair of the same name (S1's epoch had not moved) while S1 still held its end of the old one, over stale
    rendezvous keys: the bytes timed out, every other batch, for as long as the two took turns."""
    master = _store()
    with _mgr() as m1, _mgr() as m2, _mgr(host=4) as peer:
        s1, s2 = _transfer(m1, master, 0, 1, 2.0), _transfer(m2, master, 0, 1, 2.0)
        into = _transfer(peer, master, 1, 0, 2.0)
        for k, (out, mgr) in enumerate([(s1, m1), (s2, m2), (s1, m1), (s2, m2)]):
            rid = f"x{k}"
            _export(mgr, rid, float(k))
            thread, sent = _in_thread(out.send)
            got = into.receive()
            thread.join(10)
            assert got == [rid] and sent == [[rid]], f"batch {k}: {sent}"
            peer.discard_arrived(rid)
            peer.flush_nowait()
        for mgr in (m1, m2):
            mgr.flush_nowait()
            mgr.check_idle(host=True)
