"""The crew: a large CPU stage's pieces shared with helper threads (mambacache/_executors/_crew.py).

The executor tests run through the crew only when a stage is a few MiB, which
the small pools of the property and fault sweeps never are; here the crew's
thresholds are lowered so that every stage of pieces is shared, and its own
contract is checked: the bytes are the reference executor's; a fault at any
chunk, on any thread, leaves no helper writing once the flush raised, and the
repair flush is exact; a slow helper holds up only its own chunk; a dispatch
mode keeps every op on the calling thread; two threads' stages do not mix.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import queue
import sys
import threading
import time
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext

import mambacache as mc
from mambacache._executors import _crew
from mambacache._executors._crew import CHUNK_BYTES, MIN_VIEWS, Crew, _Job, crew
from mambacache._executors._torch import TorchExecutor
from mambacache.testing import SequentialOracle, count_ops

from ..support.large import SPECS, make_pool, random_bytes, shared
from ..support.strategies import events_from_ops, host_events_from_ops, host_ops, ops
from ..support.util import drive

# How long a test waits for a helper thread to do its part: a loaded host may wake one late, but a helper that
# never comes is a failure, not a hang.
PATIENCE = 120.0


class Foreach:
    """Wraps torch's two foreach ops (module attributes, so every thread's calls): counts calls per thread,
    records each helper call's autograd modes, raises ``exc`` before call ``at`` (1-based, in whichever
    thread), sleeps ``main`` seconds in each of the calling thread's calls (``wait``: the calling thread's calls
    in a stage shared by the crew ``of`` wait until a helper made one; ``hold``: a helper's call waits until its
    stage's caller closed the stage, so no helper runs two chunks of one stage), and tracks the calls in flight."""

    def __init__(
        self,
        at: int = 0,
        exc: type[BaseException] = MemoryError,
        main: float = 0.0,
        wait: bool = False,
        hold: bool = False,
        of: Crew = crew,
    ) -> None:
        self.at, self.exc, self.main, self.wait, self.hold, self.of = at, exc, main, wait, hold, of
        self.helper_ran = threading.Event()
        self.calls = 0
        self.by_thread: dict[str, int] = {}
        self.helper_modes: set[tuple[bool, bool]] = set()  # (inference mode, grad mode) of each helper call
        self.caller_modes: set[tuple[bool, bool]] = set()  # the same, of the calling thread's calls
        self.in_flight = 0
        self.lock = threading.Lock()
        self.real = {name: getattr(torch, name) for name in ("_foreach_zero_", "_foreach_copy_")}
        self.real_work = _Job.work
        self.job = threading.local()  # the job a thread is working on

    @property
    def helper_calls(self) -> int:
        return self.calls - self.by_thread.get(threading.main_thread().name, 0)

    def _wrap(self, name: str) -> Any:
        real = self.real[name]

        def op(*args: Any) -> Any:
            me = threading.current_thread()
            with self.lock:
                self.calls += 1
                self.by_thread[me.name] = self.by_thread.get(me.name, 0) + 1
                if self.calls == self.at:
                    raise self.exc(f"injected before foreach call {self.calls}")
                helper = me is not threading.main_thread()
                modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
                (self.helper_modes if helper else self.caller_modes).add(modes)
                self.in_flight += 1
            try:
                if self.hold and helper:
                    job = self.job.current
                    deadline = time.monotonic() + PATIENCE
                    while not job.closed and time.monotonic() < deadline:
                        time.sleep(0.001)
                elif self.main and not helper:  # the helpers' time to take chunks too
                    time.sleep(self.main)
                if helper:
                    self.helper_ran.set()
                elif self.wait and self.of._busy.locked():  # a shared stage's chunk: until a helper took one too
                    self.helper_ran.wait(PATIENCE)
                return real(*args)
            finally:
                with self.lock:
                    self.in_flight -= 1

        return op

    def __enter__(self) -> Foreach:
        for name in self.real:
            setattr(torch, name, self._wrap(name))
        real_work, local = self.real_work, self.job

        def work(job: _Job, helper: bool = False) -> None:
            local.current = job
            try:
                real_work(job, helper)
            finally:
                local.current = None  # a job's views keep its pool alive

        _Job.work = work  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self.real.items():
            setattr(torch, name, real)
        _Job.work = self.real_work  # type: ignore[method-assign]


