"""Attacks on a state transfer's wire over real gloo processes (issue #32).

The cases are in ``tests/workers/transfer_wire.py`` (rank 0 sends, rank 1
receives, real threads on both sides). Each failed before its fix, but the
landing that fails before its go or after its bytes, which guards the landing
path (it held already); the random landing faults found the withdrawn-header
hang and fail without its fix.
"""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from ...support.link import free_port
from ...workers.transfer_wire import CASES, wire_worker


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_wire_holds_under_attack(case: str) -> None:
    mp.spawn(wire_worker, args=(free_port(), case), nprocs=2, join=True)
