"""Routing (issue #32): one prefill manager feeds two decode managers; every state reaches its peer and no other.

Three gloo processes (``tests/workers/transfer_route.py``). Needs the manager's
``export(..., to=)``.
"""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from ...support.link import free_port
from ...workers.transfer_route import route_worker

pytestmark = pytest.mark.slow


def test_every_state_reaches_the_peer_it_was_exported_to_and_no_other() -> None:
    mp.spawn(route_worker, args=(free_port(),), nprocs=3, join=True)
