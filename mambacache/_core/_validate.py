"""The argument checks: one rule per kind of argument, each raising one typed error with one message.

A call checks all its arguments, with these rules, before it changes
anything, so a refused call leaves everything as it was. The kinds: slots
and host slots (one, or many), counts, request ids (one, or a list), bools,
positive ints, strs, callables, peers' ranks, instances of a class, a copy's
shift, submitted events, and the hand-off's and the transfer's values
(exports, a batch in doubt, rows and their shapes). Modules that own a
stranger value (a spec's shapes, a pool's tensors) check it themselves.

Engines hold slot ids as Python ints, numpy integers, numpy arrays and CPU
tensors; all are accepted (anything ``operator.index`` takes), bool and float
never, and a device tensor is refused rather than read, since reading it would
wait for the device.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable, Mapping, Sequence, Set, ValuesView
from typing import Any, TypeVar

import torch

from ._errors import InvalidArgumentError, InvalidEventError, InvalidSlotError
from ._events import Alloc, Clear, CommitDraft, CopyOnWrite, DropHost, Export, Offload, Release, Restore

__all__ = [
    "as_slot", "check_batch_key", "check_bool", "check_callable", "check_count", "check_exports", "check_instance",
    "check_peer", "check_positive_int", "check_request_id", "check_request_ids", "check_rows", "check_shapes",
    "check_shift", "check_str", "count_list", "host_slot", "host_slot_list", "named_request_id", "need_host",
    "normalised", "paired", "slot_list",
]  # fmt: skip

_T = TypeVar("_T")


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


def host_slot(x: Any, num_slots: int) -> int:
    """``x`` as a host slot of a host pool of ``num_slots``: :func:`as_slot`'s rule, its error naming the host."""
    try:
        return as_slot(x, num_slots)
    except InvalidSlotError as exc:
        raise InvalidSlotError(f"host {exc}") from None


def host_slot_list(slots: Any, num_slots: int) -> list[int]:
    """:func:`slot_list` for host slots, its error naming the host."""
    try:
        return slot_list(slots, num_slots)
    except InvalidSlotError as exc:
        raise InvalidSlotError(f"host {exc}") from None


def paired(what: str, firsts: list[int], seconds: list[int]) -> list[int]:
    """``seconds``, checked to be as many as ``firsts`` (a bulk call's two lists of slots)."""
    if len(firsts) != len(seconds):
        names = ("source(s)", "destination(s)") if what == "copy_many" else ("host slot(s)", "slot(s)")
        raise InvalidArgumentError(f"{what}: {len(firsts)} {names[0]} but {len(seconds)} {names[1]}")
    return seconds


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
                accepted = _count(accepted, "accepted")
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


# -- request ids -----------------------------------------------------------------
def check_request_id(request_id: Any) -> None:
    """A request id: a str, or None (no tenant check)."""
    if request_id is not None and type(request_id) is not str:
        raise InvalidArgumentError(f"request_id must be a str or None, got {request_id!r}")


def named_request_id(what: str, request_id: Any, why: str) -> str:
    """A request id that must be given (a str): ``what`` needs it because ``why``."""
    check_request_id(request_id)
    if type(request_id) is not str:
        raise InvalidArgumentError(f"{what} needs the request's id: {why}")
    return request_id


def check_request_ids(what: str, request_ids: Any, *, batch: bool = False) -> list[str]:
    """A list of request ids (str; a str is not taken for its characters); ``batch``: a transfer's batch, at
    least one and no id twice."""
    if (
        type(request_ids) is not list
        or not all(type(r) is str for r in request_ids)
        or (batch and (not request_ids or len(set(request_ids)) != len(request_ids)))
    ):
        kind = "distinct request ids" if batch else "request ids"
        raise InvalidArgumentError(f"{what} takes a list of {kind} (str), got {request_ids!r}")
    return request_ids


# -- plain values ------------------------------------------------------------------
def check_bool(name: str, value: Any, *, none: bool = False) -> None:
    """A bool (``none``: or None); never an int or a str read by its truth."""
    if type(value) is not bool and not (none and value is None):
        raise InvalidArgumentError(f"{name} must be a bool{' or None' if none else ''}, got {value!r}")


def check_positive_int(name: str, value: Any) -> int:
    """An int of at least 1 (not a bool)."""
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    return value


def check_count(name: str, value: Any, below: int | None = None) -> int:
    """An int of at least 0 (not a bool); with ``below``, less than it."""
    if type(value) is not int or value < 0 or (below is not None and value >= below):
        kind = "a non-negative int" if below is None else f"an int in 0..{below - 1}"
        raise InvalidArgumentError(f"{name} must be {kind}, got {value!r}")
    return value


