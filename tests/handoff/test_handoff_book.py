"""An export's life on the sender (``_handoff/_book.py``): queued, ready, sending, then delivered or withdrawn.

The rules a scheduler relies on: the exported slot stays held by its request
until the peer acknowledges; a release before or after a send withdraws the
export (its staging slot is dropped, nothing is sent); a release while a send
awaits the ack is refused with nothing changed (the peer may or may not hold
the state); a hand-over or a second export of an exporting slot is refused;
the delivery releases and drops all of a batch or none. A state machine
against a model of that diagram, plus the cases one by one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import mambacache as mc
from mambacache.testing import fail_at_op

from ..support.util import small_spec

SLOTS, HOST = 4, 6


def _manager() -> mc.CacheManager:
    spec = small_spec(2)
    return mc.CacheManager(mc.StatePool(spec, SLOTS), host_pool=mc.HostPool(spec, HOST), max_failed_flushes=10**6)


def _state(mgr: mc.CacheManager) -> tuple[object, ...]:
    assert mgr.host_pool is not None
    return mgr.held(), mgr.queued(), mgr.host_pool.held(), mgr.exports_ready()


def test_a_release_before_the_send_withdraws_the_export() -> None:
    with _manager() as mgr:
        (s,) = mgr.alloc(1, "r")
        h = mgr.export(s, "r")
        mgr.flush_nowait()
        assert [ev.slot for ev in mgr.exports_ready()] == [s]
        mgr.release(s, "r")
        assert mgr.exports_ready() == [] and mgr.take_exports() == []
        assert mgr.queued()[-1] == mc.DropHost(h)
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def test_a_release_in_the_exports_own_step_withdraws_it_after_the_staging_copy() -> None:
    with _manager() as mgr:
        (s,) = mgr.alloc(1, "r")
        h = mgr.export(s, "r")
        mgr.release(s, "r")
        assert mgr.queued()[-3:] == [mc.Export(s, h, "r"), mc.Release(s, "r"), mc.DropHost(h)]
        mgr.flush_nowait()
        assert mgr.exports_ready() == []
        mgr.check_idle(host=True)


def test_a_release_while_sending_is_refused_and_changes_nothing_then_allowed_once_returned() -> None:
    with _manager() as mgr:
        a, b = mgr.alloc(2, "r")
        mgr.export(a, "r")
        mgr.flush_nowait()
        taken = mgr.take_exports()
        assert [ev.slot for ev in taken] == [a]
        before = _state(mgr)
        for call in (lambda: mgr.release(a, "r"), lambda: mgr.release_many([b, a], "r")):
            with pytest.raises(mc.SlotStateError, match="being sent"):
                call()
            assert _state(mgr) == before
        assert mgr.take_exports() == []  # a second send does not ship it twice
        mgr.exports_returned(taken)
        mgr.release(a, "r")
        mgr.release(b, "r")
        mgr.flush_nowait()
        mgr.check_idle(host=True)


@pytest.mark.parametrize("call", ["hand_over", "export"])
def test_an_exporting_slot_cannot_be_handed_over_or_exported_again(call: str) -> None:
    with _manager() as mgr:
        (s,) = mgr.alloc(1, "r")
        mgr.export(s, "r")
        before = _state(mgr)
        with pytest.raises(mc.SlotStateError, match="exporting"):
            mgr.hand_over(s, "cache", "r") if call == "hand_over" else mgr.export(s, "r")
        assert _state(mgr) == before


def test_delivery_releases_and_drops_the_whole_batch_and_on_a_closed_manager_settles_at_once() -> None:
    mgr = _manager()
    with mgr:
        slots = mgr.alloc(3, "r")
        for i, s in enumerate(slots):
            mgr.hand_over(s, f"r{i}", "r")
            mgr.export(s, f"r{i}")
        mgr.flush_nowait()
        taken = mgr.take_exports()
        mgr.exports_delivered(taken[:2])
        mgr.exports_delivered(taken[:2])  # a repeated ack changes nothing more
        assert mgr.held() == {slots[2]: "r2"}
        last = mgr.take_exports() or taken[2:]
        mgr.flush_nowait()
    assert mgr.held() == {slots[2]: "r2"}
    with pytest.raises(mc.ManagerClosedError):
        mgr.take_exports()
    mgr.exports_delivered(last)  # acknowledged after the close: released at once, nothing left for the next manager
    assert mgr.held() == {} and mgr.host_pool is not None and mgr.host_pool.held() == {}


def test_a_pool_state_staged_then_withdrawn_is_not_what_a_later_export_sends() -> None:
    with _manager() as mgr:
        (s,) = mgr.alloc(1, "r")
        mgr.flush_nowait()
        mgr.pool.temporal[:, s] = 1.0
        mgr.export(s, "r")
        mgr.flush_nowait()
        mgr.release(s, "r")
        (t,) = mgr.alloc(1, "q")
        mgr.flush_nowait()
        mgr.pool.temporal[:, t] = 2.0
        h = mgr.export(t, "q")
        mgr.flush_nowait()
        (ev,) = mgr.take_exports()
        assert ev.host == h and ev.request_id == "q"
        assert mgr.host_pool is not None
        assert torch.equal(mgr.host_pool.temporal[:, h], torch.full_like(mgr.host_pool.temporal[:, h], 2.0))
        mgr.exports_returned([ev])


def test_an_arrived_state_is_imported_once_or_discarded_once() -> None:
    with _manager() as mgr:
        (h,) = mgr.land(["r"])
        assert mgr.host_pool is not None and mgr.host_pool.held() == {h: "r"}
        before = _state(mgr)
        for bad in ("q", 3):
            with pytest.raises((mc.SlotStateError, mc.InvalidArgumentError)):
                mgr.discard_arrived(bad)  # type: ignore[arg-type]
            assert _state(mgr) == before
        assert mgr.discard_arrived("r") == h
        with pytest.raises(mc.SlotStateError, match="no state"):
            mgr.import_into(1, "r")
        with pytest.raises(mc.SlotStateError):
            mgr.discard_arrived("r")
        mgr.flush_nowait()
        mgr.check_idle(host=True)
        assert mgr.land(["r"]) == [h]  # the id may arrive again once its state is gone (its slot is free again)
        mgr.import_into(1, "r")
        with pytest.raises(mc.SlotStateError):
            mgr.discard_arrived("r")
        mgr.release(1, "r")
        mgr.flush_nowait()
        mgr.check_idle(host=True)


PEERS = (None, 1, 2)


class ExportLife(RuleBasedStateMachine):
    """The sender's export lifecycle against a model: slot -> "queued" | "ready" | "sending", each export with its
    destination. A flush may fail (a fault in its first op): its exports stay unready until a flush succeeds (the
    repair), since readiness is work done, not a step number. A send may fail in doubt with its peer: the book
    then names the batch it may have landed under to every later sender, and an unaddressed export goes to that
    peer only, until it is delivered or withdrawn (or returned not in doubt)."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = _manager()
        self.mgr.__enter__()
        self.model: dict[int, str] = {}
        self.to: dict[int, int | None] = {}
        self.held: dict[int, str] = {}
        self.taken: list[tuple[list[mc.Export], int | None]] = []
        self.pin: dict[int, int] = {}  # slot -> the peer its unaddressed export may be at (in doubt)
        self.doubt: dict[int, tuple[str, int]] = {}  # slot -> the batch it may have landed under
        self.n = 0

    def teardown(self) -> None:
        self.mgr.__exit__(None, None, None)

    @precondition(lambda self: len(self.held) < SLOTS)
    @rule()
    def alloc(self) -> None:
        self.n += 1
        (s,) = self.mgr.alloc(1, f"r{self.n}")
        self.held[s] = f"r{self.n}"

    @rule(data=st.data(), to=st.sampled_from(PEERS))
    def export(self, data: st.DataObject, to: int | None) -> None:
        if not self.held:
            return
        s = data.draw(st.sampled_from(sorted(self.held)))
        if s in self.model:
            with pytest.raises(mc.SlotStateError):
                self.mgr.export(s, self.held[s], to=to)
            return
        try:
            self.mgr.export(s, self.held[s], to=to)
        except mc.PoolExhaustedError:
            assert self.mgr.host_pool is not None and self.mgr.host_pool.num_free == 0
            return
        self.model[s] = "queued"
        self.to[s] = to

    @rule(fail=st.booleans())
    def flush(self, fail: bool) -> None:
        try:
            with fail_at_op(1 if fail else 0, RuntimeError):
                self.mgr.flush_nowait()
        except mc.ExecutorError:
            assert fail and self.mgr.unfinished >= 1
            return  # taken, not run: nothing it staged is ready
        self.model = {s: ("ready" if v == "queued" else v) for s, v in self.model.items()}

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.held:
            return
        s = data.draw(st.sampled_from(sorted(self.held)))
        if self.model.get(s) == "sending":
            with pytest.raises(mc.SlotStateError):
                self.mgr.release(s, self.held[s])
            return
        self.mgr.release(s, self.held.pop(s))
        self.model.pop(s, None)
        self.pin.pop(s, None)
        self.doubt.pop(s, None)

    def _for(self, to: int | None) -> list[int]:
        return sorted(
            s
            for s, v in self.model.items()
            if v == "ready" and (to is None or self.to[s] == to or (self.to[s] is None and self.pin.get(s, to) == to))
        )

    @rule(to=st.sampled_from(PEERS))
    def take(self, to: int | None) -> None:
        got = self.mgr.take_exports(to=to)
        assert sorted(ev.slot for ev in got) == self._for(to)
        assert all(ev.to == self.to[ev.slot] for ev in got)
        for ev in got:
            self.model[ev.slot] = "sending"
        if got:
            self.taken.append((got, to))

    @precondition(lambda self: self.taken)
    @rule(how=st.sampled_from(["delivered", "returned", "in doubt", "refused"]))
    def settle(self, how: str) -> None:
        batch, to = self.taken.pop(0)
        if how == "delivered":
            self.mgr.exports_delivered(batch)
            for ev in batch:
                del self.model[ev.slot]
                del self.held[ev.slot]
                self.pin.pop(ev.slot, None)
                self.doubt.pop(ev.slot, None)
            return
        # "returned": sent nowhere (no peer): each record stays; "refused" by ``to`` (a retry): in doubt under no
        # batch, still ``to``'s; "in doubt" with ``to``: under a batch of its own.
        peer = None if how == "returned" else to
        ident = ("t", self.n) if how == "in doubt" and peer is not None else None
        self.mgr.exports_returned(batch, peer=peer, batch=ident)
        for ev in batch:
            self.model[ev.slot] = "ready"
            if peer is None:
                continue
            if ev.to is None:
                self.pin[ev.slot] = peer
            if ident is None:
                self.doubt.pop(ev.slot, None)
            else:
                self.doubt[ev.slot] = ident

    @invariant()
    def the_book_names_each_batch_in_doubt(self) -> None:
        ready = self.mgr.exports_ready()
        assert self.mgr.exports_in_doubt(ready) == [self.doubt.get(ev.slot) for ev in ready]

    @invariant()
    def agrees(self) -> None:
        assert self.mgr.held() == self.held
        for to in PEERS:
            assert sorted(ev.slot for ev in self.mgr.exports_ready(to=to)) == self._for(to)

    @invariant()
    def the_book_keeps_one_record_per_export_in_its_phase(self) -> None:
        book = self.mgr._handoff
        assert book is not None
        want = {s: "sending" if v == "sending" else "waiting" for s, v in self.model.items()}
        assert {s: x.phase.value for s, x in book.exports.items()} == want
        assert book.hosts == {x.event.host: x for x in book.exports.values() if x.event.host is not None}
        assert all(x.peer == self.pin.get(s) and x.batch == self.doubt.get(s) for s, x in book.exports.items())

    @invariant()
    def host_slots_are_the_exports_in_the_book(self) -> None:
        host = self.mgr.host_pool
        assert host is not None
        # Drops free their host slot for the next step: count held ones net of queued drops.
        dropped = sum(isinstance(ev, mc.DropHost) for ev in self.mgr.queued())
        assert len(host.held()) - dropped <= len(self.model) <= len(host.held())