def _bytes(*tensor_lists: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for ts in tensor_lists for t in ts]


# How the torch executor runs a large stage: picked from measured times, or one way always.
LARGE = ["auto", "crew", "inline", "whole"]


@pytest.mark.parametrize("large", LARGE)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name", ["wide", "narrow"])
@given(raw=ops, seed=st.integers(0, 99))
@settings(max_examples=15)
def test_shared_stages_move_the_bytes_the_reference_moves(
    name: str, paged: bool, large: str, raw: list[Any], seed: int
) -> None:
    raw0 = [(k, 0 if k == "alloc" else a, b) for k, a, b in raw]
    drafts = 0 if paged else 2
    moved = []
    for executor in (TorchExecutor(large_stages=large), "reference"):
        pool = make_pool(name, paged)
        random_bytes([*pool.tensors, *pool.draft_tensors], seed)
        with shared(), SizeHints() as hints, mc.CacheManager(pool, executor=executor) as mgr:
            for events, _ in events_from_ops(raw0, 8, set(), draft_tokens=drafts):
                drive(mgr, events)
                mgr.flush_nowait()
        assert hints.wrong == [], "a stage's size hint is not its views' bytes"
        moved.append((pool.allocated_slots(), _bytes(pool.tensors)))
    assert moved[0][0] == moved[1][0]
    assert all(map(torch.equal, moved[0][1], moved[1][1]))


class SizeHints:
    """Checks every size hint the executor gives the crew (it lets a small stage skip the look at each view)
    against the bytes of the views it came with."""

    def __init__(self) -> None:
        self.wrong: list[tuple[int, int]] = []
        self.given = 0

    def __enter__(self) -> SizeHints:
        real = Crew.shares

        def shares(me: Crew, dests: list[torch.Tensor], nbytes: int | None = None) -> bool:
            if nbytes is not None:
                self.given += 1
                if nbytes != sum(v.nbytes for v in dests):
                    self.wrong.append((nbytes, sum(v.nbytes for v in dests)))
            return real(me, dests, nbytes)

        crew.shares = shares.__get__(crew)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del crew.shares


def test_size_hints_are_given_on_both_runs_paths() -> None:
    """The hint comes with a decode step's few runs (the kept group's size) and with many runs (summed)."""
    pool = mc.StatePool(SPECS["wide"], 16)
    executor = TorchExecutor()
    assert executor.max_runs == 4
    with shared(), SizeHints() as hints, mc.CacheManager(pool, executor=executor) as mgr:
        mgr.alloc(16, clear=False)
        mgr.flush_nowait()
        # One run of four slots (the few-runs path), then five runs of one (past max_runs: the rule's path).
        for srcs, dsts in (([1, 2, 3, 4], [5, 6, 7, 8]), ([1, 3, 5, 7, 9], [2, 4, 6, 8, 10])):
            before = hints.given
            mgr.copy_many(srcs, dsts)
            mgr.flush_nowait()
            assert hints.given > before
            before = hints.given
            mgr.clear_many(dsts)
            mgr.flush_nowait()
            assert hints.given > before
    assert hints.wrong == []


@pytest.mark.parametrize("large", LARGE)
@pytest.mark.parametrize("name", ["wide", "narrow"])
@given(raw=host_ops, seed=st.integers(0, 99))
@settings(max_examples=15)
def test_shared_host_stages_move_the_bytes_the_reference_moves(
    name: str, large: str, raw: list[Any], seed: int
) -> None:
    moved = []
    for executor in (TorchExecutor(large_stages=large), "reference"):
        pool = make_pool(name, False)
        host = mc.HostPool(pool.spec, 6)
        random_bytes([*pool.tensors, *host.tensors], seed)
        with shared(), mc.CacheManager(pool, executor=executor, host_pool=host) as mgr:
            mgr.alloc(8, clear=False)
            hosts: dict[int, int] = {}
            raw0 = [(k, 0 if k == "alloc" else a, b) for k, a, b in raw]
            for events, _, _ in host_events_from_ops(raw0, 8, set(range(1, 9)), 6, set()):
                drive(mgr, events, hosts=hosts)
                mgr.flush_nowait()
        moved.append((pool.allocated_slots(), _bytes(pool.tensors, host.tensors)))
    assert moved[0][0] == moved[1][0]
    assert all(map(torch.equal, moved[0][1], moved[1][1]))


