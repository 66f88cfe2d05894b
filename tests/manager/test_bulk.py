"""The bulk forms ``commit_many``, ``offload_many`` and ``restore_many``: each is its single calls in one.

The property test runs every bulk call on one manager and the loop of its single
calls on a twin (same pool, same fill, same history), then compares what they
queued, the ledgers, the host slots handed out, the errors, and after each flush
the bytes of both pools (and the oracle's). A bulk call that fails must leave its
manager exactly as it was, where the loop may have queued a prefix; the twin is
then rebuilt from the history of the calls that succeeded.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

import mambacache as mc
from mambacache import tracing
from mambacache.testing import SequentialOracle
from mambacache.tracing import analyze_lines

from ..support.sweep import fault_points
from ..support.util import VARIANTS, flush_with_fault, small_spec

N, H, K = 8, 5, 2  # pool slots, host slots, draft tokens
SPEC = small_spec()
TENANTS = ("a", "b")


def fill(pool: mc.StatePool, host: mc.HostPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in [*pool.tensors, *pool.draft_tensors, *host.tensors]:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype) + 1.0)


def as_form(xs: list[Any], form: int) -> Any:
    """``xs`` as a list, a numpy array or a CPU tensor (ints; a float among them makes a float array)."""
    if form == 0 or not xs:
        return xs
    if form == 1:
        return np.array(xs)
    return torch.tensor(xs)


class Twin:
    """A pool with draft buffers, a host pool and an open manager (with ``start``: four live slots, three host
    slots held), filled from ``seed``, with ``history`` (calls that succeeded, and flushes) replayed on it."""

    def __init__(self, seed: int, history: list[Callable[[Twin], object]], start: bool = True) -> None:
        self.pool, self.host = mc.StatePool(SPEC, N, draft_tokens=K), mc.HostPool(SPEC, H)
        self.stack = contextlib.ExitStack()
        self.mgr = mgr = self.stack.enter_context(mc.CacheManager(self.pool, host_pool=self.host))
        if start:  # live slots of two tenants, and host copies
            a, b = mgr.alloc(2, "a"), mgr.alloc(2, "b")
            mgr.offload(a[0], "a"), mgr.offload(a[1], "a"), mgr.offload(b[0], "b")
            mgr.flush_nowait()
        fill(self.pool, self.host, seed)
        for call in history:
            call(self)

    def state(self) -> tuple[list[Any], dict[int, str | None], dict[int, str | None], int]:
        return self.mgr.queued(), self.mgr.held(), self.host.held(), self.host.num_free

    def forward(self, step: int) -> None:
        """A forward writes every live slot between flushes (so a stale copy shows)."""
        for s in self.pool.allocated_slots():
            for t in self.pool.tensors:
                t[:, s] = float(step * 100 + s)

    def step(self, step: int) -> mc.StepReport:
        report = self.mgr.flush_nowait()
        self.forward(step)
        return report


KINDS = (
    "commit", "commit", "offload", "offload", "restore", "restore", "alloc", "alloc", "release", "flush", "cow", "drop",
)  # fmt: skip
# Defects a draw may add: the argument kinds are found before any state is looked at.
ARG_DEFECTS = ("range", "float", "length", "device")
DEFECTS = ("none", "none", "none", "none", "unheld", "host", "accepted", *ARG_DEFECTS)
calls = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.lists(st.integers(0, 10**6), max_size=6),
        st.integers(0, 10**6),
        st.sampled_from(DEFECTS),
    ),
    min_size=4,
    max_size=24,
)


def _args(twin: Twin, kind: str, picks: list[int], b: int, defect: str) -> dict[str, Any] | None:
    """A bulk call's arguments drawn on ``twin``'s live state, with ``defect`` put in where it fits (``defect``:
    the one put in, or "none"); None if no call fits."""
    live, held = twin.pool.allocated_slots(), sorted(twin.host.held())
    if not live or (kind == "restore" and not held):
        return None
    slots = [live[p % len(live)] for p in picks]
    tenants = twin.mgr.held()
    rid = [None, tenants[slots[0]] if slots else None, TENANTS[b % 2]][b % 3]
    args: dict[str, Any] = {"slots": slots, "request_id": rid}
    if kind == "commit":
        args["accepted"] = b % (K + 1) if b % 5 == 0 else [(p // 7) % (K + 1) for p in picks]
    if kind == "restore":
        # Half the draws read distinct host slots (a swap-in of many requests), half any (repeats too).
        hosts = [held[(j + b) % len(held)] if b % 2 else held[(p // 7) % len(held)] for j, p in enumerate(picks)]
        args["hosts"], args["keep"] = hosts, b % 4 == 0
    i = b % len(slots) if slots else 0
    free = sorted(set(range(1, N + 1)) - set(live))
    applied = defect = defect if slots else "none"
    if defect == "unheld" and free:
        slots[i] = free[b % len(free)]
    elif defect == "host" and kind == "restore" and len(held) < H:
        args["hosts"][i] = sorted(set(range(1, H + 1)) - set(held))[0]
    elif defect == "accepted" and kind == "commit":
        acc = args["accepted"]
        args["accepted"] = [*acc] if isinstance(acc, list) else [acc] * len(slots)
        args["accepted"][i] = K + 1 if b % 2 else -1
    elif defect == "range":
        (args["hosts"] if kind == "restore" and b % 2 else slots)[i] = [0, N + H][b % 2]
    elif defect == "float":
        slots[i] = float(slots[i])
    elif defect == "length" and isinstance(args.get("hosts" if kind == "restore" else "accepted"), list):
        key = "hosts" if kind == "restore" else "accepted"
        args[key] = args[key][:-1]
    elif defect == "device":
        slots = torch.tensor(slots, device="meta")  # type: ignore[assignment]
    else:
        applied = "none"
    args["defect"] = applied
    form = b % 3
    args["slots"] = slots if applied == "device" else as_form(slots, form)
    if kind == "restore":
        args["hosts"] = as_form(args["hosts"], form)
    if kind == "commit" and isinstance(args["accepted"], list):
        args["accepted"] = as_form(args["accepted"], form)
    return args


def bulk(twin: Twin, kind: str, args: dict[str, Any]) -> Any:
    mgr = twin.mgr
    if kind == "commit":
        return mgr.commit_many(args["slots"], args["accepted"], args["request_id"])
    if kind == "offload":
        return mgr.offload_many(args["slots"], args["request_id"])
    return mgr.restore_many(args["hosts"], args["slots"], args["request_id"], keep=args["keep"])


def loop(twin: Twin, kind: str, args: dict[str, Any]) -> Any:
    """The single calls a bulk call stands for, in order, over the elements of its inputs as given."""
    mgr, slots, rid = twin.mgr, list(args["slots"]), args["request_id"]
    if kind == "commit":
        acc = args["accepted"]
        accepted = list(acc) if isinstance(acc, (list, np.ndarray, torch.Tensor)) else [acc] * len(slots)
        for s, a in zip(slots, accepted, strict=True):
            mgr.commit_draft(s, a, rid)
        return None
    if kind == "offload":
        return [mgr.offload(s, rid) for s in slots]
    for h, s in zip(list(args["hosts"]), slots, strict=True):
        mgr.restore(h, s, rid, keep=args["keep"])
    return None


def _ledger_call(twin: Twin, kind: str, b: int) -> Callable[[Twin], object] | None:
    """An alloc (tenant ``a`` or ``b``, cleared or not), a release or a fork of live slots (shifted by one
    token, in place too, for some draws), or a drop of a held host slot, as a replayable call."""
    live, held = twin.pool.allocated_slots(), sorted(twin.host.held())
    if kind == "alloc" and twin.pool.num_free:
        return lambda t: t.mgr.alloc(1, TENANTS[b % 2], clear=b % 3 > 0)
    if kind in ("release", "cow") and live:
        slot, dst = live[b % len(live)], live[(b // 7) % len(live)]
        k = (b // 49) % 2  # the spec's narrowest conv is 2 tokens wide: shift 0 or 1
        return (
            (lambda t: t.mgr.release(slot))
            if kind == "release"
            else (lambda t: t.mgr.copy_on_write(slot, dst, shift=k))
        )
    if kind == "drop" and held:
        host = held[b % len(held)]
        return lambda t: t.mgr.drop(host)
    return None


def _outcome(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return call(), None
    except Exception as exc:  # the comparison below says which errors are right
        return None, exc


@given(draws=calls, seed=st.integers(0, 2**16))
@settings(max_examples=50)
def test_each_bulk_form_equals_its_single_calls_in_order(
    draws: list[tuple[str, list[int], int, str]], seed: int
) -> None:
    history: list[Callable[[Twin], object]] = []
    one, many = Twin(seed, []), Twin(seed, [])  # the loop's twin, the bulk forms' manager
    oracle = SequentialOracle(many.pool, many.host)
    step = 0
    try:
        for kind, picks, b, defect in draws:
            if kind == "flush":
                r1, r2 = one.mgr.flush_nowait(), many.mgr.flush_nowait()
                assert (r1.events, r1.committed, r1.offloaded, r1.restored, r1.elided) == (
                    r2.events, r2.committed, r2.offloaded, r2.restored, r2.elided)  # fmt: skip
                oracle.assert_matches(many.pool, many.host)
                assert all(torch.equal(x, y) for x, y in zip(one.pool.tensors, many.pool.tensors, strict=True))
                assert all(torch.equal(x, y) for x, y in zip(one.host.tensors, many.host.tensors, strict=True))
                one.forward(step), many.forward(step)
                for s in many.pool.allocated_slots():
                    oracle.write(s, float(step * 100 + s))
                history.append(lambda t, step=step: t.step(step))
                step += 1
                continue
            if kind in ("alloc", "release", "cow", "drop"):
                call = _ledger_call(many, kind, b)
                if call is None:
                    continue
                n = len(many.mgr.queued())
                call(one), call(many)
                oracle.apply(many.mgr.queued()[n:])
                history.append(call)
                continue
            args = _args(many, kind, picks, b, defect)
            if args is None:
                continue
            before = many.state()
            got, err = _outcome(lambda: bulk(many, kind, args))  # noqa: B023
            want, loop_err = _outcome(lambda: loop(one, kind, args))  # noqa: B023
            event(f"{kind} {args['defect']}: {type(err).__name__ if err else 'ok'}")  # --hypothesis-show-statistics
            if err is None:
                assert loop_err is None, f"the loop raised {loop_err!r}, the bulk form did not"
                assert got == want and one.state() == many.state()
                oracle.apply(many.mgr.queued()[len(before[0]) :])
                history.append(lambda t, kind=kind, args=args: loop(t, kind, args))
                continue
            assert many.state() == before, "a failed bulk call changed something"
            assert loop_err is not None, f"the bulk form raised {err!r}, the loop did not"
            if args["defect"] in ARG_DEFECTS:
                assert isinstance(err, mc.InvalidArgumentError), err
            else:  # a state error: the one the first failing single call raises
                assert type(err) is type(loop_err), (err, loop_err)
                if not isinstance(err, mc.PoolExhaustedError):
                    assert str(err) == str(loop_err)
            one.stack.close()
            one = Twin(seed, history)
            assert one.state() == many.state()
    finally:
        one.stack.close()
        many.stack.close()


# -- examples: every input check, all or nothing -----------------------------------
def test_bulk_forms_are_all_or_nothing_with_typed_errors() -> None:
    twin = Twin(0, [], start=False)
    mgr = twin.mgr
    with twin.stack:
        a, b, c = mgr.alloc(3, request_id="r")
        h1, h2 = mgr.offload_many([a, b])
        assert (h1, h2) == (1, 2)
        before = twin.state()
        bad_calls = [
            (lambda: mgr.offload_many([a, 0]), mc.InvalidSlotError, "out of range"),
            (lambda: mgr.offload_many([a, b, c, a]), mc.PoolExhaustedError, "host pool exhausted"),
            (lambda: mgr.offload_many([a, 7]), mc.SlotStateError, "not allocated"),
            # One call per slot would run out of host slots before it reached slot 7.
            (lambda: mgr.offload_many([a, b, c, c, 7]), mc.PoolExhaustedError, "exhausted"),
            (lambda: mgr.offload_many([a], request_id="other"), mc.SlotStateError, "belongs to"),
            (lambda: mgr.offload_many(torch.tensor([a], device="meta")), mc.InvalidSlotError, "wait for the device"),
            (lambda: mgr.offload_many(np.array([[a]])), mc.InvalidSlotError, "1-D"),
            (lambda: mgr.restore_many([h1, h1], [a, b]), mc.SlotStateError, "host slot 1 holds no state"),
            (lambda: mgr.restore_many([h1, 9], [a, b]), mc.InvalidSlotError, "host slot 9 is out of range"),
            (lambda: mgr.restore_many([h1, 3], [a, b]), mc.SlotStateError, "host slot 3"),
            (lambda: mgr.restore_many([h1, h2], [a]), mc.InvalidArgumentError, r"2 host slot\(s\) but 1 slot\(s\)"),
            (lambda: mgr.restore_many([h1], [a], keep=1), mc.InvalidArgumentError, "keep"),  # type: ignore[arg-type]
            (lambda: mgr.restore_many([h1], [7]), mc.SlotStateError, "not allocated"),
            (lambda: mgr.commit_many([a, b], [1, K + 1]), mc.InvalidArgumentError, "accepted must be in"),
            (lambda: mgr.commit_many([a, b], [1.0, 1]), mc.InvalidArgumentError, "accepted must be an int"),
            (lambda: mgr.commit_many([a, b], np.array([1.0, 1.0])), mc.InvalidArgumentError, "integer array"),
            (lambda: mgr.commit_many([a, b], torch.tensor([1, 1], device="meta")), mc.InvalidArgumentError, "meta"),
            (lambda: mgr.commit_many([a, b], [True, 1]), mc.InvalidArgumentError, "must be an int"),
            (lambda: mgr.commit_many([a, b], [1]), mc.InvalidArgumentError, "1 values for 2 slots"),
            (lambda: mgr.commit_many([a, b], "12"), mc.InvalidArgumentError, "accepted must be a list"),
            (lambda: mgr.commit_many([a, b], 1.5), mc.InvalidArgumentError, "must be an int"),
            (lambda: mgr.commit_many([a, 7], 1), mc.SlotStateError, "not allocated"),
            (lambda: mgr.commit_many([a], 1, request_id=3), mc.InvalidArgumentError, "request_id"),  # type: ignore[arg-type]
            # A shift must be an int below the narrowest conv width (2 here); whole calls, single and bulk.
            (
                lambda: mgr.copy_many([a, b], [b, c], shift=2),
                mc.InvalidArgumentError,
                r"shift must be an int in 0\.\.1",
            ),
            (lambda: mgr.copy_many([a], [b], shift=True), mc.InvalidArgumentError, "shift"),  # type: ignore[arg-type]
            (lambda: mgr.copy_on_write(a, b, shift=-1), mc.InvalidArgumentError, "got -1"),
            (lambda: mgr.copy_on_write(a, b, shift=1.0), mc.InvalidArgumentError, "got 1.0"),  # type: ignore[arg-type]
            (lambda: mgr.submit(mc.Clear(a), mc.CopyOnWrite(a, b, shift=2)), mc.InvalidArgumentError, "got 2"),
            (lambda: mgr.copy_on_write(a, 7, shift=1), mc.SlotStateError, "not allocated"),
            (lambda: mgr.copy_many([a, a], [b, 7], shift=1), mc.SlotStateError, "not allocated"),
            # A temporal source is a slot as the others are, held at its point of the order (not tenant-checked,
            # as a source is not): a bad one refuses the whole call.
            (lambda: mgr.copy_on_write(a, b, shift=1, temporal_src=7), mc.SlotStateError, "temporal source slot 7"),
            (lambda: mgr.copy_on_write(a, b, temporal_src=9), mc.InvalidSlotError, "slot 9 is out of range"),
            (lambda: mgr.copy_on_write(a, b, temporal_src=1.0), mc.InvalidSlotError, "float"),  # type: ignore[arg-type]
            (lambda: mgr.copy_on_write(a, b, temporal_src=True), mc.InvalidSlotError, "bool"),  # type: ignore[arg-type]
            (
                lambda: mgr.submit(mc.Release(c), mc.CopyOnWrite(a, b, temporal_src=c)),
                mc.SlotStateError,
                "temporal source slot",
            ),
        ]
        for call, error, match in bad_calls:
            with pytest.raises(error, match=match):
                call()
            assert twin.state() == before
        # Every form of one accepted count for all: an int, a numpy int, a 0-d CPU tensor.
        for accepted in (1, np.int64(2), torch.tensor(0)):
            mgr.commit_many(np.array([a, b]), accepted, request_id="r")
        assert [e.accepted for e in mgr.queued()[-6:]] == [1, 1, 2, 2, 0, 0]  # type: ignore[union-attr]
        mgr.offload_many([]), mgr.restore_many([], []), mgr.commit_many([], [])  # empty is fine
        assert mgr.pending == len(before[0]) + 6


def test_bulk_forms_refuse_a_closed_manager_and_a_missing_host_pool() -> None:
    pool = mc.StatePool(SPEC, 4, draft_tokens=K)
    mgr = mc.CacheManager(pool)
    with pytest.raises(mc.ManagerClosedError):
        mgr.commit_many([1], 1)
    with mgr:
        (a,) = mgr.alloc(1)
        for call in (lambda: mgr.offload_many([a]), lambda: mgr.restore_many([1], [a])):
            with pytest.raises(mc.InvalidArgumentError, match="needs a host pool"):
                call()
    with mc.CacheManager(mc.StatePool(SPEC, 4)) as plain:
        (a,) = plain.alloc(1)
        with pytest.raises(mc.InvalidEventError, match="without draft buffers"):
            plain.commit_many([a], 1)
        assert plain.pending == 1


def test_restore_many_with_keep_reads_one_host_slot_many_times_and_frees_in_order() -> None:
    twin = Twin(1, [], start=False)
    mgr = twin.mgr
    with twin.stack:
        slots = mgr.alloc(4)
        h1, h2 = mgr.offload_many(slots[:2])
        mgr.flush_nowait()
        mgr.restore_many([h1, h1, h1], slots[1:], keep=True)  # a checkpoint into three slots
        assert twin.host.held() == {h1: None, h2: None}
        mgr.restore_many([h2, h1], slots[2:])  # both freed, in this order, for the next step
        assert twin.host.held() == {}
        # Freed in this step: handed out again only when no other is free, h2 before h1.
        assert mgr.offload_many(slots) == [3, 4, 5, h2]
        oracle = SequentialOracle(twin.pool, twin.host)
        oracle.apply(mgr.queued())
        mgr.flush_nowait()
        oracle.assert_matches(twin.pool, twin.host)


# -- faults: a bulk step fails at any op on any executor and is retried exactly -----
def bulk_scenario(mgr: mc.CacheManager, slots: list[int], checkpoints: list[int]) -> None:
    """Speculative decoding's commit, then preemption by swap and a swap-in, as bulk calls. Planned as an
    early offload (``b``, unchanged), the commits (``a``'s also reaches ``b`` through the host), a late
    offload (``c``, committed first) and the restores of the checkpoints."""
    a, b, c, d = slots[:4]
    mgr.commit_many([a, b, c, d], [2, 0, 1, 2])
    swapped = mgr.offload_many([a, b, c])
    mgr.release_many([a, b])
    new = mgr.alloc(2, clear=False)
    mgr.restore_many(swapped[:2], new[::-1])  # each into the other's old slot
    mgr.restore_many(checkpoints, [c, d], keep=True)


def run_bulk_scenario(variant: str, at: int, exc: type[BaseException]) -> int:
    pool, host = mc.StatePool(SPEC, N, draft_tokens=K), mc.HostPool(SPEC, H)
    with mc.CacheManager(pool, executor=VARIANTS[variant](), host_pool=host, max_failed_flushes=1000) as mgr:
        slots = mgr.alloc(6)
        mgr.flush_nowait()
        fill(pool, host, at)
        checkpoints = mgr.offload_many(slots[4:6])
        mgr.flush_nowait()
        for t in pool.tensors:
            t[:, slots[4:6]] = -7.0  # the pool moves on; the host keeps the old states
        oracle = SequentialOracle(pool, host)
        before = mgr.pending
        bulk_scenario(mgr, slots, checkpoints)
        oracle.apply(mgr.queued()[before:])
        ops = flush_with_fault(mgr, at, exc)
        oracle.assert_matches(pool, host)
        assert pool.unfinished == 0
        return ops


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_fault_at_every_op_of_a_bulk_step_then_one_flush_is_exact(variant: str) -> None:
    total = run_bulk_scenario(variant, 0, MemoryError)
    assert total > 0
    excs: list[type[BaseException]] = [MemoryError, RuntimeError, KeyboardInterrupt]
    for at in fault_points(total):
        run_bulk_scenario(variant, at, excs[at % len(excs)])


# -- tracing: the same lines as the single calls ------------------------------------
def _traced(use_bulk: bool) -> list[dict[str, Any]]:
    tracing.configure(level="debug", use_structlog_config=True)
    try:
        with capture_logs() as logs:
            twin = Twin(2, [], start=False)
            mgr = twin.mgr
            with twin.stack:
                slots = mgr.alloc(3, "r")
                mgr.flush_nowait()
                if use_bulk:
                    mgr.commit_many(slots, [1, 2, 0], "r")
                    hosts = mgr.offload_many(slots, "r")
                    mgr.release_many(slots, "r")
                    new = mgr.alloc(3, "r", clear=False)
                    mgr.restore_many(hosts, new, "r")
                else:
                    for s, k in zip(slots, [1, 2, 0], strict=True):
                        mgr.commit_draft(s, k, "r")
                    hosts = [mgr.offload(s, "r") for s in slots]
                    for s in slots:
                        mgr.release(s, "r")
                    new = mgr.alloc(3, "r", clear=False)
                    for h, s in zip(hosts, new, strict=True):
                        mgr.restore(h, s, "r")
                mgr.flush_nowait()
                mgr.release_many(new, "r")
                mgr.flush_nowait()
    finally:
        tracing.disable()
    return [{k: v for k, v in e.items() if k not in ("plan_us", "execute_us")} for e in logs]


def test_bulk_forms_trace_the_lines_of_their_single_calls_and_analyze_clean() -> None:
    lines = _traced(True)
    assert lines == _traced(False)
    kinds = [e["event"] for e in lines]
    assert kinds.count("slot.commit") == 3 and kinds.count("slot.offload") == kinds.count("slot.restore") == 3
    analysis = analyze_lines(json.dumps({k: v for k, v in e.items() if k != "log_level"}) for e in lines)
    assert analysis.anomalies == [] and analysis.summary["releases"] == 6


# -- threads: a bulk call is one hold of the lock -----------------------------------
def test_bulk_calls_from_two_threads_queue_each_call_whole() -> None:
    """Two threads swap their own requests out and in as fast as they can: each call's events are contiguous
    in the queue, in its order, and the host slots it got are its own. The threads take turns at the lock
    some tens of times in a run (a lock released between a call's events would show at such a turn)."""
    pool, host = mc.StatePool(SPEC, 8, draft_tokens=K), mc.HostPool(SPEC, 8)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with mc.CacheManager(pool, host_pool=host) as mgr:
            mine = {r: mgr.alloc(4, r) for r in TENANTS}
            mgr.flush_nowait()
            errors: list[BaseException] = []

            start = threading.Barrier(2)

            def swapper(r: str) -> None:
                try:
                    start.wait()
                    for _ in range(2000):
                        mgr.commit_many(mine[r], 1, r)
                        hosts = mgr.offload_many(mine[r], r)
                        assert all(host.held()[h] == r for h in hosts)
                        mgr.restore_many(hosts, mine[r][::-1], r)
                except BaseException as exc:  # the main thread re-raises it
                    errors.append(exc)

            threads = [threading.Thread(target=swapper, args=(r,)) for r in TENANTS]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
            events = mgr.queued()
            assert len(events) == 2 * 2000 * 12
            for i in range(0, len(events), 4):  # every call queued 4 events of one tenant, in its order
                batch = events[i : i + 4]
                r = batch[0].request_id  # type: ignore[union-attr]
                assert all(type(e) is type(batch[0]) and e.request_id == r for e in batch)  # type: ignore[union-attr]
                want = mine[r][::-1] if isinstance(batch[0], mc.Restore) else mine[r]  # type: ignore[index]
                assert [e.slot for e in batch] == want  # type: ignore[union-attr]
            mgr.flush_nowait()
            assert host.held() == {}
    finally:
        sys.setswitchinterval(interval)
