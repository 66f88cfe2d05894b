"""Events a scheduler submits, and the report of a flush. All frozen values."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Alloc", "Clear", "CommitDraft", "CopyOnWrite", "Event", "Release", "StepReport"]


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
    """``dst`` gets ``src``'s state as of this point of the event order."""

    src: int
    dst: int
    request_id: str | None = None


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


Event = Alloc | Clear | CopyOnWrite | Release | CommitDraft


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one flush did.

    ``events`` counts every event the step took; ``zeroed``, ``copied`` and
    ``committed`` count slots written (by zeroing, by a copy of another slot, by
    a copy from a draft buffer); ``elided`` counts clear, alloc, copy and commit
    events that needed no device work of their own (dead, overwritten,
    self-copies, duplicates, commits of 0 tokens).
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
