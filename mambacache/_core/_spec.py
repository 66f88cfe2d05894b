"""StateSpec: the per-slot shape of a model's recurrent state."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from ._errors import InvalidArgumentError
from ._validate import check_count, check_positive_int

__all__ = ["ExtraShapes", "StateSpec"]

_QUANTIZED = frozenset(
    getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)
)


def _shape(value: Sequence[int], what: str, *, scalar: bool = False) -> tuple[int, ...]:
    try:
        shape = tuple(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a sequence of ints, got {value!r}") from None
    if (not shape and not scalar) or any(type(d) is not int or d <= 0 for d in shape):
        raise InvalidArgumentError(f"{what} must be {'' if scalar else 'non-empty '}positive ints, got {value!r}")
    return shape


def _dtype(dtype: object, what: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"{what} must be a torch.dtype, got {dtype!r}")
    if dtype in _QUANTIZED:
        # Quantized tensors carry a scale and zero point per tensor: a slot copy
        # between two such tensors is not a plain byte copy. Per-slot scales are
        # extra tensors of the spec instead (extra_shapes).
        raise InvalidArgumentError(
            f"{what} {dtype} is a quantized dtype; store the state as a plain dtype (int8, float8_*) and its"
            " scales as extra_shapes"
        )
    return dtype


ExtraShape = tuple[tuple[int, ...], torch.dtype]


class ExtraShapes(dict[str, ExtraShape]):
    """A read-only, hashable ``name -> (shape, dtype)`` mapping, kept in name order.

    Name order makes two specs with the same extras equal *and* lay out their
    pool tensors alike (pools, host pools and executors match tensors by
    position); read-only because ``slot_bytes`` is derived from it once.
    """

    __slots__ = ()

    def _read_only(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("StateSpec.extra_shapes is read-only: make a new spec (dataclasses.replace)")

    __setitem__ = __delitem__ = _read_only
    clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __hash__(self) -> int:  # type: ignore[override]  # dict is unhashable; this one never changes
        return hash(tuple(self.items()))

    def __reduce__(self) -> tuple[type[ExtraShapes], tuple[dict[str, ExtraShape]]]:
        # Pickle and deepcopy rebuild it whole: item by item would hit __setitem__.
        return (type(self), (dict(self),))


def _extras(value: object) -> ExtraShapes:
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"extra_shapes must be a mapping of name -> (shape, dtype), got {value!r}")
    out: dict[str, ExtraShape] = {}
    for name in value:
        if type(name) is not str or not name.isidentifier():
            raise InvalidArgumentError(f"extra_shapes names must be identifiers (str), got {name!r}")
        entry = value[name]
        if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 2:
            raise InvalidArgumentError(f"extra_shapes[{name!r}] must be a (shape, dtype) pair, got {entry!r}")
        what = f"extra_shapes[{name!r}]"
        out[name] = (_shape(entry[0], f"{what} shape", scalar=True), _dtype(entry[1], f"{what} dtype"))
    return ExtraShapes(sorted(out.items()))


@dataclass(frozen=True, slots=True)
class StateSpec:
    """Shapes and dtypes of one slot's state, identical for every layer.

    Invariants: ``num_layers >= 1``; every conv and temporal shape is a non-empty
    tuple of positive ints; ``conv_shapes`` may be empty (a model with only a
    temporal state); ``draft_tokens >= 0`` is the number of per-draft-token
    states a slot keeps for speculative decoding (``docs/speculative.md``).

    ``extra_shapes`` names more per-slot tensors, ``name -> (shape, dtype)``,
    e.g. the per-slot scales of an int8 or fp8 state: each is one more pool
    tensor ``[num_layers, num_slots + 1, *shape]`` (``shape`` may be ``()``,
    one value per slot and layer) that every event clears, copies, offloads,
    restores and commits with the slot, exactly as the conv and temporal
    states. Kept read-only, in name order (``docs/engines.md``, "Quantised
    states and their scales").

    ``slot_bytes`` is one slot's state (what a clear or a copy moves);
    ``memory_bytes`` adds its draft buffers (what a slot costs in memory).
    """

    num_layers: int
    conv_shapes: Sequence[Sequence[int]]  # stored as a tuple of tuples
    temporal_shape: Sequence[int]  # stored as a tuple
    conv_dtype: torch.dtype = torch.bfloat16
    temporal_dtype: torch.dtype = torch.float32
    draft_tokens: int = 0
    extra_shapes: Mapping[str, tuple[Sequence[int], torch.dtype]] = field(default_factory=dict)
    # Derived once: planning and reporting read it per step.
    slot_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_positive_int("num_layers", self.num_layers)
        if isinstance(self.conv_shapes, (str, bytes)) or not isinstance(self.conv_shapes, Sequence):
            raise InvalidArgumentError(f"conv_shapes must be a sequence of shapes, got {self.conv_shapes!r}")
        conv = tuple(_shape(s, f"conv_shapes[{i}]") for i, s in enumerate(self.conv_shapes))
        temporal = _shape(self.temporal_shape, "temporal_shape")
        for name in ("conv_dtype", "temporal_dtype"):
            _dtype(getattr(self, name), name)
        extras = _extras(self.extra_shapes)
        object.__setattr__(self, "conv_shapes", conv)
        object.__setattr__(self, "extra_shapes", extras)
        object.__setattr__(self, "temporal_shape", temporal)
        check_count("draft_tokens", self.draft_tokens)
        object.__setattr__(self, "slot_bytes", self.num_layers * sum(self.layer_bytes()))

    def shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each pool tensor's per-slot, per-layer block: convs, temporal, then extras."""
        convs = [(tuple(s), self.conv_dtype) for s in self.conv_shapes]
        extras = [(tuple(s), d) for s, d in self.extra_shapes.values()]
        return [*convs, (tuple(self.temporal_shape), self.temporal_dtype), *extras]

    @property
    def memory_bytes(self) -> int:
        """Bytes one slot takes in a pool: its state and its ``draft_tokens`` draft states."""
        return self.slot_bytes * (1 + self.draft_tokens)

    def layer_bytes(self) -> list[int]:
        """Bytes of one slot in one layer, for each pool tensor (convs, temporal, then extras)."""
        return [math.prod(s) * d.itemsize for s, d in self.shapes()]

    @classmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> StateSpec:
        """A spec whose shapes match the linear-attention cache of a transformers model.

        Supports Mamba2 (and Mamba2-style mixers: Nemotron-H, Falcon-H1) and
        Qwen3-Next / Qwen3.5 GatedDeltaNet layers. See :mod:`mambacache._core._hfconfig`.
        ``overrides`` set any field, e.g. ``draft_tokens=k`` for speculative decoding.
        """
        from ._hfconfig import spec_kwargs_from_config

        kwargs = spec_kwargs_from_config(config)
        kwargs.update(overrides)
        return cls(**kwargs)
