"""send_async / receive_async cancelled at every await of a transfer, on real torch.distributed (two gloo processes).

The await points: before the worker thread starts (a cancelled call must do
nothing), and while the thread waits on the wire (the sender for the peer's
acknowledgement, the receiver for the header). The outcome asserted is the
real one on both sides: the batch finished consistently (the sender's slots
released iff the peer acknowledged, the receiver's states landed all or none),
the cancellation still delivered, and the next send/receive pair works. The
cases are in ``tests/workers/transfer_cancel.py``; both event loops run them.
"""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from ...support.link import free_port
from ...workers.transfer_cancel import cancel_worker

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_cancelled_transfer_finishes_its_batch_and_the_next_one_works(backend: str) -> None:
    mp.spawn(cancel_worker, args=(free_port(), backend), nprocs=2, join=True)
