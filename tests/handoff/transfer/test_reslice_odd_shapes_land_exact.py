"""Re-slicing end to end over every transport (gloo pushes, NIXL and Mooncake read pieces) on odd states: bf16,
float16 and 1-byte dtypes, 1-element dimensions, two conv tensors, 1-byte extras, layers in tensors of their
own; staged and in place, TP 2 -> 1 and 1 -> 2. The oracle is the sharding rule by hand (``torch.chunk`` of each
split segment, replicated segments whole): what lands must be those bytes exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

import mambacache as mc
from mambacache._handoff._reslice import ReslicingReceiver, ReslicingSender, StateLayout

from ...support.link import in_thread, store, transfer

TIMEOUT = 10.0


def _mamba2() -> StateLayout:
    # One group (B and C replicated), head_dim 1, kernel 1; conv bf16, temporal float16, two 1-byte extras.
    cfg = SimpleNamespace(
        model_type="mamba2", num_hidden_layers=3, num_heads=2, head_dim=1, n_groups=1, state_size=1,
        expand=1, hidden_size=2, conv_kernel=1,
    )  # fmt: skip
    base = mc.StateSpec.from_hf_config(cfg)
    extras = {"s8": ((), torch.int8), "u8": ((3,), torch.uint8)}
    spec = mc.StateSpec(
        base.num_layers, base.conv_shapes, base.temporal_shape, conv_dtype=torch.bfloat16,
        temporal_dtype=torch.float16, extra_shapes=extras,
    )  # fmt: skip
    return StateLayout.from_config(cfg, spec)


def _synthetic() -> StateLayout:
    spec = mc.StateSpec(
        2, [(2, 1), (4, 3)], (2, 1, 1), conv_dtype=torch.uint8, temporal_dtype=torch.bfloat16,
        extra_shapes={"b": ((1,), torch.bool)},
    )  # fmt: skip
    return StateLayout.synthetic(spec)


LAYOUTS = {"mamba2-1-group-bf16": _mamba2, "synthetic-two-convs-1-byte": _synthetic}
SEGMENTS = {  # per pool tensor: (start, size, split) of its first state dimension, by the documented rule
    "mamba2-1-group-bf16": [[(0, 2, True), (2, 1, False), (3, 1, False)], [(0, 2, True)], [], []],
    "synthetic-two-convs-1-byte": [[(0, 2, True)], [(0, 4, True)], [(0, 2, True)], []],
}


# Staged, the host pool's rows are read (always stacked); in place, the pool's own: stacked or per layer.
WHERE = [(False, False), (True, False), (True, True)]
WHERE_IDS = ["staged", "in-place-stacked", "in-place-per-layer"]


def _shard(full: torch.Tensor, segments: list[tuple[int, int, bool]], tp: int, rank: int) -> torch.Tensor:
    if not segments:
        return full.clone()
    parts = [full.narrow(2, a, n).chunk(tp, dim=2)[rank] if split else full.narrow(2, a, n) for a, n, split in segments]
    return torch.cat(parts, 2)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _full(layout: StateLayout, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in layout.spec.shapes():
        bits = torch.randint(0, 256, (layout.spec.num_layers, n, *shape, dtype.itemsize), generator=g)
        bits = bits.to(torch.uint8) & (1 if dtype is torch.bool else 255)
        out.append(bits.view(dtype).reshape(layout.spec.num_layers, n, *shape))
    return out


def _mgr(spec: mc.StateSpec, per_layer: bool) -> mc.CacheManager:
    """A manager of 5 slots; ``per_layer``: its pool's layers in tensors of their own (``from_layers``)."""
    if per_layer:
        shapes = spec.shapes()
        n = len(spec.conv_shapes)
        per = [[torch.zeros(6, *s, dtype=d) for s, d in shapes] for _ in range(spec.num_layers)]
        extra = {name: [layer[n + 1 + i] for layer in per] for i, name in enumerate(spec.extra_shapes)}
        pool = mc.StatePool.from_layers(
            conv=[layer[:n] for layer in per], temporal=[layer[n] for layer in per], extra=extra or None
        )
    else:
        pool = mc.StatePool(spec, 5)
    return mc.CacheManager(pool, host_pool=mc.HostPool(spec, 4))


def _put(mgr: mc.CacheManager, slot: int, rows: list[torch.Tensor], j: int) -> None:
    for views, t in zip(mgr.pool.layers, rows, strict=True):
        for layer, view in enumerate(views):
            view[slot] = t[layer, j]


def _get(mgr: mc.CacheManager, slot: int) -> list[torch.Tensor]:
    return [torch.stack([v[slot] for v in views]) for views in mgr.pool.layers]


