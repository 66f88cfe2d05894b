"""Extra per-slot tensors (``StateSpec.extra_shapes``): a quantised state's scales, laid out, counted, adopted and
refused like the state itself. Their semantics and faults run in the shared suites: tests/core/test_semantics.py and
tests/core/test_faults.py on ``quant_spec()``, tests/tiers/test_tiers_property.py with extras in its spec."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
from typing import Any

import pytest
import torch

import mambacache as mc
from mambacache.testing import SequentialOracle

from ..support.util import fill_random, quant_spec, small_spec


def test_extras_are_pool_tensors_in_name_order_with_the_pool_layout() -> None:
    given = {"ssm_scale": ([2], torch.bfloat16), "conv_scale": ((), torch.float32)}
    spec = dataclasses.replace(quant_spec(), extra_shapes=given, draft_tokens=2)
    assert list(spec.extra_shapes) == ["conv_scale", "ssm_scale"]  # name order, whatever order they came in
    assert spec.extra_shapes["ssm_scale"] == ((2,), torch.bfloat16)
    assert spec == dataclasses.replace(spec, extra_shapes=dict(reversed(given.items())))
    assert hash(spec) == hash(dataclasses.replace(spec, extra_shapes=dict(reversed(given.items()))))
    assert spec != dataclasses.replace(spec, extra_shapes={**given, "conv_scale": ((), torch.float16)})
    assert spec.shapes()[-2:] == [((), torch.float32), ((2,), torch.bfloat16)]
    pool = mc.StatePool(spec, 5)
    assert list(pool.extra) == list(pool.draft_extra) == ["conv_scale", "ssm_scale"]
    assert pool.extra["conv_scale"].shape == (3, 6) and pool.extra["ssm_scale"].shape == (3, 6, 2)
    assert pool.draft_extra["conv_scale"].shape == (3, 6, 2) and pool.draft_extra["ssm_scale"].shape == (3, 6, 2, 2)
    assert pool.tensors == [*pool.conv, pool.temporal, *pool.extra.values()]
    assert pool.draft_tensors == [*pool.draft_conv, pool.draft_temporal, *pool.draft_extra.values()]
    # Executors get the same storage; fp8 as an int8 view (torch has no index kernels for it).
    assert [t.data_ptr() for t in pool.exec_tensors] == [t.data_ptr() for t in pool.tensors]
    assert [t.data_ptr() for t in pool.exec_drafts] == [t.data_ptr() for t in pool.draft_tensors]
    assert pool.temporal.dtype == torch.float8_e4m3fn and pool.exec_tensors[2].dtype == torch.int8
    host = mc.HostPool(spec, 3)
    assert list(host.extra) == ["conv_scale", "ssm_scale"] and host.extra["ssm_scale"].shape == (3, 4, 2)
    assert host.tensors == [*host.conv, host.temporal, *host.extra.values()]


def test_extras_are_counted_in_slot_memory_and_step_bytes() -> None:
    spec = quant_spec(draft_tokens=2)
    # int8 convs (6x3, 5x2), fp8 temporal (2x3x4), a float32 scalar, a bf16 pair; per layer.
    assert spec.layer_bytes() == [18, 10, 24, 4, 4]
    assert spec.slot_bytes == 3 * 60 and spec.memory_bytes == 3 * spec.slot_bytes
    pool = mc.StatePool(spec, 5)
    allocated = sum(t.numel() * t.element_size() for t in [*pool.tensors, *pool.draft_tensors])
    assert allocated == spec.memory_bytes * (pool.num_slots + 1)
    assert mc.StatePool.from_memory_budget(spec, allocated).num_slots == 5
    assert mc.StatePool.from_memory_budget(spec, allocated - 1).num_slots == 4
    host = mc.HostPool(spec, 3)
    assert sum(t.numel() * t.element_size() for t in host.tensors) == spec.slot_bytes * 4
    with mc.CacheManager(pool, host_pool=host) as mgr:
        a, b = mgr.alloc(2)
        report = mgr.flush_nowait()
        assert report.bytes_zeroed == 2 * spec.slot_bytes
        mgr.copy_on_write(a, b)
        mgr.offload(a)
        mgr.commit_draft(a, 1)
        report = mgr.flush_nowait()
        assert (report.bytes_copied, report.bytes_offloaded) == (spec.slot_bytes, spec.slot_bytes)
        assert report.bytes_committed == spec.slot_bytes


def test_a_host_pool_must_hold_the_same_extras() -> None:
    spec = quant_spec()
    host = mc.HostPool(spec, 2)
    assert host.compatible_with(spec) and host.compatible_with(dataclasses.replace(spec, draft_tokens=3))
    others = [
        dataclasses.replace(spec, extra_shapes={}),
        dataclasses.replace(spec, extra_shapes={**spec.extra_shapes, "conv_scale": ((), torch.float16)}),
        dataclasses.replace(spec, extra_shapes={**spec.extra_shapes, "conv_scale": ((1,), torch.float32)}),
        dataclasses.replace(spec, extra_shapes={**spec.extra_shapes, "more": ((), torch.int8)}),
    ]
    for other in others:
        assert not host.compatible_with(other)
        pool = mc.StatePool(other, 2)
        with pytest.raises(mc.InvalidArgumentError, match="host_pool holds states"):
            mc.CacheManager(pool, host_pool=host)
        assert pool.ledger.owner is None and host.ledger.owner is None


@pytest.mark.parametrize(
    ("extra_shapes", "match"),
    [
        ([("s", ((), torch.float32))], "mapping"),
        ({1: ((), torch.float32)}, "identifiers"),
        ({"a-b": ((), torch.float32)}, "identifiers"),
        ({"": ((), torch.float32)}, "identifiers"),
        ({"s": torch.float32}, "pair"),
        ({"s": "f32"}, "pair"),
        ({"s": ((), torch.float32, 1)}, "pair"),
        ({"s": ((0,), torch.float32)}, "positive ints"),
        ({"s": ((2, -1), torch.float32)}, "positive ints"),
        ({"s": ((2.0,), torch.float32)}, "positive ints"),
        ({"s": (3, torch.float32)}, "sequence of ints"),
        ({"s": ((), "float32")}, "torch.dtype"),
        ({"s": ((), torch.qint8)}, "quantized dtype"),
    ],
)
def test_bad_extra_shapes_are_typed_errors(extra_shapes: Any, match: str) -> None:
    with pytest.raises(mc.InvalidArgumentError, match=match) as info:
        mc.StateSpec(num_layers=1, conv_shapes=[], temporal_shape=(2,), extra_shapes=extra_shapes)
    assert isinstance(info.value, ValueError)


def test_extra_shapes_are_read_only_and_survive_pickle_copy_and_asdict() -> None:
    spec = quant_spec(draft_tokens=1)
    before = dict(spec.extra_shapes)
    for change in (
        lambda e: e.__setitem__("x", ((), torch.int8)),
        lambda e: e.__delitem__("conv_scale"),
        lambda e: e.update(x=((), torch.int8)),
        lambda e: e.pop("conv_scale"),
        lambda e: e.clear(),
        lambda e: e.setdefault("x", ((), torch.int8)),
        lambda e: e.popitem(),
    ):
        with pytest.raises(TypeError, match="read-only"):
            change(spec.extra_shapes)
    with pytest.raises(TypeError, match="read-only"):
        spec.extra_shapes |= {"x": ((), torch.int8)}  # type: ignore[misc]
    assert spec.extra_shapes == before and spec.slot_bytes == quant_spec().slot_bytes
    assert pickle.loads(pickle.dumps(spec)) == spec and copy.deepcopy(spec) == spec
    assert dataclasses.asdict(spec)["extra_shapes"] == before


def _engine_tensors(layers: int = 2, slots: int = 4, k: int = 0) -> dict[str, Any]:
    """An fp8 state with one float32 scale per slot and layer, and a per-head bf16 one, as separate tensors."""
    rows = (layers, slots + 1) if not k else (layers, slots + 1, k)
    return {
        "conv": [torch.zeros(*rows, 6, 3, dtype=torch.float8_e4m3fn)],
        "temporal": torch.zeros(*rows, 2, 4, dtype=torch.float8_e4m3fn),
        "extra": {"ssm_scale": torch.zeros(*rows, 2, dtype=torch.bfloat16), "conv_scale": torch.zeros(*rows)},
    }


def test_from_tensors_adopts_the_engines_scales_and_their_draft_buffers() -> None:
    state, drafts = _engine_tensors(), _engine_tensors(k=3)
    pool = mc.StatePool.from_tensors(
        state["conv"],
        state["temporal"],
        extra=state["extra"],
        draft_conv=drafts["conv"],
        draft_temporal=drafts["temporal"],
        draft_extra=drafts["extra"],
    )
    assert pool.spec.extra_shapes == {"conv_scale": ((), torch.float32), "ssm_scale": ((2,), torch.bfloat16)}
    assert pool.extra["ssm_scale"] is state["extra"]["ssm_scale"] and pool.draft_tokens == 3
    assert pool.draft_extra["conv_scale"] is drafts["extra"]["conv_scale"]
    assert pool.tensors[-2:] == [state["extra"]["conv_scale"], state["extra"]["ssm_scale"]]  # spec (name) order
    scale = state["extra"]["conv_scale"]
    with mc.CacheManager(pool) as mgr:
        a, b = mgr.alloc(2)
        mgr.flush_nowait()
        scale[:, a] = 0.25
        drafts["extra"]["conv_scale"][:, b, 1] = 4.0
        mgr.copy_on_write(a, b)
        mgr.flush_nowait()
        assert scale[:, b].tolist() == [0.25, 0.25]
        mgr.commit_draft(b, 2)
        mgr.flush_nowait()
    assert scale[:, b].tolist() == [4.0, 4.0] and scale[:, 0].tolist() == [0.0, 0.0]  # padding untouched


def _bad_adoptions() -> list[tuple[str, dict[str, Any]]]:
    def with_extra(**extra: Any) -> dict[str, Any]:
        t = _engine_tensors()
        return {**t, "extra": {**t["extra"], **extra}}

    def with_drafts(**kw: Any) -> dict[str, Any]:
        d = _engine_tensors(k=2)
        return {**_engine_tensors(), "draft_conv": d["conv"], "draft_temporal": d["temporal"], **kw}

    raw = torch.zeros(90)  # one buffer, a scale carved out of the state's end
    overlapping = {**_engine_tensors(), "temporal": raw[:80].view(2, 5, 2, 4), "extra": {"s": raw[70:80].view(2, 5)}}
    good = _engine_tensors(k=2)["extra"]
    return [
        ("mapping", {**_engine_tensors(), "extra": [torch.zeros(2, 5)]}),
        ("torch.Tensor", with_extra(s=[0.0])),
        ("layers", with_extra(s=torch.zeros(3, 5))),
        ("layers", with_extra(s=torch.zeros(2, 4))),
        (r"\*state", with_extra(s=torch.zeros(2))),
        ("row contiguously", with_extra(s=torch.zeros(2, 5, 3, 2).transpose(2, 3))),
        ("grad", with_extra(s=torch.zeros(2, 5, requires_grad=True))),
        ("identifiers", with_extra(**{"a b": torch.zeros(2, 5)})),
        ("overlap", overlapping),
        ("draft buffers", {**_engine_tensors(), "draft_extra": good}),
        ("draft_extra for each", with_drafts()),
        ("draft_extra for each", with_drafts(draft_extra={"conv_scale": good["conv_scale"]})),
        ("draft_extra", with_drafts(draft_extra={**good, "ssm_scale": torch.zeros(2, 5, 2, 2)})),  # float32
        ("draft_tokens", with_drafts(draft_extra={**good, "ssm_scale": torch.zeros(2, 5, 3, 2, dtype=torch.bfloat16)})),
    ]


@pytest.mark.parametrize(("match", "kwargs"), _bad_adoptions())
def test_from_tensors_refuses_bad_scales_and_changes_nothing(match: str, kwargs: dict[str, Any]) -> None:
    extra = kwargs["extra"]
    tensors = [*kwargs["conv"], kwargs["temporal"], *(extra.values() if isinstance(extra, dict) else extra)]
    tensors = [t.detach() for t in tensors if isinstance(t, torch.Tensor)]
    for t in tensors:
        t.fill_(7)
    before = [t.clone() for t in tensors]
    with pytest.raises(mc.InvalidArgumentError, match=match):
        mc.StatePool.from_tensors(**kwargs)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))


@pytest.mark.parametrize("executor", ["torch", "npu", "reference"])
def test_a_quantised_slot_moves_whole_through_every_event(executor: str) -> None:
    """One readable case of what the property tests check at random: every tensor of a slot, scales included."""
    spec = quant_spec(draft_tokens=2)
    pool, host = mc.StatePool(spec, 6), mc.HostPool(spec, 2)
    with mc.CacheManager(pool, executor=executor, host_pool=host) as mgr:
        a, b, c = mgr.alloc(3)
        mgr.flush_nowait()
        fill_random(pool, 3)
        for d in pool.draft_tensors:
            d.copy_(torch.full(d.shape, 5.0).to(d.dtype))
        oracle = SequentialOracle(pool, host)
        h = mgr.offload(a)
        events: list[Any] = [mc.Offload(a, h), mc.CopyOnWrite(a, b), mc.Clear(a), mc.CommitDraft(c, 2)]
        mgr.submit(*events[1:3])
        mgr.commit_draft(c, 2)
        oracle.apply(events)
        mgr.flush_nowait()
        oracle.assert_matches(pool, host)
        assert float(pool.extra["conv_scale"][0, a]) == 0.0 and float(pool.extra["ssm_scale"][1, c, 0]) == 5.0
        mgr.restore(h, a)
        oracle.apply([mc.Restore(h, a, keep=False)])
        mgr.flush_nowait()
        oracle.assert_matches(pool, host)
        assert torch.equal(pool.extra["conv_scale"][:, a], pool.extra["conv_scale"][:, b])


def test_bind_cache_refuses_a_pool_with_extras() -> None:
    pytest.importorskip("transformers")
    from mambacache.sim._models import HFModel

    model = HFModel("mamba2")
    spec = dataclasses.replace(model.spec, extra_shapes={"ssm_scale": ((), torch.float32)})
    pool = mc.StatePool(spec, 2)
    ctx = model.new_context()
    with pytest.raises(mc.InvalidArgumentError, match=r"without extra tensors.*\['ssm_scale'\]"):
        model.bind(ctx, pool, 1, 0)
    model.bind(ctx, mc.StatePool(model.spec, 2), 1, 0)  # the same cache binds a plain pool


def test_a_plain_spec_is_unchanged() -> None:
    spec = small_spec()
    assert spec.extra_shapes == {} and len(mc.StatePool(spec, 2).tensors) == 3
    assert spec.slot_bytes == 3 * sum(math.prod(s) * d.itemsize for s, d in spec.shapes())
