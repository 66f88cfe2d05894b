"""What a pulled transport (NIXL, Mooncake) reads when states are re-sliced between tensor-parallel sizes.

Each read the transport makes is recorded from outside (what hands NIXL or Mooncake its descriptors is
wrapped: the local address, the remote address and the byte count of every one), and checked byte for byte
against the layout's own rule, ``StateLayout.slice`` of a row of byte positions: decode rank ``k`` reads from
the prefill rank exactly the bytes of its shard, where they lie in the prefill side's staging or pool rows,
once each, and writes them where they belong in its landing rows (TP 2 -> 1: each prefill rank's shard straight
into its parts of the whole state's rows). The real link runs in one process, as in ``test_reslice_batches.py``.
Over gloo nothing is read (the sender pushes whole messages): skipped.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import mambacache as mc
from mambacache._handoff._reslice import ReslicingReceiver, StateLayout

from ...support.link import in_thread
from ...support.link import store as _store
from ...support.link import transfer as _transfer
from ...support.reslice import fill_slot, host_manager, mamba2_layout, one_to_two

Read = tuple[Any, int, int, int]  # (who read: its wire or engine, local address, remote address, bytes)


@pytest.fixture
def reads(transport: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Read]]:
    """Every descriptor the transport reads in the test, recorded as its wire hands it to NIXL or Mooncake."""
    if transport == "gloo":
        pytest.skip("gloo pushes whole messages: the receiver reads nothing")
    got: list[Read] = []
    lock = threading.Lock()
    if transport == "nixl":
        from mambacache._handoff._transports import _nixl

        real_nixl = _nixl.NixlWire._read

        def nixl_read(self: Any, raw: Any, plan: list[list[tuple[int, int, int, int]]], *args: Any) -> None:
            with lock:
                got.extend((self, la, ra, n) for cuts in plan for la, ra, n, _ in cuts)
            real_nixl(self, raw, plan, *args)

        monkeypatch.setattr(_nixl.NixlWire, "_read", nixl_read)
    else:
        from mambacache._handoff._transports import _mooncake

        real_mooncake = _mooncake._read

        def mooncake_read(engine: Any, segment: str, local: list[int], remote: list[int], sizes: list[int]) -> Any:
            with lock:
                got.extend((engine, a, b, n) for a, b, n in zip(local, remote, sizes, strict=True))
            return real_mooncake(engine, segment, local, remote, sizes)

        monkeypatch.setattr(_mooncake, "_read", mooncake_read)
    yield got


def _reader(x: mc.StateTransfer) -> Any:
    """What the reads of ``x``'s receiving side are recorded under: its NIXL wire, or its Mooncake engine."""
    wire = x._in.wire
    return wire.transport.engine if x.transport == "mooncake" else wire


def _offsets(layout: StateLayout, tp: int, rank: int) -> list[set[int]]:
    """Per pool tensor, the bytes of one state's row that rank ``rank``'s shard at ``tp`` is made of: the layout's
    ``slice`` (what the gloo wire sends) of a row whose every byte holds its own position."""
    rows = [torch.arange(math.prod(s) * d.itemsize).view(1, 1, *s, d.itemsize) for s, d in layout.spec.shapes()]
    return [set(t.flatten().tolist()) for t in layout.slice(rows, tp, rank)]


def _where(address: int, tensors: list[torch.Tensor]) -> tuple[int, int, int, int] | None:
    """``(tensor, layer, slot, byte in the row)`` of ``address`` in stacked ``[layers, slots + 1, *state]`` host
    tensors (a pool's, a host pool's), None outside them."""
    for i, t in enumerate(tensors):
        row = t[0, 0].numel() * t.element_size()
        offset = address - t.data_ptr()
        if 0 <= offset < t.numel() * t.element_size():
            layer, rest = divmod(offset, t.shape[1] * row)
            slot, byte = divmod(rest, row)
            return i, layer, slot, byte
    return None


