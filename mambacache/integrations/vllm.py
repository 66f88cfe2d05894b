"""mambacache inside vLLM: a general plugin that runs vLLM's mamba state through a CacheManager.

Registered as the vLLM general plugin ``mambacache`` (entry point group
``vllm.general_plugins``); active only when ``VLLM_PLUGINS`` names it, so
installing mambacache next to vLLM changes nothing by itself. When active it
wraps two methods of vLLM's ``GPUModelRunner`` (which ``CPUModelRunner``
subclasses):

* ``initialize_kv_cache``: after vLLM has bound each mamba layer's ``(conv,
  ssm)`` tensors, adopt them into :class:`~mambacache.StatePool` s, same
  storage, no copy: one pool and one manager over every mamba layer, each
  block's page as one byte row (:func:`block_rows`), or, with speculative
  decoding in align mode, the conv windows as conv states and the SSM states
  as temporal states (:func:`split_pools`);
* ``_update_states``: before vLLM's own update, turn the scheduler output into
  events (finished requests' blocks into releases, new and resumed requests'
  mamba blocks into ``alloc_slots`` with a clear, block copies between mamba
  blocks into copy-on-write events) and flush them, so the clears land before
  vLLM's own block copies and the forward.

A slot is a vLLM block id, so vLLM's ``state_indices_tensor`` and kernels are
unchanged; block 0 is vLLM's null block and mambacache's padding slot alike.

With align-mode prefix caching (``enable_prefix_caching=True,
mamba_cache_mode="align"``) the plugin also runs vLLM's ``preprocess_mamba``
block copies as copy-on-write events, keeps finished requests' blocks for
prefix-cache hits, and on CPU drops Mamba2's in-forward prefill checkpoint,
which the CPU build cannot run (:mod:`._vllm_prefix`).

Every worker also answers ``llm.collective_rpc("mambacache_stats")`` (its
plugin's counters and pool shapes, or None) and ``"mambacache_close"``, which
detaches the plugin: later steps run on vLLM's own path, as without it (in
align mode on the CPU build, that path is what cannot run: see
:mod:`._vllm_prefix`).

``MAMBACACHE_TRACE=PATH`` writes the slot-lifecycle trace (debug level), which
``mambacache trace PATH`` analyses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from .._core._errors import InvalidArgumentError
from .._core._pool import StatePool
from .._manager import CacheManager
from . import _vllm_prefix

__all__ = ["CACHED", "PLUGIN_NAME", "VllmStates", "active", "block_rows", "distinct_layers", "register", "split_pools"]

CACHED = "vllm:prefix-cache"  # the tenant of blocks that vLLM's prefix cache may still hit

PLUGIN_NAME = "mambacache"
_patched = False


def active() -> bool:
    """Whether ``VLLM_PLUGINS`` (comma-separated) names this plugin."""
    names = os.environ.get("VLLM_PLUGINS")
    return names is not None and PLUGIN_NAME in {n.strip() for n in names.split(",")}


def register() -> None:
    """vLLM's general-plugin entry point: wrap the model runner when active. Idempotent.

    vLLM calls general plugins in every process it starts (engine core,
    workers), so this runs wherever the model runner lives.
    """
    global _patched
    if _patched or not active():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    original_init = GPUModelRunner.initialize_kv_cache
    original_update = GPUModelRunner._update_states

    def initialize_kv_cache(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        out = original_init(self, kv_cache_config, *args, **kwargs)
        old = getattr(self, "_mambacache", None)
        if old is not None:
            old.close()
        self._mambacache = VllmStates.from_runner(self)
        _vllm_prefix.current = self._mambacache
        return out

    def _update_states(self: Any, scheduler_output: Any) -> Any:
        states: VllmStates | None = getattr(self, "_mambacache", None)
        if states is not None and not states.closed:  # once closed, vLLM runs on its own path
            states.take(scheduler_output)
            if states.block_size is None:
                # Flushed before vLLM's own update: its block copies (a prefix-cache hit into a
                # new block) then land on the cleared block, not under the clear.
                states.flush()
            # In align mode preprocess_mamba's copies join this step's events and one flush
            # runs them all before the forward (_vllm_prefix's do_mamba_copy_block).
        return original_update(self, scheduler_output)

    def mambacache_stats(self: Any) -> dict[str, Any] | None:
        # Every rank's own figures, read with llm.collective_rpc("mambacache_stats") (no pickled function).
        states: VllmStates | None = getattr(self.model_runner, "_mambacache", None)
        if states is None:
            return None
        return {"stats": states.stats_dict(), "pools": states.shapes(), "layer_groups": states.layer_groups()}

    def mambacache_close(self: Any) -> None:
        states: VllmStates | None = getattr(self.model_runner, "_mambacache", None)
        if states is not None:
            states.close()

    GPUModelRunner.initialize_kv_cache = initialize_kv_cache
    GPUModelRunner._update_states = _update_states
    WorkerBase.mambacache_stats = mambacache_stats
    WorkerBase.mambacache_close = mambacache_close
    _vllm_prefix.install()
    _patched = True
    trace = os.environ.get("MAMBACACHE_TRACE")
    if trace:
        from .. import tracing

        tracing.configure(trace, level="debug")


def block_rows(conv: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
    """One layer's blocks as contiguous byte rows ``[num_blocks, page_bytes]``: a view, no copy.

    vLLM keeps a mamba layer's states block-major, each block one page holding
    the conv state and then the SSM state (and padding)::

        block b:  | conv [3, 160] | ssm [8, 16, 16] | pad |   <- page_bytes, block b + 1 follows
        conv = view(blocks, 3, 160)   strides (page, 160, 1)   not contiguous
        ssm  = view(blocks, 8, 16, 16) at +conv bytes, same page stride

    Zeroing or copying a whole row zeroes or copies both states of that block,
    so mambacache manages the page as one opaque state. Raises ValueError when
    the tensors are not laid out so.
    """
    page = conv.stride(0) * conv.element_size()
    if ssm.stride(0) * ssm.element_size() != page or conv.shape[0] != ssm.shape[0]:
        raise ValueError(f"conv and ssm do not share a page per block: {conv.stride()} vs {ssm.stride()}")
    if conv.untyped_storage().data_ptr() != ssm.untyped_storage().data_ptr():
        raise ValueError("conv and ssm live in different storages")
    base = conv.storage_offset() * conv.element_size()
    ssm_at = ssm.storage_offset() * ssm.element_size() - base
    ends = (
        conv[0].numel() * conv.element_size(),  # conv[0] is contiguous within the page
        ssm_at + ssm[0].numel() * ssm.element_size(),
    )
    if ssm_at < 0 or max(ends) > page or not (conv[0].is_contiguous() and ssm[0].is_contiguous()):
        raise ValueError("a block's conv and ssm states do not fit one page from the conv state on")
    rows = torch.empty(0, dtype=torch.uint8, device=conv.device)
    rows.set_(conv.untyped_storage(), base, (conv.shape[0], page), (page, 1))
    return rows


def _pools(rows: list[torch.Tensor]) -> list[StatePool]:
    """Every layer's block rows as one pool (:meth:`StatePool.from_layers`): one tensor when they are evenly
    spaced in one storage, else a layer group per run of such layers; one ledger and one flush either way."""
    return [StatePool.from_layers(None, rows)]


def distinct_layers(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``layers`` without the repeats: a ``(conv, ssm)`` pair over the same bytes as one before it, as layer
    ``i`` of every mamba KV cache group is (vLLM lays every group out from byte 0 of the same buffers; a
    block id belongs to one group at a time).

    One pool per storage, since a pool replays every block event on its bytes: two pools over the same
    bytes would run a step twice, which a copy whose source the step later overwrites, or a shift in
    place, does not survive.
    """
    seen: set[tuple[Any, ...]] = set()
    out = []
    for conv, ssm in layers:
        key = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in (conv, ssm))
        if key not in seen:
            seen.add(key)
            out.append((conv, ssm))
    return out


