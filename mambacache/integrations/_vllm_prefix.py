"""vLLM's align-mode mamba prefix caching taken over by the mambacache plugin (a prototype, #23).

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

Speculative decoding's copies (``accept_token_bias > 0``, and the fused
pre/post-copy kernels it enables) are not taken over yet: they raise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

__all__ = ["current", "install"]

current: Any = None  # the VllmStates of this process's model runner (one per process)
_installed = False


def _without_prefill_checkpoints(specs: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import MambaSpec

    return {
        name: replace(spec, num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None)
        if isinstance(spec, MambaSpec) and spec.num_prefill_checkpoint_blocks
        else spec
        for name, spec in specs.items()
    }


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

    def collect_mamba_copy_meta(
        copy_bufs: Any,
        kv_cache_config: Any,
        mamba_state_copy_funcs: Any,
        mamba_group_ids: list[int],
        src_block_idx: int,
        dest_block_idx: int,
        accept_token_bias: int,
        req_state: Any,
        forward_context: dict[str, Any],
    ) -> None:
        if src_block_idx == dest_block_idx and accept_token_bias == 0:
            return
        if current is None:
            raise RuntimeError("mambacache: an align-mode copy before the plugin adopted the KV cache")
        if accept_token_bias:
            raise NotImplementedError("mambacache: align-mode copies with accepted draft tokens (a conv shift)")
        for g in mamba_group_ids:
            ids = req_state.block_ids[g]
            current.copy_block(req_state.req_id, int(ids[src_block_idx]), int(ids[dest_block_idx]))

    def do_mamba_copy_block(copy_bufs: Any) -> None:
        # The step's clears, hand-overs and copies, planned together, before the forward.
        if current is not None:
            current.flush()

    GPUModelRunner.get_kv_cache_spec = get_kv_cache_spec
    mamba_utils.collect_mamba_copy_meta = collect_mamba_copy_meta
    mamba_utils.do_mamba_copy_block = do_mamba_copy_block
    _installed = True
