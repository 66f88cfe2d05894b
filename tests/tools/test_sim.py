"""The simulator on the toy model and on real transformers models."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import anyio
import pytest
import torch

import mambacache as mc
from mambacache._cli import main
from mambacache._core._planner import HostStage, Stage
from mambacache._executors._torch import TorchExecutor
from mambacache.hf import cache_keyword
from mambacache.sim import SimConfig, build_model, simulate

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)


def run(**kw: object) -> mc.sim.SimReport:
    return anyio.run(simulate, SimConfig(**kw))  # type: ignore[arg-type]


def test_toy_is_lossless_and_reuses_slots() -> None:
    r = run(model="toy", requests=40)
    assert (r.completed, r.mismatches) == (40, 0)
    assert r.prefix_hits > 0 and r.forks == r.prefix_hits and r.checkpoints > r.prefix_hits
    assert r.tokens_saved >= 4 * r.prefix_hits  # block-aligned hits of at least one block
    assert r.evictions > 0  # slots are reused dirty
    assert r.peak_slots_in_use == r.num_slots
    assert 0 < r.manager_overhead_fraction < 1


@pytest.mark.parametrize("fault", ["skip-clear", "skip-fork"])
def test_faults_are_caught(fault: str) -> None:
    assert run(model="toy", requests=40, fault=fault).mismatches > 0


@pytest.mark.parametrize("model", ["mamba2", "qwen3-next"])
def test_real_models_lossless_and_fault_caught(model: str) -> None:
    m = build_model(model)
    good = anyio.run(simulate, SimConfig(model=model, requests=16), m)
    assert (good.completed, good.mismatches) == (16, 0)
    assert good.prefix_hits > 0
    bad = anyio.run(simulate, SimConfig(model=model, requests=16, fault="skip-clear"), m)
    assert bad.mismatches > 0


@pytest.mark.parametrize("model", ["mamba2", "qwen3-next"])
def test_prefix_swap_recompute_and_host_tier_scenarios_are_lossless(model: str) -> None:
    from mambacache.sim import SCENARIOS

    m = build_model(model)
    reports = {
        name: anyio.run(simulate, SimConfig(model=model, requests=16, **overrides), m)
        for name, overrides in SCENARIOS.items()
        if name != "reserved"  # scheduling only, no model path of its own: on the toy model below, to keep this fast
    }
    for name, r in reports.items():
        assert (r.completed, r.mismatches) == (16, 0), name
    assert reports["prefix"].prefix_hits > 0 and reports["prefix"].tokens_saved > 0
    swap = reports["swap"]
    assert swap.swaps > 0 and swap.host_offloads >= swap.swaps and swap.host_restores >= swap.swaps
    assert reports["recompute"].recomputes > 0 and reports["recompute"].recomputed_tokens > 0
    tier = reports["host-tier"]
    assert tier.host_offloads > 0 and tier.host_restores > 0  # evicted checkpoints came back from the host
    bad = anyio.run(simulate, SimConfig(model=model, requests=16, fault="skip-restore", **SCENARIOS["swap"]), m)
    assert bad.mismatches > 0


@pytest.mark.parametrize("model", ["toy", "mamba2", "qwen3-next"])
def test_speculative_decoding_is_lossless_and_a_wrong_commit_is_caught(model: str) -> None:
    m = build_model(model)
    good = anyio.run(simulate, SimConfig(model=model, requests=16, speculative=3), m)
    assert (good.completed, good.mismatches) == (16, 0)
    assert 0 < good.drafts_accepted < good.drafts_proposed  # some drafts accepted, some rejected
    assert good.commits > 0 and good.prefix_hits > 0
    bad = anyio.run(simulate, SimConfig(model=model, requests=16, speculative=3, fault="wrong-commit"), m)
    assert bad.mismatches > 0


def test_speculative_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "toy", "--requests", "8", "--speculative", "2"]) == 0
    out = capsys.readouterr().out
    assert "speculative 2 draft tokens" in out and "accepted" in out
    assert main(["simulate", "--model", "toy", "--requests", "8", "--speculative", "2", "--fault", "wrong-commit"]) == 0
    assert main(["simulate", "--model", "toy", "--fault", "wrong-commit"]) == 2


class ForgetsScales(TorchExecutor):
    """Runs every stage on the states only: the 2-d pool tensors (the toy's per-slot scales) stay behind."""

    name = "forgets-scales"

    def execute_stage(self, stage: Stage, tensors: list[torch.Tensor]) -> bool:
        states = [t for t in tensors if t.ndim > 2]
        return not states or super().execute_stage(stage, states)

    def execute(self, stage: Stage, tensor: torch.Tensor, draft: torch.Tensor | None = None) -> None:
        if tensor.ndim > 2:
            super().execute(stage, tensor, draft)

    def execute_host(self, stage: HostStage, tensor: torch.Tensor, host: torch.Tensor) -> None:
        if tensor.ndim > 2:
            super().execute_host(stage, tensor, host)


@pytest.mark.parametrize("state_dtype", ["int8", "fp8"])
def test_quantised_toy_states_with_per_slot_scales_stay_exact(state_dtype: str) -> None:
    """The toy model storing its states as int8 / fp8 with a float scale per slot and layer (extra pool tensors):
    clears, forks, swaps, host checkpoints and speculative commits leave every request exactly as its isolated
    run of the same quantised model; a skipped clear, or an executor that leaves the scales behind, is caught."""
    from mambacache.sim import SCENARIOS

    m = build_model("toy", state_dtype=state_dtype)
    assert m.spec.extra_shapes == {"conv_scale": ((), torch.float32), "state_scale": ((), torch.float32)}
    assert m.spec.temporal_dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[state_dtype]
    runs = {
        "prefix": {},
        "swap": SCENARIOS["swap"],
        "host-tier": SCENARIOS["host-tier"],
        "speculative": {"speculative": 3},
    }
    for name, overrides in runs.items():
        r = anyio.run(simulate, SimConfig(model="toy", requests=24, state_dtype=state_dtype, **overrides), m)
        assert (r.completed, r.mismatches, r.state_dtype) == (24, 0, state_dtype), name
    assert r.commits > 0
    bad = anyio.run(simulate, SimConfig(model="toy", requests=24, state_dtype=state_dtype, fault="skip-clear"), m)
    assert bad.mismatches > 0
    for overrides in ({}, SCENARIOS["swap"]):
        cfg = SimConfig(model="toy", requests=24, state_dtype=state_dtype, executor=ForgetsScales(), **overrides)  # type: ignore[arg-type]
        assert anyio.run(simulate, cfg, m).mismatches > 0


def test_state_dtype_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert main(["simulate", "--state-dtype", "int8", "--requests", "12", "--json", str(out)]) == 0  # toy alone
    assert "int8 states with per-slot scales" in capsys.readouterr().out
    (report,) = json.loads(out.read_text())
    assert (report["model"], report["state_dtype"], report["mismatches"]) == ("toy", "int8", 0)
    assert main(["simulate", "--state-dtype", "fp8", "--requests", "12", "--fault", "skip-clear"]) == 0  # caught
    assert main(["simulate", "--state-dtype", "fp8", "--model", "mamba2"]) == 2
    assert "for the toy model" in capsys.readouterr().err
    with pytest.raises(ValueError, match="toy model"):
        build_model("qwen3-next", state_dtype="int8")
    with pytest.raises(ValueError, match="unknown state dtype"):
        build_model("toy", state_dtype="int4")


def test_simulate_cli_json_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, trace = tmp_path / "r.json", tmp_path / "t.jsonl"
    assert main(["simulate", "--model", "toy", "--requests", "12", "--json", str(out), "--trace", str(trace)]) == 0
    text = capsys.readouterr().out
    assert "mismatch" in text and "toy" in text
    (report,) = json.loads(out.read_text())
    assert {"requests", "completed", "mismatches", "forks", "clears", "clears_elided", "peak_slots_in_use",
            "steps", "tokens_per_s", "manager_overhead_fraction"} <= set(report)  # fmt: skip
    assert report["mismatches"] == 0
    assert main(["trace", str(trace)]) == 0  # a clean run's trace has no anomaly
    assert main(["simulate", "--model", "toy", "--requests", "12", "--fault", "skip-clear"]) == 0  # found them
    assert main(["trace", str(trace), "--json", "-"]) == 0


def _cache_shapes(model: object, config: object) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True, **{cache_keyword(model): cache})  # type: ignore[operator]
    convs, temporals = [], []
    for layer in cache.layers:
        conv = getattr(layer, "conv_states", {}).get(0)
        if conv is not None:
            convs.append(tuple(conv.shape[1:]))
            temporals.append(tuple(layer.recurrent_states[0].shape[1:]))
    return convs, temporals


