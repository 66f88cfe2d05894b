from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import mambacache as mc

settings.register_profile(
    "default", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def small_spec(layers: int = 3) -> mc.StateSpec:
    # Odd sizes and both dtypes on purpose: layouts must not depend on round numbers.
    return mc.StateSpec(num_layers=layers, conv_shapes=[(6, 3), (5, 2)], temporal_shape=(2, 3, 4))


def fill_random(pool: mc.StatePool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in pool.tensors:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype) + 1.0)
