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
        bind_cache(cache, pool, slot, config, tokens=0)   # the slot's state has seen 0 tokens
        model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache})   # updates pool slot `slot`
        check_seq_length(cache, ids.shape[1], config)      # BindingError if the cache disagrees

The token count matters: since transformers 5.25 each linear-attention cache
layer keeps a token counter, ``cache.get_seq_length()`` returns it for a model
whose first layer is linear attention (Qwen3-Next, Qwen3.5), and the model
takes its RoPE positions from it. A state bound from a pool slot (a fork of a
cached prefix, a restored swap) must come with its token count, or the next
tokens get positions from 0 while the attention KV holds the prefix: wrong
tokens, silently. ``bind_cache(..., tokens=n)`` sets the counter;
:func:`check_seq_length` makes any disagreement a :class:`BindingError`.

Supported: transformers ``>=5.23`` (the range in pyproject; older 5.x releases
run a bound Mamba2 without reading the pool, see docs/simulator.md), so
:func:`bind_cache` refuses them. Pass the cache under :func:`cache_keyword`:
``cache=`` since 5.24, ``past_key_values=`` / ``cache_params=`` before. The
simulator checks outputs token for token against ``generate`` with this binding
on Mamba2 and Qwen3-Next.
"""

from __future__ import annotations

import functools
from typing import Any

from ._core._errors import BindingError, InvalidArgumentError
from ._core._hfconfig import linear_layer_indices
from ._core._pool import StatePool
from ._core._spec import StateSpec
from ._core._validate import as_slot, check_count

MIN_TRANSFORMERS = (5, 23)
"""The oldest transformers the binding supports: older 5.x releases run a bound model without reading the pool
(measured in docs/simulator.md), so :func:`bind_cache` refuses them."""

__all__ = ["bind_cache", "cache_keyword", "check_seq_length", "drop_tokens", "linear_layer_indices", "spec_from_config"]


def spec_from_config(config: Any, **overrides: Any) -> StateSpec:
    """``StateSpec.from_hf_config``: shapes of the linear-attention layers, dtypes from the config."""
    return StateSpec.from_hf_config(config, **overrides)


def bind_cache(
    cache: Any, pool: StatePool, slot: int, config: Any, *, draft: int | None = None, tokens: int | None = None
) -> None:
    """Point ``cache``'s linear-attention layers at views of ``slot`` of ``pool``.

    Pool layer ``j`` is the ``j``-th linear-attention layer of the model
    (:func:`linear_layer_indices`). The views stay valid as long as the pool's
    tensors do; rebinding to another slot is another call. ``draft=j`` binds
    the slot's draft state ``j`` instead (speculative decoding: a verify forward
    that runs there leaves the slot's own state untouched).

    ``tokens``: how many tokens the bound state has consumed. It becomes the
    linear-attention layers' token count (where the transformers version keeps
    one), so the model's positions follow the state, not the cache object's
    history; then :func:`check_seq_length` runs. Leave it None only to rebind a
    cache whose count is already right.

    A pool with extra tensors (``StateSpec.extra_shapes``) is refused: the
    model would never write them.
    """
    _check_transformers()
    if pool.extra:  # a transformers cache layer has a conv and a recurrent state only: scales would go stale
        raise InvalidArgumentError(f"bind_cache needs a pool without extra tensors (this one has {list(pool.extra)})")
    slot = as_slot(slot, pool.num_slots)
    if tokens is not None:
        check_count("tokens", tokens)
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
    if tokens is not None:
        _set_linear_count(layers, linear, tokens)
        check_seq_length(cache, tokens, config)


def cache_keyword(model: Any) -> str:
    """The keyword ``model``'s forward takes the cache under: ``cache`` (transformers >= 5.24), else
    ``past_key_values`` or, for Mamba models before 5.24, ``cache_params``.

    Passing the wrong one is silent (``**kwargs`` swallows it and the model runs
    without the cache), so ask the model rather than the version number.
    """
    import inspect

    params = inspect.signature(model.forward).parameters
    return next((k for k in ("cache", "past_key_values", "cache_params") if k in params), "cache")


@functools.cache
def _check_transformers() -> None:
    import transformers

    version = transformers.__version__
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < MIN_TRANSFORMERS:
        floor = ".".join(map(str, MIN_TRANSFORMERS))
        raise BindingError(
            f"transformers {version} is older than {floor}, the oldest the binding supports (a bound model would"
            f" silently run without the pool's state): pip install 'transformers>={floor}'"
        )


def _set_linear_count(layers: Any, linear: list[int], tokens: int) -> None:
    for index in linear:
        counter = getattr(layers[index], "cumulative_length_linear", None)  # transformers >= 5.25
        if counter is not None:
            counter.fill_(tokens)


def check_seq_length(cache: Any, tokens: int, config: Any) -> None:
    """Raise :class:`BindingError` unless ``cache`` counts ``tokens`` tokens everywhere the model may read it.

    Checked: ``cache.get_seq_length()`` (what the model takes positions from),
    each initialised attention layer's KV length, and each linear-attention
    layer's counter where the version keeps one. It reads the counters on the
    host, which waits for the device on an accelerator: a check for tests and
    debug runs, not a serving hot path. The simulator calls it after every bind,
    forward and drop, so a transformers change in its bookkeeping fails loudly
    here instead of as wrong tokens.
    """
    linear = set(linear_layer_indices(config))
    seen: list[str] = []
    try:
        total: int | None = int(cache.get_seq_length())
    except ValueError:  # transformers 5.24: a cache of linear-attention layers only keeps no count at all
        total = None
    if total is not None and total != tokens:
        seen.append(f"get_seq_length() = {total}")
    for i, layer in enumerate(getattr(cache, "layers", ())):
        if i in linear:
            counter = getattr(layer, "cumulative_length_linear", None)
            if counter is not None and int(counter) != tokens:
                seen.append(f"layer {i} (linear) counts {int(counter)}")
        elif getattr(layer, "is_initialized", False) and int(layer.get_seq_length()) != tokens:
            seen.append(f"layer {i} (attention) holds {int(layer.get_seq_length())}")
    if seen:
        raise BindingError(
            f"the transformers cache disagrees with the bound state ({tokens} tokens): {'; '.join(seen)}"
        )


def drop_tokens(cache: Any, n: int, config: Any) -> None:
    """Forget the last ``n`` tokens in ``cache``'s bookkeeping: attention KV cropped, linear counters rolled back.

    For rejected draft tokens: the recurrent state itself lives in the pool and
    is rolled back there (``commit_draft``); this keeps the cache's token count
    consistent with it.
    """
    check_count("n", n)
    if not n:
        return
    linear = set(linear_layer_indices(config))
    for i, layer in enumerate(cache.layers):
        if i in linear:
            counter = getattr(layer, "cumulative_length_linear", None)
            if counter is not None:
                counter.sub_(n)
        elif getattr(layer, "is_initialized", False):
            layer.crop(-n)
