"""Tracing state transfers (issue #20): the transfer's lines carry the peer, and the analyzer's three hand-off rules.

The rules (``read-before-import``, ``import-never-completed``,
``export-undelivered``) are pinned twice: on hand-written traces shaped like
the real ones, each next to the correct hand-off it must not flag, and on the
traces of a real two-process run over gloo (``tests/workers/transfer_trace.py``), where a
correct hand-off is clean under ``--expect-idle`` and each broken one is
flagged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from structlog.testing import capture_logs

import mambacache as mc
from mambacache import tracing
from mambacache._cli import main
from mambacache._core import _tracer
from mambacache.tracing import analyze, analyze_lines

from ...support.link import deliver as _deliver
from ...support.link import export_valued as _export
from ...support.link import free_port
from ...support.link import imported as _imported
from ...support.link import in_thread as _in_thread
from ...support.link import small_manager as _mgr
from ...support.link import store as _store
from ...support.link import transfer as _transfer
from ...support.util import line, small_spec
from ...workers.transfer import spec
from ...workers.transfer_trace import MODES, trace_worker


@pytest.fixture(autouse=True)
def _tracing_off() -> object:
    yield
    tracing.disable()


# -- hand-written traces ---------------------------------------------------------------------------------------------
SENDER = [
    line("slot.alloc", 0, slot=1, request_id="a", cleared=True),
    line("step.flush", 0, events=1),
    line("slot.export", 1, slot=1, host=0, request_id="a"),
    line("slot.clear", 1, slot=1, request_id="a"),  # after the export: a correct hand-off
    line("step.flush", 1, events=2),
]
DELIVERED = [
    line("transfer.send", 2, peer=1, request_ids=["a"], n=1, bytes=64),
    line("host.drop", 2, host=0),
    line("slot.release", 2, slot=1, request_id="a"),
    line("step.flush", 2, events=2),
]
RECEIVED = [
    line("slot.alloc", 0, slot=1, request_id="old", cleared=True),
    line("step.flush", 0, events=1),
    line("transfer.receive", 1, peer=0, request_ids=["a"], n=1, hosts=[3], bytes=64),
    line("slot.release", 1, slot=1, request_id="old"),  # before the import of the same slot: never wipes it
]
IMPORT = [
    line("slot.alloc", 1, slot=1, request_id="a", cleared=False),
    line("slot.import", 1, host=3, slot=1, request_id="a", peer=0),
]
FAILED = [line("step.error", 1, stage="Restore", error="MemoryError()", failures=1)]
REPAIRED = [line("step.flush", 2, events=0, resumed_stages=1)]


def fork(step: int) -> list[str]:
    """Request f forks from slot 1 (the import's) in ``step``: a read of it."""
    return [
        line("slot.alloc", step, slot=2, request_id="f", cleared=False),
        line("slot.cow", step, src=1, dst=2, request_id="f"),
    ]


DONE = [
    line("slot.release", 3, slot=1, request_id="a"),
    line("slot.release", 3, slot=2, request_id="f"),
    line("step.flush", 3, events=2),
]


def kinds(lines: list[str], expect_idle: bool = False) -> list[tuple[str, int | None, str | None]]:
    return [(a.kind, a.slot, a.request_id) for a in analyze_lines(lines, expect_idle=expect_idle).anomalies]


@pytest.mark.no_transport
def test_a_correct_hand_off_is_clean_on_both_sides() -> None:
    sender = analyze_lines([*SENDER, *DELIVERED], expect_idle=True)
    assert sender.anomalies == [] and sender.bad_lines == []
    assert [(e.action, e.other, e.peer) for e in sender.timelines[1]] == [
        ("alloc", None, None), ("export", 0, None), ("clear", None, None), ("sent", None, 1), ("release", None, None)
    ]  # fmt: skip
    receiver = [*RECEIVED, *IMPORT, line("step.flush", 1, events=3), line("slot.release", 2, slot=1, request_id="a")]
    analysis = analyze_lines(receiver, expect_idle=True)
    assert analysis.anomalies == [] and analysis.bad_lines == []
    assert [(e.action, e.request_id, e.peer) for e in analysis.timelines[1]][-2:] == [
        ("import", "a", 0), ("release", "a", None)
    ]  # fmt: skip
    s = analysis.summary
    assert (s["imports"], s["states_received"], s["exports"], s["states_sent"]) == (1, 1, 0, 0)
    # Without the peer on the import line, the receive that landed it still names it.
    unnamed = [ln.replace(', "peer": 0', "") if "slot.import" in ln else ln for ln in receiver]
    assert [e.peer for e in analyze_lines(unnamed).timelines[1] if e.action == "import"] == [0]


@pytest.mark.no_transport
def test_a_slot_read_while_its_received_state_waits_unimported_is_flagged() -> None:
    # LMCache#2863: the decode slot is allocated (cleared, even) and decoded, the state never loaded.
    skipped = [*RECEIVED, line("slot.alloc", 1, slot=2, request_id="a", cleared=True), line("step.flush", 1)]
    assert kinds(skipped) == [("read-before-import", 2, "a")]
    assert kinds(skipped[:-1]) == []  # not read yet: no flush ran
    # A tenancy of a begun before its (next) state arrived is not that state's slot: a multi-turn request.
    earlier = [RECEIVED[0], line("slot.alloc", 0, slot=2, request_id="a", cleared=True), *RECEIVED[1:]]
    assert kinds([*earlier, line("step.flush", 1)]) == []
    # Imported instead: clean; the state is in the slot.
    assert kinds([*RECEIVED, *IMPORT, line("step.flush", 1)]) == []


@pytest.mark.no_transport
def test_a_read_of_a_slot_after_its_import_failed_to_flush_is_flagged() -> None:
    before = [*RECEIVED, *IMPORT, *FAILED]
    assert kinds([*before, *fork(2), *REPAIRED, *DONE]) == [("read-before-import", 1, "f")]
    for read in (
        line("slot.offload", 2, slot=1, host=4, request_id="a"),
        line("slot.export", 2, slot=1, host=4, request_id="a"),
        line("slot.commit", 2, slot=1, accepted=1, request_id="a"),
    ):
        assert kinds([*before, read]) == [("read-before-import", 1, "a")], read
    # Not flagged: the read after the repair; a read in the import's own step (planned after it);
    # a release after the failure (the right reaction); a failure of an earlier step's flush.
    assert kinds([*before, *REPAIRED, *fork(3), *DONE]) == []
    assert kinds([*RECEIVED, *IMPORT, *fork(1), *FAILED, *REPAIRED]) == []
    assert kinds([*before, line("slot.release", 2, slot=1, request_id="a")], expect_idle=True) == []
    earlier = [*RECEIVED, *IMPORT, line("step.error", 0, stage="Clear", error="x", failures=1), *fork(2)]
    assert kinds(earlier) == []


@pytest.mark.no_transport
def test_expect_idle_flags_imports_never_completed() -> None:
    unimported = RECEIVED
    assert kinds(unimported) == []  # a trace cut mid-run: the state may still be imported
    analysis = analyze_lines(unimported, expect_idle=True)
    assert [(a.kind, a.slot, a.request_id) for a in analysis.anomalies] == [("import-never-completed", None, "a")]
    assert "staging host slot 3" in analysis.anomalies[0].message and "rank 0" in analysis.anomalies[0].message
    unlanded = [*RECEIVED, *IMPORT, *FAILED]
    assert kinds(unlanded, expect_idle=True) == [("held-at-end", 1, "a"), ("import-never-completed", 1, "a")]
    assert kinds([*unlanded, *REPAIRED], expect_idle=True) == [("held-at-end", 1, "a")]


@pytest.mark.no_transport
def test_expect_idle_flags_exports_never_delivered_with_the_last_failure() -> None:
    failed = line("transfer.failed", 2, peer=1, request_ids=["a"], call="send", error="the header timed out")
    assert kinds([*SENDER, failed]) == []  # the sender may retry: not an anomaly mid-run
    analysis = analyze_lines([*SENDER, failed], expect_idle=True)
    assert [(a.kind, a.slot) for a in analysis.anomalies] == [("held-at-end", 1), ("export-undelivered", 1)]
    assert "the header timed out" in analysis.anomalies[1].message
    assert analysis.summary["transfer_failures"] == 1
    # Delivered on the retry: clean.
    assert kinds([*SENDER, failed, *DELIVERED], expect_idle=True) == []


@pytest.mark.no_transport
def test_slotless_anomalies_show_in_whole_views_and_with_their_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([*RECEIVED, line("slot.alloc", 1, slot=2, request_id="a", cleared=True)]) + "\n")
    assert main(["trace", str(path), "--expect-idle", "--json", "-"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert {(a["kind"], a["slot"]) for a in data["anomalies"]} == {
        ("import-never-completed", None), ("held-at-end", 2)
    }  # fmt: skip
    assert main(["trace", str(path), "--expect-idle", "--request", "a"]) == 1
    out = capsys.readouterr().out
    assert "no slot  import-never-completed" in out and "anomalies (2)" in out
    assert main(["trace", str(path), "--expect-idle", "--slot", "1"]) == 0  # "old"'s slot: clean
    assert "no anomalies" in capsys.readouterr().out


@pytest.mark.no_transport
@pytest.mark.parametrize(
    "bad",
    [
        line("transfer.send", 1, request_ids=["a"]),
        line("transfer.send", 1, peer=1, request_ids="a"),
        line("transfer.receive", 1, peer=0, request_ids=["a", "b"], hosts=[1]),
        line("transfer.receive", 1, peer=0, request_ids=["a"], hosts=[-1]),
        line("slot.import", 1, slot=1, request_id="a"),
        line("slot.export", 1, host=1, request_id="a"),
        line("transfer.teleport", 1, peer=0),
    ],
)
def test_malformed_transfer_lines_are_named_and_skipped(bad: str) -> None:
    analysis = analyze_lines([*SENDER, bad])
    assert [b.line for b in analysis.bad_lines] == [len(SENDER) + 1] and analysis.anomalies == []


# -- the lines themselves --------------------------------------------------------------------------------------------
def test_an_import_line_names_the_peer_its_state_came_from() -> None:
    tracing.configure(level="debug", use_structlog_config=True)
    spec = small_spec()
    with mc.CacheManager(mc.StatePool(spec, 4), host_pool=mc.HostPool(spec, 2)) as mgr, capture_logs() as logs:
        (h,) = mgr.land(["a"])  # what StateTransfer.receive does, then it traces:
        _tracer.tracer.transfer("transfer.receive", 3, ["a"], step=mgr.step, n=1, hosts=[h], bytes=spec.slot_bytes)
        mgr.import_into(2, request_id="a")
        mgr.flush_nowait()
    receive, alloc, imp = logs[0], logs[1], logs[2]
    assert receive == {"event": "transfer.receive", "peer": 3, "request_ids": ["a"], "step": 0, "n": 1,
                       "hosts": [h], "bytes": spec.slot_bytes, "log_level": "info"}  # fmt: skip
    assert alloc["event"] == "slot.alloc" and alloc["cleared"] is False
    assert imp == {"event": "slot.import", "host": h, "slot": 2, "request_id": "a", "peer": 3, "step": 0,
                   "log_level": "debug"}  # fmt: skip


class _Wire:
    """The one attribute traces_failures reads, and a method that fails like the wire."""

    peer = 5

    @_tracer.traces_failures
    def send(self, fail: bool) -> list[str]:
        """Fails when told to."""
        if fail:
            raise mc.TransferError("the header with rank 5 failed or timed out after 1s: gone", ["a", "b"])
        return ["a", "b"]


@pytest.mark.no_transport
def test_a_failed_transfer_is_traced_with_the_peer_at_error_level_and_reraised() -> None:
    tracing.configure(level="info", use_structlog_config=True)  # an error: written at info level too
    with capture_logs() as logs:
        assert _Wire().send(False) == ["a", "b"]
        with pytest.raises(mc.TransferError, match="gone"):
            _Wire().send(True)
    error = "the header with rank 5 failed or timed out after 1s: gone"
    assert logs == [{"event": "transfer.failed", "peer": 5, "request_ids": ["a", "b"], "call": "send", "error": error,
                     "log_level": "error"}]  # fmt: skip
    assert _Wire.send.__doc__ == "Fails when told to." and _Wire.send.__name__ == "send"
    tracing.disable()
    with capture_logs() as logs, pytest.raises(mc.TransferError):
        _Wire().send(True)
    assert logs == []


# -- a real run: two processes over gloo -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("traces")
    mp.spawn(trace_worker, args=(free_port(), str(directory)), nprocs=2, join=True)
    return directory


def records(path: Path, event: str) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == event]


@pytest.mark.slow
def test_a_real_hand_off_is_traced_with_the_peer_and_is_clean(traces: Path) -> None:
    assert sorted(p.name for p in traces.iterdir()) == sorted(
        f"{m}-{r}.jsonl" for m in MODES for r in (0, 1) if (m, r) != ("silent-peer", 1)
    )
    sender, receiver = traces / "ok-0.jsonl", traces / "ok-1.jsonl"
    for path in (sender, receiver):
        assert analyze(path, expect_idle=True).anomalies == []
        assert main(["trace", str(path), "--expect-idle", "--strict"]) == 0
    (sent,) = records(sender, "transfer.send")
    assert (sent["peer"], sent["request_ids"], sent["n"], sent["bytes"]) == (1, ["a", "b"], 2, 2 * spec().slot_bytes)
    exports = records(sender, "slot.export")
    (received,) = records(receiver, "transfer.receive")
    assert (received["peer"], received["request_ids"]) == (0, ["a", "b"])
    imports = records(receiver, "slot.import")
    assert [(i["request_id"], i["host"], i["peer"]) for i in imports] == [
        ("a", received["hosts"][0], 0), ("b", received["hosts"][1], 0)
    ]  # fmt: skip
    timeline = analyze(sender).timelines[exports[0]["slot"]]
    assert [(e.action, e.peer) for e in timeline][-4:] == [
        ("export", None),
        ("clear", None),
        ("sent", 1),
        ("release", None),
    ]


@pytest.mark.slow
def test_a_real_skipped_import_and_a_read_after_a_failed_flush_are_flagged(traces: Path) -> None:
    for mode in ("skip-import", "failed-flush", "silent-peer"):
        assert analyze(traces / f"{mode}-0.jsonl").anomalies == [], mode  # nothing wrong until the end
    skipped = analyze(traces / "skip-import-1.jsonl", expect_idle=True)
    assert [(a.kind, a.request_id) for a in skipped.anomalies] == [
        ("read-before-import", "a"), ("import-never-completed", "a")
    ]  # fmt: skip
    failed = analyze(traces / "failed-flush-1.jsonl", expect_idle=True)
    assert [(a.kind, a.request_id) for a in failed.anomalies] == [("read-before-import", "a2")]  # b2's after the repair
    assert "its flush failed on line" in failed.anomalies[0].message


@pytest.mark.slow
def test_a_real_send_to_a_silent_peer_is_traced_failed_and_its_exports_undelivered(traces: Path) -> None:
    path = traces / "silent-peer-0.jsonl"
    (failed,) = records(path, "transfer.failed")
    assert (failed["peer"], failed["request_ids"], failed["call"], failed["level"]) == (1, ["a", "b"], "send", "error")
    assert "timed out" in failed["error"]
    idle = analyze(path, expect_idle=True)
    assert sorted(a.kind for a in idle.anomalies) == ["export-undelivered"] * 2 + ["held-at-end"] * 2
    assert main(["trace", str(path), "--expect-idle"]) == 1


def _traced(run: Callable[[mc.CacheManager], None]) -> list[str]:
    """The JSON lines ``run`` writes on a fresh manager with a host pool, closed idle."""
    tracing.configure(level="debug", use_structlog_config=True)
    spec = small_spec()
    with capture_logs() as logs, mc.CacheManager(mc.StatePool(spec, 4), host_pool=mc.HostPool(spec, 2)) as mgr:
        run(mgr)
        mgr.flush_nowait()
        mgr.check_idle(host=True)
    return [json.dumps(r) for r in logs]


def _withdraw(mgr: mc.CacheManager) -> None:
    (s,) = mgr.alloc(1, "a")
    mgr.export(s, "a")
    mgr.flush_nowait()
    mgr.release(s, "a")  # gives the export up: nothing goes to a peer


def _discard(mgr: mc.CacheManager) -> None:
    hosts = mgr.land(["a", "b"])  # what StateTransfer.receive does, then it traces:
    _tracer.tracer.transfer("transfer.receive", 1, ["a", "b"], step=mgr.step, n=2, hosts=hosts, bytes=0)
    mgr.import_into(1, "b")
    mgr.discard_arrived("a")  # the decode side aborted "a": its state is never imported
    mgr.flush_nowait()
    mgr.release(1, "b")


@pytest.mark.no_transport
@pytest.mark.parametrize(("run", "event", "kind"), [
    (_withdraw, "transfer.withdraw", "export-undelivered"),
    (_discard, "transfer.discard", "import-never-completed"),
])  # fmt: skip
def test_a_withdrawn_export_and_a_discarded_arrival_end_their_hand_offs(
    run: Callable[[mc.CacheManager], None], event: str, kind: str
) -> None:
    lines = _traced(run)
    assert analyze_lines(lines, expect_idle=True).anomalies == []
    without = [line for line in lines if json.loads(line)["event"] != event]
    assert len(without) == len(lines) - 1
    assert [a.kind for a in analyze_lines(without, expect_idle=True).anomalies] == [kind]


SPEC = small_spec(2)


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
