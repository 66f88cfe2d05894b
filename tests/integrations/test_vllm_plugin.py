"""The vLLM plugin's logic without vLLM: layout adoption, the step's events, the activation gate.

tests/integrations/test_vllm.py runs the plugin inside vLLM itself (in the vLLM venv that .ci/run makes).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import mambacache as mc
from mambacache.integrations import vllm as plugin

from ..support.engine_faults.mambacache_test_faults import inject, subprocess_env

ROOT = Path(__file__).parents[2]

BLOCKS, CONV, SSM = 7, (3, 5), (2, 4, 4)


def vllm_layout(layers: int = 2, pad: int = 3) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """vLLM's mamba layout: one buffer, per layer per block a page of conv then ssm (then padding)."""
    conv_n, ssm_n = 3 * 5, 2 * 4 * 4
    page = conv_n + ssm_n + pad
    raw = torch.randn(layers * BLOCKS * page)
    layer_views = []
    for layer in range(layers):
        base = layer * BLOCKS * page
        conv = raw.as_strided((BLOCKS, *CONV), (page, 5, 1), base)
        ssm = raw.as_strided((BLOCKS, *SSM), (page, 16, 4, 1), base + conv_n)
        layer_views.append((conv, ssm))
    return raw, layer_views


def test_block_rows_cover_both_states_of_each_block_in_place() -> None:
    _raw, layers = vllm_layout()
    conv, ssm = layers[1]
    rows = plugin.block_rows(conv, ssm)
    assert rows.shape[0] == BLOCKS and rows.is_contiguous() and rows.dtype == torch.uint8
    rows[3].zero_()
    assert bool((conv[3] == 0).all()) and bool((ssm[3] == 0).all())
    assert bool((conv[2] != 0).any()) and bool((conv[4] != 0).any())  # neighbours untouched
    rows[5].copy_(rows[1])
    assert torch.equal(conv[5], conv[1]) and torch.equal(ssm[5], ssm[1])
    with pytest.raises(ValueError, match="page"):
        plugin.block_rows(conv, torch.zeros(BLOCKS, *SSM))


def test_every_layer_is_in_one_pool_stacked_when_evenly_spaced_else_in_layer_groups() -> None:
    _, layers = vllm_layout(layers=3)
    rows = [plugin.block_rows(c, s) for c, s in layers]
    (pool,) = plugin._pools(rows)
    assert pool.num_slots == BLOCKS - 1 and pool.temporal.shape[0] == 3 and pool.layer_groups == ((0, 3),)
    assert pool.temporal.data_ptr() == layers[0][0].data_ptr()  # adopted, not copied
    shuffled = [rows[2], rows[1], rows[0]]  # descending: no two layers make one strided view
    (pool,) = plugin._pools(shuffled)  # still one pool, one manager: a layer group per layer
    assert pool.layer_groups == ((0, 1), (1, 2), (2, 3))
    assert [t.data_ptr() for (t,) in zip(*pool.layers, strict=True)] == [r.data_ptr() for r in shuffled]
    s = plugin.VllmStates([pool], groups=[1])
    assert s.layer_groups() == [3] and s.shapes() == [[3, BLOCKS, rows[0].shape[1]]]
    try:
        s.take(step(new=(("a", [2]),)))
        s.flush()
        assert all(bool((conv[2] == 0).all()) and bool((ssm[2] == 0).all()) for conv, ssm in layers)
        assert all(bool((conv[3] != 0).any()) for conv, _ in layers)
    finally:
        s.close()


def step(
    finished: tuple[str, ...] = (),
    new: tuple[tuple[str, list[int]], ...] = (),
    cached: tuple[tuple[str, list[int] | None], ...] = (),
    resumed: tuple[str, ...] = (),
    copies: tuple[tuple[int, int], ...] = (),
    computed: dict[str, int] | None = None,
) -> Any:
    done = computed or {}
    return SimpleNamespace(
        finished_req_ids=set(finished),
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=([], b), num_computed_tokens=done.get(r, 0)) for r, b in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            new_block_ids=[None if b is None else ([], b) for _, b in cached],
            resumed_req_ids=set(resumed),
        ),
        kv_cache_block_copies=list(copies) or None,
    )


@pytest.fixture
def states() -> Any:
    _raw, layers = vllm_layout()
    rows = [plugin.block_rows(c, s) for c, s in layers]
    s = plugin.VllmStates(plugin._pools(rows), groups=[1])  # group 0 is an attention group here
    yield s, layers
    s.close()


