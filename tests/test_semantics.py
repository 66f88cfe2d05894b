"""Every executor, through the manager, against one-event-at-a-time execution."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache._executors._npu import NpuExecutor
from mambacache._executors._torch import TorchExecutor

from .oracle import SequentialOracle
from .strategies import events_from_ops, ops
from .util import drive, fill_random, quant_spec, small_spec, step_value

N = 10
SPECS = {"plain": small_spec(), "quantized": quant_spec()}  # the extras follow the same semantics as conv/temporal


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
    executor: object, raw: list[tuple[str, int, int]], initially: set[int], seed: int, spec: mc.StateSpec
) -> None:
    pool = mc.StatePool(spec, N)
    async with mc.CacheManager(pool, executor=executor) as mgr:
        if initially:
            mgr.alloc(len(initially))
        await mgr.flush()
        fill_random(pool, seed)  # every slot dirty, as after forward steps
        oracle = SequentialOracle(pool)
        for step, (events, _) in enumerate(events_from_ops(raw, N, set(pool.allocated_slots()))):
            drive(mgr, events, oracle)  # alloc hands out the lowest free slot, the one the log drew
            report = await mgr.flush()
            assert report.events == len(events)
            oracle.assert_matches(pool)
            # A forward step writes into every live slot between flushes.
            for s in pool.allocated_slots():
                value = step_value(step, s)
                oracle.write(s, value)
                for t in pool.tensors:
                    t[:, s] = value


@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("name", list(EXECUTORS))
@given(raw=ops, initially=st.sets(st.integers(1, N), max_size=6), seed=st.integers(0, 2**16))
@settings(max_examples=100)
def test_executor_matches_sequential(
    name: str, spec: str, raw: list[tuple[str, int, int]], initially: set[int], seed: int
) -> None:
    # `alloc` picks the slot, so the strategy's own choice is replaced by the manager's.
    anyio.run(run_steps, EXECUTORS[name], _lowest_free_allocs(raw), initially, seed, SPECS[spec])


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
