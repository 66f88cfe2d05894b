"""A re-slice's shard of a batch as pieces of the rows it lies in (``_transfer._Rows.pieces`` with cuts), the
byte ranges a wire that reads pieces (NIXL, Mooncake) reads from or writes into.

Checked against obviously-correct references: the shard's pieces of the sender's rows against the wire's messages
of ``StateLayout.slice`` of the same states (the copy the gloo wire sends); a message written into a receiver's
pieces (a later rank's replicated parts aside) against the same slice, the aside against ``replicated_rows``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mambacache as mc
from mambacache._handoff._link import messages
from mambacache._handoff._reslice import StateLayout
from mambacache._handoff._transfer import _Rows, replicated_bytes, replicated_rows
from mambacache._handoff._transports._base import Pieces

from ..support.reslice import layouts


def _storage(t: torch.Tensor) -> torch.Tensor:
    """The whole storage ``t`` lies in, as a flat ``uint8`` tensor."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _at(pieces: Pieces, address: int, size: int) -> torch.Tensor:
    """The ``uint8`` view of ``size`` bytes at ``address``, in the tensor of ``pieces.within`` that holds them."""
    for t in pieces.within:
        flat = _storage(t)
        offset = address - flat.data_ptr()
        if offset >= 0 and offset + size <= flat.numel():
            return flat[offset : offset + size]
    raise AssertionError(f"{size} bytes at {address:#x} lie in none of the message's tensors")


def _read(pieces: Pieces) -> bytes:
    """The message ``pieces`` make: each range's bytes, in order."""
    return b"".join(bytes(_at(pieces, a, n).tolist()) for a, n in pieces.spans)


def _write(pieces: Pieces, message: torch.Tensor) -> None:
    """``message`` (flat ``uint8``) written into ``pieces``' ranges in order, as a read of a pulled wire does."""
    at = 0
    for address, size in pieces.spans:
        _at(pieces, address, size).copy_(message[at : at + size])
        at += size
    assert at == message.numel() == pieces.numel()


def _pool(layout: StateLayout, per_layer: bool, seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Random ``[layers, 7, *state]`` tensors of the layout's spec, and their rows as a pool holds them (one
    stacked tensor per pool tensor, or a tensor per layer, ``from_layers``)."""
    g = torch.Generator().manual_seed(seed)
    stacked = [torch.randn(layout.spec.num_layers, 7, *s, generator=g).to(d) for s, d in layout.spec.shapes()]
    return stacked, [list(t.clone().unbind(0)) if per_layer else list(t.unbind(0)) for t in stacked]


CASES = st.sampled_from([1, 2, 4]).flatmap(lambda tp: st.tuples(st.just(tp), st.integers(0, tp - 1), layouts(tp)))
SLOTS = st.lists(st.integers(1, 6), min_size=1, max_size=4, unique=True)


@given(CASES, SLOTS, st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_a_shards_pieces_are_the_layouts_slice_of_the_same_rows(
    case: tuple[int, int, StateLayout], slots: list[int], split: bool, per_layer: bool, seed: int
) -> None:
    """Rank ``k``'s shard of states in any slots (a run or not, in any order), as pieces of the pool's rows, is
    byte for byte the wire's messages of ``layout.slice`` of those states (what the gloo wire sends), split or
    not, on a stacked pool and on one with a tensor per layer; uncut (no cuts), the plain messages."""
    tp, rank, layout = case
    stacked, rows = _pool(layout, per_layer, seed)
    want = messages([s.contiguous() for s in layout.slice([t[:, slots] for t in stacked], tp, rank)], split)
    got = _Rows(rows).pieces(slots, split, ("cpu",), layout.cuts(tp, rank))
    assert got is not None and len(got) == len(want)
    assert [_read(m) for m in got] == [bytes(w.tolist()) for w in want]
    plain = _Rows(rows).pieces(slots, split, ("cpu",))
    assert plain is not None
    assert [_read(m) for m in plain] == [bytes(m.tolist()) for m in messages([t[:, slots] for t in stacked], split)]


@given(CASES.filter(lambda c: c[1] > 0), SLOTS, st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_a_shard_written_into_a_receivers_pieces_fills_its_parts_and_puts_replicated_ones_aside(
    case: tuple[int, int, StateLayout], slots: list[int], split: bool, per_layer: bool, seed: int
) -> None:
    """A later rank's shard written into the receiver's pieces (its replicated parts aside): the rows hold the
    shard's split parts where ``slice`` takes them from and nothing else changed; the aside holds the replicated
    parts, equal to ``replicated_rows`` of the source, so the receiver's comparison with rank 0's is exact."""
    tp, rank, layout = case
    source, _ = _pool(layout, False, seed)
    _, rows = _pool(layout, per_layer, seed + 1)  # the landing rows: another state, to be overwritten
    before = [[v.clone() for v in views] for views in rows]
    cuts = layout.cuts(tp, rank)
    aside = torch.full((replicated_bytes(layout.spec.num_layers, len(slots), cuts) + 3,), 7, dtype=torch.uint8)
    got = _Rows(rows).pieces(slots, split, ("cpu",), cuts, aside[:-3] if aside.numel() > 3 else None)
    assert got is not None
    sent = messages([s.contiguous() for s in layout.slice([t[:, slots] for t in source], tp, rank)], split)
    for pieces, message in zip(got, sent, strict=True):
        _write(pieces, message)
    assert torch.equal(aside[-3:], torch.full((3,), 7, dtype=torch.uint8))  # nothing past its size
    src_rows = [list(t.unbind(0)) for t in source]
    want_aside = replicated_rows(src_rows, slots, cuts)
    assert torch.equal(aside[:-3], want_aside)
    for views, old, src_views, tensor_cuts in zip(rows, before, src_rows, cuts, strict=True):
        for view, was, src in zip(views, old, src_views, strict=True):
            for s in range(view.shape[0]):
                got_row = _row(view[s])
                want_row = _row(was[s]).clone()
                if s in slots:
                    src_row = _row(src[s])
                    for offset, size, replicated in tensor_cuts:
                        if not replicated:
                            want_row[offset : offset + size] = src_row[offset : offset + size]
                assert torch.equal(got_row, want_row)


def _row(t: torch.Tensor) -> torch.Tensor:
    """One state's row as its bytes (a scalar state too)."""
    return t.reshape(-1).contiguous().view(torch.uint8)


