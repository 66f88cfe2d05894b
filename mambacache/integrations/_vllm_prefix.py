"""vLLM's align-mode mamba prefix caching taken over by the mambacache plugin.

vLLM's align mode (``enable_prefix_caching=True, mamba_cache_mode="align"``)
needs two things the CPU build lacks (docs/engines.md, "Prefix caching on the
CPU build: what is missing"):

* Mamba2 declares an in-forward prefill checkpoint
  (``MambaMixer2.get_kv_cache_spec``: ``num_prefill_checkpoint_blocks=1``),
  which needs the SSD scan's per-chunk states and a Triton store kernel; the
  CPU scan returns one state per sequence. :func:`install` drops the
  checkpoint block from every ``MambaSpec`` the model runner reports on CPU,
  so vLLM's scheduler splits prefills at block boundaries instead (its own
  path for backends without a checkpoint) and the block-end states come from
  ordinary chunk ends.
* ``preprocess_mamba`` copies the running (or hit) state into the request's
  current block with Triton's ``batch_memcpy``. :func:`install` wraps the two
  functions of its scalar path: ``collect_mamba_copy_meta`` (where vLLM turns
  a decision, "block column ``src`` into column ``dst``", into raw pointers)
  records a block copy as a mambacache ``copy_on_write`` instead, and
  ``do_mamba_copy_block`` (the one launch of ``batch_memcpy``) flushes the
  step's events instead, so vLLM's copy kernel is never called.

With speculative decoding on a hybrid model, vLLM runs these copies as fused
Triton kernels instead (``MambaSpecDecodeGPUContext.run_fused_precopy`` and
``run_fused_postprocess``), which the CPU build cannot run either. The plugin
adopts each layer's conv and SSM states apart, as the conv and temporal states
of its one pool (:func:`~mambacache.integrations.vllm.split_pools`), since such
a copy reads the conv window of block column ``s`` shifted by the accepted-token
bias ``k`` and the SSM state of column ``s + k``: one event,
``copy_on_write(blk[s], dst, shift=k * unit, temporal_src=blk[s + k])``, and wraps:

* ``preprocess_mamba``: called without its fused context, so it takes the
  scalar path above, whose ``collect_mamba_copy_meta`` passes the bias on;
* ``postprocess_mamba_align_gpu`` (after the forward: a request whose accepted
  tokens reach a block boundary gets the boundary's state copied into that
  block): :meth:`~mambacache.integrations.vllm.VllmStates.postprocess` makes
  the same decisions as vLLM's kernel and queues the same copies as events,
  which the next step's flush runs before its own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

__all__ = ["current", "install"]

current: Any = None  # the VllmStates of this process's model runner (one per process)
_installed = False
_originals: dict[str, Any] = {}  # vLLM's functions that the wrappers hand over to without a plugin


def _without_prefill_checkpoints(specs: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import MambaSpec

    return {
        name: replace(spec, num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None)
        if isinstance(spec, MambaSpec) and spec.num_prefill_checkpoint_blocks
        else spec
        for name, spec in specs.items()
    }


def _collect_mamba_copy_meta(
    copy_bufs: Any,
    kv_cache_config: Any,
    mamba_state_copy_funcs: Any,
    mamba_group_ids: list[int],
    src_block_idx: int,
    dest_block_idx: int,
    accept_token_bias: int,
    req_state: Any,
    forward_context: dict[str, Any],
) -> Any:
    """vLLM's "block column ``src`` into column ``dst``" (with the accepted-token bias) as copy events."""
    if current is None:  # no plugin states (closed, or none adopted): vLLM's own copy
        return _originals["collect_mamba_copy_meta"](
            copy_bufs, kv_cache_config, mamba_state_copy_funcs, mamba_group_ids, src_block_idx, dest_block_idx,
            accept_token_bias, req_state, forward_context,
        )  # fmt: skip
    if src_block_idx == dest_block_idx and accept_token_bias == 0:
        return None
    current.copy_columns(req_state.req_id, req_state.block_ids, src_block_idx, dest_block_idx, accept_token_bias)
    return None


def _do_mamba_copy_block(copy_bufs: Any) -> Any:
    """The step's clears, hand-overs and copies, planned together, before the forward."""
    if current is None:
        return _originals["do_mamba_copy_block"](copy_bufs)
    current.flush()
    return None


def _preprocess_mamba(*args: Any, **kwargs: Any) -> Any:
    """vLLM's ``preprocess_mamba`` on its scalar path: its copies come to :func:`_collect_mamba_copy_meta`."""
    if current is not None:
        kwargs["align_ctx"] = None
    return _originals["preprocess_mamba"](*args, **kwargs)


def _postprocess_mamba_align_gpu(**kwargs: Any) -> Any:
    """vLLM's post-forward fused copies, as the plugin's events (``VllmStates.postprocess``)."""
    if current is None:
        return _originals["postprocess_mamba_align_gpu"](**kwargs)
    current.postprocess(
        kwargs["bufs"].postprocess_align,
        kwargs["num_reqs"],
        kwargs["num_accepted_tokens_gpu"],
        kwargs["num_accepted_tokens_cpu_tensor"],
        kwargs["input_batch"],
    )
    return None


def install() -> None:
    """Wrap vLLM's align-mode hooks (see the module docstring). Idempotent."""
    global _installed
    if _installed:
        return
    from vllm.platforms import current_platform
    from vllm.v1.worker import mamba_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original_spec = GPUModelRunner.get_kv_cache_spec

    def get_kv_cache_spec(self: Any) -> Any:
        specs = original_spec(self)
        if current_platform.is_cpu() and self.cache_config.mamba_cache_mode == "align":
            # The CPU scan returns no per-chunk states to export a checkpoint from.
            specs = _without_prefill_checkpoints(specs)
        return specs

    GPUModelRunner.get_kv_cache_spec = get_kv_cache_spec
    for name in ("preprocess_mamba", "postprocess_mamba_align_gpu", "collect_mamba_copy_meta", "do_mamba_copy_block"):
        _originals[name] = getattr(mamba_utils, name)
    mamba_utils.preprocess_mamba = _preprocess_mamba
    mamba_utils.postprocess_mamba_align_gpu = _postprocess_mamba_align_gpu
    mamba_utils.collect_mamba_copy_meta = _collect_mamba_copy_meta
    mamba_utils.do_mamba_copy_block = _do_mamba_copy_block
    _installed = True
