"""State transfer between two engines (issue #20) on real torch.distributed (gloo on 127.0.0.1), two processes."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from ...support.link import free_port
from ...workers.transfer import transfer_worker

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["ok", "clear-after", "kill-prefill"])
def test_exported_states_arrive_exactly_and_a_dead_peer_is_an_error(mode: str) -> None:
    mp.spawn(transfer_worker, args=(free_port(), 11, mode), nprocs=2, join=True)
