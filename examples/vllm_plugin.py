"""vLLM with and without the mambacache plugin, and transformers: do all three agree token for token?

Builds a tiny random Mamba2 (hidden 64, 2 layers, 8 heads of 16, state 16, conv 4,
fp32) and a word-level tokenizer locally (nothing is downloaded), then runs the
same greedy requests three ways: vLLM alone, vLLM with ``VLLM_PLUGINS=mambacache``
(its mamba state run through mambacache, traced), and transformers' ``generate``.
vLLM loads plugins once per process, so each vLLM run is a subprocess of this
script (``--worker``).

Needs ``pip install torch==2.13.0 'mambacache[vllm]'`` (then uninstall
torchvision, torchaudio and torchcodec: they break transformers' imports against
this torch). Exit 0 when all three agree, 1 when not, 2 on bad usage.

Options that make the check harder: ``--requests`` above ``--blocks`` reuses
blocks (continuous batching with more requests than fit); ``--chunked`` splits
prefills into small chunks; ``--unmask`` disables vLLM's initial-state masking
(new requests then read whatever their block holds: only the plugin's clears
keep outputs right).
``--close-midway`` closes the plugin (``llm.collective_rpc("mambacache_close")``)
after half the requests: the engine serves the rest on vLLM's own path.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VOCAB = 128


def build_model(out: Path, kind: str = "mamba2", linear_layers: int | None = None) -> None:
    """A tiny random Mamba2 (or, ``kind="qwen3-next"``, a hybrid Qwen3-Next) and a word-level tokenizer, saved
    to ``out``. The Qwen3-Next's head dims (128) and attention heads are what vLLM's CPU kernels accept, and
    its one-head linear attention keeps the mamba page (so the block) small. It has 2 linear-attention
    layers, each followed by a full-attention one; ``linear_layers=n`` gives it ``n`` in Qwen3-Next-80B's
    pattern instead (3 linear layers, then a full-attention one)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    common: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False,
    }  # fmt: skip
    if kind == "qwen3-next":
        types = ["linear_attention", "full_attention"] * 2
        if linear_layers is not None:
            types = [t for i in range(linear_layers) for t in ["linear_attention"] + ["full_attention"] * (i % 3 == 2)]
        config: Any = transformers.Qwen3NextConfig(
            intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            shared_expert_intermediate_size=32, num_hidden_layers=len(types), num_attention_heads=4,
            num_key_value_heads=4, head_dim=128, linear_conv_kernel_dim=4, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=1, layer_types=types,
            **common,
        )  # fmt: skip
        cls: Any = transformers.Qwen3NextForCausalLM
    else:
        config = transformers.Mamba2Config(
            state_size=16, num_heads=8, head_dim=16, n_groups=1, expand=2, conv_kernel=4, num_hidden_layers=2,
            chunk_size=8, **common,
        )  # fmt: skip
        cls = transformers.Mamba2ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config).float().eval()
    model.save_pretrained(out)
    fast.save_pretrained(out)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 24))] for _ in range(n)]


def transformers_greedy(model_dir: Path, requests: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    out = []
    with torch.no_grad():
        for p in requests:
            ids = model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
            )  # fmt: skip
            out.append([int(t) for t in ids[0, len(p) :]])
    return out


def _unmask_initial_states() -> None:
    """Make every prefill read its block's state as the initial state (vLLM masks new requests' reads)."""
    import torch
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder

    build = Mamba2AttentionMetadataBuilder.build

    def unmasked(self: Any, *args: Any, **kwargs: Any) -> Any:
        meta = build(self, *args, **kwargs)
        if meta.has_initial_states_p is not None:
            meta.has_initial_states_p = torch.ones_like(meta.has_initial_states_p)
            meta.prep_initial_states = True
        return meta

    Mamba2AttentionMetadataBuilder.build = unmasked


