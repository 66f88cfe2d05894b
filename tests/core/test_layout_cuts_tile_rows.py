"""A re-slice's byte ranges (``StateLayout.cuts``) and copies (``slice``, ``gather``) against the sharding rule of
``docs/transfer-tp.md`` written out by hand: ``torch.chunk`` of each segment of the full state along its first
state dimension (Mamba2's ``x | B | C``, ``B`` and ``C`` whole on every rank with one group; Qwen3-Next's
``q | k | v``; the temporal heads; extras whole), over odd shapes (1-element dimensions, head counts that do not
divide, which must be refused), every dtype width (bf16, float8, 1-byte ints, bool), and the cuts of every rank
tiling each row's bytes exactly once (the split ranges once across the ranks, the replicated ones on every rank).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache._handoff._reslice import StateLayout

pytestmark = pytest.mark.no_transport

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.bool]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def _rule(kind: str, cfg: Any, spec: mc.StateSpec, tp: int) -> list[list[tuple[int, int, bool]]] | None:
    """Per pool tensor, its first state dimension as ``(start, size, split)`` segments by the documented rule;
    None when the rule refuses ``tp``."""
    if kind == "mamba2":
        inner, gn = cfg.heads * cfg.head_dim, cfg.groups * cfg.state
        if cfg.heads % tp or (cfg.groups != 1 and cfg.groups % tp):
            return None
        bc = cfg.groups != 1
        conv = [(0, inner, True), (inner, gn, bc), (inner + gn, gn, bc)]
        temporal = [(0, cfg.heads, True)]
    elif kind == "qwen":
        key, value = cfg.hk * cfg.dk, cfg.hv * cfg.dv
        if cfg.hk % tp or cfg.hv % tp:
            return None
        conv = [(0, key, True), (key, key, True), (2 * key, value, True)]
        temporal = [(0, cfg.hv, True)]
    else:
        if any(c[0] % tp for c in spec.conv_shapes) or spec.temporal_shape[0] % tp:
            return None
        convs = [[(0, c[0], True)] for c in spec.conv_shapes]
        return [*convs, [(0, spec.temporal_shape[0], True)], *([] for _ in spec.extra_shapes)]
    return [conv, temporal, *([] for _ in spec.extra_shapes)]


def _shard(full: torch.Tensor, segments: list[tuple[int, int, bool]], tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (``[layers, n, *state]``) by hand: ``chunk`` of each split segment."""
    if not segments:
        return full.clone()
    parts = []
    for start, size, split in segments:
        seg = full.narrow(2, start, size)
        parts.append(seg.chunk(tp, dim=2)[rank] if split else seg)
    return torch.cat(parts, 2)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    bits = torch.randint(0, 256, (*shape, dtype.itemsize), generator=g, dtype=torch.uint8)
    if dtype is torch.bool:
        bits &= 1
    return bits.view(dtype).reshape(shape)


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, Any, StateLayout, int]:
    """A model (Mamba2, Qwen3-Next, synthetic), its layout, and a tp the rule may or may not accept."""
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    kind = draw(st.sampled_from(["mamba2", "qwen", "synthetic"]))
    conv_dtype, temporal_dtype, extra_dtype = (draw(st.sampled_from(DTYPES)) for _ in range(3))
    layers = draw(st.integers(1, 3))

    def count() -> int:  # a head (or channel) count: a multiple of tp half the time, else anything small
        return draw(st.integers(1, 3)) * draw(st.sampled_from([1, tp]))

    if kind == "mamba2":
        cfg = SimpleNamespace(
            heads=count(), head_dim=draw(st.integers(1, 3)),
            groups=draw(st.sampled_from([1, 2, 3, 4, tp, 2 * tp])), state=draw(st.integers(1, 3)),
        )  # fmt: skip
        hf = SimpleNamespace(
            model_type="mamba2", num_hidden_layers=layers, num_heads=cfg.heads, head_dim=cfg.head_dim,
            n_groups=cfg.groups, state_size=cfg.state, expand=1, hidden_size=cfg.heads * cfg.head_dim,
            conv_kernel=draw(st.integers(1, 4)),
        )  # fmt: skip
    elif kind == "qwen":
        cfg = SimpleNamespace(
            hk=count(), hv=count(), dk=draw(st.integers(1, 3)),
            dv=draw(st.integers(1, 3)),
        )  # fmt: skip
        hf = SimpleNamespace(
            model_type="qwen3_next", linear_num_key_heads=cfg.hk, linear_num_value_heads=cfg.hv,
            linear_key_head_dim=cfg.dk, linear_value_head_dim=cfg.dv, linear_conv_kernel_dim=draw(st.integers(1, 4)),
            layer_types=["linear_attention"] * layers,
        )  # fmt: skip
    else:
        cfg, hf = None, None
    extras = {
        f"e{i}": (tuple(draw(st.lists(st.integers(1, 3), max_size=2))), extra_dtype)
        for i in range(draw(st.integers(0, 2)))
    }
    if hf is not None:
        base = mc.StateSpec.from_hf_config(hf)
        spec = mc.StateSpec(
            base.num_layers, base.conv_shapes, base.temporal_shape, conv_dtype=conv_dtype,
            temporal_dtype=temporal_dtype, extra_shapes=extras,
        )  # fmt: skip
        return kind, cfg, StateLayout.from_config(hf, spec), tp
    convs = [(count(), draw(st.integers(1, 3))) for _ in range(draw(st.integers(1, 2)))]
    temporal = (count(), *draw(st.lists(st.integers(1, 3), max_size=2)))
    spec = mc.StateSpec(
        layers, convs, temporal, conv_dtype=conv_dtype, temporal_dtype=temporal_dtype, extra_shapes=extras
    )
    return kind, cfg, StateLayout.synthetic(spec), tp


