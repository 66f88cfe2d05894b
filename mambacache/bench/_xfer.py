"""``mambacache bench --transfer``: a StateTransfer of n slots against a plain send/recv of the same bytes.

Two processes (rank 0 prefill, rank 1 decode) over gloo on 127.0.0.1, one
torch thread each (two ranks share the machine, as two engines would share a
host). Per size, rounds alternate the two paths (which goes first flips every
round), so a slow spell of a shared machine hits both alike:

* ``transfer``: ``export`` of n slots spread over the pool, ``flush_nowait``
  (the staging copies into the host pool), ``StateTransfer.send`` / ``receive``
  (header, ids, the rows, the acknowledgement), ``import_into`` of n slots and
  the receiver's ``flush_nowait`` (the copies into its pool);
* ``in_place``: the same with ``export(..., in_place=True)`` of n slots that are
  one run (no staging copy: the rows go straight from the pool slots) and, on
  the receiver, ``expect_import`` of its n slots (one run) before the round:
  the rows land straight in them and ``import_into`` copies nothing;
  ``in_place_spread``: the same from the spread slots (the send gathers them:
  one copy);
* ``staged_awaiting``: the transfer's staged export of the spread slots, into
  the receiver's n slots awaiting the states (``expect_import`` before the
  round, as in place): the rows are read from the sender's host pool straight
  into them, and ``import_into`` copies nothing (the staging copy stays);
* ``send``: one ``dist.send`` / ``dist.recv`` of a ready contiguous buffer of the
  same bytes, the bound of this group and link; over ``transport="nixl"`` or
  ``"mooncake"``, one raw read of that buffer by the receiver over the same
  transport (its wire, the buffer registered once), started by a one-word
  message: the bound of that transport here.

Both are timed on the sender from the start to the receiver's one-word "done",
so each includes one small message's latency. The first transfer round of each
size is checked byte for byte (untimed): a benchmark that moved the wrong bytes
fails.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch

from .._core._pool import StatePool
from .._core._spec import StateSpec
from .._handoff._link import root_store
from .._handoff._transfer import StateTransfer
from .._handoff._transports._base import Transport, Wire
from .._handoff._transports._pick import make as make_transport
from .._manager import CacheManager
from .._tiers._hostpool import HostPool
from ._presets import fit_layers, lookup

__all__ = ["transfer_vs_send"]

PATHS = ("transfer", "in_place", "in_place_spread", "staged_awaiting", "send")
TRANSFERS = PATHS[:-1]
# Per process: the pool, the host pool, the plain path's buffer and the transfer's gathered rows, each about
# max(sizes) slots; two processes.
COPIES = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fill(pool: StatePool, seed: int) -> None:
    """Random bytes (compared as bytes: a NaN pattern must still compare equal)."""
    g = torch.Generator().manual_seed(seed)
    for t in pool.tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def transfer_vs_send(
    preset: str, sizes: list[int], repeats: int, budget_bytes: int, *, timeout: float = 60.0, transport: str = "gloo"
) -> list[dict[str, Any]]:
    """One row per size: the transfer's and the plain send's median and best milliseconds, and their ratio.

    ``ratio`` is the transfer's median over the send's (1.0 = no cost over moving
    the bytes), ``best_ratio`` the same of the fastest rounds, ``ratio_paired``
    (``in_place_ratio_paired``, ...) the median of each round's ratio. ``stage_ms`` (export
    and flush on the sender), ``wire_ms`` (``send`` until the acknowledgement) and
    ``land_ms`` (``import_into`` and flush on the receiver) split the transfer's
    median round. Layers are cut so that both processes fit ``budget_bytes``.
    """
    import torch.multiprocessing as mp

    spec = fit_layers(lookup(preset).spec, COPIES * max(sizes), budget_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        args = (_free_port(), spec, sizes, repeats, timeout, tmp, transport)
        mp.spawn(_worker, args=args, nprocs=2, join=True)  # type: ignore[attr-defined,no-untyped-call]
        with open(os.path.join(tmp, "0.json"), encoding="utf-8") as f:
            sender = json.load(f)
        with open(os.path.join(tmp, "1.json"), encoding="utf-8") as f:
            receiver = json.load(f)
    rows = []
    for n in sizes:
        t, land = sender[str(n)], receiver[str(n)]
        row: dict[str, Any] = {
            "preset": preset, "transport": transport, "layers": spec.num_layers, "slots": n,
            "bytes": n * spec.slot_bytes,
        }  # fmt: skip
        for path in PATHS:
            row[f"{path}_ms"] = statistics.median(t[path]) * 1e3
            row[f"{path}_min_ms"] = min(t[path]) * 1e3
            row[f"{path}_gb_s"] = row["bytes"] / statistics.median(t[path]) / 1e9
        row["ratio"] = row["transfer_ms"] / row["send_ms"]
        row["best_ratio"] = row["transfer_min_ms"] / row["send_min_ms"]
        row["in_place_ratio"] = row["in_place_ms"] / row["send_ms"]
        row["in_place_spread_ratio"] = row["in_place_spread_ms"] / row["send_ms"]
        row["staged_awaiting_ratio"] = row["staged_awaiting_ms"] / row["send_ms"]
        for path in TRANSFERS:
            tag = "" if path == "transfer" else f"{path}_"
            # Each round's time over the plain path's of the same round (they ran back to back), the median: on a
            # shared machine the load drifts from round to round, and a ratio of medians mixes rounds apart.
            row[f"{tag}ratio_paired"] = statistics.median(a / b for a, b in zip(t[path], t["send"], strict=True))
            row[f"{tag}stage_ms"] = statistics.median(t[f"{path}_stage"]) * 1e3
            row[f"{tag}wire_ms"] = statistics.median(t[f"{path}_wire"]) * 1e3
            row[f"{tag}land_ms"] = statistics.median(land[path]) * 1e3
        row["rounds"] = len(t["transfer"])
        rows.append(row)
    return rows


def _worker(
    rank: int, port: int, spec: StateSpec, sizes: list[int], repeats: int, timeout: float, out: str, transport: str
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=timeout)
    )
    try:
        pool, host = StatePool(spec, max(sizes)), HostPool(spec, max(sizes))
        _fill(pool, 1234 + rank)
        with CacheManager(pool, host_pool=host) as mgr:
            xfer = StateTransfer(mgr, dist.group.WORLD, peer=1 - rank, timeout=timeout, transport=transport)
            side = (_Sender if rank == 0 else _Receiver)(mgr, xfer, _raw_wire(transport, rank, timeout))
            times = {str(n): side.size(n, repeats) for n in sizes}
        with open(os.path.join(out, f"{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(times, f)
    finally:
        dist.destroy_process_group()


def _raw_wire(transport: str, rank: int, timeout: float) -> tuple[Transport, Wire] | None:
    """The plain path's own transport and its wire ``0 > 1`` (None over gloo: ``dist.send`` is its bound)."""
    import torch.distributed as dist

    if transport == "gloo":
        return None
    store = root_store(dist.distributed_c10d._get_default_store())
    raw = make_transport(transport, store, rank, 1 - rank, timeout)
    keys = dist.distributed_c10d.PrefixStore("mambacache/bench/raw/", store)
    return raw, raw.wire(keys, 0, 1, rank, timeout)