def _bytes(reads: list[Read], local: bool) -> list[int]:
    """Every byte the reads wrote (``local``) or read, one entry per time it was."""
    return [(a if local else b) + i for _, a, b, n in reads for i in range(n)]


def _rows(addresses: list[int], tensors: list[torch.Tensor]) -> dict[tuple[int, int, int], set[int]]:
    """The bytes at ``addresses`` by the row they lie in, ``(tensor, layer, slot) -> bytes of it``; every
    address must lie in ``tensors``."""
    out: dict[tuple[int, int, int], set[int]] = {}
    for address in addresses:
        where = _where(address, tensors)
        assert where is not None, f"a byte read or written outside the rows it belongs to: {address:#x}"
        out.setdefault(where[:3], set()).add(where[3])
    return out


@pytest.mark.parametrize("in_place", [False, True])
def test_tp1_to_tp2_each_decode_rank_reads_only_its_shard_where_it_lies(reads: list[Read], in_place: bool) -> None:
    """1 -> 2 (x split, B and C replicated, a scalar extra replicated): each decode rank reads from the prefill
    rank exactly its shard's bytes of each state, once each, out of the rows the states lie in (the staging host
    rows, or the pool slots exported in place) and into its landing rows (staging host rows, or the slots awaiting
    them). The sender used to copy the whole states out of their rows and cut each shard into a fresh tensor
    (the transport read those copies) and the receiver to read into a buffer and copy it into place."""
    layout = mamba2_layout()
    with one_to_two(5.0) as (mgr, d1, d2, sender, into):
        slots = []
        for seed, rid in enumerate(("a", "b")):
            (slot,) = mgr.alloc(1, rid, clear=False)
            mgr.flush_nowait()
            fill_slot(mgr, slot, seed)
            mgr.export(slot, rid, in_place=in_place)
            mgr.flush_nowait()
            slots.append(slot)
        sources = {ev.request_id: ev.slot if in_place else ev.host for ev in mgr.exports_ready(to=1)}
        full = [t[:, slots].clone() for t in mgr.pool.tensors]
        if in_place:
            for d in (d1, d2):
                d.expect_import(4, "a")
                d.expect_import(2, "b")
                d.flush_nowait()
        threads = [in_thread(x.receive) for x in into]
        assert sender.send() == ["a", "b"]
        for th, got in threads:
            th.join(10)
            assert got == [["a", "b"]]
        read_from = mgr.pool.tensors if in_place else mgr.host_pool.tensors  # type: ignore[union-attr]
        for k, d in enumerate((d1, d2)):
            landing = d.pool.tensors if in_place else d.host_pool.tensors  # type: ignore[union-attr]
            mine = [r for r in reads if r[0] is _reader(into[k])]
            remote = _bytes(mine, local=False)
            assert len(remote) == len(set(remote)) == 2 * layout.shard_spec(2).slot_bytes, "read more than its shard"
            want = {
                (i, layer, sources[rid]): offsets
                for i, offsets in enumerate(_offsets(layout, 2, k))
                for layer in range(layout.spec.num_layers)
                for rid in ("a", "b")
            }
            assert _rows(remote, read_from) == want, "the bytes read are not the shard's, where it lies"
            written = _rows(_bytes(mine, local=True), landing)
            assert len(written) == 2 * len(landing) * layout.spec.num_layers  # the rows of the two states, whole
            assert all(got == set(range(landing[i][0, 0].nbytes)) for (i, _, _), got in written.items())
            if not in_place:
                d.import_into(4, "a")
                d.import_into(2, "b")
                d.flush_nowait()
            want_rows = layout.slice(full, 2, k)
            for got_t, w in zip(d.pool.tensors, want_rows, strict=True):
                assert torch.equal(got_t[:, [4, 2]].contiguous().view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("in_place", [False, True])
def test_tp2_to_tp1_each_prefill_ranks_shard_is_read_straight_into_its_parts(reads: list[Read], in_place: bool) -> None:
    """2 -> 1 (x split, B and C and a scalar extra replicated): the decode side reads from each prefill rank its
    shard once, and writes it straight into that rank's parts of the landing rows (staging host rows, or the pool
    slots awaiting the states): rank 0's replicated parts there too, rank 1's elsewhere (they are compared, not
    landed twice). Every byte of the whole state is written into the rows once. It used to read each shard into
    a fresh tensor, join them into another and copy that into place."""
    layout = mamba2_layout(1)
    shard = layout.shard_spec(2)
    master = _store()
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(layout.spec.num_layers, 2, *s, generator=g).to(d) for s, d in layout.spec.shapes()]
    full[-1].fill_(0.5)  # the replicated scalar: one value on both ranks
    with host_manager(shard) as p0, host_manager(shard) as p1, host_manager(layout.spec) as d:
        senders = [_transfer(p0, master, 0, 2, 5.0), _transfer(p1, master, 1, 2, 5.0)]
        receiver = ReslicingReceiver(d, [_transfer(d, master, 2, 0, 5.0), _transfer(d, master, 2, 1, 5.0)], layout)
        for k, p in enumerate((p0, p1)):
            for j, rid in enumerate(("a", "b")):
                (slot,) = p.alloc(1, rid, clear=False)
                p.flush_nowait()
                for t, part in zip(p.pool.tensors, layout.slice(full, 2, k), strict=True):
                    t[:, slot] = part[:, j]
                p.export(slot, rid, in_place=in_place)
                p.flush_nowait()
        if in_place:
            d.expect_import(5, "a")
            d.expect_import(1, "b")
            d.flush_nowait()
        sends = [in_thread(x.send) for x in senders]
        assert receiver.receive() == ["a", "b"]
        for th, sent in sends:
            th.join(10)
            assert sent == [["a", "b"]]
        landing = d.pool.tensors if in_place else d.host_pool.tensors  # type: ignore[union-attr]
        offsets = _offsets(layout, 2, 0), _offsets(layout, 2, 1)
        filled: dict[tuple[int, int, int], list[int]] = {}
        for k in (0, 1):
            mine = [r for r in reads if r[0] is _reader(receiver._transfers[k])]
            remote = _bytes(mine, local=False)
            assert len(remote) == len(set(remote)) == 2 * shard.slot_bytes, "read more than the rank's shard"
            written = _bytes(mine, local=True)
            into_rows = [a for a in written if _where(a, landing) is not None]
            replicated = [offsets[0][i] & offsets[1][i] for i in range(len(offsets[0]))]
            elsewhere = 2 * layout.spec.num_layers * sum(len(r) for r in replicated)
            assert len(written) - len(into_rows) == (elsewhere if k else 0), "replicated parts landed twice"
            for row, got in _rows(into_rows, landing).items():
                want = offsets[k][row[0]] - (replicated[row[0]] if k else set())
                assert got == want, f"rank {k}'s bytes are not its parts of row {row}"
                filled.setdefault(row, []).extend(got)
        for (i, _, _), got in filled.items():
            assert sorted(got) == list(range(landing[i][0, 0].nbytes))
        assert len(filled) == 2 * len(landing) * layout.spec.num_layers
        if not in_place:
            d.import_into(5, "a")
            d.import_into(1, "b")
            d.flush_nowait()
        for got_t, w in zip(d.pool.tensors, full, strict=True):
            assert torch.equal(got_t[:, [5, 1]].contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))


