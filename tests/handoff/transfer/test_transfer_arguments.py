"""A transfer's public calls on bad input: a typed error, raised before anything is posted or waited for, and
nothing changed (the batch awaiting its answer still awaits it).
"""

from __future__ import annotations

import gc
from datetime import timedelta
from typing import Any

import pytest
import torch

import mambacache as mc

from ...support.link import in_thread as _in_thread
from ...support.link import store as _store
from ...support.link import transfer as _transfer
from ...support.util import quant_spec, small_spec

SPEC = small_spec(2)


def _mgr(slots: int = 4, host: int = 2) -> mc.CacheManager:
    return mc.CacheManager(mc.StatePool(SPEC, slots), host_pool=mc.HostPool(SPEC, host))


def _export(mgr: mc.CacheManager, rid: str, value: float) -> int:
    (slot,) = mgr.alloc(1, rid, clear=False)
    mgr.flush_nowait()
    for t in mgr.pool.tensors:
        t[:, slot] = value
    mgr.export(slot, rid, to=1)
    mgr.flush_nowait()
    return slot


def _posted(master: Any, src: int, dst: int) -> int:
    """How many headers ``src`` has posted to ``dst`` (the direction's counter in the store)."""
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    return int(dist.PrefixStore(f"mambacache/xfer/{src}>{dst}/", client).add("posted", 0))


_ROWS = [torch.zeros(2, 1, 3)]  # one pool tensor, two layers, one state


@pytest.mark.parametrize("store", ["x", object(), 5])
def test_a_transfer_with_something_else_than_a_store_is_a_typed_error(store: Any) -> None:
    """Was an AttributeError (``'str' object has no attribute 'clone'``)."""
    with _mgr() as mgr, pytest.raises(mc.InvalidArgumentError, match="a torch\\.distributed\\.Store"):
        mc.StateTransfer(mgr, None, peer=0, store=store, rank=1, timeout=1.0)


def test_a_transfer_built_on_a_store_whose_host_is_gone_is_a_transfer_error() -> None:
    """A joiner whose store host died: was a bare DistNetworkError from the store client's clone."""
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=1))
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=1))
    del master
    gc.collect()
    with _mgr() as mgr, pytest.raises(mc.TransferError, match="key-value store failed"):
        mc.StateTransfer(mgr, None, peer=0, store=client, rank=1, timeout=1.0)


@pytest.mark.no_transport
@pytest.mark.parametrize("bad", [-1, True, 1.5, "1"])
def test_the_new_arguments_refuse_bad_input_typed_and_change_nothing(bad: Any) -> None:
    with _mgr() as mgr:
        _export(mgr, "r", 1.0)
        taken = mgr.take_exports(to=1)
        with pytest.raises(mc.InvalidArgumentError, match="peer's rank"):
            mgr.exports_returned(taken, peer=bad)
        with pytest.raises(mc.InvalidArgumentError, match="callable"):
            mgr.land(["x"], bad)
        host = mgr.host_pool
        assert host is not None and host.num_held == 1 and mgr.exports_ready() == []  # still sending
        mgr.exports_returned(taken, peer=1)
        assert mgr.exports_ready(to=1) == taken


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
