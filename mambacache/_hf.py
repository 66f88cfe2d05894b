"""StateSpec from a transformers config: the shapes its cache layers hold.

Duck-typed on the config's fields, so transformers is not imported here.

================  ===========================  ====================================
model_type        conv state per layer         temporal state per layer
================  ===========================  ====================================
mamba2            (I + 2*G*N, conv_kernel)     (heads, head_dim, N)
nemotron_h        (I + 2*G*N, conv_kernel)     (mamba_num_heads, mamba_head_dim, N)
qwen3_next,       (2*Hk*Dk + Hv*Dv, kernel)    (Hv, Dk, Dv)
qwen3_5(_moe)
================  ===========================  ====================================

``I`` is the mixer's inner size, ``G`` its groups, ``N`` its state size; only
the layers of linear-attention type are counted (attention layers keep a KV cache).
"""

from __future__ import annotations

from typing import Any

from ._errors import InvalidArgumentError

__all__ = ["linear_layer_indices", "spec_kwargs_from_config"]

_QWEN = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def _text(config: Any) -> Any:
    # Multimodal Qwen3.5 keeps the language model's fields in text_config.
    return getattr(config, "text_config", None) or config


def linear_layer_indices(config: Any) -> list[int]:
    """Indices of the layers whose state lives in a mambacache pool."""
    config = _text(config)
    kind = getattr(config, "model_type", None)
    if kind == "mamba2":
        return list(range(config.num_hidden_layers))
    types = getattr(config, "layer_types", None)
    if kind in _QWEN and types is not None:
        return [i for i, t in enumerate(types) if t == "linear_attention"]
    if kind == "nemotron_h" and types is not None:
        # Older configs say "mamba"; transformers 5 remaps it to "linear_attention".
        return [i for i, t in enumerate(types) if t in ("mamba", "linear_attention")]
    raise InvalidArgumentError(f"unsupported config model_type {kind!r}: supported are mamba2, nemotron_h, {_QWEN}")


def spec_kwargs_from_config(config: Any) -> dict[str, Any]:
    text = _text(config)
    kind = getattr(text, "model_type", None)
    layers = len(linear_layer_indices(text))
    if kind == "mamba2":
        inner = int(text.expand * text.hidden_size)
        conv = (inner + 2 * text.n_groups * text.state_size, text.conv_kernel)
        temporal = (text.num_heads, text.head_dim, text.state_size)
    elif kind == "nemotron_h":
        inner = text.mamba_num_heads * text.mamba_head_dim
        conv = (inner + 2 * text.n_groups * text.ssm_state_size, text.conv_kernel)
        temporal = (text.mamba_num_heads, text.mamba_head_dim, text.ssm_state_size)
    else:
        key_dim = text.linear_num_key_heads * text.linear_key_head_dim
        value_dim = text.linear_num_value_heads * text.linear_value_head_dim
        conv = (2 * key_dim + value_dim, text.linear_conv_kernel_dim)
        temporal = (text.linear_num_value_heads, text.linear_key_head_dim, text.linear_value_head_dim)
    return {"num_layers": layers, "conv_shapes": [conv], "temporal_shape": temporal}
