"""Op audit: what a block of torch code allocates, feeds and syncs.

``OpAudit`` is a ``TorchDispatchMode`` that watches every aten op in a block and
reports, in an :class:`AuditReport`:

* temporaries: tensors an op allocates (outputs that share no storage with any
  input), with the live peak. Integer tensors (indices) are counted apart from
  state-dtype ones, so "no temporary of state data" can be asserted exactly;
* non-contiguous inputs: bytes of tensor arguments that are not contiguous —
  what an NPU op adapter copies into a contiguous temporary first (an
  ``expand``-ed zero shows up here, on CPU too);
* host syncs: ops that read device data back to the host (``.item()``,
  ``nonzero``, data-dependent shapes, device-to-host copies).

It runs on CPU, so the device-memory behaviour of an executor can be tested
without the device.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["SYNC_OPS", "AuditReport", "OpAudit"]

_aten = torch.ops.aten
SYNC_OPS = frozenset(
    {
        _aten._local_scalar_dense.default,
        _aten.is_nonzero.default,
        _aten.equal.default,
        _aten.nonzero.default,
        _aten.nonzero_static.default,
        _aten.masked_select.default,
        _aten._unique2.default,
        _aten.unique_consecutive.default,
        _aten.repeat_interleave.Tensor,
    }
)


@dataclass(frozen=True, slots=True)
class AuditReport:
    """Figures for one audited block. Byte counts are storage bytes."""

    ops: int
    op_counts: dict[str, int] = field(hash=False)
    peak_temp_bytes: int
    """Live peak of temporaries of every dtype."""
    peak_state_temp_bytes: int
    """Live peak of floating-point (state) temporaries, index tensors excluded."""
    max_temp_bytes: int
    """The largest single temporary."""
    total_temp_bytes: int
    noncontiguous_input_bytes: int
    noncontiguous_ops: tuple[str, ...]
    sync_ops: tuple[str, ...]


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


class OpAudit(TorchDispatchMode):  # type: ignore[misc,no-untyped-call]
    """Use as ``with OpAudit() as audit: ...``, then ``audit.report()``."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._ops: Counter[str] = Counter()
        self._live = 0
        self._live_state = 0
        self._peak = 0
        self._peak_state = 0
        self._max = 0
        self._total = 0
        self._noncontig = 0
        self._noncontig_ops: list[str] = []
        self._syncs: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        self._ops[name] += 1
        inputs = _tensors((args, kwargs))
        for t in inputs:
            if t.dim() > 0 and not t.is_contiguous():
                self._noncontig += t.numel() * t.element_size()
                self._noncontig_ops.append(name)
        if func in SYNC_OPS:
            self._syncs.append(name)
        elif func in (_aten._to_copy.default, _aten.copy_.default):
            self._check_d2h(name, func, args, kwargs)
        out = func(*args, **kwargs)
        input_ptrs = {t.untyped_storage().data_ptr() for t in inputs}
        seen: set[int] = set()
        for t in _tensors(out):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in input_ptrs or ptr in seen or storage.nbytes() == 0:
                continue  # a view, an in-place or out= result: not new memory
            seen.add(ptr)
            self._allocated(t, storage.nbytes())
        return out

    def _check_d2h(self, name: str, func: Any, args: Any, kwargs: Any) -> None:
        if func is _aten.copy_.default:
            dst, src = args[0], args[1]
            if src.device.type != "cpu" and dst.device.type == "cpu":
                self._syncs.append(name)
        else:
            device = kwargs.get("device")
            if args[0].device.type != "cpu" and device is not None and torch.device(device).type == "cpu":
                self._syncs.append(name)

    def _allocated(self, t: torch.Tensor, nbytes: int) -> None:
        state = t.is_floating_point() or t.is_complex()
        self._total += nbytes
        self._max = max(self._max, nbytes)
        self._live += nbytes
        self._peak = max(self._peak, self._live)
        if state:
            self._live_state += nbytes
            self._peak_state = max(self._peak_state, self._live_state)
        weakref.finalize(t, self._freed, nbytes, state)

    def _freed(self, nbytes: int, state: bool) -> None:
        self._live -= nbytes
        if state:
            self._live_state -= nbytes

    def report(self) -> AuditReport:
        """The figures of the block audited so far (call it after the ``with`` block)."""
        return AuditReport(
            ops=sum(self._ops.values()),
            op_counts=dict(self._ops),
            peak_temp_bytes=self._peak,
            peak_state_temp_bytes=self._peak_state,
            max_temp_bytes=self._max,
            total_temp_bytes=self._total,
            noncontiguous_input_bytes=self._noncontig,
            noncontiguous_ops=tuple(self._noncontig_ops),
            sync_ops=tuple(self._syncs),
        )
