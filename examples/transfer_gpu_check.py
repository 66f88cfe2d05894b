"""A prepared accelerator check of the state transfer (issue #20): pools on CUDA, NCCL in the group.

Not run by the tests (it needs CUDA). On a machine with CUDA, in a venv with
torch (CUDA build) and mambacache installed::

    python examples/transfer_gpu_check.py            # sizes 1,8,64, 10 timed rounds each
    python examples/transfer_gpu_check.py --quick    # sizes 1,8, 3 rounds
    python examples/transfer_gpu_check.py --cpu      # the gloo parts with CPU pools: checks the script itself
    python examples/transfer_gpu_check.py --transport nixl          # the hand-off over NIXL (pip install '.[nixl]')
    python examples/transfer_gpu_check.py --transport nixl --cpu    # the same with CPU pools

What it needs: NCCL refuses two ranks on one GPU, so the NCCL parts need two
GPUs (rank k on ``cuda:k``). With one GPU both ranks share ``cuda:0`` and only
the gloo parts run (the NCCL lines say "skipped: one GPU").

Two processes, rank 0 a prefill engine, rank 1 a decode engine, in one group
``init_process_group("cpu:gloo,cuda:nccl")`` (CPU tensors over gloo, CUDA
tensors over NCCL). Per size n (slots of the small bench preset, 1 MiB each):

1. ``transfer``: rank 0 exports n slots of a CUDA pool, flushes and
   ``StateTransfer.send()``s; rank 1 ``receive()``s, ``import_into``s n slots of
   its CUDA pool, flushes and synchronizes. The transfer stages in the host pool
   and sends host tensors, so this path is device -> host -> gloo -> host ->
   device. Every byte is compared with the sender's (the receiver rebuilds the
   sender's pool from the same seed): a mismatch exits 1.
2. ``in place``: the same with ``export(..., in_place=True)`` on rank 0 and
   ``expect_import`` of its n slots on rank 1 before the round: no host pool
   slot on either side; the send copies the CUDA rows to the host itself, the
   landing copies them into the awaiting CUDA slots and waits for that copy.
   Every byte is checked the same way.
3. ``nccl send``: one ``dist.send`` of a CUDA buffer of the same bytes (NCCL,
   device to device), synchronized on both sides: the bound of a
   device-staged transfer, which does not exist yet (docs/transfer.md says
   what it would take).
4. ``gloo send``: one ``dist.send`` of a host buffer of the same bytes: the
   wire the transfer uses today.

With ``--transport nixl`` the hand-off goes over NIXL (UCX with its CUDA
transports, ``cuda_copy`` and ``cuda_ipc``: two processes on one GPU or on
two): the transfer registers the CUDA pools as VRAM, so in place the receiver
reads the sender's device rows straight into its own device rows, no host hop
and no staging buffer (staged, the staging copies to and from the host pool
stay, as the staged hand-off is defined). A fifth path, ``nixl read``, is one
raw NIXL read of a device buffer of the same bytes (the bound of that wire).
After the rounds each rank checks that its transfer never grew a kept host
buffer (nothing gathered or scattered through the host) and that its transport
kept device memory (``devices`` names ``cuda``): either failing exits 1.

Rounds alternate the paths; it prints medians and bests and the ratios. Last,
with two GPUs, it makes an NCCL-only group and expects the hand-off to work
with exact bytes (since issue #32 the transfer agrees on each batch through the
group's store and moves the bytes over a gloo pair of its own, never the
group's backend); a failure or wrong bytes exits 1.
Exit status: 0 all as expected, 1 a mismatch or an unexpected outcome, 2 no CUDA
(without ``--cpu``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mambacache as mc
from mambacache.bench._presets import lookup

SPEC = lookup("small").spec
TIMEOUT = 30.0


def fill(pool: mc.StatePool, seed: int) -> None:
    """Random bytes, made on the CPU so that the other rank can rebuild them (compared as bytes)."""
    g = torch.Generator().manual_seed(seed)
    for t in pool.tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def word(rank: int, value: int = 0) -> None:
    """A one-word handshake over gloo (CPU): rank 0 waits for rank 1 (the 'done' after a path's round)."""
    t = torch.tensor([value], dtype=torch.int64)
    if rank == 0:
        dist.recv(t, 1)
    else:
        dist.send(t, 0)


def start(rank: int) -> None:
    """Both ranks begin a round together (gloo, CPU: a barrier on this group could pick NCCL)."""
    t = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)