class _Side:
    """What both ranks do around a round: the plain buffer and the rounds' order."""

    def __init__(self, mgr: CacheManager, xfer: StateTransfer, raw: tuple[Transport, Wire] | None) -> None:
        import torch.distributed as dist

        self.dist, self.mgr, self.xfer, self.raw = dist, mgr, xfer, raw
        self.done = torch.zeros(1, dtype=torch.int64)
        self.source: dict[str, Any] | None = None

    def size(self, n: int, repeats: int) -> Any:
        """Times of ``n`` slots: two warm-up rounds, then ``repeats`` rounds, the paths alternating."""
        buf = torch.empty(n * self.mgr.pool.spec.slot_bytes, dtype=torch.uint8)
        # The sender's bytes are its first n slots' (written, as the pool's are: a buffer never written reads as
        # the kernel's zero page, and a raw read of one took 1.4-2.7x as long here); the receiver's written too.
        if self.dist.get_rank() == 0:
            buf.copy_(torch.cat([t[:, 1 : n + 1].reshape(-1).view(torch.uint8) for t in self.mgr.pool.tensors]))
        else:
            buf.zero_()
        if self.raw is not None:  # registered once per size, its place told to the reader once (untimed)
            self.raw[0].register([buf])
            box = [self.raw[1].source([buf]) if self.dist.get_rank() == 0 else None]
            self.dist.broadcast_object_list(box, src=0)
            self.source = box[0]
        self.setup(n)
        for r in range(repeats + 2):
            for path in PATHS if r % 2 else PATHS[::-1]:
                self.prepare(path, n)
                self.dist.barrier()  # both sides start a round together: untimed
                if path == "send":
                    self.plain(buf, keep=r >= 2)
                else:
                    self.transfer(path, n, keep=r >= 2, check=r == 0)
        return self.times()

    def setup(self, n: int) -> None:
        """Per-size state (slot choice, buffers)."""

    def prepare(self, path: str, n: int) -> None:
        """Before a round of ``path`` (untimed)."""

    def plain(self, buf: torch.Tensor, keep: bool) -> None:
        """One plain round."""
        raise NotImplementedError

    def transfer(self, path: str, n: int, keep: bool, check: bool) -> None:
        """One transfer round of ``path``."""
        raise NotImplementedError

    def times(self) -> Any:
        """This size's samples, JSON-ready."""
        raise NotImplementedError