def split_pools(
    layers: list[tuple[torch.Tensor, torch.Tensor]], dim_first: bool = False
) -> tuple[list[StatePool], list[tuple[str, int]]]:
    """Every layer's conv windows as conv states and SSM states as temporal states of one paged pool
    (:meth:`StatePool.from_layers`), same storage, and its role ``("split", unit)``: ``([pool], [role])``.

    For speculative decoding's align-mode copies, which read a block's conv
    window and its SSM state from different blocks (the conv window of column
    ``s`` shifted by the accepted-token bias ``k``, the SSM state of column
    ``s + k``): a page row moves both from one block, while this pool keeps them
    apart, so such a copy is one event,
    ``copy_on_write(blk[s], dst, shift=k * unit, temporal_src=blk[s + k])``. The
    conv windows' time axis is last, so a shift of ``k`` tokens is ``shift=k * unit``::

        vLLM "SD" conv block [state_len, dim]  ->  [1, state_len * dim]   unit = dim
        vLLM "DS" conv block [dim, state_len]  ->  as it is               unit = 1

    One pool, so one manager, whatever the layer count. (The name and the
    ``(pools, roles)`` shape are kept from when the two states took a pool each.)
    """
    conv0 = layers[0][0]
    # Views (a reshape could copy, and the pool would then write the copy).
    windows = [c if dim_first else c.view(c.shape[0], 1, -1) for c, _ in layers]
    unit = 1 if dim_first else conv0.shape[-1]
    return [StatePool.from_layers([[w] for w in windows], [s for _, s in layers])], [("split", unit)]


