"""vLLM's own align-mode copy kernels, run in Triton's interpreter on CPU tensors, against the plugin's events.

Run by tests/integrations/test_vllm_kernels.py in a subprocess (Triton reads ``TRITON_INTERPRET``
when it is imported, so it is set here first):

    python tests/workers/vllm_kernels.py --layout SD --cases 200 [--wrong-bias]

vLLM's CPU build replaces its Triton kernels with plain functions (it has no
Triton CPU backend), so each kernel is re-jitted from its own code with the
real ``triton`` and ``triton.language``: the interpreter then runs vLLM's
kernel body as written, on the same tensors the plugin adopts. For each case
(a batch of requests with block tables over a dirty pool laid out in vLLM's
block pages), one copy of the pool goes through vLLM's kernel through vLLM's
own ``MambaSpecDecodeGPUContext`` (built and initialised by vLLM's code from
the layers), the other through :class:`VllmStates` (``postprocess`` for the
post-forward kernel, ``copy_columns`` for the pre-copy one) and a flush.

Compared: every byte of every block, except a destination's conv rows past the
window the kernels read (``state_len - num_spec``): vLLM leaves them as they
were, mambacache's shift zero-fills them, and neither path reads them. Prints
one JSON line: cases, copies made, mismatches (with the first few).
``--wrong-bias`` drops the accepted-token bias from the plugin's copies, so the
comparison is shown to fail.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"

BLOCKS, WIDTH, NSPEC, DIM, SSM, BS, REQS, COLS = 40, 4, 2, 6, (2, 4, 4), 8, 4, 6
STATE_LEN = WIDTH - 1 + NSPEC


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layout", choices=["SD", "DS"], default="SD")
    p.add_argument("--cases", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wrong-bias", action="store_true")
    args = p.parse_args()
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = args.layout
    sys.path.insert(0, str(Path(__file__).parents[2]))
    import torch
    import triton
    import triton.language as tl
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.worker import mamba_utils as mu

    from mambacache.integrations import vllm as plugin

    def rejit(fn: Any, **calls: Any) -> Any:
        scope = {**fn.__globals__, "tl": tl, "triton": triton, **calls}
        return triton.jit(types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__))

    memcpy = rejit(mu._memcpy_u64_tiled)
    block = rejit(mu._copy_mamba_state_block, _memcpy_u64_tiled=memcpy)
    mu.postprocess_mamba_fused_kernel = rejit(mu.postprocess_mamba_fused_kernel, _copy_mamba_state_block=block)
    mu.precopy_mamba_align_fused_kernel = rejit(mu.precopy_mamba_align_fused_kernel, _copy_mamba_state_block=block)

    dim_first = args.layout == "DS"
    conv_shape = (DIM, STATE_LEN) if dim_first else (STATE_LEN, DIM)
    spec = MambaSpec(
        block_size=BS, shapes=(conv_shape, SSM), dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align", num_speculative_blocks=NSPEC,
    )  # fmt: skip
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["a", "b"])])
    funcs = {spec.mamba_type: (get_conv_copy_spec, get_temporal_copy_spec)}

    def pages(seed: int) -> list[tuple[Any, Any, Any]]:
        """Two layers, each one byte buffer of block pages: conv (bf16), then the SSM state (fp32), then 8 spare
        bytes; random bytes everywhere, as a pool reused across requests is."""
        g = torch.Generator().manual_seed(seed)
        conv_bytes, ssm_bytes = STATE_LEN * DIM * 2, 4 * SSM[0] * SSM[1] * SSM[2]
        page = conv_bytes + ssm_bytes + 8
        out = []
        for _ in range(2):
            raw = torch.randn(BLOCKS * page // 4, generator=g).view(torch.uint8)
            conv = raw.view(torch.bfloat16).as_strided((BLOCKS, *conv_shape), (page // 2, conv_shape[1], 1))
            ssm = raw.view(torch.float32).as_strided(
                (BLOCKS, *SSM), (page // 4, SSM[1] * SSM[2], SSM[2], 1), conv_bytes // 4
            )
            out.append((raw, conv, ssm))
        return out

    class Buffer:  # vLLM's CpuGpuBuffer on a CPU: one tensor, its numpy view
        def __init__(self, n: int, dtype: Any) -> None:
            self.gpu = torch.zeros(n, dtype=dtype)
            self.np = self.gpu.numpy()

    class Tables:  # input_batch.block_table: one BlockTable per KV cache group
        def __init__(self, table: Any) -> None:
            self.block_tables = [SimpleNamespace(block_table=SimpleNamespace(np=table.numpy()))]

        def __getitem__(self, g: int) -> Any:
            return self.block_tables[g]

    rng = random.Random(args.seed)
    mismatches: list[str] = []
    copies = shifted = 0
    for case in range(args.cases):
        table = torch.zeros(REQS, COLS, dtype=torch.int32)
        ids = rng.sample(range(1, BLOCKS), REQS * COLS)
        for i in range(REQS):
            table[i] = torch.tensor(ids[i * COLS : (i + 1) * COLS])
        ref, mine = pages(case), pages(case)
        context = {f"{n}": SimpleNamespace(kv_cache=[c, s]) for n, (_, c, s) in zip("ab", ref, strict=True)}
        ctx = mu.MambaSpecDecodeGPUContext.create(REQS, config, funcs, torch.device("cpu"), Buffer)
        ctx.initialize_from_forward_context(config, context, funcs, [table])
        pools, roles = plugin.split_pools([(c, s) for _, c, s in mine], dim_first)
        states = plugin.VllmStates(pools, [0], BS, roles)
        for i in range(REQS):
            states._give(f"r{i}", [int(b) for b in table[i]])
        states.flush()
        for (raw, _, _), (fresh, _, _) in zip(mine, pages(case), strict=True):
            raw.copy_(fresh)  # the allocations cleared the blocks: dirty again, as vLLM's are
        batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(REQS)], block_table=Tables(table))
        if case % 2 == 0:  # the post-forward kernel: requests near a block boundary, drafts accepted or not
            drafts = [rng.randint(0, NSPEC) for _ in range(REQS)]
            accepted = [rng.randint(1, d + 1) for d in drafts]
            computed = [rng.randrange(COLS - NSPEC - 1) * BS + BS - 1 - rng.randint(0, NSPEC) for _ in range(REQS)]
            scheduled = [1 + d for d in drafts]
            state_idx = [-(-(c + s) // BS) - 1 for c, s in zip(computed, scheduled, strict=True)]
            for buf, values in (
                (ctx.mamba_state_idx_buf, state_idx), (ctx.num_scheduled_tokens_buf, scheduled),
                (ctx.num_computed_tokens_buf, computed), (ctx.num_draft_tokens_buf, drafts),
            ):  # fmt: skip
                buf.np[:REQS] = values
            counts = torch.tensor(accepted, dtype=torch.int32)
            ctx.run_fused_postprocess(
                REQS, counts, ctx.mamba_state_idx_buf.gpu, ctx.num_scheduled_tokens_buf.gpu,
                ctx.num_computed_tokens_buf.gpu, ctx.num_draft_tokens_buf.gpu,
            )  # fmt: skip
            out = torch.zeros(REQS, dtype=torch.int32)
            before = states.stats.copies
            if args.wrong_bias:
                states.copy_columns = _without_bias(states.copy_columns)  # type: ignore[method-assign]
            states.postprocess(ctx, REQS, counts, out, batch)
            if out.tolist() != ctx.num_accepted_tokens_out[:REQS].tolist():
                mismatches.append(f"case {case}: accepted {out.tolist()} != {ctx.num_accepted_tokens_out.tolist()}")
            made = states.stats.copies - before
        else:  # the pre-copy kernel: the previous running column into the new one, with last step's bias
            src = [rng.choice([-1, *range(COLS - NSPEC)]) for _ in range(REQS)]
            dst = [rng.randrange(COLS - NSPEC) for _ in range(REQS)]
            bias = [rng.randint(0, NSPEC) for _ in range(REQS)]
            tensors = [torch.tensor(v, dtype=torch.int32) for v in (dst, src, bias)]
            ctx.run_fused_precopy(REQS, *tensors, idx_mapping=None)
            made = 0
            for i in range(REQS):
                if src[i] >= 0 and src[i] != dst[i]:
                    k = 0 if args.wrong_bias else bias[i]
                    states.copy_columns(f"r{i}", [table[i].numpy()], src[i], dst[i], k)
                    made += 1
        states.flush()
        copies += made
        window = WIDTH - 1

        def same_bytes(a: Any, b: Any) -> bool:  # random bytes hold NaNs, which torch.equal never calls equal
            ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
            return torch.equal(a.view(ints), b.view(ints))

        for name, (_, cr, sr), (_, cm, sm), (_, c0, _) in zip("ab", ref, mine, pages(case), strict=True):
            for b in range(BLOCKS):
                if not same_bytes(sr[b], sm[b]):
                    mismatches.append(f"case {case}: layer {name} block {b}: ssm")
                if same_bytes(cr[b], c0[b]):  # vLLM left the block alone: so must the plugin, every byte
                    same = same_bytes(cm[b], c0[b])
                elif dim_first:  # a destination: the window the kernels read
                    same = same_bytes(cm[b, :, :window], cr[b, :, :window])
                else:
                    same = same_bytes(cm[b, :window], cr[b, :window])
                if not same:
                    mismatches.append(f"case {case}: layer {name} block {b}: conv")
        shifted += states.stats.shifted
        states.close()
    report = {"cases": args.cases, "copies": copies, "shifted": shifted, "mismatches": len(mismatches)}
    print(json.dumps({**report, "first": mismatches[:5]}))
    return 0


def _without_bias(copy_columns: Any) -> Any:
    def wrong(req_id: str, block_ids: Any, src_col: int, dst_col: int, bias: int = 0) -> None:
        copy_columns(req_id, block_ids, src_col, dst_col, 0)

    return wrong


if __name__ == "__main__":
    raise SystemExit(main())