def _step(mgr: mc.CacheManager) -> None:
    """A step of shared stages: a run of clears, copies of whole slots, offloads, restores, a commit."""
    mgr.submit(mc.Clear(1), mc.Clear(2), mc.Clear(3))
    mgr.copy_many([4, 5, 6], [7, 8, 1])
    mgr.offload_many([2, 4, 5])
    mgr.restore(1, 3, keep=True)
    mgr.submit(mc.CommitDraft(6, 1))


def _faulted_flush(
    at: int, exc: type[BaseException], *, hold: bool = False, main: float = 0.0, wait: bool = False
) -> tuple[Foreach, int]:
    """The step on the wide pool with a fault before foreach call ``at`` (0: none), then the repair; the pool
    and host pool against the oracle. Returns the wrapper and the shared stages of the faulted flush."""
    pool = make_pool("wide", False)
    host = mc.HostPool(pool.spec, 6)
    g = torch.Generator().manual_seed(at)
    for t in [*pool.tensors, *pool.draft_tensors, *host.tensors]:  # finite values: the oracle compares floats
        t.copy_(torch.randn(t.shape, generator=g))
    with shared(), mc.CacheManager(pool, host_pool=host) as mgr:
        mgr.alloc(8, clear=False)
        mgr.flush_nowait()
        oracle = SequentialOracle(pool, host)
        before = mgr.pending
        _step(mgr)
        oracle.apply(mgr.queued()[before:])
        stages = crew.stages
        with Foreach(at, exc, main, wait, hold) as calls:
            try:
                mgr.flush_nowait()
            except (mc.ExecutorError, KeyboardInterrupt):
                assert at, "no fault was injected"
                # The flush raised: no chunk of its stage may still be running, or the repair would race it.
                assert calls.in_flight == 0
                assert pool.unfinished >= 1
                assert mgr.flush_nowait().resumed_stages >= 1
            else:
                assert at == 0 or at > calls.calls
        shared_stages = crew.stages - stages
        oracle.assert_matches(pool)
        for got, want in zip(host.tensors, oracle.host, strict=True):
            for h in (1, 2, 3):  # the offloaded host slots
                assert torch.equal(got[:, h], want[:, h])
    return calls, shared_stages


def test_a_fault_before_any_foreach_call_of_shared_stages_then_one_flush_is_exact() -> None:
    calls, stages = _faulted_flush(0, MemoryError, wait=True)
    assert stages >= 4, "the step's clear, copy, offload and commit stages were not shared"
    assert calls.helper_calls >= 1, f"no helper thread ran a chunk: {calls.by_thread}"
    excs: list[type[BaseException]] = [MemoryError, RuntimeError, KeyboardInterrupt]
    for at in range(1, calls.calls + 1):
        _faulted_flush(at, excs[at % len(excs)], main=0.001)


def test_a_slow_helper_holds_up_only_its_own_chunk() -> None:
    # Each helper's chunk lasts until its stage's caller has taken every other chunk and closed the stage (a
    # helper another process holds): the calling thread takes the rest meanwhile, so a helper runs at most one
    # chunk a stage, and the stage does not wait for the helper to take more.
    calls, stages = _faulted_flush(0, MemoryError, hold=True)
    assert stages >= 4
    helpers = {k: v for k, v in calls.by_thread.items() if k != threading.main_thread().name}
    assert calls.by_thread[threading.main_thread().name] >= calls.calls - stages  # at most one chunk a stage
    assert sum(helpers.values()) <= stages, helpers


def test_a_dispatch_mode_keeps_every_op_on_the_calling_thread() -> None:
    pool = make_pool("wide", False)
    with shared(), mc.CacheManager(pool) as mgr:
        mgr.alloc(8, clear=False)
        mgr.flush_nowait()
        mgr.copy_many([1, 2, 3], [4, 5, 6])
        before = crew.stages
        with count_ops() as mode:
            mgr.flush_nowait()
        assert crew.stages == before
        assert mode.ops > 0


