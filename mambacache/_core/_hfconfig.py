"""StateSpec from a transformers config: the shapes its cache layers hold.

Duck-typed on the config's fields, so transformers is not imported here.

================  ===========================  ====================================
model_type        conv state per layer         temporal state per layer
================  ===========================  ====================================
mamba2            (I + 2*G*N, conv_kernel)     (heads, head_dim, N)
nemotron_h        (I + 2*G*N, conv_kernel)     (mamba_num_heads, mamba_head_dim, N)
falcon_h1         (I + 2*G*N, mamba_d_conv)    (mamba_n_heads, mamba_d_head, N)
jamba (Mamba1)    (I, mamba_d_conv)            (I, N)
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
    if kind in ("nemotron_h", "jamba") and types is not None:
        # Older configs say "mamba"; transformers 5 remaps it to "linear_attention".
        return [i for i, t in enumerate(types) if t in ("mamba", "linear_attention")]
    if kind == "falcon_h1":
        return list(range(config.num_hidden_layers))  # every layer runs attention and Mamba2 side by side
    raise InvalidArgumentError(
        f"unsupported config model_type {kind!r}: supported are mamba2, nemotron_h, falcon_h1, jamba, {_QWEN}"
    )


def spec_kwargs_from_config(config: Any) -> dict[str, Any]:
    text = _text(config)
    kind = getattr(text, "model_type", None)
    layers = len(linear_layer_indices(text))
    temporal: tuple[int, ...]
    if kind == "mamba2":
        inner = int(text.expand * text.hidden_size)
        conv = (inner + 2 * text.n_groups * text.state_size, text.conv_kernel)
        temporal = (text.num_heads, text.head_dim, text.state_size)
    elif kind == "nemotron_h":
        inner = text.mamba_num_heads * text.mamba_head_dim
        conv = (inner + 2 * text.n_groups * text.ssm_state_size, text.conv_kernel)
        temporal = (text.mamba_num_heads, text.mamba_head_dim, text.ssm_state_size)
    elif kind == "falcon_h1":
        inner = text.mamba_d_ssm if text.mamba_d_ssm is not None else int(text.mamba_expand * text.hidden_size)
        conv = (inner + 2 * text.mamba_n_groups * text.mamba_d_state, text.mamba_d_conv)
        temporal = (text.mamba_n_heads, text.mamba_d_head, text.mamba_d_state)
    elif kind == "jamba":
        inner = int(text.mamba_expand * text.hidden_size)
        conv = (inner, text.mamba_d_conv)
        temporal = (inner, text.mamba_d_state)
    else:
        key_dim = text.linear_num_key_heads * text.linear_key_head_dim
        value_dim = text.linear_num_value_heads * text.linear_value_head_dim
        conv = (2 * key_dim + value_dim, text.linear_conv_kernel_dim)
        temporal = (text.linear_num_value_heads, text.linear_key_head_dim, text.linear_value_head_dim)
    out: dict[str, Any] = {"num_layers": layers, "conv_shapes": [conv], "temporal_shape": temporal}
    # Dtypes: the model's dtype for the conv state, and for the temporal state too
    # unless the config names an SSM state dtype of its own (as transformers and
    # vLLM's "auto" do); with neither, StateSpec's defaults (bf16 conv, fp32 state).
    # transformers 5 names it `dtype` (reading the old `torch_dtype` there logs a deprecation).
    model_dtype = _dtype(text.dtype if hasattr(text, "dtype") else getattr(text, "torch_dtype", None))
    ssm_dtype = _dtype(getattr(text, "mamba_ssm_dtype", None) or getattr(text, "ssm_state_dtype", None))
    if model_dtype is not None:
        out["conv_dtype"] = model_dtype
    if ssm_dtype is not None or model_dtype is not None:
        out["temporal_dtype"] = ssm_dtype if ssm_dtype is not None else model_dtype
    return out


def _dtype(value: Any) -> Any:
    """A torch.dtype from a config field (a dtype, or a name like "bfloat16"); None if unset or unknown."""
    import torch

    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        candidate = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(candidate, torch.dtype):
            return candidate
        if value == "auto":
            return None
    raise InvalidArgumentError(f"config dtype {value!r} is not a torch dtype")
