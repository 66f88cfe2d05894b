"""What engines need to embed mambacache: sync loops, engine-owned tensors, bulk submits, index buffers, leaks."""

from __future__ import annotations

import threading

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache.audit import OpAudit
from mambacache.testing import SequentialOracle

from ..support.strategies import events_from_ops, ops
from ..support.util import fill_random, small_spec

# -- synchronous use -------------------------------------------------------


def test_sync_block_and_flush_nowait_match_the_async_flush() -> None:
    def run_sync() -> tuple[mc.StepReport, list[torch.Tensor]]:
        pool = mc.StatePool(small_spec(), 8)
        fill_random(pool, 1)
        with mc.CacheManager(pool) as mgr:
            a, b, c = mgr.alloc(3)
            mgr.flush_nowait()
            fill_random(pool, 2)
            mgr.submit(mc.CopyOnWrite(a, c), mc.CopyOnWrite(b, a), mc.CopyOnWrite(c, b), mc.Clear(c))
            report = mgr.flush_nowait()
        return report, pool.tensors

    async def run_async() -> tuple[mc.StepReport, list[torch.Tensor]]:
        pool = mc.StatePool(small_spec(), 8)
        fill_random(pool, 1)
        async with mc.CacheManager(pool) as mgr:
            a, b, c = mgr.alloc(3)
            await mgr.flush()
            fill_random(pool, 2)
            mgr.submit(mc.CopyOnWrite(a, c), mc.CopyOnWrite(b, a), mc.CopyOnWrite(c, b), mc.Clear(c))
            report = await mgr.flush()
        return report, pool.tensors

    r1, t1 = run_sync()
    r2, t2 = anyio.run(run_async)
    strip = {"plan_s": 0.0, "execute_s": 0.0}
    assert r1.__class__(**{**_fields(r1), **strip}) == r2.__class__(**{**_fields(r2), **strip})
    assert r1.stages == 2 and r1.zeroed == 1 and r1.copied == 2
    assert all(torch.equal(x, y) for x, y in zip(t1, t2, strict=True))


def _fields(r: mc.StepReport) -> dict[str, object]:
    return {f: getattr(r, f) for f in r.__dataclass_fields__}


@pytest.mark.anyio
async def test_flush_nowait_from_threads_and_async_flushes_run_one_at_a_time() -> None:
    pool = mc.StatePool(small_spec(), 64)
    fill_random(pool, 3)
    oracle_events: list[object] = []
    lock = threading.Lock()
    async with mc.CacheManager(pool) as mgr:
        slots = mgr.alloc(64)
        await mgr.flush()
        fill_random(pool, 4)
        oracle = SequentialOracle(pool)
        steps: list[int] = []

        def worker(k: int) -> None:
            for i in range(50):
                with lock:  # the oracle's order must be the submit order
                    ev = mc.CopyOnWrite(slots[(k * 7 + i) % 64], slots[(k * 13 + 3 * i + 1) % 64])
                    mgr.submit(ev)
                    oracle_events.append(ev)
                steps.append(mgr.flush_nowait().step)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for _ in range(50):
            steps.append((await mgr.flush()).step)
            await anyio.lowlevel.checkpoint()
        for t in threads:
            await anyio.to_thread.run_sync(t.join)
        await mgr.flush()
    oracle.apply(oracle_events)  # type: ignore[arg-type]
    oracle.assert_matches(pool)
    assert sorted(steps) == list(range(1, len(steps) + 1))  # every step ran once: none interleaved


# -- engine-owned tensors --------------------------------------------------


def test_from_tensors_adopts_the_engines_storage() -> None:
    layers, slots = 3, 6
    raw = torch.zeros(layers * (slots + 1) * (12 + 10 + 24))  # one raw buffer, as engines allocate it
    sizes = [layers * (slots + 1) * k for k in (12, 10, 24)]
    c0, c1, t = (
        x.view(layers, slots + 1, *shape)
        for x, shape in zip(raw.split(sizes), [(6, 2), (5, 2), (2, 3, 4)], strict=True)
    )
    pool = mc.StatePool.from_tensors(conv=[c0, c1], temporal=t)
    assert pool.num_slots == slots and pool.spec.num_layers == layers
    assert pool.spec.conv_shapes == ((6, 2), (5, 2)) and pool.spec.temporal_shape == (2, 3, 4)
    assert pool.spec.conv_dtype == torch.float32 and pool.conv[0].data_ptr() == c0.data_ptr()
    with mc.CacheManager(pool) as mgr:
        a, b = mgr.alloc(2)
        mgr.flush_nowait()
        t[:, a] = 5.0
        mgr.copy_on_write(a, b)
        mgr.flush_nowait()
    assert bool((t[:, b] == 5.0).all()) and bool((t[:, 0] == 0).all())  # written through, padding untouched


