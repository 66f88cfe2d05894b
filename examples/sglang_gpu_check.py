"""A prepared accelerator check: SGLang serving a tiny hybrid model, with and without the mambacache plugin.

Not run by the tests: SGLang's engine needs an accelerator (its CPU engine needs
sgl-kernel built from source). On a machine with one, in a venv with SGLang and
mambacache installed::

    python examples/sglang_gpu_check.py

It builds a tiny Qwen3-Next with random weights locally (nothing is downloaded),
then serves the same shared-prefix workload twice, each in a fresh process:
SGLang alone, and with ``SGLANG_PLUGINS=mambacache`` and a slot trace. It prints
whether the greedy outputs are token-exact, what ``mambacache trace
--expect-idle`` says of the plugin's trace, and the wall time of each pass with
and without the plugin: the first pass one request at a time (each admission
allocates and each finish frees a slot: where a read of slot ids to the host at
each allocation and free would show), the second batched. The plugin reads slot
ids to the host at most once per forward step, never per allocation or free
(tests/integrations/test_sglang.py counts it). It exits 1 if outputs or trace are wrong.
Meant to take under 2 minutes on one H200 (two engine starts dominate; decode
CUDA graphs are captured up to batch 32 only).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEMS, PER_SYSTEM, NEW_TOKENS = 4, 6, 16


def build_model(path: Path) -> None:
    """A 4-layer Qwen3-Next (3 linear-attention layers, 1 full), random weights, saved locally."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, full_attention_interval=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        max_position_embeddings=1024,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)


def prompts() -> list[list[int]]:
    """Requests over a few system prompts of several blocks each, so prefix hits fork cached states."""
    out = []
    for s in range(SYSTEMS):
        system = [(7 * s + i) % 500 + 1 for i in range(40 + 9 * s)]
        out += [system + [(s * 31 + r * 7 + i) % 500 + 1 for i in range(5 + r)] for r in range(PER_SYSTEM)]
    return out


def serve(model: str, mode: str, out: str, trace: str) -> None:
    """One engine, the whole workload twice (the second pass hits the prefix cache), greedy outputs to ``out``."""
    if mode == "plugin":
        os.environ["SGLANG_PLUGINS"] = "mambacache"
        os.environ["MAMBACACHE_TRACE"] = trace
    import sglang as sgl

    engine = sgl.Engine(
        model_path=model,
        skip_tokenizer_init=True,
        mem_fraction_static=0.3,
        random_seed=0,
        cuda_graph_max_bs_decode=32,  # the batch is 24 requests: fewer graphs to capture, a shorter start
    )
    try:
        params = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
        start = time.perf_counter()
        outputs = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts()]
        serial_s = time.perf_counter() - start
        start = time.perf_counter()
        outputs += [r["output_ids"] for r in engine.generate(input_ids=prompts(), sampling_params=params)]
        batch_s = time.perf_counter() - start
    finally:
        engine.shutdown()
    Path(out).write_text(json.dumps({"outputs": outputs, "serial_s": serial_s, "batch_s": batch_s}))


def missing() -> str | None:
    """What this machine lacks for the check (None: nothing)."""
    if importlib.util.find_spec("sglang") is None:
        return "SGLang (pip install sglang, in a venv with mambacache)"
    import torch

    if not torch.cuda.is_available():
        return "a CUDA GPU (SGLang's CPU engine needs sgl-kernel built from source)"
    return None


def main() -> int:
    lack = missing()
    if lack is not None:
        sys.stderr.write(f"sglang_gpu_check.py needs {lack}\n")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build_model(model)
        results = {}
        for mode in ("plain", "plugin"):
            out, trace = Path(tmp) / f"{mode}.json", Path(tmp) / "trace.jsonl"
            served = subprocess.run([sys.executable, __file__, "serve", str(model), mode, str(out), str(trace)])
            if served.returncode != 0:
                sys.stderr.write(f"sglang_gpu_check.py: the {mode} engine failed (exit {served.returncode}; above)\n")
                return 1
            results[mode] = json.loads(out.read_text())
        exact = results["plain"]["outputs"] == results["plugin"]["outputs"]
        from mambacache import tracing

        analysis = tracing.analyze(Path(tmp) / "trace.jsonl", expect_idle=True)
        print(f"token-exact: {exact} ({len(results['plain']['outputs'])} requests, {NEW_TOKENS} tokens each)")
        for key, name in (("serial_s", "one request at a time"), ("batch_s", "batched (prefix hits)")):
            times = ", ".join(f"{m} {r[key] * 1e3:.1f} ms" for m, r in results.items())
            print(f"{name}: {times}; plugin/plain {results['plugin'][key] / results['plain'][key]:.3f}")
        print(f"trace: {analysis.summary}; anomalies: {[a.kind for a in analysis.anomalies]}")
        return 0 if exact and not analysis.anomalies else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(*sys.argv[2:6])
        sys.exit(0)
    sys.exit(main())
