"""What a transfer holds ends with it: over every transport (``tests/conftest.py``), transfers made, used and then
closed (``StateTransfer.close``) or dropped leave no thread behind, and a closed transfer refuses every call, typed.

Over NIXL each transfer has an agent (UCX workers, a progress thread), over Mooncake a Transfer Engine (its RPC
and transport threads): the suite makes thousands of transfers in one process, so one that outlives its transfer
piles up threads for the rest of the run. The real link in one process (``tests/support/link.py``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

import mambacache as mc

from ...support.link import in_thread, store, transfer
from ...support.util import small_spec

SPEC = small_spec(2)
ROUNDS = 6


def _threads() -> int:
    """The threads of this process as the kernel counts them (native ones included: NIXL's, UCX's, Mooncake's)."""
    return len(os.listdir("/proc/self/task"))


def _mgr() -> mc.CacheManager:
    return mc.CacheManager(mc.StatePool(SPEC, 4), host_pool=mc.HostPool(SPEC, 2))


def _round(master: Any, close: bool) -> None:
    """A sender and a receiver transfer made, one batch moved between them, then both closed or dropped."""
    with _mgr() as src, _mgr() as dst:
        out, into = transfer(src, master, 0, 1, 5.0), transfer(dst, master, 1, 0, 5.0)
        (slot,) = src.alloc(1, "r", clear=False)
        src.flush_nowait()
        src.export(slot, "r")
        src.flush_nowait()
        thread, sent = in_thread(out.send)
        try:
            assert into.receive() == ["r"]
        finally:
            thread.join(10)
        assert sent == [["r"]], sent
        dst.discard_arrived("r")
        dst.flush_nowait()
        if close:
            out.close()
            into.close()
            out.close()  # idempotent


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
@pytest.mark.parametrize("end", ["closed", "dropped"])
def test_transfers_made_and_ended_leave_no_thread_behind(end: str) -> None:
    """Each NIXL transport's finalizer held the transport itself (its registered regions' callbacks were its
    bound methods), so no agent was released before the process exited: 404 threads in one pytest process after
    28 minutes of the suite, their progress threads busy. Now an ended transfer's agent or engine goes with it."""
    master = store()
    _round(master, end == "closed")  # the process-wide threads (UCX's, a transport's own pools) start once
    before = _threads()
    for _ in range(ROUNDS):
        _round(master, end == "closed")
    after = _threads()
    # A few threads of the last round may still be on their way out; a transfer that kept its own would add
    # at least one per round and side.
    assert after <= before + 2, f"{after - before} more threads after {ROUNDS} transfers made and {end}"


@pytest.mark.parametrize("end", ["closed", "dropped"])
def test_an_ended_transfers_mooncake_engine_goes_to_the_next_transfer(
    end: str, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Destroying a Mooncake Transfer Engine holds the GIL for about 0.8 s (measured: every Python thread of the
    process stopped), at a close or wherever the collector finalized its transfer: a late acknowledgement of any
    transfer of the process, an engine's step loop stalled. An ended transfer's engine is not destroyed but taken
    by the next transfer: as many engines as transfers alive at once."""
    if transport != "mooncake":
        pytest.skip("Mooncake's engines only (NIXL's agents are destroyed in milliseconds)")
    import mooncake.engine

    made: list[object] = []
    real = mooncake.engine.TransferEngine

    def counted() -> object:
        made.append(real())
        return made[-1]

    monkeypatch.setattr(mooncake.engine, "TransferEngine", counted)
    master = store()
    for _ in range(ROUNDS):
        _round(master, end == "closed")
    assert len(made) <= 2, f"{len(made)} engines made for {ROUNDS} rounds of two transfers alive at once"
    made.clear()


def test_a_closed_transfer_refuses_every_call_typed_and_changes_nothing() -> None:
    master = store()
    with _mgr() as src:
        out = transfer(src, master, 0, 1, 1.0)
        (slot,) = src.alloc(1, "r", clear=False)
        src.flush_nowait()
        src.export(slot, "r")
        src.flush_nowait()
        out.close()
        for call in (out.send, out.receive, out.receive_rows):
            with pytest.raises(mc.TransferError, match="closed"):
                call()
        with pytest.raises(mc.TransferError, match="closed"):
            out.send_rows(["x"], [t[:, :1].clone() for t in src.host_pool.tensors], 1)  # type: ignore[union-attr]
        assert src.held() == {slot: "r"} and src.exports_ready() != [], "a closed transfer changed the manager"
        # Another transfer of the manager sends what the closed one left.
        into_mgr = _mgr()
        with into_mgr:
            again, into = transfer(src, master, 0, 1, 5.0), transfer(into_mgr, master, 1, 0, 5.0)
            thread, sent = in_thread(again.send)
            try:
                assert into.receive() == ["r"]
            finally:
                thread.join(10)
            assert sent == [["r"]], sent
            into_mgr.discard_arrived("r")
            into_mgr.flush_nowait()


def test_rows_the_transport_cannot_offer_are_a_typed_error_nothing_sent_and_not_in_doubt() -> None:
    """A pulled wire offers a batch's rows before its header goes out (registering rows outside the pools,
    publishing the agent's metadata): a failure there (NIXL refusing a registration, the store refusing the
    metadata) escaped ``send()`` bare, and the export was counted in doubt with that peer (pinned to it) although
    no header was posted. A TransferError, nothing sent, not in doubt; the next send delivers it."""
    master = store()
    with _mgr() as src, _mgr() as dst:
        out, into = transfer(src, master, 0, 1, 5.0), transfer(dst, master, 1, 0, 5.0)
        (slot,) = src.alloc(1, "r", clear=False)
        src.flush_nowait()
        src.export(slot, "r")
        src.flush_nowait()
        wire = out._out.wire  # type: ignore[attr-defined]
        real = wire.source

        def refused(raw: list[Any]) -> Any:
            wire.source = real
            raise RuntimeError("memory registration refused")

        wire.source = refused
        with pytest.raises(mc.TransferError, match="nothing was sent") as failed:
            out.send()
        assert failed.value.request_ids == ["r"]
        assert int(out._out.store.add("posted", 0)) == 0, "a header went out"  # type: ignore[attr-defined]
        assert src.exports_in_doubt(src.exports_ready()) == [None], "an export nothing was sent of is in doubt"
        thread, sent = in_thread(out.send)
        try:
            assert into.receive() == ["r"]
        finally:
            thread.join(10)
        assert sent == [["r"]], sent
        dst.discard_arrived("r")
        dst.flush_nowait()
