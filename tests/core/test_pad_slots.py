"""Several padding slots: ``StatePool(..., pad_slots=k)`` and the index tensor that pads with them.

A padded batch position (CUDA-graph capture pads a batch to a captured size, or
a draft length) writes the slot its index points at: the pool's padding slots
must never be handed out or written by the manager, and the index tensor must
point padded positions only at them (TRT-LLM#13151, sglang#38997).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache.testing import SequentialOracle

from ..support.strategies import events_from_ops, ops
from ..support.util import VARIANTS, drive, fill_random, small_spec

SPEC = small_spec(layers=2)


def test_a_pool_with_k_padding_slots_has_them_after_its_live_slots() -> None:
    pool = mc.StatePool(SPEC, 5, pad_slots=4)
    assert pool.num_slots == 5 and pool.pad_slots == 4 and pool.pad_ids == (0, 6, 7, 8)
    assert all(t.shape[1] == 5 + 4 for t in [*pool.tensors])
    with mc.CacheManager(pool) as mgr:
        assert mgr.alloc(5) == [1, 2, 3, 4, 5]
        with pytest.raises(mc.PoolExhaustedError):
            mgr.alloc(1)
        mgr.release_many([1, 2, 3, 4, 5])
        mgr.flush_nowait()
    default = mc.StatePool(SPEC, 5)
    assert default.pad_slots == 1 and default.pad_ids == (0,) and default.temporal.shape[1] == 6
    # The budget pays for every padding slot.
    budget = SPEC.memory_bytes * 10
    assert mc.StatePool.from_memory_budget(SPEC, budget, pad_slots=3).num_slots == 7
    assert mc.StatePool.from_memory_budget(SPEC, budget).num_slots == 9


def test_adopted_tensors_may_keep_padding_rows_at_their_end() -> None:
    conv = [torch.zeros(2, 9, *s, dtype=SPEC.conv_dtype) for s in SPEC.conv_shapes]
    temporal = torch.zeros(2, 9, *SPEC.temporal_shape)
    pool = mc.StatePool.from_tensors(conv, temporal, pad_slots=3)
    assert pool.num_slots == 6 and pool.pad_ids == (0, 7, 8) and pool.temporal.data_ptr() == temporal.data_ptr()
    with pytest.raises(mc.InvalidArgumentError, match="no live slot"):
        mc.StatePool.from_tensors(conv, temporal, pad_slots=9)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2", None])
def test_a_bad_pad_count_is_a_typed_error(bad: object) -> None:
    for make in (
        lambda: mc.StatePool(SPEC, 4, pad_slots=bad),  # type: ignore[arg-type]
        lambda: mc.StatePool.from_memory_budget(SPEC, 10**6, pad_slots=bad),  # type: ignore[arg-type]
        lambda: mc.StatePool.from_tensors([], torch.zeros(1, 5, 2), pad_slots=bad),  # type: ignore[arg-type]
    ):
        with pytest.raises(mc.InvalidArgumentError, match="pad_slots"):
            make()


def test_the_manager_refuses_every_padding_slot_and_changes_nothing() -> None:
    pool = mc.StatePool(SPEC, 4, pad_slots=3)
    host = mc.HostPool(SPEC, 2)
    with mc.CacheManager(pool, host_pool=host) as mgr:
        live = mgr.alloc(2, "r")
        a, b = live
        calls = (
            lambda p: mgr.clear(p), lambda p: mgr.release(p), lambda p: mgr.copy_on_write(a, p),
            lambda p: mgr.copy_on_write(p, a), lambda p: mgr.clear_many([b, p]), lambda p: mgr.alloc_slots([p]),
            lambda p: mgr.offload(p), lambda p: mgr.hand_over(p, "x"),
        )  # fmt: skip
        for pad in pool.pad_ids:
            for call in calls:
                with pytest.raises(mc.InvalidSlotError):
                    call(pad)
        assert mgr.queued() == [mc.Alloc(1, "r"), mc.Alloc(2, "r")] and mgr.held() == {1: "r", 2: "r"}
        mgr.release_many(live, "r")
        mgr.flush_nowait()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@settings(max_examples=15, deadline=None)
@given(raw=ops, pads=st.integers(1, 4))
def test_no_executor_ever_writes_a_padding_slot(variant: str, raw: list[tuple[str, int, int]], pads: int) -> None:
    """Random logs of every event kind: live slots end as the oracle says, padding rows as they were."""
    spec = small_spec(layers=2)
    spec = mc.StateSpec(spec.num_layers, spec.conv_shapes, spec.temporal_shape, draft_tokens=2)
    pool = mc.StatePool(spec, 6, pad_slots=pads)
    fill_random(pool, seed=len(raw))
    for d in pool.draft_tensors:
        d.copy_(torch.randn(d.shape).to(d.dtype))
    before = [t[:, list(pool.pad_ids)].clone() for t in pool.tensors]
    oracle = SequentialOracle(pool)
    with mc.CacheManager(pool, executor=VARIANTS[variant]()) as mgr:
        for events, _live in events_from_ops(raw, pool.num_slots, set(), draft_tokens=2):
            drive(mgr, events, oracle, exact=True)
            mgr.flush_nowait()
            oracle.assert_matches(pool)
        for slot in pool.allocated_slots():
            mgr.release(slot)
        mgr.flush_nowait()
    for b, t in zip(before, pool.tensors, strict=True):
        assert torch.equal(t[:, list(pool.pad_ids)], b)


@settings(max_examples=60, deadline=None)
@given(
    num_slots=st.integers(1, 12), pads=st.integers(1, 6), capacity=st.integers(1, 16), data=st.data(),
)  # fmt: skip
def test_a_padded_forward_never_touches_a_live_slot(
    num_slots: int, pads: int, capacity: int, data: st.DataObject
) -> None:
    """The kernel's view: write every position of the index tensor, padded ones included, with its own value.

    Live slots outside the batch keep their state; each batch slot gets exactly its
    position's value; padded positions land on padding rows only, and up to
    ``pad_slots`` of them in a row land on distinct rows (no two writers of one row).
    """
    pool = mc.StatePool(mc.StateSpec(num_layers=2, conv_shapes=(), temporal_shape=(3,)), num_slots, pad_slots=pads)
    live = data.draw(st.sets(st.integers(1, num_slots)))
    batch = data.draw(st.permutations(sorted(live)).map(lambda p: p[: min(len(p), capacity)]))
    state = pool.temporal
    state.copy_(torch.arange(state.numel(), dtype=state.dtype).reshape(state.shape))
    before = state.clone()
    idx = mc.StateIndices.for_pool(pool, capacity)
    ptr = idx.tensor.data_ptr()
    form = data.draw(st.sampled_from(["list", "numpy", "tensor"]))
    arg = {
        "list": list(batch),
        "numpy": np.array(batch, dtype=np.int64),
        "tensor": torch.tensor(batch, dtype=torch.int64),
    }[form]
    assert idx.update(arg).tolist() == list(batch) and idx.size == len(batch) and idx.tensor.data_ptr() == ptr
    rows = idx.tensor.long()
    padded = rows[len(batch) :].tolist()
    assert all(r in pool.pad_ids for r in padded)
    window = padded[:pads]
    assert len(set(window)) == len(window)
    # The forward: position i writes -(i + 1) into its row (index_copy_: the last writer of a row wins).
    values = -torch.arange(1, capacity + 1, dtype=state.dtype).view(1, capacity, 1).expand(2, capacity, 3)
    state.index_copy_(1, rows, values.contiguous())
    for slot in range(1, num_slots + 1):
        if slot in batch:
            assert (state[:, slot] == -(batch.index(slot) + 1)).all()
        else:
            assert torch.equal(state[:, slot], before[:, slot])


def test_indices_accept_padding_slots_in_the_batch_and_refuse_the_rest() -> None:
    idx = mc.StateIndices(6, num_slots=4, pad_slots=(0, 5, 6))
    assert idx.tensor.tolist() == [0, 5, 6, 0, 5, 6]
    assert idx.update([2, 5, 1]).tolist() == [2, 5, 1] and idx.tensor.tolist() == [2, 5, 1, 0, 5, 6]
    for bad in ([7], [2, 9], [-1]):
        with pytest.raises(mc.InvalidSlotError):
            idx.update(bad)
        assert idx.tensor.tolist() == [2, 5, 1, 0, 5, 6] and idx.size == 3
    for pads in ((), (1,), (0, 0), (0, -1), "05", (0, 2.0), 7):
        with pytest.raises(mc.InvalidArgumentError, match="pad_slots"):
            mc.StateIndices(4, num_slots=4, pad_slots=pads)  # type: ignore[arg-type]
    # Without num_slots there is nothing to check pads against but themselves.
    assert mc.StateIndices(3, pad_slots=(9,)).tensor.tolist() == [9, 9, 9]
    # The device path copies the same padding (meta: shapes only, no data to read back).
    meta = mc.StateIndices(4, device="meta", num_slots=4, pad_slots=(0, 5))
    assert meta.update(torch.tensor([1, 2], device="meta")).shape == (2,) and meta.size == 2
    # Host values to a device with no stream (meta) take a plain copy: no pinned memory, no event.
    assert meta.update([3, 5, 1]).shape == (3,) and meta.size == 3
