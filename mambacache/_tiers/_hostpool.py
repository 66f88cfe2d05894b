"""HostPool: slot states kept in host memory (offload, restore, preemption by swap).

Same layout as :class:`StatePool`, one tensor per conv shape, the temporal
tensor and one per extra (``StateSpec.extra_shapes``), on the CPU::

    dim 0: layer   dim 1: host slot (0 = unused)   dims 2..: the per-slot state

so a run of pool slots and a run of host slots copy as one contiguous chunk per
layer, with no gather. Where an accelerator is present the tensors are pinned, so
the copies are enqueued on the flush's stream and nothing waits for them.
"""

from __future__ import annotations

import dataclasses

import torch

from .._core._errors import PoolAllocationError
from .._core._ledger import SlotLedger
from .._core._spec import StateSpec
from .._core._torchutil import executor_view, failure_reason
from .._core._validate import check_bool, check_instance, check_positive_int, host_slot

__all__ = ["HostPool"]


def _accelerator_present() -> bool:
    try:
        return bool(torch.accelerator.is_available())
    except Exception:  # an accelerator backend that fails to load counts as none
        return False


class HostPool:
    """Host copies of pool slots, ``1..num_slots`` (slot 0 is never used).

    Invariants: every host slot is free or held, never both; an offload takes
    the lowest free slot, so offloads of runs of pool slots land in runs of host
    slots and copy in one op per layer; a slot freed by ``drop`` or a
    ``restore`` without ``keep`` goes back to the free list at the next flush,
    and before that is taken only when no other slot is free (a full tier that
    drops its oldest state to take a new one): the planner orders such a step
    exactly, a restore's read of the slot before the offload that rewrites it.

    Draft buffers are never offloaded: a host slot holds a slot's state only.
    As in :class:`StatePool`, ``ledger`` and ``exec_tensors`` belong to the core.
    """

    def __init__(self, spec: StateSpec, num_slots: int, *, pin_memory: bool | None = None) -> None:
        check_instance("spec", spec, StateSpec)
        check_positive_int("num_slots", num_slots)
        check_bool("pin_memory", pin_memory, none=True)
        pin = _accelerator_present() if pin_memory is None else pin_memory
        self.spec = dataclasses.replace(spec, draft_tokens=0) if spec.draft_tokens else spec
        rows = (spec.num_layers, num_slots + 1)
        try:
            conv = [torch.zeros(*rows, *shape, dtype=spec.conv_dtype, pin_memory=pin) for shape in spec.conv_shapes]
            temporal = torch.zeros(*rows, *spec.temporal_shape, dtype=spec.temporal_dtype, pin_memory=pin)
            extra = {
                n: torch.zeros(*rows, *shape, dtype=d, pin_memory=pin) for n, (shape, d) in spec.extra_shapes.items()
            }
        except (RuntimeError, MemoryError) as exc:
            total = self.spec.slot_bytes * (num_slots + 1)
            raise PoolAllocationError(
                f"could not allocate a host pool of {num_slots} slots ({total:,} bytes, pinned={pin}):"
                f" {failure_reason(exc)}"
            ) from None
        self.num_slots = num_slots
        self.pinned = pin
        self.conv: list[torch.Tensor] = conv
        self.temporal: torch.Tensor = temporal
        self.extra: dict[str, torch.Tensor] = extra  # as StatePool.extra: name -> tensor, in spec order
        self.exec_tensors = [executor_view(t) for t in self.tensors]
        self.ledger = SlotLedger(num_slots, "host pool")  # held host slots and their tenants; driven by the manager

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every host tensor: the conv tensors, the temporal tensor, then the extras (as :attr:`StatePool.tensors`)."""
        return [*self.conv, self.temporal, *self.extra.values()]

    @property
    def num_free(self) -> int:
        """Host slots an offload can take now: free ones and those freed by queued events (drop, restore).

        A slot freed by a queued event is taken only when no other is free, so
        ``num_free`` is also how many offloads the queue can take before
        :class:`PoolExhaustedError`; ``num_free + num_held == num_slots``.
        """
        return self.ledger.num_free

    @property
    def num_held(self) -> int:
        """Host slots holding a state (O(1))."""
        return self.num_slots - self.ledger.num_free

    def is_held(self, host: int) -> bool:
        """Whether host slot ``host`` holds a state (at the end of the event queue).

        ``host`` is checked as the manager checks host slots (numpy and 0-d CPU
        tensor ints taken): a bool, a float, a str or a slot outside
        ``1..num_slots`` raises :class:`InvalidSlotError`.
        """
        if type(host) is not int or not 0 < host <= self.num_slots:
            host = host_slot(host, self.num_slots)
        return self.ledger.is_held(host)

    def held(self) -> dict[int, str | None]:
        """Held host slots and the ``request_id`` of the offload that filled each."""
        return self.ledger.held_by()

    def compatible_with(self, spec: StateSpec) -> bool:
        """Whether this pool holds states of ``spec`` (draft buffers aside; extra tensors must match too)."""
        check_instance("spec", spec, StateSpec)
        return dataclasses.replace(spec, draft_tokens=0) == self.spec

    def __repr__(self) -> str:
        return (
            f"HostPool(num_slots={self.num_slots}, num_held={self.num_held}, pinned={self.pinned},"
            f" slot_bytes={self.spec.slot_bytes})"
        )
