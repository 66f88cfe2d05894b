"""Per-layer tensors as one pool (:meth:`StatePool.from_layers`): the argument checks and the layer groups.

An engine may keep each layer's state in a tensor of its own, ``[num_slots + 1,
*state]``, anywhere. The pool adopts them as they are and hands the executors
one tensor per *layer group*: consecutive layers whose tensors are one strided
view of one storage (same shape, strides and dtype, evenly spaced) become one
``[layers_in_group, num_slots + 1, *state]`` tensor, so a stage is one op over
the group, as on a stacked pool; a layer that breaks the spacing starts a new
group. Every pool tensor (conv, temporal, extra, draft buffer) uses the same
groups, so the executors' tensor lists stay matched by position::

    exec_tensors = [conv0 g0, conv0 g1, ..., temporal g0, temporal g1, ..., extra g0, ...]

A group never turns contiguous layers into a non-contiguous tensor (only
layers that are paged already, each row contiguous, are joined across gaps):
the npu executor, which refuses non-contiguous tensors, takes every pool of
contiguous layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._errors import InvalidArgumentError

__all__ = ["LayerArgs", "layer_args", "layer_groups", "stack_group"]

# (name for messages, one tensor per layer), in pool-tensor order: conv..., temporal, extras...
LayerArgs = list[tuple[str, list[torch.Tensor]]]


def _per_layer(what: str, value: Any, layers: int | None) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence) or not value:
        raise InvalidArgumentError(f"{what} must be a non-empty sequence of tensors, one per layer")
    if layers is not None and len(value) != layers:
        raise InvalidArgumentError(f"{what} has {len(value)} layers, temporal {layers}")
    for i, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{what}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return list(value)


def _convs_by_shape(what: str, conv: Any, layers: int) -> list[list[torch.Tensor]]:
    """``conv[layer][i]`` -> one list per conv state ``i`` of every layer."""
    if conv is None:
        return []
    if isinstance(conv, torch.Tensor) or not isinstance(conv, Sequence) or len(conv) != layers:
        raise InvalidArgumentError(f"{what} must be a sequence of {layers} sequences of tensors, one per layer")
    rows = []
    for i, per in enumerate(conv):
        if isinstance(per, torch.Tensor) or not isinstance(per, Sequence):
            raise InvalidArgumentError(f"{what}[{i}] must be a sequence of layer {i}'s conv tensors")
        rows.append(list(per))
    if len({len(r) for r in rows}) > 1:
        raise InvalidArgumentError(f"every layer needs as many conv tensors in {what}: {[len(r) for r in rows]}")
    return [_per_layer(f"{what}[*][{j}]", [r[j] for r in rows], layers) for j in range(len(rows[0]))]


def layer_args(
    conv: Any, temporal: Any, draft_conv: Any, draft_temporal: Any, extra: Any, draft_extra: Any
) -> tuple[LayerArgs, LayerArgs]:
    """:meth:`StatePool.from_layers`' arguments as named per-layer lists: the pool tensors and the draft
    buffers (empty without). Checks the nesting only; the tensors are checked per group by ``from_tensors``'
    checks."""
    temps = _per_layer("temporal", temporal, None)
    n = len(temps)
    states: LayerArgs = [(f"conv[*][{j}]", c) for j, c in enumerate(_convs_by_shape("conv", conv, n))]
    states.append(("temporal", temps))
    if extra is not None and not isinstance(extra, Mapping):
        raise InvalidArgumentError("extra must be a mapping of name -> per-layer tensors")
    states += [(f"extra[{k!r}]", _per_layer(f"extra[{k!r}]", v, n)) for k, v in (extra or {}).items()]
    if (draft_conv is None) != (draft_temporal is None):
        raise InvalidArgumentError("give draft_conv and draft_temporal together, or neither")
    if draft_temporal is None:
        if draft_extra is not None:
            raise InvalidArgumentError(
                "draft_extra needs the state tensors' draft buffers (draft_conv, draft_temporal)"
            )
        return states, []
    dconv = _convs_by_shape("draft_conv", draft_conv, n)
    if len(dconv) != len(states) - 1 - len(extra or {}):
        raise InvalidArgumentError("draft_conv needs one draft buffer per conv tensor of each layer")
    drafts: LayerArgs = [(f"draft_conv[*][{j}]", c) for j, c in enumerate(dconv)]
    drafts.append(("draft_temporal", _per_layer("draft_temporal", draft_temporal, n)))
    if not isinstance(draft_extra, Mapping | None) or set(draft_extra or {}) != set(extra or {}):
        raise InvalidArgumentError(f"with draft buffers, give draft_extra for each extra tensor: {sorted(extra or {})}")
    dextra: Mapping[str, Any] = draft_extra or {}
    drafts += [(f"draft_extra[{k!r}]", _per_layer(f"draft_extra[{k!r}]", dextra[k], n)) for k in extra or {}]
    return states, drafts


def _joins(layers: list[torch.Tensor], start: int, layer: int) -> bool:
    """Whether ``layers[layer]`` continues the strided group ``layers[start:layer]``."""
    first, prev, t = layers[start], layers[layer - 1], layers[layer]
    if (
        t.shape != first.shape
        or t.stride() != first.stride()
        or t.dtype != first.dtype
        or t.device != first.device
        or t.numel() == 0
        or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    ):
        return False
    delta = t.storage_offset() - prev.storage_offset()
    if layer - start >= 2 and delta != layers[start + 1].storage_offset() - first.storage_offset():
        return False
    # Contiguous layers stay one contiguous tensor (the npu executor's rule); paged ones may have gaps.
    return delta > 0 and (delta == first.numel() if first.is_contiguous() else True)


def layer_groups(tensors: Sequence[list[torch.Tensor]]) -> tuple[tuple[int, int], ...]:
    """The layer ranges ``(start, stop)`` over which every one of ``tensors`` (one list per pool tensor, one
    tensor per layer) is one strided view: greedy, so the fewest groups for this layer order."""
    n = len(tensors[0])
    groups, start = [], 0
    for layer in range(1, n):
        if not all(_joins(layers, start, layer) for layers in tensors):
            groups.append((start, layer))
            start = layer
    groups.append((start, n))
    return tuple(groups)


def stack_group(layers: list[torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """``layers[start:stop]`` as one ``[stop - start, *shape]`` view of their storage (they join, see
    :func:`layer_groups`)."""
    first = layers[start]
    if stop - start == 1:
        return first.unsqueeze(0)
    delta = layers[start + 1].storage_offset() - first.storage_offset()
    return first.as_strided((stop - start, *first.shape), (delta, *first.stride()), first.storage_offset())