def _sender(mgr: mc.CacheManager, master: Any, layout: StateLayout, peers: list[int]) -> ReslicingSender:
    """Rank 0's re-slicing sender, its process group's calls stood in (one process here)."""
    import torch.distributed as dist

    import mambacache._handoff._reslice as reslice_mod

    def made(m: mc.CacheManager, group: Any, peer: int, *, timeout: float, transport: str) -> mc.StateTransfer:
        return transfer(m, master, 0, peer, timeout)

    with (
        mock.patch.object(dist, "is_initialized", return_value=True),
        mock.patch.object(dist, "get_process_group_ranks", return_value=[0, *peers]),
        mock.patch.object(dist, "get_rank", return_value=0),
        mock.patch.object(reslice_mod, "StateTransfer", made),
    ):
        return ReslicingSender(mgr, None, peers, layout, timeout=TIMEOUT)


@contextlib.contextmanager
def _managers(*specs: tuple[mc.StateSpec, bool]) -> Iterator[list[mc.CacheManager]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(_mgr(spec, per_layer)) for spec, per_layer in specs]


@pytest.mark.parametrize("in_place,per_layer", WHERE, ids=WHERE_IDS)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_tp2_to_tp1_lands_the_whole_state_exactly(name: str, in_place: bool, per_layer: bool) -> None:
    layout, segments = LAYOUTS[name](), SEGMENTS[name]
    shard = layout.shard_spec(2)
    full = _full(layout, 2, 1)
    master = store()
    with _managers((shard, per_layer), (shard, per_layer), (layout.spec, per_layer)) as (p0, p1, d):
        senders = [transfer(p0, master, 0, 2, TIMEOUT), transfer(p1, master, 1, 2, TIMEOUT)]
        receiver = ReslicingReceiver(
            d, [transfer(d, master, 2, 0, TIMEOUT), transfer(d, master, 2, 1, TIMEOUT)], layout
        )
        for k, p in enumerate((p0, p1)):
            mine = [_shard(f, segs, 2, k) for f, segs in zip(full, segments, strict=True)]
            for j, rid in enumerate(("a", "b")):
                (slot,) = p.alloc(1, rid, clear=False)
                p.flush_nowait()
                _put(p, slot, mine, j)
                p.export(slot, rid, in_place=in_place)
                p.flush_nowait()
        if in_place:
            d.expect_import(4, "a")
            d.expect_import(2, "b")
            d.flush_nowait()
        sends = [in_thread(x.send) for x in senders]
        assert receiver.receive() == ["a", "b"]
        for th, sent in sends:
            th.join(2 * TIMEOUT)
            assert sent == [["a", "b"]], sent
        if not in_place:
            d.import_into(4, "a")
            d.import_into(2, "b")
        d.flush_nowait()
        for slot, j in ((4, 0), (2, 1)):
            for got, want in zip(_get(d, slot), full, strict=True):
                assert torch.equal(_raw(got), _raw(want[:, j])), f"{name}: state {j} landed other bytes"


@pytest.mark.parametrize("in_place,per_layer", WHERE, ids=WHERE_IDS)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_tp1_to_tp2_lands_each_ranks_shard_exactly(name: str, in_place: bool, per_layer: bool) -> None:
    layout, segments = LAYOUTS[name](), SEGMENTS[name]
    shard = layout.shard_spec(2)
    full = _full(layout, 2, 2)
    master = store()
    with _managers((layout.spec, per_layer), (shard, per_layer), (shard, per_layer)) as (mgr, d1, d2):
        sender = _sender(mgr, master, layout, [1, 2])
        into = [transfer(d1, master, 1, 0, TIMEOUT), transfer(d2, master, 2, 0, TIMEOUT)]
        for j, rid in enumerate(("a", "b")):
            (slot,) = mgr.alloc(1, rid, clear=False)
            mgr.flush_nowait()
            _put(mgr, slot, full, j)
            mgr.export(slot, rid, in_place=in_place)
            mgr.flush_nowait()
        if in_place:
            for d in (d1, d2):
                d.expect_import(4, "a")
                d.expect_import(2, "b")
                d.flush_nowait()
        threads = [in_thread(x.receive) for x in into]
        assert sender.send() == ["a", "b"]
        for th, got in threads:
            th.join(2 * TIMEOUT)
            assert got == [["a", "b"]], got
        for k, d in enumerate((d1, d2)):
            if not in_place:
                d.import_into(4, "a")
                d.import_into(2, "b")
            d.flush_nowait()
            want = [_shard(f, segs, 2, k) for f, segs in zip(full, segments, strict=True)]
            for slot, j in ((4, 0), (2, 1)):
                for got, w in zip(_get(d, slot), want, strict=True):
                    assert torch.equal(_raw(got), _raw(w[:, j])), f"{name}: rank {k}'s shard of state {j} differs"
