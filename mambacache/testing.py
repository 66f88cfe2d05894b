"""Tools to check an integration of mambacache the way the project's own tests check the package.

* :class:`SequentialOracle` applies events one at a time to plain copies of a pool's tensors, the obviously
  correct way, and compares a pool (and host pool) with them: whatever the planner merged, reordered or elided,
  a flushed pool must hold what the oracle holds in every slot whose value is defined.
* :class:`ReferenceExecutor` runs each stage one slot at a time (``executor="reference"``).
* :func:`fail_at_op` raises before the k-th aten op run inside its block, whichever executor runs it;
  :func:`count_ops` only counts, so a test can fault before each op of a flush in turn.
  :class:`FailingExecutor` wraps an executor and raises before chosen calls of it. Both inject from the
  outside: nothing in the package reads a switch to fail.

A fault during a flush loses nothing: the flush raises :class:`~mambacache.ExecutorError`, the pool keeps the
unfinished work, and the next flush finishes it, so the pool then matches the oracle. docs/testing.md shows a
whole check. Importing this module imports neither pytest nor hypothesis; a failed comparison raises
:class:`AssertionError` (not an ``assert`` statement, so ``python -O`` checks too).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._core._errors import InvalidArgumentError, InvalidEventError
from ._core._events import (
    Alloc,
    Clear,
    CommitDraft,
    CopyOnWrite,
    DropHost,
    Export,
    Import,
    Offload,
    Release,
    Restore,
)
from ._core._planner import HostStage, Stage
from ._core._pool import StatePool
from ._executors._base import Executor
from ._executors._reference import ReferenceExecutor
from ._tiers._hostpool import HostPool

__all__ = [
    "FailingExecutor",
    "FaultInjector",
    "ReferenceExecutor",
    "SequentialOracle",
    "count_ops",
    "fail_at_op",
]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _pool_stacks(pool: StatePool, drafts: bool = False) -> list[Any]:
    """Per pool tensor, the stacked ``[layers, slots + 1, ...]`` tensor, or its list of layers on a pool of many
    layer groups (:meth:`StatePool.from_layers`). A stand-in for a pool (a view of one, say) needs only
    ``tensors``; without ``draft_tensors`` it has no draft buffers."""
    if len(getattr(pool, "layer_groups", ((0, 0),))) == 1:
        return list(getattr(pool, "draft_tensors", []) if drafts else pool.tensors)
    return list(pool.draft_layers if drafts else pool.layers)


def _row(t: Any, slot: int) -> torch.Tensor:
    """``t[:, slot]``: one slot of every layer, of a stacked tensor or a list of layers."""
    return t[:, slot] if isinstance(t, torch.Tensor) else torch.stack([layer[slot] for layer in t])


def _copy(t: Any) -> torch.Tensor:
    return t.clone() if isinstance(t, torch.Tensor) else torch.stack(t)


class SequentialOracle:
    """A pool's state kept the obviously correct way: each event applied on its own to copies of the tensors.

    Made from a pool (and its host pool, if the manager has one) before the events it will check; it copies
    the tensors and which slots are allocated and held. :meth:`apply` every event the manager took, in the same
    order, then :meth:`assert_matches` after a flush. The pool may be any object with a pool's ``spec``,
    ``tensors`` and ``allocated_slots()`` (byte views of a pool's tensors, to compare any dtype bit for bit).

    It tracks which slots have a defined value: a free slot's content is unspecified, and so is that of a slot
    allocated with ``clear=False`` until a clear, a copy of a defined slot or a forward (:meth:`write`) writes
    it; only defined slots are compared. The attributes are the state: ``tensors`` and ``host`` (one
    ``[layers, slots + 1, ...]`` tensor per pool and host tensor), ``drafts`` (the draft buffers as made: a
    forward writes them, events only read them), the sets ``allocated``, ``defined``, ``host_held`` and
    ``host_defined``.
    """

    def __init__(self, pool: StatePool, host: HostPool | None = None) -> None:
        self.tensors = [_copy(t) for t in _pool_stacks(pool)]
        # The conv tensors come first: a shifted copy moves those by `shift` tokens of `token` elements each
        # on the last axis (1, or the item size on a pool of byte views).
        self.token = [t.shape[-1] // c[-1] for t, c in zip(self.tensors, pool.spec.conv_shapes, strict=False)]
        self.host = [t.clone() for t in host.tensors] if host is not None else []
        self.host_held: set[int] = set(host.held()) if host is not None else set()
        self.drafts = [_copy(t) for t in _pool_stacks(pool, drafts=True)]
        self.allocated: set[int] = set(pool.allocated_slots())
        self.defined: set[int] = set(self.allocated)
        self.host_defined: set[int] = set(self.host_held)

    def apply(self, events: Iterable[Any]) -> None:
        """Apply ``events`` in order, each as if it ran alone. An export stages its slot's state as of its
        place in the log, as an offload would; an import reads a staged state, as a restore would. An export or
        import in place (``host`` None) changes nothing here: :meth:`land_slot` records a state that arrived."""
        for ev in events:
            if isinstance(ev, Export) and ev.host is not None:
                ev = Offload(ev.slot, ev.host, ev.request_id)
            elif isinstance(ev, Import) and ev.host is not None:
                ev = Restore(ev.host, ev.slot, ev.request_id)
            elif isinstance(ev, (Export, Import)):
                continue
            if isinstance(ev, Offload):
                self._offload(ev)
            elif isinstance(ev, Restore):
                self._restore(ev)
            elif isinstance(ev, DropHost):
                self.host_held.discard(ev.host)
            elif isinstance(ev, CommitDraft):
                if ev.accepted:
                    for t, d in zip(self.tensors, self.drafts, strict=True):
                        t[:, ev.slot] = d[:, ev.slot, ev.accepted - 1].clone()
                    self.defined.add(ev.slot)
            elif isinstance(ev, (Clear, Alloc)):
                if isinstance(ev, Clear) or ev.clear:
                    for t in self.tensors:
                        t[:, ev.slot] = 0
                    self.defined.add(ev.slot)
                if isinstance(ev, Alloc):
                    self.allocated.add(ev.slot)
            elif isinstance(ev, CopyOnWrite):
                self._copy_on_write(ev)
            elif isinstance(ev, Release):
                self.allocated.discard(ev.slot)
                self.defined.discard(ev.slot)
            else:
                raise InvalidEventError(f"not a mambacache event: {ev!r}")

    def _offload(self, ev: Offload) -> None:
        for t, h in zip(self.tensors, self.host, strict=True):
            h[:, ev.host] = t[:, ev.slot].clone()
        self.host_held.add(ev.host)
        self.host_defined.discard(ev.host)
        if ev.slot in self.defined:
            self.host_defined.add(ev.host)

    def _restore(self, ev: Restore) -> None:
        for t, h in zip(self.tensors, self.host, strict=True):
            t[:, ev.slot] = h[:, ev.host].clone()
        if ev.host in self.host_defined:
            self.defined.add(ev.slot)
        else:
            self.defined.discard(ev.slot)
        if not ev.keep:
            self.host_held.discard(ev.host)

    def _copy_on_write(self, ev: CopyOnWrite) -> None:
        # The conv states (the first tensors) come from `src`, the rest from `temporal_src` (default `src`).
        ts = ev.src if ev.temporal_src is None else ev.temporal_src
        for i, t in enumerate(self.tensors):
            row = t[:, ev.src if i < len(self.token) else ts].clone()
            if ev.shift and i < len(self.token):  # time is the last axis: roll to the front, zero the end
                n = ev.shift * self.token[i]
                row = torch.roll(row, -n, dims=-1)
                row[..., -n:] = 0
            t[:, ev.dst] = row
        if ev.src in self.defined and ts in self.defined:
            self.defined.add(ev.dst)
        else:
            self.defined.discard(ev.dst)

    def write(self, slot: int, value: float) -> None:
        """A forward step wrote ``value`` into every element of ``slot``: afterwards it is defined."""
        for t in self.tensors:
            t[:, slot] = value
        self.defined.add(slot)

    def land(self, host: int, rows: list[torch.Tensor], defined: bool) -> None:
        """A transfer wrote ``rows`` (one ``[layers, *state]`` row per host tensor) into staging host slot ``host``
        of this side, now: the slot is held, and defined if the state sent was."""
        for h, row in zip(self.host, rows, strict=True):
            h[:, host] = row
        self.host_held.add(host)
        self.host_defined.discard(host)
        if defined:
            self.host_defined.add(host)

    def land_slot(self, slot: int, rows: list[torch.Tensor], defined: bool) -> None:
        """A transfer wrote ``rows`` straight into pool slot ``slot`` (awaiting them in place), now."""
        for t, row in zip(self.tensors, rows, strict=True):
            t[:, slot] = row
        self.defined.discard(slot)
        if defined:
            self.defined.add(slot)

    def assert_matches(self, pool: StatePool, host: HostPool | None = None) -> None:
        """Raise :class:`AssertionError` unless ``pool`` (flushed) holds this state: the same allocated slots,
        every defined one equal bit for bit, the padding slot never written; and ``host``, if given, the same
        held host slots, every defined one equal."""
        if host is not None:
            held = set(host.held())
            _check(held == self.host_held, f"host slots held: {sorted(held)}, expected {sorted(self.host_held)}")
            for i, (want, got) in enumerate(zip(self.host, host.tensors, strict=True)):
                for h in sorted(self.host_held & self.host_defined):
                    _check(torch.equal(want[:, h], got[:, h]), f"host tensor {i} slot {h} differs")
        allocated = set(pool.allocated_slots())
        _check(allocated == self.allocated, f"slots allocated: {sorted(allocated)}, expected {sorted(self.allocated)}")
        self.assert_matches_shard(pool)
        for i, (want, got) in enumerate(zip(self.tensors, _pool_stacks(pool), strict=True)):
            _check(torch.equal(want[:, 0], _row(got, 0)), f"tensor {i}: the padding slot was written")

    def assert_matches_shard(self, pool: StatePool) -> None:
        """As :meth:`assert_matches`, the tensors only: for a pool whose slots another rank allocates (a
        tensor-parallel rank's)."""
        for i, (want, got) in enumerate(zip(self.tensors, _pool_stacks(pool), strict=True)):
            for s in sorted(self.allocated & self.defined):
                _check(torch.equal(want[:, s], _row(got, s)), f"tensor {i} slot {s} differs")


class FaultInjector(TorchDispatchMode):  # type: ignore[misc,no-untyped-call]
    """A context manager that counts the aten ops run on this thread inside its block (``ops``) and, when ``at``
    is 1 or more, raises ``exc`` instead of running the ``at``-th (1-based). Made by :func:`fail_at_op` and
    :func:`count_ops`.

    A flush runs its ops on the calling thread while a dispatch mode is active (the torch executor's helper
    threads stay idle), so every op of the flush is counted. A fault raised inside a flush reaches the caller
    as :class:`~mambacache.ExecutorError` (``KeyboardInterrupt`` as itself), the work kept for the next flush.
    """

    def __init__(self, at: int = 0, exc: type[BaseException] = MemoryError) -> None:
        if isinstance(at, bool) or not isinstance(at, int) or at < 0:
            raise InvalidArgumentError(f"at must be an int >= 0 (0: no fault), got {at!r}")
        if not (isinstance(exc, type) and issubclass(exc, BaseException)):
            raise InvalidArgumentError(f"exc must be an exception class, got {exc!r}")
        super().__init__()  # type: ignore[no-untyped-call]
        self.at, self.exc, self.ops = at, exc, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        if self.ops == self.at:
            raise self.exc(f"injected before op {self.ops}: {func}")
        return func(*args, **(kwargs or {}))


def fail_at_op(k: int, exc: type[BaseException] = MemoryError) -> FaultInjector:
    """``with fail_at_op(k): mgr.flush_nowait()``: raise ``exc`` before the ``k``-th aten op of the block (0:
    never). Count a flush's ops with :func:`count_ops` first to fault before each of them in turn."""
    return FaultInjector(k, exc)


def count_ops() -> FaultInjector:
    """``with count_ops() as n: mgr.flush_nowait()``: ``n.ops`` is then the number of aten ops the block ran."""
    return FaultInjector(0)


class FailingExecutor(Executor):
    """Runs ``inner``; once armed (:meth:`arm`), raises ``exc`` before the calls numbered in ``fail_at``.

    Calls are counted over ``execute`` and ``execute_host`` from the last :meth:`arm` (``calls``). A manager
    runs every stage kind once on scratch tensors when it is made, so arm it after making the manager. Each
    stage runs one pool tensor per call (the inner executor's all-tensors path is not used), so a fault can
    fall between two tensors of one stage.
    """

    def __init__(self, inner: Executor, exc: type[BaseException] = MemoryError) -> None:
        self.inner, self.exc = inner, exc
        self.name = f"failing-{inner.name}"
        self.takes_paged = inner.takes_paged
        self.fail_at: set[int] = set()
        self.calls = 0

    def arm(self, fail_at: Iterable[int]) -> None:
        """Raise before the calls numbered in ``fail_at`` (1-based), counting from the next call; an empty
        ``fail_at`` disarms it."""
        self.fail_at, self.calls = set(fail_at), 0

    def _call(self) -> None:
        self.calls += 1
        if self.calls in self.fail_at:
            raise self.exc(f"injected fault at call {self.calls}")

    def execute(self, stage: Stage, tensor: torch.Tensor, draft: torch.Tensor | None = None) -> None:
        self._call()
        self.inner.execute(stage, tensor, draft)

    def execute_host(self, stage: HostStage, tensor: torch.Tensor, host: torch.Tensor) -> None:
        self._call()
        self.inner.execute_host(stage, tensor, host)
