"""Executor registry: by name, and a default name per ``torch.device.type``.

Built-in executors are imported lazily, the first time they are asked for, as
anyio loads its backends: asking for "npu" never imports anything CUDA, and
nothing here imports torch_npu.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from .._errors import UnknownExecutorError, UnsupportedDtypeError
from .._planner import CommitStage, CopyStage, RotateStage, Stage, ZeroStage, copy_runs, zero_runs
from ._base import Executor

__all__ = [
    "Executor",
    "ExecutorFactory",
    "check_executor",
    "known_executors",
    "register_executor",
    "resolve_executor",
]

ExecutorFactory = Callable[[int], Executor]
"""Called with ``copy_workspace_bytes``; returns an executor."""

_factories: dict[str, ExecutorFactory | str] = {
    "torch": "mambacache._executors._torch:TorchExecutor",
    "npu": "mambacache._executors._npu:NpuExecutor",
    "reference": "mambacache._executors._reference:ReferenceExecutor",
}
_device_defaults: dict[str, str] = {"cpu": "torch", "cuda": "torch", "npu": "npu"}


def register_executor(name: str, factory: ExecutorFactory, *, device_types: tuple[str, ...] = ()) -> None:
    """Register ``factory`` under ``name``, and as the default for ``device_types``."""
    _factories[name] = factory
    for device_type in device_types:
        _device_defaults[device_type] = name


def known_executors() -> dict[str, list[str]]:
    """Executor names, and the device types that default to each."""
    return {name: sorted(d for d, n in _device_defaults.items() if n == name) for name in sorted(_factories)}


def _factory(name: str) -> ExecutorFactory:
    factory = _factories[name]
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        _factories[name] = factory
    return factory


def resolve_executor(executor: Any, device: torch.device, copy_workspace_bytes: int) -> Executor:
    """None: the default for ``device.type``; a name: that executor; else the object as given."""
    if executor is None:
        name = _device_defaults.get(device.type)
        if name is None:
            raise UnknownExecutorError(
                f"no executor for device type {device.type!r}; known device types:"
                f" {sorted(_device_defaults)}; pass executor=NAME (one of {sorted(_factories)})"
                " or register one with mambacache.register_executor"
            )
        return _factory(name)(copy_workspace_bytes)
    if isinstance(executor, str):
        if executor not in _factories:
            raise UnknownExecutorError(f"unknown executor {executor!r}; known: {sorted(_factories)}")
        return _factory(executor)(copy_workspace_bytes)
    if isinstance(executor, Executor):
        return executor
    raise UnknownExecutorError(
        f"executor must be None, a name in {sorted(_factories)}, or an object with"
        f" `name` and `execute(stage, tensor)`; got {executor!r}"
    )


def _probe_stages() -> list[Stage]:
    # One of each stage kind, few runs and many, so that every code path an
    # executor picks by run count is taken: 11 slots + padding.
    def zero(*slots: int) -> ZeroStage:
        return ZeroStage(slots, zero_runs(slots))

    def copy(*pairs: tuple[int, int]) -> CopyStage:
        return CopyStage(pairs, copy_runs(pairs))

    return [
        zero(1, 2),
        zero(1, 3, 5, 7, 9, 11),
        copy((1, 2)),
        copy((1, 2), (3, 4), (5, 6), (7, 8), (9, 10)),
        RotateStage(((1, 2), (3, 4, 5))),
    ]


def check_executor(executor: Executor, tensors: list[torch.Tensor], drafts: list[torch.Tensor] | None = None) -> None:
    """Run every stage kind once on a small scratch tensor of each dtype in ``tensors``.

    Raises :class:`UnsupportedDtypeError` naming the dtype and executor when one
    fails, so a pool that could zero and copy but never swap is refused when the
    manager is made, not on the first swap with work piling up behind it.
    """
    seen: set[tuple[torch.dtype, tuple[int, ...]]] = set()
    for i, t in enumerate(tensors):
        key = (t.dtype, tuple(t.shape[2:3]))
        if key in seen:
            continue
        seen.add(key)
        # Keep the state's leading dim (rows), so a workspace bound is probed on real row sizes.
        scratch = torch.zeros((2, 12, *t.shape[2:3]), dtype=t.dtype, device=t.device)
        stages: list[tuple[Stage, torch.Tensor | None]] = [(stage, None) for stage in _probe_stages()]
        if drafts:
            k = drafts[i].shape[2]
            draft = torch.zeros((2, 12, k, *t.shape[2:3]), dtype=t.dtype, device=t.device)
            stages.append((CommitStage(((1, 0, 2), (3, k - 1, 4), (5, 0, 5))), draft))
        for stage, draft_scratch in stages:
            try:
                if draft_scratch is None:
                    executor.execute(stage, scratch)
                else:
                    executor.execute(stage, scratch, draft_scratch)  # type: ignore[call-arg]
            except Exception as exc:
                raise UnsupportedDtypeError(
                    f"executor {executor.name!r} cannot run a {type(stage).__name__} on {t.dtype} tensors on"
                    f" {t.device}: {exc}"
                ) from exc