@dataclass(frozen=True, slots=True)
class VllmStats:
    """What the plugin did: blocks allocated (and cleared), released, copied, and taken back from preempted.

    In align mode also: ``kept``, blocks handed over to vLLM's prefix cache (tenant :data:`CACHED`) when
    their request let go of them, ``hits``, blocks a new request got as prefix-cache hits (not cleared),
    and, with speculative decoding, ``shifted``: the copies that carried an accepted-token bias.
    """

    allocs: int = 0
    clears: int = 0
    releases: int = 0
    copies: int = 0
    reclaimed: int = 0
    flushes: int = 0
    kept: int = 0
    hits: int = 0
    shifted: int = 0


class VllmStates:
    """vLLM's mamba blocks as mambacache slots: one pool over every mamba layer (block pages, or from
    :func:`split_pools` conv windows and SSM states apart) and one CacheManager on it.

    Invariants: a block is held by the request vLLM last gave it to; a block
    vLLM hands to a new request while the plugin still holds it for another
    (that request was preempted, and vLLM recomputes it) is released from the
    old tenant first; every block a request gets reads as zeros before its first
    forward.

    With align-mode prefix caching (``block_size`` set) a block's state may be
    hit after its request let go of it, so the request's blocks pass to the
    tenant :data:`CACHED` instead of being released, and a new request's
    blocks in the columns its computed (hit) tokens cover are read, not
    allocated: vLLM's ``preprocess_mamba`` copies the hit block's state into
    the request's current block, through :meth:`copy_block`.
    """

    def __init__(
        self,
        pools: list[StatePool],
        groups: list[int],
        block_size: int | None = None,
        roles: list[tuple[str, int]] | None = None,
    ) -> None:
        if len(pools) != 1 or (roles is not None and len(roles) != 1):
            raise InvalidArgumentError(
                f"VllmStates takes one pool (every mamba layer) and at most one role, got {len(pools)} pool(s)"
            )
        self.pools = pools
        # ("page", 0): a block's whole page (block_rows); or, from split_pools, ("split", unit): conv windows
        # and SSM states apart, which a copy with an accepted-token bias reads from different blocks.
        self.role = roles[0] if roles is not None else ("page", 0)
        self.groups = groups  # indices of the mamba KV cache groups
        self.block_size = block_size  # the mamba block size in align mode with prefix caching, else None
        self.manager = CacheManager(pools[0]).__enter__()
        self.tenant_of: dict[int, str] = {}
        self.blocks: dict[str, list[int]] = {}
        self._counts = dict.fromkeys(VllmStats.__slots__, 0)
        self._closed = False

    @classmethod
    def from_runner(cls, runner: Any) -> VllmStates | None:
        """Adopt the mamba layers' tensors of a model runner whose KV cache is initialised; None without any."""
        from vllm.v1.kv_cache_interface import MambaSpec

        kv_groups = runner.kv_cache_config.kv_cache_groups
        groups = [i for i, g in enumerate(kv_groups) if isinstance(g.kv_cache_spec, MambaSpec)]
        if not groups:
            return None
        context = runner.compilation_config.static_forward_context
        layers = []
        for i in groups:
            for name in kv_groups[i].layer_names:
                kv = context[name].kv_cache
                conv, ssm = (kv[0] if isinstance(kv[0], list | tuple) else kv)[:2]
                layers.append((conv, ssm))
        layers = distinct_layers(layers)
        cache = runner.cache_config
        align = bool(cache.enable_prefix_caching) and cache.mamba_cache_mode == "align"
        block_size = kv_groups[groups[0]].kv_cache_spec.block_size if align else None
        if align and getattr(runner, "speculative_config", None) is not None:
            from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

            pools, roles = split_pools(layers, is_conv_state_dim_first())
            return cls(pools, groups, block_size, roles)
        return cls(_pools([block_rows(c, s) for c, s in layers]), groups, block_size)

    @property
    def stats(self) -> VllmStats:
        """A snapshot of the counters."""
        return VllmStats(**self._counts)

    def stats_dict(self) -> dict[str, int]:
        """The counters as a plain dict (JSON-ready)."""
        return dict(self._counts)

    def shapes(self) -> list[list[int]]:
        """Each adopted pool's ``[layers, blocks, *state]`` (page bytes for block pages; with tensor parallelism,
        this rank's shard)."""
        return [[p.spec.num_layers, p.num_slots + p.pad_slots, *p.spec.temporal_shape] for p in self.pools]

    def layer_groups(self) -> list[int]:
        """Each pool's layer groups (:meth:`StatePool.from_layers`): 1 when its layers run as one tensor."""
        return [len(p.layer_groups) for p in self.pools]

    def _mamba_ids(self, block_ids: tuple[list[int], ...] | None, computed: int = 0) -> list[int]:
        if not block_ids:
            return []
        # Columns the computed tokens cover hold prefix-cache hits: read, never cleared.
        skip = -(-computed // self.block_size) if self.block_size and computed > 0 else 0
        hits = sum(b > 0 for g in self.groups for b in block_ids[g][:skip])
        self._counts["hits"] += hits
        return [b for g in self.groups for b in block_ids[g][skip:] if b > 0]  # 0 is vLLM's null block

    def _release(self, req_id: str, blocks: list[int] | None = None, keep: bool = False) -> None:
        held = self.blocks.get(req_id, [])
        gone = [b for b in held if blocks is None or b in blocks]
        kept = keep and self.block_size is not None and req_id != CACHED
        for b in gone:
            if kept:
                self.manager.hand_over(b, CACHED, request_id=req_id)
                self.tenant_of[b] = CACHED
            else:
                self.manager.release(b, request_id=req_id)
                del self.tenant_of[b]
        if kept:
            self.blocks.setdefault(CACHED, []).extend(gone)
        self._counts["kept" if kept else "releases"] += len(gone)
        rest = [b for b in held if b not in gone]
        if rest:
            self.blocks[req_id] = rest
        else:
            self.blocks.pop(req_id, None)

    def _give(self, req_id: str, blocks: list[int]) -> None:
        new = [b for b in blocks if self.tenant_of.get(b) != req_id]
        for b in new:
            tenant = self.tenant_of.get(b)
            if tenant is not None:  # vLLM took it back from a preempted request, or evicted it from its cache
                self._release(tenant, [b])
                self._counts["reclaimed"] += 1
        if not new:
            return
        self.manager.alloc_slots(new, request_id=req_id, clear=True)  # vLLM hands blocks out dirty
        for b in new:
            self.tenant_of[b] = req_id
        self.blocks.setdefault(req_id, []).extend(new)
        self._counts["allocs"] += len(new)
        self._counts["clears"] += len(new)

    def take(self, so: Any) -> None:
        """Turn one step's scheduler output into events (before vLLM's own update)."""
        for req_id in so.finished_req_ids:
            self._release(req_id, keep=True)
        for req in so.scheduled_new_reqs:
            # An aborted id resubmitted was released with the finished ones above; a
            # streaming request continued under its id keeps the blocks it still has.
            ids = self._mamba_ids(req.block_ids, getattr(req, "num_computed_tokens", 0))
            self._release(req.req_id, [b for b in self.blocks.get(req.req_id, []) if b not in ids], keep=True)
            self._give(req.req_id, ids)
        cached = so.scheduled_cached_reqs
        computed = getattr(cached, "num_computed_tokens", None) or [0] * len(cached.req_ids)
        for req_id, block_ids, done in zip(cached.req_ids, cached.new_block_ids, computed, strict=False):
            if req_id in cached.resumed_req_ids:
                # Resumed after preemption: vLLM recomputes it from its last hit in the blocks it now gives.
                self._release(req_id, keep=True)
                self._give(req_id, self._mamba_ids(block_ids, done))
            else:
                self._give(req_id, self._mamba_ids(block_ids))
        for copy in getattr(so, "kv_cache_block_copies", None) or ():
            src, dst = int(copy[0]), int(copy[1])
            if src in self.tenant_of and dst in self.tenant_of:
                self._copy(self.tenant_of[dst], src, dst)

    def copy_block(self, req_id: str, src: int, dst: int, bias: int = 0, temporal_src: int | None = None) -> None:
        """Queue vLLM's align-mode copy of block ``src``'s state into ``req_id``'s block ``dst``.

        ``src`` is the request's previous block or a prefix-cache hit (held by
        another request or by :data:`CACHED`); ``dst`` is held by ``req_id``.
        With speculative decoding, ``bias`` accepted draft tokens shift the conv
        window by ``bias`` tokens and the SSM state comes from block
        ``temporal_src`` (vLLM's ``get_conv_copy_spec`` / ``get_temporal_copy_spec``):
        one event, ``copy_on_write(src, dst, shift=bias * unit, temporal_src=...)``;
        that needs :func:`split_pools`.
        """
        self._copy(req_id, src, dst, bias, src if temporal_src is None else temporal_src)

    def _copy(self, req_id: str, src: int, dst: int, bias: int = 0, temporal_src: int | None = None) -> None:
        role, unit = self.role
        second = None if temporal_src is None or temporal_src == src else temporal_src
        if role == "page":
            if bias or second is not None:
                raise InvalidArgumentError(
                    "a copy with an accepted-token bias needs the conv and SSM states apart in the pool (split_pools)"
                )
            self.manager.copy_on_write(src, dst, request_id=req_id)
        elif bias or src != dst or (second is not None and second != dst):  # else it would leave dst as it is
            self.manager.copy_on_write(src, dst, request_id=req_id, shift=bias * unit, temporal_src=second)
        self._counts["copies"] += 1
        self._counts["shifted"] += bias > 0

    def copy_columns(self, req_id: str, block_ids: Any, src_col: int, dst_col: int, bias: int = 0) -> None:
        """:meth:`copy_block` from block column ``src_col`` to ``dst_col`` of each mamba group of ``block_ids``
        (a request's block ids per KV cache group), as vLLM's ``collect_mamba_copy_meta`` addresses it."""
        for g in self.groups:
            ids = block_ids[g]
            self.copy_block(req_id, int(ids[src_col]), int(ids[dst_col]), bias, int(ids[src_col + bias]))

    def postprocess(
        self, ctx: Any, num_reqs: int, accepted: torch.Tensor, accepted_out: torch.Tensor, input_batch: Any
    ) -> None:
        """vLLM's ``postprocess_mamba_fused_kernel`` as events: after a speculative step, a request whose
        accepted tokens reach a block boundary gets the state at the boundary copied into that block.

        Reads the step's figures vLLM staged on ``ctx`` (``stage_postprocess_inputs_to_gpu``) and the
        accepted counts; writes the counts the next ``preprocess_mamba`` reads into ``accepted_out`` (1
        where the copy stayed in the running block). The copies run with the next step's flush, before
        its own copies, so nothing reads them sooner.
        """
        block_size = self.block_size
        if block_size is None:
            raise RuntimeError("mambacache: a speculative postprocess outside align mode")
        counts = accepted[:num_reqs].tolist()  # on the CPU build: no device sync
        state_idx, scheduled = ctx.mamba_state_idx_buf.np, ctx.num_scheduled_tokens_buf.np
        computed, drafts = ctx.num_computed_tokens_buf.np, ctx.num_draft_tokens_buf.np
        out = list(counts)
        for i, n in enumerate(counts):
            running = int(computed[i]) + int(scheduled[i]) - int(drafts[i])  # tokens in the running state
            aligned = (running + n - 1) // block_size * block_size
            if aligned < running:
                continue  # the accepted tokens stay inside the running block
            src, dst, bias = int(state_idx[i]), aligned // block_size - 1, aligned - running
            if src == dst:
                out[i] = 1
                if bias == 0:
                    continue
            tables = input_batch.block_table.block_tables  # one per KV cache group, rows in batch order
            self.copy_columns(input_batch.req_ids[i], [t.block_table.np[i] for t in tables], src, dst, bias)
        accepted_out[:num_reqs] = torch.tensor(out, dtype=accepted_out.dtype)

    def flush(self) -> None:
        """Run the step's events on the forward's stream, before the forward."""
        self.manager.flush_nowait()
        self._counts["flushes"] += 1

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran: the plugin is detached, vLLM's steps no longer reach it."""
        return self._closed

    def close(self) -> None:
        """Release the blocks kept for vLLM's prefix cache, close the manager (it runs its last flush) and
        detach: the model runner's later steps, and the align-mode hooks, hand over to vLLM's own code.

        Blocks still held by a request stay held (that request never finished),
        so a trace of a run whose requests all finished ends idle. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        if _vllm_prefix.current is self:
            _vllm_prefix.current = None
        self._release(CACHED)  # the prefix cache dies with the engine: its blocks are no one's now
        self.manager.__exit__(None, None, None)
