"""Exports in place (issue #32's cost): the send reads the pool slot itself, no staging copy, no host slot.

What a scheduler relies on: ``export(s, r, in_place=True)`` queues no event and
takes no host slot; the export is ready once the flush that takes the events
queued before it ran (a failed flush: once its repair ran); until the peer
acknowledges, every call that would write ``s`` is refused with nothing
changed, while reads of it go on; a release before the send withdraws it
(nothing to drop); the delivery releases ``s``. The bytes sent are those of
``s`` on every pool layout (stacked, paged rows, separately allocated layers),
straight from the slot rows when they are one run of contiguous host memory.
Over real gloo: ``tests/handoff/transfer/test_transfer_link.py``'s "every wire layout".
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from structlog.testing import capture_logs

import mambacache as mc
from mambacache import tracing
from mambacache._core import _tracer
from mambacache._handoff._link import messages
from mambacache._handoff._transfer import export_rows
from mambacache.testing import fail_at_op
from mambacache.tracing import analyze_lines

from ...support.layered import layered_pool, pool_tensors
from ...support.link import in_thread as _in_thread
from ...support.link import store as _store
from ...support.link import transfer as _transfer
from ...support.loopback import loopback, stand_in_transfer
from ...support.util import fill_random, paged_pool, quant_spec, small_spec

SPEC = small_spec(3)


def _manager(pool: mc.StatePool | None = None) -> mc.CacheManager:
    pool = pool if pool is not None else mc.StatePool(SPEC, 6)
    return mc.CacheManager(pool, host_pool=mc.HostPool(pool.spec, 4), max_failed_flushes=100)


def _state(mgr: mc.CacheManager) -> tuple[object, ...]:
    host = mgr.host_pool
    assert host is not None
    tensors = [t.clone() for t in pool_tensors(mgr.pool)]
    return mgr.held(), mgr.queued(), host.held(), mgr.exports_ready(), tensors


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    *rest_a, ta = a
    *rest_b, tb = b
    return rest_a == rest_b and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))  # type: ignore[call-overload]


@pytest.mark.no_transport
def test_an_export_in_place_queues_nothing_takes_no_host_slot_and_is_ready_after_the_next_flush() -> None:
    with _manager() as mgr:
        (s,) = mgr.alloc(1, "r")
        queued = mgr.queued()
        assert mgr.export(s, "r", in_place=True) is None
        assert mgr.queued() == queued  # the alloc only: nothing to plan for the export
        assert mgr.host_pool is not None and mgr.host_pool.held() == {}
        assert mgr.exports_ready() == []  # the alloc (and its clear) queued before it has not run
        mgr.flush_nowait()
        assert mgr.exports_ready() == [mc.Export(s, None, "r")]


@pytest.mark.no_transport
@pytest.mark.parametrize("call", ["clear", "cow", "commit", "restore", "clear_many", "submit"])
def test_every_write_of_a_slot_exported_in_place_is_refused_and_changes_nothing(call: str) -> None:
    pool = mc.StatePool(dataclasses.replace(SPEC, draft_tokens=2), 6) if call == "commit" else None
    with _manager(pool) as mgr:
        s, other = mgr.alloc(2, "r")
        h = mgr.offload(other)
        mgr.flush_nowait()
        mgr.export(s, "r", in_place=True)
        before = _state(mgr)
        writes = {
            "clear": lambda: mgr.clear(s),
            "cow": lambda: mgr.copy_on_write(other, s),
            "commit": lambda: mgr.commit_draft(s, 1),
            "restore": lambda: mgr.restore(h, s),
            "clear_many": lambda: mgr.clear_many([other, s]),
            "submit": lambda: mgr.submit(mc.Clear(other), mc.CopyOnWrite(other, s)),
        }
        with pytest.raises(mc.SlotStateError, match="exported in place"):
            writes[call]()
        assert _same(_state(mgr), before)
        mgr.copy_on_write(s, other)  # reading it is fine: the state does not change
        mgr.offload(s)
        mgr.flush_nowait()
        assert [ev.slot for ev in mgr.exports_ready()] == [s]


@pytest.mark.no_transport
def test_a_release_before_the_send_withdraws_it_and_while_sending_is_refused() -> None:
    with _manager() as mgr:
        a, b = mgr.alloc(2, "r")
        mgr.export(a, "r", in_place=True)
        mgr.release(a, "r")  # withdrawn: nothing to drop, the slot is free
        assert mgr.exports_ready() == [] and mgr.held() == {b: "r"}
        mgr.flush_nowait()
        mgr.clear(b)  # a write before the export is fine, and is what goes
        mgr.export(b, "r", in_place=True)
        mgr.flush_nowait()
        (ev,) = mgr.take_exports()
        before = _state(mgr)
        with pytest.raises(mc.SlotStateError, match="being sent"):
            mgr.release(b, "r")
        assert _same(_state(mgr), before)
        mgr.exports_delivered([ev])
        mgr.flush_nowait()
        mgr.check_idle(host=True)


@pytest.mark.no_transport
def test_an_export_in_place_after_a_failed_flush_is_ready_only_once_the_repair_ran_and_sends_its_result() -> None:
    with _manager() as send, _manager() as recv:
        (s,) = send.alloc(1, "r")
        fill_random(send.pool, 3)
        send.clear(s)  # queued before the export: what the peer gets is the cleared slot
        send.export(s, "r", in_place=True)
        with pytest.raises(mc.ExecutorError), fail_at_op(1, RuntimeError):
            send.flush_nowait()
        assert send.unfinished and send.exports_ready() == []
        send.flush_nowait()  # the repair
        assert loopback(send, recv) == ["r"]
        recv.import_into(2, "r")
        recv.flush_nowait()
        for t in recv.pool.tensors:
            assert bool((t[:, 2] == 0).all())
        send.flush_nowait()
        send.check_idle(host=True)


@pytest.mark.no_transport
@pytest.mark.parametrize("layout", ["stacked", "paged", "layers", "paged layers"])
@pytest.mark.parametrize("slots", [[1, 2, 3], [4, 1]])
def test_the_messages_of_an_export_in_place_are_the_slots_bytes_on_every_pool_layout(
    layout: str, slots: list[int]
) -> None:
    pools = {
        "stacked": lambda: mc.StatePool(SPEC, 6),
        "paged": lambda: paged_pool(SPEC, 6),
        "layers": lambda: layered_pool(SPEC, 6, mc.StatePool),
        "paged layers": lambda: layered_pool(SPEC, 6, paged_pool),
    }
    with _manager(pools[layout]()) as mgr:
        for s in slots:
            mgr.alloc_slots([s], f"r{s}", clear=False)
        mgr.flush_nowait()
        fill_random(mgr.pool, 5)
        for s in slots:
            mgr.export(s, f"r{s}", in_place=True)
        mgr.flush_nowait()
        ready = mgr.exports_ready()
        want = [t[:, slots].contiguous() for t in pool_tensors(mgr.pool)]
        got = export_rows(mgr, ready)
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
        xfer = stand_in_transfer(mgr)
        straight = xfer._straight(ready)  # type: ignore[attr-defined]
        contiguous_rows = "paged" not in layout and slots == [1, 2, 3]
        assert (straight is not None) == contiguous_rows  # views of the slot rows themselves: no copy
        if straight is not None:
            assert [bytes(m.numpy()) for m in straight] == [bytes(m.numpy()) for m in messages(want, True)]


def test_an_export_in_place_is_traced_without_a_host_slot_and_the_analyzer_sees_it_delivered() -> None:
    tracing.configure(level="debug", use_structlog_config=True)
    try:
        with capture_logs() as logs, _manager() as send:
            (s,) = send.alloc(1, "r")
            send.export(s, "r", in_place=True, to=1)
            send.flush_nowait()
            ready = send.take_exports(to=1)
            _tracer.tracer.transfer("transfer.send", 1, ["r"], step=send.step, n=1, bytes=0)  # as send() does
            send.exports_delivered(ready)
            send.flush_nowait()
            send.check_idle(host=True)
    finally:
        tracing.disable()
    (line,) = [r for r in logs if r["event"] == "slot.export"]
    assert line["slot"] == s and line["host"] is None and line["to"] == 1
    report = analyze_lines([json.dumps(r) for r in logs], expect_idle=True)
    assert report.anomalies == [], report.anomalies


# -- arrivals in place: expect_import ---------------------------------------------------------------------------
def _staged_batch(send: mc.CacheManager, ids: list[str], value: float) -> None:
    """Sender: ``ids`` exported from slots holding ``value`` (+ i for the i-th), flushed: ready to go."""
    slots = [send.alloc(1, rid)[0] for rid in ids]
    send.flush_nowait()  # the allocs' clears ran: then a forward writes the states
    for i, (s, rid) in enumerate(zip(slots, ids, strict=True)):
        for t in pool_tensors(send.pool):
            t[:, s] = value + i
        send.export(s, rid)
    send.flush_nowait()


@pytest.mark.no_transport
def test_an_expected_state_lands_straight_in_its_slot_and_the_import_queues_nothing() -> None:
    with _manager() as send, _manager() as recv:
        recv.expect_import(4, "a")
        recv.expect_import(5, "b")
        assert recv.queued() == [mc.Alloc(4, "a", False), mc.Alloc(5, "b", False)]
        assert recv.held() == {4: "a", 5: "b"}
        _staged_batch(send, ["a", "b"], 7.0)
        assert recv.landing_room(["a", "b"]) == 4  # their allocs have not run: they would land in staging
        recv.flush_nowait()
        assert recv.landing_room(["a", "b"]) == 2 and recv.landing_room(["a", "c"]) == 4
        assert loopback(send, recv) == ["a", "b"]
        assert recv.host_pool is not None and recv.host_pool.held() == {}  # no staging slot taken
        for t in recv.pool.tensors:
            assert bool((t[:, 4] == 7.0).all()) and bool((t[:, 5] == 8.0).all())
        queued = recv.queued()
        with pytest.raises(mc.SlotStateError, match="lands in slot 4"):
            recv.import_into(3, "a")
        recv.import_into(5, "b")
        recv.import_into(4, "a")
        assert recv.queued() == queued  # nothing to copy
        recv.copy_on_write(4, 5)  # an ordinary slot from here on
        recv.flush_nowait()
        for t in recv.pool.tensors:
            assert bool((t[:, 5] == 7.0).all())
        recv.release(4, "a")
        recv.release(5, "b")
        recv.flush_nowait()
        recv.check_idle(host=True)


@pytest.mark.no_transport
def test_a_state_that_arrives_before_its_slot_settled_lands_in_staging_and_is_restored_into_it() -> None:
    with _manager() as send, _manager() as recv:
        recv.expect_import(3, "a")  # its alloc not flushed: the landing may not write the slot yet
        _staged_batch(send, ["a"], 5.0)
        assert loopback(send, recv) == ["a"]
        assert recv.host_pool is not None and list(recv.host_pool.held().values()) == ["a"]
        (h,) = recv.host_pool.held()
        recv.import_into(3, "a")
        assert recv.queued()[-1] == mc.Import(h, 3, "a")  # the slot is held already: no second alloc
        recv.flush_nowait()
        for t in recv.pool.tensors:
            assert bool((t[:, 3] == 5.0).all())
        recv.release(3, "a")
        recv.flush_nowait()
        recv.check_idle(host=True)


@pytest.mark.no_transport
@pytest.mark.parametrize(
    "call", ["clear", "cow into", "cow from", "commit", "restore", "offload", "export", "hand_over", "alloc_slots"]
)
def test_every_other_call_on_a_slot_awaiting_a_state_is_refused_and_changes_nothing(call: str) -> None:
    with _manager(mc.StatePool(dataclasses.replace(SPEC, draft_tokens=2), 6)) as mgr:
        (other,) = mgr.alloc(1, "r")
        h = mgr.offload(other)
        mgr.expect_import(4, "a")
        mgr.flush_nowait()
        before = _state(mgr)
        calls = {
            "clear": lambda: mgr.clear(4),
            "cow into": lambda: mgr.copy_on_write(other, 4),
            "cow from": lambda: mgr.copy_on_write(4, other),
            "commit": lambda: mgr.commit_draft(4, 1),
            "restore": lambda: mgr.restore(h, 4),
            "offload": lambda: mgr.offload(4),
            "export": lambda: mgr.export(4, "a"),
            "hand_over": lambda: mgr.hand_over(4, "a", "b"),
            "alloc_slots": lambda: mgr.alloc_slots([4], "a"),
        }
        with pytest.raises(mc.SlotStateError):
            calls[call]()
        assert _same(_state(mgr), before)


@pytest.mark.no_transport
def test_expecting_twice_or_after_arrival_is_refused_and_a_release_gives_the_state_up() -> None:
    with _manager() as send, _manager() as recv:
        recv.expect_import(4, "a")
        before = _state(recv)
        with pytest.raises(mc.SlotStateError, match="expected or arrived"):
            recv.expect_import(5, "a")
        with pytest.raises(mc.SlotStateError, match="held"):
            recv.expect_import(4, "b")
        assert _same(_state(recv), before)
        with pytest.raises(mc.SlotStateError, match="no state has arrived"):
            recv.import_into(4, "a")
        recv.flush_nowait()
        _staged_batch(send, ["a"], 3.0)
        assert loopback(send, recv) == ["a"]  # in place
        with pytest.raises(mc.SlotStateError, match="release that"):
            recv.discard_arrived("a")
        recv.release(4, "a")  # the request was aborted: the state is given up with its slot
        recv.flush_nowait()
        recv.check_idle(host=True)
        with pytest.raises(mc.SlotStateError, match="no state has arrived"):
            recv.import_into(4, "a")


@pytest.mark.no_transport
def test_a_landing_in_place_that_fails_leaves_the_slot_awaiting_and_a_release_meanwhile_is_refused() -> None:
    with _manager() as recv:
        recv.expect_import(4, "a")
        recv.flush_nowait()

        def broken(slots: list[int]) -> None:
            assert slots == [4]
            with pytest.raises(mc.SlotStateError, match="being written"):
                recv.release(4, "a")
            with pytest.raises(mc.SlotStateError, match="arrived twice"):
                recv.land(["a"])
            raise RuntimeError("the bytes did not arrive")

        with pytest.raises(RuntimeError, match="did not arrive"):
            recv.land_in_place(["a"], broken)
        with pytest.raises(mc.SlotStateError, match="no state has arrived"):
            recv.import_into(4, "a")
        assert recv.land_in_place(["a", "b"], broken) is None  # "b" is not expected: nothing lands in place
        assert recv.land_in_place(["a"], lambda slots: None) == [4]
        recv.import_into(4, "a")
        recv.release(4, "a")
        recv.flush_nowait()
        recv.check_idle(host=True)


def test_an_arrival_in_place_is_traced_and_the_analyzer_sees_it_imported() -> None:
    tracing.configure(level="debug", use_structlog_config=True)
    try:
        with capture_logs() as logs, _manager() as recv:
            recv.expect_import(4, "a")
            recv.flush_nowait()
            slots = recv.land_in_place(["a"], lambda slots: None)
            _tracer.tracer.transfer("transfer.receive", 3, ["a"], step=recv.step, n=1, slots=slots, bytes=0)
            recv.flush_nowait()  # a step while it waits for its import: the engine does not run it
            recv.import_into(4, "a")
            recv.flush_nowait()
            recv.release(4, "a")
            recv.flush_nowait()
    finally:
        tracing.disable()
    (expect,) = [r for r in logs if r["event"] == "slot.expect"]
    (imp,) = [r for r in logs if r["event"] == "slot.import"]
    assert expect["slot"] == 4 and imp["host"] is None and imp["peer"] == 3
    report = analyze_lines([json.dumps(r) for r in logs], expect_idle=True)
    assert report.anomalies == [], report.anomalies
    unimported = [json.dumps(r) for r in logs if r["event"] not in ("slot.import", "slot.release")]
    kinds = [a.kind for a in analyze_lines(unimported, expect_idle=True).anomalies]
    assert "import-never-completed" in kinds


@pytest.mark.no_transport
def test_the_analyzer_takes_a_null_host_only_where_a_hand_off_runs_in_place() -> None:
    head = [json.dumps({"event": "slot.alloc", "step": 0, "slot": 1, "request_id": "a", "cleared": True})]
    fine = [
        {"event": "slot.export", "step": 1, "slot": 1, "host": None, "request_id": "a"},
        {"event": "transfer.receive", "step": 1, "peer": 0, "request_ids": ["a"], "n": 1, "slots": [1], "bytes": 0},
    ]
    bad = [
        {"event": "slot.offload", "step": 1, "slot": 1, "host": None, "request_id": "a"},
        {"event": "slot.restore", "step": 1, "slot": 1, "host": None, "request_id": "a"},
        {"event": "slot.import", "step": 1, "slot": 1, "request_id": "a"},  # no host at all
        {"event": "transfer.receive", "step": 1, "peer": 0, "request_ids": ["a"], "n": 1, "slots": [-1]},
    ]
    for r in fine:
        assert analyze_lines([*head, json.dumps(r)]).bad_lines == [], r
    for r in bad:
        assert [b.line for b in analyze_lines([*head, json.dumps(r)]).bad_lines] == [2], r


@pytest.mark.parametrize("in_place", [True, False])
def test_a_landing_that_a_close_overtakes_is_not_acknowledged_and_keeps_the_pool_from_the_next_manager(
    in_place: bool,
) -> None:
    """A receive thread writes a batch's rows while the step loop closes the manager. Before, the landing ended
    as arrived on the closed manager (where nothing can import it) and was acknowledged, so the sender released
    the state: lost; and the close freed the pool for the next manager while the rows were still being written
    into its slots. Now the closed manager keeps the pool claimed until the write ends, and a landing that ends
    on a manager no longer open is not an arrival: the receive raises ManagerClosedError and answers that
    nothing landed (the sender keeps the state), the slot still held by the request (in place) or the staging
    host slot free again."""
    import threading

    import mambacache._handoff._transfer as xfer_mod

    from ...support.loopback import OneBatch

    pool, host = mc.StatePool(SPEC, 6), mc.HostPool(SPEC, 4)
    mgr = mc.CacheManager(pool, host_pool=host).__enter__()
    if in_place:
        mgr.expect_import(3, "r")
        mgr.flush_nowait()
    rows = [torch.full((t.shape[0], 1, *t.shape[2:]), 7.0).to(t.dtype) for t in host.tensors]
    inbox = OneBatch(rows)
    xfer = inbox.transfer(mgr)
    writing, go = threading.Event(), threading.Event()
    name = "write_pool" if in_place else "write_staging"
    real = getattr(xfer_mod, name)

    def slow(m: mc.CacheManager, slots: list[int], r: list[torch.Tensor]) -> None:
        writing.set()
        assert go.wait(10)
        real(m, slots, r)

    outcome: list[object] = []

    def receive() -> None:
        try:
            outcome.append(xfer.receive())
        except BaseException as exc:  # the test checks it
            outcome.append(exc)

    setattr(xfer_mod, name, slow)
    try:
        t = threading.Thread(target=receive)
        t.start()
        assert writing.wait(10)
        mgr.__exit__(None, None, None)
        with pytest.raises(mc.InvalidArgumentError, match="already managed"):
            mc.CacheManager(pool, host_pool=host).__enter__()  # the rows are still being written into it
        go.set()
        t.join(10)
    finally:
        setattr(xfer_mod, name, real)
        go.set()
    assert isinstance(outcome[0], mc.ManagerClosedError), outcome
    assert [landed for landed, _ in inbox.answers] == [False]
    with mc.CacheManager(pool, host_pool=host) as nxt:
        assert nxt.held() == ({3: "r"} if in_place else {}) and host.held() == {}


_EXPECTED = [
    '{"event": "slot.alloc", "step": 0, "slot": 1, "request_id": "a", "cleared": true}',
    '{"event": "slot.alloc", "step": 0, "slot": 2, "request_id": "b", "cleared": false}',
    '{"event": "slot.expect", "step": 0, "slot": 2, "request_id": "b"}',
]
_READS = {
    "fork": '{"event": "slot.cow", "step": 0, "src": 2, "dst": 1, "request_id": "a"}',
    "second source": '{"event": "slot.cow", "step": 0, "src": 1, "dst": 1, "temporal_src": 2, "request_id": "a"}',
    "offload": '{"event": "slot.offload", "step": 0, "slot": 2, "host": 1, "request_id": "b"}',
    "export": '{"event": "slot.export", "step": 0, "slot": 2, "host": null, "request_id": "b"}',
    "commit": '{"event": "slot.commit", "step": 0, "slot": 2, "accepted": 1, "request_id": "b"}',
}


@pytest.mark.no_transport
@pytest.mark.parametrize("read", sorted(_READS))
def test_the_analyzer_flags_a_read_of_a_slot_that_awaits_its_state_and_not_one_after_the_import(read: str) -> None:
    """A slot awaiting its state from a peer (``slot.expect``) holds none until its import (the manager refuses
    any read of it): a trace written by hand or by another tool that forks out of it, offloads, exports or commits
    it went unflagged (an export would ship stale bytes); now it is a read-before-import."""
    flush = '{"event": "step.flush", "step": 0, "events": 4, "elided": 0}'
    kinds = [a.kind for a in analyze_lines([*_EXPECTED, _READS[read], flush]).anomalies]
    assert "read-before-import" in kinds, kinds
    landed = [
        '{"event": "transfer.receive", "step": 0, "peer": 3, "request_ids": ["b"], "slots": [2], "n": 1}',
        '{"event": "slot.import", "step": 0, "slot": 2, "host": null, "request_id": "b"}',
    ]
    kinds = [a.kind for a in analyze_lines([*_EXPECTED, *landed, _READS[read], flush]).anomalies]
    assert "read-before-import" not in kinds, kinds


@pytest.mark.parametrize("in_place", [True, False])
def test_the_receive_line_precedes_an_import_made_by_another_thread_as_soon_as_the_state_arrived(
    in_place: bool,
) -> None:
    """The step loop may import a state the moment it counts as arrived (polling ``import_into`` for a request it
    expects). The receive traced its line only after the landing returned, outside the lock, so that import could
    be traced first: its line lacked the peer (left to a later import into the same slot), and the analyzer saw a
    received state never imported (a false import-never-completed). Now the line is traced in the lock hold that
    makes the states arrived."""
    import threading

    from ...support.loopback import OneBatch

    tracing.configure(level="debug", use_structlog_config=True)
    try:
        with capture_logs() as logs, _manager() as recv:
            if in_place:
                recv.expect_import(4, "r")
                recv.flush_nowait()
            assert recv.host_pool is not None
            rows = [torch.full((t.shape[0], 1, *t.shape[2:]), 7.0).to(t.dtype) for t in recv.host_pool.tensors]
            xfer = OneBatch(rows).transfer(recv)
            name = "land_in_place" if in_place else "land"
            real = getattr(recv, name)

            def landed_then_imported(*args: object, **kwargs: object) -> object:
                slots = real(*args, **kwargs)
                if slots is not None:  # the step loop's import runs before this thread goes on
                    step_loop = threading.Thread(target=recv.import_into, args=(4, "r"))
                    step_loop.start()
                    step_loop.join(10)
                return slots

            setattr(recv, name, landed_then_imported)
            assert xfer.receive() == ["r"]
            recv.flush_nowait()
            recv.release(4, "r")
            recv.flush_nowait()
    finally:
        tracing.disable()
    order = [r["event"] for r in logs if r["event"] in ("transfer.receive", "slot.import")]
    assert order == ["transfer.receive", "slot.import"], order
    (imp,) = [r for r in logs if r["event"] == "slot.import"]
    assert imp["peer"] == 1
    assert analyze_lines([json.dumps(r) for r in logs], expect_idle=True).anomalies == []


@pytest.mark.no_transport
def test_a_state_landing_in_staging_is_not_landed_in_place_a_second_time_by_another_receive() -> None:
    """Two receives at once (one per peer) with a state for the same request: while the first writes it into a
    staging host slot, the second found its slot awaiting and landed it there too, so the id arrived twice (in
    staging and in its slot: delivered twice, against the arrivals' invariant). Now the second is refused as
    arrived twice, nothing changed."""
    import threading

    with _manager() as recv:
        recv.expect_import(4, "a")  # its alloc not run yet: a landing now goes to staging
        writing, go = threading.Event(), threading.Event()

        def slow(slots: list[int]) -> None:
            writing.set()
            assert go.wait(10)

        first = threading.Thread(target=recv.land, args=(["a"], slow))
        first.start()
        try:
            assert writing.wait(10)
            recv.flush_nowait()  # the slot settles while the first landing writes
            before = _state(recv)
            with pytest.raises(mc.SlotStateError, match="arrived twice"):
                recv.land_in_place(["a"], lambda slots: None)
            assert _same(_state(recv), before)
        finally:
            go.set()
            first.join(10)
        recv.import_into(4, "a")  # the staged state, restored into the slot that awaited it
        recv.flush_nowait()
        recv.release(4, "a")
        recv.flush_nowait()
        recv.check_idle(host=True)


def test_an_import_in_place_is_not_reported_unlanded_when_a_flush_of_its_step_fails() -> None:
    """An import in place queues nothing (the state is in its slot already), yet the analyzer tracked it as an
    import whose flush must complete: a flush of its step that failed (on other work) made a later read of the
    slot a read-before-import, and a trace ending before a flush reported it never completed."""
    tracing.configure(level="debug", use_structlog_config=True)
    try:
        with capture_logs() as logs, _manager() as recv:
            recv.expect_import(4, "a")
            recv.flush_nowait()
            slots = recv.land_in_place(
                ["a"],
                lambda slots: None,
                arrived=lambda slots: _tracer.tracer.transfer(
                    "transfer.receive", 3, ["a"], step=recv.step, n=1, slots=slots, bytes=0
                ),
            )
            assert slots == [4]
            recv.import_into(4, "a")
            imported = [json.dumps(r) for r in logs]
            kinds = [a.kind for a in analyze_lines(imported, expect_idle=True).anomalies]
            assert kinds == ["held-at-end"], kinds  # the slot is held: its import completed
            recv.alloc(1, "b")  # other work in the import's step, whose flush fails
            with pytest.raises(mc.ExecutorError), fail_at_op(1, RuntimeError):
                recv.flush_nowait()
            recv.offload(4, "a")  # the slot holds its state: the engine may read it
            lines = [json.dumps(r) for r in logs]
            assert analyze_lines(lines).anomalies == []
            recv.flush_nowait()  # the repair
    finally:
        tracing.disable()
    assert any(r["event"] == "step.error" for r in logs)
    assert analyze_lines([json.dumps(r) for r in logs]).anomalies == []


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, whatever its strides (a float8 or a scalar-shaped row compares bit for bit)."""
    return t.reshape(-1).clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("paged", ["sender", "receiver"])
def test_one_state_in_place_from_or_into_a_paged_pool_with_a_scalar_extra_goes_over(paged: str) -> None:
    """A paged pool (vLLM's: a page per ``(layer, slot)``) with a per-slot scale of shape ``()``: one state's row
    of that tensor is a one-element view whose stride is the page. ``is_contiguous()`` holds for it (a size-1
    dimension), but ``view(torch.uint8)`` of a 4-byte dtype wants stride 1, so the straight-from-the-rows path
    (one layer: always split) raised a bare RuntimeError: on the sender (in place) before the header, and the
    batch was counted in doubt, pinned to the peer that never saw it; on the receiver (expect_import) before go,
    refused as ``failed``. Either way every retry failed the same: the state could never be sent."""
    spec = quant_spec(1)  # one layer: a batch of any size is split, and read from (or written into) the rows
    master = _store()
    src = paged_pool(spec, 4) if paged == "sender" else mc.StatePool(spec, 4)
    dst = paged_pool(spec, 4) if paged == "receiver" else mc.StatePool(spec, 4)
    with (
        mc.CacheManager(src, host_pool=mc.HostPool(spec, 2)) as mgr,
        mc.CacheManager(dst, host_pool=mc.HostPool(spec, 2)) as peer,
    ):
        out, into = _transfer(mgr, master, 0, 1, 2.0), _transfer(peer, master, 1, 0, 2.0)
        (slot,) = mgr.alloc(1, "r", clear=False)
        mgr.flush_nowait()
        for i, t in enumerate(src.tensors):
            t[:, slot] = torch.full(t[:, slot].shape, 1.5 + i).to(t.dtype)
        mgr.export(slot, "r", in_place=paged == "sender")
        mgr.flush_nowait()
        if paged == "receiver":
            peer.expect_import(3, "r")
            peer.flush_nowait()
        thread, sent = _in_thread(out.send)
        try:
            got = into.receive()
        finally:
            thread.join(10)
        assert got == ["r"] and sent == [["r"]], sent
        peer.import_into(3, "r")
        peer.flush_nowait()
        for a, b in zip(src.tensors, dst.tensors, strict=True):
            assert torch.equal(_raw(a[:, slot]), _raw(b[:, 3]))
        peer.release(3, "r")
        peer.flush_nowait()
        mgr.flush_nowait()
        mgr.check_idle(host=True)
        peer.check_idle(host=True)
