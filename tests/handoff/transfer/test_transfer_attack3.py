"""Adversarial checks of the state transfer, third round: each fails on the code before its fix.

Where the transfer meets the rest of the manager (pool layouts, the async
forms, the arguments of its public calls). Some run the real link in one
process: two ``StateTransfer`` built from clients of one ``TCPStore`` on
127.0.0.1 (``store=``, ``rank=``), the sender in a thread, the gloo pair
between them built as between two processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

import mambacache as mc
from mambacache import tracing

from ...support.link import fail_once, staged_and_in_place
from ...support.link import in_thread as _in_thread
from ...support.link import store as _store
from ...support.link import transfer as _transfer
from ...support.util import paged_pool, quant_spec


@contextlib.contextmanager
def _one_export(
    value: float, timeout: float
) -> Iterator[tuple[mc.CacheManager, mc.CacheManager, mc.StateTransfer, mc.StateTransfer]]:
    """A sender whose staged export ``r`` holds ``value`` everywhere, a receiver with room, and the link between:
    ``(src, dst, out, into)``. On a clean exit the sender holds nothing (its export was delivered)."""
    spec = quant_spec(2)
    master = _store()
    with (
        mc.CacheManager(mc.StatePool(spec, 4), host_pool=mc.HostPool(spec, 2)) as src,
        mc.CacheManager(mc.StatePool(spec, 4), host_pool=mc.HostPool(spec, 2)) as dst,
    ):
        (slot,) = src.alloc(1, "r", clear=False)
        for t in src.pool.exec_tensors:
            t[:, slot] = value
        src.flush_nowait()
        src.export(slot, "r")
        src.flush_nowait()
        yield src, dst, _transfer(src, master, 0, 1, timeout), _transfer(dst, master, 1, 0, timeout)
        src.flush_nowait()
        src.check_idle(host=True)


def _imports_once(dst: mc.CacheManager, value: float) -> None:
    """``r`` arrived at ``dst`` (once: the import takes it) and holds ``value`` everywhere."""
    (new,) = dst.alloc(1, "x", clear=False)
    dst.release(new)
    dst.import_into(new, "r")
    dst.flush_nowait()
    assert all(bool((t[:, new] == value).all()) for t in dst.pool.exec_tensors)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, whatever its strides (a float8 or a scalar-shaped row compares bit for bit)."""
    return t.reshape(-1).clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


# -- pool layouts ------------------------------------------------------------------------------------------------
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


def _fail_reading_once(monkeypatch: pytest.MonkeyPatch, transport: str, error: BaseException) -> None:
    """The next read of a batch's rows for a send raises ``error``: gathering them into the kept buffers (gloo,
    whose one-state batch is gathered), or finding where they lie (a pulled wire reads them there)."""
    import mambacache._handoff._transfer as transfer

    if transport == "gloo":
        fail_once(monkeypatch, transfer, "export_rows", error)
    else:
        fail_once(monkeypatch, transfer._Rows, "pieces", error)


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


# -- bad input ---------------------------------------------------------------------------------------------------
def _posted(master: Any, src: int, dst: int) -> int:
    """How many headers ``src`` has posted to ``dst`` (the direction's counter in the store)."""
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    return int(dist.PrefixStore(f"mambacache/xfer/{src}>{dst}/", client).add("posted", 0))


_ROWS = [torch.zeros(2, 1, 3)]  # one pool tensor, two layers, one state


@pytest.mark.parametrize(
    ("ids", "rows", "seq"),
    [
        ("ab", _ROWS, 1),  # a str: sent as the ids ['a', 'b']
        ([], [torch.zeros(2, 0, 3)], 1),  # no state
        (["a", "a"], [torch.zeros(2, 2, 3)], 1),  # one id twice: the peer refuses it as a header
        ([1], _ROWS, 1),
        (["a"], None, 1),  # a bare TypeError
        (["a"], [1], 1),  # a bare AttributeError
        (["a"], [], 1),  # no pool tensor
        (["a"], [torch.zeros(2, 3)], 1),  # not [layers, n, *state]
        (["a"], [torch.zeros(2, 2, 3)], 1),  # two states' rows for one id
        (["a"], [torch.zeros(2, 1, 3), torch.zeros(3, 1, 3)], 1),  # two layer counts
        (["a"], _ROWS, "1"),  # posted: the peer refuses the header
        (["a"], _ROWS, True),
        (["a"], _ROWS, 1.0),
    ],
)
def test_send_rows_refuses_bad_input_typed_before_anything_is_posted(ids: Any, rows: Any, seq: Any) -> None:
    """``send_rows`` (the re-slicing sender's wire) took any arguments: a str of ids went as its characters, a seq
    that is not an int, rows of another count than the ids, went out as a header that the peer could only refuse
    (or that waited out the timeout with nobody there), and rows that are not tensors raised a bare TypeError or
    AttributeError. Each is an InvalidArgumentError now, before a header is posted."""
    spec = quant_spec(2)
    master = _store()
    with mc.CacheManager(mc.StatePool(spec, 2), host_pool=mc.HostPool(spec, 1)) as mgr:
        out = _transfer(mgr, master, 0, 1, 0.3)  # nobody receives: a header posted waits this out
        with pytest.raises(mc.InvalidArgumentError):
            out.send_rows(ids, rows, seq)
        assert _posted(master, 0, 1) == 0, "a header went out for a call that was refused"


