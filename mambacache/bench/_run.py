"""The measurements of ``mambacache bench``.

Every figure is a median of repeated runs after warm-up, with min and max; the
ratios compare paths measured in the same run on the same pool:

* clear: against a warm contiguous ``zero_()`` of the same bytes (the memset
  bound), and against the seed's expand-based clear;
* copy: against a contiguous ``copy_`` of the same bytes, and the seed's
  advanced-index copy ``t[:, dst] = t[:, src]``;
* workspace: the op audit's temporaries and non-contiguous inputs per step;
* host: submit + plan microseconds per event, and the cost of tracing when off.
"""

from __future__ import annotations

import random
import statistics
import time
import timeit
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import anyio
import torch

from .. import _tracing
from .._events import Clear, CopyOnWrite
from .._executors import resolve_executor
from .._manager import CacheManager
from .._planner import Stage, plan_step
from .._pool import StatePool
from .._spec import StateSpec
from ..audit import OpAudit
from ._presets import PRESETS, fit_layers

__all__ = ["Result", "host_overhead", "run_preset", "tracing_overhead"]


@dataclass(frozen=True, slots=True)
class Result:
    preset: str
    layers: int
    slots: int
    op: str  # clear | copy
    path: str  # an executor name, or seed / memset / memcpy
    median_s: float
    min_s: float
    max_s: float
    bytes: int
    gb_s: float
    vs_bound: float  # the memset/memcpy time over this time: 1.0 is the bandwidth bound
    vs_seed: float  # the seed path's time over this time: > 1 is faster than the seed
    peak_temp_bytes: int | None = None
    noncontiguous_input_bytes: int | None = None
    host_syncs: int | None = None  # ops that read device data back (audit), plus CUDA's sync debug mode

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


def measure(
    fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2, min_total_s: float = 0.2
) -> tuple[float, float, float]:
    """Median, min and max seconds of ``fn``, after warm-up.

    Short runs are repeated until ``min_total_s`` is measured (at most 200 times):
    on a shared machine a handful of sub-millisecond samples is mostly noise.
    """
    for _ in range(warmup):
        fn()
    _sync(device)
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_total_s and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), max(times)


def _zero_all(bufs: list[torch.Tensor]) -> None:
    for b in bufs:
        b.zero_()