@pytest.mark.parametrize("made_in", ["inference_mode", "no_grad"])
def test_helpers_take_on_the_callers_autograd_mode(made_in: str) -> None:
    # An engine's pool made and flushed under inference_mode holds inference tensors: an in-place op on one
    # outside inference mode (a helper thread's default) raises; the helpers run under the modes the calling
    # thread runs the stage in (the runner's, whatever the engine's around the flush).
    mode = torch.inference_mode if made_in == "inference_mode" else torch.no_grad
    with mode():
        pool = make_pool("wide", False)
        random_bytes(pool.tensors, 1)
    want = [t.clone() for t in pool.tensors]
    with shared(), mode(), mc.CacheManager(pool) as mgr, Foreach(wait=True) as calls:
        mgr.alloc(8, clear=False)
        before = crew.stages
        mgr.copy_many([1, 2, 3, 4], [5, 6, 7, 8])
        mgr.flush_nowait()
        assert crew.stages > before
        assert calls.helper_calls >= 1, f"no helper thread ran a chunk: {calls.by_thread}"
    # The runner runs every stage under inference mode (grad off), whatever the engine's modes around the
    # flush; the calling thread's own calls, when it made any (a helper may take every chunk), ran under them too.
    assert calls.helper_modes == {(True, False)}
    assert calls.caller_modes <= {(True, False)}
    for t in want:
        t[:, 5:9] = t[:, 1:5].clone()
    assert all(map(torch.equal, _bytes(pool.tensors), _bytes(want)))


class _CountCalls(TorchFunctionMode):
    """A user's function mode: counts the torch calls it sees (on its own thread only: modes are
    thread-local)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("under_device", [False, True])
def test_a_function_mode_keeps_every_op_on_the_calling_thread(under_device: bool) -> None:
    pool = make_pool("wide", False)
    with shared(), mc.CacheManager(pool) as mgr:
        mgr.alloc(8, clear=False)
        mgr.copy_many([1, 2, 3, 4], [5, 6, 7, 8])
        before = crew.stages
        with contextlib.ExitStack() as stack:
            if under_device:  # a default-device context below the user's mode does not make it shareable
                stack.enter_context(torch.device("cpu"))
            mode = stack.enter_context(_CountCalls())
            mgr.flush_nowait()
        assert crew.stages == before
        assert mode.calls > 0


@pytest.mark.parametrize("how", ["set_default_device", "with torch.device", "both"])
def test_a_default_device_context_still_shares_stages(how: str) -> None:
    # torch.set_default_device (even to 'cpu') and `with torch.device(...)` push a function mode that only
    # gives factory functions a device; an engine that set one kept every stage on one thread before.
    pool = make_pool("wide", False)
    random_bytes(pool.tensors, 5)
    want = [t.clone() for t in pool.tensors]
    with shared(), mc.CacheManager(pool) as mgr, Foreach(wait=True) as calls:
        mgr.alloc(8, clear=False)
        mgr.flush_nowait()
        before = crew.stages
        mgr.copy_many([1, 2, 3, 4], [5, 6, 7, 8])
        try:
            with contextlib.ExitStack() as stack:
                if how != "with torch.device":
                    torch.set_default_device("cpu")
                if how != "set_default_device":
                    stack.enter_context(torch.device("cpu"))
                assert torch._C._len_torch_function_stack() > 0
                mgr.flush_nowait()
        finally:
            torch.set_default_device(None)
        assert crew.stages > before
        assert calls.helper_calls >= 1, f"no helper thread ran a chunk: {calls.by_thread}"
    for t in want:
        t[:, 5:9] = t[:, 1:5].clone()
    assert all(map(torch.equal, _bytes(pool.tensors), _bytes(want)))


class _CountingDevice(DeviceContext):
    """A user's mode built on the default-device context: it gives factory functions a device and counts the
    torch calls it sees, so it must see every op, as any other function mode must."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return super().__torch_function__(func, types, args, kwargs)


def test_a_mode_that_subclasses_the_default_device_context_keeps_every_op_on_the_calling_thread() -> None:
    # Only the default-device context itself does nothing to an in-place op; a subclass may do anything.
    pool = make_pool("wide", False)
    with shared(), mc.CacheManager(pool) as mgr:
        mgr.alloc(8, clear=False)
        mgr.flush_nowait()
        mgr.copy_many([1, 2, 3, 4], [5, 6, 7, 8])
        before = crew.stages
        mode = _CountingDevice()
        with mode:
            mgr.flush_nowait()
        assert crew.stages == before, "a stage went to the helpers, whose ops the mode does not see"
        assert mode.calls > 0