def worker(args: argparse.Namespace) -> None:
    """One vLLM run; prints JSON: the tokens, the plugin's figures, the seconds."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    if args.unmask:
        _unmask_initial_states()
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    if args.chunked:
        extra = {"enable_chunked_prefill": True, "max_num_batched_tokens": 8, "long_prefill_token_threshold": 4}
    llm = LLM(
        model=str(args.model_dir), dtype="float32", max_model_len=64, enforce_eager=True, max_num_seqs=4, seed=0,
        num_gpu_blocks_override=args.blocks, enable_prefix_caching=False, **extra,
    )  # fmt: skip
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    g = torch.Generator().manual_seed(1)
    for layer in runner.compilation_config.static_forward_context.values():
        for t in layer.kv_cache[:2]:  # a dirty pool, as one reused across requests is
            t.copy_(torch.randn(t.shape, generator=g))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts(args.requests, args.seed)]
    half = len(reqs) // 2 if args.close_midway else len(reqs)
    outs = llm.generate(reqs[:half], params, use_tqdm=False)
    # vLLM tells the model runner which requests finished in the *next* step's
    # scheduler output: one more (empty) step hands the last ones over.
    llm.llm_engine.step()
    states = getattr(runner, "_mambacache", None)
    stats = None if states is None else states.stats_dict()
    if args.close_midway:
        if states is not None:
            llm.collective_rpc("mambacache_close")  # detaches the plugin: the engine goes on without it
        outs += llm.generate(reqs[half:], params, use_tqdm=False)
    report = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "seconds": time.perf_counter() - t0,
        "plugin": stats,
    }
    print(json.dumps(report))


def run_vllm(args: argparse.Namespace, plugin: bool, trace: Path | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "MAMBACACHE_TRACE")}
    if plugin:
        env["VLLM_PLUGINS"] = "mambacache"
        if trace is not None:
            env["MAMBACACHE_TRACE"] = str(trace)
    cmd = [sys.executable, __file__, "--worker", "--model-dir", str(args.model_dir)]
    cmd += [f"--requests={args.requests}", f"--blocks={args.blocks}", f"--new-tokens={args.new_tokens}"]
    cmd += [f"--seed={args.seed}"] + (["--chunked"] if args.chunked else []) + (["--unmask"] if args.unmask else [])
    cmd += ["--close-midway"] if args.close_midway else []
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"the vLLM run ({'with' if plugin else 'without'} the plugin) failed")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--blocks", type=int, default=6, help="vLLM KV cache blocks (the null block is one)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunked", action="store_true", help="chunked prefill, 4 tokens a chunk")
    p.add_argument("--unmask", action="store_true", help="disable vLLM's initial-state masking")
    p.add_argument(
        "--close-midway", action="store_true", help="close the plugin (mambacache_close) after half the requests"
    )
    p.add_argument("--model-dir", type=Path, default=None, help="where to build the model (default: a temp dir)")
    p.add_argument("--trace", type=Path, default=None, help="write the plugin run's slot trace here")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.requests < 1 or args.blocks < 2 or args.new_tokens < 1:
        p.error("--requests and --new-tokens must be at least 1, --blocks at least 2")
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir is None:
            args.model_dir = Path(tmp) / "mamba2-tiny"
        if not (args.model_dir / "config.json").exists():
            build_model(args.model_dir)
        t0 = time.perf_counter()
        plain = run_vllm(args, plugin=False, trace=None)
        plugged = run_vllm(args, plugin=True, trace=args.trace)
        reference = transformers_greedy(args.model_dir, prompts(args.requests, args.seed), args.new_tokens)
        seconds = time.perf_counter() - t0
    rows = [
        (i, a == c, b == c)
        for i, (a, b, c) in enumerate(zip(plain["tokens"], plugged["tokens"], reference, strict=True))
    ]
    result = {
        "requests": args.requests,
        "blocks": args.blocks,
        "chunked": args.chunked,
        "unmask": args.unmask,
        "vllm_matches_transformers": sum(r[1] for r in rows),
        "plugin_matches_transformers": sum(r[2] for r in rows),
        "plugin_matches_vllm": sum(a == b for a, b in zip(plain["tokens"], plugged["tokens"], strict=True)),
        "all_agree": all(r[1] and r[2] for r in rows),
        "verdict": "",
        "plugin": plugged["plugin"],
        "seconds": round(seconds, 1),
    }
    n = args.requests
    wrong = n - result["plugin_matches_transformers"]
    if args.unmask:
        # Without the masking vLLM alone reads stale blocks; the plugin's clears are what keeps it right.
        ok = wrong == 0
        verdict = (
            "the plugin agrees with transformers"
            + ("; vLLM alone does not (it relies on the masking)" if result["vllm_matches_transformers"] < n else "")
            if ok
            else f"FAILED: with the plugin {wrong}/{n} requests mismatch"
        )
    else:
        ok = bool(result["all_agree"])
        verdict = "all three agree" if ok else "FAILED: they disagree"
    result["verdict"] = verdict
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.requests} requests, {args.blocks - 1} usable blocks, chunked={args.chunked},"
              f" unmask={args.unmask} ({seconds:.0f} s)")  # fmt: skip
        print(f"vLLM alone       = transformers: {result['vllm_matches_transformers']}/{args.requests}")
        print(f"vLLM + mambacache = transformers: {result['plugin_matches_transformers']}/{args.requests}")
        print(f"plugin: {plugged['plugin']}")
        print(result["verdict"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