def test_rows_a_wire_does_not_reach_or_not_contiguous_per_slot_have_no_pieces() -> None:
    """Only rows on a device type the wire reads, each slot's row contiguous, are read in pieces; others go
    through a host copy (the sender) or buffers gathered after (the receiver)."""
    layout = StateLayout.synthetic(mc.StateSpec(1, [(4, 3)], (2, 2)))
    cuts = layout.cuts(2, 1)
    t = torch.zeros(6, 4, 3)
    rows = [[t], [torch.zeros(6, 2, 2)]]
    assert _Rows(rows).pieces([1], False, ("cpu",), cuts) is not None
    assert _Rows([[t.transpose(1, 2)], rows[1]]).pieces([1], False, ("cpu",), cuts) is None
    assert _Rows([[t.to("meta")], [rows[1][0].to("meta")]]).pieces([1], False, ("cpu",), cuts) is None


def test_a_run_of_slots_cut_in_two_places_is_a_range_per_slot_and_layer() -> None:
    """What a cut costs the header: rank 0's shard of ``x`` then ``B`` and ``C`` (the full row's first half of
    ``x``, then ``B`` and ``C`` after the other half) is two ranges per row, the second touching the next row's
    first (one range more per layer than rows); rank 1's (the second half of ``x`` then ``B`` and ``C``,
    touching) one per row; an uncut run of rows one range per layer at most."""
    cfg_layout = StateLayout.from_config(_mamba2())
    rows = [list(t.unbind(0)) for t in mc.StatePool(cfg_layout.spec, 9).tensors]
    slots = list(range(1, 9))
    conv = 0
    r0 = _Rows(rows).pieces(slots, False, ("cpu",), cfg_layout.cuts(2, 0))
    r1 = _Rows(rows).pieces(slots, False, ("cpu",), cfg_layout.cuts(2, 1))
    whole = _Rows(rows).pieces(slots, False, ("cpu",))
    assert r0 is not None and r1 is not None and whole is not None
    layers = cfg_layout.spec.num_layers
    assert len(r0[conv].spans) == (len(slots) + 1) * layers
    assert len(r1[conv].spans) == len(slots) * layers
    assert len(whole[conv].spans) <= layers


def _mamba2() -> object:
    from types import SimpleNamespace

    return SimpleNamespace(
        model_type="mamba2", num_hidden_layers=2, num_heads=4, head_dim=2, n_groups=1,
        state_size=3, expand=2, hidden_size=4, conv_kernel=4,
    )  # fmt: skip


def test_cuts_refuse_a_rank_outside_the_tp() -> None:
    layout = StateLayout.synthetic(mc.StateSpec(1, [(4, 3)], (2, 2)))
    with pytest.raises(mc.InvalidArgumentError, match="rank"):
        layout.cuts(2, 2)
