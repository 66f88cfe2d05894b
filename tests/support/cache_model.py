"""PrefixCache's contract in plain Python, and the readers its property tests compare it with.

Shared by tests/tiers/test_tiers_property.py (the tiers together, on the block grid)
and tests/tiers/test_prefix_offgrid_keys.py (any length, under extra keys): one model,
so a change of the contract is written once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch

import mambacache as mc
from mambacache.testing import fail_at_op

Key = tuple[Hashable, tuple[int, ...]]  # (extra key, tokens)


def value_of(tensors: list[torch.Tensor], slot: int) -> float:
    """The one tag value written across ``slot`` of every tensor (a mix fails)."""
    values = {float(v) for t in tensors for v in t[:, slot].flatten().tolist()}
    assert len(values) == 1, f"slot {slot} holds a mix of states: {sorted(values)[:4]}"
    return values.pop()


def key_of(node: Any) -> Key:
    """A trie node's (extra key, tokens), read up its parent chain."""
    parts: list[tuple[int, ...]] = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return node.space, tuple(t for part in reversed(parts) for t in part)


def flush(mgr: mc.CacheManager, at: int) -> int:
    """Flush with a fault before aten op ``at`` (0: none); a failed flush is repaired by the next one.

    Returns the ops the flush ran (all of them when it did not fail)."""
    fault = fail_at_op(at, MemoryError if at % 2 else RuntimeError)
    try:
        with fault:
            mgr.flush_nowait()
    except mc.ExecutorError:
        assert at and mgr.pool.unfinished >= 1
        assert mgr.flush_nowait().resumed_stages >= 1
    return fault.ops


class PoolModel:
    """The pool slots free now, shared by the caches on one manager, and those caches (for their reservations)."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.caches: list[CacheModel] = []

    def kept(self, but: CacheModel | None = None) -> int:
        """Free slots kept for the caches' reservations (``but``'s aside): each keeps ``reserved - len(device)``."""
        return sum(max(0, c.reserved - len(c.device)) for c in self.caches if c is not but)

    def available(self, cache: CacheModel | None = None) -> int:
        """Slots a request (``cache`` None) or ``cache``'s checkpoints may take now."""
        return max(0, self.free - self.kept(but=cache))


class CacheModel:
    """The contract as a dict per tier, keyed by (extra key, tokens), least recently used first.

    ``pool_free`` and ``host_free`` are the slots the manager can hand out now
    (a host slot freed in the step counts at once: HostPool.num_free).
    ``reserved`` slots are kept for this cache's checkpoints: another tenant
    (a request, another cache's checkpoints) may take a slot only while more
    than ``reserved - len(device)`` are free. Caches on one manager share a
    :class:`PoolModel` (``pool``), each with its own reservation.
    """

    def __init__(
        self, max_ckpt: int, host_ckpt: int, pool_free: int, host_free: int, reserved: int = 0,
        pool: PoolModel | None = None,
    ) -> None:  # fmt: skip
        self.max_ckpt, self.host_ckpt, self.reserved = max_ckpt, host_ckpt, reserved
        self.device: OrderedDict[Key, float] = OrderedDict()
        self.host: OrderedDict[Key, float] = OrderedDict()
        self.pool = PoolModel(pool_free) if pool is None else pool
        self.pool.caches.append(self)
        self.host_free = host_free
        self.counts = dict.fromkeys(
            ("hits", "misses", "tokens_saved", "inserts", "evictions", "offloads", "restores", "host_drops", "skipped"),
            0,
        )

    def match(self, tokens: list[int], space: Hashable = None) -> tuple[Key, str] | None:
        found = [
            k for k in (*self.device, *self.host)
            if k[0] == space and len(k[1]) <= len(tokens) and tuple(tokens[: len(k[1])]) == k[1]
        ]  # fmt: skip
        if not found:
            self.counts["misses"] += 1
            return None
        key = max(found, key=lambda k: len(k[1]))
        self.counts["hits"] += 1
        self._touch(key)
        return key, "device" if key in self.device else "host"

    @property
    def pool_free(self) -> int:
        return self.pool.free

    @pool_free.setter
    def pool_free(self, value: int) -> None:
        self.pool.free = value

    def available(self) -> int:
        """Slots a request may take now."""
        return self.pool.available()

    def fork(self, key: Key) -> float:
        self.alloc(protect=key, request=True)  # PoolExhaustedError propagates: the real fork raises too
        value = self.device[key] if key in self.device else self.host[key]
        self.counts["restores"] += key not in self.device
        self.counts["tokens_saved"] += len(key[1])
        self._touch(key)
        return value

    def insert(self, key: Key, value: float) -> bool:
        if key in self.device or key in self.host:
            self._touch(key)
            return False
        if self.max_ckpt == 0:
            return False
        while len(self.device) >= self.max_ckpt and self.evict(None):
            pass
        try:
            self.alloc(None)
        except mc.PoolExhaustedError:
            self.counts["skipped"] += 1
            return False
        self.device[key] = value
        self.counts["inserts"] += 1
        return True

    def alloc(self, protect: Key | None, request: bool = False) -> None:
        if request:  # evicting a checkpoint within the reservation frees nothing a request may take: none is
            while not self.available():
                if len(self.device) <= self.reserved or not self.evict(protect):
                    raise mc.PoolExhaustedError("model: no slot a request may take")
        while not self.pool.available(self):  # another cache's reservation is not this one's to use
            if not self.evict(protect):
                raise mc.PoolExhaustedError("model: no slot and nothing to evict")
        self.pool_free -= 1

    def evict(self, protect: Key | None) -> bool:
        def leaf(k: Key) -> bool:  # no device checkpoint of a longer prefix extending it, under the same key
            return not any(o[0] == k[0] and len(o[1]) > len(k[1]) and o[1][: len(k[1])] == k[1] for o in self.device)

        victim = next((k for k in self.device if leaf(k) and k != protect), None)
        if victim is None:
            return False
        value = self.device.pop(victim)
        self.pool_free += 1
        self.counts["evictions"] += 1
        if self.host_ckpt:
            while len(self.host) >= self.host_ckpt or not self.host_free:
                dropped = next((k for k in self.host if k != protect), None)
                if dropped is None:
                    break
                del self.host[dropped]
                self.host_free += 1
                self.counts["host_drops"] += 1
            if len(self.host) < self.host_ckpt and self.host_free:
                self.host[victim] = value
                self.host_free -= 1
                self.counts["offloads"] += 1
        return True

    def clear(self) -> None:
        self.pool_free += len(self.device)
        self.host_free += len(self.host)
        self.device.clear()
        self.host.clear()

    def _touch(self, key: Key) -> None:
        (self.device if key in self.device else self.host).move_to_end(key)
