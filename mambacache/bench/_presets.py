"""Pool shapes from real models' configs (their public config.json fields), via ``StateSpec.from_hf_config``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .._core._spec import StateSpec

__all__ = ["PRESETS", "SHARDED", "Preset", "fit_layers", "lookup", "shard"]


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


def _divide(value: int, tp: int, what: str) -> int:
    if value % tp:
        raise ValueError(f"{what} ({value}) is not divisible by tp {tp}")
    return value // tp


def _shard_config(cfg: SimpleNamespace, tp: int) -> SimpleNamespace:
    """The config of one rank's shard, divided as engines divide it: heads and conv channels by ``tp``.

    Mamba2-style groups are divided when ``tp`` divides them and replicated
    otherwise (one group per rank, as vLLM's extra-groups rule does for
    ``n_groups < tp``), so the conv channels are ``inner / tp + 2 * groups * N``.
    """
    out = SimpleNamespace(**vars(cfg))
    kind = cfg.model_type
    if kind in ("qwen3_next", "qwen3_5"):
        out.linear_num_key_heads = _divide(cfg.linear_num_key_heads, tp, "key heads")
        out.linear_num_value_heads = _divide(cfg.linear_num_value_heads, tp, "value heads")
    elif kind == "mamba2":
        out.num_heads = _divide(cfg.num_heads, tp, "heads")
        out.hidden_size = _divide(cfg.hidden_size, tp, "hidden size")  # inner = expand * hidden
        out.n_groups = cfg.n_groups // tp if cfg.n_groups % tp == 0 else 1
    elif kind == "nemotron_h":
        out.mamba_num_heads = _divide(cfg.mamba_num_heads, tp, "heads")
        out.n_groups = cfg.n_groups // tp if cfg.n_groups % tp == 0 else 1
    else:
        raise ValueError(f"no sharding rule for {kind}")
    return out


def shard(name: str, tp: int) -> Preset:
    """Preset ``name`` as one rank of a ``tp``-way tensor-parallel deployment holds it."""
    if tp == 1:
        return PRESETS[name]
    base = name.split("-tp")[0]
    if base in CONFIGS:
        spec = StateSpec.from_hf_config(_shard_config(CONFIGS[base], tp))
    else:  # synthetic: channels and heads (the first state dim) divided
        full = PRESETS[base].spec
        conv = [(_divide(c[0], tp, "conv channels"), *c[1:]) for c in full.conv_shapes]
        temporal = (_divide(full.temporal_shape[0], tp, "heads"), *full.temporal_shape[1:])
        spec = StateSpec(full.num_layers, conv, temporal, full.conv_dtype, full.temporal_dtype)
    return Preset(f"{base}-tp{tp}", spec, f"{PRESETS[base].source}, sharded {tp}-way")


# The shapes engines run: each rank of a tensor-parallel deployment holds a shard.
SHARDED = [
    *(f"qwen3-next-80b-a3b-tp{tp}" for tp in (2, 4, 8)),
    *(f"qwen3.5-35b-a3b-tp{tp}" for tp in (2, 4, 8)),
    "nemotron-h-8b-tp8",
    "mamba2-2.7b-tp8",
]
# --quick: 8 layers and about 1 MiB per slot (128 KiB per layer), a pool sized for a quick run on a CPU.
PRESETS["small"] = Preset(
    "small",
    StateSpec(num_layers=8, conv_shapes=[(2048, 4)], temporal_shape=(8, 64, 64), conv_dtype=torch.bfloat16),
    "synthetic",
)


for _name in SHARDED:
    _base, _tp = _name.rsplit("-tp", 1)
    PRESETS[_name] = shard(_base, int(_tp))


def lookup(name: str) -> Preset:
    """A preset by name, ``<preset>-tp<N>`` included for any N that divides its heads and channels."""
    if name in PRESETS:
        return PRESETS[name]
    base, _, tp = name.rpartition("-tp")
    return shard(base, int(tp))


def fit_layers(spec: StateSpec, num_slots: int, budget_bytes: int) -> StateSpec:
    """The same per-layer shapes with as many layers as fit ``budget_bytes`` for ``num_slots`` slots."""
    per_layer = sum(spec.layer_bytes()) * (num_slots + 1)
    layers = max(1, min(spec.num_layers, budget_bytes // per_layer))
    if layers == spec.num_layers:
        return spec
    return dataclasses.replace(spec, num_layers=layers)  # keeps extras and draft buffers
