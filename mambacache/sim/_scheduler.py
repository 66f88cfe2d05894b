"""A continuous-batching scheduler with a prefix cache and preemption, driving a CacheManager.

Each step:  admit arrivals and preempted requests (fork a cached prefix, restore a
            swapped state, or take a cleared slot; preempt a long runner when
            slots run out)
         -> flush (the clears, forks, restores and offloads run before the forward)
         -> forward every running request (a prefill chunk of one block, or a decode)
         -> checkpoint the state at each block boundary of a prefill (and, with the
            junction policy, at the end of the system prompt); release finished
            requests.

Prefix states live in a :class:`PrefixCache` (checkpoints in the pool, evicted to
its host tier when one is set); the attention KV of a checkpoint (Qwen3-Next) is
the checkpoint's payload. Slots are reused dirty all the time. With adapters,
a request's prompt ids run through its adapter before the model sees them, so
equal ids under another adapter compute another state: the cache keys by the
adapter.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import tracing
from .._core._errors import PoolExhaustedError
from .._core._pool import StatePool
from .._manager import CacheManager
from .._tiers._hostpool import HostPool
from .._tiers._prefix import PrefixCache
from ._config import CHECKPOINTS, FAULTS, PREEMPT, SCENARIOS, SimConfig
from ._models import SimModel, build_model

__all__ = ["CHECKPOINTS", "FAULTS", "PREEMPT", "SCENARIOS", "SimConfig", "SimReport", "pool_sizes", "simulate"]


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
    prefix_misses: int = 0
    hit_rate: float = 0.0
    tokens_saved: int = 0
    checkpoints: int = 0
    host_offloads: int = 0
    host_restores: int = 0
    preempt: str = "none"
    swaps: int = 0
    recomputes: int = 0
    recomputed_tokens: int = 0
    reserved: int = 0
    evicted_for_requests: int = 0  # checkpoints evicted to admit a request (only those above the reservation)
    checkpoints_kept: int = 0  # fewest device checkpoints at a step's end once max(1, reserved) were first held
    state_dtype: str = "float32"
    checkpoint: str = "grid"
    adapters: int = 0
    cross_key_hits: int = 0  # forks from a checkpoint another adapter's request made (0 unless the key is ignored)


@dataclass(slots=True)
class _Request:
    rid: str
    prompt: list[int]
    n_new: int
    arrival: int
    slot: int = 0
    ctx: Any = None
    pos: int = 0  # tokens of `seq` the slot's state has consumed
    out: list[int] = field(default_factory=list)
    reference: list[int] = field(default_factory=list)  # its isolated greedy continuation (drafts come from it)
    seq: list[int] = field(default_factory=list)  # what prefill consumes: the prompt (and, recomputing, the output)
    host: int = 0  # host slot of a swapped-out state
    ran: int = 0  # steps since (re)admission
    adapter: int | None = None  # the extra key: what the prompt's ids mean depends on it
    inputs: list[int] = field(default_factory=list)  # the prompt as the model sees it (through the adapter)
    fed: list[int] = field(default_factory=list)  # what prefill feeds the model: `seq` through the adapter
    junction: int = 0  # where the system prompt ends

    @property
    def seen(self) -> int:
        """Tokens the request's state has consumed: the prefill so far, or after it, all but the last output."""
        if self.pos < len(self.seq) or not self.out:
            return self.pos
        return len(self.prompt) + len(self.out) - 1


def adapt(tokens: list[int], adapter: int | None, vocab: int) -> list[int]:
    """The ids as the model sees them under ``adapter`` (a shift of the ids above 2): an adapter, or an image's
    features under its placeholder ids, changes what equal ids compute."""
    if adapter is None:
        return list(tokens)
    return [3 + (t - 3 + 17 * adapter) % (vocab - 3) if t >= 3 else t for t in tokens]


