"""``simulate --scenario pd`` over every transport (``tests/conftest.py`` parametrises this module over gloo, NIXL
and Mooncake): the toy, Mamba2 and Qwen3-Next (tiny random configs), prefill and decode at TP 1 -> 1, 2 -> 1 and
1 -> 2 in separate processes, each request's tokens checked against the request generated alone.

Two batches each: the first staged through the host pools, the second in place (``_pd._in_place``), so both
hand-offs run on every combination; 2 -> 1 re-slices on the decode side (``ReslicingReceiver``), 1 -> 2 on the
prefill side (``ReslicingSender``), over a pulled transport each rank's shard read where it lies.
"""

from __future__ import annotations

import pytest

from mambacache.sim._pd import PdConfig, simulate_pd


@pytest.mark.slow
@pytest.mark.parametrize(("tp_prefill", "tp_decode"), [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("model", ["toy", "mamba2", "qwen3-next"])
def test_pd_is_exact_over_the_transport(transport: str, model: str, tp_prefill: int, tp_decode: int) -> None:
    if model != "toy":
        pytest.importorskip("transformers")
    r = simulate_pd(
        PdConfig(
            model=model, requests=3, batch=2, tp_prefill=tp_prefill, tp_decode=tp_decode, timeout=30,
            transport=transport,
        )
    )  # fmt: skip
    assert r.error is None, r.error
    assert (r.completed, r.mismatches, r.batches, r.transport) == (3, 0, 2, transport)