def rounds(
    rank: int, device: torch.device, sizes: list[int], repeats: int, nccl: bool, transport: str = "gloo"
) -> dict[int, dict[str, list[float]]]:
    """One function because both ranks run the same rounds in lock step, each side's half inline.

    Returns the sender's seconds per path and size (the receiver's are empty).
    """
    top = max(sizes)
    pool, host = mc.StatePool(SPEC, top, device=device), mc.HostPool(SPEC, top)
    fill(pool, 100 + rank)
    sent = mc.StatePool(SPEC, top)  # rank 1: rank 0's pool, rebuilt on the CPU from its seed
    fill(sent, 100)
    paths = ["transfer", "in place", "gloo send"] + (["nccl send"] if nccl else [])
    paths += ["nixl read"] if transport == "nixl" else []
    handoffs = ("transfer", "in place")
    out: dict[int, dict[str, list[float]]] = {}
    with mc.CacheManager(pool, host_pool=host) as mgr:
        xfer = mc.StateTransfer(mgr, dist.group.WORLD, peer=1 - rank, timeout=TIMEOUT, transport=transport)
        for n in sizes:
            times: dict[str, list[float]] = {p: [] for p in paths}
            nbytes = n * SPEC.slot_bytes
            gloo_buf = torch.ones(nbytes, dtype=torch.uint8)
            dev_buf = torch.ones(nbytes, dtype=torch.uint8, device=device) if nccl else None
            raw = raw_read(xfer, rank, device, nbytes) if transport == "nixl" else None
            src = list(range(1, n + 1))
            dst = list(range(top - n + 1, top + 1))
            ids = [f"r{i}" for i in range(n)]
            for r in range(repeats + 2):
                for path in paths if r % 2 else paths[::-1]:
                    if rank == 0 and path in handoffs:
                        for s, i in zip(src, ids, strict=True):
                            mgr.alloc_slots([s], i, clear=False)
                        mgr.flush_nowait()
                    if rank == 1 and path == "in place":  # admitted before the states come
                        for s, i in zip(dst, ids, strict=True):
                            mgr.expect_import(s, i)
                        mgr.flush_nowait()
                    start(rank)
                    t0 = time.perf_counter()
                    if path in handoffs:
                        if rank == 0:
                            for s, i in zip(src, ids, strict=True):
                                mgr.export(s, i, in_place=path == "in place")
                            mgr.flush_nowait()
                            if xfer.send() != ids:
                                raise SystemExit("the transfer did not deliver every export")
                        else:
                            got = xfer.receive()
                            for s, i in zip(dst, got, strict=True):
                                mgr.import_into(s, i)
                            mgr.flush_nowait()
                            sync(device)
                    elif path == "gloo send":
                        (dist.send if rank == 0 else dist.recv)(gloo_buf, 1 - rank)
                    elif path == "nixl read":
                        assert raw is not None
                        if rank == 1:
                            raw[0].pull([raw[1]], raw[2], "raw", "raw", [])
                            sync(device)
                    else:
                        assert dev_buf is not None
                        (dist.send if rank == 0 else dist.recv)(dev_buf, 1 - rank)
                        sync(device)
                    word(rank)
                    if rank == 0 and r >= 2:
                        times[path].append(time.perf_counter() - t0)
                    if rank == 1 and path in handoffs:
                        check(pool, sent, src, dst, n)
                        for s, i in zip(dst, ids, strict=True):
                            mgr.release(s, i)
                        mgr.flush_nowait()
            out[n] = times
        if transport == "nixl":
            direct(xfer, device)
    return out


