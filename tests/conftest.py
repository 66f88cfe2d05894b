from __future__ import annotations

import os
from pathlib import Path

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


# The transfer suite (tests/handoff/transfer/: every test of the transfer, the re-slicing and the soaks) runs over
# each transport. One whose package is missing is skipped, unless MAMBACACHE_REQUIRE_TRANSPORTS=1 (the transports'
# venv in .ci/run): then it fails.
TRANSFER_SUITE = Path(__file__).parent / "handoff" / "transfer"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from .support.link import TRANSPORTS

    if metafunc.definition.path.is_relative_to(TRANSFER_SUITE):
        # A test marked no_transport makes no transfer (a stand-in wire, the parsers): over another transport it
        # would run the same code again (the transfer property tests alone took 4 of the transports' 25 minutes).
        wireless = metafunc.definition.get_closest_marker("no_transport") is not None
        metafunc.parametrize("transport", ("gloo",) if wireless else TRANSPORTS, indirect=True)


@pytest.fixture(autouse=True)
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The transport of the test's transfers (gloo outside the transfer suite)."""
    import importlib.util

    from mambacache._handoff._transports._pick import EXTRAS

    from .support.link import TRANSPORT_ENV, default_transport

    name = str(getattr(request, "param", "gloo"))
    if request.node.get_closest_marker("no_transport") is not None:

        def made(*args: object) -> None:
            raise AssertionError("a test marked no_transport made a transport: it belongs to every transport's run")

        monkeypatch.setattr("mambacache._handoff._transfer.make_transport", made)
    module, extra = EXTRAS[name]
    if extra and importlib.util.find_spec(module) is None:
        if os.environ.get("MAMBACACHE_REQUIRE_TRANSPORTS") == "1":
            pytest.fail(f"MAMBACACHE_REQUIRE_TRANSPORTS=1 but {module} is missing: pip install -e '.[{extra}]'")
        pytest.skip(f"the {name} transport's package {module} is not installed (pip install -e '.[{extra}]')")
    if name != "gloo":
        default_transport(name, monkeypatch.setitem)
        monkeypatch.setenv(TRANSPORT_ENV, name)
        # UCX over TCP on 127.0.0.1; without its InfiniBand module: that module's libnl copy crashes the process at
        # exit beside the system's (libibverbs1's), docs/transfer.md.
        monkeypatch.setenv("UCX_TLS", os.environ.get("UCX_TLS", "tcp,self"))
        monkeypatch.setenv("UCX_MODULES", os.environ.get("UCX_MODULES", "^ib"))
    return name
