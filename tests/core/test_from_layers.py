"""StatePool.from_layers: per-layer tensors adopted as one pool, its layer groups, its checks.

The semantics, fault and host-tier sweeps run on such pools too (tests/support/util.py's
POOL_KINDS, tests/core/test_semantics.py's POOLS); tensor parallel in tests/core/test_channel.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mambacache as mc
from mambacache.audit import OpAudit

from ..support.util import fill_random

S = 6  # slots + 1


def apart(layers: int = 3, conv: tuple[int, ...] = (4, 3), temporal: tuple[int, ...] = (2, 5)) -> tuple[Any, Any]:
    """Each layer's tensors allocated on their own."""
    return [[torch.zeros(S, *conv)] for _ in range(layers)], [torch.zeros(S, *temporal) for _ in range(layers)]


def test_layers_cut_from_one_allocation_are_one_group_and_adopted_in_place() -> None:
    conv, temporal = torch.zeros(3, S, 4, 3), torch.zeros(3, S, 2, 5)
    pool = mc.StatePool.from_layers([[c] for c in conv.unbind(0)], list(temporal.unbind(0)))
    assert pool.layer_groups == ((0, 3),) and pool.spec.num_layers == 3 and pool.num_slots == S - 1
    assert pool.temporal.data_ptr() == temporal.data_ptr() and pool.temporal.is_contiguous()
    assert len(pool.exec_tensors) == 2  # one tensor per state: a stage is one op per state, as when stacked


def test_layers_allocated_apart_are_a_group_each_and_pool_tensors_refuse_clearly() -> None:
    conv, temporal = apart()
    pool = mc.StatePool.from_layers(conv, temporal)
    assert pool.layer_groups == ((0, 1), (1, 2), (2, 3)) and len(pool.exec_tensors) == 6 and pool.exec_convs == 3
    assert [t.data_ptr() for t in pool.layers[1]] == [t.data_ptr() for t in temporal]
    assert [t.data_ptr() for t in pool.layers[0]] == [c[0].data_ptr() for c in conv]
    for name in ("tensors", "conv", "temporal", "extra"):
        with pytest.raises(mc.InvalidArgumentError, match=r"separate tensors .* use pool.layers"):
            getattr(pool, name)
    assert pool.draft_tensors == [] and pool.draft_layers == []  # no drafts: nothing to refuse


def test_only_evenly_spaced_layers_join_and_contiguous_ones_only_without_gaps() -> None:
    buf = torch.zeros(5, S, 2, 5)
    groups = mc.StatePool.from_layers(None, [buf[0], buf[1], buf[3], buf[4], buf[2]]).layer_groups
    assert groups == ((0, 2), (2, 4), (4, 5))  # 0,1 then 3,4 (the spacing changes), then 2 (backwards)
    # Contiguous layers with a gap between them would be one non-contiguous tensor, which the npu executor
    # refuses: they stay apart. Paged layers (block pages) join across the gaps, since they are paged anyway.
    assert mc.StatePool.from_layers(None, [buf[0], buf[2], buf[4]]).layer_groups == ((0, 1), (1, 2), (2, 3))
    pages = torch.zeros(3, S, 16)
    paged = [pages[i, :, :10].view(S, 2, 5) for i in range(3)]
    pool = mc.StatePool.from_layers(None, paged)
    assert pool.layer_groups == ((0, 3),) and not pool.temporal.is_contiguous()


def test_a_step_moves_every_layer_of_the_slot_and_nothing_else() -> None:
    conv, temporal = apart()
    pool = mc.StatePool.from_layers(conv, temporal)
    fill_random(pool, 0)
    before = [[t.clone() for t in layers] for layers in pool.layers]
    with mc.CacheManager(pool) as mgr, OpAudit() as audit:
        a, b = mgr.alloc(2, clear=False)
        mgr.flush_nowait()
        mgr.copy_on_write(a, b, shift=1)
        (c,) = mgr.alloc(1)
        mgr.flush_nowait()
    for layer in range(3):
        src = before[0][layer][a]
        assert torch.equal(conv[layer][0][b][:, :2], src[:, 1:]) and bool((conv[layer][0][b][:, 2] == 0).all())
        assert torch.equal(temporal[layer][b], before[1][layer][a]) and bool((temporal[layer][c] == 0).all())
        for s in set(range(S)) - {b, c}:
            assert torch.equal(temporal[layer][s], before[1][layer][s])
    assert (
        audit.report().peak_state_temp_bytes <= 3 * conv[0][0][a].nbytes
    )  # a shift's gather per layer, no pool-sized temporary


def test_the_npu_executor_takes_contiguous_layers_and_refuses_paged_ones() -> None:
    conv, temporal = apart()
    with mc.CacheManager(mc.StatePool.from_layers(conv, temporal), executor="npu") as mgr:
        (a,) = mgr.alloc(1)
        temporal[1][a] = 3.0
        mgr.clear(a)
        mgr.flush_nowait()
    assert bool((temporal[1][a] == 0).all())
    pages = torch.zeros(2, S, 16)
    paged = mc.StatePool.from_layers(None, [pages[i, :, :10].view(S, 2, 5) for i in range(2)])
    with pytest.raises(mc.InvalidArgumentError, match="needs contiguous pool tensors"):
        mc.CacheManager(paged, executor="npu").__enter__()


