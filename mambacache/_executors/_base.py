"""What every executor shares: the protocol, stream scoping, host-built indices."""

from __future__ import annotations

import abc
import collections
import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .._core._planner import CopyStage, HostStage, OffloadStage, RotateStage, ShiftStage, Stage

__all__ = [
    "GRAIN",
    "Executor",
    "IndexBuilder",
    "Progress",
    "as_executor",
    "copy_host",
    "on_stream",
    "piece_size",
    "pieces",
    "row_width",
    "stage_pairs",
]


# ATen runs an op over fewer elements than this inline on the calling thread (``at::internal::GRAIN_SIZE``);
# from it on, the op is an OpenMP parallel region that ends only once every pool thread got a time slice. A
# runs-path stage is one op per run: on a host where another process computes (shared machines, CPU quotas),
# each region waits for the thread that process holds, about a scheduler slice each, and a stage of 128 runs
# took 47x a memset (docs/benchmarks.md, "Contention"). Cut under the grain, every op runs inline; a large
# stage's pieces are shared with helper threads that take chunks as they come free (``_crew.py``), since one
# thread alone moves about half a two-thread memcpy's bytes on a quiet machine.
GRAIN = 32768
# Widest first: a zero or a same-dtype copy moves the bytes whatever their dtype (an op copies complex128
# through vector loads and stores, bit for bit), and a wider element puts more bytes under the grain.
_WIDE = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


def row_width(tensor: torch.Tensor, depth: int = 2) -> torch.dtype:
    """The widest dtype in whose elements every row over the first ``depth`` dims of ``tensor`` starts and ends
    (``(layer, slot)`` rows of a pool tensor; ``(layer, slot, draft)`` rows of a draft buffer at depth 3)."""
    size = tensor.element_size()
    unit = tensor[(0,) * depth].numel() * size
    for b in (tensor.storage_offset(), *(tensor.stride(d) for d in range(depth))):
        unit = math.gcd(unit, b * size)
    return next(dt for dt in _WIDE if unit % dt.itemsize == 0)


def pieces(block: torch.Tensor, width: torch.dtype) -> list[torch.Tensor]:
    """A contiguous block as 1-D ``width`` views of fewer than ``GRAIN`` elements each, in equal parts.

    Two blocks of the same shape give pieces of the same shapes, so a copy pairs them one to one.
    """
    flat = block.view(-1).view(torch.uint8).view(width)
    n = flat.numel()
    step = piece_size(n)
    return [flat[a : a + step] for a in range(0, n, step)]


