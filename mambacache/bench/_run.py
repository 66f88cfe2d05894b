"""The measurements of ``mambacache bench``.

Every figure is a median of repeated runs after warm-up, with min and max; the
ratios compare paths measured in the same run on the same pool:

* clear: against a warm contiguous ``zero_()`` of the same bytes (the memset
  bound), and against SGLang's expand-based clear;
* copy: against a contiguous ``copy_`` of the same bytes, and SGLang's advanced-index copy ``t[:, dst] = t[:, src]``;
* workspace: the op audit's temporaries and non-contiguous inputs per step;
* host: submit + plan microseconds per event, and the cost of tracing when off.
"""

from __future__ import annotations

import random
import statistics
import time
import timeit
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import anyio
import torch

from .._core import _tracer
from .._core._events import Alloc, Clear, CommitDraft, CopyOnWrite, Event, Offload, Release, Restore
from .._core._planner import Stage, plan_step
from .._core._pool import StatePool
from .._core._runner import run_stage
from .._core._spec import StateSpec
from .._executors import resolve_executor
from .._executors._base import as_executor
from .._executors._torch import TorchExecutor
from .._manager import CacheManager
from .._tiers._hostpool import HostPool
from ..audit import OpAudit
from ._presets import fit_layers, lookup

__all__ = ["Result", "bulk_vs_loop", "embedding_overhead", "host_overhead", "run_preset", "tracing_overhead"]


@dataclass(frozen=True, slots=True)
class Result:
    preset: str
    layers: int
    slots: int
    op: str  # clear | copy
    path: str  # an executor name, or sglang / memset / memcpy
    median_s: float
    min_s: float
    max_s: float
    bytes: int
    gb_s: float
    vs_bound: float  # the memset/memcpy time over this time: 1.0 is the bandwidth bound
    vs_sglang: float  # the sglang path's time over this time: > 1 is faster than SGLang's pre-fix code
    peak_temp_bytes: int | None = None
    noncontiguous_input_bytes: int | None = None
    host_syncs: int | None = None  # ops that read device data back (audit), plus CUDA's sync debug mode
    ops: int | None = None  # aten ops of one warm step, every pool tensor (the launches it asks for)
    launches: int | None = None  # device kernels of one warm step (CUDA only, from the profiler)
    bound_spread: float = 0.0  # the memset/memcpy rounds' interquartile range over their median

    @property
    def bound_steady(self) -> bool:
        """Whether the baseline held still enough between rounds for ``vs_bound`` to be a result: a baseline
        whose middle half of rounds spans more than ``BOUND_SPREAD`` of its median was timed through someone
        else's load, and a ratio to it can read as many times the bandwidth bound."""
        return self.bound_spread <= BOUND_SPREAD

    def to_json(self) -> dict[str, Any]:
        """The row as a JSON-ready dict (``mambacache bench --json``)."""
        return {**asdict(self), "bound_steady": self.bound_steady}


BOUND_SPREAD = 0.5


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


