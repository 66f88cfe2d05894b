"""A transfer's link recovers from every failed batch (issue #32, defects 5 and 6), on real gloo processes.

gloo closes a pair on any timeout; before the store-controlled protocol a late
receiver, an idle one, a batch refused for room or an acknowledgement that came
late left every later batch failing, and a receiver of another spec was killed
inside gloo. Each case here fails a batch one of those ways and then retries it
to success on the same ``StateTransfer`` (``tests/workers/transfer_link.py``).
"""

from __future__ import annotations

import math

import pytest
import torch.multiprocessing as mp

import mambacache as mc

from ...support.link import free_port
from ...workers.transfer import HOST, spec
from ...workers.transfer_link import CASES, link_worker


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_batch_is_retried_to_success_on_the_same_transfer(case: str) -> None:
    mp.spawn(link_worker, args=(free_port(), [case]), nprocs=2, join=True)


@pytest.mark.parametrize("timeout", ["5", None, math.inf, 1e300, [5], True, 0, -1.0, math.nan])
def test_a_timeout_that_is_not_finite_positive_seconds_is_refused(timeout: object) -> None:
    mgr = mc.CacheManager(mc.StatePool(spec(), 2), host_pool=mc.HostPool(spec(), HOST))
    with mgr, pytest.raises(mc.InvalidArgumentError, match="timeout"):
        mc.StateTransfer(mgr, None, 1, timeout=timeout)  # type: ignore[arg-type]
