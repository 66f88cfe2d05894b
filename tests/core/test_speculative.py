"""Speculative decoding: draft buffers and CommitDraft, exact like every other event, on every executor."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

import mambacache as mc
from mambacache import tracing
from mambacache._core._planner import CommitStage, decode_plan, encode_plan, plan_step
from mambacache._executors._npu import NpuExecutor
from mambacache.audit import OpAudit
from mambacache.testing import SequentialOracle, fail_at_op

from ..support.strategies import events_from_ops, ops
from ..support.sweep import fault_points
from ..support.util import VARIANTS, drive

K = 3
N = 8


def spec(layers: int = 3) -> mc.StateSpec:
    return mc.StateSpec(num_layers=layers, conv_shapes=[(6, 3), (5, 2)], temporal_shape=(2, 3, 4))


def fill(pool: mc.StatePool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in [*pool.tensors, *pool.draft_tensors]:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype) + 1.0)


def test_draft_buffers_have_the_contract_layout_and_are_counted_in_memory() -> None:
    pool = mc.StatePool(spec(), num_slots=5, draft_tokens=K)
    assert pool.draft_tokens == K and pool.spec.draft_tokens == K
    assert [tuple(t.shape) for t in pool.draft_conv] == [(3, 6, K, 6, 3), (3, 6, K, 5, 2)]
    assert pool.draft_temporal is not None and tuple(pool.draft_temporal.shape) == (3, 6, K, 2, 3, 4)
    assert pool.spec.memory_bytes == pool.spec.slot_bytes * (1 + K)
    budget = pool.spec.memory_bytes * 10
    assert mc.StatePool.from_memory_budget(spec(), budget, draft_tokens=K).num_slots == 9
    assert mc.StatePool.from_memory_budget(spec(), budget).num_slots == 10 * (1 + K) - 1
    plain = mc.StatePool(spec(), 4)
    assert plain.draft_tokens == 0 and plain.draft_conv == [] and plain.draft_temporal is None
    with pytest.raises(mc.InvalidArgumentError):
        mc.StatePool(spec(), 4, draft_tokens=-1)


def test_a_fork_after_a_commit_carries_the_committed_state_one_before_does_not() -> None:
    pool = mc.StatePool(spec(), N, draft_tokens=K)
    with mc.CacheManager(pool) as mgr:
        a, before, after = mgr.alloc(3)
        mgr.flush_nowait()
        fill(pool, 1)
        old = [t[:, a].clone() for t in pool.tensors]
        mgr.copy_on_write(a, before)
        mgr.commit_draft(a, 2)
        mgr.submit(mc.CopyOnWrite(a, after))
        report = mgr.flush_nowait()
        assert report.committed == 2 and report.copied == 1 and report.bytes_committed == 2 * pool.spec.slot_bytes
        for t, d, o in zip(pool.tensors, pool.draft_tensors, old, strict=True):
            assert torch.equal(t[:, a], d[:, a, 1]) and torch.equal(t[:, after], d[:, a, 1])
            assert torch.equal(t[:, before], o)
        mgr.commit_draft(a, 0)  # unchanged, and elided
        report = mgr.flush_nowait()
        assert report.committed == 0 and report.elided == 1 and report.stages == 0


def test_commit_validation_is_typed_and_changes_nothing() -> None:
    pool = mc.StatePool(spec(), N, draft_tokens=K)
    with mc.CacheManager(pool) as mgr:
        (a,) = mgr.alloc(1, request_id="r")
        before = mgr.pending
        for accepted, error in ((K + 1, mc.InvalidArgumentError), (-1, mc.InvalidArgumentError),
                                (True, mc.InvalidArgumentError), (1.0, mc.InvalidArgumentError)):  # fmt: skip
            with pytest.raises(error):
                mgr.commit_draft(a, accepted)  # type: ignore[arg-type]
        with pytest.raises(mc.SlotStateError):
            mgr.commit_draft(a + 1, 1)
        with pytest.raises(mc.SlotStateError, match="belongs to"):
            mgr.commit_draft(a, 1, request_id="other")
        assert mgr.pending == before
        import numpy as np

        mgr.submit(mc.CommitDraft(np.int64(a), np.int32(K)))  # type: ignore[arg-type]
        assert mgr.pending == before + 1
    with mc.CacheManager(mc.StatePool(spec(), N)) as mgr:
        (a,) = mgr.alloc(1)
        with pytest.raises(mc.InvalidEventError, match="without draft buffers"):
            mgr.commit_draft(a, 1)
        mgr.commit_draft(a, 0)  # nothing to read: allowed, a no-op


COMMIT_VARIANTS = sorted(VARIANTS)


@pytest.mark.parametrize("variant", COMMIT_VARIANTS)
@given(raw=ops, seed=st.integers(0, 99))
@settings(max_examples=25)
def test_commits_mixed_with_every_event_match_the_oracle(
    variant: str, raw: list[tuple[str, int, int]], seed: int
) -> None:
    raw0 = [(k, 0 if k == "alloc" else a, b) for k, a, b in raw]
    pool = mc.StatePool(spec(), N, draft_tokens=K)
    with mc.CacheManager(pool, executor=VARIANTS[variant]()) as mgr:
        mgr.alloc(2)
        mgr.flush_nowait()
        fill(pool, seed)
        for events, _ in events_from_ops(raw0, N, set(pool.allocated_slots()), draft_tokens=K):
            oracle = SequentialOracle(pool)
            drive(mgr, events, oracle)
            mgr.flush_nowait()
            oracle.assert_matches(pool)
            fill(pool, seed + 1)  # the next verify forward writes new drafts (and the forward, every slot)


@pytest.mark.parametrize("variant", COMMIT_VARIANTS)
def test_a_fault_at_every_op_of_a_commit_step_then_one_flush_is_exact(variant: str) -> None:
    def run(at: int, exc: type[BaseException]) -> int:
        pool = mc.StatePool(spec(), N, draft_tokens=K)
        with mc.CacheManager(pool, executor=VARIANTS[variant]()) as mgr:
            a, b, c, d = mgr.alloc(4)
            mgr.flush_nowait()
            fill(pool, at)
            oracle = SequentialOracle(pool)
            events = [mc.CopyOnWrite(a, d), mc.CommitDraft(a, 2), mc.CommitDraft(b, K), mc.CopyOnWrite(b, c),
                      mc.CommitDraft(c, 1), mc.Clear(d)]  # fmt: skip
            mgr.submit(*events)  # type: ignore[arg-type]
            oracle.apply(events)  # type: ignore[arg-type]
            mode = fail_at_op(at, exc)
            try:
                with mode:
                    mgr.flush_nowait()
            except (mc.ExecutorError, KeyboardInterrupt):
                mgr.flush_nowait()
            oracle.assert_matches(pool)
            return mode.ops

    total = run(0, MemoryError)
    for at in fault_points(total):
        run(at, [MemoryError, KeyboardInterrupt][at % 2])


def test_commit_stages_batch_a_steps_commits_and_travel_on_the_wire() -> None:
    events = [mc.CommitDraft(s, 1 + s % K) for s in range(1, 7)] + [mc.CommitDraft(7, 0)]
    plan = plan_step(events)  # type: ignore[arg-type]
    (stage,) = plan.stages
    assert isinstance(stage, CommitStage) and len(stage.entries) == 6 and plan.committed == 6 and plan.elided == 1
    assert stage.entries[0] == (1, 1, 1)
    step, back = decode_plan(encode_plan(plan, 9))
    assert step == 9 and back == plan


def test_commits_allocate_nothing_the_size_of_the_state_and_npu_stays_in_its_workspace() -> None:
    pool = mc.StatePool(spec(layers=4), 200, draft_tokens=K)
    rng = random.Random(0)
    slots = list(range(1, 65))
    from mambacache._executors._torch import TorchExecutor

    for executor, bound in (("torch", None), (TorchExecutor(path="direct"), None), (NpuExecutor(1 << 10), 1 << 10)):
        with mc.CacheManager(pool, executor=executor) as mgr:
            mgr.alloc_slots(slots)
            mgr.flush_nowait()
            for s in slots:
                mgr.commit_draft(s, rng.randint(1, K))
            with OpAudit() as audit:
                mgr.flush_nowait()
            report = audit.report()
            assert report.sync_ops == (), report
            if executor != "torch":  # the npu executor and the accelerator path feed only contiguous rows
                assert report.noncontiguous_input_bytes == 0, report
            if bound is None:
                assert report.peak_state_temp_bytes == 0
            else:
                assert report.peak_state_temp_bytes <= bound
            mgr.release_many(slots)


def test_commit_is_traced_and_analyzed() -> None:
    tracing.configure(level="debug", use_structlog_config=True)
    try:
        pool = mc.StatePool(spec(), N, draft_tokens=K)
        with capture_logs() as logs, mc.CacheManager(pool) as mgr:
            (a,) = mgr.alloc(1, request_id="r")
            mgr.commit_draft(a, 2, request_id="r")
    finally:
        tracing.disable()
    commit = next(e for e in logs if e["event"] == "slot.commit")
    assert (commit["slot"], commit["accepted"], commit["request_id"]) == (a, 2, "r")
    import json

    lines = [json.dumps({k: v for k, v in e.items() if k != "log_level"}) for e in logs]
    analysis = tracing.analyze_lines(lines)
    assert [e.action for e in analysis.timelines[a]] == ["alloc", "commit"] and analysis.summary["commits"] == 1


def test_from_hf_config_takes_draft_tokens() -> None:
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        model_type="mamba2", num_hidden_layers=2, hidden_size=16, expand=2, n_groups=1, state_size=4,
        conv_kernel=4, num_heads=2, head_dim=16,
    )  # fmt: skip
    assert mc.StateSpec.from_hf_config(cfg, draft_tokens=4).draft_tokens == 4


def test_from_tensors_adopts_the_engines_draft_buffers() -> None:
    conv, temporal = torch.zeros(2, 5, 4, 3), torch.zeros(2, 5, 2, 2)
    dconv, dtemp = torch.zeros(2, 5, 3, 4, 3), torch.zeros(2, 5, 3, 2, 2)
    pool = mc.StatePool.from_tensors(conv=[conv], temporal=temporal, draft_conv=[dconv], draft_temporal=dtemp)
    assert pool.draft_tokens == 3 and pool.draft_temporal is dtemp
    dtemp[:, 1, 2] = 7.0
    with mc.CacheManager(pool) as mgr:
        (a,) = mgr.alloc_slots([1])
        mgr.commit_draft(a, 3)
    assert bool((temporal[:, 1] == 7.0).all())  # written into the engine's own tensor
    for kwargs in (
        {"draft_conv": [dconv]},  # one without the other
        {"draft_conv": [dconv], "draft_temporal": torch.zeros(2, 5, 2, 2, 2)},  # draft counts differ
        {"draft_conv": [dconv], "draft_temporal": torch.zeros(2, 5, 3, 2, 3)},  # state shape differs
        {"draft_conv": [dconv], "draft_temporal": torch.zeros(2, 5, 3, 2, 2, dtype=torch.float16)},
        {"draft_conv": [dconv, dconv], "draft_temporal": dtemp},
    ):
        with pytest.raises(mc.InvalidArgumentError):
            mc.StatePool.from_tensors(conv=[conv], temporal=temporal, **kwargs)  # type: ignore[arg-type]