def test_new_blocks_are_cleared_before_the_forward_and_released_when_finished(states: Any) -> None:
    s, layers = states
    s.take(step(new=(("a", [2]), ("b", [0, 4]))))  # 0 is vLLM's null block: never managed
    s.flush()
    for conv, ssm in layers:
        assert bool((conv[2] == 0).all()) and bool((ssm[4] == 0).all())
        assert bool((conv[3] != 0).any())  # a block nobody got is left alone
    assert s.tenant_of == {2: "a", 4: "b"}
    s.take(step(finished=("a",), copies=((4, 2), (4, 5))))  # copies touch managed blocks only
    s.flush()
    assert s.tenant_of == {4: "b"} and s.stats.releases == 1 and s.stats.copies == 0
    assert s.manager.held() == {4: "b"}


def test_a_block_given_to_another_request_is_taken_back_from_the_preempted_one(states: Any) -> None:
    s, layers = states
    s.take(step(new=(("a", [2]),)))
    s.flush()
    for conv, _ in layers:
        conv[2].fill_(7.0)  # a's forward
    s.take(step(new=(("b", [2]),)))  # vLLM preempted a and gave its block to b
    s.flush()
    assert s.tenant_of == {2: "b"} and s.stats.reclaimed == 1
    assert all(bool((conv[2] == 0).all()) for conv, _ in layers)
    s.take(step(cached=(("a", [3]),), resumed=("a",)))  # a resumes in another block, from scratch
    s.take(step(cached=(("b", [5]),)))  # b grows by a block (speculative or checkpoint blocks)
    s.flush()
    assert s.tenant_of == {2: "b", 3: "a", 5: "b"} and s.blocks["b"] == [2, 5]
    s.take(step(copies=((2, 5),)))
    s.flush()
    assert s.stats.copies == 1
    assert all(torch.equal(conv[5], conv[2]) for conv, _ in layers)


def a_new_blocks_state_is_cleared() -> bool:
    """Whether a block the plugin gives a new request reads as zeros (the pool starts random)."""
    _, layers = vllm_layout()
    s = plugin.VllmStates(plugin._pools([plugin.block_rows(c, ssm) for c, ssm in layers]), groups=[1])
    s.take(step(new=(("a", [2]),)))
    s.flush()
    s.close()
    return all(bool((conv[2] == 0).all() and (ssm[2] == 0).all()) for conv, ssm in layers)


def test_the_skip_clear_fault_allocates_without_clearing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert a_new_blocks_state_is_cleared()
    inject("vllm-skip-clear", plugin, monkeypatch.setattr)
    assert not a_new_blocks_state_is_cleared()


@pytest.mark.parametrize("fault", [None, "vllm-skip-clear"])
def test_a_fault_reaches_a_process_of_its_own_through_its_environment(fault: str | None) -> None:
    # How the vLLM tests fault the plugin in vLLM's processes: the package itself reads no fault switch.
    code = "from tests.integrations.test_vllm_plugin import a_new_blocks_state_is_cleared as f; print(f())"
    env = subprocess_env(fault) if fault is not None else None
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == str(fault is None)


def test_inactive_unless_vllm_plugins_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert not plugin.active()
    plugin.register()  # a no-op: vLLM is not even imported
    assert "vllm" not in sys.modules or not plugin._patched
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    assert not plugin.active()
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver, mambacache")
    assert plugin.active()


def test_the_entry_point_is_declared() -> None:
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="vllm.general_plugins") if e.name == "mambacache"]
    assert found and found[0].value == "mambacache.integrations.vllm:register"
    assert found[0].load() is plugin.register


def test_pool_of_pages_is_a_plain_statepool() -> None:
    _, layers = vllm_layout()
    (pool,) = plugin._pools([plugin.block_rows(c, s) for c, s in layers])
    assert isinstance(pool, mc.StatePool) and pool.spec.conv_shapes == ()


def test_a_streaming_request_continued_under_its_id_keeps_its_state(states: Any) -> None:
    s, layers = states
    s.take(step(new=(("a", [2]),)))
    s.flush()
    for conv, _ in layers:
        conv[2].fill_(3.0)  # a's forward
    s.take(step(new=(("a", [2, 4]),)))  # vLLM's streaming input: the same request, one more block
    s.flush()
    assert s.tenant_of == {2: "a", 4: "a"} and s.stats.releases == 0
    assert all(bool((conv[2] == 3.0).all()) and bool((conv[4] == 0).all()) for conv, _ in layers)