def test_the_default_thresholds_share_a_realistic_stage() -> None:
    # A Qwen3-Next-like TP rank's temporal state (4 x 128 x 128 fp32, 256 KiB a layer), 2 layers, 8 copies:
    # 4 MiB, past twice CHUNK_BYTES, so the defaults share it; a decode-sized state is not.
    spec = mc.StateSpec(num_layers=2, conv_shapes=[(64, 4)], temporal_shape=(4, 128, 128))
    pool = mc.StatePool(spec, 16)
    assert 8 * spec.slot_bytes >= 2 * CHUNK_BYTES
    random_bytes(pool.tensors, 3)
    want = [t.clone() for t in pool.tensors]
    srcs, dsts = list(range(1, 17, 2)), list(range(2, 17, 2))
    with shared(CHUNK_BYTES, MIN_VIEWS), mc.CacheManager(pool) as mgr:
        mgr.alloc(16, clear=False)
        mgr.flush_nowait()
        before = crew.stages
        mgr.copy_many(srcs, dsts)
        mgr.flush_nowait()
        assert crew.stages == before + 1  # the temporal tensor's stage (the conv one is under the threshold)
        mgr.copy_many([1], [2])  # one slot: 2 views, inline
        mgr.flush_nowait()
        assert crew.stages == before + 1
    for t in want:
        t[:, dsts] = t[:, srcs].clone()
    assert all(map(torch.equal, _bytes(pool.tensors), _bytes(want)))


def test_two_threads_flushing_shared_stages_get_their_own_bytes() -> None:
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for r in range(5):
                pool = make_pool("wide", False)
                random_bytes(pool.tensors, seed * 100 + r)
                want = [t.clone() for t in pool.tensors]
                with mc.CacheManager(pool) as mgr:
                    mgr.alloc(8, clear=False)
                    mgr.copy_many([1, 2, 3, 4], [5, 6, 7, 8])
                    mgr.clear_many([1, 2])
                    mgr.flush_nowait()
                for t in want:
                    t[:, 5:9] = t[:, 1:5].clone()
                    t[:, 1:3] = 0
                assert all(map(torch.equal, _bytes(pool.tensors), _bytes(want)))
        except BaseException as e:  # re-raised on the test's thread
            errors.append(e)

    with shared():
        torch.set_num_threads(2)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors


def test_an_interrupt_after_a_helper_got_the_stage_leaves_no_helper_writing() -> None:
    # A KeyboardInterrupt as the hand-out returns (a signal): run raises only once the helper's chunk ended, and
    # the next stage is not cut short by anything the first left behind.
    own = Crew(chunk_bytes=512, min_views=2)

    class InterruptAfterPut(queue.SimpleQueue):  # type: ignore[type-arg]
        """A helper's inbox whose next put, once armed, raises as it returns."""

        armed = False

        def put(self, job: Any, block: bool = True, timeout: float | None = None) -> None:
            super().put(job, block, timeout)
            if InterruptAfterPut.armed:
                InterruptAfterPut.armed = False
                raise KeyboardInterrupt("a signal as the hand-out returned")

    with shared():
        with pytest.MonkeyPatch.context() as m:  # the helper makes its inbox from the module's queue
            m.setattr(_crew, "queue", SimpleNamespace(SimpleQueue=InterruptAfterPut))
            (inbox,) = own._helpers(1)
        assert type(inbox) is InterruptAfterPut
        InterruptAfterPut.armed = True
        views = [torch.ones(128) for _ in range(8)]
        with Foreach(hold=True) as calls:
            with pytest.raises(KeyboardInterrupt):
                own.run(views)
            assert calls.in_flight == 0
            assert not InterruptAfterPut.armed
            for _ in range(3):
                views = [torch.ones(128) for _ in range(8)]
                own.run(views)
                assert calls.in_flight == 0
                assert all(bool((v == 0).all()) for v in views)


def test_a_helper_keeps_no_stage_alive() -> None:
    # A job holds its stage's views, and views keep the pool's storage: a pool the user drops must go.
    with shared():
        pool = torch.ones(64, 256)
        gone = weakref.ref(pool)
        crew.run(list(pool.unbind(0)))
        del pool
        assert _dropped(gone)


