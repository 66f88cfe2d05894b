"""``fast_init``: the frozen events, reports, stages and plans keep their dataclass's constructor contract.

Each decorated class is compared with a twin made by ``dataclass(frozen=True, slots=True)`` alone from the
same fields: the same signature, the same object for every argument form (positional, keywords, defaults),
and everything else still the dataclass's (frozen, equality, hash, replace, pickling).
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mambacache._core import _events, _planner
from mambacache._core._events import fast_init

DECORATED = sorted(
    (
        c
        for mod in (_events, _planner)
        for c in vars(mod).values()
        if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == mod.__name__
    ),
    key=lambda c: c.__name__,
)


def _twin(cls: type) -> type:
    """``cls`` as plain ``dataclass(frozen=True, slots=True)`` makes it (its own ``__init__``)."""
    fields = [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(cls.__name__, fields, frozen=True, slots=True)


def test_every_frozen_value_has_it() -> None:
    assert {c.__name__ for c in DECORATED} >= {"Release", "Alloc", "CopyOnWrite", "StepReport", "Plan", "CopyStage"}
    for cls in DECORATED:
        assert "_set0" in cls.__init__.__code__.co_freevars, cls  # the generated __init__, not the dataclass's
        assert str(inspect.signature(cls)) == str(inspect.signature(_twin(cls))), cls
        assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"


@pytest.mark.parametrize("cls", DECORATED, ids=lambda c: c.__name__)
@given(data=st.data())
def test_same_object_as_the_dataclass_init(cls: type, data: st.DataObject) -> None:
    fields = dataclasses.fields(cls)
    values = [data.draw(st.one_of(st.integers(), st.none(), st.text(max_size=3)), label=f.name) for f in fields]
    given_n = data.draw(st.integers(0, len(fields)), label="given")
    required = sum(1 for f in fields if f.default is dataclasses.MISSING)
    given_n = max(given_n, required)
    twin = _twin(cls)
    use_kw = data.draw(st.booleans(), label="keywords")
    args: tuple[Any, ...] = tuple(values[:given_n])
    kwargs: dict[str, Any] = {}
    if use_kw:
        kwargs, args = {f.name: v for f, v in zip(fields, args, strict=False)}, ()
    made, expected = cls(*args, **kwargs), twin(*args, **kwargs)
    assert dataclasses.astuple(made) == dataclasses.astuple(expected)
    assert repr(made).removeprefix(cls.__name__) == repr(expected).removeprefix(cls.__name__)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, fields[0].name, 1)
    assert made == cls(*dataclasses.astuple(made)) and hash(made) == hash(cls(*dataclasses.astuple(made)))
    assert pickle.loads(pickle.dumps(made)) == made
    assert dataclasses.replace(made) == made


def test_missing_and_extra_arguments_raise_like_the_dataclass() -> None:
    with pytest.raises(TypeError):
        _events.Release()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _events.Release(1, None, 2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _events.Release(1, slot=2)  # type: ignore[misc]


def test_refuses_what_it_cannot_build() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class PostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(frozen=True, slots=True)
    class Factory:
        a: list[int] = dataclasses.field(default_factory=list)

    for cls in (NoSlots, PostInit, Factory):
        with pytest.raises(TypeError, match="fast_init"):
            fast_init(cls)


@given(
    counts=st.lists(st.integers(0, 1000), min_size=7, max_size=7),
    stages=st.integers(0, 5),
    step=st.integers(0, 10**6),
    slot_bytes=st.integers(1, 1 << 20),
    times=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    resumed=st.integers(0, 9),
)
def test_report_from_plan_fills_each_field_by_name(
    counts: list[int], stages: int, step: int, slot_bytes: int, times: tuple[float, float], resumed: int
) -> None:
    """``from_plan`` builds positionally (the flush's hot path): each field still gets its own figure."""
    events, zeroed, copied, elided, committed, offloaded, restored = counts
    plan = _planner.Plan(tuple([_planner.RotateStage(())] * stages), *counts)
    report = _events.StepReport.from_plan(
        plan, step, slot_bytes, plan_s=times[0], execute_s=times[1], resumed_stages=resumed
    )
    by_name = {
        "step": step, "events": events, "zeroed": zeroed, "copied": copied, "elided": elided,
        "bytes_zeroed": zeroed * slot_bytes, "bytes_copied": copied * slot_bytes, "stages": stages,
        "plan_s": times[0], "execute_s": times[1], "resumed_stages": resumed, "committed": committed,
        "bytes_committed": committed * slot_bytes, "offloaded": offloaded, "restored": restored,
        "bytes_offloaded": offloaded * slot_bytes, "bytes_restored": restored * slot_bytes,
    }  # fmt: skip
    assert report == _events.StepReport(**by_name)