def check_str(name: str, value: Any) -> str:
    """A str."""
    if type(value) is not str:
        raise InvalidArgumentError(f"{name} must be a str, got {value!r}")
    return value


def check_callable(name: str, value: Any, *, none: bool = False) -> None:
    """A callable (``none``: or None)."""
    if not callable(value) and not (none and value is None):
        raise InvalidArgumentError(f"{name} must be a callable{' or None' if none else ''}, got {value!r}")


def check_peer(name: str, value: Any) -> int | None:
    """A peer's rank (a non-negative int), or None (any peer)."""
    if value is not None and (type(value) is not int or value < 0):
        raise InvalidArgumentError(f"{name} must be a peer's rank (a non-negative int) or None, got {value!r}")
    return value  # type: ignore[no-any-return]


def check_instance(name: str, value: Any, cls: type) -> None:
    """An instance of ``cls`` (a pool, a host pool, a manager, a channel: their modules pass the class)."""
    if not isinstance(value, cls):
        raise InvalidArgumentError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")


def need_host(what: str, part: _T | None) -> _T:
    """``part`` (a manager's host pool, or what it holds with one); :class:`InvalidArgumentError` without one."""
    if part is None:
        raise InvalidArgumentError(
            f"{what} needs a host pool (this manager was made without a host pool):"
            " CacheManager(pool, host_pool=HostPool(spec, n))"
        )
    return part


# -- the hand-off's and the transfer's values --------------------------------------
def check_exports(what: str, exports: Any) -> list[Export]:
    """``exports`` as a list of :class:`Export` (as ``take_exports`` gave them)."""
    if not isinstance(exports, (list, tuple)) or not all(type(ev) is Export for ev in exports):
        raise InvalidArgumentError(f"{what} takes the list of Export events take_exports() returned, got {exports!r}")
    return list(exports)


def check_batch_key(batch: Any, peer: int | None) -> None:
    """The batch a returned send may have landed under: None, or a hashable value given with its peer."""
    if batch is not None and (peer is None or not isinstance(batch, Hashable)):
        raise InvalidArgumentError(f"exports_returned's batch needs a peer and must be hashable, got {batch!r}")


Shapes = list[tuple[tuple[int, ...], torch.dtype]]


def check_shapes(shapes: Any) -> Shapes:
    """A receive's per-slot ``(shape, dtype)`` of each pool tensor, as a :class:`StateSpec`'s ``shapes()``."""
    ok = isinstance(shapes, (list, tuple)) and len(shapes) > 0
    out: Shapes = []
    for entry in shapes if ok else ():
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], torch.dtype):
            ok = False
            break
        shape = entry[0]
        if not isinstance(shape, (list, tuple)) or not all(type(d) is int and d > 0 for d in shape):
            ok = False
            break
        out.append((tuple(shape), entry[1]))
    if not ok:
        raise InvalidArgumentError(
            f"shapes must be a non-empty list of (shape, torch.dtype) pairs, a StateSpec's shapes(), got {shapes!r}"
        )
    return out


def check_rows(request_ids: Any, rows: Any, seq: Any) -> None:
    """A sent batch: its request ids, its number ``seq`` and its ``rows``, one ``[layers, n, *state]`` host tensor
    per pool tensor, of one layer count and one state per id. Checked by the sender, not the peer: a header of
    them would go out, to be refused (or to wait out the timeout with nobody there), and rows that are not
    tensors would fail bare."""
    check_request_ids("send_rows", request_ids, batch=True)
    if type(seq) is not int:
        raise InvalidArgumentError(f"send_rows' seq must be an int (the batch's number), got {seq!r}")
    if (
        not isinstance(rows, (list, tuple))
        or not rows
        or not all(isinstance(r, torch.Tensor) and _host_rows(r) for r in rows)
        or len({(r.shape[0], r.shape[1]) for r in rows}) != 1
        or rows[0].shape[1] != len(request_ids)
    ):
        raise InvalidArgumentError(
            f"send_rows takes one [layers, n, *state] host tensor (strided, on the CPU) per pool tensor, each of one"
            f" layer count and of n = {len(request_ids)} states (one per request id)"
        )


def _host_rows(rows: torch.Tensor) -> bool:
    """Whether ``rows`` can go over the gloo pair as raw bytes: a strided CPU tensor of at least two dimensions (a
    sparse or accelerator tensor fails inside the wire, after its header was posted)."""
    return rows.layout == torch.strided and rows.device.type == "cpu" and rows.dim() >= 2
