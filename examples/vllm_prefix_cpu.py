"""vLLM's mamba prefix caching (align mode) on the CPU build: alone, and with the mambacache plugin.

Builds the tiny local Mamba2 of ``examples/vllm_plugin.py`` (nothing is
downloaded) and runs a shared-prefix workload (``--systems`` system prompts of
``--system-tokens`` tokens, ``--per-system`` requests each with a short unique
tail, chunked prefill) three ways in subprocesses (vLLM loads plugins once per
process):

* ``off``: vLLM alone, prefix caching off;
* ``align``: vLLM alone, ``enable_prefix_caching=True, mamba_cache_mode="align"``;
* ``align-nockpt``: vLLM alone in align mode with only the plugin's one fix
  applied by hand (Mamba2's in-forward prefill checkpoint dropped): vLLM's own
  block copies then run through its C++ fallback for ``batch_memcpy_kernel``;
* ``plugin``: align mode with ``VLLM_PLUGINS=mambacache``;

then transformers' greedy ``generate`` as the reference.

``--spec K`` runs every vLLM run with ngram speculative decoding (``K`` draft
tokens; transformers' greedy output stays the reference) and ``--model
qwen3-next`` a tiny hybrid Qwen3-Next instead (gated delta net and attention
layers, bf16, dims the CPU build's kernels accept; vLLM's accepted-token
counts reach its mamba state copies only on a hybrid model). Its prompts open
with a repeated pattern, so that the ngram drafter finds drafts; ``--linear-layers N``
grows it to ``N`` linear-attention layers in Qwen3-Next-80B's pattern (3 linear, 1
full attention; the real model has 36), for the plugin's host time per step
against the layer count (``--measure``). Each run reports its
tokens, vLLM's per-request ``num_cached_tokens`` (the prefix-cache hits) and,
when it fails, the exception's last line. Exit 0 when the plugin run is
token-exact against both references with hits, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from vllm_plugin import VOCAB, build_model, transformers_greedy

MODES = ("off", "align", "align-nockpt", "plugin")


def workload(systems: int, per_system: int, system_tokens: int, seed: int, patterned: bool = False) -> list[list[int]]:
    """``systems`` shared prefixes, ``per_system`` requests each with a unique 3 to 9 token tail, interleaved.

    ``patterned``: each prefix opens with a short pattern repeated over two thirds of it (drafts for ngram).
    """
    rng = random.Random(seed)
    prefixes = []
    for _ in range(systems):
        head = (2 * system_tokens // 3) if patterned else 0
        pattern = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 6))]
        prefix = (pattern * system_tokens)[:head] + [rng.randrange(3, VOCAB) for _ in range(system_tokens - head)]
        prefixes.append(prefix)
    return [
        prefixes[s] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 9))]
        for _ in range(per_system)
        for s in range(systems)
    ]


def plugin_active() -> bool:
    """Whether this process runs vLLM with the mambacache plugin."""
    from mambacache.integrations.vllm import active

    return active()


def timed_plugin() -> tuple[list[float], list[float], list[float]]:
    """Time the plugin's host work per step: ``VllmStates.take`` starts a step, its copies and flush join it.

    Returns the per-step seconds (filled as vLLM runs), the part of each spent
    running the step's stages (``run_stage``: on CPU a flush runs the clears
    and copies in the call, so their bytes are moved there, and they grow with
    the layers; on a GPU they are launches), and the model runner's
    ``execute_model`` seconds per step, for scale.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from mambacache._core import _runner
    from mambacache.integrations.vllm import VllmStates

    per_step: list[float] = []
    stages: list[float] = []
    executes: list[float] = []

    def timed(fn: Any, starts_step: bool, into: list[float]) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if starts_step:
                    per_step.append(0.0)
                    stages.append(0.0)
                if into:
                    into[-1] += time.perf_counter() - t

        return wrapper

    VllmStates.take = timed(VllmStates.take, True, per_step)  # type: ignore[method-assign]
    VllmStates.copy_block = timed(VllmStates.copy_block, False, per_step)  # type: ignore[method-assign]
    VllmStates.flush = timed(VllmStates.flush, False, per_step)  # type: ignore[method-assign]
    # The runner calls run_stage through its module's global: the one place a stage becomes executor calls.
    _runner.run_stage = timed(_runner.run_stage, False, stages)  # type: ignore[assignment]
    execute = GPUModelRunner.execute_model

    def execute_model(self: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return execute(self, *a, **k)
        finally:
            executes.append(time.perf_counter() - t)

    GPUModelRunner.execute_model = execute_model
    return per_step, stages, executes


def quantiles(xs: list[float]) -> dict[str, float]:
    """Median and p95 in milliseconds (nearest rank), and the count."""
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {
        "n": len(s),
        "median_ms": round(s[len(s) // 2] * 1e3, 3),
        "p95_ms": round(s[-(-len(s) * 95 // 100) - 1] * 1e3, 3),
    }


def measure(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Time to first token of waves that hit against waves that miss, alternated on one engine.

    ``--systems`` system prompts are sent once to warm the cache; then each of
    ``--rounds`` rounds sends a hit wave (those prompts, new tails) and a miss
    wave (new system prompts of the same length), the order alternating.
    """
    from vllm import SamplingParams

    rng = random.Random(args.seed + 1)

    def prompt(prefix: list[int]) -> list[int]:
        return prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 9))]

    def fresh() -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(args.system_tokens)]

    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    warm = [fresh() for _ in range(args.systems)]
    llm.generate([{"prompt_token_ids": prompt(p)} for p in warm], params, use_tqdm=False)
    ttft: dict[str, list[float]] = {"hit": [], "miss": []}
    cached: dict[str, list[int]] = {"hit": [], "miss": []}
    for r in range(args.rounds):
        for kind in ("hit", "miss") if r % 2 == 0 else ("miss", "hit"):
            prefixes = warm if kind == "hit" else [fresh() for _ in range(args.systems)]
            outs = llm.generate([{"prompt_token_ids": prompt(p)} for p in prefixes], params, use_tqdm=False)
            ttft[kind] += [o.metrics.first_token_latency for o in outs]
            cached[kind] += [o.num_cached_tokens or 0 for o in outs]
    return {
        "ttft": {k: quantiles(v) for k, v in ttft.items()},
        "cached_mean": {k: round(sum(v) / len(v), 1) for k, v in cached.items()},
    }


def shared_prefixes(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The workload in waves; the tokens, cached tokens per request and the plugin's counters (then closes it)."""
    from vllm import SamplingParams

    reqs = workload(args.systems, args.per_system, args.system_tokens, args.seed, args.model == "qwen3-next")
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    # In waves, one request per system prompt first: later waves can hit what earlier ones cached.
    outs = []
    for w in range(args.per_system):
        wave = reqs[w * args.systems : (w + 1) * args.systems]
        outs += llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
    llm.llm_engine.step()  # hands the last finished requests to the model runner
    # Each rank's plugin answers for itself (with tensor parallelism, in its worker process).
    ranks = llm.collective_rpc("mambacache_stats") if plugin_active() else []
    out = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "cached": [o.num_cached_tokens or 0 for o in outs],
        "plugin": ranks[0]["stats"] if ranks and ranks[0] else None,
        "ranks": ranks,
    }
    if ranks:
        llm.collective_rpc("mambacache_close")  # releases the blocks the prefix cache kept: the trace ends idle
    return out


def worker(args: argparse.Namespace) -> None:
    """One vLLM run; prints JSON: tokens, cached tokens per request, the plugin's figures, or the error."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    report: dict[str, Any] = {"mode": args.mode}
    if args.mode == "align-nockpt":
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from mambacache.integrations._vllm_prefix import _without_prefill_checkpoints

        spec = GPUModelRunner.get_kv_cache_spec
        GPUModelRunner.get_kv_cache_spec = lambda self: _without_prefill_checkpoints(spec(self))
    per_step, stages, executes = timed_plugin() if args.measure else ([], [], [])
    t0 = time.perf_counter()
    try:
        if args.tp > 1:
            # vLLM's automatic thread binding wants a NUMA node per worker; split this process's CPUs instead.
            cpus = sorted(os.sched_getaffinity(0))
            groups = [cpus[i :: args.tp] for i in range(args.tp)]
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, g)) for g in groups))
        parallel = {"tensor_parallel_size": args.tp, "distributed_executor_backend": "mp"} if args.tp > 1 else {}
        caching: dict[str, Any] = {"enable_prefix_caching": False}
        if args.mode != "off":
            caching = {"enable_prefix_caching": True, "mamba_cache_mode": "align"}
        model: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "block_size": args.block_size}
        if args.model == "qwen3-next":
            # The CPU build's gated delta net needs bf16; vLLM sizes a hybrid model's blocks itself.
            model = {"dtype": "bfloat16", "max_model_len": 1024}
        if args.spec:
            model["speculative_config"] = {
                "method": "ngram", "num_speculative_tokens": args.spec, "prompt_lookup_max": 3, "prompt_lookup_min": 2,
            }  # fmt: skip
        llm = LLM(
            model=str(args.model_dir), enforce_eager=True, seed=0, disable_log_stats=not args.measure,
            max_num_seqs=4, enable_chunked_prefill=True, max_num_batched_tokens=args.batch_tokens,
            num_gpu_blocks_override=args.blocks, **model, **caching, **parallel,
        )  # fmt: skip
        report["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
        if args.measure:
            report |= measure(llm, args)
            if plugin_active():
                rank = llm.collective_rpc("mambacache_stats")[0]
                report["plugin_pools"] = {"shapes": rank["pools"], "layer_groups": rank["layer_groups"]}
            report["plugin_host_per_step"] = quantiles(per_step)
            # Without the stages' own run: what is left is the plugin's and the manager's host work.
            report["plugin_host_per_step_without_stages"] = quantiles(
                [p - s for p, s in zip(per_step, stages, strict=True)]
            )
            report["execute_model_per_step"] = quantiles(executes)
        else:
            report |= shared_prefixes(llm, args)
    except Exception as e:  # the failure is the finding: record it exactly
        import traceback

        tb = traceback.extract_tb(e.__traceback__)
        report["error"] = f"{type(e).__name__}: {e}"
        report["where"] = [f"{Path(f.filename).name}:{f.lineno} {f.name}: {f.line}" for f in tb[-3:]]
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report))


def run(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    drop = ("VLLM_PLUGINS", "MAMBACACHE_TRACE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if mode == "plugin":
        env["VLLM_PLUGINS"] = "mambacache"
        if args.trace is not None:
            env["MAMBACACHE_TRACE"] = str(args.trace)
    cmd = [sys.executable, __file__, "--worker", f"--mode={mode}", "--model-dir", str(args.model_dir)]
    names = ("systems", "per_system", "system_tokens", "new_tokens", "seed", "blocks", "block_size", "spec", "model")
    for name in names:
        cmd.append(f"--{name.replace('_', '-')}={getattr(args, name)}")
    cmd += [f"--batch-tokens={args.batch_tokens}", f"--rounds={args.rounds}", f"--tp={args.tp}"] + (
        ["--measure"] if args.measure else []
    )
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    # vLLM's worker processes may log to stdout after the report: take the report's line.
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"mode"')]
    if done.returncode != 0 or not lines:
        return {"mode": mode, "error": f"exit {done.returncode}", "stderr": done.stderr[-3000:]}
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", type=int, default=3)
    p.add_argument("--per-system", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=70)
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks", type=int, default=40, help="vLLM KV cache blocks (the null block is one)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=32, help="max_num_batched_tokens (chunked prefill)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--trace", type=Path, default=None, help="write the plugin run's slot trace here and analyse it")
    p.add_argument("--measure", action="store_true", help="time to first token, hit and miss waves alternated")
    p.add_argument("--rounds", type=int, default=6, help="with --measure: rounds of one hit and one miss wave")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (workers in processes of their own)")
    p.add_argument("--spec", type=int, default=0, help="ngram speculative decoding with this many draft tokens")
    p.add_argument("--model", choices=["mamba2", "qwen3-next"], default="mamba2")
    p.add_argument(
        "--linear-layers",
        type=int,
        default=None,
        help="with --model qwen3-next: this many linear-attention layers, 3 to each full-attention one",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, default="off", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.linear_layers is not None and (args.model != "qwen3-next" or args.linear_layers < 1):
        p.error("--linear-layers needs --model qwen3-next and at least 1")
    if args.trace is not None and args.tp > 1:
        p.error("--trace with --tp: every rank would append to the same file")
    if args.worker:
        worker(args)
        return 0
    if importlib.util.find_spec("vllm") is None:
        sys.stderr.write(
            "vllm_prefix_cpu.py needs vLLM's CPU build: make the README's .venv-vllm (pip install -e '.[vllm]')"
            " and run this with its python\n"
        )
        return 2
    if args.trace is not None:
        args.trace.unlink(missing_ok=True)  # the tracer appends
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir is None:
            layers = "" if args.linear_layers is None else f"-{args.linear_layers}"
            args.model_dir = Path(tmp) / f"{args.model}{layers}-tiny"
        if not (args.model_dir / "config.json").exists():
            build_model(args.model_dir, args.model, args.linear_layers)
        runs = {m: run(args, m) for m in args.modes.split(",")}
        if args.measure:
            print(json.dumps(runs, indent=None if args.json else 1))
            return 0 if all("error" not in r for r in runs.values()) else 1
        reqs = workload(args.systems, args.per_system, args.system_tokens, args.seed, args.model == "qwen3-next")
        reference = transformers_greedy(args.model_dir, reqs, args.new_tokens)
    n = len(reqs)
    result: dict[str, Any] = {"requests": n, "runs": {}}
    for m, r in runs.items():
        keys = ("error", "where", "stderr", "cached", "plugin", "ranks", "seconds", "block_size")
        row = {k: r[k] for k in keys if k in r}
        if "tokens" in r:
            row["matches_transformers"] = sum(a == b for a, b in zip(r["tokens"], reference, strict=True))
            if "tokens" in runs.get("off", {}):
                row["matches_off"] = sum(a == b for a, b in zip(r["tokens"], runs["off"]["tokens"], strict=True))
        result["runs"][m] = row
    plug = result["runs"].get("plugin", {})
    exact = plug.get("matches_transformers") == n and plug.get("matches_off", n) == n
    hits = sum(plug.get("cached", [])) > 0
    ok = exact and hits
    if args.trace is not None and "plugin" in runs:
        from mambacache import tracing

        analysis = tracing.analyze(args.trace, expect_idle=True)
        keys = ("allocs", "forks", "releases", "requests", "held_at_end", "anomalies")
        result["trace"] = {k: analysis.summary.get(k) for k in keys}
        result["trace"]["kinds"] = sorted({a.kind for a in analysis.anomalies})
        ok = ok and not analysis.anomalies
    result["ok"] = ok
    print(json.dumps(result) if args.json else summary(result))
    return 0 if ok else 1


def summary(result: dict[str, Any]) -> str:
    """The result as one line per run (``--json`` prints all of it)."""
    n, lines = result["requests"], []
    for mode, r in result["runs"].items():
        if "error" in r:
            lines.append(f"{mode:>12}: {r['error']}" + (f"  at {r['where'][-1]}" if "where" in r else ""))
            continue
        cached = r.get("cached", [])
        hit = sum(c > 0 for c in cached)
        line = f"{mode:>12}: {r.get('matches_transformers')}/{n} = transformers"
        if "matches_off" in r:
            line += f", {r['matches_off']}/{n} = caching off"
        line += f", {hit}/{n} requests hit ({sum(cached)} cached tokens)"
        if r.get("plugin"):
            figures = ("allocs", "copies", "shifted", "hits", "kept", "reclaimed")
            line += "; plugin " + " ".join(f"{k}={r['plugin'][k]}" for k in figures if r["plugin"].get(k))
        lines.append(line)
    if "trace" in result:
        t = result["trace"]
        lines.append(f"{'trace':>12}: {t['anomalies']} anomalies, {t['held_at_end']} held at end, {t['forks']} forks")
    lines.append(f"{'ok':>12}: {result['ok']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
