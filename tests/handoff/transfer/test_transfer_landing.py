"""What a receiver lands and when: a state landed but not yet written is neither imported nor discarded; the room a
receiver reports is what a landing can take now, and a host slot a landing took is no one else's; a receive that
fails locally, or whose acknowledgement fails, says what landed, and the retry lands once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

import mambacache as mc
from mambacache import tracing

from ...support.link import in_thread as _in_thread
from ...support.link import store as _store
from ...support.link import transfer as _transfer
from ...support.loopback import OneBatch
from ...support.util import quant_spec, small_spec

SPEC = small_spec(2)


def _mgr(slots: int = 4, host: int = 2) -> mc.CacheManager:
    return mc.CacheManager(mc.StatePool(SPEC, slots), host_pool=mc.HostPool(SPEC, host))


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


def test_a_state_landed_but_not_yet_written_is_neither_imported_nor_discarded() -> None:
    """``receive()`` lands a batch (host slots held by the ids) and writes the rows after, outside the lock. In
    between, the ids counted as arrived: a step loop importing a request it expects read the host slot before
    the write (another request's old bytes), and a discard freed a slot the write then wrote into. Now they are
    arrived only once written: import_into and discard_arrived refuse them until then."""
    import mambacache._handoff._transfer as xfer_mod

    with _mgr(host=2) as mgr:
        host = mgr.host_pool
        assert host is not None
        rows = [torch.full((t.shape[0], 1, *t.shape[2:]), 7.0).to(t.dtype) for t in host.tensors]
        xfer = OneBatch(rows).transfer(mgr)  # the wire stood in
        writing, written = threading.Event(), threading.Event()
        real = xfer_mod.write_staging
        seen: list[str] = []

        def slow_write(m: mc.CacheManager, slots: list[int], r: list[torch.Tensor]) -> None:
            writing.set()
            assert written.wait(10)
            real(m, slots, r)

        xfer_mod.write_staging = slow_write  # type: ignore[assignment]
        try:
            t = threading.Thread(target=lambda: seen.extend(xfer.receive()))
            t.start()
            assert writing.wait(10)
            with pytest.raises(mc.SlotStateError):
                mgr.import_into(1, "r")  # the state is not there yet
            with pytest.raises(mc.SlotStateError):
                mgr.discard_arrived("r")
            written.set()
            t.join(10)
        finally:
            xfer_mod.write_staging = real  # type: ignore[assignment]
        assert seen == ["r"]
        mgr.import_into(1, "r")
        mgr.flush_nowait()
        assert all(bool(t[:, 1].eq(7.0).all()) for t in mgr.pool.tensors)
        mgr.release(1, "r")
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def test_a_receive_while_a_batch_of_receive_rows_awaits_its_answer_is_refused() -> None:
    """``receive_rows`` leaves its batch awaiting ``acknowledge``; a receive (either form) before that answer
    used to take the next header, leaving that batch's sender waiting and the answer meant for it to go to the
    next batch. Now it is a TransferError that touches nothing, and after the answer receiving works again."""

    with _mgr(host=2) as mgr:
        host = mgr.host_pool
        assert host is not None
        rows = [torch.full((t.shape[0], 1, *t.shape[2:]), 5.0).to(t.dtype) for t in host.tensors]
        inbox = OneBatch(rows)
        xfer = inbox.transfer(mgr)  # the wire stood in
        ids, got = xfer.receive_rows()
        assert ids == ["r"] and all(bool(g.eq(5.0).all()) for g in got)
        for call in (xfer.receive, xfer.receive_rows):
            with pytest.raises(mc.TransferError, match="awaits its answer"):
                call()
        assert inbox.offers == 1 and host.num_held == 0  # nothing taken, nothing landed
        xfer.acknowledge(ids)
        assert xfer.receive() == ["r"] and inbox.offers == 2
        mgr.import_into(1, "r")
        mgr.flush_nowait()
        assert all(bool(t[:, 1].eq(5.0).all()) for t in mgr.pool.tensors)
        mgr.release(1, "r")
        mgr.flush_nowait()
        mgr.check_idle(host=True)


def test_the_room_a_receiver_reports_is_what_a_landing_can_take_now() -> None:
    """A host slot freed in the step not yet flushed counts in ``host_pool.num_free`` but a landing cannot take
    it (its old bytes may still be read). The receiver judged headers and reported its room after a refusal by
    ``num_free``: the sender cut its batch to a room that was not there and was refused again. Now both are
    ``landing_room()``: the settled free slots."""

    with _mgr(host=2) as mgr:
        host = mgr.host_pool
        assert host is not None
        (a,) = mgr.alloc(1, "old", clear=False)
        (h,) = mgr.offload_many([a], "old")
        mgr.flush_nowait()
        mgr.drop(h)  # freed by a queued event: num_free 2, but one slot only is settled
        assert host.num_free == 2 and mgr.landing_room() == 1
        rows = [torch.full((t.shape[0], 2, *t.shape[2:]), 3.0).to(t.dtype) for t in host.tensors]
        inbox = OneBatch(rows)  # a batch of two states
        xfer = inbox.transfer(mgr)  # the wire stood in
        with pytest.raises(mc.TransferRefusedError) as info:
            xfer.receive()
        assert info.value.reason == "room"
        assert inbox.rooms == [1] and inbox.answers[0][1].startswith("room:1:"), (inbox.rooms, inbox.answers)
        assert host.num_held == 0 and mgr.landing_room() == 1  # nothing taken
        mgr.flush_nowait()
        assert mgr.landing_room() == 2
        mgr.release(a, "old")
        mgr.flush_nowait()
        mgr.check_idle(host=True)


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
        if transport == "gloo":
            receiving = into._bufs  # the receiver's alone (the sender gathers into buffers of its own)
            grow = transfer._Buffers.rows

            def rows(self: Any, *args: Any) -> Any:
                if self is not receiving:
                    return grow(self, *args)
                monkeypatch.setattr(transfer._Buffers, "rows", grow)
                raise MemoryError("the kept receive buffers could not grow")

            monkeypatch.setattr(transfer._Buffers, "rows", rows)
        else:
            find = transfer._landing_rows

            def landing_rows(mgr: mc.CacheManager, in_place: bool) -> Any:
                if mgr is not dst:  # the sender's own rows
                    return find(mgr, in_place)
                monkeypatch.setattr(transfer, "_landing_rows", find)
                raise MemoryError("the landing rows could not be found")

            monkeypatch.setattr(transfer, "_landing_rows", landing_rows)
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
