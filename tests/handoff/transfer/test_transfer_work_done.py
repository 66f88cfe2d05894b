"""The hand-off keyed on work done (issue #32): readiness, landing, protection, closing, routing, bad input.

* A landing never takes a host slot that unfinished work reads: a failed flush
  awaiting its repair, or a flush in progress in another thread.
* An export is ready once the stage that staged it has run, not once a flush
  took it (a step number).
* A transfer's staging host slots are refused by every other call.
* ``take_exports`` on a closed manager raises; a close waits for a send in
  flight, whose delivery then settles both slots.
* ``export(to=peer)`` routes; the transfer surface refuses bad input, typed.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any

import pytest
import torch

import mambacache as mc
from mambacache.testing import fail_at_op

from ...support.gate import flush_paused, resume
from ...support.loopback import loopback
from ...support.util import small_spec

pytestmark = pytest.mark.no_transport  # stand-in wires and the managers' own calls: no transfer made

SPEC = small_spec(2)


def _mgr(slots: int = 4, host: int = 2, **kw: Any) -> mc.CacheManager:
    return mc.CacheManager(mc.StatePool(SPEC, slots), host_pool=mc.HostPool(SPEC, host), **kw)


def _fill(tensors: list[torch.Tensor], index: int, value: float) -> None:
    for t in tensors:
        t[:, index] = value


def _holds(tensors: list[torch.Tensor], index: int, value: float) -> bool:
    return all(bool((t[:, index] == value).all()) for t in tensors)


def _arrive(mgr: mc.CacheManager, rid: str, value: float) -> int:
    """What StateTransfer.receive does for one state: land it, write its bytes into the staging slot."""
    (h,) = mgr.land([rid])
    assert mgr.host_pool is not None
    _fill(mgr.host_pool.tensors, h, value)
    return h


def _state(mgr: mc.CacheManager) -> tuple[Any, ...]:
    host = mgr.host_pool
    assert host is not None
    return mgr.held(), host.held(), mgr.queued(), mgr.exports_ready(), [t.clone() for t in host.tensors]


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[:4] == b[:4] and all(torch.equal(x, y) for x, y in zip(a[4], b[4], strict=True))


# -- defect 1: landing over unfinished work ---------------------------------------------------------------------
def test_a_landing_after_a_failed_flush_never_takes_the_host_slot_its_import_still_reads() -> None:
    with _mgr() as mgr:
        h = _arrive(mgr, "a", 1.0)
        mgr.import_into(1, "a")  # the restore of h into slot 1 is queued, h freed for the next step
        with pytest.raises(mc.ExecutorError), fail_at_op(1, RuntimeError):
            mgr.flush_nowait()  # the restore failed: it waits in the backlog for the repair
        assert mgr.unfinished == 1
        other = _arrive(mgr, "b", 2.0)  # the next state arrives before the repair
        assert other != h, "the landing took the host slot the unfinished import still reads"
        mgr.flush_nowait()  # the repair
        assert _holds(mgr.pool.tensors, 1, 1.0), "the repaired import read another request's bytes"
        mgr.import_into(2, "b")
        mgr.flush_nowait()
        assert _holds(mgr.pool.tensors, 2, 2.0)


def test_a_landing_while_another_thread_flushes_never_takes_the_host_slot_being_read() -> None:
    with _mgr() as mgr:
        h = _arrive(mgr, "a", 1.0)
        mgr.import_into(1, "a")
        f = flush_paused(mgr, 1)  # the step loop's flush took the import and is about to run its restore
        assert f.thread.is_alive()
        other = _arrive(mgr, "b", 2.0)  # receive_async's thread lands meanwhile
        assert resume(f) is None
        assert other != h
        assert _holds(mgr.pool.tensors, 1, 1.0), "the import read the bytes landed during its flush"


def test_a_landing_with_only_busy_host_slots_is_refused_and_changes_nothing_then_succeeds() -> None:
    with _mgr(host=1) as mgr:
        _arrive(mgr, "a", 1.0)
        mgr.import_into(1, "a")
        with pytest.raises(mc.ExecutorError), fail_at_op(1, RuntimeError):
            mgr.flush_nowait()
        before = _state(mgr)
        with pytest.raises(mc.PoolExhaustedError, match="once queued or unfinished work"):
            mgr.land(["b"])
        assert _same(_state(mgr), before)
        mgr.flush_nowait()
        assert _arrive(mgr, "b", 2.0) == 1  # read by the repair: free for a landing now
        assert _holds(mgr.pool.tensors, 1, 1.0)


def test_a_landing_on_the_next_manager_waits_for_the_backlog_the_last_one_left() -> None:
    pool, host = mc.StatePool(SPEC, 4), mc.HostPool(SPEC, 2)
    old = mc.CacheManager(pool, host_pool=host)
    old.__enter__()
    h = _arrive(old, "a", 1.0)
    old.import_into(1, "a")
    with pytest.raises(mc.ExecutorError), fail_at_op(1, RuntimeError):
        old.__exit__(None, None, None)  # its last flush failed: the import stays in the pool's backlog
    assert pool.unfinished == 1
    with mc.CacheManager(pool, host_pool=host) as new:
        assert _arrive(new, "b", 2.0) != h  # work done outlives the manager: the backlog's tickets
        new.flush_nowait()  # runs the old manager's import first
        assert _holds(pool.tensors, 1, 1.0)
        new.release(1)
        new.discard_arrived("b")
        new.flush_nowait()
        new.check_idle(host=True)


# -- defect 2: ready on work done ----------------------------------------------------------------------------------
def test_an_export_is_not_ready_while_the_flush_that_stages_it_is_still_running() -> None:
    with _mgr() as mgr:
        (s,) = mgr.alloc(1, "r", clear=False)
        mgr.flush_nowait()
        mgr.export(s, "r")
        f = flush_paused(mgr, 1)  # taken, the step advanced, the staging copy not run
        assert f.thread.is_alive() and mgr.step == 2  # (paused in planning, unfinished would even be 0)
        assert mgr.exports_ready() == [] and mgr.take_exports() == []
        assert resume(f) is None
        assert [ev.slot for ev in mgr.exports_ready()] == [s]


def test_an_export_whose_flush_failed_is_ready_only_once_the_repair_staged_it() -> None:
    with _mgr() as mgr:
        (s,) = mgr.alloc(1, "r", clear=False)
        mgr.flush_nowait()
        mgr.pool.temporal[:, s] = 5.0
        h = mgr.export(s, "r")
        with pytest.raises(mc.ExecutorError), fail_at_op(1, RuntimeError):
            mgr.flush_nowait()
        assert mgr.exports_ready() == [] and mgr.take_exports() == []
        (t,) = mgr.alloc(1, "q")  # a later step queued behind the failed one does not make it ready either
        assert mgr.exports_ready() == []
        mgr.flush_nowait()
        (ev,) = mgr.take_exports()
        assert (ev.slot, ev.host) == (s, h)
        assert mgr.host_pool is not None and bool((mgr.host_pool.temporal[:, h] == 5.0).all())
        mgr.exports_delivered([ev])
        mgr.release(t, "q")
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def test_exports_of_earlier_steps_stay_ready_while_a_later_flush_is_unfinished() -> None:
    with _mgr(host=3) as mgr:
        a, b = mgr.alloc(2, "r", clear=False)
        mgr.flush_nowait()
        mgr.export(a, "r")
        mgr.flush_nowait()
        mgr.hand_over(b, "q", "r")
        mgr.export(b, "q")
        with pytest.raises(mc.ExecutorError), fail_at_op(1, RuntimeError):
            mgr.flush_nowait()
        assert [ev.slot for ev in mgr.exports_ready()] == [a]  # its staging copy ran a step before
        mgr.flush_nowait()
        assert [ev.slot for ev in mgr.exports_ready()] == [a, b]


# -- defect 3: a transfer's host slots are the transfer's -----------------------------------------------------------
@pytest.mark.parametrize("role", ["exporting", "staged", "arrived"])
@pytest.mark.parametrize("call", ["drop", "restore", "restore_keep", "restore_many"])
def test_drop_and_restore_of_a_transfers_host_slot_are_refused_and_change_nothing(role: str, call: str) -> None:
    with _mgr(host=3) as mgr:
        (s, t) = mgr.alloc(2, "r")
        if role == "arrived":
            h = _arrive(mgr, "x", 3.0)
        else:
            h = mgr.export(s, "r")
            if role == "staged":
                mgr.flush_nowait()
        before = _state(mgr)
        calls = {
            "drop": lambda: mgr.drop(h),
            "restore": lambda: mgr.restore(h, t, "r"),
            "restore_keep": lambda: mgr.restore(h, t, "r", keep=True),
            "restore_many": lambda: mgr.restore_many([h], [t], "r"),
        }
        with pytest.raises(mc.SlotStateError, match="staging slot"):
            calls[call]()
        assert _same(_state(mgr), before)
        # The transfer's own calls still end it, and the slot is an ordinary one after.
        if role == "arrived":
            mgr.discard_arrived("x")
        mgr.release(s, "r")  # withdraws the export, if any
        mgr.flush_nowait()
        h2 = mgr.offload(t, "r")
        mgr.drop(h2)
        mgr.release(t, "r")
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def test_a_plain_offloads_host_slot_is_still_dropped_and_restored_freely() -> None:
    with _mgr(host=3) as mgr:
        (s,) = mgr.alloc(1, "r")
        mgr.export(s, "r")
        (t,) = mgr.alloc(1, "q")
        h = mgr.offload(t, "q")
        mgr.restore(h, t, "q", keep=True)
        mgr.restore_many([h], [t], "q")
        with pytest.raises(mc.SlotStateError):
            mgr.drop(h)  # restored without keep: gone already
        mgr.flush_nowait()


# -- defect 4: a closed manager ------------------------------------------------------------------------------------
def test_take_exports_on_a_closed_or_closing_manager_raises_before_anything_is_taken() -> None:
    mgr = _mgr()
    with mgr:
        (s,) = mgr.alloc(1, "r")
        mgr.export(s, "r")
        mgr.flush_nowait()
        assert len(mgr.exports_ready()) == 1
    with pytest.raises(mc.ManagerClosedError):
        mgr.take_exports()
    with pytest.raises(mc.ManagerClosedError):
        mgr.take_exports(to=1)


def test_a_send_in_flight_across_the_close_is_delivered_and_frees_both_slots_for_the_next_manager() -> None:
    mgr = _mgr()
    with mgr:
        (s,) = mgr.alloc(1, "r")
        mgr.export(s, "r")
        mgr.flush_nowait()
        taken = mgr.take_exports()  # a send awaits the peer's ack while the engine shuts down
    assert mgr.host_pool is not None
    with pytest.raises(mc.InvalidArgumentError, match="already managed"):
        mc.CacheManager(mgr.pool, host_pool=mgr.host_pool).__enter__()  # the pool is its until the send settles
    done = threading.Thread(target=mgr.exports_delivered, args=(taken,))  # the ack arrives: no error
    done.start()
    done.join()
    assert mgr.held() == {} and mgr.host_pool.held() == {}
    mgr.exports_delivered(taken)  # a repeated ack changes nothing more
    with mc.CacheManager(mgr.pool, host_pool=mgr.host_pool) as again:
        again.check_idle(host=True)  # nothing left held for the next manager


def test_a_send_that_fails_after_the_close_frees_its_slots_too() -> None:
    mgr = _mgr(host=3)
    with mgr:
        (a,) = mgr.alloc(1, "r")
        (b,) = mgr.alloc(1, "q")
        mgr.export(a, "r")
        mgr.flush_nowait()
        taken = mgr.take_exports()
        mgr.export(b, "q")  # not sent: stays held by its request after the close, as any held slot
    mgr.exports_returned(taken)
    assert mgr.held() == {b: "q"} and mgr.host_pool is not None and len(mgr.host_pool.held()) == 1
    with mc.CacheManager(mgr.pool, host_pool=mgr.host_pool):
        pass  # the ledgers are free again


def test_a_manager_that_breaks_while_a_send_awaits_its_ack_still_takes_the_delivery() -> None:
    mgr = _mgr(max_failed_flushes=1)
    mgr.__enter__()
    (s,) = mgr.alloc(1, "r")
    mgr.export(s, "r")
    mgr.flush_nowait()
    taken = mgr.take_exports()
    (t,) = mgr.alloc(1, "q")
    with pytest.raises(mc.ManagerBrokenError), fail_at_op(1, RuntimeError):
        mgr.flush_nowait()  # another thread's flush breaks the manager meanwhile
    mgr.exports_delivered(taken)  # the peer holds the state: not reported lost
    assert mgr.held() == {t: "q"}
    with pytest.raises(mc.ManagerBrokenError):
        mgr.take_exports()  # nothing new goes on the wire
    with pytest.raises(mc.ManagerBrokenError):
        mgr.__exit__(None, None, None)  # leaving re-raises that it broke


# -- defect 6's transfer-surface input checks -------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [[5], ["a", 5], "ab", ("a",), [None], [b"a"]])
def test_land_takes_a_list_of_str_ids_else_a_typed_error_and_nothing_changed(bad: Any) -> None:
    with _mgr() as mgr:
        before = _state(mgr)
        with pytest.raises(mc.InvalidArgumentError):
            mgr.land(bad)
        assert _same(_state(mgr), before)


def test_the_transfer_surface_without_a_host_pool_is_a_typed_error() -> None:
    with mc.CacheManager(mc.StatePool(SPEC, 2)) as mgr:
        for call in (
            lambda: mgr.land(["a"]),
            mgr.exports_ready,
            mgr.take_exports,
            lambda: mgr.exports_delivered([]),
            lambda: mgr.exports_returned([]),
            lambda: mgr.discard_arrived("a"),
        ):
            with pytest.raises(mc.InvalidArgumentError, match="host pool"):
                call()


@pytest.mark.parametrize("bad", ["ab", [1], [mc.Offload(1, 1)], None, mc.Export(1, 1, "r")])
def test_exports_delivered_and_returned_take_export_lists_else_a_typed_error(bad: Any) -> None:
    with _mgr() as mgr:
        (s,) = mgr.alloc(1, "r")
        mgr.export(s, "r")
        mgr.flush_nowait()
        taken = mgr.take_exports()
        before = _state(mgr)
        for call in (mgr.exports_delivered, mgr.exports_returned):
            with pytest.raises(mc.InvalidArgumentError):
                call(bad)
            assert _same(_state(mgr), before)
        mgr.exports_returned(taken)


# -- routing ---------------------------------------------------------------------------------------------------------
def test_exports_are_taken_by_the_transfer_to_their_peer_or_by_any_when_unaddressed() -> None:
    with _mgr(slots=6, host=6) as mgr:
        slots = mgr.alloc(5, "r")
        to = {slots[0]: 1, slots[1]: 2, slots[2]: None, slots[3]: 1, slots[4]: 3}
        for s in slots:
            mgr.hand_over(s, f"r{s}", "r")
            h = mgr.export(s, f"r{s}", to=to[s])
            assert mgr.queued()[-1] == mc.Export(s, h, f"r{s}", to[s])
        mgr.flush_nowait()

        def peers(exports: list[mc.Export]) -> list[int | None]:
            return [ev.to for ev in exports]

        assert peers(mgr.exports_ready()) == [1, 2, None, 1, 3]
        assert peers(mgr.exports_ready(to=1)) == [1, None, 1]
        assert peers(mgr.exports_ready(to=4)) == [None]
        two = mgr.take_exports(to=2)
        assert peers(two) == [2, None]
        assert peers(mgr.take_exports(to=1)) == [1, 1]  # the unaddressed one went with the first send
        assert peers(mgr.exports_ready()) == [3]
        mgr.exports_returned(two)
        assert peers(mgr.exports_ready(to=3)) == [None, 3]
        assert peers(mgr.exports_ready(to=2)) == [2, None]


@pytest.mark.parametrize("bad", [-1, True, 1.0, "1", [1]])
def test_a_bad_destination_is_a_typed_error_and_changes_nothing(bad: Any) -> None:
    with _mgr() as mgr:
        (s,) = mgr.alloc(1, "r")
        before = _state(mgr)
        with pytest.raises(mc.InvalidArgumentError, match="peer's rank"):
            mgr.export(s, "r", to=bad)
        for call in (mgr.exports_ready, mgr.take_exports):
            with pytest.raises(mc.InvalidArgumentError, match="peer's rank"):
                call(to=bad)
        assert _same(_state(mgr), before)


def test_three_managers_every_state_reaches_the_peer_it_was_exported_to() -> None:
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(_mgr(slots=6, host=6))
        decode = {p: stack.enter_context(_mgr(slots=6, host=6)) for p in (1, 2)}
        slots = prefill.alloc(6, "r", clear=False)
        prefill.flush_nowait()
        for i, s in enumerate(slots):
            prefill.hand_over(s, f"r{i}", "r")
            prefill.pool.temporal[:, s] = float(i)
            prefill.export(s, f"r{i}", to=1 + i % 2)
        prefill.flush_nowait()
        got = {p: loopback(prefill, decode[p], to=p) for p in (2, 1)}
        assert got == {1: ["r0", "r2", "r4"], 2: ["r1", "r3", "r5"]}
        for p, mgr in decode.items():
            for rid in got[p]:
                (slot,) = mgr.alloc(1, rid, clear=False)
                mgr.release(slot, rid)
                mgr.import_into(slot, rid)
                mgr.flush_nowait()
                assert bool((mgr.pool.temporal[:, slot] == float(rid[1:])).all())
                mgr.release(slot, rid)
            mgr.flush_nowait()
            mgr.check_idle(host=True)
        prefill.flush_nowait()
        prefill.check_idle(host=True)


# -- threads: a step loop flushing with faults, a transfer thread landing and sending ----------------------------
def test_a_step_loop_flushing_with_faults_while_another_thread_sends_and_lands_loses_nothing() -> None:
    """The transfer thread exports on the prefill manager and lands each state on the decode manager; the decode
    step loop imports each one as it arrives and flushes, every other flush failing once and repaired a little
    later. Every imported slot must read its own request's bytes."""
    n = 30

    def value(i: int) -> float:
        return float(i % 100 + 1)

    arrived: queue.Queue[str] = queue.Queue()
    errors: list[BaseException] = []
    with _mgr(slots=4, host=4) as prefill, _mgr(slots=2, host=2) as decode:

        def transfer_thread() -> None:
            try:
                for i in range(n):
                    rid = f"r{i}"
                    (s,) = prefill.alloc(1, rid, clear=False)
                    prefill.flush_nowait()
                    prefill.pool.temporal[:, s] = value(i)  # the prefill forward
                    prefill.export(s, rid)
                    prefill.flush_nowait()
                    while True:
                        try:
                            ids = loopback(prefill, decode)
                            break
                        except mc.PoolExhaustedError:
                            threading.Event().wait(0.0005)  # the decode side has no settled host slot yet
                    for got in ids:
                        arrived.put(got)
            except BaseException as exc:
                errors.append(exc)
                arrived.put("")

        worker = threading.Thread(target=transfer_thread, daemon=True)
        worker.start()
        faults = 0
        for k in range(n):
            rid = arrived.get(timeout=60)
            assert not errors, errors
            decode.import_into(1, rid)
            if k % 2:
                with pytest.raises(mc.ExecutorError), fail_at_op(1, RuntimeError):
                    decode.flush_nowait()
                faults += 1
                threading.Event().wait(0.002)  # the repair comes later: the other thread lands meanwhile
            decode.flush_nowait()
            assert bool((decode.pool.temporal[:, 1] == value(int(rid[1:]))).all()), f"{rid} read other bytes"
            decode.release(1, rid)
        worker.join(60)
        assert not errors, errors
        assert faults == n // 2
        prefill.flush_nowait()
        decode.flush_nowait()
        prefill.check_idle(host=True)
        decode.check_idle(host=True)