@pytest.fixture
def aligned() -> Any:
    """The plugin in align-mode prefix caching, 4 tokens a block."""
    _raw, layers = vllm_layout()
    s = plugin.VllmStates(plugin._pools([plugin.block_rows(c, ssm) for c, ssm in layers]), groups=[1], block_size=4)
    yield s, layers
    s.close()


def test_align_mode_keeps_finished_blocks_for_hits_and_copies_a_hit_into_the_new_block(aligned: Any) -> None:
    s, layers = aligned
    s.take(step(new=(("a", [2, 3]),)))
    s.flush()
    for conv, ssm in layers:
        conv[3].fill_(5.0)  # a's state after its 8 tokens
        ssm[3].fill_(6.0)
    s.take(step(finished=("a",)))
    s.flush()
    assert s.tenant_of == {2: plugin.CACHED, 3: plugin.CACHED} and s.stats.kept == 2 and s.stats.releases == 0
    # b hits a's 8 tokens: columns 0 and 1 are read (0: vLLM nulled it), only column 2 is b's.
    s.take(step(new=(("b", [0, 3, 4]),), computed={"b": 8}))
    s.copy_block("b", 3, 4)  # preprocess_mamba: the hit into b's current block
    s.flush()
    assert s.tenant_of[3] == plugin.CACHED and s.tenant_of[4] == "b" and s.stats.hits == 1
    assert s.stats.allocs == 3 and s.stats.copies == 1
    for conv, ssm in layers:
        assert bool((conv[4] == 5.0).all()) and bool((ssm[4] == 6.0).all()) and bool((conv[3] == 5.0).all())
    # vLLM evicts block 3 from its cache and gives it to c: reclaimed from the cache, cleared.
    s.take(step(new=(("c", [3]),)))
    s.flush()
    assert s.tenant_of[3] == "c" and s.stats.reclaimed == 1 and s.stats.releases == 1
    assert all(bool((conv[3] == 0).all()) for conv, _ in layers)


def test_a_copy_into_a_block_the_request_does_not_hold_is_refused(aligned: Any) -> None:
    s, _ = aligned
    s.take(step(new=(("a", [2]), ("b", [3]))))
    s.flush()
    with pytest.raises(mc.SlotStateError):
        s.copy_block("a", 2, 3)
        s.flush()


def test_the_skip_copy_fault_drops_the_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    inject("vllm-skip-copy", plugin, monkeypatch.setattr)
    _, layers = vllm_layout()
    s = plugin.VllmStates(plugin._pools([plugin.block_rows(c, ssm) for c, ssm in layers]), groups=[1], block_size=4)
    s.take(step(new=(("a", [2, 3]),)))
    s.flush()
    layers[0][0][2].fill_(1.0)
    s.copy_block("a", 2, 3)
    s.flush()
    assert bool((layers[0][0][3] == 0).all()) and s.stats.copies == 0
    s.close()


def test_closing_releases_the_prefix_cache_so_the_trace_ends_idle_with_the_copies_as_forks(tmp_path: Any) -> None:
    path = tmp_path / "trace.jsonl"
    _, layers = vllm_layout()
    mc.tracing.configure(path, level="debug")
    try:
        s = plugin.VllmStates(plugin._pools([plugin.block_rows(c, ssm) for c, ssm in layers]), groups=[1], block_size=4)
        s.take(step(new=(("a", [2, 3]),)))
        s.copy_block("a", 2, 3)  # preprocess_mamba: a's state at the end of block 2 into its next block
        s.flush()
        s.take(step(finished=("a",), new=(("b", [0, 3, 4]),), computed={"b": 8}))
        s.copy_block("b", 3, 4)  # a hit in a block the prefix cache holds
        s.flush()
        s.take(step(finished=("b",)))
        s.flush()
        held = dict(s.tenant_of)
        before = path.read_text()
        s.close()
        s.close()  # idempotent
    finally:
        mc.tracing.disable()
    assert held == {2: plugin.CACHED, 3: plugin.CACHED, 4: plugin.CACHED} and s.tenant_of == {}
    assert s.stats.releases == 3 and s.stats.kept == 3
    analysis = mc.tracing.analyze(path, expect_idle=True)
    assert analysis.anomalies == [] and analysis.held == {} and analysis.summary["forks"] == 2
    forks = [(e.other, e.request_id) for e in analysis.timelines[4] if e.action == "fork-in"]
    assert forks == [(3, "b")]  # the fork names its tenant
    unclosed = mc.tracing.analyze_lines(before.splitlines(), expect_idle=True)
    assert {a.slot: (a.kind, a.request_id) for a in unclosed.anomalies} == dict.fromkeys(
        (2, 3, 4), ("held-at-end", plugin.CACHED)
    )