@pytest.mark.parametrize(
    ("conv", "temporal", "match"),
    [
        ([torch.zeros(2, 5, 3)], torch.zeros(2, 4, 3), "slots"),
        ([torch.zeros(3, 5, 3)], torch.zeros(2, 5, 3), "layers"),
        ([torch.zeros(2, 5)], torch.zeros(2, 5, 3), "num_layers"),
        ([torch.zeros(2, 5, 2, 3).transpose(2, 3)], torch.zeros(2, 5, 3), "each \\(layer, slot\\) row contiguously"),
        ([torch.zeros(2, 5, 3), torch.zeros(2, 5, 3, dtype=torch.float16)], torch.zeros(2, 5, 3), "one dtype"),
        ([torch.zeros(2, 5, 3, requires_grad=True)], torch.zeros(2, 5, 3), "grad"),
        ([torch.zeros(2, 5, 3, device="meta")], torch.zeros(2, 5, 3), "meta"),
        ([], torch.zeros(2, 1, 3), "at least 2"),
        (torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), "sequence"),
        ([np.zeros((2, 5, 3))], torch.zeros(2, 5, 3), "Tensor"),
    ],
)
def test_from_tensors_refuses_what_it_cannot_drive(conv: object, temporal: torch.Tensor, match: str) -> None:
    with pytest.raises(mc.InvalidArgumentError, match=match):
        mc.StatePool.from_tensors(conv=conv, temporal=temporal)  # type: ignore[arg-type]


def test_paged_tensors_interleaved_in_block_pages_are_adopted_as_they_are() -> None:
    # vLLM's layout: one page per (layer, block) holding the block's conv state, then its SSM state, then slack.
    layers, blocks, conv, ssm = 2, 6, (4, 3), (2, 5)
    page = torch.zeros(layers, blocks, 12 + 10 + 2)
    c, t = page[..., :12].view(layers, blocks, *conv), page[..., 12:22].view(layers, blocks, *ssm)
    pool = mc.StatePool.from_tensors([c], t)
    assert pool.conv[0].data_ptr() == c.data_ptr() and not pool.temporal.is_contiguous()
    with mc.CacheManager(pool) as mgr:
        a, b = mgr.alloc(2)
        mgr.flush_nowait()
        c[:, a], t[:, a] = 3.0, 4.0
        mgr.copy_on_write(a, b, shift=1)
        mgr.flush_nowait()
    assert bool((c[:, b, :, :2] == 3.0).all()) and bool((c[:, b, :, 2] == 0).all()) and bool((t[:, b] == 4.0).all())
    assert bool((page[..., 22:] == 0).all())  # the slack between pages is never written


def test_paged_rows_that_share_a_byte_are_refused_exactly() -> None:
    page = torch.zeros(2, 6, 22)
    conv = page[..., :12].view(2, 6, 4, 3)
    with pytest.raises(mc.InvalidArgumentError, match=r"pool tensors conv\[0\] and temporal overlap"):
        mc.StatePool.from_tensors([conv], page[..., 11:21].view(2, 6, 2, 5))  # one element in common per page
    mc.StatePool.from_tensors([conv], page[..., 12:22].view(2, 6, 2, 5))  # adjacent: fine
    # A slot stride shorter than a row: rows of one tensor overlap each other.
    squeezed = page.reshape(-1)[: 2 * 6 * 8 + 4].as_strided((2, 6, 12), (48, 8, 1))
    with pytest.raises(mc.InvalidArgumentError, match="the rows of temporal overlap"):
        mc.StatePool.from_tensors([], squeezed)