@pytest.mark.parametrize(
    "shapes",
    [
        "abc",  # a bare ValueError
        [1],  # a bare TypeError
        [((2,), "float32")],  # a dtype's name: refused the sender's batch as of another spec
        [((2,), torch.float32, 0)],
        [((0,), torch.float32)],
        [((2.0,), torch.float32)],
        [],
    ],
)
def test_receive_rows_refuses_bad_shapes_typed_before_it_waits(shapes: Any) -> None:
    """``receive_rows(shapes)`` unpacked whatever it was given: a bare ValueError or TypeError, or, for a dtype
    given by name, a wait for the sender's batch that it then refused as being of another spec (the sender told
    its states can never go). An InvalidArgumentError now, before anything is read from the store."""
    spec = quant_spec(2)
    master = _store()
    with mc.CacheManager(mc.StatePool(spec, 2), host_pool=mc.HostPool(spec, 1)) as mgr:
        into = _transfer(mgr, master, 1, 0, 0.3)
        with pytest.raises(mc.InvalidArgumentError):
            into.receive_rows(shapes)


def test_acknowledge_refuses_bad_input_typed_and_the_batch_still_awaits_its_answer() -> None:
    """``acknowledge`` read ``landed`` by its truth (``landed="no"`` acknowledged the batch as landed: the sender
    freed slots whose states were never kept), took a str of ids for its characters, and raised a bare
    AttributeError for a ``why`` that is not a str. Each is an InvalidArgumentError now, nothing answered: the
    batch still awaits its answer, and the real one reaches the sender."""
    spec = quant_spec(2)
    master = _store()
    with mc.CacheManager(mc.StatePool(spec, 2), host_pool=mc.HostPool(spec, 1)) as mgr:
        out, into = _transfer(mgr, master, 0, 1, 5.0), _transfer(mgr, master, 1, 0, 5.0)
        thread, sent = _in_thread(lambda: out.send_rows(["r"], [torch.ones(2, 1, 3)], 1))
        try:
            ids, rows = into.receive_rows([((3,), torch.float32)])
            assert ids == ["r"] and torch.equal(rows[0], torch.ones(2, 1, 3))
            for bad in (
                {"request_ids": "r"},
                {"request_ids": ["r"], "landed": "no"},
                {"request_ids": ["r"], "landed": 0, "why": 5},
            ):
                with pytest.raises(mc.InvalidArgumentError):
                    into.acknowledge(**bad)
            assert not sent, "the sender heard an answer to a refused call"
            into.acknowledge(["r"], landed=False, why="kept by the test")
        finally:
            thread.join(10)
        assert isinstance(sent[0], mc.TransferRefusedError) and "kept by the test" in str(sent[0]), sent


