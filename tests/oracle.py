"""The obviously-correct reference: apply each event to a copy of the tensors, one at a time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

import mambacache as mc

from .layered import pool_tensors


class SequentialOracle:
    """Tracks which slots have a defined value: a free slot's content is unspecified,
    and so is that of a slot allocated with ``clear=False`` until a clear or a copy
    of a defined slot writes it."""

    def __init__(self, pool: mc.StatePool, host: mc.HostPool | None = None) -> None:
        self.tensors = [t.clone() for t in pool_tensors(pool)]
        # pool.tensors starts with the conv states: a shifted copy moves those by `shift` tokens, each
        # `token` elements of the last axis (1; the item size on byte views, tests/test_edges.py).
        self.token = [t.shape[-1] // c[-1] for t, c in zip(self.tensors, pool.spec.conv_shapes, strict=False)]
        self.host = [t.clone() for t in host.tensors] if host is not None else []
        self.host_held: set[int] = set(host.held()) if host is not None else set()
        # Draft buffers are written by the forward, never by events: a snapshot serves the whole step.
        self.drafts = [t.clone() for t in pool_tensors(pool, drafts=True)] if hasattr(pool, "draft_tensors") else []
        self.allocated: set[int] = set(pool.allocated_slots())
        self.defined: set[int] = set(self.allocated)
        self.host_defined: set[int] = set(self.host_held)

    def apply(self, events: Iterable[Any]) -> None:
        for ev in events:
            # A transfer's two halves: an export stages the slot's state as of here, an import reads a staged one.
            if isinstance(ev, mc.Export):
                ev = mc.Offload(ev.slot, ev.host, ev.request_id)
            elif isinstance(ev, mc.Import):
                ev = mc.Restore(ev.host, ev.slot, ev.request_id)
            if isinstance(ev, mc.Offload):
                for t, h in zip(self.tensors, self.host, strict=True):
                    h[:, ev.host] = t[:, ev.slot].clone()
                self.host_held.add(ev.host)
                self.host_defined.discard(ev.host)
                if ev.slot in self.defined:
                    self.host_defined.add(ev.host)
                continue
            if isinstance(ev, mc.Restore):
                for t, h in zip(self.tensors, self.host, strict=True):
                    t[:, ev.slot] = h[:, ev.host].clone()
                if ev.host in self.host_defined:
                    self.defined.add(ev.slot)
                else:
                    self.defined.discard(ev.slot)
                if not ev.keep:
                    self.host_held.discard(ev.host)
                continue
            if isinstance(ev, mc.DropHost):
                self.host_held.discard(ev.host)
                continue
            if isinstance(ev, mc.CommitDraft):
                if ev.accepted:
                    for t, d in zip(self.tensors, self.drafts, strict=True):
                        t[:, ev.slot] = d[:, ev.slot, ev.accepted - 1].clone()
                    self.defined.add(ev.slot)
                continue
            if isinstance(ev, mc.Clear) or (isinstance(ev, mc.Alloc) and ev.clear):
                for t in self.tensors:
                    t[:, ev.slot] = 0
                self.defined.add(ev.slot)
            if isinstance(ev, mc.Alloc):
                self.allocated.add(ev.slot)
            elif isinstance(ev, mc.CopyOnWrite):
                # The conv states (the first tensors) come from `src`, the rest from `temporal_src` (default `src`)
                ts = ev.src if ev.temporal_src is None else ev.temporal_src
                for i, t in enumerate(self.tensors):
                    row = t[:, ev.src if i < len(self.token) else ts].clone()
                    if ev.shift and i < len(self.token):  # time is the last axis: roll to the front, zero the end
                        n = ev.shift * self.token[i]
                        row = torch.roll(row, -n, dims=-1)
                        row[..., -n:] = 0
                    t[:, ev.dst] = row
                if ev.src in self.defined and ts in self.defined:
                    self.defined.add(ev.dst)
                else:
                    self.defined.discard(ev.dst)
            elif isinstance(ev, mc.Release):
                self.allocated.discard(ev.slot)
                self.defined.discard(ev.slot)

    def land(self, host: int, rows: list[torch.Tensor], defined: bool) -> None:
        """A transfer wrote ``rows`` (one ``[layers, *state]`` row per host tensor) into staging host slot ``host``
        of this side, now: the slot is held, and defined if the state sent was."""
        for h, row in zip(self.host, rows, strict=True):
            h[:, host] = row
        self.host_held.add(host)
        self.host_defined.discard(host)
        if defined:
            self.host_defined.add(host)

    def land_slot(self, slot: int, rows: list[torch.Tensor], defined: bool) -> None:
        """A transfer wrote ``rows`` straight into pool slot ``slot`` (awaiting them in place), now."""
        for t, row in zip(self.tensors, rows, strict=True):
            t[:, slot] = row
        self.defined.discard(slot)
        if defined:
            self.defined.add(slot)

    def write(self, slot: int, value: float) -> None:
        """A forward step writes every live slot: afterwards it is defined."""
        for t in self.tensors:
            t[:, slot] = value
        self.defined.add(slot)

    def assert_matches_shard(self, pool: mc.StatePool) -> None:
        """As :meth:`assert_matches`, for a tensor-parallel rank: it keeps no slot bookkeeping of its own."""
        for i, (want, got) in enumerate(zip(self.tensors, pool_tensors(pool), strict=True)):
            for s in sorted(self.allocated & self.defined):
                assert torch.equal(want[:, s], got[:, s]), f"tensor {i} slot {s} differs"

    def assert_matches(self, pool: mc.StatePool, host: mc.HostPool | None = None) -> None:
        if host is not None:
            assert set(host.held()) == self.host_held
            for i, (want, got) in enumerate(zip(self.host, host.tensors, strict=True)):
                for h in sorted(self.host_held & self.host_defined):
                    assert torch.equal(want[:, h], got[:, h]), f"host tensor {i} slot {h} differs"
        assert set(pool.allocated_slots()) == self.allocated
        for i, (want, got) in enumerate(zip(self.tensors, pool_tensors(pool), strict=True)):
            for s in sorted(self.allocated & self.defined):
                assert torch.equal(want[:, s], got[:, s]), f"tensor {i} slot {s} differs"
            # The padding slot is never written.
            assert torch.equal(want[:, 0], got[:, 0]), f"tensor {i} padding slot written"