def _tiny(kind: str) -> tuple[object, object]:
    t = transformers
    common = {"vocab_size": 64, "hidden_size": 32, "pad_token_id": 0, "eos_token_id": None}
    if kind == "mamba2":
        cfg = t.Mamba2Config(state_size=8, num_heads=4, head_dim=16, n_groups=2, expand=2, conv_kernel=3,
                             num_hidden_layers=3, chunk_size=8, **common)  # fmt: skip
        return t.Mamba2ForCausalLM(cfg), cfg
    if kind == "qwen3_next":
        cfg = t.Qwen3NextConfig(intermediate_size=32, moe_intermediate_size=16, num_experts=2, num_experts_per_tok=1,
                                shared_expert_intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=3, linear_key_head_dim=8,
                                linear_value_head_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
                                full_attention_interval=3, **common)  # fmt: skip
        return t.Qwen3NextForCausalLM(cfg), cfg
    if kind == "qwen3_5":
        cfg = t.Qwen3_5TextConfig(intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                                  linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
                                  **common)  # fmt: skip
        return t.Qwen3_5ForCausalLM(cfg), cfg
    if kind == "falcon_h1":
        cfg = t.FalconH1Config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                               intermediate_size=32, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                               mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
                               **common)  # fmt: skip
        return t.FalconH1ForCausalLM(cfg), cfg
    if kind == "jamba":
        cfg = t.JambaConfig(num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, attn_layer_period=2,
                            attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                            **common)  # fmt: skip
        return t.JambaForCausalLM(cfg), cfg
    cfg = t.NemotronHConfig(layers_block_type=["mamba", "attention", "mamba", "mlp"], mamba_num_heads=4,
                            mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4, expand=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32,
                            **common)  # fmt: skip
    return t.NemotronHForCausalLM(cfg), cfg