# -- the prefix cache beside a receiving thread --------------------------------------------------------------
@pytest.mark.no_transport
def test_a_prefix_eviction_whose_host_slot_a_landing_took_meanwhile_drops_the_checkpoint_instead() -> None:
    """The prefix cache moves an evicted checkpoint to the host tier when ``host_pool.num_free`` says there is a
    slot; a transfer's ``receive()`` in another thread (allowed beside the step loop) may land a state in that
    very slot between the read and the offload. The offload then raised PoolExhaustedError out of ``insert``
    (documented to return False when it cannot make room, never to raise for it), with a checkpoint that could
    simply have been dropped. The eviction drops it then, as with a full host tier."""
    from mambacache._tiers import _hostpool

    spec = quant_spec(2)
    owner: list[mc.CacheManager] = []  # the manager the landing goes through, once made

    class Landing(_hostpool.HostPool):
        """The receive thread's landing, made right after the cache's last read of ``num_free`` before its offload
        (that interleaving, made deterministic): it takes the free host slot. ``race``: the reads until then."""

        race = 0

        @property
        def num_free(self) -> int:
            free = super().num_free
            if self.race:
                self.race -= 1
                if not self.race:
                    assert free
                    owner[0].land(["arrived"])
            return free

    host = Landing(spec, 1)
    with mc.CacheManager(mc.StatePool(spec, 4), host_pool=host) as mgr:
        owner.append(mgr)
        cache = mc.PrefixCache(mgr, max_checkpoints=1, host_checkpoints=1)
        (slot,) = mgr.alloc(1, "req", clear=False)
        mgr.flush_nowait()
        assert cache.insert([1, 2], slot)
        host.race = 2  # the eviction's check of the tier's room, then its check that a slot is free
        assert cache.insert([3, 4], slot), "the second checkpoint was not made"
        assert not host.race and mgr.landing_room() == 0
        assert cache.match([1, 2]) is None and cache.match([3, 4]) is not None  # the first one dropped
        cache.close()
        mgr.discard_arrived("arrived")
        mgr.release(slot, "req")
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def test_a_receive_that_fails_locally_raises_a_transfer_error_and_the_retry_lands_once(
    monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """The receiver's own fault while it takes a batch (its kept buffers could not grow; over a pulled wire, which
    reads into the rows where they lie, finding them) is answered "failed" to the sender, which keeps the
    states; the receiver raised it bare, where every failure of a transfer is a TransferError. The sender's next
    send lands the batch once."""
    from mambacache._handoff import _transfer as transfer

    with _one_export(7, 2.0) as (_, dst, out, into):

        class Failing(transfer._Buffers):
            def rows(self, *args: Any) -> Any:
                raise MemoryError("the kept receive buffers could not grow")

        if transport == "gloo":
            into._bufs = Failing()  # the receiver's alone (the sender gathers into buffers of its own)
        else:
            fail_once(monkeypatch, into, "_rows", MemoryError("the landing rows could not be found"))
        thread, sent = _in_thread(out.send)
        try:
            with pytest.raises(mc.TransferError, match="nothing landed") as caught:
                into.receive()
        finally:
            thread.join(10)
        assert isinstance(caught.value.__cause__, MemoryError) and caught.value.request_ids == ["r"]
        assert len(sent) == 1 and isinstance(sent[0], mc.TransferRefusedError), sent  # the sender keeps it
        thread, sent = _in_thread(out.send)
        try:
            assert into.receive() == ["r"]
        finally:
            thread.join(10)
        assert sent == [["r"]]
        _imports_once(dst, 7)


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


def test_a_receive_whose_acknowledgement_fails_returns_the_ids_that_landed() -> None:
    """The batch landed (arrived, importable), then the acknowledgement's write to the store failed (a connection
    reset). receive() raised the store's TransferError, which carries no ids: the engine never learned which states
    had arrived, so it could not import them (check_idle named them later). It returns them now, with a
    transfer.failed line; the sender, unanswered, sends again and is acknowledged as a duplicate."""
    with _one_export(5, 1.0) as (_, dst, out, into):
        inbox = into._in
        real = inbox.call

        def reset_once(what: str, *args: Any) -> Any:
            if what == "set" and str(args[0]).startswith("ack/"):
                inbox.call = real  # type: ignore[method-assign]
                raise mc.TransferError("the key-value store failed (set): connection reset")
            return real(what, *args)

        inbox.call = reset_once  # type: ignore[method-assign]
        thread, sent = _in_thread(out.send)
        tracing.configure(level="info", use_structlog_config=True)
        try:
            with capture_logs() as logs:
                got = into.receive()
        finally:
            tracing.disable()
        thread.join(10)
        assert got == ["r"]
        assert [(e["event"], e.get("call")) for e in logs] == [
            ("transfer.receive", None), ("transfer.failed", "acknowledge")
        ], logs  # fmt: skip
        assert isinstance(sent[0], mc.TransferError), sent  # unanswered: in doubt
        thread, sent = _in_thread(out.send)  # the retry: acknowledged as a duplicate, not landed again
        try:
            with pytest.raises(mc.TransferError, match="no batch"):
                into.receive()
        finally:
            thread.join(10)
        assert sent == [["r"]], sent
        _imports_once(dst, 5)


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