def test_tp2_to_tp1_replicated_parts_that_differ_land_nothing(transport: str) -> None:
    """2 -> 1: prefill rank 1's copy of a replicated part (C) differs from rank 0's. Over every transport the
    receive is a TransferError naming the cause, nothing arrives, and each sender hears it did not land (not in
    doubt); with rank 1's bytes put right, the next send lands the state exactly."""
    layout = mamba2_layout(1)
    shard = layout.shard_spec(2)
    master = _store()
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(layout.spec.num_layers, 1, *s, generator=g).to(d) for s, d in layout.spec.shapes()]
    full[-1].fill_(0.25)
    with host_manager(shard) as p0, host_manager(shard) as p1, host_manager(layout.spec) as d:
        senders = [_transfer(p0, master, 0, 2, 5.0), _transfer(p1, master, 1, 2, 5.0)]
        receiver = ReslicingReceiver(d, [_transfer(d, master, 2, 0, 5.0), _transfer(d, master, 2, 1, 5.0)], layout)
        hosts = []
        for k, p in enumerate((p0, p1)):
            (slot,) = p.alloc(1, "a", clear=False)
            p.flush_nowait()
            for t, part in zip(p.pool.tensors, layout.slice(full, 2, k), strict=True):
                t[:, slot] = part[:, 0]
            p.export(slot, "a")
            p.flush_nowait()
            hosts.append(p.exports_ready(to=2)[0].host)
        assert p1.host_pool is not None and hosts[1] is not None
        right = p1.host_pool.tensors[0][:, hosts[1], -1].clone()
        p1.host_pool.tensors[0][:, hosts[1], -1] += 1  # the last channel of C, replicated: rank 1's differs
        sends = [in_thread(x.send) for x in senders]
        with pytest.raises(mc.TransferError, match="differ"):
            receiver.receive()
        for th, sent in sends:
            th.join(10)
            assert isinstance(sent[0], mc.TransferRefusedError) and sent[0].reason == "failed", sent
        assert d.host_pool is not None and d.host_pool.num_held == 0
        with pytest.raises(mc.SlotStateError):
            d.import_into(1, "a")
        p1.host_pool.tensors[0][:, hosts[1], -1] = right
        sends = [in_thread(x.send) for x in senders]
        assert receiver.receive() == ["a"]
        for th, sent in sends:
            th.join(10)
            assert sent == [["a"]]
        d.import_into(1, "a")
        d.flush_nowait()
        for got_t, w in zip(d.pool.tensors, full, strict=True):
            assert torch.equal(got_t[:, 1].contiguous().view(torch.uint8), w[:, 0].contiguous().view(torch.uint8))