@pytest.mark.parametrize("kind", ["mamba2", "qwen3_next", "qwen3_5", "nemotron_h", "falcon_h1", "jamba"])
def test_spec_from_hf_config_matches_the_models_cache(kind: str) -> None:
    try:
        model, config = _tiny(kind)
    except (AttributeError, TypeError, ValueError) as exc:  # a transformers without this model or field
        pytest.skip(f"{kind}: {exc}")
    spec = mc.StateSpec.from_hf_config(config)
    convs, temporals = _cache_shapes(model.eval(), config)  # type: ignore[attr-defined]
    assert len(convs) == spec.num_layers
    assert set(convs) == {spec.conv_shapes[0]}
    assert set(temporals) == {spec.temporal_shape}


def test_spec_from_unsupported_config() -> None:
    with pytest.raises(mc.InvalidArgumentError, match="unsupported"):
        mc.StateSpec.from_hf_config(transformers.LlamaConfig())


def test_spec_from_hf_config_takes_the_configs_dtypes() -> None:
    _, config = _tiny("mamba2")
    assert mc.StateSpec.from_hf_config(config).temporal_dtype == torch.float32  # no dtype in the config: defaults
    config.dtype = torch.bfloat16  # type: ignore[attr-defined]
    spec = mc.StateSpec.from_hf_config(config)
    assert (spec.conv_dtype, spec.temporal_dtype) == (torch.bfloat16, torch.bfloat16)  # the model's dtype for both
    config.mamba_ssm_dtype = "float32"  # type: ignore[attr-defined]
    spec = mc.StateSpec.from_hf_config(config)
    assert (spec.conv_dtype, spec.temporal_dtype) == (torch.bfloat16, torch.float32)  # the SSM state's own dtype
    assert mc.StateSpec.from_hf_config(config, temporal_dtype=torch.float16).temporal_dtype == torch.float16
    config.mamba_ssm_dtype = "int4x"  # type: ignore[attr-defined]
    with pytest.raises(mc.InvalidArgumentError, match="not a torch dtype"):
        mc.StateSpec.from_hf_config(config)


