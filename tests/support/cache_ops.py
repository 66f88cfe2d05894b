"""The random-operation interpreter of the prefix-cache property tests, against :class:`CacheModel`.

Shared by tests/tiers/test_tiers_property.py (the tiers together, on the block grid) and
tests/tiers/test_prefix_offgrid_keys.py (any length, under extra keys): a drawn operation ``(kind, a, b)`` runs
on the real cache or manager and on the oracle alike; a :class:`Workload` says which prompt, tokens and extra key
``a`` and ``b`` pick, and each test module keeps its own check of the real objects against the oracle.

The oracle: what every running slot, draft state and swapped request's host slot must hold, and the model of the
cache. Each state is a tag value written across the whole slot, so a misplaced, stale or half-copied state shows.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import pytest

import mambacache as mc

from .cache_model import CacheModel, flush

Prompt = tuple[list[int], Hashable]  # (tokens, extra key)


@dataclass(frozen=True)
class Workload:
    """What a drawn operation's two integers pick: ``admit(a, b)`` the prompt a request is admitted with (its last
    token is the one the forward computes), ``match(a, b)`` the tokens looked up alone, ``insert(own, b)`` the
    tokens a running request (admitted with ``own``) checkpoints."""

    admit: Callable[[int, int], Prompt]
    match: Callable[[int, int], Prompt]
    insert: Callable[[Prompt, int], Prompt]


class Interpreter:
    """Plays drawn operations on a manager, its host pool and a prefix cache, and on the oracle."""

    def __init__(
        self,
        mgr: mc.CacheManager,
        cache: mc.PrefixCache,
        model: CacheModel,
        workload: Workload,
        check: Callable[[Interpreter], None],
    ) -> None:
        self.mgr, self.cache, self.model, self.workload, self.check = mgr, cache, model, workload, check
        self.pool = mgr.pool
        host = mgr.host_pool
        assert host is not None
        self.host = host
        self.slots: dict[int, float] = {}  # running slot -> its state's tag
        self.prompt: dict[int, Prompt] = {}  # running slot -> what it was admitted with
        self.drafts: dict[tuple[int, int], float] = {}  # (slot, j) -> draft state j's tag, this step
        self.swapped: dict[int, tuple[float, Prompt]] = {}  # host slot -> (state, prompt) of a preempted request
        self.tag = 1.0

    def fresh(self) -> float:
        self.tag += 1.0
        return self.tag

    def forward(self) -> None:
        """A decode step writes every running slot, and a verify pass every draft state of it."""
        self.drafts.clear()
        for slot in self.slots:
            self.slots[slot] = self.fresh()
            for t in self.pool.tensors:
                t[:, slot] = self.slots[slot]
            for j in range(self.pool.spec.draft_tokens):
                self.drafts[slot, j] = self.fresh()
                for d in self.pool.draft_tensors:
                    d[:, slot, j] = self.drafts[slot, j]

    def run(self, raw: list[tuple[str, int, int]], faults: list[int], ops: list[int] | None = None) -> None:
        """Play ``raw``, the ``i``-th flush faulted at ``faults[i]`` (``ops`` gets each flush's op count), each
        flush checked and followed by a forward; then a last flush, checked, and everything given back."""
        fault_iter = iter(faults)
        for kind, a, b in raw:
            if kind != "flush":
                self.play(kind, a, b)
                continue
            n = flush(self.mgr, next(fault_iter, 0))
            if ops is not None:
                ops.append(n)
            self.check(self)
            self.forward()
        flush(self.mgr, next(fault_iter, 0))
        self.check(self)
        self.cache.clear()
        for slot in list(self.slots):
            self.mgr.release(slot)
        for h in list(self.swapped):
            self.mgr.drop(h)
        flush(self.mgr, 0)
        self.mgr.check_idle()

    def play(self, kind: str, a: int, b: int) -> None:
        """One drawn operation (any but a flush) on the cache or the manager, and on the oracle."""
        mgr, cache, m, running = self.mgr, self.cache, self.model, sorted(self.slots)
        if kind == "admit":
            prompt, key = self.workload.admit(a, b)
            hit = cache.match(prompt[:-1], key=key)
            want = m.match(prompt[:-1], key)
            assert (None if hit is None else ((key, tuple(prompt[: hit.length])), hit.tier)) == want
            try:
                if want is not None:
                    value = m.fork(want[0])
                elif m.available():  # a plain alloc evicts nothing
                    m.pool_free -= 1
                    value = 0.0
                else:
                    raise mc.PoolExhaustedError("model: the pool is full")
            except mc.PoolExhaustedError:
                with pytest.raises(mc.PoolExhaustedError):
                    cache.fork(hit, request_id="r") if hit is not None else mgr.alloc(1, request_id="r")
                return
            slot = cache.fork(hit, request_id="r") if hit is not None else mgr.alloc(1, request_id="r")[0]
            self.slots[slot], self.prompt[slot] = value, (prompt, key)
        elif kind == "match":
            tokens, key = self.workload.match(a, b)
            hit = cache.match(tokens, key=key)
            assert (None if hit is None else ((key, tuple(tokens[: hit.length])), hit.tier)) == m.match(tokens, key)
        elif kind == "insert" and running:
            # The request's own prompt or any other: the cache takes the caller's word for what a state is.
            slot = running[a % len(running)]
            tokens, key = self.workload.insert(self.prompt[slot], b)
            assert cache.insert(tokens, slot, key=key) == m.insert((key, tuple(tokens)), self.slots[slot])
        elif kind == "evict":
            assert cache.evict() == m.evict(None)
        elif kind == "commit" and running:
            slot = running[a % len(running)]
            accepted = b % (self.pool.spec.draft_tokens + 1)
            if accepted and (slot, accepted - 1) not in self.drafts:
                return  # admitted since the last forward: its draft buffer holds nothing of its own
            mgr.commit_draft(slot, accepted, request_id="r")
            if accepted:
                self.slots[slot] = self.drafts[slot, accepted - 1]
        elif kind in ("swap-out", "snapshot") and running:
            slot = running[a % len(running)]
            if not m.host_free:
                with pytest.raises(mc.PoolExhaustedError):
                    mgr.offload(slot, request_id="r")
                return
            h = mgr.offload(slot, request_id="r")
            m.host_free -= 1
            self.swapped[h] = (self.slots[slot], self.prompt[slot])
            if kind == "swap-out":
                mgr.release(slot, request_id="r")
                del self.slots[slot], self.prompt[slot]
                m.pool_free += 1
        elif kind == "swap-in" and self.swapped:
            h = sorted(self.swapped)[a % len(self.swapped)]
            if not m.available():
                with pytest.raises(mc.PoolExhaustedError):
                    mgr.alloc(1, request_id="r", clear=False)
                return
            (slot,) = mgr.alloc(1, request_id="r", clear=False)
            m.pool_free -= 1
            keep = b % 3 == 0
            mgr.restore(h, slot, request_id="r", keep=keep)
            self.slots[slot], self.prompt[slot] = self.swapped[h] if keep else self.swapped.pop(h)
            m.host_free += not keep
        elif kind == "abort" and self.swapped:
            h = sorted(self.swapped)[a % len(self.swapped)]
            mgr.drop(h)
            del self.swapped[h]
            m.host_free += 1
        elif kind == "cow" and len(running) > 1:
            src, dst = running[a % len(running)], running[b % len(running)]
            mgr.copy_on_write(src, dst)
            self.slots[dst], self.prompt[dst] = self.slots[src], self.prompt[src]
        elif kind == "clear" and running:
            slot = running[a % len(running)]
            mgr.clear(slot)
            self.slots[slot] = 0.0
        elif kind == "release" and running:
            slot = running[a % len(running)]
            mgr.release(slot)
            del self.slots[slot], self.prompt[slot]
            m.pool_free += 1
        elif kind == "clear-cache":
            cache.clear()
            m.clear()