def test_from_tensors_refuses_overlapping_views() -> None:
    raw = torch.zeros(2 * 5 * 3 * 2)
    a = raw[:30].view(2, 5, 3)
    b = raw[15:45].view(2, 5, 3)
    with pytest.raises(mc.InvalidArgumentError, match="overlap"):
        mc.StatePool.from_tensors(conv=[a], temporal=b)


# -- engines that pick slot ids ----------------------------------------------


def test_alloc_slots_takes_exactly_those_slots_all_or_nothing() -> None:
    pool = mc.StatePool(small_spec(), 8)
    with mc.CacheManager(pool) as mgr:
        assert mgr.alloc_slots(np.array([5, 2]), request_id="r1") == [5, 2]
        assert mgr.alloc(2) == [1, 3]  # the free list skips what alloc_slots took
        before = (pool.num_free, mgr.pending)
        with pytest.raises(mc.SlotStateError, match=r"\[2\]"):
            mgr.alloc_slots([4, 2], request_id="r2")
        for bad in ([4, 4], [0], [9], [True]):
            with pytest.raises(mc.InvalidSlotError):
                mgr.alloc_slots(bad)
        assert (pool.num_free, mgr.pending) == before and not pool.is_allocated(4)
        assert mgr.held() == {1: None, 2: "r1", 3: None, 5: "r1"}
        mgr.release_many(torch.tensor([5, 2]), request_id="r1")
        assert mgr.alloc(3) == [2, 4, 5]


# -- backpressure ------------------------------------------------------------


@pytest.mark.anyio
async def test_alloc_wait_waits_first_come_first_served_and_cancels_cleanly() -> None:
    pool = mc.StatePool(small_spec(), 3)
    async with mc.CacheManager(pool) as mgr:
        held = mgr.alloc(3, request_id="old")
        got: list[tuple[str, list[int]]] = []

        async def want(n: int, rid: str) -> None:
            got.append((rid, await mgr.alloc_wait(n, request_id=rid)))

        async def until(cond: object, what: str) -> None:
            with anyio.fail_after(10):  # generous: CI machines are shared
                while True:
                    if cond():  # type: ignore[operator]
                        return
                    await anyio.sleep(0.001)

        async with anyio.create_task_group() as tg:
            tg.start_soon(want, 2, "big")
            await until(lambda: mgr.waiting == 1, "big waits")
            tg.start_soon(want, 1, "small")
            await until(lambda: mgr.waiting == 2, "small waits")
            mgr.release(held[0])  # one free: "small" fits but must not overtake "big"
            await anyio.sleep(0.02)
            assert got == []
            mgr.release(held[1])
            await until(lambda: len(got) == 1, "big served")
            assert got == [("big", [1, 2])]
            mgr.release(held[2])
        assert got == [("big", [1, 2]), ("small", [3])]
        with anyio.move_on_after(0.02):
            await mgr.alloc_wait(1, request_id="never")
        assert pool.num_free == 0 and "never" not in mgr.held().values() and mgr.waiting == 0
        with pytest.raises(mc.InvalidArgumentError, match="never be met"):
            await mgr.alloc_wait(4)


# -- bulk submits --------------------------------------------------------------


