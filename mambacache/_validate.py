"""Argument checks shared by every submit path: slots from real schedulers, request ids, events.

Engines hold slot ids as Python ints, numpy integers, numpy arrays and CPU
tensors; all are accepted (anything ``operator.index`` takes), bool and float
never, and a device tensor is refused rather than read, since reading it would
wait for the device.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence, Set, ValuesView
from typing import Any

import torch

from ._errors import InvalidArgumentError, InvalidEventError, InvalidSlotError
from ._events import Alloc, Clear, CommitDraft, CopyOnWrite, DropHost, Offload, Release, Restore

__all__ = ["as_slot", "check_request_id", "check_shift", "count_list", "normalised", "slot_list"]


def as_slot(x: Any, num_slots: int, allow_padding: bool = False) -> int:
    """``x`` as a slot: anything ``operator.index`` takes (numpy ints, 0-d CPU int tensors), not bool or float."""
    if type(x) is not int:
        if isinstance(x, bool) or (type(x).__module__ == "numpy" and "bool" in type(x).__name__):
            raise InvalidSlotError(f"slot must be an int, got bool {x!r}")
        if isinstance(x, torch.Tensor):
            x = int(_host_ints(x, 0, "slot"))
        else:
            try:
                x = operator.index(x)
            except TypeError:
                raise InvalidSlotError(f"slot must be an int, got {type(x).__name__} {x!r}") from None
    if not (0 if allow_padding else 1) <= x <= num_slots:
        raise InvalidSlotError(
            f"slot {x} is out of range 1..{num_slots}" + (" (0 is the padding slot)" if x == 0 else "")
        )
    return x  # type: ignore[no-any-return]


def _host_ints(
    t: torch.Tensor, ndim: int, what: str, error: type[InvalidArgumentError] = InvalidSlotError
) -> torch.Tensor:
    """``t`` if it is an integer tensor of ``ndim`` dims on the host; reading a device tensor would sync."""
    if t.device.type != "cpu":
        raise error(f"{what}: a {t.device.type} tensor; reading it would wait for the device, pass host data")
    if t.ndim != ndim or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise error(f"{what} must be a {ndim}-D integer tensor, got {t.dtype} {tuple(t.shape)}")
    return t


def slot_list(slots: Any, num_slots: int, allow_padding: bool = False) -> list[int]:
    """A list, tuple, numpy array or 1-D CPU integer tensor of slots as validated ints."""
    values = _int_values(slots, "slots", InvalidSlotError)
    low = 0 if allow_padding else 1
    for i, s in enumerate(values):
        if type(s) is not int or not low <= s <= num_slots:
            values[i] = as_slot(s, num_slots, allow_padding)
    return values


def count_list(counts: Any, n: int, what: str) -> list[int]:
    """``counts`` as ``n`` ints: one int (numpy int, 0-d CPU tensor) for all, or ``n`` of them in any form
    :func:`slot_list` takes. Ranges are the caller's to check; bool and float are refused."""
    t = type(counts)
    if t is int:
        return [counts] * n
    if t is list or t is tuple:  # the common forms first: the checks below cost a microsecond
        values = list(counts)
    elif getattr(counts, "ndim", None) == 0 or not (t.__module__ == "numpy" or isinstance(counts, Iterable)):
        return [_count(counts, what)] * n
    else:
        values = _int_values(counts, what, InvalidArgumentError)
    if len(values) != n:
        raise InvalidArgumentError(f"{what}: {len(values)} values for {n} slots")
    for i, c in enumerate(values):
        if type(c) is not int:
            values[i] = _count(c, what)
    return values


def _count(x: Any, what: str) -> int:
    if isinstance(x, torch.Tensor):
        x = _host_ints(x, 0, what, InvalidArgumentError)
    try:
        if isinstance(x, (bool, float)) or (type(x).__module__ == "numpy" and "bool" in type(x).__name__):
            raise TypeError
        return operator.index(x)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an int, got {x!r}") from None