def test_tp2_to_tp1_lands_in_the_slots_that_await_the_states(transport: str) -> None:
    """2 -> 1 into pool slots that await the states (``expect_import``): over every transport the receiver lands
    them there, exact, and takes no staging host slot (it landed them in staging, a copy more at the import)."""
    layout = mamba2_layout(1)
    shard = layout.shard_spec(2)
    master = _store()
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(layout.spec.num_layers, 1, *s, generator=g).to(d) for s, d in layout.spec.shapes()]
    full[-1].fill_(0.5)
    with host_manager(shard) as p0, host_manager(shard) as p1, host_manager(layout.spec) as d:
        senders = [_transfer(p0, master, 0, 2, 5.0), _transfer(p1, master, 1, 2, 5.0)]
        receiver = ReslicingReceiver(d, [_transfer(d, master, 2, 0, 5.0), _transfer(d, master, 2, 1, 5.0)], layout)
        for k, p in enumerate((p0, p1)):
            (slot,) = p.alloc(1, "a", clear=False)
            p.flush_nowait()
            for t, part in zip(p.pool.tensors, layout.slice(full, 2, k), strict=True):
                t[:, slot] = part[:, 0]
            p.export(slot, "a")
            p.flush_nowait()
        d.expect_import(3, "a")
        d.flush_nowait()
        sends = [in_thread(x.send) for x in senders]
        assert receiver.receive() == ["a"]
        for th, sent in sends:
            th.join(10)
            assert sent == [["a"]]
        assert d.host_pool is not None and d.host_pool.num_held == 0, "landed in staging"
        for got_t, w in zip(d.pool.tensors, full, strict=True):
            assert torch.equal(got_t[:, 3].contiguous().view(torch.uint8), w[:, 0].contiguous().view(torch.uint8))
        d.import_into(3, "a")
        d.flush_nowait()
        for got_t, w in zip(d.pool.tensors, full, strict=True):
            assert torch.equal(got_t[:, 3].contiguous().view(torch.uint8), w[:, 0].contiguous().view(torch.uint8))