@given(raw=ops, seed=st.integers(0, 99), form=st.sampled_from(["list", "numpy", "tensor"]))
@settings(max_examples=60)
def test_bulk_forms_equal_that_many_single_events(raw: list[tuple[str, int, int]], seed: int, form: str) -> None:
    def as_form(xs: list[int]) -> object:
        return {"list": xs, "numpy": np.array(xs, dtype=np.int64), "tensor": torch.tensor(xs, dtype=torch.int64)}[form]

    raw0 = [(k, 0 if k == "alloc" else a, b) for k, a, b in raw]
    results = []
    for bulk in (False, True):
        pool = mc.StatePool(small_spec(), 8)
        fill_random(pool, seed)
        reports = []
        with mc.CacheManager(pool) as mgr:
            for events, _ in events_from_ops(raw0, 8, set()):
                i = 0
                while i < len(events):  # runs of one kind go out as one bulk call
                    ev = events[i]
                    j = i
                    while j < len(events) and type(events[j]) is type(ev) and not isinstance(ev, mc.Alloc):
                        j += 1
                    group = events[i : max(j, i + 1)]
                    if isinstance(ev, mc.Alloc):
                        mgr.alloc(1, clear=ev.clear)
                    elif not bulk:
                        mgr.submit(*group)  # type: ignore[arg-type]
                    elif isinstance(ev, mc.Clear):
                        mgr.clear_many(as_form([e.slot for e in group]))  # type: ignore[attr-defined]
                    elif isinstance(ev, mc.Release):
                        mgr.release_many(as_form([e.slot for e in group]))  # type: ignore[attr-defined]
                    else:
                        srcs = [e.src for e in group]  # type: ignore[attr-defined]
                        mgr.copy_many(as_form(srcs), as_form([e.dst for e in group]))  # type: ignore[attr-defined]
                    i = max(j, i + 1)
                reports.append(mgr.flush_nowait())
        results.append(([(r.events, r.zeroed, r.copied, r.elided) for r in reports], pool))
    (r1, p1), (r2, p2) = results
    assert r1 == r2
    assert p1.allocated_slots() == p2.allocated_slots()
    for s in p1.allocated_slots():
        assert all(torch.equal(x[:, s], y[:, s]) for x, y in zip(p1.tensors, p2.tensors, strict=True))


def test_bulk_forms_are_all_or_nothing_with_typed_errors() -> None:
    pool = mc.StatePool(small_spec(), 8)
    with mc.CacheManager(pool) as mgr:
        a, b, c = mgr.alloc(3, request_id="r")
        before = (mgr.pending, pool.num_free)
        bad_calls = [
            (lambda: mgr.clear_many([a, 7]), mc.SlotStateError),
            (lambda: mgr.release_many([a, a]), mc.SlotStateError),
            (lambda: mgr.release_many([a, b], request_id="other"), mc.SlotStateError),
            (lambda: mgr.copy_many([a, b], [c]), mc.InvalidArgumentError),
            (lambda: mgr.copy_many([a], [0]), mc.InvalidSlotError),
            (lambda: mgr.clear_many(np.array([1.0, 2.0])), mc.InvalidSlotError),
            (lambda: mgr.clear_many(torch.tensor([[a]])), mc.InvalidSlotError),
            (lambda: mgr.clear_many(torch.tensor([a], device="meta")), mc.InvalidSlotError),
            (lambda: mgr.clear_many("12"), mc.InvalidSlotError),
            (lambda: mgr.clear_many([a], request_id=3), mc.InvalidArgumentError),  # type: ignore[arg-type]
        ]
        for call, error in bad_calls:
            with pytest.raises(error):
                call()
            assert (mgr.pending, pool.num_free) == before
        mgr.clear_many([])  # empty is fine
        assert mgr.pending == before[0]


# -- tenants and leak checks ---------------------------------------------------


def test_a_request_id_that_is_not_the_tenant_is_refused() -> None:
    pool = mc.StatePool(small_spec(), 4)
    with mc.CacheManager(pool) as mgr:
        (a,) = mgr.alloc(1, request_id="r1")
        (b,) = mgr.alloc(1, request_id="r2")
        before = mgr.pending
        for call in (
            lambda: mgr.clear(a, request_id="r2"),
            lambda: mgr.release(a, request_id="r2"),
            lambda: mgr.copy_on_write(a, b, request_id="r1"),  # the destination is r2's
        ):
            with pytest.raises(mc.SlotStateError, match="belongs to"):
                call()
        assert mgr.pending == before and pool.is_allocated(a)
        mgr.copy_on_write(a, b, request_id="r2")  # reading another tenant's slot is a fork: fine
        mgr.clear(a)  # None: no check
        mgr.release(a, request_id="r1")


def test_held_and_check_idle_name_leaked_slots_and_tenants() -> None:
    pool = mc.StatePool(small_spec(), 4)
    with mc.CacheManager(pool) as mgr:
        mgr.check_idle()
        a, b = mgr.alloc(2, request_id="leaky")
        (c,) = mgr.alloc(1)
        mgr.release(b)
        assert mgr.held() == {a: "leaky", c: None}
        with pytest.raises(mc.SlotLeakError, match=r"2 slot\(s\) held while idle: 1 \('leaky'\), 3 \(None\)") as info:
            mgr.check_idle()
        assert info.value.held == {a: "leaky", c: None}
        mgr.release_many([a, c])
        mgr.check_idle()


