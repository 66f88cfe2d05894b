"""What a simulation is asked to do, without torch: the settings, the named scenarios, the models' and faults'
names (``mambacache simulate --help`` reads them without importing the models)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CHECKPOINTS", "FAULTS", "MODELS", "PD_FAULTS", "PREEMPT", "SCENARIOS", "STATE_DTYPE_NAMES", "SimConfig"]

MODELS = ("toy", "mamba2", "qwen3-next")
# How the toy model can store its states (``_models.STATE_DTYPES`` maps each to its torch dtype).
STATE_DTYPE_NAMES = ("float32", "int8", "fp8")
PD_FAULTS = ("none", "skip-import", "kill-peer")
FAULTS = ("none", "skip-clear", "skip-fork", "wrong-commit", "skip-restore", "ignore-key")
PREEMPT = ("none", "swap", "recompute")
# Where a prefill checkpoints: every block boundary, or those and the end of the system prompt (the junction of
# the shared prefix and the request's own tokens, wherever it falls in a block).
CHECKPOINTS = ("grid", "junction")
# Named workloads: field overrides of SimConfig.
SCENARIOS: dict[str, dict[str, Any]] = {
    "prefix": {"slots": 14},
    "swap": {"preempt": "swap", "slots": 5, "max_running": 6, "max_checkpoints": 1},
    "recompute": {"preempt": "recompute", "slots": 5, "max_running": 6, "max_checkpoints": 1},
    "host-tier": {"max_checkpoints": 2, "host_checkpoints": 8, "slots": 8},
    # Slots are scarce (fewer than running requests once 2 are kept for checkpoints) and prefixes popular:
    # admission swaps a runner out instead of evicting the checkpoints. `--reserved 0` compares.
    "reserved": {
        "preempt": "swap",
        "slots": 7,
        "max_running": 6,
        "max_checkpoints": 3,
        "reserved": 2,
        "prefix_share": 0.8,
    },
}


@dataclass(frozen=True, slots=True)
class SimConfig:
    model: str = "toy"
    requests: int = 32
    max_running: int = 6
    prefix_share: float = 0.6
    seed: int = 0
    slots: int | None = None  # default: max_running + max_running // 2 (room for a few checkpoints)
    prefixes: int = 3  # distinct shared prefixes
    prefix_len: int = 8
    suffix_len: tuple[int, int] = (2, 10)
    new_tokens: tuple[int, int] = (3, 10)
    arrival_rate: float = 1.0  # requests per step, Poisson
    fault: str = "none"
    executor: str | None = None
    verify: bool = True
    trace: str | None = None
    speculative: int = 0  # draft tokens proposed per decode step (0: plain decoding)
    draft_accuracy: float = 0.7  # chance that each proposed token is the target's own next token
    block_size: int = 4  # prefill chunk, and the prefix cache's block
    max_checkpoints: int | None = None  # default: slots - max_running (at least 1)
    host_checkpoints: int = 0  # > 0: evicted checkpoints move to a host tier
    preempt: str = "none"  # when slots run out: swap a long runner to host memory, or drop and recompute it
    quantum: int = 3  # steps a request runs before it may be preempted
    reserved: int = 0  # pool slots kept for checkpoints: requests cannot take them (PrefixCache(reserved=...))
    state_dtype: str = "float32"  # the toy model's states: float32, or int8 / fp8 with per-slot scales (extras)
    checkpoint: str = "grid"  # grid: block boundaries; junction: those and the end of the system prompt
    adapters: int = 0  # > 0: requests run under adapter 1..adapters or none, the prefix cache keyed by it