def _dropped(gone: weakref.ref[Any]) -> bool:
    """Whether ``gone``'s object is collected, once a helper that was handed a job got to drop it."""
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        gc.collect()
        if gone() is None:
            return True
        time.sleep(0.01)
    return False


def test_views_off_the_cpu_stay_on_the_calling_thread() -> None:
    # An accelerator's ops go on the calling thread's current stream: never to a helper (meta stands in).
    with shared():
        assert crew.shares([torch.empty(128) for _ in range(8)])
        assert not crew.shares([torch.empty(128, device="meta") for _ in range(8)])


def test_an_interrupt_as_the_caller_takes_a_chunk_does_not_hang_the_stage() -> None:
    # A signal reaches only the main thread, at any bytecode: here as its take() of a chunk returns, after the
    # job's books changed. run raises it once the helpers' chunks ended, and does not wait for a chunk that
    # never runs (it did, for ever, when the caller's chunks were counted).
    own = Crew(chunk_bytes=512, min_views=2)
    real_take = _Job.take
    raised: list[bool] = []

    def take(job: _Job, helper: bool) -> tuple[int, int] | None:
        got = real_take(job, helper)
        if not helper and got is not None and not raised:
            raised.append(True)
            raise KeyboardInterrupt("a signal as take returned")
        return got

    outcome: list[BaseException | None] = []

    def caller() -> None:
        try:
            own.run([torch.ones(128) for _ in range(8)])
            outcome.append(None)
        except BaseException as e:  # the test's thread reads it
            outcome.append(e)

    with shared():
        own._helpers(1)
        _Job.take = take  # type: ignore[method-assign]
        try:
            thread = threading.Thread(target=caller)
            thread.start()
            thread.join(PATIENCE)
        finally:
            _Job.take = real_take  # type: ignore[method-assign]
    assert not thread.is_alive(), "the stage hung"
    assert len(outcome) == 1 and isinstance(outcome[0], KeyboardInterrupt)


@pytest.mark.parametrize("when", ["the start raises", "an interrupt before the start", "an interrupt after it"])
def test_a_helper_that_did_not_start_is_handed_no_stage(when: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A thread that cannot start (a pids limit), or an interrupt as the start is called, leaves no inbox that
    # no one serves: later stages are shared with a helper that runs, and nothing keeps their views alive.
    own = Crew(chunk_bytes=512, min_views=2)
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if when == "the start raises":
            raise RuntimeError("can't start new thread")
        if when == "an interrupt after it":
            real_start(thread)
        raise KeyboardInterrupt("a signal as the helper started")

    with shared():
        monkeypatch.setattr(threading.Thread, "start", start)
        pool = torch.ones(64, 256)
        if when == "the start raises":
            own.run(list(pool.unbind(0)))  # on the calling thread alone
            assert bool((pool == 0).all())
        else:
            with pytest.raises(KeyboardInterrupt):
                own.run(list(pool.unbind(0)))
        monkeypatch.setattr(threading.Thread, "start", real_start)
        gone = [weakref.ref(pool)]
        del pool
        for _ in range(3):
            pool = torch.ones(64, 256)
            gone.append(weakref.ref(pool))
            with Foreach(wait=True, of=own) as calls:
                own.run(list(pool.unbind(0)))
            assert bool((pool == 0).all())
            assert calls.helper_calls >= 1, f"no helper ran a chunk: {calls.by_thread}"
            del pool
    assert all(_dropped(ref) for ref in gone), "a stage's job is kept by an inbox no one serves"


def test_an_interrupt_during_a_shared_stage_that_a_helper_failed_comes_out() -> None:
    # A helper's chunk fails, then the calling thread's chunk is interrupted: the flush raises the interrupt
    # (the helper's failure its context), not an ExecutorError the engine would carry on from; the next flush
    # repairs the step.
    pool = make_pool("wide", False)
    for t in pool.tensors:  # finite values: the oracle compares floats
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(9)))
    in_call, failed = threading.Event(), threading.Event()
    real_copy, real_fail = torch._foreach_copy_, _Job.fail

    def copy(*args: Any) -> Any:
        if not crew._busy.locked():
            return real_copy(*args)
        if threading.current_thread() is threading.main_thread():
            in_call.set()
            assert failed.wait(PATIENCE), "no helper failed"
            raise KeyboardInterrupt("a signal during the caller's chunk")
        assert in_call.wait(PATIENCE), "the calling thread took no chunk"
        raise MemoryError("a helper's chunk failed")

    def fail(job: _Job, error: BaseException) -> None:
        real_fail(job, error)
        if threading.current_thread() is not threading.main_thread():
            failed.set()

    with shared(), mc.CacheManager(pool) as mgr:
        mgr.alloc(8, clear=False)
        mgr.flush_nowait()
        oracle = SequentialOracle(pool)
        before = mgr.pending
        mgr.copy_many([1, 2, 3, 4], [5, 6, 7, 8])
        oracle.apply(mgr.queued()[before:])
        torch._foreach_copy_, _Job.fail = copy, fail  # type: ignore[assignment,method-assign]
        try:
            with pytest.raises(KeyboardInterrupt) as raised:
                mgr.flush_nowait()
        finally:
            torch._foreach_copy_, _Job.fail = real_copy, real_fail  # type: ignore[method-assign]
        assert isinstance(raised.value.__context__, MemoryError)
        assert mgr.flush_nowait().resumed_stages >= 1
    oracle.assert_matches(pool)


