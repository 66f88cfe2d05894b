"""Routing (issue #32): one prefill manager feeds two decode managers; every state reaches its peer and no other.

Three gloo processes (``tests/_transfer_route_worker.py``). Needs the manager's
``export(..., to=)`` (branch f/xcore); skipped, and named so, until it is in.
"""

from __future__ import annotations

import inspect

import pytest
import torch.multiprocessing as mp

import mambacache as mc

from ._transfer_route_worker import route_worker
from .test_distributed import free_port

pytestmark = pytest.mark.slow


@pytest.mark.skipif(
    "to" not in inspect.signature(mc.CacheManager.export).parameters,
    reason="COORDINATOR: needs export(..., to=) from f/xcore; remove this skip once merged",
)
def test_every_state_reaches_the_peer_it_was_exported_to_and_no_other() -> None:
    mp.spawn(route_worker, args=(free_port(),), nprocs=3, join=True)
