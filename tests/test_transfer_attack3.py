"""Adversarial checks of the state transfer, third round: each fails on the code before its fix.

Where the transfer meets the rest of the manager (pool layouts, the async
forms, the arguments of its public calls). Some run the real link in one
process: two ``StateTransfer`` built from clients of one ``TCPStore`` on
127.0.0.1 (``store=``, ``rank=``), the sender in a thread, the gloo pair
between them built as between two processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

import mambacache as mc

from .util import paged_pool, quant_spec


# -- the real link in one process (as tests/test_transfer_attack2.py; tests share helpers only through util) ------
def _store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _transfer(mgr: mc.CacheManager, master: Any, rank: int, peer: int, timeout: float) -> mc.StateTransfer:
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    return mc.StateTransfer(mgr, None, peer=peer, store=client, rank=rank, timeout=timeout)


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``call`` in a thread; its result (or its exception) lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # handed to the test's thread
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


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


def test_a_batch_that_could_not_be_read_before_its_header_is_not_in_doubt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A send that fails while it reads the batch's rows (growing the kept buffers ran out of memory, an
    accelerator's event wait failed), before any header is posted, put nothing anywhere. It raised that error
    bare (not a TransferError, as every failure of a send is documented to be) and counted the batch in doubt:
    an export to no one was pinned to the peer that never saw a byte of it, and the transfer to another peer
    never took it again."""
    import mambacache._handoff._transfer as transfer

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
        read = transfer.export_rows

        def out_of_memory(*args: Any) -> Any:
            monkeypatch.setattr(transfer, "export_rows", read)  # once
            raise MemoryError("the kept send buffers could not grow")

        monkeypatch.setattr(transfer, "export_rows", out_of_memory)
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