def test_drafts_extras_and_the_host_tier_follow_the_layer_groups() -> None:
    k = 2
    layers = 3
    conv, temporal = apart(layers)
    scale = [torch.zeros(S) for _ in range(layers)]
    pool = mc.StatePool.from_layers(
        conv, temporal, extra={"scale": scale},
        draft_conv=[[torch.zeros(S, k, 4, 3)] for _ in range(layers)],
        draft_temporal=[torch.zeros(S, k, 2, 5) for _ in range(layers)],
        draft_extra={"scale": [torch.zeros(S, k) for _ in range(layers)]},
    )  # fmt: skip
    assert pool.spec.extra_shapes == {"scale": ((), torch.float32)} and pool.draft_tokens == k
    assert len(pool.exec_drafts) == len(pool.exec_tensors) == 3 * layers
    host = mc.HostPool(pool.spec, 2)
    with mc.CacheManager(pool, host_pool=host) as mgr:
        (a,) = mgr.alloc(1)
        mgr.flush_nowait()
        for i, (d, t) in enumerate(zip(pool.draft_layers[1], pool.draft_layers[2], strict=True)):
            d[a, 1], t[a, 1] = float(i + 1), float(10 * i + 1)
        mgr.commit_draft(a, 2)
        h = mgr.offload(a)
        mgr.clear(a)
        mgr.flush_nowait()
        assert all(bool((t[a] == 0).all()) for t in temporal)
        mgr.restore(h, a)
        mgr.flush_nowait()
    assert [float(t[a].mean()) for t in temporal] == [1.0, 2.0, 3.0]
    assert [float(s[a]) for s in scale] == [1.0, 11.0, 21.0]
    assert [float(host.temporal[i, h].mean()) for i in range(layers)] == [1.0, 2.0, 3.0]


BAD: list[tuple[str, Any, Any, str]] = [
    ("no layers", None, [], "non-empty sequence"),
    ("a stacked tensor", None, torch.zeros(2, S, 3), "non-empty sequence"),
    ("layer counts", [[torch.zeros(S, 3)]], [torch.zeros(S, 3)] * 2, "sequence of 2 sequences"),
    ("conv counts", [[torch.zeros(S, 3)], []], [torch.zeros(S, 3), torch.zeros(S, 3)], "as many conv tensors"),
    ("not a tensor", None, [torch.zeros(S, 3), "x"], r"temporal\[1\] must be a torch.Tensor"),
    ("shapes differ", None, [torch.zeros(S, 3), torch.zeros(S, 4)], "layer 1 is .* layer 0"),
    ("dtypes differ", None, [torch.zeros(S, 3), torch.zeros(S, 3, dtype=torch.float16)], "one shape, dtype and device"),
    ("slots differ", [[torch.zeros(S + 1, 3)]], [torch.zeros(S, 3)], r"layer 0: .*\(layers, slots \+ 1\)"),
    ("rows not contiguous", None, [torch.zeros(S, 3, 4).transpose(1, 2)], "each \\(layer, slot\\) row"),
    ("grad", None, [torch.zeros(S, 3, requires_grad=True)], "requires grad"),
    ("devices", None, [torch.zeros(S, 3), torch.zeros(S, 3, device="meta")], "meta"),
    ("one slot", None, [torch.zeros(1, 3)], "at least 2 slots"),
]


@pytest.mark.parametrize(("why", "conv", "temporal", "match"), BAD, ids=[b[0] for b in BAD])
def test_what_it_cannot_drive_is_refused_with_a_typed_error(why: str, conv: Any, temporal: Any, match: str) -> None:
    with pytest.raises(mc.InvalidArgumentError, match=match):
        mc.StatePool.from_layers(conv, temporal)


def test_overlapping_layers_are_refused_naming_both() -> None:
    buf = torch.zeros(2 * S * 3)
    a, b = buf[: S * 3].view(S, 3), buf[S * 3 - 1 : 2 * S * 3 - 1].view(S, 3)  # one element in common
    with pytest.raises(mc.InvalidArgumentError, match="layer 0's temporal and layer 1's temporal overlap"):
        mc.StatePool.from_layers(None, [a, b])
    same = torch.zeros(S, 3)
    with pytest.raises(mc.InvalidArgumentError, match=r"layer 0's conv.* and layer 1's conv.* overlap"):
        mc.StatePool.from_layers([[same], [same]], [torch.zeros(S, 3), torch.zeros(S, 3)])


def test_drafts_are_checked_against_their_states() -> None:
    conv, temporal = apart(2)
    with pytest.raises(mc.InvalidArgumentError, match="together"):
        mc.StatePool.from_layers(conv, temporal, draft_temporal=[torch.zeros(S, 2, 2, 5)] * 2)
    with pytest.raises(mc.InvalidArgumentError, match="draft_tokens"):
        mc.StatePool.from_layers(
            conv, temporal, draft_conv=[[torch.zeros(S, 2, 4, 3)] for _ in range(2)],
            draft_temporal=[torch.zeros(S, 3, 2, 5) for _ in range(2)],
        )  # fmt: skip
