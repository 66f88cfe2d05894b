"""Helpers the tests share: specs and fills, the drive loop, fault injection, the host-tier driver, trace lines.

Tests import them from here, never from conftest (fixtures only) or from
another test file.
"""

from __future__ import annotations

import ast
import dis
import functools
import gc
import json
import math
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import torch

import mambacache as mc
from mambacache._executors._npu import NpuExecutor
from mambacache._executors._torch import TorchExecutor
from mambacache.testing import ReferenceExecutor, SequentialOracle, fail_at_op

from .layered import layered_pool, pool_tensors


def small_spec(layers: int = 3) -> mc.StateSpec:
    # Odd sizes and both dtypes on purpose: layouts must not depend on round numbers.
    return mc.StateSpec(num_layers=layers, conv_shapes=[(6, 3), (5, 2)], temporal_shape=(2, 3, 4))


def quant_spec(layers: int = 3, draft_tokens: int = 0) -> mc.StateSpec:
    """small_spec's shapes stored quantised: an int8 conv state, an fp8 temporal state, and per-slot scales as
    extra tensors of two more dtypes, one of them a single value per slot and layer (shape ``()``)."""
    return mc.StateSpec(
        num_layers=layers,
        conv_shapes=[(6, 3), (5, 2)],
        temporal_shape=(2, 3, 4),
        conv_dtype=torch.int8,
        temporal_dtype=torch.float8_e4m3fn,
        extra_shapes={"conv_scale": ((), torch.float32), "ssm_scale": ((2,), torch.bfloat16)},
        draft_tokens=draft_tokens,
    )


