"""StateIndices: a persistent request -> slot index tensor for kernels (CUDA-graph safe).

Kernels of hybrid models read each running request's slot from an int32 tensor
(vLLM's ``state_indices_tensor``, SGLang's ``mamba_cache_indices``). A captured
CUDA graph bakes that tensor's address in, so it must never be reallocated: the
engine writes new contents into the same buffer before each replay. Layout::

    tensor: [capacity] int32, on the device, fixed address
    +------+------+-----+--------+---------+---------+-----+
    | s_0  | s_1  | ... | s_n-1  | p[n%k]  | p[n+1%k]| ... |   <- padding after the n live entries
    +------+------+-----+--------+---------+---------+-----+

Position ``i >= n`` holds pad slot ``p[i % k]`` of the ``k`` padding slots (just
slot 0 by default; ``StatePool(..., pad_slots=k)`` makes more): up to ``k``
padded positions in a row get distinct dummy rows, so a padded forward that
writes every position never writes one row twice, nor a live slot.

``update`` stages the host values in a pinned buffer and copies it with one
non-blocking copy on the current stream: no host sync, no reallocation. A staging
buffer is reused only once the event recorded after its copy has completed
(checked with ``query()``, which never waits); until then a new one is taken.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._errors import InvalidArgumentError, InvalidSlotError
from ._torchutil import as_device
from ._validate import slot_list

if TYPE_CHECKING:
    from ._pool import StatePool

__all__ = ["StateIndices"]

MAX_CAPACITY = 2**24
"""The most positions a :class:`StateIndices` takes unless its pool has more slots: far beyond any batch, and four
buffers of 64 MiB; more is a mistake (a slot count for a token count, say), refused before anything is built."""


class StateIndices:
    """A fixed-address ``[capacity]`` int32 index tensor, rewritten in place by :meth:`update`.

    Invariants: ``tensor`` is allocated once and never replaced; after
    ``update(slots)`` (in stream order) ``tensor[:len(slots)]`` holds ``slots`` and
    position ``i`` of the rest holds ``pad_slots[i % len(pad_slots)]``; ``size``
    is ``len(slots)``. Slots given to ``update`` are live slots (``1..num_slots``)
    or padding slots.
    """

    def __init__(
        self,
        capacity: int,
        device: str | torch.device = "cpu",
        *,
        num_slots: int | None = None,
        pad_slots: Sequence[int] = (0,),
    ) -> None:
        if type(capacity) is not int or capacity < 1:
            raise InvalidArgumentError(f"capacity must be a positive int, got {capacity!r}")
        if num_slots is not None and (type(num_slots) is not int or num_slots < 1):
            raise InvalidArgumentError(f"num_slots must be a positive int or None, got {num_slots!r}")
        top = max(MAX_CAPACITY, num_slots or 0)
        if capacity > top:
            raise InvalidArgumentError(
                f"capacity {capacity} is more positions than any batch holds: at most {top} (2**24, or the pool's"
                " slots when it has more); nothing was allocated"
            )
        pads = _pads(pad_slots, num_slots)
        self.device = as_device(device)
        self.capacity = capacity
        self.num_slots = num_slots
        self.pad_slots = pads
        self._extra_pads = frozenset(p for p in pads if num_slots is not None and p > num_slots)
        self._limit = max(num_slots if num_slots is not None else 2**31 - 1, *pads)
        # The padding of every position, built once (by torch: no per-position Python object): an update copies its
        # tail, on the device too (no sync).
        reps = -(-capacity // len(pads))
        pattern = torch.tensor(pads, dtype=torch.int32).repeat(reps)[:capacity].clone()
        self._pattern = pattern
        self._pattern_dev = pattern.to(self.device)
        self.tensor = self._pattern_dev.clone()
        self.size = 0
        # Pinned staging and a completion event need an accelerator's stream; "meta" has neither.
        self._pinned = self.device.type not in ("cpu", "meta")
        self._staging: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()

    @classmethod
    def for_pool(cls, pool: StatePool, capacity: int) -> StateIndices:
        """An index tensor on ``pool``'s device, checked against its slots, padded with its padding slots."""
        return cls(capacity, pool.device, num_slots=pool.num_slots, pad_slots=pool.pad_ids)

    def _stage(self) -> torch.Tensor:
        """A host buffer no copy in flight reads: the oldest one whose copy has completed, else a new one."""
        if self._staging and self._staging[0][1].query():
            buf, _ = self._staging.popleft()
            return buf
        buf = torch.zeros(self.capacity, dtype=torch.int32)
        return buf.pin_memory() if self._pinned else buf

    def update(self, slots: Any) -> torch.Tensor:
        """Write ``slots`` (then the padding) into :attr:`tensor`; returns ``tensor[:len(slots)]``.

        ``slots``: a list, numpy array or 1-D CPU integer tensor (checked: ints in
        ``1..num_slots`` or padding slots), or a 1-D integer tensor already
        on this device (copied device to device, unchecked: checking would sync).
        Runs under inference mode whatever the caller's, as a flush's stages do:
        the tensor, or a staging buffer kept from an earlier update, may have
        been made under it (an inference tensor, refusing in-place writes outside).
        """
        if not torch.is_inference_mode_enabled():
            with torch._C._InferenceMode(True):
                return self._update(slots)
        return self._update(slots)

    def _update(self, slots: Any) -> torch.Tensor:
        if isinstance(slots, torch.Tensor) and slots.device == self.device and self.device.type != "cpu":
            if slots.ndim != 1 or slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
                raise InvalidSlotError(f"slots must be a 1-D integer tensor, got {slots.dtype} {tuple(slots.shape)}")
            n = slots.shape[0]
            self._check_len(n)
            self.tensor[:n].copy_(slots)
            self.tensor[n:].copy_(self._pattern_dev[n:])
            self.size = n
            return self.tensor[:n]
        values = slot_list(slots, self._limit, allow_padding=True)
        n = len(values)
        self._check_len(n)
        if self._limit != self.num_slots and self.num_slots is not None:
            stray = [v for v in values if v > self.num_slots and v not in self._extra_pads]
            if stray:
                raise InvalidSlotError(f"slot {stray[0]} is out of range 1..{self.num_slots} and not a padding slot")
        on_cpu = self.device.type == "cpu"
        # On CPU, write in place; on an accelerator, through a pinned buffer no copy in flight reads.
        host = self.tensor if on_cpu else self._stage() if self._pinned else self._pattern.clone()
        if n:
            host[:n] = torch.tensor(values, dtype=torch.int32)
        host[n:] = self._pattern[n:]
        if not on_cpu:
            self.tensor.copy_(host, non_blocking=self._pinned)
        if self._pinned:
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


def _pads(pad_slots: Any, num_slots: int | None) -> tuple[int, ...]:
    """``pad_slots`` as a non-empty tuple of distinct slot ids, none of them a live slot."""
    if isinstance(pad_slots, (str, bytes)) or not isinstance(pad_slots, Sequence):
        raise InvalidArgumentError(f"pad_slots must be a sequence of slot ids, got {pad_slots!r}")
    pads = tuple(pad_slots)
    if not pads or any(type(p) is not int or p < 0 or p > 2**31 - 1 for p in pads) or len(set(pads)) != len(pads):
        raise InvalidArgumentError(f"pad_slots must be distinct non-negative int32 slot ids, got {pad_slots!r}")
    if num_slots is not None and any(0 < p <= num_slots for p in pads):
        raise InvalidArgumentError(f"pad_slots {pads} include a live slot of 1..{num_slots}")
    return pads
