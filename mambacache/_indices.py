"""StateIndices: a persistent request -> slot index tensor for kernels (CUDA-graph safe).

Kernels of hybrid models read each running request's slot from an int32 tensor
(vLLM's ``state_indices_tensor``, SGLang's ``mamba_cache_indices``). A captured
CUDA graph bakes that tensor's address in, so it must never be reallocated: the
engine writes new contents into the same buffer before each replay. Layout::

    tensor: [capacity] int32, on the device, fixed address
    +------+------+-----+--------+---+---+-----+---+
    | s_0  | s_1  | ... | s_n-1  | 0 | 0 | ... | 0 |   <- padding slot 0 after the n live entries
    +------+------+-----+--------+---+---+-----+---+

``update`` stages the host values in a pinned buffer and copies it with one
non-blocking copy on the current stream: no host sync, no reallocation. A staging
buffer is reused only once the event recorded after its copy has completed
(checked with ``query()``, which never waits); until then a new one is taken.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from ._errors import InvalidArgumentError, InvalidSlotError
from ._torchutil import as_device
from ._validate import slot_list

__all__ = ["StateIndices"]


class StateIndices:
    """A fixed-address ``[capacity]`` int32 index tensor, rewritten in place by :meth:`update`.

    Invariants: ``tensor`` is allocated once and never replaced; after
    ``update(slots)`` (in stream order) ``tensor[:len(slots)]`` holds ``slots`` and
    the rest holds 0, the padding slot; ``size`` is ``len(slots)``.
    """

    def __init__(self, capacity: int, device: str | torch.device = "cpu", *, num_slots: int | None = None) -> None:
        if type(capacity) is not int or capacity < 1:
            raise InvalidArgumentError(f"capacity must be a positive int, got {capacity!r}")
        if num_slots is not None and (type(num_slots) is not int or num_slots < 1):
            raise InvalidArgumentError(f"num_slots must be a positive int or None, got {num_slots!r}")
        self.device = as_device(device)
        self.capacity = capacity
        self.num_slots = num_slots
        self.tensor = torch.zeros(capacity, dtype=torch.int32, device=self.device)
        self.size = 0
        self._pinned = self.device.type != "cpu"
        self._staging: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()

    def _stage(self) -> torch.Tensor:
        """A host buffer no copy in flight reads: the oldest one whose copy has completed, else a new one."""
        if self._staging and self._staging[0][1].query():
            buf, _ = self._staging.popleft()
            return buf
        buf = torch.zeros(self.capacity, dtype=torch.int32)
        return buf.pin_memory() if self._pinned else buf

    def update(self, slots: Any) -> torch.Tensor:
        """Write ``slots`` (then padding 0s) into :attr:`tensor`; returns ``tensor[:len(slots)]``.

        ``slots``: a list, numpy array or 1-D CPU integer tensor (checked: ints in
        ``0..num_slots``, 0 being the padding slot), or a 1-D integer tensor already
        on this device (copied device to device, unchecked: checking would sync).
        """
        if isinstance(slots, torch.Tensor) and slots.device == self.device and self.device.type != "cpu":
            if slots.ndim != 1 or slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
                raise InvalidSlotError(f"slots must be a 1-D integer tensor, got {slots.dtype} {tuple(slots.shape)}")
            n = slots.shape[0]
            self._check_len(n)
            self.tensor[:n].copy_(slots)
            self.tensor[n:].zero_()
            self.size = n
            return self.tensor[:n]
        limit = self.num_slots if self.num_slots is not None else 2**31 - 1
        values = slot_list(slots, limit, allow_padding=True)
        n = len(values)
        self._check_len(n)
        host = self._stage() if self._pinned else self.tensor  # on CPU, write in place
        if n:
            host[:n] = torch.tensor(values, dtype=torch.int32)
        host[n:] = 0
        if self._pinned:
            self.tensor.copy_(host, non_blocking=True)
            event = torch.Event(device=self.device)
            event.record()
            self._staging.append((host, event))
        self.size = n
        return self.tensor[:n]

    def _check_len(self, n: int) -> None:
        if n > self.capacity:
            raise InvalidArgumentError(f"{n} slots do not fit a StateIndices of capacity {self.capacity}")

    def __repr__(self) -> str:
        return f"StateIndices(capacity={self.capacity}, size={self.size}, device={self.device})"