def raw_read(xfer: mc.StateTransfer, rank: int, device: torch.device, nbytes: int) -> tuple[Any, Any, Any]:
    """The ``nixl read`` path's wire (rank 1 reads rank 0's), its buffer on the pools' device (registered once)
    and where the sender's lies; over the transfer's own NIXL agent."""
    transport = xfer._out.wire.transport  # the transfer's NIXL agent, its pools registered
    buf = torch.ones(nbytes, dtype=torch.uint8, device=device)
    transport.register([buf])
    wire = transport.wire(None, 0, 1, rank, TIMEOUT)
    box = [wire.source([buf]) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return wire, buf, box[0]


def direct(xfer: mc.StateTransfer, device: torch.device) -> None:
    """Over NIXL the rows went straight between the pools (and the host pools): no kept host buffer was grown on
    either side, and device memory stayed registered (else its rows would go through the host)."""
    grown = [name for name, bufs in (("send", xfer._send_bufs), ("receive", xfer._bufs)) if bufs._flat]
    devices = xfer._out.wire.devices
    if grown:
        raise SystemExit(f"NOT DIRECT: the transfer's {' and '.join(grown)} buffers were grown (a host hop)")
    if device.type not in devices:
        raise SystemExit(f"NOT DIRECT: NIXL did not take {device.type} memory (it moves {devices}); UCX_TLS?")


def check(pool: mc.StatePool, sent: mc.StatePool, src: list[int], dst: list[int], n: int) -> None:
    """Every byte of the n imported slots equals the sender's; exit 1 (via the spawn error) if not."""
    for got, want in zip(pool.tensors, sent.tensors, strict=True):
        a = got[:, dst].cpu().contiguous().view(torch.uint8)
        b = want[:, src].contiguous().view(torch.uint8)
        if not torch.equal(a, b):
            raise SystemExit(f"MISMATCH: the transfer of {n} slots delivered different bytes")


def nccl_only(rank: int, device: torch.device) -> str:
    """The transfer over an NCCL-only group: expected to work (control through the group's store, bytes over the
    transfer's own gloo pair of host tensors), with exact bytes."""
    group = dist.new_group([0, 1], backend="nccl", timeout=timedelta(seconds=TIMEOUT))
    pool, host = mc.StatePool(SPEC, 2, device=device), mc.HostPool(SPEC, 2)
    fill(pool, 100 + rank)
    t0 = time.monotonic()
    with mc.CacheManager(pool, host_pool=host) as mgr:
        xfer = mc.StateTransfer(mgr, group, peer=1 - rank, timeout=10.0)
        try:
            if rank == 0:
                mgr.alloc_slots([1], "x", clear=False)
                mgr.export(1, "x")
                mgr.flush_nowait()
                xfer.send()
            else:
                xfer.receive()
                mgr.import_into(2, "x")
                mgr.flush_nowait()
                sent = mc.StatePool(SPEC, 2)
                fill(sent, 100)
                check(pool, sent, [1], [2], 1)
        except SystemExit:
            raise
        except Exception as exc:  # not expected since issue #32: the transfer never uses the group's backend
            raise SystemExit(f"FAILED over an NCCL-only group: {type(exc).__name__}: {exc}"[:300]) from exc
    return f"works with exact bytes in {time.monotonic() - t0:.1f} s (store control, own gloo pair)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine(rank: int, port: int, sizes: list[int], repeats: int, out: str, cpu: bool, transport: str) -> None:
    two = not cpu and torch.cuda.device_count() >= 2
    device = torch.device("cpu") if cpu else torch.device("cuda", rank if two else 0)
    if not cpu:
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if two else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=TIMEOUT))  # fmt: skip
    try:
        times = rounds(rank, device, sizes, repeats, nccl=two, transport=transport)
        note = nccl_only(rank, device) if two else "skipped: fewer than two GPUs (NCCL needs one GPU per rank)"
        if rank == 0:
            what = "CPU (--cpu)" if cpu else f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(device)}"
            lines = [f"pools on {what}, backend {backend}, the hand-off over {transport}"]
            for n, t in times.items():
                med = {p: statistics.median(v) * 1e3 for p, v in t.items()}
                best = {p: min(v) * 1e3 for p, v in t.items()}
                row = ", ".join(f"{p} {med[p]:.3f} ms (best {best[p]:.3f})" for p in t)
                ratios = ", ".join(
                    f"{h} x {p} {med[h] / med[p]:.2f}"
                    for h in ("transfer", "in place")
                    for p in t
                    if "send" in p or "read" in p
                )
                lines.append(f"n={n} ({n * SPEC.slot_bytes / 2**20:.1f} MiB): {row}; {ratios}")
            lines.append(f"NCCL-only group: {note}")
            if transport == "nixl":
                lines.append(f"nixl: rows moved between the pools' {device.type} memory directly (no host buffer)")
            with open(os.path.join(out, "report.txt"), "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sizes 1,8 and 3 rounds")
    ap.add_argument("--cpu", action="store_true", help="CPU pools, gloo only: a check of this script, not of a GPU")
    ap.add_argument(
        "--transport",
        choices=["gloo", "nixl", "mooncake"],
        default="gloo",
        help="the hand-off's transport (nixl, mooncake: pip install 'mambacache[nixl]' or '[mooncake]')",
    )
    args = ap.parse_args()
    if args.transport == "nixl":  # one host: UCX over TCP, shared memory and (on a GPU) CUDA copies
        os.environ.setdefault("UCX_TLS", "tcp,sm,self" if args.cpu else "tcp,sm,cuda_copy,cuda_ipc,self")
        os.environ.setdefault("UCX_MODULES", "^ib")  # see docs/transfer.md: its libnl copy crashes the exit
    if not args.cpu and not torch.cuda.is_available():
        print("needs CUDA (a CUDA build of torch and a GPU)", file=sys.stderr)
        return 2
    sizes, repeats = ([1, 8], 3) if args.quick else ([1, 8, 64], 10)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(engine, args=(port, sizes, repeats, tmp, args.cpu, args.transport), nprocs=2, join=True)
        except Exception as exc:  # a rank's SystemExit or error, as the spawn reports it
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
        with open(os.path.join(tmp, "report.txt"), encoding="utf-8") as f:
            print(f.read(), end="")
    print("transfer check: bytes exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
