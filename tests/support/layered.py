"""Per-layer pools for the tests (``StatePool.from_layers``), and stacked access to any pool's tensors.

Tests read and write pool tensors as ``t[:, slot]`` (every layer of one slot).
:func:`pool_tensors` gives that access on every pool: the pool's own tensors
where it has them, else a :class:`LayerStack` per pool tensor over its layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

import mambacache as mc


class LayerStack:
    """A pool tensor kept as separate layers, read and written as ``t[:, index]`` like a stacked one."""

    def __init__(self, layers: list[torch.Tensor]) -> None:
        self.layers = layers
        self.shape = torch.Size((len(layers), *layers[0].shape))
        self.dtype = layers[0].dtype

    def _index(self, key: Any) -> Any:
        assert isinstance(key, tuple) and key[0] == slice(None), f"only t[:, index] is supported, got {key!r}"
        return key[1] if len(key) == 2 else key[1:]

    def __getitem__(self, key: Any) -> torch.Tensor:
        index = self._index(key)
        return torch.stack([t[index] for t in self.layers])

    def __setitem__(self, key: Any, value: Any) -> None:
        index = self._index(key)
        for i, t in enumerate(self.layers):
            t[index] = value[i] if isinstance(value, torch.Tensor) and value.ndim > 0 else value

    def clone(self) -> torch.Tensor:
        return torch.stack(self.layers).clone()

    def copy_(self, src: torch.Tensor) -> None:
        for t, s in zip(self.layers, src.unbind(0), strict=True):
            t.copy_(s)


def pool_tensors(pool: Any, drafts: bool = False) -> list[Any]:
    """``pool.tensors`` (``pool.draft_tensors``), or a :class:`LayerStack` per tensor of a pool of many layer
    groups."""
    if len(getattr(pool, "layer_groups", ((0, 0),))) == 1:
        return list(pool.draft_tensors if drafts else pool.tensors)
    return [LayerStack(ls) for ls in (pool.draft_layers if drafts else pool.layers)]


def layered_pool(spec: mc.StateSpec, num_slots: int, make: Callable[[mc.StateSpec, int], mc.StatePool]) -> mc.StatePool:
    """A ``from_layers`` pool of ``spec`` (2 or more layers): the first ``num_layers - 1`` layers cut from
    one allocation (one layer group), the last one allocated apart (a group of its own), each made by
    ``make`` (stacked or paged)."""
    assert spec.num_layers >= 2
    parts = [make(dataclasses.replace(spec, num_layers=n), num_slots) for n in (spec.num_layers - 1, 1)]
    layers = [a + b for a, b in zip(parts[0].layers, parts[1].layers, strict=True)]
    drafts = [a + b for a, b in zip(parts[0].draft_layers, parts[1].draft_layers, strict=True)]
    n, names = len(spec.conv_shapes), list(spec.extra_shapes)
    per_layer = range(spec.num_layers)
    kw: dict[str, Any] = {"extra": dict(zip(names, layers[n + 1 :], strict=True)) or None}
    if drafts:
        kw |= {
            "draft_conv": [[d[layer] for d in drafts[:n]] for layer in per_layer],
            "draft_temporal": drafts[n],
            "draft_extra": dict(zip(names, drafts[n + 1 :], strict=True)) or None,
        }
    pool = mc.StatePool.from_layers([[c[layer] for c in layers[:n]] for layer in per_layer], layers[n], **kw)
    assert pool.layer_groups == ((0, spec.num_layers - 1), (spec.num_layers - 1, spec.num_layers))
    return pool