def _time_once(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cpu":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    # Device time: events recorded on the current stream around the enqueued work.
    start = torch.Event(device=device, enable_timing=True)
    end = torch.Event(device=device, enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


# Runs of each baseline path, alone, before the round-robin warm-up (``measure``'s ``first``).
BASELINE_WARMUP = 16


def measure(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    repeats: int,
    warmup: int = 6,
    min_total_s: float = 0.2,
    first: tuple[str, ...] = (),
) -> dict[str, tuple[float, float, float, float]]:
    """Median, min and max seconds of each function, and the interquartile range of its rounds over their
    median (the spread), after warm-up (long enough for the torch executor's first looks at each way to run a
    large CPU stage: ``_executors/_policy.py``).

    The functions run in rounds, one call each per round, so a slow spell of a
    shared machine hits every path alike and the ratios stay fair; each round in
    a fresh order (seeded): a path run right after an OpenMP region (the bound's
    memset, a whole-view way) meets that region's threads still spinning on a
    busy host, and a fixed neighbour would pay it every round (docs/benchmarks.md,
    "The path after an OpenMP region"). Rounds go on until each path has
    ``repeats`` samples and the slowest ``min_total_s`` measured (at most 200
    rounds).

    ``first``: paths warmed up alone before the others (``BASELINE_WARMUP`` runs each). The sglang path's
    first runs map and free gigabytes of temporaries, and the runs beside them were several times slower
    for a dozen rounds (a 10 ms clear took 60-480 ms): an executor's first looks there picked a way that is
    slower once the process is warm, and kept it for the whole measurement. A serving engine has no such
    neighbour.
    """
    for _ in range(BASELINE_WARMUP):
        for key in first:
            fns[key]()
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    _sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    keys, order = list(fns), random.Random(len(fns))
    rounds = 0
    while rounds < repeats or (max(sum(v) for v in times.values()) < min_total_s and rounds < 200):
        order.shuffle(keys)
        for key in keys:
            times[key].append(_time_once(fns[key], device))
        rounds += 1
    return {k: (statistics.median(v), min(v), max(v), _spread(v)) for k, v in times.items()}


def _spread(samples: list[float]) -> float:
    """The interquartile range of ``samples`` over their median (the whole range below four samples)."""
    median = statistics.median(samples)
    if len(samples) >= 4:
        q1, _, q3 = statistics.quantiles(samples, n=4)
        width = q3 - q1
    else:
        width = max(samples) - min(samples)
    return width / median if median > 0 else 0.0


def _zero_all(bufs: list[torch.Tensor]) -> None:
    for b in bufs:
        b.zero_()


def _copy_all(src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
    for a, b in zip(src, dst, strict=True):
        b.copy_(a)


def _sglang_clear(pool: StatePool, idx: torch.Tensor) -> None:
    """SGLang's clear_slots before its NPU fix: zeros(1).expand + advanced-index assignment."""
    for t in pool.tensors:
        t[:, idx] = torch.zeros(1, dtype=t.dtype, device=t.device).expand(t.shape[0], len(idx), *t.shape[2:])


def _sglang_copy(pool: StatePool, src: torch.Tensor, dst: torch.Tensor) -> None:
    for t in pool.tensors:
        t[:, dst] = t[:, src]


def _sglang_commit(pool: StatePool, dst: torch.Tensor, pos: torch.Tensor) -> None:
    """Speculative decoding as engines first wrote it: an advanced-index gather from the draft buffers."""
    for t, d in zip(pool.tensors, pool.draft_tensors, strict=True):
        t[:, dst] = d[:, dst, pos]


def _sglang_host(pool: StatePool, host: HostPool, pairs: Sequence[tuple[int, int]], offload: bool) -> None:
    """What an engine without a planner writes: one copy per slot and tensor (SGLang's HiCache mamba path shape)."""
    for t, h in zip(pool.tensors, host.tensors, strict=True):
        for a, b in pairs:
            if offload:
                h[:, b].copy_(t[:, a], non_blocking=True)
            else:
                t[:, b].copy_(h[:, a], non_blocking=True)


def _run_stage(executor: Any, stage: Stage, pool: StatePool, host: HostPool | None = None) -> Callable[[], None]:
    """One stage on every pool tensor, through the manager's own dispatch (:func:`run_stage`)."""
    ex = as_executor(executor)
    assert ex is not None
    tensors, drafts = pool.exec_tensors, pool.exec_drafts
    hosts = host.exec_tensors if host is not None else None
    return partial(run_stage, ex, stage, tensors, drafts, hosts)


def _launches(fn: Callable[[], object], device: torch.device) -> int | None:
    """Kernels one call launches, counted by the profiler on CUDA; None elsewhere (CPU has no launches)."""
    if device.type != "cuda":
        return None
    from torch.profiler import DeviceType, ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith("Memcpy"))


DRAFTS = 2  # draft states per slot in the bench's pools (for the commit op)

# Executors the bench knows besides the registry's: the torch executor with a forced path.
# torch-inline: the auto paths with every op on the calling thread (no helper threads share a large CPU stage);
# torch-crew / torch-whole: a large CPU stage's pieces always shared with the crew / always one strided op per run
# (the ways the torch executor's "auto" picks between, from measured times).
BENCH_EXECUTORS = {
    "torch-runs": ("runs", "auto"), "torch-index": ("index", "auto"), "torch-direct": ("direct", "auto"),
    "torch-inline": ("auto", "inline"), "torch-crew": ("auto", "crew"), "torch-whole": ("auto", "whole"),
}  # fmt: skip


def make_executor(name: str, device: torch.device, workspace_bytes: int) -> Any:
    if name in BENCH_EXECUTORS:
        path, large = BENCH_EXECUTORS[name]
        return TorchExecutor(workspace_bytes, path=path, share_stages=name != "torch-inline", large_stages=large)
    return resolve_executor(name, device, workspace_bytes)


def _audit(fn: Callable[[], object], device: torch.device) -> tuple[int, int, int, int]:
    syncs = 0
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    try:
        import warnings

        with warnings.catch_warnings(record=True) as caught, OpAudit() as audit:
            warnings.simplefilter("always")
            fn()
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    report = audit.report()
    return report.peak_temp_bytes, report.noncontiguous_input_bytes, syncs + len(report.sync_ops), report.ops


def run_preset(
    name: str,
    sizes: Sequence[int],
    executors: Sequence[str],
    device: torch.device,
    repeats: int,
    budget_bytes: int,
    workspace_bytes: int,
    seed: int = 0,
    only: Collection[str] | None = None,
) -> Iterator[Result]:
    """Clear, copy, commit, offload and restore ``n`` random slots for each ``n`` in ``sizes``: every executor
    and the baselines.

    The pool keeps ``DRAFTS`` draft states per slot, so commits (speculative
    decoding's accepted state, from a draft buffer into the slot) are timed too.
    Offloads copy ``n`` scattered slots into consecutive host slots (preemption);
    restores the reverse; their bound is a copy of the same bytes between
    contiguous device and host buffers (pinned where the device is an accelerator).
    ``only`` keeps only those ops (default: all five).
    """
    num_slots = 2 * max(sizes) + 8
    # The pool with its draft states, and a host pool of half its slots, within the budget.
    spec: StateSpec = fit_layers(lookup(name).spec, num_slots, budget_bytes // (2 + DRAFTS))
    pool = StatePool(spec, num_slots, device, draft_tokens=DRAFTS)
    for t in [*pool.tensors, *pool.draft_tensors]:
        t.fill_(1)
    host = HostPool(spec, max(sizes))
    rng = random.Random(seed)
    impls = {e: make_executor(e, device, workspace_bytes) for e in executors}
    for n in sizes:
        nbytes = n * spec.slot_bytes
        cases = _preset_cases(pool, host, num_slots, n, rng, device)
        for op, bound, stage, sglang_fn, bound_fn in cases:
            if only is not None and op not in only:
                continue
            fns: dict[str, Callable[[], object]] = {bound: bound_fn, "sglang": sglang_fn}
            fns.update({e: _run_stage(ex, stage, pool, host) for e, ex in impls.items()})
            timings = measure(fns, device, repeats, first=(bound, "sglang"))
            for path, (median, low, high, _) in timings.items():
                # Temporaries from a fresh executor (its first step shows its workspace);
                # ops from the warm one that was timed (what every later step launches).
                fresh = (
                    _run_stage(make_executor(path, device, workspace_bytes), stage, pool, host)
                    if path in impls
                    else None
                )
                peak, noncontig, syncs, ops = _audit(fresh or fns[path], device)
                if fresh is not None:  # a fresh executor's first step builds its caches: count a warm one
                    ops = _audit(fns[path], device)[3]
                yield Result(name, spec.num_layers, n, op, path, median, low, high, nbytes, nbytes / median / 1e9,
                             timings[bound][0] / median, timings["sglang"][0] / median, peak, noncontig, syncs,
                             ops, _launches(fns[path], device), bound_spread=timings[bound][3])  # fmt: skip
        del cases


_Case = tuple[str, str, Stage, Callable[[], object], Callable[[], object]]


def _preset_cases(
    pool: StatePool, host: HostPool, num_slots: int, n: int, rng: random.Random, device: torch.device
) -> list[_Case]:
    """For ``n`` random slots: each op's name, its bound's name, its planned stage, the `sglang` path and the bound.

    The bound works on contiguous buffers holding the same bytes, allocated here
    and held by the returned callables until the list is dropped.
    """
    chosen = rng.sample(range(1, num_slots + 1), 2 * n)
    zero_slots, src, dst = sorted(chosen[:n]), chosen[:n], chosen[n:]
    bufs = [torch.empty(t.shape[0], n, *t.shape[2:], dtype=t.dtype, device=device) for t in pool.tensors]
    bufs2 = [torch.empty_like(b) for b in bufs]
    zidx = torch.tensor(zero_slots, device=device)
    sidx, didx = torch.tensor(src, device=device), torch.tensor(dst, device=device)
    (zstage,) = plan_step([Clear(s) for s in zero_slots]).stages
    (cstage,) = plan_step([CopyOnWrite(s, d) for s, d in zip(src, dst, strict=True)]).stages
    positions = [rng.randrange(DRAFTS) for _ in dst]
    (mstage,) = plan_step([CommitDraft(d, j + 1) for d, j in zip(dst, positions, strict=True)]).stages
    pidx = torch.tensor([j for _, j, _ in mstage.entries], device=device)  # type: ignore[union-attr]
    midx = torch.tensor([d for _, _, d in mstage.entries], device=device)  # type: ignore[union-attr]
    offloads = [(s, h) for h, s in enumerate(src, start=1)]
    restores = [(h, d) for h, d in enumerate(dst, start=1)]
    (ostage,) = plan_step([Offload(s, h) for s, h in offloads]).stages
    (rstage,) = plan_step([Restore(h, d, keep=True) for h, d in restores]).stages
    hbufs = [torch.empty(b.shape, dtype=b.dtype, pin_memory=host.pinned) for b in bufs]
    return [
        ("clear", "memset", zstage, partial(_sglang_clear, pool, zidx), partial(_zero_all, bufs)),
        ("copy", "memcpy", cstage, partial(_sglang_copy, pool, sidx, didx), partial(_copy_all, bufs, bufs2)),
        ("commit", "memcpy", mstage, partial(_sglang_commit, pool, midx, pidx), partial(_copy_all, bufs, bufs2)),
        ("offload", "memcpy", ostage, partial(_sglang_host, pool, host, offloads, True),
         partial(_copy_all, bufs, hbufs)),
        ("restore", "memcpy", rstage, partial(_sglang_host, pool, host, restores, False),
         partial(_copy_all, hbufs, bufs)),
    ]  # fmt: skip


class _NullExecutor:
    """Does no device work: what is left of a flush is host overhead."""

    name = "null"

    def execute(self, stage: Stage, tensor: torch.Tensor, draft: torch.Tensor | None = None) -> None:
        pass


def host_overhead(events_per_flush: Sequence[int], repeats: int) -> list[dict[str, float]]:
    """Submit + plan + bookkeeping microseconds per event, through the public API."""
    spec = StateSpec(num_layers=1, conv_shapes=(), temporal_shape=(1,))
    out = []
    for k in events_per_flush:
        pool = StatePool(spec, 2 * k + 8)

        async def main(k: int = k, pool: StatePool = pool) -> list[float]:
            rng = random.Random(k)
            times = []
            async with CacheManager(pool, executor=_NullExecutor()) as mgr:
                live = mgr.alloc(k, "r")  # events name their tenant: the tenant check is measured too
                await mgr.flush()
                for _ in range(repeats + 2):
                    picks = [(rng.choice(live), rng.choice(live)) for _ in range(k)]
                    t0 = time.perf_counter()
                    for i, (a, b) in enumerate(picks):
                        if i % 2:
                            mgr.clear(a, "r")
                        else:
                            mgr.copy_on_write(a, b, "r")
                    await mgr.flush()
                    times.append((time.perf_counter() - t0) / k)
            return times[2:]

        times = anyio.run(main)
        out.append({"events_per_flush": k, "us_per_event": statistics.median(times) * 1e6,
                    "min_us": min(times) * 1e6, "max_us": max(times) * 1e6})  # fmt: skip
    return out


def embedding_overhead(repeats: int, bulk: int = 1000) -> dict[str, float]:
    """What a synchronous engine pays on the host: bulk submits per event, and a decode step end to end.

    * ``bulk_*_us_per_event``: ``clear_many`` / ``copy_many`` / ``release_many``
      of ``bulk`` slots given as a numpy array (validation, tenant checks, queueing);
    * ``decode_step_us``: one decode step of 8 events on a real ``torch`` executor,
      submit + plan + execute, through ``flush_nowait``: 2 releases of finished
      requests, 2 allocs (cleared) for new ones, 2 forks of a cached prefix into
      them, 2 clears; the states are small, so the device work is a few memsets.
    """
    import numpy as np

    spec = StateSpec(num_layers=1, conv_shapes=(), temporal_shape=(1,))
    pool = StatePool(spec, 2 * bulk + 8)
    times: dict[str, list[float]] = {"clear": [], "copy": [], "release": []}
    with CacheManager(pool, executor=_NullExecutor()) as mgr:
        for _ in range(repeats + 2):
            live = np.array(mgr.alloc(2 * bulk, "r"))
            mgr.flush_nowait()
            srcs, dsts = live[:bulk], live[bulk:]
            t0 = time.perf_counter()
            mgr.clear_many(srcs, "r")
            t1 = time.perf_counter()
            mgr.copy_many(srcs, dsts, "r")
            t2 = time.perf_counter()
            mgr.release_many(live, "r")
            t3 = time.perf_counter()
            times["clear"].append((t1 - t0) / bulk)
            times["copy"].append((t2 - t1) / bulk)
            times["release"].append((t3 - t2) / (2 * bulk))
            mgr.flush_nowait()
    out: dict[str, float] = {"bulk_events": bulk}
    for name, ts in times.items():
        out[f"bulk_{name}_us_per_event"] = statistics.median(ts[2:]) * 1e6

    decode = StatePool(StateSpec(num_layers=4, conv_shapes=[(4, 2)], temporal_shape=(2, 2)), 64)
    steps: list[float] = []
    with CacheManager(decode) as mgr:
        (prefix,) = mgr.alloc(1, "prefix")
        running = mgr.alloc(8)
        mgr.flush_nowait()
        for _ in range(repeats * 20 + 20):
            t0 = time.perf_counter()
            mgr.release_many(running[:2])
            new = mgr.alloc(2)
            mgr.copy_on_write(prefix, new[0])
            mgr.copy_on_write(prefix, new[1])
            mgr.clear(running[2])
            mgr.clear(running[3])
            mgr.flush_nowait()
            steps.append(time.perf_counter() - t0)
            running = running[2:] + new
    out["decode_step_events"] = 8
    out["decode_step_us"] = statistics.median(steps[20:]) * 1e6
    out["decode_step_min_us"] = min(steps[20:]) * 1e6
    return out


def tracing_overhead(events: int = 1000, repeats: int = 7) -> dict[str, float]:
    """A flush of ``events`` events with tracing off, against the same work without the tracing checks.

    Tracing off costs one call of the installed no-op tracer per submit call and
    one per flush (``_tracer.tracer.events`` / ``.flushed``); that call is
    measured on its own and set against the whole.
    """
    rows = host_overhead([events], repeats)
    per_event_us = rows[0]["us_per_event"]
    check_s = min(timeit.repeat("off.events(evs, 0)", globals={"off": _tracer.OFF, "evs": ()},
                                number=100_000, repeat=5)) / 100_000  # fmt: skip
    checks = events + 1  # one per submit, plus the flush's summary
    total_s = per_event_us * 1e-6 * events
    return {
        "events": events,
        "flush_us_tracing_off": total_s * 1e6,
        "check_ns": check_s * 1e9,
        "checks": checks,
        "overhead_fraction": checks * check_s / (total_s - checks * check_s),
    }


def host_tier_overhead(repeats: int, k: int = 200) -> dict[str, float]:
    """Host microseconds per slot of a swap: ``offload`` + ``release``, then ``alloc`` + ``restore``.

    Submit and plan only: the executor does no device work.
    """
    spec = StateSpec(num_layers=1, conv_shapes=(), temporal_shape=(1,))
    pool, host = StatePool(spec, k), HostPool(spec, k)
    out: dict[str, list[float]] = {"offload_release": [], "alloc_restore": []}
    with CacheManager(pool, executor=_NullExecutor(), host_pool=host) as mgr:
        slots = mgr.alloc(k, "r")
        mgr.flush_nowait()
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            handles = []
            for s in slots:
                handles.append(mgr.offload(s, "r"))
                mgr.release(s, "r")
            mgr.flush_nowait()
            t1 = time.perf_counter()
            slots = mgr.alloc(k, "r", clear=False)
            for h, s in zip(handles, slots, strict=True):
                mgr.restore(h, s, "r")
            mgr.flush_nowait()
            t2 = time.perf_counter()
            out["offload_release"].append((t1 - t0) / k)
            out["alloc_restore"].append((t2 - t1) / k)
    return {
        "events": float(k),
        **{f"{name}_us_per_slot": statistics.median(v[2:]) * 1e6 for name, v in out.items()},
    }


def planner_scaling(sizes: Sequence[int], repeats: int) -> list[dict[str, float]]:
    """Planner microseconds per event for steps of ``sizes`` events: flat when planning is linear.

    Each step is speculative decoding's step end with preemption by swap, per
    request: ``CommitDraft``, ``Offload``, ``Release`` (``swap``: one segment), and
    the same with a new tenant's cleared ``Alloc`` of the freed slot in the same
    step (``swap+refill``: the log is cut at every request, the worst case).
    """
    out = []
    for n in sizes:
        row: dict[str, float] = {"events": n}
        for name, per in (("swap", 3), ("swap+refill", 4)):
            log: list[Event] = []
            for s in range(1, max(1, n // per) + 1):
                log += [CommitDraft(s, 1 + s % 2), Offload(s, s), Release(s)]
                if per == 4:
                    log.append(Alloc(s))
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                plan_step(log)
                times.append((time.perf_counter() - t0) / len(log))
            row[f"{name}_us_per_event"] = statistics.median(times) * 1e6
        out.append(row)
    return out


BULK = ("loop", "bulk")


def bulk_vs_loop(sizes: Sequence[int], repeats: int) -> list[dict[str, float]]:
    """Host microseconds to queue and flush ``n`` commits, offloads or restores: the bulk form against the loop.

    Per size ``n`` and kind, the median over ``repeats`` rounds of the loop of
    single calls (``commit_draft`` / ``offload`` / ``restore`` over Python ints)
    and of one bulk call (``commit_many`` / ``offload_many`` / ``restore_many``
    over numpy arrays, as engines hold slot ids), each followed by
    ``flush_nowait``. The two alternate within a round, so both see the same
    machine load; ``ratio`` is loop over bulk (medians), ``*_min_us`` the fastest
    round. The executor does no device work.
    """
    import numpy as np

    spec = StateSpec(num_layers=1, conv_shapes=(), temporal_shape=(1,), draft_tokens=2)
    out = []
    for n in sizes:
        pool, host = StatePool(spec, n), HostPool(spec, n)
        inner = max(1, 256 // n)  # small batches repeat inside one timing, above the clock's resolution
        times: dict[str, list[float]] = {f"{k}_{f}": [] for k in ("commit", "offload", "restore") for f in BULK}
        with CacheManager(pool, executor=_NullExecutor(), host_pool=host) as mgr:
            slots = mgr.alloc(n, "r")
            mgr.flush_nowait()
            arr, accepted = np.array(slots), np.array([1 + s % 2 for s in slots])
            for r in range(repeats + 2):
                for form in BULK if r % 2 else BULK[::-1]:
                    for kind, secs in _bulk_round(mgr, form, slots, arr, accepted, inner).items():
                        times[f"{kind}_{form}"].append(secs / inner)
        row: dict[str, float] = {"n": n}
        for key, ts in times.items():
            row[f"{key}_us"] = statistics.median(ts[2:]) * 1e6
            row[f"{key}_min_us"] = min(ts[2:]) * 1e6  # the least disturbed round: robust on a loaded machine
        for kind in ("commit", "offload", "restore"):
            row[f"{kind}_ratio"] = row[f"{kind}_loop_us"] / row[f"{kind}_bulk_us"]
        out.append(row)
    return out


def _bulk_round(
    mgr: CacheManager, form: str, slots: list[int], arr: Any, accepted: Any, inner: int
) -> dict[str, float]:
    """Seconds of ``inner`` commit, offload and restore batches (each queued then flushed) in ``form``."""
    acc = accepted.tolist()
    out = {"commit": 0.0, "offload": 0.0, "restore": 0.0}
    for _ in range(inner):
        t0 = time.perf_counter()
        if form == "bulk":
            mgr.commit_many(arr, accepted, "r")
        else:
            for s, a in zip(slots, acc, strict=True):
                mgr.commit_draft(s, a, "r")
        mgr.flush_nowait()
        t1 = time.perf_counter()
        hosts = mgr.offload_many(arr, "r") if form == "bulk" else [mgr.offload(s, "r") for s in slots]
        mgr.flush_nowait()
        t2 = time.perf_counter()
        if form == "bulk":
            mgr.restore_many(hosts, arr, "r")
        else:
            for h, s in zip(hosts, slots, strict=True):
                mgr.restore(h, s, "r")
        mgr.flush_nowait()
        t3 = time.perf_counter()
        out["commit"] += t1 - t0
        out["offload"] += t2 - t1
        out["restore"] += t3 - t2
    return out
