"""Tensor parallel in one process: managers joined by LoopbackChannel, each rank's shard against the oracle.

The real torch.distributed path (gloo, spawned processes) is tests/core/test_distributed.py; these
run the same manager code through the same wire format without spawning anything.
"""

from __future__ import annotations

import threading

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache.testing import SequentialOracle

from ..support.layered import layered_pool, pool_tensors
from ..support.strategies import host_events_from_ops, host_shift_ops
from ..support.util import drive

N, H = 8, 4


def shard_spec(rank: int) -> mc.StateSpec:
    # Each rank holds its own shard: the same slots, other state sizes (heads or channels split).
    return mc.StateSpec(num_layers=2, conv_shapes=[(3 + rank, 2)], temporal_shape=(2 + rank, 3))


def fill(pool: mc.StatePool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in [*pool_tensors(pool), *pool_tensors(pool, drafts=True)]:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype) + 1.0)


def submit(mgr: mc.CacheManager, events: list[object], hosts: dict[int, int]) -> None:
    """Replay a valid log on the source: allocs of exact slots, host slots mapped to the ones the manager
    hands out (``hosts``: the log's host slot -> the manager's), the rest as events."""
    drive(mgr, events, exact=True, hosts=hosts)


def flush_all(mgrs: list[mc.CacheManager]) -> list[mc.StepReport]:
    """Every rank flushes, the receivers in threads (each blocks on its plan), as separate processes would."""
    reports: list[mc.StepReport | BaseException | None] = [None] * len(mgrs)

    def run(i: int) -> None:
        try:
            reports[i] = mgrs[i].flush_nowait()
        except BaseException as exc:  # handed to the main thread
            reports[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(mgrs))]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join(30)
    for r in reports:
        if isinstance(r, BaseException):
            raise r
    return reports  # type: ignore[return-value]


@settings(max_examples=25)
@given(host_shift_ops, st.sets(st.integers(1, N)), st.sampled_from([2, 3]))
def test_every_rank_applies_the_source_plan_exactly(raw: list[tuple[str, int, int]], initially: set[int], world: int):
    channels = mc.LoopbackChannel.group(world, timeout=10)
    # Odd ranks hold their shard as per-layer tensors (StatePool.from_layers): the plan is the same.
    pools = [
        layered_pool(shard_spec(r), N, mc.StatePool) if r % 2 else mc.StatePool(shard_spec(r), N) for r in range(world)
    ]
    hosts = [mc.HostPool(shard_spec(r), 2 * H) for r in range(world)]  # room for slots freed in a step
    mgrs = [mc.CacheManager(p, channel=c, host_pool=h) for p, c, h in zip(pools, channels, hosts, strict=True)]
    for m in mgrs:
        m.__enter__()
    try:
        mgrs[0].alloc_slots(sorted(initially))
        flush_all(mgrs)
        for r, p in enumerate(pools):
            fill(p, r)
        oracles = [SequentialOracle(p, h) for p, h in zip(pools, hosts, strict=True)]
        host_of: dict[int, int] = {}
        # Shifted and split copies too: a shift stage's pairs and their temporal sources travel in the plan message
        max_shift = min(c[-1] for c in shard_spec(0).conv_shapes) - 1
        for events, _, _ in host_events_from_ops(raw, N, set(initially), H, set(), max_shift=max_shift):
            before = mgrs[0].pending
            submit(mgrs[0], events, host_of)
            queued = mgrs[0].queued()[before:]
            reports = flush_all(mgrs)
            assert len({(r.step, r.events, r.zeroed, r.copied, r.offloaded, r.restored) for r in reports}) == 1
            for o, p, h in zip(oracles, pools, hosts, strict=True):
                o.apply(queued)
                o.assert_matches_shard(p)
                for want, got in zip(o.host, h.tensors, strict=True):
                    for slot in sorted(o.host_held & o.host_defined):
                        assert torch.equal(want[:, slot], got[:, slot])
    finally:
        for m in reversed(mgrs[1:]):
            threading.Thread(target=m.__exit__, args=(None, None, None)).start()
        mgrs[0].__exit__(None, None, None)


def test_receivers_refuse_submits_and_a_silent_source_is_a_typed_error_not_a_hang() -> None:
    _source, receiver = mc.LoopbackChannel.group(2, timeout=0.2)
    mgr = mc.CacheManager(mc.StatePool(shard_spec(1), 4), channel=receiver).__enter__()
    with pytest.raises(mc.DistributedError, match="only the source rank submits"):
        mgr.alloc(1)
    with pytest.raises(mc.DistributedError, match="no plan from the source"):
        mgr.flush_nowait()
    with pytest.raises(mc.DistributedError, match="failed earlier"):  # broken for good on this rank
        mgr.__exit__(None, None, None)  # every rank flushes on exit, to stay in step
    with pytest.raises(mc.InvalidArgumentError, match="Channel"):
        mc.CacheManager(mc.StatePool(shard_spec(0), 4), channel=object())  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_async_flushes_over_a_loopback_channel_stay_in_step(anyio_backend: str) -> None:
    channels = mc.LoopbackChannel.group(3, timeout=10)
    pools = [mc.StatePool(shard_spec(r), 6) for r in range(3)]
    mgrs = [mc.CacheManager(p, channel=c) for p, c in zip(pools, channels, strict=True)]
    for m in mgrs:
        await m.__aenter__()
    a, b = mgrs[0].alloc(2)
    reports: list[mc.StepReport] = []

    async def flush(m: mc.CacheManager) -> None:
        reports.append(await m.flush())

    async with anyio.create_task_group() as tg:
        for m in mgrs:
            tg.start_soon(flush, m)
    for r, p in enumerate(pools):
        fill(p, r + 10)
    want = [[t[:, a].clone() for t in p.tensors] for p in pools]
    mgrs[0].copy_on_write(a, b)
    mgrs[0].clear(a)
    async with anyio.create_task_group() as tg:
        for m in mgrs:
            tg.start_soon(flush, m)
    assert {r.step for r in reports} == {0, 1} and all(m.step == 2 for m in mgrs)
    for p, w in zip(pools, want, strict=True):
        for t, old in zip(p.tensors, w, strict=True):
            assert torch.equal(t[:, b], old) and not t[:, a].any()
    async with anyio.create_task_group() as tg:
        for m in mgrs:
            tg.start_soon(m.__aexit__, None, None, None)
