"""PrefixCache: prefix states checkpointed at any token length, per extra key, with LRU eviction and a host tier.

Every operation is a manager event in the one queue (a fork is a copy-on-write
or a restore, a checkpoint is a copy-on-write into a slot of the cache's own, an
eviction is an offload and a release, or a release), so the sequential semantics
that make slots exact make the cache exact too: a checkpoint holds its source
slot's state as of the ``insert`` call, a checkpoint evicted after a fork in the
same step still feeds that fork, and a restore reads what the offload wrote.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._core import _tracer
from .._core._errors import InvalidArgumentError, PoolExhaustedError, SlotStateError, StaleHitError
from .._core._validate import as_slot, check_request_id
from .._manager import CacheManager
from ._trie import Trie, _Node

__all__ = ["CHECKPOINT_TENANT", "PrefixCache", "PrefixHit", "PrefixStats"]

CHECKPOINT_TENANT = "prefix-cache"
"""The ``request_id`` of the checkpoint slots of a manager's first cache (what ``CacheManager.held`` shows for
them); its second cache's are ``"prefix-cache-2"``, and so on (``PrefixCache.tenant``)."""

# Caches made on each manager, for each cache's own tenant: a cache's reservation counts its own checkpoints only.
_made: weakref.WeakKeyDictionary[CacheManager, int] = weakref.WeakKeyDictionary()


