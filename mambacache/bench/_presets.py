"""Pool shapes from real models' configs (their public config.json fields), via ``StateSpec.from_hf_config``."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .._spec import StateSpec

__all__ = ["PRESETS", "Preset", "fit_layers"]


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    spec: StateSpec
    source: str


def _qwen(layers: int, interval: int, k_heads: int, v_heads: int) -> SimpleNamespace:
    return SimpleNamespace(
        model_type="qwen3_next",
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4,
    )  # fmt: skip


_NEMOTRON_H_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

CONFIGS = {
    "mamba2-2.7b": SimpleNamespace(
        model_type="mamba2",
        num_hidden_layers=64,
        hidden_size=2560,
        expand=2,
        n_groups=1,
        state_size=128,
        conv_kernel=4,
        num_heads=80,
        head_dim=64,
    ),
    "qwen3-next-80b-a3b": _qwen(48, 4, 16, 32),
    "qwen3.5-35b-a3b": _qwen(40, 4, 16, 32),
    "nemotron-h-8b": SimpleNamespace(
        model_type="nemotron_h",
        layer_types=["mamba" if c == "M" else "other" for c in _NEMOTRON_H_8B],
        mamba_num_heads=128,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        conv_kernel=4,
        expand=2,
    ),
}

PRESETS: dict[str, Preset] = {
    name: Preset(name, StateSpec.from_hf_config(cfg), "config.json fields") for name, cfg in CONFIGS.items()
}
# --quick: 8 layers and about 1 MiB per slot (128 KiB per layer), like the CPU goal.
PRESETS["small"] = Preset(
    "small",
    StateSpec(num_layers=8, conv_shapes=[(2048, 4)], temporal_shape=(8, 64, 64), conv_dtype=torch.bfloat16),
    "synthetic",
)


def fit_layers(spec: StateSpec, num_slots: int, budget_bytes: int) -> StateSpec:
    """The same per-layer shapes with as many layers as fit ``budget_bytes`` for ``num_slots`` slots."""
    per_layer = sum(spec.layer_bytes()) * (num_slots + 1)
    layers = max(1, min(spec.num_layers, budget_bytes // per_layer))
    if layers == spec.num_layers:
        return spec
    return StateSpec(layers, spec.conv_shapes, spec.temporal_shape, spec.conv_dtype, spec.temporal_dtype)