def paged_pool(spec: mc.StateSpec, num_slots: int, gap: int = 24) -> mc.StatePool:
    """A pool of ``spec`` adopted from one byte buffer in pages, as vLLM keeps a block's states: the page of
    ``(layer, slot)`` holds that row of every tensor (each at a 16-byte aligned offset) and ``gap`` spare bytes,
    so no tensor is contiguous, only each of its rows."""
    shapes = [(s, spec.conv_dtype) for s in spec.conv_shapes] + [(spec.temporal_shape, spec.temporal_dtype)]
    shapes += list(spec.extra_shapes.values())
    offsets, page = [], 0
    for shape, dtype in shapes:
        offsets.append(page)
        page += -(-math.prod(shape) * dtype.itemsize // 16) * 16
    page += gap
    buf = torch.zeros((spec.num_layers, num_slots + 1, page), dtype=torch.uint8)
    views = [
        buf[:, :, off : off + math.prod(shape) * dtype.itemsize].view(dtype).view(*buf.shape[:2], *shape)
        for off, (shape, dtype) in zip(offsets, shapes, strict=True)
    ]
    n = len(spec.conv_shapes)
    extra = dict(zip(spec.extra_shapes, views[n + 1 :], strict=True))
    return mc.StatePool.from_tensors(views[:n], views[n], extra=extra or None)


def step_value(step: int, slot: int) -> float:
    """What a forward step writes into ``slot``: distinct per slot in a step and from the step before, and in
    range for every test dtype (an int8 state overflows past 127; fp8 rounds, identically in oracle and pool)."""
    return float((step * 100 + slot) % 127)


def fill_random(pool: mc.StatePool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in pool_tensors(pool):
        noise = torch.randn(t.shape, generator=g)
        # Integer states (int8) get a wide spread: rounded small noise would be mostly zeros, as if cleared.
        t.copy_((noise + 1.0 if t.dtype.is_floating_point else (noise * 40).clamp(-127, 127)).to(t.dtype))


def drive(
    mgr: mc.CacheManager,
    events: Iterable[Any],
    oracle: SequentialOracle | None = None,
    *,
    exact: bool = False,
    hosts: dict[int, int] | None = None,
) -> list[Any]:
    """Submit a drawn log through the manager's own calls, in order; returns the events as submitted.

    An ``Alloc`` becomes ``alloc(1)``, which must hand out the drawn slot (the
    lowest free one), or ``alloc_slots([slot])`` with ``exact``; host events go
    through ``offload`` / ``restore`` / ``drop``, the log's host slots mapped to
    the manager's in ``hosts``; the rest through ``submit``. Each event is
    applied to ``oracle`` (if given) right after the manager took it.
    """
    hosts = {} if hosts is None else hosts
    done: list[Any] = []
    for ev in events:
        if isinstance(ev, mc.Alloc):
            if exact:
                mgr.alloc_slots([ev.slot], clear=ev.clear)
            else:
                got = mgr.alloc(1, clear=ev.clear)
                assert got == [ev.slot], f"alloc handed out {got}, the log drew {ev.slot}"
        elif isinstance(ev, mc.Offload):
            hosts[ev.host] = mgr.offload(ev.slot)
        elif isinstance(ev, mc.Restore):
            mgr.restore(hosts.get(ev.host, ev.host), ev.slot, keep=ev.keep)
        elif isinstance(ev, mc.DropHost):
            mgr.drop(hosts.get(ev.host, ev.host))
        else:
            mgr.submit(ev)
        if oracle is not None:
            oracle.apply([ev])
        done.append(ev)
    return done


def every_stage_step(mgr: mc.CacheManager, slots: list[int], h0: int | None) -> None:
    """Queue a step with every stage kind on seven of ``slots``: a fork wave, a swap through a temporary (a
    rotate), clears, an alloc and a release; with ``h0`` (a host slot holding a state) an offload, a restore
    that frees its host slot, a restore that keeps it, and a drop."""
    a, b, c, d, e, f, t = slots[:7]
    mgr.copy_on_write(a, e)
    mgr.submit(mc.CopyOnWrite(b, t), mc.CopyOnWrite(c, b), mc.CopyOnWrite(t, c), mc.Release(t))
    mgr.clear(d)
    mgr.alloc(1)
    if h0 is not None:
        h1 = mgr.offload(f)
        mgr.restore(h0, d)
        mgr.restore(h1, a, keep=True)
        mgr.drop(h1)


# -- fault sweeps (tests/support/sweep.py says which ops; mambacache.testing injects) --
SPEC = small_spec()
SPECS = {"plain": SPEC, "quantized": quant_spec()}  # the fault sweeps run on both: extras are more tensors
# ... and on the quantized spec's tensors paged (vLLM's block pages), where the executor takes them.
# ... and as per-layer tensors (StatePool.from_layers: two layer groups), stacked and paged.
POOL_KINDS = [*SPECS, "paged", "layers", "layers-paged"]


def sweep_pool(kind: str, num_slots: int) -> mc.StatePool:
    """A pool of one of :data:`POOL_KINDS`."""
    if kind.startswith("layers"):
        return layered_pool(SPECS["quantized"], num_slots, paged_pool if kind.endswith("paged") else mc.StatePool)
    return paged_pool(SPECS["quantized"], num_slots) if kind == "paged" else mc.StatePool(SPECS[kind], num_slots)


def kinds_for(variant: str) -> list[str]:
    """The pool kinds an executor variant runs on: the npu executor refuses paged pools."""
    return [k for k in POOL_KINDS if not (k.endswith("paged") and variant.startswith("npu"))]


ROW = max(SPEC.layer_bytes())  # the largest state of one slot in one layer, in bytes


def variants() -> dict[str, Callable[[], mc.Executor]]:
    """Fresh instances: executors keep progress records and workspaces."""
    return {
        "torch": lambda: TorchExecutor(),
        "torch-runs": lambda: TorchExecutor(min_run_bytes=0),
        "torch-index": lambda: TorchExecutor(path="index"),
        "torch-direct": lambda: TorchExecutor(path="direct"),
        "npu-whole": lambda: NpuExecutor(64 << 20),
        "npu-slot-chunks": lambda: NpuExecutor(SPEC.num_layers * ROW * 2),
        "npu-one-layer": lambda: NpuExecutor(ROW * 2),
        "npu-rows": lambda: NpuExecutor(8),
        "npu-one-element": lambda: NpuExecutor(4),  # fp32 temporal: one element of scratch
        "reference": lambda: ReferenceExecutor(),
    }


VARIANTS = variants()


def flush_with_fault(mgr: mc.CacheManager, at: int, exc: type[BaseException], *, alone: bool = True) -> int:
    """Flush with ``exc`` raised before aten op ``at`` (0: none); a failed flush is repaired by one more.

    Returns the ops the faulted flush ran. The sweeps (tests/support/sweep.py) call it at every op. ``alone=False``:
    other threads submit meanwhile (a transfer's delivery queues releases and drops at any time), so the failed
    flush having taken every queued event is not checked.
    """
    mode = fail_at_op(at, exc)
    try:
        with mode:
            mgr.flush_nowait()
    except (mc.ExecutorError, KeyboardInterrupt) as err:
        assert at, f"no fault was injected, yet: {err!r}"
        assert mgr.pool.unfinished >= 1, "a failed flush left no unfinished work"
        assert not alone or mgr.pending == 0, f"a failed flush left {mgr.pending} events queued"
        assert mgr.flush_nowait().resumed_stages >= 1  # the repair
    else:
        assert at == 0 or at > mode.ops
    return mode.ops


class InterruptAtLine:
    """Raises ``exc`` at the ``at``-th line the block executes inside the mambacache package (1-based; 0: none),
    on this thread or one started in the block; counts those lines in ``lines``.

    Three kinds of line are counted but never interrupted, since no Python code can make them safe: the exit of
    a ``with`` block (CPython raises there before ``__exit__`` runs, so a lock stays held), the lines of a
    ``finally`` clause (the rest of the clause is skipped), and a line that starts with a NOP (a ``try:``, which
    CPython 3.11 leaves outside every exception handler: raised there, an exception skips the enclosing
    ``with``'s exit; no real signal is raised at a NOP). ``skipped`` counts them.

    ``after_calls=True`` counts instead the instructions that follow a call of a C function inside the package:
    where CPython raises an interrupt from a real signal (it runs the handler as such a call returns), which may
    be in the middle of a line, between a call and the store of its result. A C function that calls back into
    Python (``map`` over a Python function) counts as a Python call: its return is not interrupted.

    ``threads=False``: this thread only (an async flush's worker threads may be started in the block or
    before it, so counting theirs would make the count depend on the pool of workers).
    """

    def __init__(
        self,
        at: int = 0,
        exc: type[BaseException] = KeyboardInterrupt,
        *,
        after_calls: bool = False,
        threads: bool = True,
    ) -> None:
        self.at, self.exc, self.lines, self.skipped, self.raised = at, exc, 0, 0, False
        self.after_calls, self.threads = after_calls, threads
        self._inside: dict[int, set[int]] = {}  # id(frame) -> the `with` lines it is inside of
        self._called: dict[int, int] = {}  # id(frame) -> the offset of its last instruction if a call, else -1

    def __enter__(self) -> InterruptAtLine:
        # No collection inside the block: a finalizer of an earlier test's objects (a manager, a transfer) would
        # run package lines on this thread, count them, and swallow an interrupt raised in them.
        self._gc = gc.isenabled()
        gc.disable()
        if self.threads:
            threading.settrace(self._call)
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)
        if self.threads:
            threading.settrace(None)  # type: ignore[arg-type]
        if self._gc:
            gc.enable()

    def _call(self, frame: FrameType, event: str, arg: object) -> Any:
        if self.after_calls and frame.f_back is not None:
            # A Python callee returns into its caller with no check for signals (its own calls had them).
            self._called[id(frame.f_back)] = -1
        if not frame.f_code.co_filename.startswith(_PACKAGE):
            return None
        if self.after_calls:
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
        return self._line

    def _line(self, frame: FrameType, event: str, arg: object) -> Any:
        if event == "return":
            self._inside.pop(id(frame), None)
            self._called.pop(id(frame), None)
        if event == "opcode":
            code, at = frame.f_code, frame.f_lasti
            called = self._called.get(id(frame), -1)
            self._called[id(frame)] = at if dis.opname[code.co_code[at]].startswith("CALL") else -1
            # CPython raises the signal's exception as from the call, under the call's handler: raised here
            # under another (the unprotected exit of a `with` after `return f()`), it would not be the same.
            if called < 0 or _handler(code, called) != _handler(code, at):
                return self._line
        elif event != "line":
            return self._line
        self.lines += 1
        if event == "line" and frame.f_code.co_code[frame.f_lasti] == _NOP:
            # A `try:` (or `pass`): no signal is raised at a NOP, and CPython 3.11 leaves a `try:`'s NOP outside
            # every handler, so raised there an exception would skip the enclosing `with`'s exit (a lock held).
            self.skipped += 1
            return self._line
        withs, finals = _cleanup_lines(frame.f_code.co_filename)
        line = frame.f_lineno
        if line in withs:
            inside = self._inside.setdefault(id(frame), set())
            if line in inside:  # the block's exit
                inside.discard(line)
                self.skipped += 1
                return self._line
            inside.add(line)
        elif line in finals:
            self.skipped += 1
            return self._line
        if self.lines == self.at:
            self.raised = True
            raise self.exc(f"injected at line {self.lines}: {frame.f_code.co_filename}:{line}")
        return self._line


_PACKAGE = str(Path(mc.__file__).parent)
_NOP = dis.opmap["NOP"]


class CancelAtSuspension:
    """Awaits an awaitable in a cancel scope and cancels the scope as the awaitable suspends for the ``at``-th time
    (1-based; 0: never): where anyio delivers a cancellation (a checkpoint), on asyncio and trio alike. Counts the
    suspensions in ``suspensions``; ``on_suspend(n)`` runs at each (a test's way to end a wait at the n-th).

    ``how``: ``"cancel"`` calls :meth:`anyio.CancelScope.cancel`; ``"deadline"`` moves the scope's deadline to
    now (``move_on_after`` expiring there). The cancellation reaches the awaitable at that suspension, or at the
    next one it is not shielded at, or never; ``cancelled`` says whether the scope caught one.
    """

    def __init__(self, at: int, how: str = "cancel", on_suspend: Callable[[int], None] | None = None) -> None:
        self.at, self.how, self.on_suspend = at, how, on_suspend
        self.suspensions, self.cancelled = 0, False
        self._scope: Any = None

    async def run(self, awaitable: Any) -> Any:
        import anyio

        result = None
        with anyio.CancelScope() as scope:
            self._scope = scope
            result = await _Counted(awaitable, self._suspended)
        self.cancelled = scope.cancelled_caught
        return result

    def _suspended(self) -> None:
        import anyio

        self.suspensions += 1
        if self.on_suspend is not None:
            self.on_suspend(self.suspensions)
        if self.suspensions == self.at:
            if self.how == "cancel":
                self._scope.cancel()
            else:
                self._scope.deadline = anyio.current_time()


class _Counted:
    """An awaitable passing every suspension of ``awaitable`` through to the event loop, unchanged (asyncio's
    futures, trio's traps), calling ``suspended()`` at each; what the loop sends or throws in goes back in."""

    def __init__(self, awaitable: Any, suspended: Callable[[], None]) -> None:
        self._inner, self._suspended = awaitable.__await__(), suspended

    def __await__(self) -> Any:
        inner = self._inner
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = inner.throw(error) if error is not None else inner.send(value)
            except StopIteration as stop:
                return stop.value
            self._suspended()
            try:
                value, error = (yield yielded), None
            except BaseException as exc:  # the loop's cancellation (or a close) goes into the awaitable
                value, error = None, exc


@functools.cache
def _handlers(code: CodeType) -> tuple[tuple[int, int, int], ...]:
    return tuple((e.start, e.end, e.target) for e in dis.Bytecode(code).exception_entries)  # type: ignore[attr-defined]


def _handler(code: CodeType, offset: int) -> int:
    """Where an exception raised at ``offset`` of ``code`` goes (-1: out of the frame)."""
    return next((target for start, end, target in _handlers(code) if start <= offset < end), -1)


@functools.cache
def _cleanup_lines(filename: str) -> tuple[frozenset[int], frozenset[int]]:
    """The lines of ``with`` statements in ``filename`` and the lines of its ``finally`` clauses."""
    tree = ast.parse(Path(filename).read_text())
    withs: set[int] = set()
    finals: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            withs.add(node.lineno)
        elif isinstance(node, ast.Try) and node.finalbody:
            for stmt in node.finalbody:
                finals.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return frozenset(withs), frozenset(finals)


# -- the host tier --------------------------------------------------------
class Driver:
    """Turns raw draws into manager calls on live state, recording the events for the oracle."""

    def __init__(self, mgr: mc.CacheManager, oracle: SequentialOracle) -> None:
        self.mgr, self.oracle = mgr, oracle

    def apply(self, kind: str, a: int, b: int) -> None:
        mgr, pool = self.mgr, self.mgr.pool
        live = pool.allocated_slots()
        host = mgr.host_pool
        assert host is not None
        held = sorted(host.held())
        ev: Any = None
        if kind == "alloc" and pool.num_free:
            ev = mc.Alloc(mgr.alloc(1, clear=b % 4 != 0)[0], clear=b % 4 != 0)
        elif kind == "clear" and live:
            ev = mc.Clear(live[a % len(live)])
            mgr.clear(ev.slot)
        elif kind == "cow" and live:
            ev = mc.CopyOnWrite(live[a % len(live)], live[b % len(live)])
            mgr.copy_on_write(ev.src, ev.dst)
        elif kind == "release" and live:
            ev = mc.Release(live[a % len(live)])
            mgr.release(ev.slot)
        elif kind == "offload" and live and host.num_free:
            slot = live[a % len(live)]
            ev = mc.Offload(slot, mgr.offload(slot))
        elif kind == "restore" and live and held:
            ev = mc.Restore(held[b % len(held)], live[a % len(live)], keep=a % 3 == 0)
            mgr.restore(ev.host, ev.slot, keep=ev.keep)
        elif kind == "drop" and held:
            ev = mc.DropHost(held[a % len(held)])
            mgr.drop(ev.host)
        if ev is not None:
            self.oracle.apply([ev])

    def forward(self, step: int) -> None:
        """A forward writes every live slot between flushes."""
        for s in self.mgr.pool.allocated_slots():
            value = step_value(step, s)
            self.oracle.write(s, value)
            for t in pool_tensors(self.mgr.pool):
                t[:, s] = value


# -- trace lines ----------------------------------------------------------
def line(event: str, step: int, **kw: object) -> str:
    return json.dumps({"event": event, "step": step, **kw})


CLEAN = [
    line("slot.alloc", 0, slot=1, request_id="a", cleared=True),
    line("step.flush", 0, events=1, elided=0),
    line("slot.release", 1, slot=1, request_id="a"),
    line("slot.alloc", 1, slot=1, request_id="b", cleared=True),
    line("step.flush", 1, events=2, elided=0),
]