def _copy_all(src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
    for a, b in zip(src, dst, strict=True):
        b.copy_(a)


def _seed_clear(pool: StatePool, idx: torch.Tensor) -> None:
    """SGLang's clear_slots before its NPU fix: zeros(1).expand + advanced-index assignment."""
    for t in pool.tensors:
        t[:, idx] = torch.zeros(1, dtype=t.dtype, device=t.device).expand(t.shape[0], len(idx), *t.shape[2:])


def _seed_copy(pool: StatePool, src: torch.Tensor, dst: torch.Tensor) -> None:
    for t in pool.tensors:
        t[:, dst] = t[:, src]


def _run_stage(executor: Any, stage: Stage, pool: StatePool) -> Callable[[], None]:
    def go() -> None:
        for t in pool.tensors:
            executor.execute(stage, t)

    return go


def _audit(fn: Callable[[], object], device: torch.device) -> tuple[int, int, int]:
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
    return report.peak_temp_bytes, report.noncontiguous_input_bytes, syncs + len(report.sync_ops)


def run_preset(
    name: str,
    sizes: Sequence[int],
    executors: Sequence[str],
    device: torch.device,
    repeats: int,
    budget_bytes: int,
    workspace_bytes: int,
    seed: int = 0,
) -> Iterator[Result]:
    """Clear and copy ``n`` random slots for each ``n`` in ``sizes``: every executor and the baselines."""
    num_slots = 2 * max(sizes) + 8
    spec: StateSpec = fit_layers(PRESETS[name].spec, num_slots, budget_bytes)
    pool = StatePool(spec, num_slots, device)
    for t in pool.tensors:
        t.fill_(1)
    rng = random.Random(seed)
    impls = {e: resolve_executor(e, device, workspace_bytes) for e in executors}
    for n in sizes:
        chosen = rng.sample(range(1, num_slots + 1), 2 * n)
        zero_slots, src, dst = sorted(chosen[:n]), chosen[:n], chosen[n:]
        nbytes = n * spec.slot_bytes
        # The bandwidth bound: contiguous buffers holding the same bytes, warm.
        bufs = [torch.empty(t.shape[0], n, *t.shape[2:], dtype=t.dtype, device=device) for t in pool.tensors]
        bufs2 = [torch.empty_like(b) for b in bufs]
        memset = measure(partial(_zero_all, bufs), device, repeats)
        memcpy = measure(partial(_copy_all, bufs, bufs2), device, repeats)
        del bufs, bufs2
        zidx = torch.tensor(zero_slots, device=device)
        sidx, didx = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        seed_z = measure(partial(_seed_clear, pool, zidx), device, repeats)
        seed_c = measure(partial(_seed_copy, pool, sidx, didx), device, repeats)
        (zstage,) = plan_step([Clear(s) for s in zero_slots]).stages
        (cstage,) = plan_step([CopyOnWrite(s, d) for s, d in zip(src, dst, strict=True)]).stages

        def result(
            op: str,
            path: str,
            t: tuple[float, float, float],
            bound: float,
            seed_t: float,
            audit: Any = None,
            n: int = n,
            nbytes: int = nbytes,
        ) -> Result:
            return Result(name, spec.num_layers, n, op, path, *t, nbytes, nbytes / t[0] / 1e9, bound / t[0],
                          seed_t / t[0], *(audit or (None, None, None)))  # fmt: skip

        yield result("clear", "memset", memset, memset[0], seed_z[0], None)
        yield result("clear", "seed", seed_z, memset[0], seed_z[0], _audit(partial(_seed_clear, pool, zidx), device))
        for ename, ex in impls.items():
            timing = measure(_run_stage(ex, zstage, pool), device, repeats)
            fresh = resolve_executor(ename, device, workspace_bytes)  # its first step shows its workspace
            yield result("clear", ename, timing, memset[0], seed_z[0], _audit(_run_stage(fresh, zstage, pool), device))
        yield result("copy", "memcpy", memcpy, memcpy[0], seed_c[0], None)
        yield result(
            "copy", "seed", seed_c, memcpy[0], seed_c[0], _audit(partial(_seed_copy, pool, sidx, didx), device)
        )
        for ename, ex in impls.items():
            timing = measure(_run_stage(ex, cstage, pool), device, repeats)
            fresh = resolve_executor(ename, device, workspace_bytes)
            yield result("copy", ename, timing, memcpy[0], seed_c[0], _audit(_run_stage(fresh, cstage, pool), device))


class _NullExecutor:
    """Does no device work: what is left of a flush is host overhead."""

    name = "null"

    def execute(self, stage: Stage, tensor: torch.Tensor) -> None:
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
                live = mgr.alloc(k)
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


def tracing_overhead(events: int = 1000, repeats: int = 7) -> dict[str, float]:
    """A flush of ``events`` events with tracing off, against the same work without the tracing checks.

    The checks are one attribute read and a None test per submit call and per
    flush; their cost is measured on its own and set against the whole.
    """
    rows = host_overhead([events], repeats)
    per_event_us = rows[0]["us_per_event"]
    state = _tracing.state
    check_s = min(timeit.repeat("log = state.slot_log\nif log is not None: pass", globals={"state": state},
                                number=100_000, repeat=5)) / 100_000  # fmt: skip
    checks = events + 2  # one per submit, plus the flush's summary and error paths
    total_s = per_event_us * 1e-6 * events
    return {
        "events": events,
        "flush_us_tracing_off": total_s * 1e6,
        "check_ns": check_s * 1e9,
        "checks": checks,
        "overhead_fraction": checks * check_s / (total_s - checks * check_s),
    }
