"""Huge steps through the manager: the documented commit-then-swap pattern at scale, and a planner failure."""

from __future__ import annotations

import pytest
import torch

import mambacache as mc
from mambacache._core import _flush
from mambacache.testing import SequentialOracle


def spec() -> mc.StateSpec:
    return mc.StateSpec(num_layers=2, conv_shapes=[(3, 2)], temporal_shape=(2, 2), conv_dtype=torch.float32)


def fill(pool: mc.StatePool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in [*pool.tensors, *pool.draft_tensors]:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype) + 1.0)


@pytest.mark.parametrize("reuse", [False, True], ids=["swap", "swap-and-refill"])
def test_five_thousand_requests_committed_and_swapped_in_one_step_are_exact(reuse: bool) -> None:
    """Speculative decoding's step end, then preemption by swap of every request (commit, offload, release);
    with ``reuse`` new requests take the freed slots in the same step, which cuts the plan at every request."""
    n = 5000
    pool = mc.StatePool(spec(), n, draft_tokens=2)
    host = mc.HostPool(spec(), n)
    with mc.CacheManager(pool, host_pool=host) as mgr:
        slots = mgr.alloc(n, request_id="old")
        mgr.flush_nowait()
        fill(pool, 1)
        oracle = SequentialOracle(pool, host)
        before = mgr.pending
        hosts = []
        for s in slots:
            mgr.commit_draft(s, 1 + s % 2, request_id="old")
            hosts.append(mgr.offload(s, request_id="old"))
            mgr.release(s, request_id="old")
            if reuse:
                assert mgr.alloc(1, request_id="new") == [s]
        events = mgr.queued()[before:]
        report = mgr.flush_nowait()
        oracle.apply(events)
        oracle.assert_matches(pool, host)
        assert (report.committed, report.offloaded) == (n, n)
        # Each host slot holds the accepted draft state of its request, exactly.
        for s, h in zip(slots, hosts, strict=True):
            for t, d in zip(host.tensors, pool.draft_tensors, strict=True):
                assert torch.equal(t[:, h], d[:, s, s % 2])
        for h in hosts:
            mgr.drop(h)
        if reuse:
            mgr.release_many(slots, request_id="new")
        mgr.flush_nowait()


def test_a_planner_failure_after_the_events_are_taken_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = mc.StatePool(spec(), 8, draft_tokens=2)
    host = mc.HostPool(spec(), 4)
    with mc.CacheManager(pool, host_pool=host) as mgr:
        a, b, c = mgr.alloc(3, request_id="r")
        mgr.flush_nowait()
        fill(pool, 2)
        oracle = SequentialOracle(pool, host)
        mgr.commit_draft(a, 2)
        h = mgr.offload(a)
        mgr.copy_on_write(a, b)
        mgr.release(a)
        mgr.clear(c)
        events, step = mgr.queued(), mgr.step

        real = _flush.plan_step
        calls = []

        def failing(log: object) -> mc.Plan:
            calls.append(log)
            raise MemoryError("no memory for the plan")

        monkeypatch.setattr(_flush, "plan_step", failing)
        with pytest.raises(mc.PlanError, match="queued again") as info:
            mgr.flush_nowait()
        assert isinstance(info.value, RuntimeError) and isinstance(info.value.__cause__, MemoryError)
        # Nothing ran, nothing was lost: the same events, in order, for the same step.
        assert mgr.queued() == events and mgr.step == step and calls
        mgr.clear(b)  # submitting goes on meanwhile; it lands after the kept events
        monkeypatch.setattr(_flush, "plan_step", real)
        report = mgr.flush_nowait()
        assert report.step == step and report.events == len(events) + 1
        oracle.apply([*events, mc.Clear(b)])
        oracle.assert_matches(pool, host)
        assert host.held() == {h: None}
