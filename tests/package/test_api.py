from __future__ import annotations

import inspect

import pytest
import torch

import mambacache as mc


def test_all_matches_public_names() -> None:
    public = {n for n in dir(mc) if not n.startswith("_") and not inspect.ismodule(getattr(mc, n))}
    assert set(mc.__all__) == public
    for name in mc.__all__:
        assert getattr(mc, name).__module__.startswith("mambacache")


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (mc.InvalidSlotError, ValueError),
        (mc.InvalidArgumentError, ValueError),
        (mc.InvalidEventError, TypeError),
        (mc.SlotStateError, RuntimeError),
        (mc.PoolExhaustedError, RuntimeError),
        (mc.ManagerClosedError, RuntimeError),
        (mc.UnknownExecutorError, LookupError),
        (mc.ExecutorError, RuntimeError),
        (mc.DistributedError, RuntimeError),
        (mc.StaleHitError, LookupError),
    ],
)
def test_error_hierarchy(error: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(error, mc.MambaCacheError)
    assert issubclass(error, builtin)


def test_spec_and_pool_layout() -> None:
    spec = mc.StateSpec(num_layers=4, conv_shapes=[(256, 3)], temporal_shape=(8, 64, 64))
    assert spec.conv_dtype == torch.bfloat16 and spec.temporal_dtype == torch.float32
    assert spec.slot_bytes == 4 * (256 * 3 * 2 + 8 * 64 * 64 * 4)
    pool = mc.StatePool(spec, num_slots=5)
    assert [tuple(t.shape) for t in pool.conv] == [(4, 6, 256, 3)]
    assert tuple(pool.temporal.shape) == (4, 6, 8, 64, 64)
    assert pool.num_slots == 5 and pool.num_free == 5
    per_slot = sum(t[:, 0].numel() * t.element_size() for t in pool.tensors)
    assert per_slot == spec.slot_bytes


def test_pool_from_memory_budget() -> None:
    spec = mc.StateSpec(num_layers=2, conv_shapes=[(4, 2)], temporal_shape=(8,))
    pool = mc.StatePool.from_memory_budget(spec, spec.slot_bytes * 10 + 7)
    assert pool.num_slots == 9  # the padding slot takes one
    total = sum(t.numel() * t.element_size() for t in pool.tensors)
    assert total <= spec.slot_bytes * 10 + 7
    with pytest.raises(mc.InvalidArgumentError):
        mc.StatePool.from_memory_budget(spec, spec.slot_bytes)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0},
        {"num_layers": 2.0},
        {"conv_shapes": [(0, 3)]},
        {"conv_shapes": "abc"},
        {"temporal_shape": ()},
        {"temporal_shape": (2, -1)},
        {"conv_dtype": "bf16"},
    ],
)
def test_bad_spec(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {"num_layers": 2, "conv_shapes": [(4, 2)], "temporal_shape": (8,)}
    base.update(kwargs)
    with pytest.raises(mc.InvalidArgumentError):
        mc.StateSpec(**base)  # type: ignore[arg-type]


def test_executor_resolution() -> None:
    spec = mc.StateSpec(num_layers=1, conv_shapes=[], temporal_shape=(4,))
    pool = mc.StatePool(spec, 2)
    assert mc.CacheManager(pool).executor.name == "torch"
    assert mc.CacheManager(pool, executor="npu").executor.name == "npu"
    assert mc.CacheManager(pool, executor="reference").executor.name == "reference"
    with pytest.raises(mc.UnknownExecutorError, match="known"):
        mc.CacheManager(pool, executor="tpu")
    with pytest.raises(mc.UnknownExecutorError):
        mc.CacheManager(pool, executor=42)
    known = mc.known_executors()
    assert known["torch"] == ["cpu", "cuda"] and known["npu"] == ["npu"]


def test_unknown_device_type_lists_known_keys() -> None:
    from mambacache._executors import resolve_executor

    with pytest.raises(mc.UnknownExecutorError, match=r"'cpu', 'cuda', 'npu'"):
        resolve_executor(None, torch.device("meta"), 1)


def test_register_executor_for_a_new_device_type() -> None:
    from mambacache._executors import _device_defaults, _factories, resolve_executor
    from mambacache._executors._reference import ReferenceExecutor

    try:
        mc.register_executor("mine", ReferenceExecutor, device_types=("meta",))
        assert resolve_executor(None, torch.device("meta"), 1).name == "reference"
    finally:
        _factories.pop("mine")
        _device_defaults.pop("meta")


def test_npu_executor_does_not_import_torch_npu_on_cpu() -> None:
    import sys

    spec = mc.StateSpec(num_layers=1, conv_shapes=[], temporal_shape=(4,))
    mc.CacheManager(mc.StatePool(spec, 2), executor="npu")
    assert "torch_npu" not in sys.modules


def test_ci_runs_exactly_the_readme_test_command() -> None:
    from pathlib import Path

    root = Path(__file__).parents[2]
    readme = (root / "README.md").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in readme.split("```bash\n")[1:3]]
    install_and_run, test = blocks
    assert "mambacache simulate" in install_and_run
    assert "pytest" in test
    ci = [line.strip() for line in (root / ".ci" / "run").read_text().splitlines()]
    assert test in ci


def test_every_public_name_and_method_has_a_docstring() -> None:
    import mambacache.audit
    import mambacache.hf
    import mambacache.tracing

    missing = []
    for mod in (mc, mambacache.tracing, mambacache.audit, mambacache.hf):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if not inspect.getdoc(obj):
                missing.append(f"{mod.__name__}.{name}")
            if inspect.isclass(obj) and obj.__module__.startswith("mambacache"):
                for attr, value in vars(obj).items():
                    func = getattr(value, "__func__", value)
                    if attr.startswith("_") or not (isinstance(value, property) or inspect.isfunction(func)):
                        continue
                    if not (value.__doc__ if isinstance(value, property) else func.__doc__):
                        missing.append(f"{name}.{attr}")
    assert missing == []


def test_public_submodules_are_attributes() -> None:
    assert mc.tracing.configure and mc.audit.OpAudit and mc.hf.bind_cache
    assert {"tracing", "audit", "hf", "sim", "bench"} <= set(dir(mc))
    with pytest.raises(AttributeError):
        _ = mc.no_such_thing  # type: ignore[attr-defined]
