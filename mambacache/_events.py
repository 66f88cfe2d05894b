"""Events a scheduler submits, and the report of a flush. All frozen values."""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "Alloc",
    "Clear",
    "CommitDraft",
    "CopyOnWrite",
    "DropHost",
    "Event",
    "Export",
    "Import",
    "Offload",
    "Release",
    "Restore",
    "StepReport",
]


@dataclass(frozen=True, slots=True)
class Alloc:
    """``slot`` was handed to a request; with ``clear`` it reads as zeros after the next flush.

    Produced by ``CacheManager.alloc``; not submittable by hand.
    """

    slot: int
    request_id: str | None = None
    clear: bool = True


@dataclass(frozen=True, slots=True)
class Clear:
    """Zero ``slot`` at this point of the event order."""

    slot: int
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class CopyOnWrite:
    """``dst`` gets ``src``'s state as of this point of the event order.

    ``shift`` (default 0, a whole copy) moves every conv state ``shift`` tokens
    towards the front of its time axis (the last one): ``dst[..., t] =
    src[..., t + shift]`` for ``t < width - shift``, zeros after; the temporal
    state and extra tensors are copied whole. ``0 <= shift <`` the smallest conv
    width (speculative decoding's accepted-token bias, docs/semantics.md).
    ``temporal_src`` (default None: ``src``): the slot the temporal state and
    extra tensors are read from, as of the same point; the conv states still come
    from ``src`` (speculative decoding's align mode reads the two from different
    blocks). Both sources are read before ``dst`` is written, so either may be ``dst``.
    """

    src: int
    dst: int
    request_id: str | None = None
    shift: int = 0
    temporal_src: int | None = None


@dataclass(frozen=True, slots=True)
class Release:
    """``slot`` is free from this point; earlier events still see the old tenant."""

    slot: int
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class CommitDraft:
    """``slot`` gets the state after ``accepted`` draft tokens, read from its draft buffer at this point.

    ``accepted`` is in ``0..draft_tokens``: 0 leaves the slot unchanged; ``j > 0``
    copies draft position ``j - 1`` (the verify forward writes the state after draft
    token ``i`` at index ``i``). Needs a pool with draft buffers.
    """

    slot: int
    accepted: int
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class Offload:
    """Host slot ``host`` gets ``slot``'s state as of this point of the event order.

    Later events on ``slot`` do not reach the host copy. Produced by
    ``CacheManager.offload``, which picks ``host``; not submittable by hand.
    """

    slot: int
    host: int
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class Restore:
    """``slot`` gets host slot ``host``'s state as of this point; ``host`` is freed after it unless ``keep``."""

    host: int
    slot: int
    request_id: str | None = None
    keep: bool = False


@dataclass(frozen=True, slots=True)
class DropHost:
    """Host slot ``host`` is free from this point; earlier events still read its content."""

    host: int


@dataclass(frozen=True, slots=True)
class Export:
    """Staging host slot ``host`` gets ``slot``'s state as of this point, to be sent to another engine.

    Planned as an :class:`Offload`: later events on ``slot`` do not reach what is
    sent. ``to``: the peer's rank it is for (None: any). Produced by
    ``CacheManager.export``; not submittable by hand. ``host`` None: an export
    *in place* (``export(..., in_place=True)``): ``slot`` itself is sent, with no
    staging copy, and the event is never queued or planned (it orders nothing
    the flush does; the hand-off book refuses every write of ``slot`` until the
    peer acknowledges).
    """

    slot: int
    host: int | None
    request_id: str | None = None
    to: int | None = None


@dataclass(frozen=True, slots=True)
class Import:
    """``slot`` gets the state another engine sent for ``request_id``, staged in host slot ``host``, at this point.

    Planned as a :class:`Restore` that frees ``host``: a clear of ``slot``
    queued before it never wipes the imported state, one queued after it does.
    Produced by ``CacheManager.import_into``; not submittable by hand. ``host``
    None: the state arrived in ``slot`` itself (``expect_import``): traced, never
    queued or planned.
    """

    host: int | None
    slot: int
    request_id: str | None = None


class PlanCounts(Protocol):
    """What a report reads of a plan (``_planner.Plan``; named here so that events do not import the planner)."""

    @property
    def events(self) -> int: ...
    @property
    def zeroed(self) -> int: ...
    @property
    def copied(self) -> int: ...
    @property
    def elided(self) -> int: ...
    @property
    def committed(self) -> int: ...
    @property
    def offloaded(self) -> int: ...
    @property
    def restored(self) -> int: ...
    @property
    def stages(self) -> Sized: ...


Event = Alloc | Clear | CopyOnWrite | Release | CommitDraft | Offload | Restore | DropHost | Export | Import


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one flush did.

    ``events`` counts every event the step took; ``zeroed``, ``copied`` and
    ``committed`` count slots written (by zeroing, by a copy of another slot, by
    a copy from a draft buffer); ``offloaded`` and ``restored`` count host slots
    written from the pool and pool slots written from the host; ``elided`` counts clear, alloc, copy and commit
    events that needed no device work of their own (dead, overwritten,
    self-copies, duplicates, commits of 0 tokens, offloads dropped in the same
    step, restores into slots written again).
    """

    step: int
    events: int
    zeroed: int
    copied: int
    elided: int
    bytes_zeroed: int
    bytes_copied: int
    stages: int = 0
    plan_s: float = 0.0
    execute_s: float = 0.0
    resumed_stages: int = 0
    committed: int = 0
    bytes_committed: int = 0
    offloaded: int = 0
    restored: int = 0
    bytes_offloaded: int = 0
    bytes_restored: int = 0

    @classmethod
    def from_plan(
        cls, plan: PlanCounts, step: int, slot_bytes: int, *, plan_s: float = 0.0, execute_s: float = 0.0,
        resumed_stages: int = 0,
    ) -> StepReport:  # fmt: skip
        """The report of step ``step`` that ran ``plan``; each byte count is its slot count x ``slot_bytes``."""
        # Positional, in field order: every flush builds one, and keywords cost a lookup each.
        zeroed, copied, committed = plan.zeroed, plan.copied, plan.committed
        offloaded, restored = plan.offloaded, plan.restored
        return cls(
            step, plan.events, zeroed, copied, plan.elided, zeroed * slot_bytes, copied * slot_bytes,
            len(plan.stages), plan_s, execute_s, resumed_stages, committed, committed * slot_bytes, offloaded,
            restored, offloaded * slot_bytes, restored * slot_bytes,
        )  # fmt: skip