def _int_values(values: Any, what: str, error: type[InvalidArgumentError]) -> list[Any]:
    """``values`` (a list, tuple, numpy array or 1-D CPU integer tensor) as a list; elements unchecked.

    Unordered containers (a dict or any mapping, a set, a frozenset, a dict's
    keys, values or items) are refused: slot ``i`` pairs with position ``i`` of
    the other arguments and of the kernels' index tensor, so an order that is
    an accident of hashing or insertion is no order.
    """
    if type(values) is list:
        return values[:]
    if type(values) is tuple:
        return list(values)
    if isinstance(values, torch.Tensor):
        return _host_ints(values, 1, what, error).tolist()  # type: ignore[no-any-return]
    if type(values).__module__ == "numpy" and hasattr(values, "dtype"):
        if getattr(values, "ndim", 1) != 1 or values.dtype.kind not in "iu":
            raise error(f"{what} must be a 1-D integer array, got {values.dtype} of shape {values.shape}")
        return values.tolist()  # type: ignore[no-any-return]
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise error(f"{what} must be a list, numpy array or 1-D CPU int tensor, got {type(values).__name__}")
    if isinstance(values, (Mapping, Set, ValuesView)):
        raise error(
            f"{what} must be ordered (a list, tuple, numpy array or 1-D CPU int tensor), got a {type(values).__name__}"
            f"{': pass list(...) of its keys' if isinstance(values, Mapping) else ''}"
        )
    return list(values)


def check_shift(shift: Any, convs: Sequence[Sequence[int]]) -> int:
    """``shift`` as an int in ``0 ..`` the smallest conv width (the last axis of the conv shapes ``convs``)
    minus 1."""
    width = min((c[-1] for c in convs), default=1)
    if type(shift) is not int or not 0 <= shift < width:
        raise InvalidArgumentError(
            f"shift must be an int in 0..{width - 1} (below the smallest conv width, {width}), got {shift!r}"
            if convs
            else f"shift must be 0 on a pool without conv states, got {shift!r}"
        )
    return shift


def normalised(events: Iterable[Any], n: int, convs: Sequence[Sequence[int]] = ()) -> list[Any]:
    """Events with int slots (converted from numpy or tensor scalars), request ids and copy shifts checked
    (``convs``: the pool's conv state shapes, whose smallest width bounds a shift)."""
    out: list[Any] = []
    for ev in events:
        t = type(ev)
        if t is CopyOnWrite:
            a, b, k, ts = ev.src, ev.dst, ev.shift, ev.temporal_src
            if (
                type(a) is not int or type(b) is not int or not 0 < a <= n or not 0 < b <= n or k
                or type(k) is not int or ts is not None
            ):  # fmt: skip
                a, b, k = as_slot(a, n), as_slot(b, n), check_shift(k, convs)
                ts = None if ts is None else as_slot(ts, n)
                # A temporal source equal to the source is a plain copy: one form, so it plans as one
                ev = CopyOnWrite(a, b, ev.request_id, k, None if ts == a else ts)
        elif t is Clear or t is Release:
            s = ev.slot
            if type(s) is not int or not 0 < s <= n:
                ev = t(as_slot(s, n), ev.request_id)
        elif t is CommitDraft:
            s, accepted = ev.slot, ev.accepted
            if type(accepted) is not int:
                try:
                    if isinstance(accepted, (bool, float)):
                        raise TypeError
                    accepted = operator.index(accepted)
                except TypeError:
                    raise InvalidArgumentError(f"accepted must be an int, got {accepted!r}") from None
            if type(s) is not int or not 0 < s <= n or accepted is not ev.accepted:
                ev = CommitDraft(as_slot(s, n), accepted, ev.request_id)
        else:
            raise InvalidEventError(
                f"submit takes Clear, CopyOnWrite, Release and CommitDraft events, got {ev!r}"
                + ("; allocate with CacheManager.alloc" if isinstance(ev, Alloc) else "")
                + (
                    "; use CacheManager.offload, restore and drop (they pick and free host slots)"
                    if isinstance(ev, Offload | Restore | DropHost)
                    else ""
                )
            )
        if ev.request_id is not None and type(ev.request_id) is not str:
            check_request_id(ev.request_id)
        out.append(ev)
    return out


def check_request_id(request_id: Any) -> None:
    if request_id is not None and type(request_id) is not str:
        raise InvalidArgumentError(f"request_id must be a str or None, got {request_id!r}")