ExportLife.TestCase.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
test_export_life = ExportLife.TestCase


@pytest.mark.parametrize("in_place", [False, True])
def test_two_exports_of_one_request_that_could_share_a_batch_are_refused_not_wedging_the_transfer(
    in_place: bool,
) -> None:
    """A peer imports one state per request id and refuses a batch naming one twice (its header, before any byte),
    so two exports of ``r`` (two slots it holds) went into every batch and every send was refused, for good, with
    every other export behind them (``q`` never delivered). Now the second export is refused (nothing changed)
    unless the two go to two peers; the real transfer (two threads, a TCPStore) then delivers the rest."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))

    def client() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=5))

    with _manager() as send, _manager() as recv:
        a, b = send.alloc(2, "r")
        (c,) = send.alloc(1, "q")
        send.export(a, "r", in_place=in_place, to=1)
        before = _state(send)
        for to in (None, 1):
            with pytest.raises(mc.SlotStateError, match="exported already"):
                send.export(b, "r", in_place=in_place, to=to)
            assert _state(send) == before
        send.export(b, "r", in_place=in_place, to=2)  # to another peer: never in one batch with the first
        send.export(c, "q", in_place=in_place)
        send.flush_nowait()
        xs = mc.StateTransfer(send, None, peer=1, store=client(), rank=0, timeout=5.0)
        xr = mc.StateTransfer(recv, None, peer=0, store=client(), rank=1, timeout=5.0)
        got: list[object] = []
        thread = threading.Thread(target=lambda: got.append(xr.receive()))
        thread.start()
        assert xs.send() == ["r", "q"]
        thread.join(10)
        assert got == [["r", "q"]]
        send.release(b, "r")  # withdrawn: the peer at rank 2 never came
        send.flush_nowait()
        send.check_idle(host=True)