def test_bind_cache_runs_a_transformers_model_on_a_pool_slot_in_place() -> None:
    from mambacache.hf import bind_cache, spec_from_config

    model, config = _tiny("mamba2")
    model.eval()  # type: ignore[attr-defined]
    spec = spec_from_config(config, conv_dtype=torch.float32, temporal_dtype=torch.float32)
    pool = mc.StatePool(spec, 4)
    ids = torch.tensor([[5, 6, 7, 8]])
    with mc.CacheManager(pool) as mgr:
        (slot,) = mgr.alloc(1, request_id="r")
        mgr.flush_nowait()
        cache = transformers.DynamicCache(config=config)
        bind_cache(cache, pool, slot, config)
        with torch.no_grad():
            bound = model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache}).logits  # type: ignore[operator]
            plain = model(input_ids=ids, use_cache=False).logits  # type: ignore[operator]
        assert torch.allclose(bound, plain, atol=1e-5)
        assert pool.temporal[:, slot].abs().sum() > 0 and pool.temporal[:, 0].abs().sum() == 0  # written in place
        other = transformers.DynamicCache(config=config)
        with pytest.raises(mc.InvalidSlotError):
            bind_cache(other, pool, 0, config)
        with pytest.raises(mc.InvalidArgumentError, match="linear-attention layers"):
            bind_cache(
                other, mc.StatePool(mc.StateSpec(num_layers=1, conv_shapes=[(4, 3)], temporal_shape=(2,)), 2), 1, config
            )


def test_a_reservation_keeps_checkpoints_under_request_pressure() -> None:
    """The reserved scenario with and without its reservation: both exact; without it, admission evicts
    checkpoints to make room, with it a request never takes the 2 reserved slots and runners are swapped out."""
    from mambacache.sim import SCENARIOS

    m = build_model("toy")
    kept = anyio.run(simulate, SimConfig(model="toy", **SCENARIOS["reserved"]), m)
    plain = anyio.run(simulate, SimConfig(model="toy", **{**SCENARIOS["reserved"], "reserved": 0}), m)
    assert (kept.mismatches, plain.mismatches, kept.completed, plain.completed) == (0, 0, 32, 32)
    assert kept.checkpoints_kept >= 2 > plain.checkpoints_kept  # once 2 were held, never fewer at a step's end
    assert kept.swaps > 0 and kept.evicted_for_requests < plain.evicted_for_requests
    assert plain.peak_slots_in_use == kept.peak_slots_in_use == 7  # the pool was full in both


def test_reserved_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "toy", "--requests", "12", "--scenario", "reserved"]) == 0
    assert "2 slots reserved for checkpoints" in capsys.readouterr().out
    assert main(["simulate", "--model", "toy", "--requests", "12", "--scenario", "reserved", "--reserved", "4"]) == 2
    assert "reserved (4) must be in 0..min(max_checkpoints, slots - 1) = 0..3" in capsys.readouterr().err
    assert main(["simulate", "--model", "toy", "--slots", "8", "--max-running", "6", "--reserved", "3"]) == 2


