"""Events a scheduler submits, and the report of a flush. All frozen values."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sized
from dataclasses import dataclass
from typing import Protocol, TypeVar

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
    "fast_init",
]

_T = TypeVar("_T")


def fast_init(cls: type[_T]) -> type[_T]:
    """Give the frozen ``@dataclass(slots=True)`` ``cls`` an ``__init__`` that sets each field through its slot's
    member descriptor; returns ``cls``, still that frozen dataclass.

    The ``__init__`` that ``dataclass`` writes calls ``object.__setattr__(self, name, value)`` per field,
    which looks the slot up by name each time, and a decode step builds six events, two stages, a plan and a
    report. What this saves, measured against the dataclass's own ``__init__`` (``tools/benchmarks/ab_host.py``,
    30 interleaved rounds, docs/benchmarks.md): an event 0.64 -> 0.41 us, ``StepReport.from_plan`` 2.96 ->
    1.78 us, the bench's decode step 78.6 -> 70.0 us (11 %), its host line 6-13 %. It is written with ``exec``,
    as ``dataclass`` writes its own: a function of the fields' names and nothing else. This one
    has the same signature (names, defaults, annotations) and makes the same object; everything else
    (``__eq__``, ``__hash__``, ``__repr__``, pickling, ``dataclasses.replace``, the frozen ``__setattr__``)
    is the dataclass's own. Only for classes whose fields all go through ``__init__`` with plain defaults and
    that have no ``__post_init__`` (checked here).
    """
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen and "__slots__" in cls.__dict__):  # type: ignore[attr-defined]
        raise TypeError(f"fast_init needs a frozen @dataclass(slots=True), not {cls!r}")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"fast_init: {cls.__name__} has a __post_init__")
    params: list[str] = []
    local: dict[str, object] = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        if not f.init or f.kw_only or f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"fast_init: field {f.name!r} of {cls.__name__} is not a plain positional one")
        # The slot's descriptor: in the class that declared the field (a subclass adding none has an empty __slots__)
        local[f"_set{i}"] = next(c.__dict__[f.name] for c in cls.__mro__ if f.name in c.__dict__).__set__
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            local[f"_default{i}"] = f.default
            params.append(f"{f.name}=_default{i}")
    sets = (
        "".join(f"        _set{i}(self, {f.name})\n" for i, f in enumerate(dataclasses.fields(cls))) or "        pass\n"
    )
    # As dataclasses builds its own: a factory run in the module's globals (annotations resolve there), the
    # setters and defaults its locals; the source is made of the fields' own names only.
    source = f"def _make({', '.join(local)}):\n    def __init__(self, {', '.join(params)}):\n"
    source += f"{sets}    return __init__\n"
    made: dict[str, object] = {}
    exec(source, vars(sys.modules[cls.__module__]), made)
    init = made["_make"](**local)  # type: ignore[operator]
    old = cls.__dict__["__init__"]
    init.__qualname__, init.__module__, init.__doc__ = old.__qualname__, old.__module__, old.__doc__
    init.__annotations__ = dict(old.__annotations__)
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


@fast_init
@dataclass(frozen=True, slots=True)
class Alloc:
    """``slot`` was handed to a request; with ``clear`` it reads as zeros after the next flush.

    Produced by ``CacheManager.alloc``; not submittable by hand.
    """

    slot: int
    request_id: str | None = None
    clear: bool = True


@fast_init
@dataclass(frozen=True, slots=True)
class Clear:
    """Zero ``slot`` at this point of the event order."""

    slot: int
    request_id: str | None = None


@fast_init
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


@fast_init
@dataclass(frozen=True, slots=True)
class Release:
    """``slot`` is free from this point; earlier events still see the old tenant."""

    slot: int
    request_id: str | None = None


@fast_init
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


@fast_init
@dataclass(frozen=True, slots=True)
class Offload:
    """Host slot ``host`` gets ``slot``'s state as of this point of the event order.

    Later events on ``slot`` do not reach the host copy. Produced by
    ``CacheManager.offload``, which picks ``host``; not submittable by hand.
    """

    slot: int
    host: int
    request_id: str | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class Restore:
    """``slot`` gets host slot ``host``'s state as of this point; ``host`` is freed after it unless ``keep``."""

    host: int
    slot: int
    request_id: str | None = None
    keep: bool = False


@fast_init
@dataclass(frozen=True, slots=True)
class DropHost:
    """Host slot ``host`` is free from this point; earlier events still read its content."""

    host: int


@fast_init
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


@fast_init
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


@fast_init
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
