"""Re-slicing between tensor-parallel sizes: model configs and layouts, a stand-in prefill rank, and the real link
in one process (``StateTransfer`` on clients of one ``TCPStore`` on 127.0.0.1, each side in its own thread).

A ``ReslicingSender`` needs an initialised process group to build its transfers; here its ``__init__`` runs with
the group's calls stood in and store-client transfers (:func:`reslicing_sender`), the rest of it unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from hypothesis import strategies as st

import mambacache as mc
from mambacache._handoff._reslice import ReslicingReceiver, ReslicingSender, StateLayout

from .link import store, transfer


def mamba2(heads: int, head_dim: int, groups: int, state: int) -> SimpleNamespace:
    return SimpleNamespace(
        model_type="mamba2", num_hidden_layers=2, num_heads=heads, head_dim=head_dim, n_groups=groups,
        state_size=state, expand=2, hidden_size=heads * head_dim // 2, conv_kernel=4,
    )  # fmt: skip


def qwen(key_heads: int, value_heads: int, dk: int, dv: int) -> SimpleNamespace:
    return SimpleNamespace(
        model_type="qwen3_next", linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"] * 2,
    )  # fmt: skip


def random_state(spec: mc.StateSpec, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((spec.num_layers, n, *shape), generator=g).to(dtype) for shape, dtype in spec.shapes()]


def layouts(tp: int) -> st.SearchStrategy[StateLayout]:
    """Layouts whose state divides ``tp`` ways: Mamba2 with groups divisible by tp or a single (replicated) group,
    Qwen3-Next, and a plain synthetic spec with extras."""
    m2 = st.builds(
        lambda h, d, g, n: StateLayout.from_config(mamba2(h * tp, d, g, n)),
        st.integers(1, 3), st.sampled_from([2, 4]), st.sampled_from([1, tp, 2 * tp]), st.integers(1, 5),
    )  # fmt: skip
    qw = st.builds(
        lambda k, v, dk, dv: StateLayout.from_config(qwen(k * tp, v * tp, dk, dv)),
        st.integers(1, 2), st.integers(1, 3), st.integers(1, 4), st.integers(1, 4),
    )  # fmt: skip
    syn = st.builds(
        lambda c, h, w: StateLayout.synthetic(
            mc.StateSpec(2, [(c * tp, 3)], (h * tp, w), extra_shapes={"scale": ((), torch.float32)})
        ),
        st.integers(1, 4), st.integers(1, 3), st.integers(1, 4),
    )  # fmt: skip
    return st.one_of(m2, qw, syn)


class FakeTransfer:
    """Stands in for a StateTransfer to one prefill rank: hands out a prepared batch, records acknowledgements."""

    peer = 0

    def __init__(self, ids: list[str], rows: list[torch.Tensor]) -> None:
        self.ids, self.rows = ids, rows
        self.acked: list[list[str]] = []
        self.refused: list[list[str]] = []

    def receive_rows(self, shapes: object) -> tuple[list[str], list[torch.Tensor]]:
        assert shapes == [(tuple(r.shape[2:]), r.dtype) for r in self.rows]
        return list(self.ids), [r.clone() for r in self.rows]

    def acknowledge(self, ids: list[str], *, landed: bool = True, why: str = "") -> None:
        (self.acked if landed else self.refused).append(ids)


def mamba2_config(groups: int = 1) -> SimpleNamespace:
    # Mamba2 with 4 heads: x split, B and C replicated (one group) or split (two groups).
    return SimpleNamespace(
        model_type="mamba2", num_hidden_layers=2, num_heads=4, head_dim=2, n_groups=groups,
        state_size=3, expand=2, hidden_size=4, conv_kernel=4,
    )  # fmt: skip


def mamba2_layout(groups: int = 1) -> StateLayout:
    cfg = mamba2_config(groups)
    spec = mc.StateSpec.from_hf_config(cfg, extra_shapes={"scale": ((), torch.float32)})
    return StateLayout.from_config(cfg, spec)


def reslicing_sender(mgr: mc.CacheManager, master: Any, layout: StateLayout, peers: list[int], timeout: float) -> Any:
    """A ReslicingSender of rank 0, built by its own ``__init__`` with the process group's calls stood in (one
    process here) and each rank's transfer a store client's."""
    import torch.distributed as dist

    import mambacache._handoff._reslice as reslice_mod

    def store_client(m: mc.CacheManager, group: Any, peer: int, *, timeout: float, transport: str) -> mc.StateTransfer:
        return transfer(m, master, 0, peer, timeout)  # the test's transport (its fixture's default)

    with (
        mock.patch.object(dist, "is_initialized", return_value=True),
        mock.patch.object(dist, "get_process_group_ranks", return_value=[0, *peers]),
        mock.patch.object(dist, "get_rank", return_value=0),
        mock.patch.object(reslice_mod, "StateTransfer", store_client),
    ):
        return ReslicingSender(mgr, None, peers, layout, timeout=timeout)


@contextlib.contextmanager
def one_to_two(
    timeout: float, host: tuple[int, int] = (4, 4)
) -> Iterator[tuple[mc.CacheManager, mc.CacheManager, mc.CacheManager, Any, list[mc.StateTransfer]]]:
    """1 -> 2 over the real link: the prefill manager, the two decode ranks' (host pools of ``host`` slots), the
    re-slicing sender of rank 0 and the decode ranks' transfers from it."""
    layout = mamba2_layout()
    shard = layout.shard_spec(2)
    master = store()
    with (
        host_manager(layout.spec) as mgr,
        host_manager(shard, host=host[0]) as d1,
        host_manager(shard, host=host[1]) as d2,
    ):
        sender = reslicing_sender(mgr, master, layout, [1, 2], timeout)
        yield mgr, d1, d2, sender, [transfer(d1, master, 1, 0, timeout), transfer(d2, master, 2, 0, timeout)]


@contextlib.contextmanager
def two_to_one(
    timeout: float,
) -> Iterator[tuple[mc.CacheManager, mc.CacheManager, mc.CacheManager, list[mc.StateTransfer], ReslicingReceiver]]:
    """2 -> 1 over the real link: the two prefill ranks' managers (each its shard), the decode manager, the prefill
    ranks' transfers to it and its re-slicing receiver (two groups: B and C split too)."""
    layout = mamba2_layout(2)
    shard = layout.shard_spec(2)
    master = store()
    with host_manager(shard) as p0, host_manager(shard) as p1, host_manager(layout.spec) as d:
        senders = [transfer(p0, master, 0, 2, timeout), transfer(p1, master, 1, 2, timeout)]
        froms = [transfer(d, master, 2, 0, timeout), transfer(d, master, 2, 1, timeout)]
        yield p0, p1, d, senders, ReslicingReceiver(d, froms, layout)


def host_manager(spec: mc.StateSpec, slots: int = 6, host: int = 4) -> mc.CacheManager:
    return mc.CacheManager(mc.StatePool(spec, slots), host_pool=mc.HostPool(spec, host))


def fill_slot(mgr: mc.CacheManager, slot: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in mgr.pool.tensors:
        t[:, slot] = torch.randn(t[:, slot].shape, generator=g).to(t.dtype)


def export_filled(mgr: mc.CacheManager, rid: str, seed: int) -> int:
    (slot,) = mgr.alloc(1, rid, clear=False)
    mgr.flush_nowait()
    fill_slot(mgr, slot, seed)
    mgr.export(slot, rid)
    mgr.flush_nowait()
    return slot
