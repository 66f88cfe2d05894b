"""Routing (issue #32): one prefill manager feeds two decode managers; every state reaches its peer and no other.

Three gloo processes (``tests/_transfer_route_worker.py``). Needs the manager's
``export(..., to=)``.
"""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from ._transfer_route_worker import route_worker
from .test_distributed import free_port

pytestmark = pytest.mark.slow


def test_every_state_reaches_the_peer_it_was_exported_to_and_no_other() -> None:
    mp.spawn(route_worker, args=(free_port(),), nprocs=3, join=True)
