"""A peer that dies in the middle of a batch, and an engine that takes its rank: over every transport (gloo, NIXL,
Mooncake: ``tests/conftest.py``), on real processes (``tests/workers/transfer_peer.py``).

The side that lives goes on with the same ``StateTransfer``: its call during the death is a typed
``TransferError`` with nothing landed (or, on the sending side, its slots kept, the batch in doubt), and its next
calls move the batch to or from the new process (over NIXL a new agent under the same rank, over Mooncake a new
segment), bytes exact, landed once.
"""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from ...support.link import free_port
from ...workers.transfer_peer import peer_worker

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("dies", ["sender", "receiver"])
def test_a_peer_that_dies_after_go_is_a_transfer_error_and_its_successor_is_taken_up(dies: str) -> None:
    mp.spawn(peer_worker, args=(free_port(), dies), nprocs=4, join=True)
