"""mambacache inside SGLang: a general plugin that runs SGLang's mamba slot work through a CacheManager.

Registered as the SGLang plugin ``mambacache`` (entry point group
``sglang.srt.plugins``); active only when ``SGLANG_PLUGINS`` names it. SGLang
loads *every* installed plugin when that variable is unset, so installing
mambacache next to SGLang changes nothing unless it is asked for by name.

When active it registers hooks with SGLang's ``HookRegistry`` (applied in every
scheduler process before the pools and the model runner are built):

* ``HybridReqToTokenPool._init_mamba_pool`` (after): adopt the ``MambaPool``'s
  ``conv`` and ``temporal`` tensors into a :class:`~mambacache.StatePool`,
  same storage, and open a :class:`~mambacache.CacheManager` on it. SGLang's
  layout is mambacache's (``[mamba_layers, size + 1, *state]``, slot 0 the
  padding slot), so SGLang's kernels and indices are unchanged;
* ``MambaSlotAllocator._do_alloc`` / ``free`` / ``clear`` (after): SGLang's
  allocator stays the source of slot ids; each allocation becomes an
  ``alloc_slots`` (without a clear: SGLang decides which slots to clear), each
  free a ``release``, and a reset releases every held slot, so
  :meth:`~mambacache.CacheManager.held` and ``check_idle`` agree with SGLang's
  allocator at every step. SGLang keeps its free list on the device: the
  hooks record the device tensors and read no slot id, and the step's flush
  reads all of them in one transfer (:func:`settle` does it on demand);
* ``HybridReqToTokenPool.alloc``, ``MambaComponent.finalize_match_result_in_cache``
  (after): the request's new slot gets its ``rid`` as tenant (SGLang's allocator
  hands slots out without one); ``MambaComponent.commit_insert_component_data``
  (around): a slot the radix tree takes (a finished request's, or a chunked
  checkpoint's copy) is handed over to :data:`TREE_TENANT`, since SGLang moves
  it without an event; so ``held()`` names each slot's request or the tree;
* ``MambaPool.clear_slots`` / ``copy_from`` (around): the direct calls outside
  the deferred step (a chunked-prefill checkpoint's copy of a running slot into
  a new tree slot, say) become events flushed at once; a call that touches a
  slot SGLang's allocator did not hand out (the prefill graph runner's dummy
  slots) stays SGLang's own;
* ``MambaPool.get_cpu_copy`` / ``load_cpu_copy`` (around): a retraction
  backup becomes offloads into a :class:`~mambacache.HostPool` (one host slot
  per pool slot by default, ``MAMBACACHE_SGLANG_HOST_SLOTS`` to change it; 0
  leaves backups to SGLang) and its load restores, ordered with the step's
  other events, with no device synchronisation; :class:`HostCopy` is what
  SGLang keeps in the request's backup meanwhile (one SGLang lets go of
  unloaded, an aborted request's, frees its host slots at the next step);
* ``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear`` (around): the
  step's deferred clears and copy-on-writes become ``clear`` and
  ``copy_on_write`` events in SGLang's order (clears first), flushed once per
  forward step on the forward stream: on NPU through the scalar-zeroing
  executor instead of SGLang's own code.

Left to SGLang's own code, never half taken over: pools with side states
(PLE ``ShortConvPool``/``NGramPool``, ReplaySSM rings, which ride along on
SGLang's clear and copy), int8 checkpoints (``mamba_checkpoint_pool.py``), the
envelope layout, and ``MambaPoolHost``/HiCache. Slot ids are read to the host
once per forward step, and once per direct call (a checkpoint's copy, a
backup, its load), never per allocation or free.

``MAMBACACHE_TRACE=PATH`` writes the slot-lifecycle trace (debug level).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import deque
from typing import Any

import torch

from .._core._errors import MambaCacheError
from .._core._pool import StatePool
from .._manager import CacheManager
from .._tiers._hostpool import HostPool

__all__ = ["PLUGIN_NAME", "TREE_TENANT", "HostCopy", "active", "adopt", "counts", "managers", "register", "settle"]

PLUGIN_NAME = "mambacache"
TREE_TENANT = "sglang-tree"  # the tenant of a slot SGLang's radix tree holds (a prefix checkpoint)
_ATTR = "_mambacache_journal"  # set on SGLang's pool and allocator objects the plugin drives
_journals: list[_Journal] = []
# What the hooks did in this process: forward steps flushed, direct calls flushed, calls left to SGLang.
_counts = {"steps": 0, "direct": 0, "fallbacks": 0, "offloads": 0, "restores": 0}
_registered = False


def active() -> bool:
    """Whether ``SGLANG_PLUGINS`` (comma-separated) names this plugin; unset means no."""
    names = os.environ.get("SGLANG_PLUGINS")
    return names is not None and PLUGIN_NAME in {n.strip() for n in names.split(",")}


def managers() -> list[CacheManager]:
    """The managers the plugin opened in this process, one per adopted mamba pool (for tests and operators)."""
    return [j.manager for j in _journals]


def counts() -> dict[str, int]:
    """What the plugin's hooks did in this process: ``steps`` (forward steps whose deferred clears and copies
    ran as one flush), ``direct`` (direct ``clear_slots`` / ``copy_from`` calls run as a flush of their own)
    and ``fallbacks`` (calls left to SGLang's own code: a slot the allocator did not hand out)."""
    return dict(_counts)


def settle(sglang_pool: Any = None) -> None:
    """Bring a manager's ledger up to SGLang's allocator now: one device read (at most).

    The hooks record SGLang's allocations, frees and tree hand-overs without
    reading the slot ids (device values), and the next forward step's flush
    applies them; until then :meth:`~mambacache.CacheManager.held` is the
    allocator's held set as of the last step. For operators and tests that
    look in between. ``sglang_pool``: the adopted ``HybridReqToTokenPool`` (or
    its allocator, or its ``MambaPool``); None: every manager the plugin opened.
    """
    journals = _journals if sglang_pool is None else [getattr(sglang_pool, _ATTR)]
    for journal in journals:
        journal.resolve()


def adopt(req_to_token_pool: Any) -> CacheManager | None:
    """Drive ``req_to_token_pool``'s mamba pool through a new manager; None when the plugin must not.

    Refused (SGLang keeps the pool) when the pool carries state mambacache does
    not manage: side states, ReplaySSM rings, int8 checkpoints, the envelope
    layout; and, with a warning, when its tensors cannot be adopted or the host
    tier cannot be made. Already adopted: the same manager.
    """
    existing: _Journal | None = getattr(req_to_token_pool, _ATTR, None)
    if existing is not None:
        return existing.manager
    mamba_pool = req_to_token_pool.mamba_pool
    if not _takes_over(req_to_token_pool, mamba_pool):
        return None
    cache = mamba_pool.mamba_cache
    allocator = req_to_token_pool.mamba_allocator
    mgr: CacheManager | None = None
    try:
        pool = StatePool.from_tensors(list(cache.conv), cache.temporal)
        # Retraction backups (get_cpu_copy) go to a host tier of one slot per pool slot, unless told otherwise.
        host_slots = int(os.environ.get("MAMBACACHE_SGLANG_HOST_SLOTS", pool.num_slots))
        host = HostPool(pool.spec, host_slots) if host_slots > 0 else None
        mgr = CacheManager(pool, host_pool=host).__enter__()
        # The allocator may already hand out slots (a pool made before the plugin loaded): one read, once.
        held = sorted(set(range(1, pool.num_slots + 1)) - set(allocator.free_slots.tolist()))
        if held:
            mgr.alloc_slots(held, clear=False)
    except (MambaCacheError, ValueError) as exc:
        # Tensors mambacache cannot adopt, a bad MAMBACACHE_SGLANG_HOST_SLOTS, no memory for the host tier:
        # SGLang keeps the pool, and says why once.
        if mgr is not None:
            mgr.__exit__(None, None, None)
        logging.getLogger(__name__).warning("mambacache: SGLang keeps its mamba pool: %s", exc)
        return None
    journal = _Journal(mgr)
    for obj in (req_to_token_pool, allocator, mamba_pool):
        setattr(obj, _ATTR, journal)
    _journals.append(journal)
    return mgr


def _takes_over(req_to_token_pool: Any, mamba_pool: Any) -> bool:
    cache = mamba_pool.mamba_cache
    return (
        not getattr(mamba_pool, "_slot_siblings", None)
        and getattr(mamba_pool, "replayssm_write_pos", None) is None
        and getattr(req_to_token_pool, "mamba_ckpt_pool", None) is None
        and getattr(mamba_pool, "_raw", None) is None
        and cache.temporal.numel() > 0
        and all(c.is_contiguous() for c in cache.conv)
        and cache.temporal.is_contiguous()
    )


_ALLOC, _FREE, _TENANT, _TREE = range(4)  # what a journal entry does when it is replayed
_COMPACT = 32  # device segments kept before they are joined into one (a device op, no read)


def _tenant(mgr: CacheManager, slot: int, rid: Any) -> None:
    """A slot SGLang's allocator handed out without a request gets its request as tenant."""
    if 0 < slot <= mgr.pool.num_slots and mgr.pool.is_allocated(slot) and mgr.pool.ledger.tenants[slot] is None:
        mgr.hand_over(slot, str(rid))


class _Journal:
    """The slot changes SGLang's allocator and tree made since the last step, kept as SGLang's device tensors.

    SGLang keeps its free list on the device, so a slot id is a device value;
    reading one to the host at each allocation or free would make each of them
    wait for the device (a synchronisation SGLang alone does not pay). Instead
    each allocation, free, tenant and tree hand-over is recorded here with the
    device tensor that holds its ids, and :meth:`resolve` reads every recorded
    tensor, with the caller's own index tensors, in one transfer: once per
    forward step (and once per direct call, which needs its own ids anyway);
    then it replays the entries in order.

    Invariants: replaying the entries in order brings the manager's ledger to
    SGLang's allocator's state at the last entry; each recorded tensor holds
    the ids it held when recorded: an allocation is a slice of the allocator's
    ``free_slots`` and a free the tail of the new ``free_slots`` (SGLang rebinds
    that tensor, never writes it in place; the index a free is given may be a
    view of a mapping row that a new request overwrites before the step); a
    request's ping-pong track buffer, which SGLang writes in place, is copied
    on the device.
    """

    __slots__ = ("manager", "meta", "orphans", "segments")

    def __init__(self, manager: CacheManager) -> None:
        self.manager = manager
        self.segments: list[torch.Tensor] = []  # device int64 ids: the entries', in order
        self.meta: list[tuple[int, int, str | None]] = []  # (kind, how many ids, tenant) of each entry
        # Host slots of HostCopy objects SGLang let go of without a load or drop; a deque: a finalizer appends.
        self.orphans: deque[int] = deque()

    def record(self, kind: int, ids: torch.Tensor, tenant: str | None = None) -> None:
        """One entry, no device read; a long run of entries is joined on the device (no read either)."""
        flat = ids.reshape(-1)
        if flat.numel() == 0:
            return
        self.segments.append(flat if flat.dtype == torch.int64 else flat.to(torch.int64))
        self.meta.append((kind, flat.numel(), tenant))
        if len(self.segments) > _COMPACT:
            self.segments = [torch.cat(self.segments)]

    def resolve(self, *extra: Any) -> list[list[int]]:
        """Replay the journal and return each of ``extra``'s ids (index tensors or int sequences), with one
        device-to-host read at most: the journal's tensors and ``extra``'s in one transfer."""
        tensors = [x.reshape(-1) for x in extra if isinstance(x, torch.Tensor)]
        parts = [*self.segments, *(t if t.dtype == torch.int64 else t.to(torch.int64) for t in tensors)]
        flat: list[int] = torch.cat(parts).tolist() if parts else []  # the one read
        meta, self.segments, self.meta = self.meta, [], []
        mgr, at = self.manager, 0
        run: list[int] = []  # consecutive allocations (or frees): one call
        run_kind = _ALLOC
        for kind, n, tenant in meta:
            ids, at = flat[at : at + n], at + n
            if run and kind != run_kind:
                _apply(mgr, run_kind, run)
                run = []
            if kind in (_ALLOC, _FREE):
                run_kind = kind
                run.extend(ids)
            elif kind == _TENANT:
                for s in ids:
                    _tenant(mgr, s, tenant)  # -1 (a ping-pong track slot allocated later, on demand) is skipped
            else:
                for s in ids:
                    mgr.hand_over(s, TREE_TENANT)
        if run:
            _apply(mgr, run_kind, run)
        self.drop_orphans()
        out = []
        for x in extra:
            n = x.numel() if isinstance(x, torch.Tensor) else 0
            out.append(flat[at : at + n] if isinstance(x, torch.Tensor) else [int(s) for s in x])
            at += n
        return out

    def reset(self) -> None:
        """SGLang's allocator was reset: every slot is free, whatever the journal says; no read."""
        self.segments, self.meta = [], []
        held = list(self.manager.held())
        if held:
            self.manager.release_many(held)
        self.drop_orphans()

    def drop_orphans(self) -> None:
        while self.orphans:
            self.manager.drop(self.orphans.popleft())


def _apply(mgr: CacheManager, kind: int, slots: list[int]) -> None:
    if kind == _ALLOC:
        mgr.alloc_slots(slots, clear=False)  # SGLang decides which slots to clear
    else:
        mgr.release_many(slots)


# -- the hooks (plain functions: HookRegistry wraps them around SGLang's methods) -------------
def _after_init_mamba_pool(result: Any, pool: Any, *args: Any, **kwargs: Any) -> None:
    adopt(pool)


def _after_alloc(result: Any, allocator: Any, *args: Any, **kwargs: Any) -> None:
    journal: _Journal | None = getattr(allocator, _ATTR, None)
    if journal is not None and result is not None:
        journal.record(_ALLOC, result)


def _after_free(result: Any, allocator: Any, free_index: Any, *args: Any, **kwargs: Any) -> None:
    journal: _Journal | None = getattr(allocator, _ATTR, None)
    n = free_index.numel()
    if journal is not None and n:
        journal.record(_FREE, allocator.free_slots[-n:])  # what free() appended: never written in place


def _after_pool_alloc(result: Any, pool: Any, reqs: Any, *args: Any, **kwargs: Any) -> None:
    journal: _Journal | None = getattr(pool, _ATTR, None)
    if journal is not None and result is not None:
        for req in reqs:
            if req.kv.mamba_pool_idx is not None:
                journal.record(_TENANT, req.kv.mamba_pool_idx, str(req.rid))
            track = getattr(req.kv, "mamba_ping_pong_track_buffer", None)  # the extra buffer's track slots
            if track is not None:  # SGLang writes this buffer in place (set_mamba_ping_pong_slot): a copy
                journal.record(_TENANT, track.clone(), str(req.rid))


def _after_match(result: Any, component: Any, params: Any, *args: Any, **kwargs: Any) -> None:
    journal: _Journal | None = getattr(component.cache.req_to_token_pool, _ATTR, None)
    req = params.req
    if journal is not None and req is not None and req.kv.mamba_pool_idx is not None:
        journal.record(_TENANT, req.kv.mamba_pool_idx, str(req.rid))  # the copy-on-write's new slot


def _around_commit_insert(original: Any, component: Any, *args: Any, **kwargs: Any) -> Any:
    # SGLang passes (node, is_new_leaf, params, result, cache_actions) by keyword, and one is named `result`:
    # an around hook, so the names cannot clash with an after hook's own first argument.
    out = original(component, *args, **kwargs)
    journal: _Journal | None = getattr(component.cache.req_to_token_pool, _ATTR, None)
    params = kwargs["params"] if "params" in kwargs else args[2]
    insert = kwargs["result"] if "result" in kwargs else args[3]
    if journal is not None and not insert.mamba_exist:  # the tree took the slot: no event in SGLang, a hand-over
        journal.record(_TREE, params.mamba_value)
    return out


def _after_clear(result: Any, allocator: Any, *args: Any, **kwargs: Any) -> None:
    journal: _Journal | None = getattr(allocator, _ATTR, None)
    if journal is not None:
        journal.reset()


def _all_held(mgr: CacheManager, *groups: list[int]) -> bool:
    """Whether every slot is one SGLang's allocator handed out (the manager holds it); never raises."""
    n, held = mgr.pool.num_slots, mgr.pool.is_allocated
    return all(0 < s <= n and held(s) for group in groups for s in group)


def _direct(original: Any, mamba_pool: Any, submit: Any, *args: Any) -> Any:
    """A ``clear_slots`` / ``copy_from`` called outside the deferred step: events flushed at once, or SGLang's own
    code when a slot is not one SGLang's allocator handed out (the prefill graph runner's dummy slots)."""
    journal: _Journal | None = getattr(mamba_pool, _ATTR, None)
    if journal is None:
        return original(mamba_pool, *args)
    slots = journal.resolve(*args)  # the journal and these indices: one read
    if not _all_held(journal.manager, *slots):
        _counts["fallbacks"] += 1
        return original(mamba_pool, *args)
    _counts["direct"] += 1
    submit(journal.manager, *slots)
    journal.manager.flush_nowait()  # the caller expects the work enqueued on return, as SGLang's own does
    return None


def _around_clear_slots(original: Any, mamba_pool: Any, indices: Any) -> Any:
    return _direct(original, mamba_pool, CacheManager.clear_many, indices)


def _around_copy_from(original: Any, mamba_pool: Any, src: Any, dst: Any) -> Any:
    return _direct(original, mamba_pool, CacheManager.copy_many, src, dst)


class HostCopy:
    """What ``MambaPool.get_cpu_copy`` returns under the plugin: host slots of the manager's
    :class:`~mambacache.HostPool` holding the states, in order; ``load_cpu_copy`` restores them.

    SGLang keeps it in the request's retraction backup as it would keep its CPU
    tensors. A backup never loaded (an aborted request: SGLang's
    ``discard_kv_cache_backup`` just lets go of it) frees its host slots when
    SGLang lets go of it: the manager drops them at its next step (or
    :func:`settle`), and ``check_idle`` names them until then; :meth:`drop`
    frees them at once.
    """

    __slots__ = ("__weakref__", "hosts", "manager")

    def __init__(self, manager: CacheManager, hosts: list[int], orphans: deque[int] | None = None) -> None:
        self.manager = manager
        self.hosts = hosts  # emptied in place when loaded or dropped: the finalizer shares this list
        if orphans is not None:  # not from a finalizer's thread into the manager: a deque the next step drains
            weakref.finalize(self, orphans.extend, hosts)

    def drop(self) -> None:
        """Free the host slots without restoring them."""
        for h in self.hosts:
            self.manager.drop(h)
        self.hosts.clear()


def _around_get_cpu_copy(original: Any, mamba_pool: Any, indices: Any) -> Any:
    journal: _Journal | None = getattr(mamba_pool, _ATTR, None)
    mgr = journal.manager if journal is not None else None
    host = mgr.host_pool if mgr is not None else None
    n = indices.numel() if isinstance(indices, torch.Tensor) else len(indices)
    if journal is None or mgr is None or host is None or host.num_free < n:
        _counts["fallbacks"] += 1
        return original(mamba_pool, indices)  # SGLang's own synchronous copy
    (slots,) = journal.resolve(indices)
    if not _all_held(mgr, slots):
        _counts["fallbacks"] += 1
        return original(mamba_pool, indices)
    # Offloads are ordered events: a release or a new tenant of the slot later in the step does not reach them,
    # so unlike SGLang's copy nothing waits for the device here.
    tenants = mgr.pool.ledger.tenants
    hosts = [mgr.offload(s, tenants[s]) for s in slots]  # the host slot names the request it backs up
    mgr.flush_nowait()
    _counts["offloads"] += len(hosts)
    return HostCopy(mgr, hosts, journal.orphans)


def _around_load_cpu_copy(original: Any, mamba_pool: Any, mamba_cache_cpu: Any, indices: Any) -> Any:
    if not isinstance(mamba_cache_cpu, HostCopy):
        return original(mamba_pool, mamba_cache_cpu, indices)
    mgr = mamba_cache_cpu.manager
    journal: _Journal = getattr(mamba_pool, _ATTR)  # the pool that made the HostCopy: adopted
    (slots,) = journal.resolve(indices)
    if len(slots) != len(mamba_cache_cpu.hosts):
        raise ValueError(f"load_cpu_copy: {len(mamba_cache_cpu.hosts)} saved states for {len(slots)} slots")
    for h, s in zip(mamba_cache_cpu.hosts, slots, strict=True):
        mgr.restore(h, s)
    mgr.flush_nowait()  # the forward reads the slot next
    _counts["restores"] += len(slots)
    mamba_cache_cpu.hosts.clear()
    return None


def _deferred_cow_and_clear(original: Any, runner: Any, forward_batch: Any) -> None:
    pool = runner.req_to_token_pool
    journal: _Journal | None = getattr(pool, _ATTR, None)
    mode = forward_batch.forward_mode
    if (
        journal is None
        or runner.is_draft_worker
        or not mode.is_extend()
        or mode.is_target_verify()
        or mode.is_draft_extend_v2()
    ):
        return original(runner, forward_batch)  # type: ignore[no-any-return]
    clear, src, dst = (
        forward_batch.mamba_clear_indices,
        forward_batch.mamba_cow_src_indices,
        forward_batch.mamba_cow_dst_indices,
    )
    clearing = clear is not None and len(clear) > 0
    copying = src is not None and len(src) > 0
    # The journal (the allocations, frees, tenants since the last read) and the step's indices: the step's one
    # read. A step with neither a clear nor a copy reads nothing unless the journal has grown long.
    cleared: list[int] = []
    a: list[int] = []
    b: list[int] = []
    if clearing or copying or len(journal.meta) > _COMPACT:
        cleared, a, b = journal.resolve(
            pool.translate_mamba_indices(clear) if clearing else [],
            pool.translate_mamba_indices(src) if copying else [],
            pool.translate_mamba_indices(dst) if copying else [],
        )
    mgr = journal.manager
    if not _all_held(mgr, cleared, a, b):  # checked before anything is queued: all of the step or none of it
        _counts["fallbacks"] += 1
        return original(runner, forward_batch)  # type: ignore[no-any-return]
    if cleared:
        mgr.clear_many(cleared)
    if copying:
        counter = getattr(pool, "layer_transfer_counter", None)
        if counter is not None and counter.consumer_index >= 0:  # HiCache: the states must have landed
            counter.wait_until(max(pool.mamba_map) - pool.start_layer)
        mgr.copy_many(a, b)
    mgr.flush_nowait()  # on the current stream: the forward's
    _counts["steps"] += 1
    forward_batch.mamba_clear_indices = None
    forward_batch.mamba_cow_src_indices = None
    forward_batch.mamba_cow_dst_indices = None
    return None


def _hooks() -> list[tuple[str, Any, str]]:
    """Every hook the plugin registers: SGLang's dotted target, the hook, its HookType name."""
    pool = "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool"
    allocator = "sglang.srt.mem_cache.allocator.mamba.MambaSlotAllocator"
    component = "sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent"
    mamba_pool = "sglang.srt.mem_cache.memory_pool.MambaPool"
    runner = "sglang.srt.model_executor.model_runner.ModelRunner"
    return [
        (f"{pool}._init_mamba_pool", _after_init_mamba_pool, "AFTER"),
        (f"{pool}.alloc", _after_pool_alloc, "AFTER"),
        (f"{component}.finalize_match_result_in_cache", _after_match, "AFTER"),
        (f"{component}.commit_insert_component_data", _around_commit_insert, "AROUND"),
        (f"{allocator}._do_alloc", _after_alloc, "AFTER"),
        (f"{allocator}.free", _after_free, "AFTER"),
        (f"{allocator}.clear", _after_clear, "AFTER"),
        (f"{mamba_pool}.clear_slots", _around_clear_slots, "AROUND"),
        (f"{mamba_pool}.copy_from", _around_copy_from, "AROUND"),
        (f"{mamba_pool}.get_cpu_copy", _around_get_cpu_copy, "AROUND"),
        (f"{mamba_pool}.load_cpu_copy", _around_load_cpu_copy, "AROUND"),
        (f"{runner}._maybe_execute_deferred_mamba_cow_and_clear", _deferred_cow_and_clear, "AROUND"),
    ]


def register() -> None:
    """SGLang's general-plugin entry point: register the hooks when active. Idempotent.

    SGLang calls plugins with no arguments in every process that loads them,
    then applies the registered hooks before building the pools.
    """
    global _registered
    if _registered or not active():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in _hooks():
        HookRegistry.register(target, hook, getattr(HookType, kind))
    _registered = True
    trace = os.environ.get("MAMBACACHE_TRACE")
    if trace:
        from .. import tracing

        tracing.configure(trace, level="debug")