@settings(max_examples=400)  # a few ms each
@given(cases(), st.integers(1, 3), st.integers(0, 2**16))
def test_cuts_slice_and_gather_are_the_documented_rule_and_tile_each_row_once(
    case: tuple[str, Any, StateLayout, int], n: int, seed: int
) -> None:
    kind, cfg, layout, tp = case
    rule = _rule(kind, cfg, layout.spec, tp)
    event(f"{kind} at tp {tp}: {'refused' if rule is None else 'sliced'}")
    if rule is None:
        with pytest.raises(mc.InvalidArgumentError):
            layout.check(tp)
        with pytest.raises(mc.InvalidArgumentError):
            layout.cuts(tp, 0)
        return
    g = torch.Generator().manual_seed(seed)
    shapes = layout.spec.shapes()
    full = [_random((layout.spec.num_layers, n, *s), d, g) for s, d in shapes]
    want = [[_shard(f, segs, tp, k) for f, segs in zip(full, rule, strict=True)] for k in range(tp)]
    for k in range(tp):
        got = layout.slice(full, tp, k)
        assert [_raw(a).tolist() for a in got] == [_raw(w).tolist() for w in want[k]], f"slice of rank {k}"
    assert layout.shard_spec(tp).shapes() == [(tuple(w.shape[2:]), w.dtype) for w in want[0]]
    back = layout.gather(want)
    assert all(torch.equal(_raw(a), _raw(b)) for a, b in zip(back, full, strict=True))
    # The cuts: rank k's bytes of one row, in shard order, are its hand-made shard's; across the ranks every
    # split byte is named once and every replicated byte by every rank.
    every = [layout.cuts(tp, k) for k in range(tp)]
    for i, (shape, dtype) in enumerate(shapes):
        row_bytes = math.prod(shape) * dtype.itemsize
        named = [0] * row_bytes
        replicated = [False] * row_bytes
        for k in range(tp):
            row = _raw(full[i][0, 0]).reshape(-1)
            cut = every[k][i]
            assert all(size > 0 for _, size, _ in cut), f"an empty range in {cut}"
            picked = torch.cat([row[o : o + s] for o, s, _ in cut])
            assert picked.tolist() == _raw(want[k][i][0, 0]).reshape(-1).tolist(), f"cuts of rank {k}, tensor {i}"
            for offset, size, rep in cut:
                assert offset >= 0 and offset + size <= row_bytes
                for b in range(offset, offset + size):
                    named[b] += 1
                    replicated[b] = replicated[b] or rep
        for b in range(row_bytes):
            assert named[b] == (tp if replicated[b] else 1), f"tensor {i} byte {b} named {named[b]} times"