@pytest.mark.parametrize("scenario", ["swap", "host-tier", "reserved"])
def test_the_trace_of_a_host_tier_run_is_clean_and_idle(scenario: str, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    args = ["simulate", "--model", "toy", "--requests", "24", "--scenario", scenario, "--trace", str(trace)]
    assert main(args) == 0
    assert main(["trace", str(trace), "--expect-idle"]) == 0  # every slot and host slot given back, no anomaly
    summary = mc.tracing.analyze(trace, expect_idle=True).summary
    assert summary["offloads"] > 0 and summary["restores"] > 0 and summary["host_held_at_end"] == 0


def test_junction_checkpoints_hit_a_system_prompt_off_the_block_grid() -> None:
    """Issue #21: system prompts of 8 tokens. With blocks of 16 the grid has no checkpoint inside them (vllm#40696:
    no hit at all); with blocks of 3 its deepest one is at 6. Checkpoints at the junction hit at 8, losslessly."""
    reports = {
        (block, policy): run(model="toy", requests=32, block_size=block, checkpoint=policy)
        for block in (16, 3)
        for policy in ("grid", "junction")
    }
    for report in reports.values():
        assert (report.completed, report.mismatches) == (32, 0)
    grid, junction = reports[16, "grid"], reports[16, "junction"]
    assert grid.prefix_hits == 0 and junction.prefix_hits > 0 and junction.tokens_saved >= 8 * junction.prefix_hits
    grid, junction = reports[3, "grid"], reports[3, "junction"]
    assert grid.prefix_hits > 0 and grid.tokens_saved < junction.tokens_saved


def test_adapters_key_the_prefix_cache_and_ignoring_the_key_is_caught() -> None:
    """Requests under another adapter compute other states from equal ids: keyed, no fork crosses adapters and every
    output matches; with the key ignored, forks cross adapters and outputs go wrong."""
    good = run(model="toy", requests=40, adapters=2)
    assert (good.completed, good.mismatches, good.cross_key_hits) == (40, 0, 0) and good.prefix_hits > 0
    bad = run(model="toy", requests=40, adapters=2, fault="ignore-key")
    assert bad.cross_key_hits > 0 and bad.mismatches > 0
    with pytest.raises(ValueError, match="ignore-key fault needs adapters"):
        run(model="toy", fault="ignore-key")
    with pytest.raises(ValueError, match="unknown checkpoint policy"):
        run(model="toy", checkpoint="everywhere")


@pytest.mark.parametrize("model", ["mamba2", "qwen3-next"])
def test_real_models_junction_checkpoints_under_adapters_are_lossless(model: str) -> None:
    r = anyio.run(
        simulate,
        SimConfig(model=model, requests=16, block_size=16, checkpoint="junction", adapters=2),
        build_model(model),
    )
    assert (r.completed, r.mismatches, r.cross_key_hits) == (16, 0, 0) and r.prefix_hits > 0


def test_checkpoint_and_adapter_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    args = ["simulate", "--model", "toy", "--requests", "16", "--block-size", "16", "--checkpoint", "junction"]
    assert main([*args, "--adapters", "2", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "checkpoints at the junction, 2 adapters" in out and "x-key hits" in out
    assert main(["trace", str(trace), "--expect-idle"]) == 0
    keys = {json.loads(line).get("key") for line in trace.read_text().splitlines()}
    assert keys == {None, 1, 2}  # the adapters' notes carry their key; the base model's carry none
    assert main(["simulate", "--model", "toy", "--requests", "40", "--adapters", "2", "--fault", "ignore-key"]) == 0
    assert main(["simulate", "--model", "toy", "--fault", "ignore-key"]) == 2