class _Sender(_Side):
    def setup(self, n: int) -> None:
        """Slots spread over the pool (every other where they fit: the staging copies are not one run)."""
        step = max(1, self.mgr.pool.num_slots // n)
        self.spread = [1 + i * step for i in range(n)]
        self.run = list(range(1, n + 1))
        self.samples: dict[str, list[float]] = {
            name: [] for path in TRANSFERS for name in (path, f"{path}_stage", f"{path}_wire")
        }
        self.samples["send"] = []

    def plain(self, buf: torch.Tensor, keep: bool) -> None:
        """Send the bytes (over a pulled transport: the word that starts the receiver's read), wait for the
        receiver's word."""
        t0 = time.perf_counter()
        self.dist.send(self.done if self.raw is not None else buf, 1)
        self.dist.recv(self.done, 1)
        if keep:
            self.samples["send"].append(time.perf_counter() - t0)

    def transfer(self, path: str, n: int, keep: bool, check: bool) -> None:
        """Export, stage, send until acknowledged, wait for the receiver's word that the states landed."""
        mgr, ids = self.mgr, [f"r{i}" for i in range(n)]
        slots = self.run if path == "in_place" else self.spread
        in_place = path.startswith("in_place")
        for s, r in zip(slots, ids, strict=True):
            mgr.alloc_slots([s], r, clear=False)
        mgr.flush_nowait()
        t0 = time.perf_counter()
        for s, r in zip(slots, ids, strict=True):
            mgr.export(s, r, in_place=in_place)
        mgr.flush_nowait()
        t1 = time.perf_counter()
        if self.xfer.send() != ids:
            raise RuntimeError("the transfer did not deliver every export")
        t2 = time.perf_counter()
        self.dist.recv(self.done, 1)
        t3 = time.perf_counter()
        if check:  # the receiver compares against these rows: untimed
            for t in mgr.pool.tensors:
                self.dist.send(t[:, slots].contiguous().view(torch.uint8), 1)
        if keep:
            self.samples[path].append(t3 - t0)
            self.samples[f"{path}_stage"].append(t1 - t0)
            self.samples[f"{path}_wire"].append(t2 - t1)

    def times(self) -> Any:
        """The sender's samples: both paths, and the transfer's stage and wire parts."""
        return self.samples


class _Receiver(_Side):
    def setup(self, n: int) -> None:
        """Import into the last ``n`` slots (not the sender's: the ids are the receiver's own)."""
        self.slots = list(range(self.mgr.pool.num_slots - n + 1, self.mgr.pool.num_slots + 1))
        self.land: dict[str, list[float]] = {path: [] for path in TRANSFERS}

    def plain(self, buf: torch.Tensor, keep: bool) -> None:
        """Receive the bytes (over a pulled transport: read them once the sender's word came), say done."""
        if self.raw is None:
            self.dist.recv(buf, 0)
        else:
            self.dist.recv(self.done, 0)
            self.raw[1].pull([buf], self.source, "raw", "raw", [])
        self.dist.send(self.done, 0)

    def prepare(self, path: str, n: int) -> None:
        """In place (and staged into awaiting slots), the slots await the states from before the round (an engine
        allocates them when it admits the requests, long before their states come)."""
        if path.startswith("in_place") or path == "staged_awaiting":
            for s, r in zip(self.slots, [f"r{i}" for i in range(n)], strict=True):
                self.mgr.expect_import(s, r)
            self.mgr.flush_nowait()

    def transfer(self, path: str, n: int, keep: bool, check: bool) -> None:
        """Receive, import, flush, say done; then free the slots (untimed)."""
        mgr = self.mgr
        ids = self.xfer.receive()
        t0 = time.perf_counter()
        for s, r in zip(self.slots, ids, strict=True):
            mgr.import_into(s, r)
        mgr.flush_nowait()
        t1 = time.perf_counter()
        self.dist.send(self.done, 0)
        if check:
            for t in mgr.pool.tensors:
                want = torch.empty_like(t[:, self.slots]).contiguous()
                self.dist.recv(want.view(torch.uint8), 0)
                if not torch.equal(t[:, self.slots].contiguous().view(torch.uint8), want.view(torch.uint8)):
                    raise RuntimeError(f"the transfer of {n} slots delivered different bytes")
        for s, r in zip(self.slots, ids, strict=True):
            mgr.release(s, r)
        mgr.flush_nowait()
        if keep:
            self.land[path].append(t1 - t0)

    def times(self) -> Any:
        """The receiver's samples: the landing part."""
        return self.land