def test_split_pools_copy_the_conv_window_shifted_and_the_ssm_state_from_the_accepted_column() -> None:
    raw, layers = vllm_layout()
    before = raw.clone()
    pools, roles = plugin.split_pools(layers)
    # One pool over every layer, conv windows and SSM states apart: one manager, whatever the layer count.
    assert roles == [("split", CONV[1])] and len(pools) == 1 and not pools[0].temporal.is_contiguous()
    assert pools[0].spec.num_layers == 2 and len(pools[0].spec.conv_shapes) == 1
    s = plugin.VllmStates(pools, groups=[1], block_size=4, roles=roles)
    try:
        s.take(step(new=(("a", [2, 3, 4, 5]),)))
        s.flush()
        for conv, ssm in layers:  # dirty again: the copies below must read what is there
            conv[2:6] = torch.randn(4, *CONV)
            ssm[2:6] = torch.randn(4, *SSM)
        want = [(conv[2, 1:].clone(), ssm[3].clone(), conv[5].clone()) for conv, ssm in layers]
        # Column 0 -> 1 with one accepted draft token: the conv window from block 2 one token in, the SSM
        # state from the block of column 0 + 1 (block 3): vLLM's get_conv_copy_spec / get_temporal_copy_spec.
        s.copy_columns("a", ([], [2, 3, 4, 5]), 0, 2, bias=1)
        # One event: the conv window of column 0 shifted, the SSM state of column 0 + 1.
        assert s.manager.queued() == [mc.CopyOnWrite(2, 4, "a", CONV[1], 3)]
        s.flush()
        for (conv, ssm), (window, state, untouched) in zip(layers, want, strict=True):
            assert torch.equal(conv[4, :2], window) and bool((conv[4, 2] == 0).all())  # the shift zero-fills
            assert torch.equal(ssm[4], state) and torch.equal(conv[5], untouched)
        assert s.stats.copies == 1 and s.stats.shifted == 1
        # Blocks nobody holds keep every byte (the page slack too).
        others = torch.ones(BLOCKS, dtype=torch.bool)
        others[2:6] = False
        page = raw.numel() // (2 * BLOCKS)
        assert torch.equal(raw.view(2, BLOCKS, page)[:, others], before.view(2, BLOCKS, page)[:, others])
    finally:
        s.close()


def test_a_split_copy_keeps_the_destinations_ssm_state_when_the_accepted_column_is_its_own() -> None:
    """``temporal_src == dst``: the SSM state stays, the conv window still moves (one event, nothing else)."""
    _, layers = vllm_layout()
    pools, roles = plugin.split_pools(layers, dim_first=True)
    assert roles == [("split", 1)]
    s = plugin.VllmStates(pools, groups=[1], block_size=4, roles=roles)
    try:
        s.take(step(new=(("a", [2, 3]),)))
        s.flush()
        for conv, ssm in layers:
            conv[2:4], ssm[2:4] = torch.randn(2, *CONV), torch.randn(2, *SSM)
        want = [(conv[2].clone(), ssm[3].clone()) for conv, ssm in layers]
        s.copy_block("a", 2, 3, bias=1, temporal_src=3)
        s.copy_block("a", 3, 3)  # a copy of a block onto itself: no event at all
        assert s.manager.queued() == [mc.CopyOnWrite(2, 3, "a", 1, 3)]
        s.flush()
        for (conv, ssm), (window, state) in zip(layers, want, strict=True):
            # "DS" layout read as it is: each row's time axis is last, unit 1
            assert torch.equal(conv[3][..., :-1], window[..., 1:]) and bool((conv[3][..., -1] == 0).all())
            assert torch.equal(ssm[3], state)
    finally:
        s.close()
    with pytest.raises(mc.InvalidArgumentError, match="one pool"):
        plugin.VllmStates(pools * 2, groups=[1])


