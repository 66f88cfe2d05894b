"""A batch re-sliced between tensor-parallel sizes (``_handoff/_reslice.py``): each rank gets exactly its shard; a
batch larger than a rank's room is cut to it, for every rank alike; a batch in doubt stays so until settled; shards
that are not one batch, an acknowledgement that fails on one rank and a batch the sender could not read leave
every rank answered and nothing in doubt; a layout is its model config's (the engines' conv windows too).

Most run the real link in one process: ``StateTransfer`` built from clients of one ``TCPStore`` on 127.0.0.1
(``store=``, ``rank=``), each side in its own thread, the gloo pairs between them built as between processes.
A ``ReslicingSender`` needs an initialised process group to build its transfers; here its ``__init__`` runs
with the group's calls stood in and store-client transfers (:func:`reslicing_sender`), the rest of it unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

import pytest
import torch

import mambacache as mc
from mambacache._handoff._reslice import StateLayout

from ...support.link import fail_once
from ...support.link import in_thread as _in_thread
from ...support.reslice import (
    export_filled,
    mamba2_config,
    mamba2_layout,
    one_to_two,
    two_to_one,
)


def test_the_harness_delivers_each_rank_exactly_its_shard() -> None:
    """The baseline the tests below build on: 1 -> 2 over the real link, each decode rank's slots byte for byte
    its shard of the whole (x split, B and C replicated, a scalar extra replicated)."""
    layout = mamba2_layout()  # equal to the sender's: a layout is its config's and spec's
    with one_to_two(5.0) as (mgr, d1, d2, sender, into):
        slots = [export_filled(mgr, "a", 1), export_filled(mgr, "b", 2)]
        full = [t[:, slots].clone() for t in mgr.pool.tensors]
        threads = [_in_thread(x.receive) for x in into]
        assert sender.send() == ["a", "b"]
        for th, got in threads:
            th.join(10)
            assert got == [["a", "b"]]
        for k, d in enumerate((d1, d2)):
            d.import_into(1, "a")
            d.import_into(2, "b")
            d.flush_nowait()
            want = layout.slice(full, 2, k)
            for got_t, w in zip(d.pool.tensors, want, strict=True):
                assert torch.equal(got_t[:, 1:3].contiguous().view(torch.uint8), w.view(torch.uint8))


def _receiving(x: mc.StateTransfer, tries: int = 3) -> tuple[threading.Thread, list[Any]]:
    """``x.receive()`` in a thread until a batch lands (refusals and timeouts retried ``tries`` times in all)."""

    def loop() -> list[str]:
        for k in range(tries):
            try:
                return x.receive()
            except mc.TransferError:
                if k == tries - 1:
                    raise
        raise AssertionError("unreachable")

    return _in_thread(loop)


def test_a_batch_larger_than_every_ranks_room_is_cut_to_it() -> None:
    """1 -> 2, three states ready and room for two on each decode rank: both ranks refuse the batch for room
    before their go, so nothing landed anywhere. A plain StateTransfer cuts such a batch to the room and sends it
    again at once; the re-slicing sender took any rank's failure for one after the bytes (a batch in doubt), so it
    sent the same three under the same number on every later call, refused again each time: the states never
    went, however often the engine retried."""
    with one_to_two(2.0, host=(2, 2)) as (mgr, d1, d2, sender, into):
        for k, rid in enumerate("abc"):
            export_filled(mgr, rid, k)
        threads = [_receiving(x) for x in into]
        try:
            sent = sender.send()
        finally:
            for th, _ in threads:
                th.join(10)
        assert sent == ["a", "b"], "a batch refused for room by every rank was not cut to the room"
        assert [got for _, got in threads] == [[["a", "b"]], [["a", "b"]]]
        for d in (d1, d2):
            d.discard_arrived("a")
            d.discard_arrived("b")
            d.flush_nowait()
        threads = [_receiving(x) for x in into]
        assert sender.send() == ["c"]
        for th, got in threads:
            th.join(10)
            assert got == [["c"]]
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def test_two_sends_at_once_keep_a_batch_in_doubt_until_it_is_settled() -> None:
    """A StateTransfer's sends take turns (its send lock); a ReslicingSender's did not. Send A ships ``a``: rank 1
    lands it, rank 2 is not receiving yet, so A fails in doubt (rank 1 holds ``a``). Send B, from another thread
    meanwhile, ships ``b`` and succeeds once rank 2 comes back, and its success cleared the shared doubt: ``a``
    then went again under a new number, which rank 1 could not tell from a new state (refused as arrived twice
    while it awaits its import, landed a second time after it)."""
    with one_to_two(1.0) as (mgr, d1, d2, sender, into):
        stop = threading.Event()
        got: dict[int, list[str]] = {1: [], 2: []}
        errors: list[BaseException] = []

        def receiving(k: int) -> None:  # rank k takes every batch until told to stop
            while not stop.is_set():
                try:
                    got[k] += into[k - 1].receive()
                except mc.TransferRefusedError as exc:
                    errors.append(exc)
                except mc.TransferError:
                    pass  # no batch within the timeout: wait again
                except mc.SlotStateError as exc:  # a landing refused: an id arrived twice
                    errors.append(exc)

        export_filled(mgr, "a", 1)
        first = _in_thread(sender.send)
        rank1 = threading.Thread(target=receiving, args=(1,))
        rank1.start()
        try:
            while not got[1] and first[0].is_alive():  # rank 1 lands a; rank 2 never answers this try
                threading.Event().wait(0.02)
            export_filled(mgr, "b", 2)
            second = _in_thread(sender.send)
            first[0].join(10)
            assert isinstance(first[1][0], mc.TransferError), first[1]
            rank2 = threading.Thread(target=receiving, args=(2,))
            rank2.start()
            second[0].join(10)
            sent = second[1][0]
            if not isinstance(sent, BaseException) and "a" not in sent:
                sent = sent + sender.send()  # a, still in doubt, goes now (or: it went as a new batch)
        finally:
            stop.set()
            rank1.join(10)
            if "rank2" in locals():
                rank2.join(10)
        assert errors == [], f"a rank refused a state it held already: {errors}"
        assert sorted(sent) == ["a", "b"] and sorted(got[1]) == ["a", "b"] and sorted(got[2]) == ["a", "b"], (
            sent,
            got,
        )


def test_shards_that_are_not_one_batch_cost_no_gloo_pair() -> None:
    """2 -> 1: prefill rank 1's flush of ``b`` has not run when both send, so rank 0 sends ``[a, b]`` and rank 1
    ``[a]``: not one batch, and every rank hears that nothing landed (a normal event: both send again). The bytes
    had arrived whole over healthy pairs, but the answer was the one for bytes that failed (``fail``): each sender
    bumped its epoch and retired its pair, and the receiver retired its own at the next batch, two ProcessGroupGloo
    per rank per such round, kept for the life of the process (a decode side ran out of file descriptors)."""
    import mambacache._handoff._link as link

    with two_to_one(5.0) as (p0, p1, d, senders, receiver):
        retired = []
        for k in range(3):
            a, b = f"a{k}", f"b{k}"
            for rid in (a, b):
                export_filled(p0, rid, 1)
            export_filled(p1, a, 1)
            sends = [_in_thread(x.send) for x in senders]
            with pytest.raises(mc.TransferError, match="not one batch"):
                receiver.receive()
            for th, sent in sends:
                th.join(10)
                assert isinstance(sent[0], mc.TransferRefusedError) and sent[0].reason == "failed", sent
            export_filled(p1, b, 1)
            sends = [_in_thread(x.send) for x in senders]
            assert receiver.receive() == [a, b]
            for th, sent in sends:
                th.join(10)
                assert sent == [[a, b]]
            for rid in (a, b):
                d.discard_arrived(rid)
            d.flush_nowait()
            retired.append(len(link._RETIRED))
        assert retired[0] == retired[-1], f"gloo pairs retired after each round: {retired}"


@pytest.mark.no_transport
@pytest.mark.parametrize("wrong", ["a shard's spec", "other temporal heads", "two conv tensors"])
def test_a_spec_that_is_not_the_configs_is_refused_by_the_layout(wrong: str) -> None:
    """``StateLayout.from_config(config, spec)`` checked the spec's conv channels against a count it had derived
    from those very channels (inner = channels - 2 * groups * state: always equal), and the temporal heads not at
    all. A TP-2 rank's own spec (``mgr.pool.spec``, a shard) was taken for the full model's, and a spec of
    another head count was cut at heads the config does not have: wrong shards, no error, and a sender or
    receiver built over it passes its spec check. Now InvalidArgumentError, before any layout exists."""
    cfg = mamba2_config(1)
    full = mc.StateSpec.from_hf_config(cfg)
    spec = {
        "a shard's spec": mamba2_layout(1).shard_spec(2),
        "other temporal heads": mc.StateSpec(2, full.conv_shapes, (6, *full.temporal_shape[1:])),
        "two conv tensors": mc.StateSpec(2, [*full.conv_shapes, (4, 3)], full.temporal_shape),
    }[wrong]
    with pytest.raises(mc.InvalidArgumentError, match="not the config's"):
        StateLayout.from_config(cfg, spec)
    StateLayout.from_config(cfg, mc.StateSpec.from_hf_config(cfg, num_layers=1, temporal_dtype=torch.bfloat16))


def test_an_acknowledgement_that_fails_on_one_rank_still_answers_the_others() -> None:
    """2 -> 1: the state landed, and the acknowledgement to rank 0 failed (its store client's ``set`` raised:
    a connection reset). The loop stopped there, so rank 1 was never answered: its sender waited out its
    timeout, and this receiver's transfer from rank 1 kept the batch awaiting an answer that nothing could give
    any more (the caller never saw its ids): every later receive refused ("awaits its answer"), for good. Every
    rank is answered, and the landed ids are returned (raised, the error hid which states landed)."""
    with two_to_one(2.0) as (p0, p1, _, senders, receiver):
        inbox = receiver._transfers[0]._in
        real = inbox.call

        def reset_once(what: str, *args: Any) -> Any:  # the store client's one failure: the ack's write
            if what == "set" and str(args[0]).startswith("ack/"):
                inbox.call = real
                raise mc.TransferError("the key-value store failed (set): connection reset")
            return real(what, *args)

        inbox.call = reset_once
        for p in (p0, p1):
            export_filled(p, "a", 1)
        sends = [_in_thread(x.send) for x in senders]
        assert receiver.receive() == ["a"]  # landed: the failed answer is traced, not raised (the ids stay known)
        for th, _ in sends:
            th.join(10)
        assert sends[1][1] == [["a"]], f"rank 1 was not answered: {sends[1][1]}"
        for p in (p0, p1):
            export_filled(p, "b", 2)
        sends = [_in_thread(x.send) for x in senders]
        assert receiver.receive() == ["b"]  # rank 0's retry of a is acknowledged again (dup), not landed twice
        for th, _ in sends:
            th.join(10)
        assert [sent for _, sent in sends] == [[["a", "b"]], [["b"]]]  # rank 0: a in doubt (dup) first, then b


def test_a_cut_for_room_on_one_rank_does_not_split_the_ranks_batches_for_good() -> None:
    """2 -> 1 (found by test_reslice_soak.py, which hung): rank 0's header of ``[a, b]`` is refused for room
    (room for one), so its sender cuts to one state and keeps that cut (``Batches.limit``) until a batch of it
    succeeds. Meanwhile room comes back and rank 1's ``[a, b]`` is taken: rank 0 sent ``[a]``, not one batch,
    refused as ``failed`` on both. The cut stayed: rank 0 sent ``[a]`` and rank 1 ``[a, b]`` on every later try,
    with the decode side idle and room for both, for good (the soak: 115 s of "not one batch" until its
    deadline)."""
    with two_to_one(5.0) as (p0, p1, d, senders, receiver):
        d.land(["x", "y", "z"])  # arrived, not imported yet: room for one
        assert d.landing_room() == 1
        for p in (p0, p1):
            export_filled(p, "a", 1)
            export_filled(p, "b", 2)
        sends = [_in_thread(x.send) for x in senders]
        with pytest.raises(mc.TransferRefusedError):
            receiver.receive()  # rank 0's [a, b]: room for 1; its sender cuts to [a] and sends that at once
        for rid in "xyz":
            d.discard_arrived(rid)  # the step loop imported them: room for four
        d.flush_nowait()
        with pytest.raises(mc.TransferError, match="not one batch"):
            receiver.receive()  # [a] from rank 0, [a, b] from rank 1: both hear that nothing landed
        for th, sent in sends:
            th.join(10)
            assert isinstance(sent[0], mc.TransferRefusedError) and sent[0].reason == "failed", sent
        landed: list[str] = []
        for _ in range(3):  # both send again, as an engine's sender loop does
            sends = [_in_thread(x.send) for x in senders]
            try:
                landed = receiver.receive()
            except mc.TransferError as exc:
                assert "not one batch" in str(exc), exc
            for th, _ in sends:
                th.join(10)
            if landed:
                break
        assert landed == ["a", "b"], "the ranks' batches stayed apart: rank 0 kept its cut to the room it had"
        for rid in landed:
            d.discard_arrived(rid)
        d.flush_nowait()
        for p in (p0, p1):
            p.flush_nowait()
            p.check_idle(host=True)


@pytest.mark.no_transport
def test_an_engine_pools_conv_window_of_kernel_minus_one_is_a_layout_of_the_config() -> None:
    """An engine's adopted pool keeps ``kernel - 1`` conv columns per channel (SGLang's and TensorRT-LLM's conv
    state ``[conv_dim, d_conv - 1]``, ``docs/engines.md``), so its spec is the config's in everything the layout
    cuts (the conv channels, the temporal heads) but not in the conv window's width. ``ReslicingReceiver`` and
    ``ReslicingSender`` need ``layout.spec == mgr.pool.spec``, so such an engine passes its pool's spec; the new
    check compared whole shapes and refused it ("not the config's"), where the layout, which cuts the first
    dimension only, is right for it: the shards gather back byte for byte."""
    cfg = mamba2_config(groups=2)
    derived = mc.StateSpec.from_hf_config(cfg)
    channels, kernel = derived.conv_shapes[0]
    engine = dataclasses.replace(derived, conv_shapes=[(channels, kernel - 1)])
    layout = StateLayout.from_config(cfg, engine)
    assert layout.spec == engine
    assert layout.shard_spec(2).conv_shapes == ((channels // 2, kernel - 1),)
    full = [torch.randn(2, 3, *shape).to(dtype) for shape, dtype in engine.shapes()]
    back = layout.gather([layout.slice(full, 2, k) for k in range(2)])
    assert all(torch.equal(a, b) for a, b in zip(full, back, strict=True))


def test_a_first_try_one_rank_refused_for_room_and_another_never_took_is_cut_to_the_room() -> None:
    """1 -> 2, three states ready, room for two on rank 1 (its host pool holds two), rank 2 not receiving yet.
    Rank 1 refuses the batch for room before its go, rank 2's header is withdrawn: on this first try nothing
    landed anywhere. The re-slicing sender cut a batch only when *every* rank refused it, so this mix went in
    doubt: the same three under the same number on every later send, which rank 1, whose room can never be
    three, refused each time while rank 2 landed them: the states never went, however often the engine retried.
    Now a first try that no rank took is not in doubt, and a refusal for room cuts it: a and b go."""
    with one_to_two(1.0, host=(2, 4)) as (mgr, _, _, sender, into):
        for k, rid in enumerate("abc"):
            export_filled(mgr, rid, k)
        stop = threading.Event()
        got1: list[str] = []

        def receiving() -> None:  # rank 1 takes (or refuses) every header meanwhile
            while not stop.is_set():
                with contextlib.suppress(mc.TransferError):
                    got1.extend(into[0].receive())

        rank1 = threading.Thread(target=receiving)
        rank1.start()
        try:
            with contextlib.suppress(mc.TransferError):  # rank 2 is not receiving: what rank 1 took is in doubt
                sender.send()
            rank2, got2 = _receiving(into[1], tries=2)
            try:
                sent = sender.send()
            except mc.TransferError as exc:
                sent = [f"{type(exc).__name__}: {exc}"]
            rank2.join(10)
        finally:
            stop.set()
            rank1.join(15)
        assert sent[:2] == ["a", "b"], sent
        assert got1 == ["a", "b"] and got2 == [["a", "b"]]  # each landed once (rank 1's retry: dup)


def test_a_batch_the_sender_could_not_read_is_a_transfer_error_and_not_in_doubt(
    monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """1 -> 2: reading the batch (the shards are cut from fresh host tensors: ``export_rows`` and the layout's
    slices allocate) fails before any rank's header is posted, so no rank can hold this try. The re-slicing sender
    raised the error bare (every failure of a send is documented a TransferError, and send() traces only those:
    no transfer.failed line) and ``Batches.failed`` counted the batch in doubt, pinning the export to rank 1, a peer
    that never saw it: a sender to other ranks never took it again. A StateTransfer's send makes the same failure
    a NothingSent (test_transfer_in_doubt.py); now this one does too, and the next send delivers it."""
    import mambacache._handoff._reslice as reslice_mod

    with one_to_two(2.0) as (mgr, d1, d2, sender, into):
        export_filled(mgr, "a", 1)
        fail_once(monkeypatch, reslice_mod, _reading(transport), MemoryError("the shards' host tensors could not grow"))
        with pytest.raises(mc.TransferError, match="nothing was sent") as caught:
            sender.send()
        assert isinstance(caught.value.__cause__, MemoryError)
        assert [ev.request_id for ev in mgr.exports_ready(to=5)] == ["a"], "pinned to a rank that got nothing"
        threads = [_in_thread(x.receive) for x in into]
        try:
            assert sender.send() == ["a"]
        finally:
            for th, _ in threads:
                th.join(10)
        assert [got for _, got in threads] == [[["a"]], [["a"]]]
        for d in (d1, d2):
            d.discard_arrived("a")
            d.flush_nowait()
            d.check_idle(host=True)
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def _reading(transport: str) -> str:
    """What reads a batch's shards on the sender: cut from a host copy of the rows (gloo pushes them), or, over a
    wire that reads pieces, the byte ranges of the rows they lie in (read there by each rank)."""
    return "export_rows" if transport == "gloo" else "export_pieces"


def test_a_stop_iteration_while_the_shards_are_cut_is_nothing_sent_too(
    monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """1 -> 2: ``ReadingBatch``, first a generator context manager, let a StopIteration raised while the batch was read
    out bare, not as NothingSent (contextlib takes a RuntimeError caused by it for PEP 479's conversion, and
    NothingSent is one): the batch, read before any rank's header, was counted in doubt and pinned to rank 1."""
    import mambacache._handoff._reslice as reslice_mod

    with one_to_two(2.0) as (mgr, d1, d2, sender, _):
        slot = export_filled(mgr, "a", 1)
        fail_once(monkeypatch, reslice_mod, _reading(transport), StopIteration("an iterator ran dry"))
        with pytest.raises(mc.TransferError, match="nothing was sent") as caught:
            sender.send()
        assert isinstance(caught.value.__cause__, StopIteration)
        assert [ev.request_id for ev in mgr.exports_ready(to=5)] == ["a"], "pinned to a rank that got nothing"
        mgr.release(slot, "a")
        mgr.flush_nowait()
        mgr.check_idle(host=True)
        for d in (d1, d2):
            d.check_idle(host=True)


@pytest.mark.no_transport
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
