"""Re-slicing states between tensor-parallel sizes, and ``simulate --scenario pd`` (issue #20)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mambacache as mc
from mambacache._cli import main
from mambacache._handoff._reslice import StateLayout
from mambacache.bench._presets import _shard_config
from mambacache.sim._models import build_model
from mambacache.sim._pd import PdConfig, simulate_pd

from ..support.reslice import FakeTransfer, layouts, mamba2, qwen, random_state


@given(st.sampled_from([1, 2, 4]).flatmap(lambda tp: st.tuples(st.just(tp), layouts(tp))), st.integers(0, 2**16))
def test_slicing_a_state_and_gathering_the_shards_is_the_identity(case: tuple[int, StateLayout], seed: int) -> None:
    tp, layout = case
    full = random_state(layout.spec, 3, seed)
    if layout.spec.extra_shapes:  # a scalar extra replicated: every rank holds the same one
        full[-1].fill_(0.5)
    shards = [layout.slice(full, tp, rank) for rank in range(tp)]
    want = [(layout.spec.num_layers, 3, *s) for s, _ in layout.shard_spec(tp).shapes()]
    assert all([tuple(t.shape) for t in shard] == want for shard in shards)
    back = layout.gather(shards)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(back, full, strict=True))
    if tp > 1:  # the split parts really are split: a rank alone holds less than the whole
        assert sum(t.numel() for t in shards[0]) < sum(t.numel() for t in full)


@given(
    st.sampled_from([1, 2, 4]),
    st.one_of(
        st.builds(lambda h, d, g, n: ("m", h, d, g, n), st.integers(1, 3), st.sampled_from([2, 4]),
                  st.sampled_from([1, 0, 2]), st.integers(1, 5)),
        st.builds(lambda k, v, dk, dv: ("q", k, v, dk, dv), st.integers(1, 2), st.integers(1, 3),
                  st.integers(1, 4), st.integers(1, 4)),
    ),
)  # fmt: skip
def test_shard_spec_is_the_sharded_presets_rule(tp: int, case: tuple[str, int, int, int, int]) -> None:
    kind, a, b, c, d = case
    # Groups: one (replicated), tp (one per rank) or 2 * tp; heads: a multiple of tp.
    config = mamba2(a * tp, b, max(1, c * tp), d) if kind == "m" else qwen(a * tp, b * tp, c, d)
    want = mc.StateSpec.from_hf_config(_shard_config(config, tp))
    assert StateLayout.from_config(config).shard_spec(tp) == want
    for a in (k for k in (1, 2, 4) if tp % k == 0):  # re-sliced from a shard at a smaller size: the same spec
        assert StateLayout.from_config(config).shard_layout(a).shard_spec(tp // a) == want


# (prefill TP a, decode TP b): one divides the other; a = b, a -> 1 and 1 -> b among them.
PAIRS = [(1, 1), (2, 2), (2, 1), (1, 2), (4, 1), (1, 4), (4, 2), (2, 4)]


@given(
    st.sampled_from(PAIRS).flatmap(lambda ab: st.tuples(st.just(ab), layouts(max(ab)))),
    st.integers(0, 2**16),
)
def test_reslicing_between_any_two_sizes_is_the_identity(case: tuple[tuple[int, int], StateLayout], seed: int) -> None:
    (a, b), layout = case
    full = random_state(layout.spec, 2, seed)
    if layout.spec.extra_shapes:
        full[-1].fill_(0.5)
    prefill = [layout.slice(full, a, k) for k in range(a)]
    if a <= b:  # each prefill rank cuts its shard for its b / a decode ranks (ReslicingSender)
        mine = layout.shard_layout(a)
        decode = [s for shard in prefill for s in (mine.slice(shard, b // a, i) for i in range(b // a))]
    else:  # each decode rank joins the shards of its a / b prefill ranks (ReslicingReceiver)
        m, mine = a // b, layout.shard_layout(b)
        decode = [mine.gather(prefill[j * m : (j + 1) * m]) for j in range(b)]
    want = [layout.slice(full, b, j) for j in range(b)]  # what the decode ranks hold when cut from the whole
    assert len(decode) == b and all(same(got, exp) for got, exp in zip(decode, want, strict=True))
    assert same(layout.gather(decode), full)
    # A shard is a layout of its own: its shards are the shards at the larger size, spec and all.
    small, m = min(a, b), max(a, b) // min(a, b)
    assert layout.shard_layout(small).shard_spec(m) == layout.shard_spec(max(a, b))


def same(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    """Byte for byte (a NaN equals itself, -0.0 differs from 0.0), shapes included."""
    return len(xs) == len(ys) and all(
        x.shape == y.shape and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(xs, ys, strict=True)
    )


def test_replicated_group_shards_that_disagree_are_a_transfer_error() -> None:
    layout = StateLayout.from_config(mamba2(4, 4, 1, 4))  # one group: B and C replicated on both ranks
    full = random_state(layout.spec, 1, 0)
    shards = [layout.slice(full, 2, rank) for rank in range(2)]
    shards[1][0][:, :, -1] += 1  # rank 1's copy of C differs
    with pytest.raises(mc.TransferError, match="replicated segment 2"):
        layout.gather(shards)


@pytest.mark.parametrize(
    ("layout", "tp"),
    [
        (StateLayout.from_config(mamba2(4, 4, 3, 4)), 2),  # 3 groups neither divide by 2 nor replicate (vLLM)
        (StateLayout.from_config(qwen(1, 2, 4, 4)), 2),  # one key head cannot split
        (StateLayout.synthetic(mc.StateSpec(1, [(6, 2)], (3, 2))), 2),
    ],
)
def test_a_state_that_does_not_divide_is_refused(layout: StateLayout, tp: int) -> None:
    with pytest.raises(mc.InvalidArgumentError):
        layout.shard_spec(tp)
    with pytest.raises(ValueError):  # and it is a ValueError too
        layout.slice(random_state(layout.spec, 1, 0), tp, 0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ok", "kill-decode-1"])  # the first rank dead: the second is still heard
def test_tp1_to_tp2_sends_each_rank_exactly_its_shard(mode: str) -> None:
    import torch.multiprocessing as mp

    from ..support.link import free_port
    from ..workers.reslice import reslice_worker

    mp.spawn(reslice_worker, args=(free_port(), 5, mode), nprocs=3, join=True)


# -- the pd scenario: separate processes over gloo ----------------------------------------------
transformers = pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize(("model", "tp", "requests"), [("toy", 2, 6), ("mamba2", 2, 2), ("qwen3-next", 2, 5)])
def test_pd_hand_off_at_tp2_to_tp1_is_exact(model: str, tp: int, requests: int) -> None:
    r = simulate_pd(PdConfig(model=model, requests=requests, tp_prefill=tp, batch=3, timeout=20))
    assert r.error is None
    assert (r.completed, r.mismatches, r.batches) == (requests, 0, -(-requests // 3))
    assert r.bytes_sent > 0


@pytest.mark.slow
def test_pd_hand_off_at_tp1_to_tp2_is_exact() -> None:
    # Three processes: the prefill rank cuts each state in two, each decode rank imports its half, and the
    # first decode rank decodes the gathered whole.
    r = simulate_pd(PdConfig(model="toy", requests=4, tp_decode=2, batch=2, timeout=20))
    assert r.error is None
    assert (r.completed, r.mismatches, r.batches, r.tp_prefill, r.tp_decode) == (4, 0, 2, 1, 2)
    # The toy's state has no replicated part: the two halves add up to one whole state, sent once.
    assert r.bytes_sent == 4 * build_model("toy", 0, "float32").spec.memory_bytes


@pytest.mark.slow
def test_pd_skip_import_is_caught() -> None:
    r = simulate_pd(PdConfig(model="toy", requests=6, fault="skip-import"))
    assert r.error is None and r.completed == 6 and r.mismatches > 0


@pytest.mark.slow
def test_pd_a_killed_peer_is_a_transfer_error_quickly(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--scenario", "pd", "--model", "toy", "--requests", "6", "--tp-prefill", "2"]
    assert main([*args, "--fault", "kill-peer", "--transfer-timeout", "3"]) == 1
    err = capsys.readouterr().err
    # Quickly: the prefill side's own TransferError on the dead peer, not the run's deadline killing it.
    assert "TransferError" in err and "died" in err and "did not finish" not in err, err


@pytest.mark.slow
def test_pd_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pd.json"
    assert main(["simulate", "--scenario", "pd", "--model", "toy", "--requests", "4", "--json", str(out)]) == 0
    (report,) = json.loads(out.read_text())
    assert (report["model"], report["completed"], report["mismatches"], report["tp_prefill"]) == ("toy", 4, 0, 1)
    captured = capsys.readouterr()
    assert "scenario pd" in captured.out
    last = captured.err.splitlines()[-1]  # progress off a terminal: a line as each model's run ends
    assert last.startswith("simulate: 1/1 ") and last.endswith(" toy: done"), captured.err


@pytest.mark.parametrize(
    "extra",
    [
        ["--fault", "skip-import"],  # a pd fault without the pd scenario
        ["--tp-prefill", "2"],
        ["--scenario", "pd", "--fault", "skip-clear"],
        ["--scenario", "pd", "--speculative", "2"],
        ["--scenario", "pd", "--tp-prefill", "3"],  # the toy's 16 channels do not split 3 ways
        ["--tp-decode", "2"],
        ["--scenario", "pd", "--tp-decode", "3"],
        ["--scenario", "pd", "--tp-prefill", "2", "--tp-decode", "4", "--model", "qwen3-next"],  # 2 key heads
        ["--scenario", "pd", "--tp-prefill", "2", "--tp-decode", "3"],  # neither divides the other
    ],
)
def test_pd_bad_input_is_one_line_and_exit_2(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "toy", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mambacache simulate:")


@pytest.mark.parametrize("fault", ["none", "replicated-differs", "ids-differ"])
def test_reslicing_receiver_lands_whole_states_or_nothing(fault: str) -> None:
    from mambacache._handoff._reslice import ReslicingReceiver

    layout = StateLayout.from_config(mamba2(4, 4, 1, 4))
    full = random_state(layout.spec, 2, 7)
    shards = [layout.slice(full, 2, k) for k in range(2)]
    ids = [["a", "b"], ["a", "b"] if fault != "ids-differ" else ["b", "a"]]
    if fault == "replicated-differs":
        shards[1][0][:, 1, -1] += 1
    fakes = [FakeTransfer(ids[k], shards[k]) for k in range(2)]
    pool = mc.StatePool(layout.spec, 4)
    with mc.CacheManager(pool, host_pool=mc.HostPool(layout.spec, 4)) as mgr:
        receiver = ReslicingReceiver(mgr, fakes, layout)  # type: ignore[arg-type]
        if fault != "none":
            with pytest.raises(mc.TransferError):
                receiver.receive()
            assert all(f.acked == [] for f in fakes)  # no sender lets go of its slot
            assert [f.refused for f in fakes] == [[ids[0]], [ids[1]]]  # each hears at once that nothing landed
            assert mgr.host_pool is not None and mgr.host_pool.num_held == 0  # nothing landed
            with pytest.raises(mc.SlotStateError):
                mgr.import_into(1, "a")
            return
        assert receiver.receive() == ["a", "b"]
        assert all(f.acked == [["a", "b"]] for f in fakes)
        mgr.import_into(3, "a")
        mgr.import_into(1, "b")
        mgr.flush_nowait()
        for got, want in zip(pool.tensors, full, strict=True):
            assert torch.equal(got[:, 3], want[:, 0]) and torch.equal(got[:, 1], want[:, 1])
        mgr.release_many([3, 1])
        mgr.flush_nowait()
        mgr.check_idle()


def test_a_reslicing_sender_refuses_bad_input() -> None:
    from mambacache._handoff._reslice import ReslicingSender

    layout = StateLayout.from_config(mamba2(4, 4, 1, 4))
    with mc.CacheManager(mc.StatePool(layout.spec, 2), host_pool=mc.HostPool(layout.spec, 2)) as mgr:
        with pytest.raises(mc.InvalidArgumentError, match="one per shard"):
            ReslicingSender(mgr, None, [], layout)
        with pytest.raises(ValueError, match="split 3 ways"):  # 4 heads do not split 3 ways
            ReslicingSender(mgr, None, [1, 2, 3], layout)
        with pytest.raises(mc.DistributedError, match="not initialized"):
            ReslicingSender(mgr, None, [1, 2], layout)
    shard = layout.shard_spec(2)
    with (
        mc.CacheManager(mc.StatePool(shard, 2), host_pool=mc.HostPool(shard, 2)) as mgr,
        pytest.raises(mc.InvalidArgumentError, match="full spec"),  # a shard's manager, not the whole's
    ):
        ReslicingSender(mgr, None, [1, 2], layout)
