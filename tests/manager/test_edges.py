"""The edges of the contract: exits under load, unusable dtypes, bad arguments, slot types of real schedulers."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache._core._planner import RotateStage, ShiftStage, Stage
from mambacache._executors._reference import ReferenceExecutor
from mambacache._executors._torch import TorchExecutor
from mambacache.testing import SequentialOracle

from ..support.strategies import events_from_ops, shift_ops
from ..support.util import drive, fill_random, small_spec


def exit_under_load(seed: int, sync: bool) -> None:
    pool = mc.StatePool(small_spec(), 16)
    refused = threading.Event()
    started = threading.Event()

    def worker(mgr: mc.CacheManager) -> None:
        started.set()
        while True:
            try:
                (s,) = mgr.alloc(1, clear=True)
                mgr.clear(s)
                mgr.release(s)
            except mc.ManagerClosedError:
                refused.set()
                return

    async def body() -> mc.CacheManager:
        async with mc.CacheManager(pool) as mgr:
            thread = threading.Thread(target=worker, args=(mgr,))
            thread.start()
            started.wait()
            await anyio.sleep(0.001 * (seed % 3))
        thread.join()
        return mgr

    if sync:
        with mc.CacheManager(pool) as mgr:
            thread = threading.Thread(target=worker, args=(mgr,))
            thread.start()
            started.wait()
        thread.join()
    else:
        mgr = anyio.run(body)
    assert refused.is_set()
    # Every accepted submit was taken by the exit flush: nothing is left queued or planned.
    assert mgr.pending == 0 and pool.unfinished == 0 and pool.ledger.owner is None


@pytest.mark.parametrize("sync", [False, True])
def test_a_thread_submitting_while_the_block_exits_never_loses_an_event(sync: bool) -> None:
    for seed in range(30):
        exit_under_load(seed, sync)


class NoRotateFor:
    """A (custom) executor that cannot swap one dtype: the kind of combination to refuse up front."""

    name = "no-rotate-f64"

    def __init__(self) -> None:
        self.inner = TorchExecutor()

    def execute(self, stage: Stage, tensor: torch.Tensor) -> None:
        if isinstance(stage, RotateStage) and tensor.dtype == torch.float64:
            raise NotImplementedError("index_copy_ not implemented for 'Double'")
        self.inner.execute(stage, tensor)


def test_an_executor_that_cannot_run_every_stage_kind_is_refused_when_the_manager_is_made() -> None:
    spec = mc.StateSpec(num_layers=2, conv_shapes=[(3, 2)], temporal_shape=(4,), temporal_dtype=torch.float64)
    pool = mc.StatePool(spec, 4)
    with pytest.raises(mc.UnsupportedDtypeError, match=r"no-rotate-f64.*RotateStage.*torch\.float64") as info:
        mc.CacheManager(pool, executor=NoRotateFor())
    assert isinstance(info.value, TypeError)
    assert pool.ledger.owner is None
    mc.CacheManager(mc.StatePool(small_spec(), 4), executor=NoRotateFor())  # no float64 there: accepted


class NoShift(NoRotateFor):
    """An executor that can do everything but shift a conv window."""

    name = "no-shift"

    def execute(self, stage: Stage, tensor: torch.Tensor) -> None:
        if isinstance(stage, ShiftStage):
            raise NotImplementedError("no shifted copies here")
        self.inner.execute(stage, tensor)


def test_an_executor_that_cannot_shift_is_refused_for_a_pool_with_conv_states_only() -> None:
    pool = mc.StatePool(small_spec(), 4)
    with pytest.raises(mc.UnsupportedDtypeError, match=r"no-shift.*ShiftStage.*torch\.bfloat16"):
        mc.CacheManager(pool, executor=NoShift())
    assert pool.ledger.owner is None
    no_conv = mc.StatePool.from_tensors([], torch.zeros(2, 5, 3))  # nothing to shift: accepted
    with mc.CacheManager(no_conv, executor=NoShift()) as mgr:
        mgr.alloc(2)


ODD_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.bits8, torch.bool]


@pytest.mark.parametrize("executor", ["torch", "npu", "reference"])
@pytest.mark.parametrize("dtype", ODD_DTYPES, ids=str)
@given(raw=shift_ops, seed=st.integers(0, 99))
@settings(max_examples=15)
def test_dtypes_without_index_kernels_run_every_stage_kind(
    executor: str, dtype: torch.dtype, raw: list[tuple[str, int, int]], seed: int
) -> None:
    spec = mc.StateSpec(
        num_layers=2, conv_shapes=[(3, 2)], temporal_shape=(2, 3), conv_dtype=dtype, temporal_dtype=dtype
    )
    pool = mc.StatePool(spec, 8)
    g = torch.Generator().manual_seed(seed)
    with mc.CacheManager(pool, executor=executor) as mgr:
        for t in pool.tensors:  # random bytes, every bit pattern allowed
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
        oracle = BytesOracle(pool)
        raw0 = [(k, 0 if k == "alloc" else a, b) for k, a, b in raw]  # alloc hands out the lowest free slot
        for events, _ in events_from_ops(raw0, 8, set(), max_shift=1):  # shifted copies too: width 2
            drive(mgr, events, oracle)
            mgr.flush_nowait()
            oracle.assert_matches(pool)
            # A forward writes random bytes into every live slot, so the next step's copies move more than zeros
            # (0/1 for bool: any op that copies a bool turns another byte into 1).
            top = 2 if dtype is torch.bool else 256
            for s in pool.allocated_slots():
                for t, want in zip(pool.tensors, oracle.tensors, strict=True):
                    row = torch.randint(0, top, want[:, s].shape, generator=g, dtype=torch.uint8)
                    t.view(torch.uint8)[:, s] = row
                    want[:, s] = row
                oracle.defined.add(s)


@pytest.mark.parametrize("executor", ["torch", "npu", "reference"])
@pytest.mark.parametrize("dtype", ODD_DTYPES, ids=str)
def test_dtypes_without_index_kernels_shift_whole_tokens(executor: str, dtype: torch.dtype) -> None:
    spec = mc.StateSpec(num_layers=2, conv_shapes=[(3, 4)], temporal_shape=(2, 3), conv_dtype=dtype)
    pool = mc.StatePool(spec, 6)
    g = torch.Generator().manual_seed(7)
    with mc.CacheManager(pool, executor=executor) as mgr:
        a, b, c = mgr.alloc(3)
        mgr.flush_nowait()
        top = 2 if dtype is torch.bool else 256  # any op that copies a bool turns another byte into 1
        for t in pool.tensors:
            t.view(torch.uint8).copy_(torch.randint(0, top, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
        oracle = BytesOracle(pool)
        events = [mc.CopyOnWrite(a, b, shift=1), mc.CopyOnWrite(c, c, shift=3), mc.CopyOnWrite(b, a, shift=2)]
        mgr.submit(*events)
        oracle.apply(events)
        mgr.flush_nowait()
        oracle.assert_matches(pool)
        token = pool.conv[0].element_size()  # bytes of one token on the byte view
        assert not pool.conv[0].view(torch.uint8)[:, c, :, token:].any()  # 3 of 4 tokens zeroed, bit for bit


class BytesOracle(SequentialOracle):
    """The sequential oracle on byte views: bit-exact for any dtype, NaN payloads included."""

    def __init__(self, pool: mc.StatePool) -> None:
        super().__init__(_Bytes(pool))  # type: ignore[arg-type]

    def assert_matches(self, pool: mc.StatePool) -> None:
        super().assert_matches(_Bytes(pool))  # type: ignore[arg-type]


class _Bytes:
    def __init__(self, pool: mc.StatePool) -> None:
        self.tensors = [t.view(torch.uint8) for t in pool.tensors]
        self.spec = pool.spec  # a shifted copy moves whole tokens: item-size runs of bytes (conv widths)
        self._pool = pool

    def allocated_slots(self) -> list[int]:
        return self._pool.allocated_slots()


@pytest.mark.parametrize(
    "make",
    [
        lambda: mc.StatePool(small_spec(), 2**62),
        lambda: mc.StatePool(small_spec(), 4, device="nonsense"),
        lambda: mc.StatePool(small_spec(), 4, device=3.5),
        lambda: mc.StatePool.from_memory_budget("spec", 1 << 20),  # type: ignore[arg-type]
        lambda: mc.StatePool.from_memory_budget(small_spec(), 2**62),
        lambda: mc.StateSpec(num_layers=1, conv_shapes=[], temporal_shape=(2,), temporal_dtype=torch.qint8),
        lambda: mc.StateSpec(num_layers=1, conv_shapes=[], temporal_shape=(2,), conv_dtype=torch.quint8),
        lambda: mc.CacheManager(mc.StatePool(small_spec(), 4), clear_on_alloc=1),  # type: ignore[arg-type]
        lambda: mc.CacheManager(mc.StatePool(small_spec(), 4), clear_on_alloc="no"),  # type: ignore[arg-type]
        lambda: mc.CacheManager(mc.StatePool(small_spec(), 4), max_failed_flushes=0),
    ],
    ids=[
        "2**62 slots",
        "device nonsense",
        "device float",
        "budget of a str spec",
        "budget 2**62",
        "qint8",
        "quint8",
        "clear_on_alloc=1",
        "clear_on_alloc=str",
        "max_failed_flushes=0",
    ],
)
def test_bad_arguments_get_a_typed_one_line_error(make: object) -> None:
    with pytest.raises(mc.MambaCacheError) as info:
        make()  # type: ignore[operator]
    assert "\n" not in str(info.value)


def test_a_device_that_is_not_here_is_a_typed_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(mc.InvalidArgumentError, match="not available"):
        mc.StatePool(small_spec(), 4, device="cuda")


@pytest.mark.parametrize("clear", [1, 0, "yes", None.__class__])
def test_alloc_clear_must_be_a_bool(clear: object) -> None:
    pool = mc.StatePool(small_spec(), 4)
    with mc.CacheManager(pool) as mgr:
        with pytest.raises(mc.InvalidArgumentError, match="clear must be a bool"):
            mgr.alloc(1, clear=clear)  # type: ignore[arg-type]
        assert pool.num_free == 4 and mgr.pending == 0


SLOT_FORMS = [
    lambda s: np.int64(s),
    lambda s: np.int32(s),
    lambda s: np.uint8(s),
    lambda s: torch.tensor(s),
    lambda s: torch.tensor(s, dtype=torch.int32),
]


@pytest.mark.parametrize("form", range(len(SLOT_FORMS)))
def test_slots_from_numpy_and_cpu_tensors_are_ints(form: int) -> None:
    as_form = SLOT_FORMS[form]
    pool = mc.StatePool(small_spec(), 6)
    fill_random(pool, 2)
    with mc.CacheManager(pool) as mgr:
        a, b, c = mgr.alloc(3, clear=False)
        oracle = SequentialOracle(pool)
        mgr.copy_on_write(as_form(a), as_form(b))
        mgr.submit(mc.Clear(as_form(c)), mc.CopyOnWrite(as_form(c), as_form(a)))  # type: ignore[arg-type]
        queued = mgr.queued()
        assert all(type(x) is int for ev in queued for x in (getattr(ev, "slot", 1), getattr(ev, "src", 1)))
        oracle.apply([mc.CopyOnWrite(a, b), mc.Clear(c), mc.CopyOnWrite(c, a)])
        mgr.flush_nowait()
        oracle.assert_matches(pool)
        mgr.release(as_form(a))
        assert not pool.is_allocated(a)


def test_leftover_work_reaches_the_backlog_before_the_pool_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager whose last flush could not run its backlog plans what is still queued into the pool's backlog
    while it still holds the pool: a manager opened on the pool at that moment would run newer work first."""
    from mambacache._core import _flush

    class Flaky:
        name = "flaky"
        armed = False

        def execute(self, stage: object, tensor: torch.Tensor) -> None:
            if self.armed:
                raise RuntimeError("injected")
            ReferenceExecutor().execute(stage, tensor)  # type: ignore[arg-type]

    pool = mc.StatePool(small_spec(), 4)
    ex = Flaky()
    owners: list[object] = []
    real = _flush.plan_step

    def spy(events: list[object]) -> object:
        owners.append(pool.ledger.owner)
        return real(events)  # type: ignore[arg-type]

    mgr = mc.CacheManager(pool, executor=ex, max_failed_flushes=100)
    with pytest.raises(mc.ExecutorError), mgr:
        (a,) = mgr.alloc(1)
        ex.armed = True
        with pytest.raises(mc.ExecutorError):
            mgr.flush_nowait()  # the alloc's clear stays in the backlog
        mgr.clear(a)  # queued behind it; the exit flush fails on the backlog again
        monkeypatch.setattr(_flush, "plan_step", spy)
    assert owners and owners[-1] is not None  # planned into the backlog while the pool was still claimed
    assert pool.ledger.owner is None and pool.unfinished == 2


@pytest.mark.parametrize("num_slots", [2**63, 10**20])
def test_a_pool_past_int64_slots_is_an_allocation_error(num_slots: int) -> None:
    """Past torch's int64 sizes: the typed allocation error (a MemoryError), not torch's bare TypeError."""
    with pytest.raises(mc.PoolAllocationError, match=f"a pool of {num_slots} slots") as err:
        mc.StatePool(small_spec(), num_slots)
    assert isinstance(err.value, MemoryError)
