"""Tracing the transfer between tensor-parallel sizes (``_handoff/_reslice.py``): each test fails on the code before
its fix.

The real link runs in one process, as in ``test_reslice_batches.py``: store-client transfers over gloo on
127.0.0.1, each side in its own thread. The tracer is the process's, so the other side of each hand-off uses the
calls that trace nothing of their own and touch no manager (``receive_rows`` with ``acknowledge``, ``send_rows``):
what is captured is one engine's trace, as a real engine's file would be.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

import mambacache as mc
from mambacache import tracing
from mambacache._cli import main
from mambacache._handoff._reslice import ReslicingReceiver, StateLayout
from mambacache.tracing import analyze, analyze_lines

from ...support.link import in_thread as _in_thread
from ...support.link import store as _store
from ...support.link import transfer as _transfer
from ...support.reslice import host_manager, mamba2_layout, reslicing_sender

# The timeout of a transfer whose batches must land: nothing here waits it out, and on a loaded 2-core host a
# re-sliced batch took over the 5 s these used.
LANDS = 30.0


@pytest.fixture(autouse=True)
def _tracing_off() -> object:
    yield
    tracing.disable()


def _export(mgr: mc.CacheManager, rid: str, seed: int, to: int | None = None) -> int:
    """A cleared slot of ``rid`` filled with a state, exported (``to``: addressed to that rank) and flushed."""
    (slot,) = mgr.alloc(1, rid)
    mgr.flush_nowait()
    g = torch.Generator().manual_seed(seed)
    for t in mgr.pool.tensors:
        t[:, slot] = torch.randn(t[:, slot].shape, generator=g).to(t.dtype)
    mgr.export(slot, rid, to=to)
    mgr.flush_nowait()
    return slot


def _taking(x: mc.StateTransfer, states: int, tries: int = 4) -> tuple[threading.Thread, list[Any]]:
    """A decode rank that takes batches (``receive_rows``, acknowledged, landed nowhere) until ``states`` came;
    a refusal for room is retried. Neither call traces a line unless it fails."""

    def loop() -> list[str]:
        got: list[str] = []
        for _ in range(tries):
            try:
                ids, _ = x.receive_rows()
            except mc.TransferRefusedError:
                continue
            x.acknowledge(ids)
            got += ids
            if len(got) >= states:
                break
        return got

    return _in_thread(loop)


def _one_to_two(path: Path, host: int = 4) -> tuple[list[dict[str, Any]], list[str]]:
    """1 -> 2, ``a`` and ``b`` (and ``c`` with ``host`` 2: a batch refused for room, cut to it): the prefill
    side's trace (written to ``path``, as an engine's) and the ids sent."""
    layout = mamba2_layout()
    shard = layout.shard_spec(2)
    master = _store()
    ids = ["a", "b", "c"] if host == 2 else ["a", "b"]
    tracing.configure(path, level="debug")
    with host_manager(layout.spec) as mgr, host_manager(shard, host=host) as d1, host_manager(shard, host=host) as d2:
        sender = reslicing_sender(mgr, master, layout, [1, 2], LANDS)
        into = [_transfer(d1, master, 1, 0, LANDS), _transfer(d2, master, 2, 0, LANDS)]
        for k, rid in enumerate(ids):
            _export(mgr, rid, k)
        ranks = [_taking(x, len(ids)) for x in into]
        sent = sender.send()
        for th, got in ranks:
            th.join(2 * LANDS)
            assert got == [ids]
        mgr.flush_nowait()
        mgr.check_idle(host=True)
    tracing.disable()
    return [json.loads(text) for text in path.read_text().splitlines()], sent


def _lines(logs: list[dict[str, Any]]) -> list[str]:
    return [json.dumps(r) for r in logs]


def test_a_resliced_send_is_one_delivery_in_the_trace(tmp_path: Path) -> None:
    """1 -> 2: the sender wrote one ``transfer.send`` per decode rank, so the analyzer counted each state sent
    twice (``states_sent`` 4 for 2 exports), and the second rank's line took a later export of the same request as
    delivered: one addressed to rank 2 (which this sender never sends) showed ``sent`` to rank 2, and
    ``--expect-idle`` did not report it undelivered. Now one line per batch: ``peer`` the first rank (the one its
    exports are addressed to), ``peers`` every rank."""
    path = tmp_path / "prefill.jsonl"
    logs, sent = _one_to_two(path)
    assert sent == ["a", "b"]
    (line,) = [r for r in logs if r["event"] == "transfer.send"]
    assert (line["peer"], line["peers"], line["request_ids"], line["n"]) == (1, [1, 2], ["a", "b"], 2)
    analysis = analyze(path, expect_idle=True)
    assert analysis.anomalies == []
    assert (analysis.summary["exports"], analysis.summary["states_sent"]) == (2, 2)
    assert main(["trace", str(path), "--expect-idle", "--strict"]) == 0

    # The same request exported to rank 1 (the sender's) and to rank 2 (for another transfer): only the first goes.
    layout = mamba2_layout()
    master = _store()
    tracing.configure(level="debug", use_structlog_config=True)
    with (
        capture_logs() as logs,
        host_manager(layout.spec) as mgr,
        host_manager(layout.shard_spec(2)) as d1,
        host_manager(layout.shard_spec(2)) as d2,
    ):
        sender = reslicing_sender(mgr, master, layout, [1, 2], LANDS)
        ranks = [_taking(_transfer(d, master, k, 0, LANDS), 1) for k, d in ((1, d1), (2, d2))]
        mine, other = _export(mgr, "a", 1, to=1), _export(mgr, "a", 2, to=2)
        assert sender.send() == ["a"]
        for th, got in ranks:
            th.join(2 * LANDS)
            assert got == [["a"]]
    idle = analyze_lines(_lines(logs), expect_idle=True)
    assert sorted((a.kind, a.slot) for a in idle.anomalies) == [("export-undelivered", other), ("held-at-end", other)]
    assert [e.peer for e in idle.timelines[mine] if e.action == "sent"] == [1]
    assert [e.action for e in idle.timelines[other] if e.action == "sent"] == []


def _states(layout: StateLayout, n: int, seed: int) -> list[torch.Tensor]:
    """``n`` whole states, ``[layers, n, *state]`` per pool tensor."""
    g = torch.Generator().manual_seed(seed)
    layers = layout.spec.num_layers
    return [torch.randn(layers, n, *shape, generator=g).to(dtype) for shape, dtype in layout.spec.shapes()]


def _two_to_one(
    d: mc.CacheManager, layout: StateLayout, batches: list[tuple[list[str], list[torch.Tensor]]]
) -> tuple[list[str] | BaseException, list[list[Any]]]:
    """2 -> 1 into ``d``: prefill rank ``k`` sends ``batches[k]`` (ids, its shard's rows) with ``send_rows``
    (which traces nothing: the trace is the decode side's); what the receive returned or raised, and each rank's
    outcome."""
    master = _store()
    shard = layout.shard_spec(2)
    with host_manager(shard) as p0, host_manager(shard) as p1:
        senders = [_transfer(p0, master, 0, 2, 5.0), _transfer(p1, master, 1, 2, 5.0)]
        receiver = ReslicingReceiver(d, [_transfer(d, master, 2, 0, 5.0), _transfer(d, master, 2, 1, 5.0)], layout)
        sends = [_in_thread(lambda x=x, b=b: x.send_rows(b[0], b[1], 1)) for x, b in zip(senders, batches, strict=True)]
        try:
            got: list[str] | BaseException = receiver.receive()
        except mc.TransferError as exc:
            got = exc
        for th, _ in sends:
            th.join(10)
    return got, [out for _, out in sends]


def test_a_resliced_receive_is_one_landing_with_its_bytes(tmp_path: Path) -> None:
    """2 -> 1: one ``transfer.receive`` for the states every rank's shard of came (``peer`` the first rank,
    ``peers`` both), counted once, and the decode side's trace clean under ``--expect-idle``. Its line had no
    ``bytes`` (a plain receive's has): now the bytes that arrived from all the ranks."""
    layout = mamba2_layout(2)
    full = _states(layout, 2, 1)
    path = tmp_path / "decode.jsonl"
    tracing.configure(path, level="debug")
    with host_manager(layout.spec) as d:
        got, sent = _two_to_one(d, layout, [(["a", "b"], layout.slice(full, 2, k)) for k in range(2)])
        assert got == ["a", "b"] and sent == [[None], [None]]
        d.import_into(1, "a")
        d.import_into(3, "b")
        d.flush_nowait()
        for slot, rid in ((1, "a"), (3, "b")):
            assert torch.equal(d.pool.tensors[0][:, slot], full[0][:, "ab".index(rid)])
            d.release(slot, rid)
        d.flush_nowait()
        d.check_idle(host=True)
    tracing.disable()
    records = [json.loads(text) for text in path.read_text().splitlines()]
    (line,) = [r for r in records if r["event"].startswith("transfer.")]
    assert (line["event"], line["peer"], line["peers"], line["request_ids"]) == (
        "transfer.receive",
        0,
        [0, 1],
        ["a", "b"],
    )
    assert line["bytes"] == 2 * 2 * layout.shard_spec(2).slot_bytes  # two states, a shard of each from two ranks
    analysis = analyze(path, expect_idle=True)
    assert analysis.anomalies == []
    assert (analysis.summary["states_received"], analysis.summary["imports"]) == (2, 2)
    assert main(["trace", str(path), "--expect-idle", "--strict"]) == 0


def test_a_resliced_send_line_has_its_bytes(tmp_path: Path) -> None:
    """1 -> 2: a plain ``transfer.send`` carries ``bytes``; the re-slicing sender's had none. Now the bytes sent
    to all the ranks: each its shard of every state."""
    logs, sent = _one_to_two(tmp_path / "prefill.jsonl")
    (line,) = [r for r in logs if r["event"] == "transfer.send"]
    assert (line["request_ids"], line["bytes"]) == (sent, 2 * 2 * mamba2_layout().shard_spec(2).slot_bytes)


@pytest.mark.parametrize("wrong", ["not one batch", "replicated parts differ"])
def test_a_resliced_receive_that_fails_on_its_own_check_is_traced(wrong: str) -> None:
    """2 -> 1: the receiver's own refusals of what its ranks sent (their ids are not one batch; the parts every
    rank holds whole differ) raised TransferError and wrote no ``transfer.failed`` (each rank's own receive
    traces its failures, these checks are the receiver's): the decode trace showed nothing wrong. Now one line,
    as a failed plain receive writes: ``peer`` the first rank, ``peers`` every rank, ``call`` ``receive``."""
    layout = mamba2_layout(1)  # one group: B and C whole on every rank
    one, other = _states(layout, 2, 1), _states(layout, 2, 2)
    batches = [(["a", "b"], layout.slice(one, 2, 0))]
    if wrong == "not one batch":
        batches.append((["a"], [r[:, :1] for r in layout.slice(one, 2, 1)]))  # its flush of b ran later
    else:
        batches.append((["a", "b"], layout.slice(other, 2, 1)))  # a shard of other states
    tracing.configure(level="debug", use_structlog_config=True)
    with host_manager(layout.spec) as d, capture_logs() as logs:
        got, sent = _two_to_one(d, layout, batches)
    assert isinstance(got, mc.TransferError) and wrong.split()[-1] in str(got), got
    assert all(isinstance(out[0], mc.TransferRefusedError) for out in sent), sent  # every rank keeps its slots
    assert [(r["event"], r["peer"], r["peers"], r["request_ids"], r["call"], r["error"]) for r in logs] == [
        ("transfer.failed", 0, [0, 1], ["a", "b"], "receive", str(got))
    ]


def test_a_rank_whose_retry_never_comes_is_its_own_failure_line(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 -> 1 over a wire that reads pieces: rank 1's sender withdrew its header before this side's go, and no
    retry came before the receive's deadline. The receive raised TransferError and wrote no ``transfer.failed``
    (the wait for the retry was outside the rank's own failures, which a plain receive traces): the decode trace
    showed nothing wrong. Now that rank's line, as its own receive would write: ``peer`` 1, ``call`` ``receive``,
    no ``peers`` (nothing of the receiver's own checks failed)."""
    if transport == "gloo":
        pytest.skip("gloo pushes whole messages: its ranks' receive_rows trace their own failures")
    from mambacache._handoff import _link

    layout = mamba2_layout(1)
    one = _states(layout, 2, 1)
    real_take = _link.Inbox.take
    takes: list[int] = []

    def take(self: Any, batch: Any, raw: Any) -> None:
        takes.append(1)
        if len(takes) == 2:  # rank 1's: its sender withdrew the header first
            raise _link.Withdrawn(batch.ids)
        real_take(self, batch, raw)

    def spent(self: Any, deadline: float) -> None:  # the receive's wait for the retry, spent
        raise mc.TransferError(f"no batch from rank {self.src} taken within {self.timeout:g}s: its sender withdrew")

    monkeypatch.setattr(_link.Inbox, "take", take)
    monkeypatch.setattr(_link.Inbox, "check_left", spent)
    tracing.configure(level="debug", use_structlog_config=True)
    with host_manager(layout.spec) as d, capture_logs() as logs:
        got, _ = _two_to_one(d, layout, [(["a", "b"], layout.slice(one, 2, k)) for k in range(2)])
    assert isinstance(got, mc.TransferError) and "withdrew" in str(got), got
    failed = [r for r in logs if r["event"] == "transfer.failed"]
    assert [(r["peer"], r["request_ids"], r["call"], "peers" in r) for r in failed] == [(1, [], "receive", False)]


def test_a_refusal_the_send_recovers_from_is_no_failure_line(tmp_path: Path) -> None:
    """1 -> 2, three states and room for two on each rank: both refuse the batch for room, it is cut to two and
    sent again in the same call, which delivers all three. A plain StateTransfer writes ``transfer.failed`` only
    for the TransferError its call raises (none here); the re-slicing sender wrote one per rank for the refusal,
    counted as transfer failures of a send that failed nothing. A send that does raise still names each rank
    that failed, and only those."""
    logs, sent = _one_to_two(tmp_path / "prefill.jsonl", host=2)
    assert sent == ["a", "b", "c"]
    refused = [r for r in logs if r["event"] == "transfer.failed"]
    assert {r["call"] for r in refused} == {"receive_rows"}, refused  # the decode ranks' refusals, theirs to trace
    assert [r["n"] for r in logs if r["event"] == "transfer.send"] == [2, 1]

    layout = mamba2_layout()
    master = _store()
    tracing.configure(level="debug", use_structlog_config=True)
    with capture_logs() as logs, host_manager(layout.spec) as mgr, host_manager(layout.shard_spec(2)) as d1:
        # Rank 1's batch must be taken within the timeout (rank 2's decision is waited for as long): 1 s failed it
        # over Mooncake on a loaded machine, whose first read makes its connection (a handshake) then.
        sender = reslicing_sender(mgr, master, layout, [1, 2], 3.0)
        rank1 = _taking(_transfer(d1, master, 1, 0, 3.0), 1, tries=1)
        _export(mgr, "a", 1)
        with pytest.raises(mc.TransferError, match="1 of 2 ranks") as failed:
            sender.send()  # rank 2 never receives
        rank1[0].join(10)
    (line,) = [r for r in logs if r["event"] == "transfer.failed"]
    assert (line["peer"], line["request_ids"], line["call"]) == (2, ["a"], "send")
    assert line["error"] in str(failed.value)
