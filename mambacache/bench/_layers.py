"""The per-layer row of ``mambacache bench``: a decode step on per-layer tensors against the stacked pool.

An engine that keeps each layer's state in a tensor of its own adopts them with
:meth:`StatePool.from_layers`; this times one decode step (a release, a cleared
alloc, a fork of a prefix into it: submit + plan + execute through
``flush_nowait``) on the same layers held four ways, interleaved round by round
so that all four see the same machine load:

* ``stacked``: one ``[layers, slots + 1, *state]`` tensor per state (the reference);
* ``layers-strided``: ``from_layers`` over that allocation's layers (one layer
  group: one strided view per state, as vLLM's evenly spaced block pages);
* ``layers-apart``: ``from_layers`` over layers allocated one by one (a layer
  group per layer: each op a foreach over every layer's rows);
* ``managers``: one ``CacheManager`` per layer, as the vLLM plugin ran split pools
  before ``from_layers`` (every event submitted and every step flushed per layer).

``ratio`` is each layout's median over ``stacked``'s. Two state sizes: ``tiny``
(a few bytes per layer: the host overhead alone) and a model's layer shapes.
``op_us`` is the floor under a layout's step, timed in the same rounds: the one
``_foreach_copy_`` its fork needs, over row views built beforehand (a view per
pool tensor and layer group), with no manager around it. Where a layout's floor
alone passes the stacked step times a goal ratio, no host-side change meets it.
(On model-sized states a slot's view is past the grain, so the floor is one
parallel region where the step cuts pieces for the crew: a floor, not a twin.)
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from .._core._pool import StatePool
from .._core._spec import StateSpec
from .._manager import CacheManager
from ._presets import lookup

__all__ = ["LAYOUTS", "layer_overhead", "render", "run"]

LAYOUTS = ("stacked", "layers-strided", "layers-apart", "managers")
TINY = StateSpec(num_layers=36, conv_shapes=[(4, 2)], temporal_shape=(2, 2))


def _adopt(layers: list[list[Any]], nconv: int) -> StatePool:
    """``from_layers`` over ``layers`` (per pool tensor, its per-layer tensors)."""
    n = len(layers[0])
    return StatePool.from_layers([[c[i] for c in layers[:nconv]] for i in range(n)], layers[nconv])


def _pools(spec: StateSpec, slots: int) -> dict[str, list[StatePool]]:
    nconv = len(spec.conv_shapes)
    one = dataclasses.replace(spec, num_layers=1)
    apart = [StatePool(one, slots) for _ in range(spec.num_layers)]
    per_layer = [[t for p in apart for t in p.layers[k]] for k in range(nconv + 1)]
    return {
        "stacked": [StatePool(spec, slots)],
        "layers-strided": [_adopt(StatePool(spec, slots).layers, nconv)],
        "layers-apart": [_adopt(per_layer, nconv)],
        "managers": [StatePool(one, slots) for _ in range(spec.num_layers)],
    }


def _stepper(managers: list[CacheManager]) -> Callable[[], None]:
    """One decode step on every manager: release the oldest request's slot, alloc a cleared one, fork into it."""
    running: list[int] = []
    prefix = 0
    for mgr in managers:  # the same slots in each: the ledgers see the same events
        (prefix,) = mgr.alloc(1, "prefix")
        running = mgr.alloc(3)
        mgr.flush_nowait()

    def step() -> None:
        old = running.pop(0)
        new = 0
        for mgr in managers:
            mgr.release(old)
            (new,) = mgr.alloc(1)
            mgr.copy_on_write(prefix, new)
            mgr.flush_nowait()
        running.append(new)

    return step


def _bare_op(pools: list[StatePool]) -> Callable[[], None]:
    """The fork's copy alone: one foreach from slot 1's rows into slot 2's, over every pool tensor and layer
    group of ``pools``, the views built here once."""
    dests = [t[:, 2] for p in pools for t in p.exec_tensors]
    sources = [t[:, 1] for p in pools for t in p.exec_tensors]

    def op() -> None:
        torch._foreach_copy_(dests, sources)

    return op


