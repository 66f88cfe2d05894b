"""The benchmark runs and emits valid JSON (figures are for docs/benchmarks.md, not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mambacache import CacheManager
from mambacache._cli import main


@pytest.mark.slow
def test_bench_quick_emits_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--quick", "--sizes", "1,8", "--repeats", "2", "--json", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    captured = capsys.readouterr()
    text = captured.out
    assert "bench: small done" in captured.err  # progress off a terminal (capsys is none)
    assert text.endswith(f"JSON: {out}\nplot: {png}\n")
    assert "x bound" in text and "host overhead" in text and "tracing off" in text
    data = json.loads(out.read_text())
    assert {"machine", "results", "host_overhead", "tracing_overhead", "host_tier_overhead"} <= set(data)
    assert 0 < data["host_tier_overhead"]["offload_release_us_per_slot"] < 1000
    paths = {(r["op"], r["path"]) for r in data["results"]}
    for op, bound in (("clear", "memset"), ("copy", "memcpy"), ("offload", "memcpy"), ("restore", "memcpy")):
        assert {(op, p) for p in (bound, "sglang", "torch", "torch-direct", "npu", "reference")} <= paths
    for r in data["results"]:
        assert r["median_s"] > 0 and r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["bytes"] == r["slots"] * data["results"][0]["bytes"] // data["results"][0]["slots"]
        if r["path"] == "npu":
            assert r["noncontiguous_input_bytes"] == 0  # the NPU-relevant figure
        if r["path"] == "sglang" and r["op"] == "clear":
            assert r["noncontiguous_input_bytes"] == r["bytes"]  # the expanded zeros, in full
        if r["host_syncs"] is not None:
            assert r["host_syncs"] == 0
        assert r["ops"] >= 1 and r["peak_temp_bytes"] is not None  # every path audited
        if r["path"] == "torch-direct" and r["op"] in ("clear", "copy", "commit"):
            # As a flush runs them: a zero or copy stage is one foreach op over both pool tensors' rows, a
            # commit one per pool tensor; no temporary.
            assert r["ops"] == (2 if r["op"] == "commit" else 1) and r["peak_temp_bytes"] == 0
        if r["op"] in ("offload", "restore") and r["path"] not in ("memcpy", "sglang"):
            # Per run of slots (random slots: runs of one) and pool tensor, one copy (npu: one per layer), no
            # temporary; a slice or two and a copy each.
            assert r["peak_temp_bytes"] == 0 and r["ops"] <= 10 * r["slots"] * r["layers"], r  # 2 tensors
    assert [h["events_per_flush"] for h in data["host_overhead"]] == [10, 100, 1000]
    assert [p["events"] for p in data["planner_scaling"]] == [10, 100, 1000, 10000]
    assert all(p["swap_us_per_event"] > 0 and p["swap+refill_us_per_event"] > 0 for p in data["planner_scaling"])
    assert "planner alone" in text
    assert "decode flush" in text and data["decode_flush"]["ratio"] > 0  # the step against its one op
    assert [b["n"] for b in data["bulk_vs_loop"]] == [1, 64, 1000] and "bulk forms vs single calls" in text
    for b in data["bulk_vs_loop"]:
        assert all(b[f"{k}_{f}_us"] > 0 for k in ("commit", "offload", "restore") for f in ("loop", "bulk"))
        assert b["offload_ratio"] == b["offload_loop_us"] / b["offload_bulk_us"]


def test_sharded_presets_divide_heads_and_channels_as_engines_do() -> None:
    from mambacache.bench._presets import PRESETS, lookup, shard

    full, tp8 = PRESETS["qwen3-next-80b-a3b"].spec, lookup("qwen3-next-80b-a3b-tp8").spec
    assert tp8.conv_shapes == ((full.conv_shapes[0][0] // 8, 4),)
    assert tp8.temporal_shape == (full.temporal_shape[0] // 8, 128, 128)
    # Mamba2: one group, replicated on every rank (inner / tp + 2 * N conv channels).
    assert lookup("mamba2-2.7b-tp8").spec.conv_shapes == ((5120 // 8 + 2 * 128, 4),)
    assert lookup("nemotron-h-8b-tp8").spec.temporal_shape == (16, 64, 128)
    assert shard("small", 8).name == "small-tp8"
    with pytest.raises(ValueError, match="not divisible"):
        shard("qwen3-next-80b-a3b", 3)


@pytest.mark.slow
def test_bench_quick_tp8(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quick", "--tp", "8", "--sizes", "1,4", "--repeats", "1", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["preset"] for r in data["results"]} == {"small-tp8"}
    assert main(["bench", "--quick", "--tp", "3"]) == 2
    assert "not divisible" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_transfer_row(capsys: pytest.CaptureFixture[str]) -> None:
    """Two gloo processes; the bench itself fails if the first transfer of a size delivered other bytes."""
    from mambacache.bench._presets import lookup

    assert main(["bench", "--transfer", "--quick", "--sizes", "1,3", "--repeats", "2", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["transfer"]
    assert [(r["preset"], r["slots"]) for r in rows] == [("small", 1), ("small", 3)]
    for r in rows:
        assert r["bytes"] == r["slots"] * lookup("small").spec.slot_bytes and r["rounds"] == 2
        for path in ("transfer", "send"):
            assert 0 < r[f"{path}_min_ms"] <= r[f"{path}_ms"]
        assert r["ratio"] == r["transfer_ms"] / r["send_ms"]
        assert all(r[f"{part}_ms"] > 0 for part in ("stage", "wire", "land"))
        tags = ("", "in_place_", "in_place_spread_", "staged_awaiting_")
        assert all(r[f"{tag}ratio_paired"] > 0 for tag in tags)  # per round


def test_bench_contended_prints_quiet_and_contended_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--contended", "--quick", "--sizes", "2", "--repeats", "1", "--json", "-"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["contended"]
    assert {(r["op"], r["path"]) for r in rows} == {
        (op, p)
        for op, bound in (("clear", "memset"), ("copy", "memcpy"), ("offload", "memcpy"), ("restore", "memcpy"))
        for p in (bound, "sglang", "torch")
    }
    for r in rows:
        assert r["quiet_ms"] > 0 and r["contended_ms"] > 0 and r["quiet_x_bound"] > 0 and r["contended_x_sglang"] > 0


def test_the_competing_process_is_killed_even_on_interrupt() -> None:
    from mambacache.bench._contend import competing_process

    with pytest.raises(KeyboardInterrupt), competing_process(seconds=120) as proc:
        assert proc.poll() is None  # computing
        raise KeyboardInterrupt
    assert proc.poll() is not None  # gone, not left computing for two minutes


def test_the_decode_flush_ratio_is_measured() -> None:
    from mambacache.bench._decode import decode_flush

    d = decode_flush(1, steps=50)
    assert d["flush_us"] > 0 and d["op_us"] > 0 and d["ratio"] == d["flush_us"] / d["op_us"]
    assert d["floor_us"] > 0 and d["floor_ratio"] == d["floor_us"] / d["op_us"]


@pytest.mark.anyio
async def test_the_decode_floor_does_the_steps_work() -> None:
    """The floor leaves a pool exactly as the manager does: same slots, same bytes, step after step."""
    from mambacache.bench._decode import BareManager, decode_pool

    real_pool, low_pool = decode_pool(), decode_pool()
    gen = torch.Generator().manual_seed(3)
    for a, b in zip(real_pool.exec_tensors, low_pool.exec_tensors, strict=True):
        a.copy_(torch.randn(a.shape, generator=gen))
        b.copy_(a)
    low = BareManager(low_pool)
    async with CacheManager(real_pool) as mgr:
        prefixes, low_prefixes = mgr.alloc(2), low.alloc(2)
        running, low_running = mgr.alloc(6), low.alloc(6)
        await mgr.flush()
        await low.flush()
        for step in range(30):
            k = 1 + step % 3  # releases, allocs and forks of one or more slots, a prefix each
            mgr.release_many(running[:k])
            low.release_many(low_running[:k])
            new, low_new = mgr.alloc(k + 1), low.alloc(k + 1)
            assert new == low_new  # the same free-list order
            for i in range(k):
                mgr.copy_on_write(prefixes[i % 2], new[i])
                low.copy_on_write(low_prefixes[i % 2], low_new[i])
            await mgr.flush()  # new[-1] is cleared, the others forked
            await low.flush()
            for a, b in zip(real_pool.exec_tensors, low_pool.exec_tensors, strict=True):
                assert torch.equal(a, b), step
            running, low_running = running[k:] + new, low_running[k:] + low_new


@pytest.mark.slow
def test_bench_layers_row(capsys: pytest.CaptureFixture[str]) -> None:
    """The per-layer row: every layout timed, each against the stacked pool of the same layers."""
    assert main(["bench", "--layers", "--repeats", "1", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)["layer_overhead"]
    assert [(r["layout"], r["layer_groups"]) for r in rows[:4]] == [
        ("stacked", 1), ("layers-strided", 1), ("layers-apart", 36), ("managers", 36)
    ]  # fmt: skip
    assert {r["state"] for r in rows} == {"tiny", "qwen3-next-80b-a3b-tp8"} and len(rows) == 8
    for r in rows:
        assert 0 < r["min_us"] <= r["step_us"] and r["layers"] == 36
        assert r["ratio"] == 1.0 if r["layout"] == "stacked" else r["ratio"] > 0
        assert r["op_us"] > 0
    assert main(["bench", "--layers", "--repeats", "1"]) == 0
    assert "op vs stacked" in capsys.readouterr().out


def test_bench_layers_floor_is_the_forks_copy() -> None:
    """The per-layer row's floor moves what the step's fork moves: slot 1's rows into slot 2, in every pool
    tensor and layer group of each layout, and nothing else."""
    from mambacache.bench._layers import TINY, _bare_op, _pools

    for layout, pools in _pools(TINY, 6).items():
        for p in pools:
            for t in p.exec_tensors:
                t.copy_(torch.randint(0, 100, t.shape, dtype=t.dtype))
        before = [t.clone() for p in pools for t in p.exec_tensors]
        _bare_op(pools)()
        after = [t for p in pools for t in p.exec_tensors]
        assert len(after) == (72 if layout in ("layers-apart", "managers") else 2)
        for b, a in zip(before, after, strict=True):
            assert torch.equal(a[:, 2], b[:, 1]), layout
            b[:, 2] = b[:, 1]
            assert torch.equal(a, b), layout
