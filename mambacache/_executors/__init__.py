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

from .._core._errors import UnknownExecutorError
from ._base import Executor, as_executor

__all__ = [
    "Executor",
    "ExecutorFactory",
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
    adapted = as_executor(executor)
    if adapted is not None:
        return adapted
    raise UnknownExecutorError(
        f"executor must be None, a name in {sorted(_factories)}, or an object with"
        f" `name` and `execute(stage, tensor)`; got {executor!r}"
    )
