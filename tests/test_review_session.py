"""Review of the session's transfer changes (94167a8..): each test fails on the code before its fix.

The real-link tests run ``StateTransfer`` on clients of one ``TCPStore`` on 127.0.0.1, each side in its own
thread, the gloo pairs between them built as between processes (the pattern of ``test_reslice_attack.py``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

import mambacache as mc
from mambacache._handoff._reslice import StateLayout


def _mamba2(groups: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        model_type="mamba2", num_hidden_layers=2, num_heads=4, head_dim=2, n_groups=groups,
        state_size=3, expand=2, hidden_size=4, conv_kernel=4,
    )  # fmt: skip


def test_an_engine_pools_conv_window_of_kernel_minus_one_is_a_layout_of_the_config() -> None:
    """An engine's adopted pool keeps ``kernel - 1`` conv columns per channel (SGLang's and TensorRT-LLM's conv
    state ``[conv_dim, d_conv - 1]``, ``docs/engines.md``), so its spec is the config's in everything the layout
    cuts (the conv channels, the temporal heads) but not in the conv window's width. ``ReslicingReceiver`` and
    ``ReslicingSender`` need ``layout.spec == mgr.pool.spec``, so such an engine passes its pool's spec; the new
    check compared whole shapes and refused it ("not the config's"), where the layout, which cuts the first
    dimension only, is right for it: the shards gather back byte for byte."""
    cfg = _mamba2(groups=2)
    derived = mc.StateSpec.from_hf_config(cfg)
    channels, kernel = derived.conv_shapes[0]
    engine = dataclasses.replace(derived, conv_shapes=[(channels, kernel - 1)])
    layout = StateLayout.from_config(cfg, engine)
    assert layout.spec == engine
    assert layout.shard_spec(2).conv_shapes == ((channels // 2, kernel - 1),)
    full = [torch.randn(2, 3, *shape).to(dtype) for shape, dtype in engine.shapes()]
    back = layout.gather([layout.slice(full, 2, k) for k in range(2)])
    assert all(torch.equal(a, b) for a, b in zip(full, back, strict=True))
