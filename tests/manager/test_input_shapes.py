"""Inputs whose shape is the mistake (issue #32, defect 8): an index tensor's capacity far beyond any batch, and
slot lists in unordered containers. Each is a typed error before anything is built or changed."""

from __future__ import annotations

import tracemalloc
import types
from typing import Any

import pytest
import torch

import mambacache as mc

SPEC = mc.StateSpec(num_layers=1, conv_shapes=[(2, 2)], temporal_shape=(2,), conv_dtype=torch.float32)


@pytest.mark.parametrize("capacity", [2**24 + 1, 2**40, 2**63])
def test_a_capacity_beyond_any_batch_is_refused_before_anything_is_built(capacity: int) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(mc.InvalidArgumentError, match="more positions than any batch"):
            mc.StateIndices(capacity)
        assert tracemalloc.get_traced_memory()[1] < 2**20  # nothing per position, in Python
    finally:
        tracemalloc.stop()


def test_a_pool_with_more_slots_than_the_limit_may_have_an_index_that_large() -> None:
    with pytest.raises(mc.InvalidArgumentError):
        mc.StateIndices(2**24 + 2, device="meta", num_slots=2**24 + 1)
    idx = mc.StateIndices(2**24 + 1, device="meta", num_slots=2**24 + 1)
    assert idx.tensor.shape == (2**24 + 1,)


def test_the_padding_pattern_is_built_without_a_python_object_per_position() -> None:
    """The old constructor built ``[pads[i % k] for i in range(capacity)]``: 5 s and 130 MB of Python at 2**24."""
    capacity = 2**21
    tracemalloc.start()
    try:
        idx = mc.StateIndices(capacity, pad_slots=(0, 9, 7))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"{peak} bytes of Python objects for {capacity} positions"
    want = torch.tensor([0, 9, 7], dtype=torch.int32).repeat(capacity // 3 + 1)[:capacity]
    assert torch.equal(idx.tensor, want)
    assert idx.update([3, 1]).tolist() == [3, 1]
    assert idx.tensor[:6].tolist() == [3, 1, 7, 0, 9, 7]  # position i >= n: pad i % 3


UNORDERED: list[Any] = [
    {1: "a", 2: "b"},
    {1, 2},
    frozenset({1, 2}),
    {1: "a", 2: "b"}.keys(),
    {"a": 1, "b": 2}.values(),
    {1: 2}.items(),
    types.MappingProxyType({1: "a", 2: "b"}),
]


@pytest.mark.parametrize("slots", UNORDERED, ids=lambda s: type(s).__name__)
def test_bulk_calls_refuse_unordered_slot_containers_and_change_nothing(slots: Any) -> None:
    pool = mc.StatePool(SPEC, 4)
    with mc.CacheManager(pool) as mgr:
        held = mgr.alloc(2, request_id="r")
        mgr.flush_nowait()
        before = (mgr.held(), mgr.queued(), pool.num_free)
        for call in (
            lambda: mgr.clear_many(slots),
            lambda: mgr.release_many(slots),
            lambda: mgr.alloc_slots(slots),
            lambda: mgr.copy_many([1, 2], slots),
        ):
            with pytest.raises(mc.InvalidArgumentError, match="must be ordered"):
                call()
            assert (mgr.held(), mgr.queued(), pool.num_free) == before
        mgr.release_many(held)


def test_ordered_forms_still_pass() -> None:
    np = pytest.importorskip("numpy")
    pool = mc.StatePool(SPEC, 6)
    with mc.CacheManager(pool) as mgr:
        for slots in ([1, 2], (1, 2), np.array([1, 2]), torch.tensor([1, 2]), range(1, 3)):
            assert mgr.alloc_slots(slots, request_id="r") == [1, 2]
            mgr.clear_many(slots)
            mgr.release_many(slots, request_id="r")
            mgr.flush_nowait()
        mgr.check_idle()