def test_a_shifted_copy_is_refused_on_page_pools() -> None:
    _, layers = vllm_layout()
    s = plugin.VllmStates(plugin._pools([plugin.block_rows(c, ssm) for c, ssm in layers]), groups=[1], block_size=4)
    try:
        s.take(step(new=(("a", [2, 3, 4]),)))
        with pytest.raises(mc.InvalidArgumentError, match="apart in the pool"):
            s.copy_block("a", 2, 3, bias=1, temporal_src=4)
        assert s.stats.copies == 0
    finally:
        s.close()


def test_split_pools_trace_each_block_event_once(tmp_path: Any) -> None:
    path = tmp_path / "trace.jsonl"
    _, layers = vllm_layout()
    mc.tracing.configure(path, level="debug")
    try:
        pools, roles = plugin.split_pools(layers)
        s = plugin.VllmStates(pools, groups=[1], block_size=4, roles=roles)  # 1 pool, 1 manager
        s.take(step(new=(("a", [2, 3, 4]),)))
        s.copy_columns("a", ([], [2, 3, 4]), 0, 1, bias=1)
        s.flush()
        s.take(step(finished=("a",)))
        s.flush()
        s.close()
    finally:
        mc.tracing.disable()
    analysis = mc.tracing.analyze(path, expect_idle=True)
    assert analysis.anomalies == [] and analysis.held == {} and analysis.summary["forks"] == 1
    assert analysis.summary["allocs"] == 3


def test_groups_sharing_their_tensors_make_one_pool_per_storage_so_a_shift_in_place_runs_once() -> None:
    # vLLM lays layer i of each mamba group over the same bytes: adopted twice, a step would run twice.
    _, layers = vllm_layout()
    twice = layers + [(c.view(c.shape), s.view(s.shape)) for c, s in layers]  # new tensor objects, same bytes
    assert plugin.distinct_layers(twice) == layers
    pools, roles = plugin.split_pools(plugin.distinct_layers(twice))
    s = plugin.VllmStates(pools, groups=[1], block_size=4, roles=roles)
    try:
        s.take(step(new=(("a", [2, 3]),)))
        s.flush()
        conv = layers[0][0]
        conv[2] = torch.arange(15.0).view(CONV)
        s.copy_columns("a", ([], [2, 3]), 0, 0, bias=1)  # the postprocess case: a shift within the running block
        s.flush()
        want = torch.cat([torch.arange(15.0).view(CONV)[1:], torch.zeros(1, CONV[1])])
        assert torch.equal(conv[2], want)  # shifted once, not once per group
    finally:
        s.close()


def test_close_detaches_the_plugin_so_vllms_own_path_runs_the_next_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """#32.7: after ``mambacache_close`` the engine's next steps must not reach the closed managers."""
    from mambacache.integrations import _vllm_prefix

    calls: list[Any] = []
    monkeypatch.setitem(_vllm_prefix._originals, "collect_mamba_copy_meta", lambda *a: calls.append(a[4:6]))
    monkeypatch.setitem(_vllm_prefix._originals, "do_mamba_copy_block", lambda bufs: calls.append(bufs))
    _, layers = vllm_layout()
    s = plugin.VllmStates(plugin._pools([plugin.block_rows(c, ssm) for c, ssm in layers]), groups=[1], block_size=4)
    monkeypatch.setattr(_vllm_prefix, "current", s)
    req = SimpleNamespace(req_id="a", block_ids=([], [2, 3]))

    def vllm_copies() -> None:  # what preprocess_mamba calls on its scalar path
        _vllm_prefix._collect_mamba_copy_meta(None, None, None, [1], 0, 1, 0, req, {})
        _vllm_prefix._do_mamba_copy_block("bufs")

    s.take(step(new=(("a", [2, 3]),)))
    vllm_copies()
    assert s.stats.copies == 1 and s.stats.flushes == 1 and calls == []  # the plugin's
    s.close()
    assert s.closed and _vllm_prefix.current is None
    vllm_copies()  # detached: vLLM's own functions, not a ManagerClosedError
    assert calls == [(0, 1), "bufs"] and s.stats.copies == 1
    with pytest.raises(mc.ManagerClosedError):
        s.manager.alloc(1)  # the managers are closed indeed: only the detach keeps steps off them
