"""The op audit, and what it proves about the executors."""

from __future__ import annotations

import pytest
import torch

import mambacache as mc
from mambacache.audit import OpAudit

pytestmark = pytest.mark.anyio

SPEC = mc.StateSpec(num_layers=4, conv_shapes=[(64, 4)], temporal_shape=(4, 16, 16))
SLOT_LAYER_MAX = max(SPEC.layer_bytes())


def seed_clear(pool: mc.StatePool, slots: list[int]) -> None:
    """The expand-based clear SGLang used before its NPU fix."""
    idx = torch.tensor(slots)
    for t in pool.tensors:
        z = torch.zeros(1, dtype=t.dtype, device=t.device).expand(t.shape[0], len(slots), *t.shape[2:])
        t[:, idx] = z


async def audited_flush(executor: str | object, n_clear: int, n_copy: int = 0) -> mc.audit.AuditReport:
    pool = mc.StatePool(SPEC, 2 * n_clear + 2 * n_copy + 4)
    async with mc.CacheManager(pool, executor=executor, copy_workspace_bytes=SLOT_LAYER_MAX * 3) as mgr:
        slots = mgr.alloc(2 * n_clear + 2 * n_copy)
        await mgr.flush()
        for s in slots[: 2 * n_clear : 2]:  # every other slot: no coalescing into one run
            mgr.clear(s)
        for i in range(n_copy):
            mgr.copy_on_write(slots[2 * n_clear + 2 * i], slots[2 * n_clear + 2 * i + 1])
        with OpAudit() as audit:
            await mgr.flush()
        return audit.report()


@pytest.mark.parametrize("executor", ["torch", "npu", "reference"])
async def test_clears_allocate_no_temporary_growing_with_slot_count(executor: str) -> None:
    small = await audited_flush(executor, 10)
    large = await audited_flush(executor, 300)
    assert large.peak_state_temp_bytes == small.peak_state_temp_bytes == 0
    assert large.peak_temp_bytes <= 64  # at most a scalar or two
    assert large.sync_ops == ()


async def test_npu_feeds_no_noncontiguous_input_and_copies_stay_in_workspace() -> None:
    report = await audited_flush("npu", 200, n_copy=50)
    assert report.noncontiguous_input_bytes == 0, report.noncontiguous_ops
    assert 0 < report.max_temp_bytes <= SLOT_LAYER_MAX * 3
    assert report.peak_state_temp_bytes <= SLOT_LAYER_MAX * 3
    assert report.sync_ops == ()


@pytest.mark.parametrize("executor", ["torch", "npu", "reference"])
async def test_no_flush_syncs_the_host(executor: str) -> None:
    report = await audited_flush(executor, 30, n_copy=30)
    assert report.sync_ops == ()


def test_audit_sees_the_seed_path_and_host_syncs() -> None:
    pool = mc.StatePool(SPEC, 400)
    slots = list(range(1, 400, 2))
    with OpAudit() as audit:
        seed_clear(pool, slots)
        pool.temporal.sum().item()
        torch.nonzero(pool.temporal[0, 1])
    report = audit.report()
    # What an NPU adapter would materialise: every cleared slot, in full.
    assert report.noncontiguous_input_bytes == len(slots) * SPEC.slot_bytes
    assert set(report.sync_ops) == {"_local_scalar_dense", "nonzero"}


def test_audit_peak_tracks_live_temporaries() -> None:
    x = torch.ones(1000)
    with OpAudit() as audit:
        a = x * 2  # 4000 bytes
        b = x + 1  # 4000 more, both live
        del a, b
        c = x - 1  # 4000, after the others died
        del c
    report = audit.report()
    assert report.peak_temp_bytes == 8000
    assert report.total_temp_bytes == 12000 and report.max_temp_bytes == 4000


async def test_npu_workspace_grows_without_two_buffers_alive() -> None:
    # The conv tensor needs a small workspace, the temporal one a larger one: the
    # buffer grows between them, and the old one must be gone before the new one.
    pool = mc.StatePool(SPEC, 8)
    async with mc.CacheManager(pool, executor="npu", copy_workspace_bytes=1 << 20) as mgr:
        a, b, c, d = mgr.alloc(4)
        await mgr.flush()
        mgr.submit(mc.CopyOnWrite(a, c), mc.CopyOnWrite(b, d))
        with OpAudit() as audit:
            await mgr.flush()
    report = audit.report()
    temporal_need = 2 * SPEC.num_layers * SPEC.layer_bytes()[-1]
    assert report.max_temp_bytes == temporal_need
    assert report.peak_temp_bytes == temporal_need  # not conv_need + temporal_need


async def test_torch_index_path_copies_stay_in_workspace() -> None:
    from mambacache._executors._torch import TorchExecutor

    bound = 3 * SPEC.num_layers * max(SPEC.layer_bytes())  # three slots of the largest tensor
    executor = TorchExecutor(bound, min_run_bytes=1 << 40, max_runs=0)  # force the index path
    report = await audited_flush(executor, 0, n_copy=40)
    assert 0 < report.max_temp_bytes <= bound
    assert report.peak_state_temp_bytes <= bound


@pytest.mark.parametrize("executor", ["torch", "npu", "reference"])
@pytest.mark.parametrize("n", [1, 8, 32])
async def test_offloads_and_restores_allocate_nothing_and_never_sync(executor: str, n: int) -> None:
    pool, host = mc.StatePool(SPEC, 2 * n + 2), mc.HostPool(SPEC, 2 * n)
    async with mc.CacheManager(pool, executor=executor, host_pool=host) as mgr:
        slots = mgr.alloc(2 * n)
        await mgr.flush()
        handles = [mgr.offload(s) for s in slots[::2]]  # scattered slots into consecutive host slots
        with OpAudit() as audit:
            report = await mgr.flush()
        out = audit.report()
        assert report.offloaded == n
        assert out.peak_temp_bytes == 0 and out.sync_ops == ()
        for h, s in zip(handles, slots[1::2], strict=True):
            mgr.restore(h, s)
        with OpAudit() as audit:
            report = await mgr.flush()
        out = audit.report()
        assert report.restored == n
        assert out.peak_temp_bytes == 0 and out.sync_ops == ()
