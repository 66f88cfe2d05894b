"""Review of the session's transfer changes (94167a8..): each test fails on the code before its fix.

The real-link tests run ``StateTransfer`` on clients of one ``TCPStore`` on 127.0.0.1, each side in its own
thread, the gloo pairs between them built as between processes (the pattern of ``test_reslice_attack.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from types import SimpleNamespace

import torch

import mambacache as mc
from mambacache._handoff._reslice import StateLayout

from .test_reslice_attack import _export, _layout, _mgr, _receiving, _sender, _store, _transfer


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


# -- the real link in one process (the helpers of tests/test_reslice_attack.py) --------------------------------------


def test_a_first_try_one_rank_refused_for_room_and_another_never_took_is_cut_to_the_room() -> None:
    """1 -> 2, three states ready, room for two on rank 1 (its host pool holds two), rank 2 not receiving yet.
    Rank 1 refuses the batch for room before its go, rank 2's header is withdrawn: on this first try nothing
    landed anywhere. The re-slicing sender cut a batch only when *every* rank refused it, so this mix went in
    doubt: the same three under the same number on every later send, which rank 1, whose room can never be
    three, refused each time while rank 2 landed them: the states never went, however often the engine retried.
    Now a first try that no rank took is not in doubt, and a refusal for room cuts it: a and b go."""
    layout = _layout()
    shard = layout.shard_spec(2)
    master = _store()
    with _mgr(layout.spec) as mgr, _mgr(shard, host=2) as d1, _mgr(shard) as d2:
        sender = _sender(mgr, master, layout, [1, 2], 1.0)
        into = [_transfer(d1, master, 1, 0, 1.0), _transfer(d2, master, 2, 0, 1.0)]
        for k, rid in enumerate("abc"):
            _export(mgr, rid, k)
        stop = threading.Event()
        got1: list[str] = []

        def receiving() -> None:  # rank 1 takes (or refuses) every header meanwhile
            while not stop.is_set():
                with contextlib.suppress(mc.TransferError):
                    got1.extend(into[0].receive())

        rank1 = threading.Thread(target=receiving)
        rank1.start()
        try:
            with contextlib.suppress(mc.TransferError):  # rank 2 is not receiving: what rank 1 took is in doubt
                sender.send()
            rank2, got2 = _receiving(into[1], tries=2)
            try:
                sent = sender.send()
            except mc.TransferError as exc:
                sent = [f"{type(exc).__name__}: {exc}"]
            rank2.join(10)
        finally:
            stop.set()
            rank1.join(15)
        assert sent[:2] == ["a", "b"], sent
        assert got1 == ["a", "b"] and got2 == [["a", "b"]]  # each landed once (rank 1's retry: dup)