def make_workload(cfg: SimConfig, vocab: int) -> list[_Request]:
    """Seeded Poisson arrivals; a share of prompts start with one of a few common prefixes (system prompts of
    ``prefix_len`` tokens); with ``adapters``, each request runs under one of them or none."""
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
        prompt = head + tail
        req = _Request(f"req-{i}", prompt, rng.randint(*cfg.new_tokens), int(t), seq=list(prompt))
        if cfg.adapters:  # drawn only then: a workload without adapters is the one it always was
            req.adapter = rng.choice([None, *range(1, cfg.adapters + 1)])
        req.inputs = adapt(prompt, req.adapter, vocab)
        req.fed, req.junction = list(req.inputs), cfg.prefix_len
        out.append(req)
    return out


class _Scheduler:
    def __init__(self, cfg: SimConfig, model: SimModel, mgr: CacheManager, pool: StatePool, cache: PrefixCache) -> None:
        self.cfg, self.model, self.mgr, self.pool, self.cache = cfg, model, mgr, pool, cache
        self.running: list[_Request] = []
        self.preempted: deque[_Request] = deque()
        self.forks = self.clears = self.elided = self.peak = 0
        self.swaps = self.recomputes = self.recomputed_tokens = 0
        self.evicted_for_requests = 0
        self.kept: int | None = None  # fewest checkpoints at a step's end since max(1, reserved) were first held
        self.manager_s = 0.0
        self.proposed = self.accepted = self.commits = self.cross_key_hits = 0
        self._rng = random.Random(cfg.seed + 1)

    def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.manager_s += time.perf_counter() - t0

    def _free_one(self) -> bool:
        """Make a slot available to a request, evicting the least recently used checkpoint if that helps (one
        above the reservation: a reserved one's slot stays kept for checkpoints); False if none can be."""
        if self.pool.num_available:
            return True
        if self.cache.stats.device_checkpoints <= self.cache.reserved or not self._timed(self.cache.evict):
            return False
        self.evicted_for_requests += 1
        return bool(self.pool.num_available)

    def _alloc(self, req: _Request, clear: bool | None = None) -> int:
        (slot,) = self._timed(self.mgr.alloc, 1, request_id=req.rid, clear=clear)
        return int(slot)

    def admit(self, req: _Request) -> None:
        cfg, model, mgr = self.cfg, self.model, self.mgr
        req.ran = 0
        if req.host:  # swapped out: its state comes back from the host into whatever slot is free
            req.slot = self._alloc(req, clear=cfg.fault == "skip-restore")
            if cfg.fault != "skip-restore":
                self._timed(mgr.restore, req.host, req.slot, request_id=req.rid)
            else:
                self._timed(mgr.drop, req.host)
            req.host = 0
            model.bind(req.ctx, self.pool, req.slot, req.seen)
            self.running.append(req)
            return
        hit = self._timed(self.cache.match, req.seq[:-1], key=self._key(req))
        if hit is not None:
            maker, payload = hit.payload
            self.cross_key_hits += maker != req.adapter
            if cfg.fault == "skip-fork":
                req.slot = self._alloc(req)
                self.clears += mgr.clear_on_alloc
            else:
                req.slot = self._timed(self.cache.fork, hit, request_id=req.rid)
                self.forks += 1
            req.ctx, req.pos = model.restore(payload), hit.length
        else:
            req.slot = self._alloc(req)
            self.clears += mgr.clear_on_alloc
            req.ctx, req.pos = model.new_context(), 0
        model.bind(req.ctx, self.pool, req.slot, req.seen)
        self.running.append(req)

    def _key(self, req: _Request) -> int | None:
        """The request's extra key in the prefix cache: its adapter (None under the ignore-key fault)."""
        return None if self.cfg.fault == "ignore-key" else req.adapter

    def preempt_one(self) -> bool:
        """Preempt the request that ran longest (``quantum`` steps at least, prefill done); False if none may be.

        Only requests past their prefill are preempted, so each admission yields a
        token at least: no livelock however long recomputed prefills grow.
        """
        cfg, mgr = self.cfg, self.mgr
        candidates = [r for r in self.running if r.ran >= cfg.quantum and r.pos == len(r.seq)]
        if cfg.preempt == "none" or not candidates:
            return False
        req = max(candidates, key=lambda r: r.ran)
        self.running.remove(req)
        if cfg.preempt == "swap":
            req.host = self._timed(mgr.offload, req.slot, request_id=req.rid)
            self.swaps += 1
        else:
            # Recompute: drop the state; prefill the prompt and the output so far again (from a
            # checkpoint where one matches), and the last chunk yields the next token.
            req.seq, req.fed = req.prompt + req.out, req.inputs + req.out
            req.ctx, req.pos = None, 0
            self.recomputes += 1
        self._timed(mgr.release, req.slot, request_id=req.rid)
        req.slot = 0
        self.preempted.append(req)
        return True

    def advance(self, req: _Request) -> bool:
        """One forward for ``req``; True when it has all its tokens."""
        cfg, model = self.cfg, self.model
        req.ran += 1
        if req.pos < len(req.seq):
            # Chunked prefill, one block per step: checkpoint at every block boundary (and, junction policy, at
            # the end of the system prompt: the chunk stops there); the copy runs at the next flush, before this
            # slot is written again. The cache keys by the ids and the adapter; the model runs on `fed`.
            end = min(len(req.seq), (req.pos // cfg.block_size + 1) * cfg.block_size)
            junction = cfg.checkpoint == "junction" and req.pos < req.junction <= end
            end = req.junction if junction else end
            token = model.forward(req.ctx, req.fed[req.pos : end], req.pos)
            if len(req.seq) > len(req.prompt):
                self.recomputed_tokens += end - req.pos
            req.pos = end
            if end % cfg.block_size == 0 or junction:
                payload = (req.adapter, model.snapshot(req.ctx))
                self._timed(self.cache.insert, req.seq[:end], req.slot, payload=payload, key=self._key(req))
            if end == len(req.seq):
                req.out.append(token)
        elif cfg.speculative:
            self.speculate(req)
        else:
            req.out.append(model.forward(req.ctx, [req.out[-1]], req.seen))
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
        seen = req.seen
        for j, token in enumerate(inputs):
            for t, d in zip(pool.tensors, pool.draft_tensors, strict=True):
                d[:, req.slot, j].copy_(t[:, req.slot] if j == 0 else d[:, req.slot, j - 1])
            model.bind_draft(req.ctx, pool, req.slot, j, seen + j)
            ys.append(model.forward(req.ctx, [token], seen + j))
        accepted = 0
        while accepted < k and drafts[accepted] == ys[accepted]:
            accepted += 1
        consumed = accepted + 1  # the pending token and the accepted drafts
        commit = consumed - 1 if cfg.fault == "wrong-commit" else consumed
        self._timed(self.mgr.commit_draft, req.slot, commit, request_id=req.rid)
        model.bind(req.ctx, pool, req.slot, seen + len(inputs))
        model.drop_tokens(req.ctx, len(inputs) - consumed, seen + consumed)
        req.out += ys[:consumed]
        self.proposed += k
        self.accepted += accepted
        self.commits += 1

    async def run(self, waiting: deque[_Request], on_done: Callable[[_Request], None]) -> int:
        step = 0
        while waiting or self.running or self.preempted:
            while len(self.running) < self.cfg.max_running:
                queue = self.preempted if self.preempted else waiting
                if not queue or queue[0].arrival > step:
                    break
                if not self._free_one() and not self.preempt_one():
                    break
                try:
                    self.admit(queue.popleft())
                except PoolExhaustedError:
                    raise AssertionError("admission found no slot after making one free") from None
            t0 = time.perf_counter()
            report = await self.mgr.flush()
            self.manager_s += time.perf_counter() - t0
            self.elided += report.elided
            self.peak = max(self.peak, self.pool.num_slots - self.pool.num_free)
            held = self.cache.stats.device_checkpoints
            if self.kept is not None or held >= max(1, self.cfg.reserved):
                self.kept = held if self.kept is None else min(self.kept, held)
            finished = [r for r in self.running if self.advance(r)]
            for req in finished:
                self._timed(self.mgr.release, req.slot, request_id=req.rid)
                self.running.remove(req)
                on_done(req)
            step += 1
        return step


async def simulate(
    cfg: SimConfig,
    model: SimModel | None = None,
    on_done: Callable[[_Request], None] | None = None,
    on_checked: Callable[[], None] | None = None,
) -> SimReport:
    """Run the workload through a CacheManager; with ``verify``, compare every request to ``generate``.
    ``on_done`` is called as each request completes, ``on_checked`` as each is verified after the run."""
    _check_config(cfg)
    model = model if model is not None else build_model(cfg.model, cfg.seed, cfg.state_dtype)
    workload = make_workload(cfg, model.vocab_size)
    if cfg.speculative:
        # The drafts' source, and the verification's reference: one isolated greedy run each.
        for req in workload:
            req.reference = model.generate(req.inputs, req.n_new + cfg.speculative + 1)
    num_slots, max_checkpoints, pool, host = _pools(cfg, model)
    if cfg.trace:
        tracing.configure(cfg.trace, level="debug")
    done: list[_Request] = []

    def finished(req: _Request) -> None:
        done.append(req)
        if on_done is not None:
            on_done(req)

    t0 = time.perf_counter()
    try:
        async with CacheManager(
            pool, executor=cfg.executor, clear_on_alloc=cfg.fault != "skip-clear", host_pool=host
        ) as mgr:
            cache = PrefixCache(mgr, cfg.block_size, max_checkpoints, cfg.host_checkpoints, cfg.reserved)
            sched = _Scheduler(cfg, model, mgr, pool, cache)
            steps = await sched.run(deque(workload), finished)
            cache.clear()  # the checkpoints' slots: an idle engine holds none
            mgr.check_idle()
    finally:
        if cfg.trace:
            tracing.disable()
    seconds = time.perf_counter() - t0
    mismatched = _verify(cfg, model, done, on_checked)
    return _report(cfg, model, done, mismatched, sched, cache, num_slots, steps, seconds)


def _check_config(cfg: SimConfig) -> None:
    """Refuse, with ValueError, the settings the simulation cannot honour (all but the slot count)."""
    if cfg.fault not in FAULTS:
        raise ValueError(f"unknown fault {cfg.fault!r}; choose from {FAULTS}")
    if cfg.preempt not in PREEMPT:
        raise ValueError(f"unknown preempt {cfg.preempt!r}; choose from {PREEMPT}")
    if cfg.suffix_len[0] < 1 or cfg.new_tokens[0] < 1:
        raise ValueError("prompts need a suffix after the prefix, and requests at least one new token")
    if cfg.fault == "wrong-commit" and not cfg.speculative:
        raise ValueError("the wrong-commit fault needs speculative decoding (speculative > 0)")
    if cfg.fault == "skip-restore" and cfg.preempt != "swap":
        raise ValueError("the skip-restore fault needs preemption by swap (preempt='swap')")
    if cfg.checkpoint not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint policy {cfg.checkpoint!r}; choose from {CHECKPOINTS}")
    if cfg.adapters < 0 or (cfg.fault == "ignore-key" and not cfg.adapters):
        raise ValueError("adapters must be >= 0, and the ignore-key fault needs adapters > 0")


def pool_sizes(cfg: SimConfig) -> tuple[int, int]:
    """The slot count and the checkpoint limit; ValueError for sizes the run cannot honour."""
    num_slots = cfg.slots if cfg.slots is not None else cfg.max_running + max(2, cfg.max_running // 2)
    # A request forks while the checkpoint it reads stays held: one slot beyond the runners, or the reservation's.
    if num_slots < 2 or (cfg.preempt == "none" and num_slots < cfg.max_running + max(1, cfg.reserved)):
        raise ValueError(
            f"slots ({num_slots}) must be at least max_running ({cfg.max_running}) + max(1, reserved"
            f" ({cfg.reserved})) without preemption"
        )
    max_checkpoints = cfg.max_checkpoints if cfg.max_checkpoints is not None else max(1, num_slots - cfg.max_running)
    if not 0 <= cfg.reserved <= min(max_checkpoints, num_slots - 1):
        raise ValueError(
            f"reserved ({cfg.reserved}) must be in 0..min(max_checkpoints, slots - 1)"
            f" = 0..{min(max_checkpoints, num_slots - 1)}"
        )
    return num_slots, max_checkpoints


def _pools(cfg: SimConfig, model: SimModel) -> tuple[int, int, StatePool, HostPool | None]:
    """The slot count, the checkpoint limit, the dirty state pool and the host pool (None when unused)."""
    num_slots, max_checkpoints = pool_sizes(cfg)
    pool = StatePool(model.spec, num_slots, draft_tokens=cfg.speculative + 1 if cfg.speculative else 0)
    host = None
    if cfg.host_checkpoints or cfg.preempt == "swap":
        host = HostPool(model.spec, cfg.host_checkpoints + cfg.requests)
    # Dirty from the start, as a pool reused across server restarts would be.
    generator = torch.Generator().manual_seed(cfg.seed)
    for t in pool.tensors:
        if t.dtype.is_floating_point and t.element_size() > 1:
            t[:, 1:].normal_(generator=generator)
        else:  # int8 / fp8 states have no normal_: spread noise over their range instead
            noise = torch.randn(t[:, 1:].shape, generator=generator) * 40
            t[:, 1:] = noise.clamp(-127, 127).to(t.dtype)
    return num_slots, max_checkpoints, pool, host


def _verify(
    cfg: SimConfig, model: SimModel, done: list[_Request], on_checked: Callable[[], None] | None
) -> tuple[str, ...]:
    """The ids of the requests whose outputs differ from their isolated generation (none without ``verify``)."""
    mismatched = []
    for r in done:
        del r.out[r.n_new :]  # a speculative step may overshoot the last one
        if cfg.verify:
            if r.out != (r.reference[: r.n_new] if cfg.speculative else model.generate(r.inputs, r.n_new)):
                mismatched.append(r.rid)
            if on_checked is not None:
                on_checked()
    return tuple(mismatched)


def _report(
    cfg: SimConfig,
    model: SimModel,
    done: list[_Request],
    mismatched: tuple[str, ...],
    sched: _Scheduler,
    cache: PrefixCache,
    num_slots: int,
    steps: int,
    seconds: float,
) -> SimReport:
    """The finished run's report."""
    tokens = sum(len(r.out) for r in done)
    return SimReport(
        model=model.name,
        requests=cfg.requests,
        completed=len(done),
        mismatches=len(mismatched),
        forks=sched.forks,
        clears=sched.clears,
        clears_elided=sched.elided,
        prefix_hits=cache.stats.hits,
        evictions=cache.stats.evictions,
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
        prefix_misses=cache.stats.misses,
        hit_rate=cache.stats.hit_rate,
        tokens_saved=cache.stats.tokens_saved,
        checkpoints=cache.stats.inserts,
        host_offloads=cache.stats.offloads + sched.swaps,
        host_restores=cache.stats.restores + (sched.swaps if cfg.fault != "skip-restore" else 0),
        preempt=cfg.preempt,
        swaps=sched.swaps,
        recomputes=sched.recomputes,
        recomputed_tokens=sched.recomputed_tokens,
        reserved=cfg.reserved,
        evicted_for_requests=sched.evicted_for_requests,
        checkpoints_kept=sched.kept or 0,
        state_dtype=getattr(model, "state_dtype", "float32"),
        checkpoint=cfg.checkpoint,
        adapters=cfg.adapters,
        cross_key_hits=sched.cross_key_hits,
    )
