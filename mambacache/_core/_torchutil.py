"""Small torch helpers the core shares: device parsing, executor views of odd dtypes, allocation errors."""

from __future__ import annotations

import torch

from ._errors import InvalidArgumentError

__all__ = ["as_device", "executor_view", "failure_reason"]

# Bit-exact integer stand-ins for dtypes that torch has no index kernels for
# (index_fill_, index_copy_): executors see these views, so every stage kind runs.
# All-zero bits are zero in each of them, so zeroing the view zeroes the state.
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def executor_view(t: torch.Tensor) -> torch.Tensor:
    name = str(t.dtype)
    if name.startswith(("torch.float8", "torch.float4", "torch.bits")) or name in (
        "torch.uint16",
        "torch.uint32",
        "torch.uint64",
    ):
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def failure_reason(exc: BaseException) -> str:
    """The first line of what torch said about a failed allocation (its messages run to many lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def as_device(device: object) -> torch.device:
    try:
        dev: torch.device = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        raise InvalidArgumentError(
            f"unknown device {device!r}: give a torch.device or a string such as 'cpu', 'cuda' or 'cuda:1'"
            " ('npu' needs torch_npu)"
        ) from None
    if dev.type not in ("cpu", "meta"):
        try:
            available = bool(torch.get_device_module(dev.type).is_available())
        except Exception:  # a backend module that is missing or fails to load
            available = False
        if not available:
            raise InvalidArgumentError(f"device {dev} is not available on this machine")
    return dev