def test_check_idle_reports_host_slots_of_aborted_swapped_out_requests() -> None:
    pool, host = mc.StatePool(small_spec(), 4), mc.HostPool(small_spec(), 3)
    with mc.CacheManager(pool, host_pool=host) as mgr:
        (a,) = mgr.alloc(1, request_id="r")
        h = mgr.offload(a, request_id="r")  # swapped out ...
        mgr.release(a, request_id="r")  # ... and aborted without drop(h)
        mgr.flush_nowait()
        assert mgr.held() == {} and host.held() == {h: "r"}
        with pytest.raises(mc.SlotLeakError, match=r"1 host slot\(s\) held while idle: 1 \('r'\)") as info:
            mgr.check_idle()
        assert info.value.held == {} and info.value.host_held == {h: "r"}
        mgr.check_idle(host=False)  # the pool alone is idle
        (b,) = mgr.alloc(1, request_id="q")
        with pytest.raises(mc.SlotLeakError, match=rf"1 slot\(s\) held while idle: {b} \('q'\); 1 host slot") as info:
            mgr.check_idle(host=True)
        assert info.value.held == {b: "q"}
        with pytest.raises(mc.InvalidArgumentError):
            mgr.check_idle(host=1)  # type: ignore[arg-type]
        mgr.release(b)
        mgr.drop(h)
        mgr.check_idle()


# -- the persistent index tensor -----------------------------------------------


def test_state_indices_keep_their_address_and_pad_with_slot_zero() -> None:
    idx = mc.StateIndices(capacity=6, device="cpu", num_slots=8)
    ptr = idx.tensor.data_ptr()
    assert idx.update([3, 1, 8]).tolist() == [3, 1, 8]
    assert idx.tensor.tolist() == [3, 1, 8, 0, 0, 0] and idx.size == 3
    idx.update(np.array([2], dtype=np.int32))
    assert idx.tensor.tolist() == [2, 0, 0, 0, 0, 0]
    idx.update(torch.tensor([4, 0, 5]))  # 0 is allowed: a padding entry
    assert idx.tensor.tolist() == [4, 0, 5, 0, 0, 0]
    idx.update([])
    assert idx.tensor.tolist() == [0] * 6 and idx.tensor.data_ptr() == ptr and idx.tensor.dtype == torch.int32
    for bad, error in (([1] * 7, mc.InvalidArgumentError), ([9], mc.InvalidSlotError), ([-1], mc.InvalidSlotError)):
        with pytest.raises(error):
            idx.update(bad)
    assert idx.tensor.tolist() == [0] * 6
    with pytest.raises(mc.InvalidArgumentError):
        mc.StateIndices(capacity=0)


def test_audit_index_updates_and_bulk_submits_neither_sync_nor_allocate_per_slot() -> None:
    idx = mc.StateIndices(capacity=1024, num_slots=1000)
    pool = mc.StatePool(mc.StateSpec(num_layers=1, conv_shapes=(), temporal_shape=(2,)), 1000)
    with mc.CacheManager(pool) as mgr:
        slots = mgr.alloc(1000)
        mgr.flush_nowait()
        counts = []
        for n in (10, 1000):
            host = np.arange(1, n + 1)
            srcs, dsts = torch.tensor(slots[:n]), torch.tensor(slots[::-1][:n])
            with OpAudit() as audit:
                idx.update(host)
            with OpAudit() as submit_audit:
                mgr.clear_many(host)
                mgr.copy_many(srcs, dsts)
            report, subs = audit.report(), submit_audit.report()
            assert report.sync_ops == () and subs.sync_ops == ()
            counts.append((report.op_counts, subs.op_counts, report.total_temp_bytes))
            mgr.flush_nowait()
    # As many ops for 1,000 slots as for 10 (none for the submits: they are host work), one staging tensor.
    assert counts[0][:2] == counts[1][:2] and counts[1][1] == {}, counts
    assert sum(counts[1][0].values()) <= 8 and counts[1][2] <= 1000 * 4