def _reserve(manager: CacheManager, reserved: Any, max_checkpoints: int) -> tuple[int, str]:
    """Check ``reserved``, name the new cache's tenant and keep ``reserved`` of the manager's slots for it."""
    top = min(max_checkpoints, manager.pool.num_slots - 1)
    if type(reserved) is not int or not 0 <= reserved <= top:
        raise InvalidArgumentError(
            f"reserved must be an int in 0..min(max_checkpoints, num_slots - 1) = 0..{top}, got {reserved!r}"
        )
    made = _made.get(manager, 0) + 1
    tenant = CHECKPOINT_TENANT if made == 1 else f"{CHECKPOINT_TENANT}-{made}"
    if reserved:
        manager.reserve(reserved, tenant)  # the other caches' reservations stand beside it
    _made[manager] = made  # only once nothing can refuse the cache
    return reserved, tenant


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The deepest cached prefix of a ``match``: ``length`` tokens, on the ``"device"`` or ``"host"`` tier.

    ``payload`` is what ``insert`` was given with the checkpoint (an engine's
    attention KV handle, say). Pass the hit to :meth:`PrefixCache.fork`.
    """

    length: int
    tier: str
    payload: Any = field(default=None, compare=False)
    _node: _Node | None = field(default=None, repr=False, compare=False)
    _gen: int = field(default=0, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class PrefixStats:
    """Counters since the cache was made, and the checkpoints held now."""

    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0  # prefix tokens that forks did not have to recompute
    inserts: int = 0
    evictions: int = 0  # device checkpoints evicted (to the host tier, or dropped)
    offloads: int = 0  # evictions that moved the checkpoint to the host tier
    restores: int = 0  # forks served from the host tier
    host_drops: int = 0  # host checkpoints dropped to make room
    skipped: int = 0  # inserts refused because no pool slot could be freed
    device_checkpoints: int = 0
    host_checkpoints: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits over lookups (0.0 before any)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class PrefixCache:
    """Prefix states of token prefixes of any length, per extra key, in checkpoint slots of the manager's pool.

    Invariants:

    * a checkpoint of ``tokens`` (any positive length: on the ``block_size``
      grid or off it) under ``key`` holds the state of the slot given to
      ``insert`` as of that call, in the event order; it is never written
      again, so any later fork reads exactly that;
    * ``match(tokens, key=k)`` sees only checkpoints inserted under a key equal
      to ``k`` (dict-key equality): equal token ids under different extra
      inputs never share a state;
    * at most ``max_checkpoints`` checkpoints hold pool slots (a budget apart
      from running requests), and at most ``host_checkpoints`` hold host slots;
      requests never take the ``reserved`` slots, so an insert below that many finds one;
    * the checkpoint slots are held by the cache's own ``tenant`` (``"prefix-cache"``
      for a manager's first cache, ``"prefix-cache-2"`` for its second...), and its
      reservation counts that tenant's slots only: another cache's checkpoints on
      the same manager never use it up;
    * eviction takes the least recently used *leaf*: a device checkpoint with no
      device checkpoint of a longer prefix extending it (under its key), so a
      chain of checkpoints along one prompt shrinks from its end; with
      ``host_checkpoints > 0`` the evicted state moves to the host tier, and a
      later hit restores it;
    * a hit stays usable until its checkpoint leaves both tiers; ``fork`` on a
      hit whose checkpoint is gone raises :class:`StaleHitError`;
    * every public call checks all its arguments, and that the manager takes
      events, before it evicts, allocates or links anything: a refused call
      (a typed error of :mod:`mambacache`) leaves the cache, the pool and the
      host pool as they were.

    ``block_size`` is the engine's block grid, kept for the callers that
    checkpoint on it (the simulator's grid policy); the cache itself takes
    checkpoints at any length. Not thread-safe: use it from the task or thread
    that schedules steps.
    """

    def __init__(
        self, manager: CacheManager, block_size: int = 64, max_checkpoints: int = 128, host_checkpoints: int = 0,
        reserved: int = 0,
    ) -> None:  # fmt: skip
        if not isinstance(manager, CacheManager):
            raise InvalidArgumentError(f"manager must be a CacheManager, got {type(manager).__name__}")
        for name, value, low in (
            ("block_size", block_size, 1),
            ("max_checkpoints", max_checkpoints, 0),
            ("host_checkpoints", host_checkpoints, 0),
        ):
            if type(value) is not int or value < low:
                raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
        if host_checkpoints and manager.host_pool is None:
            raise InvalidArgumentError(
                "host_checkpoints > 0 needs a manager with a host pool: CacheManager(pool, host_pool=HostPool(...))"
            )
        # Last: a refusal leaves no cache behind.
        self.reserved, self.tenant = _reserve(manager, reserved, max_checkpoints)
        self._mgr = manager
        self.block_size = block_size
        self.max_checkpoints = max_checkpoints
        self.host_checkpoints = host_checkpoints
        self._trie = Trie()
        self._device: OrderedDict[_Node, None] = OrderedDict()  # least recently used first
        self._host: OrderedDict[_Node, None] = OrderedDict()
        self._counts = dict.fromkeys(
            ("hits", "misses", "tokens_saved", "inserts", "evictions", "offloads", "restores", "host_drops", "skipped"),
            0,
        )

    # -- lookups ---------------------------------------------------------
    @property
    def stats(self) -> PrefixStats:
        """A snapshot of the counters."""
        return PrefixStats(**self._counts, device_checkpoints=len(self._device), host_checkpoints=len(self._host))

    def __len__(self) -> int:
        """Checkpoints held, on both tiers."""
        return len(self._device) + len(self._host)

    def match(self, tokens: Sequence[int], *, key: Hashable = None) -> PrefixHit | None:
        """The deepest checkpoint under ``key`` whose tokens are a prefix of ``tokens``, on either tier, or None.

        A hit may cover all of ``tokens``; an engine that needs a token left to run
        (for the next logits) matches ``tokens[:-1]``.
        """
        tokens = self._tokens(tokens)
        _check_key(key)
        best = self._trie.deepest(tuple(tokens), key)
        if best is None:
            self._counts["misses"] += 1
            _tracer.tracer.note("prefix.miss", tokens=len(tokens), step=self._mgr.step, **_traced(key))
            return None
        self._counts["hits"] += 1
        self._touch(best)
        tier = "device" if best.slot else "host"
        _tracer.tracer.note(
            "prefix.hit", length=best.length, tier=tier, slot=best.slot or None, host=best.host or None,
            tokens=len(tokens), step=self._mgr.step, **_traced(key),
        )  # fmt: skip
        return PrefixHit(best.length, tier, best.payload, best, best.gen)

    def fork(self, hit: PrefixHit, request_id: str | None = None) -> int:
        """A new slot for ``request_id`` holding the hit's prefix state (from the host tier if it is there).

        The slot is allocated without a clear: the copy or the restore writes all
        of it. With no slot available, the least recently used checkpoint (not this
        one) is evicted while the pool holds more checkpoints than it reserves for
        them (evicting one of those frees no slot a request may take).
        """
        if not isinstance(hit, PrefixHit) or hit._node is None:
            raise InvalidArgumentError(f"fork takes a PrefixHit from match(), got {hit!r}")
        check_request_id(request_id)
        node = hit._node
        # A node can outlive its checkpoint (it still branches) and get a new one: the hit's was another state.
        if not node.live or not (node.slot or node.host) or node.gen != hit._gen:
            raise StaleHitError(
                f"the checkpoint of this {hit.length}-token hit was evicted and dropped since match(): match again"
            )
        if not self._trie.owns(node):  # another cache's slots: possibly another manager's pool
            raise InvalidArgumentError("fork takes a PrefixHit from this cache's match(), not another cache's")
        self._mgr.check_open()
        slot = self._alloc(request_id, protect=node)
        if node.slot:
            self._mgr.copy_on_write(node.slot, slot, request_id=request_id)
        else:
            self._mgr.restore(node.host, slot, request_id=request_id, keep=True)
            self._counts["restores"] += 1
        self._counts["tokens_saved"] += node.length
        self._touch(node)
        _tracer.tracer.note(
            "prefix.fork", slot=slot, length=node.length, src=node.slot or None, host=node.host or None,
            request_id=request_id, step=self._mgr.step,
        )  # fmt: skip
        return slot

    # -- inserting and evicting ------------------------------------------
    def insert(self, tokens: Sequence[int], slot: int, *, payload: Any = None, key: Hashable = None) -> bool:
        """Checkpoint ``slot``'s state as of this point of the event order as the state after ``tokens`` under ``key``.

        ``tokens`` may have any positive length: a block boundary, the end of a
        shared system prompt, a decode step. Returns True when a checkpoint was
        made; False when the prefix is already cached under ``key`` (its recency
        is refreshed), when ``max_checkpoints`` is 0, or when no pool slot could
        be freed for it (counted in ``stats.skipped``).
        """
        # Every argument is checked before anything is evicted, allocated or linked.
        tokens = self._tokens(tokens)
        if not tokens:
            raise InvalidArgumentError("insert takes at least one token")
        _check_key(key)
        slot = as_slot(slot, self._mgr.pool.num_slots)
        if not self._mgr.pool.is_allocated(slot):
            raise SlotStateError(f"insert: slot {slot!r} is not allocated")
        awaited = self._mgr.awaiting_import(slot)
        if awaited is not None:  # the fork out of it would be refused only after the eviction and the alloc
            raise SlotStateError(f"insert: slot {slot} awaits the state of {awaited!r} from a peer: nothing to copy")
        self._mgr.check_open()
        path = tuple(tokens)
        node = self._trie.find(path, key)
        if node is not None and (node.slot or node.host):
            self._touch(node)
            return False
        if self.max_checkpoints == 0:
            return False
        # Evict and allocate before linking the new path: an eviction prunes and merges nodes.
        while len(self._device) >= self.max_checkpoints and self._evict_one(protect=None):
            pass
        try:
            checkpoint = self._alloc(self.tenant, protect=None)
        except PoolExhaustedError:
            self._counts["skipped"] += 1
            return False
        node = self._trie.link(path, key)
        self._mgr.copy_on_write(slot, checkpoint, request_id=self.tenant)
        node.slot, node.payload = checkpoint, payload
        node.gen += 1
        self._device[node] = None
        self._trie.adjust_below(node, +1)
        self._counts["inserts"] += 1
        _tracer.tracer.note(
            "prefix.insert", slot=checkpoint, src=slot, length=len(path), step=self._mgr.step, **_traced(key)
        )
        return True

    def evict(self) -> bool:
        """Evict the least recently used leaf checkpoint now (to the host tier if it has room); False if none."""
        self._mgr.check_open()
        return self._evict_one(protect=None)

    def clear(self) -> None:
        """Release every checkpoint slot and drop every host checkpoint (before an idle leak check, say)."""
        self._mgr.check_open()
        for node in list(self._device):
            self._mgr.release(node.slot, request_id=self.tenant)
            node.slot = 0
        for node in list(self._host):
            self._mgr.drop(node.host)
            node.host = 0
        for node in [*self._device, *self._host]:
            node.live = False
        self._device.clear()
        self._host.clear()
        self._trie = Trie()

    def close(self) -> None:
        """:meth:`clear`, then end this cache's reservation (``reserved=k``): every slot is for requests again.

        The cache stays usable, without a reservation.
        """
        self.clear()
        if self.reserved:
            self._mgr.reserve(0, self.tenant)
            self.reserved = 0

    def _alloc(self, request_id: str | None, protect: _Node | None) -> int:
        while True:
            try:
                return self._mgr.alloc(1, request_id, clear=False)[0]
            except PoolExhaustedError:
                # This cache's tenant holds exactly its device checkpoints: at or below its reservation, an evicted
                # slot would stay kept for them, no help to a request (another cache's reservation is not ours).
                kept = len(self._device) <= self.reserved
                if (request_id != self.tenant and kept) or not self._evict_one(protect):
                    raise

    def _evict_one(self, protect: _Node | None) -> bool:
        victim = next((n for n in self._device if n.below == 0 and n is not protect), None)
        if victim is None:
            return False
        mgr = self._mgr
        host = 0
        if self.host_checkpoints:
            hp = mgr.host_pool
            assert hp is not None
            # The host tier is LRU: drop its least recently used checkpoints, one per host slot missing. A dropped
            # slot counts in num_free at once (an offload takes it in this same step when no other is free, the
            # planner reading its old content first), so a full tier drops exactly one, not all of them.
            while (len(self._host) >= self.host_checkpoints or hp.num_free == 0) and self._drop_host_one(protect):
                pass
            if len(self._host) < self.host_checkpoints and hp.num_free:
                try:
                    host = mgr.offload(victim.slot, request_id=self.tenant)
                except PoolExhaustedError:
                    # A transfer's landing in another thread took that host slot since the read: the checkpoint
                    # is dropped, as with a full tier (nothing was queued; the cache is as before).
                    host = 0
        slot = victim.slot
        mgr.release(slot, request_id=self.tenant)
        del self._device[victim]
        self._trie.adjust_below(victim, -1)
        victim.slot = 0
        self._counts["evictions"] += 1
        if host:
            victim.host = host
            self._host[victim] = None
            self._counts["offloads"] += 1
        else:
            self._trie.prune(victim)
        _tracer.tracer.note(
            "prefix.evict", slot=slot, length=victim.length, to="host" if host else "dropped",
            host=host or None, step=mgr.step,
        )  # fmt: skip
        return True

    def _drop_host_one(self, protect: _Node | None) -> bool:
        node = next((n for n in self._host if n is not protect), None)
        if node is None:
            return False
        self._mgr.drop(node.host)  # first: if the manager refuses it, the cache still tracks the checkpoint
        del self._host[node]
        _tracer.tracer.note("prefix.evict", host=node.host, length=node.length, to="dropped", step=self._mgr.step)
        node.host = 0
        self._counts["host_drops"] += 1
        self._trie.prune(node)
        return True

    # -- helpers -----------------------------------------------------------
    def _touch(self, node: _Node) -> None:
        if node.slot:
            self._device.move_to_end(node)
        elif node.host:
            self._host.move_to_end(node)

    @staticmethod
    def _tokens(tokens: Any) -> list[int]:
        if isinstance(tokens, str | bytes) or (not isinstance(tokens, Sequence) and not hasattr(tokens, "tolist")):
            raise InvalidArgumentError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
        values = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        if not all(type(t) is int for t in values):
            raise InvalidArgumentError("tokens must be ints")
        return values  # type: ignore[no-any-return]


def _check_key(key: Hashable) -> None:
    """Refuse an unhashable extra key before anything changes (a dict lookup would raise a bare TypeError)."""
    try:
        hash(key)
    except TypeError:
        raise InvalidArgumentError(
            f"key must be hashable (a str, an int, a tuple...), got {type(key).__name__}"
        ) from None


def _traced(key: Hashable) -> dict[str, Any]:
    """The key as a trace field when JSON writes it as itself (a str or an int); None (the default) and others: none."""
    return {"key": key} if type(key) in (str, int) else {}
