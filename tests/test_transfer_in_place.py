"""Exports in place (issue #32's cost): the send reads the pool slot itself, no staging copy, no host slot.

What a scheduler relies on: ``export(s, r, in_place=True)`` queues no event and
takes no host slot; the export is ready once the flush that takes the events
queued before it ran (a failed flush: once its repair ran); until the peer
acknowledges, every call that would write ``s`` is refused with nothing
changed, while reads of it go on; a release before the send withdraws it
(nothing to drop); the delivery releases ``s``. The bytes sent are those of
``s`` on every pool layout (stacked, paged rows, separately allocated layers),
straight from the slot rows when they are one run of contiguous host memory.
Over real gloo: ``tests/test_transfer_link.py``'s "every wire layout".
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from structlog.testing import capture_logs

import mambacache as mc
from mambacache import _tracing, tracing
from mambacache._handoff._link import messages
from mambacache._handoff._transfer import export_rows
from mambacache.tracing import analyze_lines

from ._loopback import loopback
from .layered import layered_pool, pool_tensors
from .util import FaultAt, fill_random, paged_pool, small_spec

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


def test_an_export_in_place_after_a_failed_flush_is_ready_only_once_the_repair_ran_and_sends_its_result() -> None:
    with _manager() as send, _manager() as recv:
        (s,) = send.alloc(1, "r")
        fill_random(send.pool, 3)
        send.clear(s)  # queued before the export: what the peer gets is the cleared slot
        send.export(s, "r", in_place=True)
        with pytest.raises(mc.ExecutorError), FaultAt(1, RuntimeError):
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
        xfer = object.__new__(mc.StateTransfer)
        xfer._mgr = mgr  # type: ignore[attr-defined]
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
            _tracing.tracer.transfer("transfer.send", 1, ["r"], step=send.step, n=1, bytes=0)  # as send() does
            send.exports_delivered(ready)
            send.flush_nowait()
            send.check_idle(host=True)
    finally:
        tracing.disable()
    (line,) = [r for r in logs if r["event"] == "slot.export"]
    assert line["slot"] == s and line["host"] is None and line["to"] == 1
    report = analyze_lines([json.dumps(r) for r in logs], expect_idle=True)
    assert report.anomalies == [], report.anomalies
