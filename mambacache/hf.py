"""transformers integration: a spec from a config, and a cache bound to pool slots.

A model run through transformers keeps its linear-attention state in the layers of
its cache object (``DynamicCache``). :func:`bind_cache` points those layers at
*views* of one pool slot, ``[1, *state]`` each, so the model's forward reads and
writes the slot in place: no gather before the forward, no scatter after it. The
attention layers' KV cache stays in the cache object.

    import transformers, mambacache as mc
    from mambacache.hf import bind_cache, spec_from_config

    spec = spec_from_config(config)                    # shapes and dtypes from the config
    pool = mc.StatePool(spec, num_slots=8)
    with mc.CacheManager(pool) as mgr:
        (slot,) = mgr.alloc(1, request_id="r1")
        mgr.flush_nowait()                             # the slot reads as zeros now
        cache = transformers.DynamicCache(config=config)
        bind_cache(cache, pool, slot, config)
        model(input_ids=ids, cache=cache, use_cache=True)   # updates pool slot `slot`

Requires transformers 5 (cache layers with ``conv_states`` / ``recurrent_states``),
as the simulator does; the simulator checks outputs token for token against
``generate`` with this binding on Mamba2 and Qwen3-Next.
"""

from __future__ import annotations

from typing import Any

from ._errors import InvalidArgumentError
from ._hf import linear_layer_indices
from ._pool import StatePool
from ._spec import StateSpec
from ._validate import as_slot

__all__ = ["bind_cache", "linear_layer_indices", "spec_from_config"]


def spec_from_config(config: Any, **overrides: Any) -> StateSpec:
    """``StateSpec.from_hf_config``: shapes of the linear-attention layers, dtypes from the config."""
    return StateSpec.from_hf_config(config, **overrides)


def bind_cache(cache: Any, pool: StatePool, slot: int, config: Any, *, draft: int | None = None) -> None:
    """Point ``cache``'s linear-attention layers at views of ``slot`` of ``pool``.

    Pool layer ``j`` is the ``j``-th linear-attention layer of the model
    (:func:`linear_layer_indices`). The views stay valid as long as the pool's
    tensors do; rebinding to another slot is another call. ``draft=j`` binds
    the slot's draft state ``j`` instead (speculative decoding: a verify forward
    that runs there leaves the slot's own state untouched).
    """
    slot = as_slot(slot, pool.num_slots)
    linear = linear_layer_indices(config)
    if len(linear) != pool.spec.num_layers:
        raise InvalidArgumentError(
            f"the config has {len(linear)} linear-attention layers, the pool {pool.spec.num_layers}"
        )
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) <= max(linear):
        raise InvalidArgumentError("cache must be a transformers 5 cache built with config=... for this model")
    if draft is not None and not (type(draft) is int and 0 <= draft < pool.draft_tokens):
        raise InvalidArgumentError(
            f"draft must be in 0..{pool.draft_tokens - 1} (the pool's draft states), got {draft!r}"
        )
    kernel = pool.spec.conv_shapes[0][-1] if pool.spec.conv_shapes else 0
    for j, index in enumerate(linear):
        layer = layers[index]
        if not hasattr(layer, "conv_states") or not hasattr(layer, "recurrent_states"):
            raise InvalidArgumentError(f"cache layer {index} is not a linear-attention layer")
        if draft is None:
            layer.conv_states[0] = pool.conv[0][j, slot : slot + 1]
            layer.recurrent_states[0] = pool.temporal[j, slot : slot + 1]
        else:
            assert pool.draft_temporal is not None
            layer.conv_states[0] = pool.draft_conv[0][j, slot, draft : draft + 1]
            layer.recurrent_states[0] = pool.draft_temporal[j, slot, draft : draft + 1]
        layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
        layer.has_previous_state[0] = True  # read the slot, even on the first chunk
        layer.conv_kernel_size[0] = kernel
        layer.dtype, layer.device = pool.temporal.dtype, pool.device
