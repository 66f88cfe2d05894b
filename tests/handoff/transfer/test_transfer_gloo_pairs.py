"""The gloo pairs of a transfer's link: a withdrawn header or a batch refused before the receiver's go costs no
pair, a receiver that took a withdrawn one's rank gets a pair of its own, and two senders of one rank that take
turns to one receiver deliver every batch. The real link in one process (``tests/support/link.py``).
"""

from __future__ import annotations

import pytest

import mambacache as mc

from ...support.link import deliver as _deliver
from ...support.link import export_valued as _export
from ...support.link import imported as _imported
from ...support.link import in_thread as _in_thread
from ...support.link import small_manager as _mgr
from ...support.link import store as _store
from ...support.link import transfer as _transfer
from ...support.util import small_spec

SPEC = small_spec(2)


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