def test_an_interrupt_while_the_caller_waits_for_helpers_comes_out_after_a_helpers_failure() -> None:
    # One helper's chunk failed and another's still runs when a signal reaches the calling thread, waiting in
    # the stage's close (injected by a trace function at the wait's line): run raises the interrupt, with the
    # failure as its context, once no helper writes.
    own = Crew(chunk_bytes=512, min_views=2)
    close = _Job.close.__code__
    wait_line = close.co_firstlineno + next(
        i for i, line in enumerate(inspect.getsource(_Job.close).splitlines()) if "self.cond.wait()" in line
    )
    second, failed, interrupted = threading.Event(), threading.Event(), threading.Event()
    helper_calls: list[int] = []
    real_zero, real_fail = torch._foreach_zero_, _Job.fail

    def zero(*args: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            assert failed.wait(PATIENCE), "no helper failed"
            return real_zero(*args)
        helper_calls.append(1)
        if len(helper_calls) == 1:  # the first helper fails once the second one runs a chunk too
            assert second.wait(PATIENCE), "the second helper took no chunk"
            raise MemoryError("a helper's chunk failed")
        second.set()
        assert interrupted.wait(PATIENCE), "the calling thread was not interrupted"
        return real_zero(*args)

    def fail(job: _Job, error: BaseException) -> None:
        real_fail(job, error)
        if threading.current_thread() is not threading.main_thread():
            failed.set()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == wait_line and not interrupted.is_set():
            interrupted.set()
            raise KeyboardInterrupt("a signal as the caller waits for its helpers")
        return local

    with shared():
        torch.set_num_threads(3)  # two helpers
        own._helpers(2)
        torch._foreach_zero_, _Job.fail = zero, fail  # type: ignore[method-assign]
        sys.settrace(lambda frame, event, arg: local if frame.f_code is close else None)
        try:
            with pytest.raises(KeyboardInterrupt) as raised:
                own.run([torch.ones(128) for _ in range(8)])
        finally:
            sys.settrace(None)
            torch._foreach_zero_, _Job.fail = real_zero, real_fail  # type: ignore[method-assign]
    assert interrupted.is_set()
    assert isinstance(raised.value.__context__, MemoryError)
    assert len(helper_calls) == 2


def test_a_profiler_records_every_op_of_a_stage() -> None:
    # torch.profiler records the ops of the thread it was started on: a stage a helper shared would be missing
    # from the profile.
    pool = make_pool("wide", False)
    with shared(), mc.CacheManager(pool) as mgr:
        mgr.alloc(8, clear=False)
        mgr.flush_nowait()
        mgr.copy_many([1, 2, 3, 4], [5, 6, 7, 8])
        mgr.clear_many([1, 2, 3])
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with Foreach(wait=True) as calls, torch.profiler.profile(activities=cpu) as prof:
            mgr.flush_nowait()
    recorded = sum(e.count for e in prof.key_averages() if e.key in ("aten::_foreach_copy_", "aten::_foreach_zero_"))
    assert calls.calls >= 2
    assert recorded == calls.calls, f"{calls.calls} foreach calls made, {recorded} in the profile"
