"""A continuous-batching scheduler with a prefix cache, driving a CacheManager.

Each step:  admit arrivals (fork a cached prefix, or take a cleared slot)
         -> flush (the clears and forks run before the forward)
         -> forward every running request (a prefill chunk, or one decode token)
         -> release finished requests; cache the state at the prefix boundary.

The prefix cache keeps, for the first ``prefix_len`` tokens of a prompt, a pool
slot with the state after them (a copy-on-write fork of the request that
computed it) and the attention KV; it is evicted least-recently-used when the
pool runs out, so slots are reused dirty all the time.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import tracing
from .._manager import CacheManager
from .._pool import StatePool
from ._models import SimModel, build_model

__all__ = ["FAULTS", "SimConfig", "SimReport", "simulate"]

FAULTS = ("none", "skip-clear", "skip-fork", "wrong-commit")


@dataclass(frozen=True, slots=True)
class SimConfig:
    model: str = "toy"
    requests: int = 32
    max_running: int = 6
    prefix_share: float = 0.6
    seed: int = 0
    slots: int | None = None  # default: max_running + max_running // 2 (room for a few cached prefixes)
    prefixes: int = 3  # distinct shared prefixes
    prefix_len: int = 8
    suffix_len: tuple[int, int] = (2, 10)
    new_tokens: tuple[int, int] = (3, 10)
    arrival_rate: float = 1.0  # requests per step, Poisson
    fault: str = "none"
    executor: str | None = None
    verify: bool = True
    trace: str | None = None
    speculative: int = 0  # draft tokens proposed per decode step (0: plain decoding)
    draft_accuracy: float = 0.7  # chance that each proposed token is the target's own next token


@dataclass(frozen=True, slots=True)
class SimReport:
    model: str
    requests: int
    completed: int
    mismatches: int
    forks: int
    clears: int
    clears_elided: int
    prefix_hits: int
    evictions: int
    peak_slots_in_use: int
    num_slots: int
    steps: int
    tokens: int
    tokens_per_s: float
    manager_overhead_fraction: float
    seconds: float
    fault: str
    mismatched_requests: tuple[str, ...] = ()
    speculative: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    commits: int = 0


@dataclass(slots=True)
class _Request:
    rid: str
    prompt: list[int]
    n_new: int
    arrival: int
    slot: int = 0
    ctx: Any = None
    pos: int = 0
    out: list[int] = field(default_factory=list)
    reference: list[int] = field(default_factory=list)  # its isolated greedy continuation (drafts come from it)


@dataclass(slots=True)
class _Entry:
    slot: int
    kv: Any
    rid: str  # the entry's tenant id in the trace


def make_workload(cfg: SimConfig, vocab: int) -> list[_Request]:
    """Seeded Poisson arrivals; a share of prompts start with one of a few common prefixes."""
    rng = random.Random(cfg.seed)
    shared = [[rng.randrange(3, vocab) for _ in range(cfg.prefix_len)] for _ in range(cfg.prefixes)]
    t, out = 0.0, []
    for i in range(cfg.requests):
        t += rng.expovariate(cfg.arrival_rate)
        if rng.random() < cfg.prefix_share:
            head = list(rng.choice(shared))
        else:
            head = [rng.randrange(3, vocab) for _ in range(cfg.prefix_len)]
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(*cfg.suffix_len))]
        out.append(_Request(f"req-{i}", head + tail, rng.randint(*cfg.new_tokens), int(t)))
    return out


class _Scheduler:
    def __init__(self, cfg: SimConfig, model: SimModel, mgr: CacheManager, pool: StatePool) -> None:
        self.cfg, self.model, self.mgr, self.pool = cfg, model, mgr, pool
        self.prefix_cache: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.running: list[_Request] = []
        self.forks = self.clears = self.elided = self.hits = self.evictions = self.peak = 0
        self.manager_s = 0.0
        self._entries = 0
        self.proposed = self.accepted = self.commits = 0
        self._rng = random.Random(cfg.seed + 1)

    def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.manager_s += time.perf_counter() - t0

    def _free_one(self) -> bool:
        """Make a slot free by evicting the least recently used prefix; False if none is left."""
        if self.pool.num_free:
            return True
        if not self.prefix_cache:
            return False
        _, entry = self.prefix_cache.popitem(last=False)
        self._timed(self.mgr.release, entry.slot, request_id=entry.rid)
        self.evictions += 1
        return True

    def admit(self, req: _Request) -> None:
        cfg = self.cfg
        key = tuple(req.prompt[: cfg.prefix_len])
        entry = self.prefix_cache.get(key)
        (req.slot,) = self._timed(self.mgr.alloc, 1, request_id=req.rid)
        self.clears += self.mgr.clear_on_alloc
        if entry is not None:
            self.prefix_cache.move_to_end(key)
            if cfg.fault != "skip-fork":
                self._timed(self.mgr.copy_on_write, entry.slot, req.slot, request_id=req.rid)
                self.forks += 1
            req.ctx, req.pos = self.model.restore(entry.kv), cfg.prefix_len
            self.hits += 1
        else:
            req.ctx = self.model.new_context()
        self.model.bind(req.ctx, self.pool, req.slot)
        self.running.append(req)

    def advance(self, req: _Request) -> bool:
        """One forward for ``req``; True when it has all its tokens."""
        cfg, model = self.cfg, self.model
        if req.pos == 0:
            # Prefill the prefix as its own chunk and fork its state into the cache;
            # the fork runs at the next flush, before this slot is written again.
            model.forward(req.ctx, req.prompt[: cfg.prefix_len])
            req.pos = cfg.prefix_len
            key = tuple(req.prompt[: cfg.prefix_len])
            if key not in self.prefix_cache and self._free_one():
                self._entries += 1
                rid = f"prefix:{self._entries}"
                (slot,) = self._timed(self.mgr.alloc, 1, request_id=rid, clear=False)
                self._timed(self.mgr.copy_on_write, req.slot, slot, request_id=rid)
                self.forks += 1
                self.prefix_cache[key] = _Entry(slot, model.snapshot(req.ctx), rid)
            return False
        if req.pos < len(req.prompt):
            req.out.append(model.forward(req.ctx, req.prompt[req.pos :]))
            req.pos = len(req.prompt)
        elif cfg.speculative:
            self.speculate(req)
        else:
            req.out.append(model.forward(req.ctx, [req.out[-1]]))
        return len(req.out) >= req.n_new

    def speculate(self, req: _Request) -> None:
        """One speculative decode step: propose k tokens, verify k + 1 positions, commit the accepted state.

        The verify forward runs token by token in the slot's draft buffers: position
        ``j`` starts from position ``j - 1`` (the slot's own state for ``j = 0``) and
        holds the state after input ``j``, so the slot itself is not written. Inputs
        are the pending token and the k drafts; the target's greedy choice after each
        is ``ys[j]``. Drafts are accepted while they equal the target's choices; the
        slot then takes, by ``CommitDraft`` at the next flush (before its next
        forward), the state after the pending token and the accepted drafts.
        """
        cfg, model, pool = self.cfg, self.model, self.pool
        k = cfg.speculative
        have = len(req.out)
        drafts = [
            req.reference[have + i]
            if self._rng.random() < cfg.draft_accuracy
            else self._rng.randrange(model.vocab_size)
            for i in range(k)
        ]
        inputs = [req.out[-1], *drafts]
        ys: list[int] = []
        for j, token in enumerate(inputs):
            for t, d in zip(pool.tensors, pool.draft_tensors, strict=True):
                d[:, req.slot, j].copy_(t[:, req.slot] if j == 0 else d[:, req.slot, j - 1])
            model.bind_draft(req.ctx, pool, req.slot, j)
            ys.append(model.forward(req.ctx, [token]))
        accepted = 0
        while accepted < k and drafts[accepted] == ys[accepted]:
            accepted += 1
        consumed = accepted + 1  # the pending token and the accepted drafts
        commit = consumed - 1 if cfg.fault == "wrong-commit" else consumed
        self._timed(self.mgr.commit_draft, req.slot, commit, request_id=req.rid)
        model.bind(req.ctx, pool, req.slot)
        model.drop_tokens(req.ctx, len(inputs) - consumed)
        req.out += ys[:consumed]
        self.proposed += k
        self.accepted += accepted
        self.commits += 1

    async def run(self, waiting: deque[_Request], on_done: Callable[[_Request], None]) -> int:
        step = 0
        while waiting or self.running:
            while waiting and waiting[0].arrival <= step and len(self.running) < self.cfg.max_running:
                if not self._free_one():
                    break
                self.admit(waiting.popleft())
            t0 = time.perf_counter()
            report = await self.mgr.flush()
            self.manager_s += time.perf_counter() - t0
            self.elided += report.elided
            self.peak = max(self.peak, self.pool.num_slots - self.pool.num_free)
            finished = [r for r in self.running if self.advance(r)]
            for req in finished:
                self._timed(self.mgr.release, req.slot, request_id=req.rid)
                self.running.remove(req)
                on_done(req)
            step += 1
        return step


async def simulate(
    cfg: SimConfig, model: SimModel | None = None, on_done: Callable[[_Request], None] | None = None
) -> SimReport:
    """Run the workload through a CacheManager; with ``verify``, compare every request to ``generate``."""
    if cfg.fault not in FAULTS:
        raise ValueError(f"unknown fault {cfg.fault!r}; choose from {FAULTS}")
    if cfg.suffix_len[0] < 1 or cfg.new_tokens[0] < 1:
        raise ValueError("prompts need a suffix after the prefix, and requests at least one new token")
    if cfg.fault == "wrong-commit" and not cfg.speculative:
        raise ValueError("the wrong-commit fault needs speculative decoding (speculative > 0)")
    model = model if model is not None else build_model(cfg.model, cfg.seed)
    workload = make_workload(cfg, model.vocab_size)
    if cfg.speculative:
        # The drafts' source, and the verification's reference: one isolated greedy run each.
        for req in workload:
            req.reference = model.generate(req.prompt, req.n_new + cfg.speculative + 1)
    num_slots = cfg.slots if cfg.slots is not None else cfg.max_running + max(2, cfg.max_running // 2)
    if num_slots < cfg.max_running + 1:
        raise ValueError(f"slots ({num_slots}) must exceed max_running ({cfg.max_running})")
    pool = StatePool(model.spec, num_slots, draft_tokens=cfg.speculative + 1 if cfg.speculative else 0)
    # Dirty from the start, as a pool reused across server restarts would be.
    generator = torch.Generator().manual_seed(cfg.seed)
    for t in pool.tensors:
        t[:, 1:].normal_(generator=generator)
    if cfg.trace:
        tracing.configure(cfg.trace, level="debug")
    done: list[_Request] = []

    def finished(req: _Request) -> None:
        done.append(req)
        if on_done is not None:
            on_done(req)

    t0 = time.perf_counter()
    try:
        async with CacheManager(pool, executor=cfg.executor, clear_on_alloc=cfg.fault != "skip-clear") as mgr:
            sched = _Scheduler(cfg, model, mgr, pool)
            steps = await sched.run(deque(workload), finished)
    finally:
        if cfg.trace:
            tracing.disable()
    seconds = time.perf_counter() - t0
    for r in done:
        del r.out[r.n_new :]  # a speculative step may overshoot the last one
    mismatched = tuple(
        r.rid
        for r in done
        if cfg.verify and r.out != (r.reference[: r.n_new] if cfg.speculative else model.generate(r.prompt, r.n_new))
    )
    tokens = sum(len(r.out) for r in done)
    return SimReport(
        model=model.name,
        requests=cfg.requests,
        completed=len(done),
        mismatches=len(mismatched),
        forks=sched.forks,
        clears=sched.clears,
        clears_elided=sched.elided,
        prefix_hits=sched.hits,
        evictions=sched.evictions,
        peak_slots_in_use=sched.peak,
        num_slots=num_slots,
        steps=steps,
        tokens=tokens,
        tokens_per_s=tokens / seconds if seconds else 0.0,
        manager_overhead_fraction=sched.manager_s / seconds if seconds else 0.0,
        seconds=seconds,
        fault=cfg.fault,
        mismatched_requests=mismatched,
        speculative=cfg.speculative,
        drafts_proposed=sched.proposed,
        drafts_accepted=sched.accepted,
        commits=sched.commits,
    )