def layer_overhead(
    repeats: int, layers: int = 36, slots: int = 6, inner: int = 20, quick: bool = False
) -> list[dict[str, Any]]:
    """Median microseconds of one decode step per layout and state size, and each over ``stacked``'s.

    ``repeats`` rounds; in each, every layout runs ``inner`` steps (after as
    many to warm up), the order rotating from round to round. ``quick``: the
    tiny states only.
    """
    model = lookup("qwen3-next-80b-a3b-tp8")
    specs = {"tiny": dataclasses.replace(TINY, num_layers=layers)}
    if not quick:
        specs[model.name] = model.spec
    rows = []
    for name, full in specs.items():
        spec = dataclasses.replace(full, num_layers=layers)
        pools = _pools(spec, slots)
        managers = {k: [CacheManager(p).__enter__() for p in ps] for k, ps in pools.items()}
        try:
            steps = {k: _stepper(m) for k, m in managers.items()}
            ops = {k: _bare_op(ps) for k, ps in pools.items()}
            times: dict[str, list[float]] = {k: [] for k in LAYOUTS}
            op_times: dict[str, list[float]] = {k: [] for k in LAYOUTS}
            for r in range(repeats + 1):
                for k in LAYOUTS[r % 4 :] + LAYOUTS[: r % 4]:
                    for fn, out in ((steps[k], times[k]), (ops[k], op_times[k])):
                        t0 = time.perf_counter()
                        for _ in range(inner):
                            fn()
                        if r:  # round 0 warms up
                            out.append((time.perf_counter() - t0) / inner)
        finally:
            for ms in managers.values():
                for mgr in ms:
                    mgr.__exit__(None, None, None)
        base = statistics.median(times["stacked"])
        for k in LAYOUTS:
            med = statistics.median(times[k])
            rows.append({"state": name, "layers": layers, "layout": k, "step_us": med * 1e6,
                         "min_us": min(times[k]) * 1e6, "ratio": med / base,
                         "op_us": statistics.median(op_times[k]) * 1e6,
                         "layer_groups": sum(len(p.layer_groups) for p in pools[k])})  # fmt: skip
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """The rows as a table: step time and ratio to the stacked pool, per state size."""
    lines = ["per-layer tensors: a decode step (release, cleared alloc, fork; flush_nowait) on 36 layers"]
    lines += [
        f"{'state':<24} {'layout':<15} {'groups':>6} {'step us':>9} {'min us':>9} {'vs stacked':>10}"
        f" {'op us':>8} {'op vs stacked':>13}"
    ]
    base = {r["state"]: r["step_us"] for r in rows if r["layout"] == "stacked"}
    for r in rows:
        lines.append(
            f"{r['state']:<24} {r['layout']:<15} {r['layer_groups']:>6} {r['step_us']:>9.1f} {r['min_us']:>9.1f}"
            f" {r['ratio']:>9.2f}x {r['op_us']:>8.1f} {r['op_us'] / base[r['state']]:>12.2f}x"
        )
    lines.append("op: the fork's one foreach copy alone, over row views built beforehand (the layout's floor);"
                 " op vs stacked: that floor over the stacked pool's whole step")  # fmt: skip
    return "\n".join(lines)


def run(repeats: int, json_path: str | None, quick: bool = False) -> int:
    """``mambacache bench --layers``: the per-layer row alone (``json_path``: also as JSON, '-' for stdout)."""
    from .._console import say_written, write_json

    rows = layer_overhead(repeats, quick=quick)
    if json_path != "-":
        sys.stdout.write(render(rows) + "\n")
    if json_path:
        write_json(json_path, {"layer_overhead": rows})
        say_written("JSON", json_path, json_path)
    return 0
