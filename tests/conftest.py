from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# One torch thread per test process and per process it starts (examples, spawned ranks, the CLI), unless
# MAMBACACHE_TEST_THREADS says otherwise: the tests' tensors are tiny, and on a shared or loaded machine every
# op's parallel region waits for a second thread to be scheduled (the suite took 26 minutes on a loaded 2-core
# machine). OMP_NUM_THREADS reaches the subprocesses; torch.set_num_threads this one, already started.
THREADS = os.environ.get("MAMBACACHE_TEST_THREADS", "1")
os.environ["OMP_NUM_THREADS"] = THREADS
torch.set_num_threads(int(THREADS))

settings.register_profile(
    "default", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
