"""Every executor, through the manager, against one-event-at-a-time execution."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache._executors._npu import NpuExecutor
from mambacache._executors._torch import TorchExecutor
from mambacache.testing import SequentialOracle

from ..support.layered import layered_pool, pool_tensors
from ..support.strategies import events_from_ops, shift_ops
from ..support.util import drive, fill_random, paged_pool, quant_spec, small_spec, step_value

N = 10
# The extras follow the same semantics as conv/temporal; "wide" has convs of widths 4 and 5, so that shifted
# copies draw shifts 1..3 (the other two specs have a width-2 conv: shift 1 only).
SPECS = {
    "plain": small_spec(),
    "quantized": quant_spec(),
    "wide": mc.StateSpec(num_layers=2, conv_shapes=[(3, 5), (4, 4)], temporal_shape=(2, 3)),
}
# Paged pools (an engine's block pages: only each (layer, slot) row contiguous) of the same specs; the npu
# executor refuses them (test_a_paged_pool_is_refused_by_the_npu_executor_only).
# Per-layer pools (StatePool.from_layers, two layer groups: tests/support/layered.py), stacked and paged.
POOLS = {name: (spec, "stacked") for name, spec in SPECS.items()}
POOLS |= {f"paged-{name}": (SPECS[name], "paged") for name in ("quantized", "wide")}
POOLS |= {f"layers-{name}": (SPECS[name], "layers") for name in ("quantized", "wide")}
POOLS |= {f"layers-paged-{name}": (SPECS[name], "layers-paged") for name in ("quantized", "wide")}
MAKE: dict[str, Callable[[mc.StateSpec, int], mc.StatePool]] = {
    "stacked": mc.StatePool,
    "paged": paged_pool,
    "layers": lambda spec, n: layered_pool(spec, n, mc.StatePool),
    "layers-paged": lambda spec, n: layered_pool(spec, n, paged_pool),
}


def executors() -> dict[str, object]:
    spec = small_spec()
    slot_layer = max(spec.layer_bytes())
    return {
        "torch": "torch",
        "torch-runs": TorchExecutor(min_run_bytes=0),  # always one slice op per run
        "torch-index": TorchExecutor(path="index"),  # always index ops
        "torch-direct": TorchExecutor(path="direct"),  # the accelerator path: foreach over (layer, slot) rows
        "npu": "npu",
        # Workspaces that force each chunking level: slots, layers, rows.
        "npu-slot-chunks": NpuExecutor(spec.num_layers * slot_layer * 2),
        "npu-layer-chunks": NpuExecutor(slot_layer * 2),
        "npu-rows": NpuExecutor(8),
        "reference": "reference",
    }


EXECUTORS = executors()


async def run_steps(
    executor: object, raw: list[tuple[str, int, int]], initially: set[int], seed: int, spec: mc.StateSpec,
    kind: str = "stacked",
) -> None:  # fmt: skip
    pool = MAKE[kind](spec, N)
    async with mc.CacheManager(pool, executor=executor) as mgr:
        if initially:
            mgr.alloc(len(initially))
        await mgr.flush()
        fill_random(pool, seed)  # every slot dirty, as after forward steps
        oracle = SequentialOracle(pool)
        max_shift = min(s[-1] for s in spec.conv_shapes) - 1
        for step, (events, _) in enumerate(events_from_ops(raw, N, set(pool.allocated_slots()), max_shift=max_shift)):
            drive(mgr, events, oracle)  # alloc hands out the lowest free slot, the one the log drew
            report = await mgr.flush()
            assert report.events == len(events)
            oracle.assert_matches(pool)
            # A forward step writes into every live slot between flushes.
            for s in pool.allocated_slots():
                value = step_value(step, s)
                oracle.write(s, value)
                for t in pool_tensors(pool):
                    t[:, s] = value


@pytest.mark.parametrize(
    ("pool", "name"),
    [(p, n) for p in sorted(POOLS) for n in EXECUTORS if not (POOLS[p][1].endswith("paged") and "npu" in n)],
)
@given(raw=shift_ops, initially=st.sets(st.integers(1, N), max_size=6), seed=st.integers(0, 2**16))
@settings(max_examples=100)
def test_executor_matches_sequential(
    name: str, pool: str, raw: list[tuple[str, int, int]], initially: set[int], seed: int
) -> None:
    # `alloc` picks the slot, so the strategy's own choice is replaced by the manager's.
    anyio.run(run_steps, EXECUTORS[name], _lowest_free_allocs(raw), initially, seed, *POOLS[pool])


def test_a_paged_pool_is_refused_by_the_npu_executor_only() -> None:
    pool = paged_pool(quant_spec(), 4)
    fill_random(pool, 0)
    before = [t.clone() for t in pool.tensors]
    for executor in ("npu", NpuExecutor(8)):
        with pytest.raises(mc.InvalidArgumentError, match="needs contiguous pool tensors; this pool's are paged"):
            mc.CacheManager(pool, executor=executor).__enter__()
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(before, pool.tensors, strict=True))
    with mc.CacheManager(pool, executor="torch") as mgr:  # the refusals claimed nothing
        assert mgr.alloc(4) == [1, 2, 3, 4]


def _lowest_free_allocs(raw: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    return [(k, 0 if k == "alloc" else a, b) for k, a, b in raw]


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["torch", "npu", "reference"])
async def test_swap_chain_and_read_before_clear(name: str) -> None:
    pool = mc.StatePool(small_spec(), 8)
    async with mc.CacheManager(pool, executor=name) as mgr:
        a, b, c, d = mgr.alloc(4)
        await mgr.flush()
        fill_random(pool, 1)
        oracle = SequentialOracle(pool)
        spare = mgr.alloc(1)[0]
        events = [
            mc.CopyOnWrite(a, spare),
            mc.CopyOnWrite(b, a),
            mc.CopyOnWrite(spare, b),  # swap a <-> b through the spare
            mc.CopyOnWrite(c, d),
            mc.Clear(c),  # d must get c's old content
            mc.Release(spare),
        ]
        mgr.submit(*events)
        oracle.apply([mc.Alloc(spare), *events])
        report = await mgr.flush()
        oracle.assert_matches(pool)
        assert (report.copied, report.zeroed) == (3, 1)


# -- shifted copies: vLLM's semantics, bad input ------------------------------------
@pytest.mark.parametrize("name", ["torch", "npu", "reference"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_shifted_copy_is_vllms_accepted_token_bias_copy(name: str, k: int) -> None:
    """vLLM's align-mode copy with ``accept_token_bias = k`` (``get_conv_copy_spec``, SD layout
    ``[blocks, state_len, dim]``): one memcpy of ``state[src, k:]`` to the start of ``state[dst]``. Our conv
    layout is its transpose (``[dim, width]``, time last), so the same tokens land in ``dst[..., :width - k]``;
    vLLM leaves the last ``k`` positions stale (its kernels never read them), we zero them."""
    width, dim = 4, 3
    spec = mc.StateSpec(num_layers=2, conv_shapes=[(dim, width)], temporal_shape=(2, 2), conv_dtype=torch.float32)
    pool = mc.StatePool(spec, 4)
    with mc.CacheManager(pool, executor=name) as mgr:
        a, b = mgr.alloc(2)
        mgr.flush_nowait()
        fill_random(pool, k)
        conv, temporal = pool.tensors[0].clone(), pool.tensors[1].clone()
        mgr.copy_on_write(a, b, shift=k)
        mgr.copy_on_write(a, a, shift=k)  # in place: vLLM's same-block shift (memmove-safe, low to high)
        mgr.flush_nowait()
    for layer in range(2):
        sd = conv[layer].transpose(-1, -2).contiguous()  # vLLM's SD blocks [slots, state_len, dim]
        flat = sd.view(sd.shape[0], -1)
        n = (width - k) * dim  # copy_spec.num_elements
        want = flat[a, k * dim :][:n].view(width - k, dim).T  # what the memcpy puts at the start of dst
        for slot in (a, b):
            got = pool.tensors[0][layer, slot]
            assert torch.equal(got[:, : width - k], want) and not got[:, width - k :].any()
            assert torch.equal(pool.tensors[1][layer, slot], temporal[layer, a])  # temporal: whole


def test_a_bad_shift_changes_nothing_and_a_pool_without_conv_states_takes_only_zero() -> None:
    pool = mc.StatePool(small_spec(), 4)  # conv widths 3 and 2: shift 0 or 1
    with mc.CacheManager(pool) as mgr:
        a, b = mgr.alloc(2)
        before = (mgr.queued(), mgr.held())
        for bad in (2, -1, 1.5, True, "1", None):
            with pytest.raises(mc.InvalidArgumentError, match=r"shift must be an int in 0\.\.1"):
                mgr.copy_on_write(a, b, shift=bad)  # type: ignore[arg-type]
            with pytest.raises(mc.InvalidArgumentError, match="shift"):
                mgr.submit(mc.CopyOnWrite(a, b), mc.CopyOnWrite(a, b, shift=bad))  # type: ignore[arg-type]
            assert (mgr.queued(), mgr.held()) == before
        mgr.copy_on_write(a, b, shift=1)
        assert mgr.queued()[-1] == mc.CopyOnWrite(a, b, shift=1)
    flat = mc.StatePool.from_tensors([], torch.zeros(2, 4, 8))
    with mc.CacheManager(flat) as mgr:
        a, b = mgr.alloc(2)
        with pytest.raises(mc.InvalidArgumentError, match="shift must be 0 on a pool without conv states"):
            mgr.copy_on_write(a, b, shift=1)
        mgr.copy_on_write(a, b, shift=0)
        assert mgr.queued()[-1] == mc.CopyOnWrite(a, b)