def piece_size(n: int) -> int:
    """The length of each of the equal parts, fewer than ``GRAIN`` elements, that :func:`pieces` cuts ``n``
    elements into (the last part may be shorter)."""
    return -(-n // -(-n // (GRAIN - 1)))


class Executor(abc.ABC):
    """Applies one planned stage to one pool tensor, on the current stream.

    ``tensor`` is ``[num_layers, num_slots + 1, *state]``. The step runner calls
    ``execute`` for each stage and, inside it, for each pool tensor in order
    (:func:`mambacache._core._runner.run_stage` is the one place that dispatches).

    Resume contract: a call may raise at any point, even between two of its own
    device ops (a fault, ``MemoryError``, ``KeyboardInterrupt``). The runner then
    calls ``execute`` again with the same ``stage`` and ``tensor`` objects on the
    same executor, until one call returns; the tensor must then hold exactly what
    one uninterrupted call would have left. Zero and copy stages satisfy this by
    being idempotent (a copy stage's sources and destinations are disjoint). A
    rotate is not: once a member is overwritten its old value exists only where
    the executor saved it, so rotating executors keep a :class:`Progress`; so is a
    shift stage (a shift in place), which only reaches ``execute`` with a conv
    tensor: shift its last (time) axis, zero-filling the end.
    Device work is only enqueued: no call may wait for the device.

    Two methods have defaults an executor may override: :meth:`execute_stage`
    (a zero or copy stage on every pool tensor at once) and :meth:`execute_host`
    (offload and restore stages, :func:`copy_host`).
    """

    name: str
    # Whether it runs on paged pool tensors (only each ``(layer, slot)`` row contiguous, as in an
    # engine's block pages; :mod:`mambacache._core._pool`); the manager refuses a paged pool otherwise.
    takes_paged: bool = True

    @abc.abstractmethod
    def execute(self, stage: Stage, tensor: torch.Tensor, draft: torch.Tensor | None = None) -> None:
        """Enqueue ``stage`` on ``tensor`` (one pool tensor, ``[layers, slots + 1, *state]``).

        ``draft`` is given with a ``CommitStage`` only: the tensor's draft buffer,
        ``[layers, slots + 1, draft_tokens, *state]``, which the stage reads.
        """

    def execute_stage(self, stage: Stage, tensors: list[torch.Tensor]) -> bool:
        """Enqueue a zero or copy stage on all of ``tensors`` at once; False when this executor has no such
        path for it (then :meth:`execute` runs per tensor). The default has none.

        Only called with idempotent stages and before any tensor of the stage ran,
        so a fault part-way just leaves the stage to be run again.
        """
        del stage, tensors
        return False

    def execute_host(self, stage: HostStage, tensor: torch.Tensor, host: torch.Tensor) -> None:
        """Enqueue an offload (pool -> host) or restore (host -> pool) stage on one tensor pair.

        ``host`` is the host-pool tensor matching ``tensor``. The default is :func:`copy_host`.
        """
        copy_host(stage, tensor, host)


class _Adapted(Executor):
    """An executor object that does not subclass :class:`Executor` (duck-typed: ``name`` and ``execute``).

    Its optional methods are looked up once, here, so the runner never probes.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self._whole = getattr(inner, "execute_stage", None)
        self._host = getattr(inner, "execute_host", None)

    def execute(self, stage: Stage, tensor: torch.Tensor, draft: torch.Tensor | None = None) -> None:
        if draft is None:  # the two-argument form, which duck-typed executors may be limited to
            self.inner.execute(stage, tensor)
        else:
            self.inner.execute(stage, tensor, draft)

    def execute_stage(self, stage: Stage, tensors: list[torch.Tensor]) -> bool:
        return bool(self._whole(stage, tensors)) if self._whole is not None else False

    def execute_host(self, stage: HostStage, tensor: torch.Tensor, host: torch.Tensor) -> None:
        (self._host or copy_host)(stage, tensor, host)


def as_executor(obj: Any) -> Executor | None:
    """``obj`` as an :class:`Executor`: itself if it subclasses it, adapted if it has ``name`` and a callable
    ``execute``, else None."""
    if isinstance(obj, Executor):
        return obj
    if isinstance(getattr(obj, "name", None), str) and callable(getattr(obj, "execute", None)):
        return _Adapted(obj)
    return None


def copy_host(stage: HostStage, tensor: torch.Tensor, host: torch.Tensor, per_layer: bool | None = None) -> None:
    """Run an offload (pool -> host) or restore (host -> pool) stage on one tensor pair.

    The default for every executor without an ``execute_host`` of its own. Each
    run of slots is one contiguous chunk per layer on both sides, so it copies
    with no temporary and no index tensor: one strided op per run on the CPU, one
    op per layer and run on an accelerator (where a strided cross-device copy
    would stage through a contiguous temporary; ``per_layer`` forces either).
    ``non_blocking``: with pinned host memory the copy is enqueued on the current
    stream, nothing waits. Reads one side, writes the other, so a repeat after a
    fault is harmless.
    """
    src, dst = (tensor, host) if type(stage) is OffloadStage else (host, tensor)
    if not (tensor.device.type != "cpu" if per_layer is None else per_layer):
        for a, b, n in stage.runs:
            dst[:, b : b + n].copy_(src[:, a : a + n])
        return
    for a, b, n in stage.runs:
        for layer in range(tensor.shape[0]):
            dst[layer, b : b + n].copy_(src[layer, a : a + n], non_blocking=True)


class Progress:
    """How far a rotate on one (stage, tensor) got, so that a repeated call resumes it exactly.

    The executor splits the rotate into units (cycles, layer groups, single row
    copies); each unit either reads before it writes, keeping what it read in
    ``saved``, or is one op whose repetition is harmless. The whole record is
    ``(stage, tensor, first unit not known done, saved reads or None)`` and is
    replaced by one attribute store, so an interrupt between two bytecodes leaves
    the old record or the new one, and both resume correctly. A finished call
    keeps its record with every unit done, so a repeat (an interrupt that hit
    between the last op and the caller's bookkeeping) is a no-op, not a second
    rotate.
    """

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state: tuple[object, object, int, Any] = (None, None, 0, None)

    def resume(self, stage: Stage, tensor: torch.Tensor) -> tuple[int, Any]:
        """``(unit, saved)`` to start from: saved progress for this very (stage, tensor), else ``(0, None)``."""
        st = self._state
        if st[0] is not stage or st[1] is not tensor:
            st = self._state = (stage, tensor, 0, None)
        return st[2], st[3]

    def mark(self, unit: int, saved: Any = None) -> None:
        """Units before ``unit`` are done; ``saved`` holds what unit ``unit`` has read so far."""
        st = self._state
        self._state = (st[0], st[1], unit, saved)


_NO_STREAM: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()


def on_stream(device: torch.device, stream: Any | None) -> contextlib.AbstractContextManager[Any]:
    """Make ``stream`` (default: the device's current stream) current for the block.

    On CPU there is no stream: a shared no-op context, since this runs on every flush.
    """
    if device.type == "cpu":
        return _NO_STREAM
    return _device_stream(device, stream)


@contextlib.contextmanager
def _device_stream(device: torch.device, stream: Any | None) -> Iterator[Any]:
    module = torch.get_device_module(device.type)
    stream = stream if stream is not None else module.current_stream(device)
    with module.stream(stream):
        yield stream


def stage_pairs(stage: CopyStage | RotateStage | ShiftStage) -> tuple[list[int], list[int]]:
    """Sources and destinations of a copy, shift or rotate stage, as parallel lists."""
    if isinstance(stage, CopyStage | ShiftStage):
        return [s for s, _ in stage.pairs], [d for _, d in stage.pairs]
    srcs: list[int] = []
    dsts: list[int] = []
    for cycle in stage.cycles:
        srcs.extend(cycle)
        dsts.extend(cycle[1:] + cycle[:1])
    return srcs, dsts


class IndexBuilder:
    """Builds index tensors on the host and moves them to the device without waiting.

    On accelerators the host tensor is pinned and copied non-blocking on the
    current stream; the pinned buffer is held, with an event recorded after the
    copy, until the event has completed (checked by ``query``, which never
    waits). The device copy may be dropped once the work using it is enqueued:
    the caching allocators only reuse memory in stream order. Indices are
    cached for the stage being executed, because the manager calls the
    executor once per pool tensor with the same stage; the cache is keyed by
    stage, device and stream, so a stage resumed on another stream gets indices
    made on that stream.
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] = ()
        self._cached: tuple[torch.Tensor, ...] = ()
        self._in_flight: collections.deque[tuple[Any, tuple[torch.Tensor, ...]]] = collections.deque()

    def get(self, stage: Stage, device: torch.device, *lists: Sequence[int]) -> tuple[torch.Tensor, ...]:
        stream = None if device.type == "cpu" else torch.get_device_module(device.type).current_stream(device)
        key = (stage, device, stream)
        if self._key and self._key[0] is stage and self._key[1:] == key[1:]:
            return self._cached
        self._release_done()
        if device.type == "cpu":
            out = tuple(torch.tensor(v, dtype=torch.int64) for v in lists)
        else:
            flat = [x for v in lists for x in v]
            host = torch.tensor(flat, dtype=torch.int64).pin_memory()
            dev = host.to(device, non_blocking=True)
            out = tuple(torch.split(dev, [len(v) for v in lists]))
            event = torch.Event(device=device)
            event.record()
            self._in_flight.append((event, (host,)))
        self._key, self._cached = key, out
        return out

    def _release_done(self) -> None:
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()
