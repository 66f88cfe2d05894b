"""``simulate --scenario pd``: prefill and decode engines in separate processes, states handed over.

Ranks ``0 .. a - 1`` are the prefill engine (TP ``a``, ``--tp-prefill``), ranks
``a .. a + b - 1`` the decode engine (TP ``b``, ``--tp-decode``), over gloo on
127.0.0.1; one of ``a`` and ``b`` divides the other. Each prefill rank runs the
full model over a batch of prompts in a scratch pool (a sharded forward is not
the point here), writes *its shard* of each state into its own pool slot,
exports it and sends the batch: to its one decode rank when ``a >= b``, cut
into the ``b / a`` shards of its decode ranks when ``a < b``
(``ReslicingSender``). Each decode rank receives its shard (joined from
``a / b`` prefill ranks by a ``ReslicingReceiver`` when ``a > b``) and imports it
into a dirty slot. Every other batch goes in place (``export(..., in_place=True)``
on the prefill side, its slots awaiting it through ``expect_import`` on the
decode side: no staging copy, no restore copy), the rest staged through the
host pools. The decode forward runs the full model too: at ``b > 1`` the
other decode ranks send their imported shards to the first, which gathers the
whole state (checking that replicated parts agree) and decodes it, as a
sharded forward would read the shards. Its tokens are compared with the
request generated alone.

The attention KV of Qwen3-Next is an engine's KV connector's business, not
mambacache's: rank 0 ships it beside the first token on the same group
(``_send_side``), so the decode side can continue exactly.

Faults: ``skip-import`` allocates the decode slots without importing (outputs
must differ); ``kill-peer`` kills the last decode process after its first batch
(the prefill side must raise :class:`TransferError`, keep its slots, and the
run must end nonzero, never hang).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .._core._errors import TransferError
from .._core._pool import StatePool
from .._handoff._reslice import ReslicingReceiver, ReslicingSender, StateLayout
from .._handoff._transfer import StateTransfer
from .._manager import CacheManager
from .._tiers._hostpool import HostPool
from ._config import PD_FAULTS
from ._models import HFModel, SimModel, build_model

__all__ = ["PD_FAULTS", "PdConfig", "PdReport", "layout_of", "run_cli", "simulate_pd"]


@dataclass(frozen=True, slots=True)
class PdConfig:
    """One prefill/decode run: ``requests`` in batches of ``batch`` (one transfer each)."""

    model: str = "toy"
    requests: int = 8
    seed: int = 0
    tp_prefill: int = 1
    tp_decode: int = 1  # one of tp_prefill and tp_decode divides the other
    batch: int = 4
    fault: str = "none"
    timeout: float = 10.0  # seconds one batch of a transfer may take (the receiver: once its header came)
    verify: bool = True
    state_dtype: str = "float32"
    transport: str = "gloo"  # the transfers' transport: gloo, nixl or mooncake


@dataclass(frozen=True, slots=True)
class PdReport:
    """What the decode side saw (``error``: the first rank's failure, e.g. a TransferError; None when clean)."""

    model: str
    requests: int
    completed: int
    mismatches: int
    tp_prefill: int
    tp_decode: int
    batches: int
    bytes_sent: int
    seconds: float
    fault: str
    mismatched_requests: tuple[str, ...] = ()
    error: str | None = None
    transport: str = "gloo"


def layout_of(model: SimModel) -> StateLayout:
    """How ``model``'s state divides across TP ranks: its config's rule, or the synthetic one for the toy."""
    if isinstance(model, HFModel):
        return StateLayout.from_config(model.config, model.spec)
    return StateLayout.synthetic(model.spec)


def _requests(cfg: PdConfig, vocab: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(cfg.seed)
    return [
        (f"r{i}", [rng.randrange(2, vocab) for _ in range(rng.randint(4, 12))], rng.randint(3, 8))
        for i in range(cfg.requests)
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def simulate_pd(cfg: PdConfig) -> PdReport:
    """Run the hand-off in ``tp_prefill + tp_decode`` spawned processes; the first decode rank's report (or the
    failure).

    Nothing hangs: every wait of a transfer is bounded by ``cfg.timeout``, and a
    process still alive past the overall deadline is killed and reported.
    """
    import torch.multiprocessing as mp

    start = time.monotonic()
    world = cfg.tp_prefill + cfg.tp_decode
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="mambacache-pd-") as out:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, out), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = start + 120 + 4 * cfg.timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results = {r: json.loads(f.read_text()) for r in range(world) if (f := Path(out, f"rank{r}.json")).exists()}
    errors = [
        f"rank {r}: {res['error'].splitlines()[0][:160]}" for r, res in sorted(results.items()) if res.get("error")
    ]
    errors += [f"rank {r} did not finish (killed after the deadline)" for r in stuck]
    errors += [
        f"rank {r} died (exit code {p.exitcode})" for r, p in enumerate(procs) if r not in results and r not in stuck
    ]
    decode = results.get(cfg.tp_prefill, {})
    sent = sum(res.get("bytes", 0) for r, res in results.items() if r < cfg.tp_prefill)
    return PdReport(
        model=cfg.model,
        requests=cfg.requests,
        completed=decode.get("completed", 0),
        mismatches=decode.get("mismatches", 0),
        tp_prefill=cfg.tp_prefill,
        tp_decode=cfg.tp_decode,
        batches=decode.get("batches", 0),
        bytes_sent=sent,
        seconds=round(time.monotonic() - start, 2),
        fault=cfg.fault,
        mismatched_requests=tuple(decode.get("mismatched", ())),
        error="; ".join(errors) or None,
        transport=cfg.transport,
    )


def _worker(rank: int, world: int, port: int, cfg: PdConfig, out: str) -> None:
    """One engine process: prefill for ranks below ``tp_prefill``, decode for the others; writes its result."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    try:
        import transformers

        transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    except ImportError:
        pass
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=cfg.timeout),
        )
        model = build_model(cfg.model, cfg.seed, cfg.state_dtype)
        if rank < cfg.tp_prefill:
            _prefill(rank, cfg, model, result)
        else:
            result = _decode(rank - cfg.tp_prefill, cfg, model)
    except TransferError as exc:
        result = {**result, "error": f"TransferError: {exc}"}
    except Exception as exc:  # reported, never swallowed: the parent turns it into a failed run
        result = {**result, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()  # gloo's teardown does not wait on a dead peer


def _batches(cfg: PdConfig, model: SimModel) -> list[list[tuple[str, list[int], int]]]:
    reqs = _requests(cfg, model.vocab_size)
    return [reqs[i : i + cfg.batch] for i in range(0, len(reqs), cfg.batch)]


def _sender(rank: int, cfg: PdConfig, layout: StateLayout, mgr: CacheManager) -> tuple[Any, int]:
    """Prefill rank ``rank``'s way out, and the bytes it sends per state: its shard to one decode rank, or cut
    into the shards of its ``tp_decode / tp_prefill`` decode ranks."""
    import torch.distributed as dist

    a, b = cfg.tp_prefill, cfg.tp_decode
    if a >= b:
        peer = a + rank // (a // b)
        return StateTransfer(
            mgr, dist.group.WORLD, peer=peer, timeout=cfg.timeout, transport=cfg.transport
        ), mgr.pool.spec.memory_bytes
    m = b // a
    peers = [a + rank * m + i for i in range(m)]
    sender = ReslicingSender(
        mgr, dist.group.WORLD, peers, layout.shard_layout(a), timeout=cfg.timeout, transport=cfg.transport
    )
    return sender, m * layout.shard_spec(b).memory_bytes


def _prefill(rank: int, cfg: PdConfig, model: SimModel, result: dict[str, Any]) -> None:
    """Prefill each batch on the full model, keep this rank's shard in a pool slot, export it, send the batch.

    ``result`` counts what was delivered as it goes, so a failure still reports it.
    """
    tp, layout = cfg.tp_prefill, layout_of(model)
    scratch = StatePool(model.spec, cfg.batch)
    pool = StatePool(layout.shard_spec(tp), cfg.batch)
    result.update(bytes=0, batches=0)
    with CacheManager(pool, host_pool=HostPool(pool.spec, cfg.batch)) as mgr:
        xfer, per_state = _sender(rank, cfg, layout, mgr)
        for number, batch in enumerate(_batches(cfg, model)):
            firsts, kvs = [], []
            slots = [mgr.alloc(1, request_id=rid)[0] for rid, _, _ in batch]
            mgr.flush_nowait()
            for j, ((rid, prompt, _), slot) in enumerate(zip(batch, slots, strict=True)):
                for t in scratch.tensors:
                    t[:, j + 1].zero_()
                ctx = model.new_context()
                model.bind(ctx, scratch, j + 1, 0)
                firsts.append(model.forward(ctx, prompt, 0))
                kvs.append(model.snapshot(ctx))
                full = [t[:, j + 1 : j + 2] for t in scratch.tensors]
                for dst, shard in zip(pool.tensors, layout.slice(full, tp, rank), strict=True):
                    dst[:, slot : slot + 1].copy_(shard)  # what a sharded forward would have written
                mgr.export(slot, request_id=rid, in_place=_in_place(cfg, number))
            mgr.flush_nowait()
            try:
                xfer.send()
            except TransferError:
                # The sender keeps what it could not hand over: every exported slot is still held.
                held = mgr.held()
                assert all(held.get(s) == rid for s, (rid, _, _) in zip(slots, batch, strict=True)), held
                raise
            result["bytes"] += per_state * len(batch)
            result["batches"] += 1
            if rank == 0:
                _send_side(firsts, kvs, tp)


def _in_place(cfg: PdConfig, number: int) -> bool:
    """Whether batch ``number`` is handed over in place (every other one; never with ``skip-import``, whose decode
    side allocates its slots itself)."""
    return number % 2 == 1 and cfg.fault != "skip-import"


def _send_side(firsts: list[int], kvs: list[Any], peer: int) -> None:
    """The first tokens and, for attention layers, their KV (the KV connector's part), in one header and tensors."""
    import torch.distributed as dist

    meta: list[int] = []
    for first, kv in zip(firsts, kvs, strict=True):
        layers = kv or []
        meta += [first, len(layers)]
        for i, keys, _ in layers:
            meta += [i, *keys.shape]
    dist.send(torch.tensor([len(meta)], dtype=torch.int64), peer)
    dist.send(torch.tensor(meta, dtype=torch.int64), peer)
    for kv in kvs:
        for _, keys, values in kv or []:
            dist.send(keys.contiguous(), peer)
            dist.send(values.contiguous(), peer)


def _recv_side(n: int, src: int) -> tuple[list[int], list[Any]]:
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src)
    meta_t = torch.zeros(int(size.item()), dtype=torch.int64)
    dist.recv(meta_t, src)
    meta, at = meta_t.tolist(), 0
    firsts, shapes = [], []
    for _ in range(n):
        firsts.append(meta[at])
        count, at = meta[at + 1], at + 2
        shapes.append([(meta[at + 5 * k], tuple(meta[at + 5 * k + 1 : at + 5 * k + 5])) for k in range(count)])
        at += 5 * count
    kvs = []
    for layers in shapes:
        snap = []
        for i, shape in layers:
            keys, values = torch.empty(shape), torch.empty(shape)
            dist.recv(keys, src)
            dist.recv(values, src)
            snap.append((i, keys, values))
        kvs.append(snap)
    return firsts, kvs


def _receiver(rank: int, cfg: PdConfig, layout: StateLayout, mgr: CacheManager) -> StateTransfer | ReslicingReceiver:
    """Decode rank ``rank``'s way in: its shard from one prefill rank, or joined from ``tp_prefill / tp_decode``."""
    import torch.distributed as dist

    a, b = cfg.tp_prefill, cfg.tp_decode
    if a <= b:
        return StateTransfer(mgr, dist.group.WORLD, peer=rank // (b // a), timeout=cfg.timeout, transport=cfg.transport)
    m = a // b
    xfers = [
        StateTransfer(mgr, dist.group.WORLD, peer=rank * m + i, timeout=cfg.timeout, transport=cfg.transport)
        for i in range(m)
    ]
    return ReslicingReceiver(mgr, xfers, layout.shard_layout(b))


def _whole(cfg: PdConfig, layout: StateLayout, pool: StatePool, slots: list[int], scratch: StatePool) -> None:
    """At ``tp_decode > 1``: every decode rank's imported shards of ``slots`` gathered into ``scratch``'s slots
    ``1 .. n`` on the first decode rank (the others only send theirs), for the full model's forward."""
    import torch.distributed as dist

    a, b, me = cfg.tp_prefill, cfg.tp_decode, dist.get_rank()
    index = torch.tensor(slots, dtype=torch.long)
    mine = [t.index_select(1, index) for t in pool.tensors]
    if me != a:
        for t in mine:
            dist.send(t, a)
        return
    shards = [mine]
    for k in range(a + 1, a + b):
        rows = [torch.empty_like(t) for t in mine]
        for t in rows:
            dist.recv(t, k)
        shards.append(rows)
    for dst, full in zip(scratch.tensors, layout.gather(shards), strict=True):
        dst[:, 1 : len(slots) + 1].copy_(full)


def _decode(rank: int, cfg: PdConfig, model: SimModel) -> dict[str, Any]:
    """Receive each batch (this rank's shard), import it into dirty slots; the first decode rank decodes the
    whole state and compares."""
    b, layout = cfg.tp_decode, layout_of(model)
    pool = StatePool(layout.shard_spec(b), cfg.batch)
    for t in pool.tensors:  # dirty: an old tenant's bytes, which only an import may replace
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(cfg.seed + 1)).to(t.dtype))
    scratch = StatePool(model.spec, cfg.batch) if b > 1 and rank == 0 else pool
    mismatched: list[str] = []
    completed = batches = 0
    with CacheManager(pool, host_pool=HostPool(pool.spec, cfg.batch * 2)) as mgr:
        receiver = _receiver(rank, cfg, layout, mgr)
        for number, batch in enumerate(_batches(cfg, model)):
            if cfg.fault == "kill-peer" and batches == 1 and rank == b - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a peer dies mid-run: the prefill side must notice, not hang
            slots = list(range(1, len(batch) + 1))
            if _in_place(cfg, number):  # admitted before their states come: they land in these slots
                for slot, (rid, _, _) in zip(slots, batch, strict=True):
                    mgr.expect_import(slot, request_id=rid)
                mgr.flush_nowait()
            ids = receiver.receive()
            assert ids == [rid for rid, _, _ in batch], ids
            firsts, kvs = _recv_side(len(batch), 0) if rank == 0 else ([], [])
            for slot, rid in zip(slots, ids, strict=True):
                if cfg.fault == "skip-import":
                    mgr.alloc_slots([slot], rid)  # the state never loads: the check must report a mismatch
                else:
                    mgr.import_into(slot, request_id=rid)
            mgr.flush_nowait()
            if b > 1:
                _whole(cfg, layout, pool, slots, scratch)
            for (rid, prompt, n), slot, first, kv in zip(batch, slots, firsts, kvs, strict=rank == 0):
                ctx = model.restore(kv) if kv else model.new_context()
                model.bind(ctx, scratch, slot, len(prompt))
                toks = [first]
                while len(toks) < n:
                    toks.append(model.forward(ctx, [toks[-1]], len(prompt) + len(toks) - 1))
                if cfg.verify and toks != model.generate(prompt, n):
                    mismatched.append(rid)
                completed += 1
            mgr.release_many(slots)
            mgr.flush_nowait()
            batches += 1
        if cfg.fault == "none":
            mgr.check_idle()
    return {"completed": completed, "mismatches": len(mismatched), "mismatched": mismatched, "batches": batches}


def _check_cli(args: Any, models: list[str]) -> None:
    """UsageError, before any process starts, for a run that cannot be what was asked."""
    from .._console import UsageError
    from .._core._errors import InvalidArgumentError, TransportUnavailableError
    from .._handoff._transports._pick import check_transport, one_host_ucx

    try:
        check_transport(args.transport)
    except TransportUnavailableError as exc:
        raise UsageError(f"--transport {args.transport}: {exc}") from None

    a, b = args.tp_prefill, args.tp_decode
    batch = PdConfig().batch
    if args.fault == "kill-peer" and args.requests <= batch:
        raise UsageError(
            f"--fault kill-peer kills a decode rank after its first batch of {batch} requests, so it never fires"
            f" with --requests {args.requests} (one batch): give --requests {batch + 1} or more"
        )
    if max(a, b) % min(a, b):
        raise UsageError(f"--tp-prefill {a} and --tp-decode {b}: one must divide the other")
    if args.transport == "nixl":
        one_host_ucx()
    for name in models:  # refuse a TP size the state does not divide by before any process starts
        for flag, tp in (("--tp-prefill", a), ("--tp-decode", b)):
            try:
                layout_of(build_model(name, args.seed, args.state_dtype)).check(tp)
            except InvalidArgumentError as exc:
                raise UsageError(f"{flag} {tp}: {exc}") from None


def run_cli(args: Any, models: list[str]) -> int:
    """``simulate --scenario pd``: one run per model; exit 1 unless the check passes (see ``docs/transfer-tp.md``).

    Passing means: no fault and 0 mismatches; ``skip-import`` and some; ``kill-peer``
    never passes (the run must end nonzero with the TransferError, and quickly).
    """
    from .._console import Progress, table, write_json

    _check_cli(args, models)
    a, b = args.tp_prefill, args.tp_decode
    reports = []
    with Progress(len(models), "simulate") as progress:  # a pd run is seconds per model, in other processes
        for name in models:
            cfg = PdConfig(
                model=name,
                requests=args.requests,
                seed=args.seed,
                tp_prefill=a,
                tp_decode=b,
                fault=args.fault,
                timeout=args.transfer_timeout,
                verify=not args.no_verify,
                state_dtype=args.state_dtype,
                transport=args.transport,
            )
            reports.append(simulate_pd(cfg))
            progress.advance(1, f"{name}: done")
    if args.json != "-":
        rows = [
            [r.model, r.completed, "-" if args.no_verify else r.mismatches, f"{r.tp_prefill} -> {r.tp_decode}",
             r.batches, r.bytes_sent, r.seconds, "yes" if r.error else "no"]
            for r in reports
        ]  # fmt: skip
        title = (
            f"mambacache simulate: scenario pd (prefill and decode in separate processes over {args.transport}),"
            f" {args.requests} requests, fault {args.fault}"
        )
        headers = ["model", "done", "mismatch", "tp", "batches", "bytes sent", "s", "error"]
        sys.stdout.write(table(headers, rows, title=title) + "\n")
    if args.json:
        write_json(args.json, [{**dataclasses.asdict(r), "verified": not args.no_verify} for r in reports])
    failed = False
    for r in reports:
        if r.error:
            sys.stderr.write(f"{r.model}: {r.error}\n")
            failed = True
        elif not args.no_verify and (r.mismatches > 0) == (args.fault == "none"):
            what = (
                f"{r.mismatches} mismatches: {', '.join(r.mismatched_requests[:5])}" if r.mismatches else "no mismatch"
            )
            sys.stderr.write(f"{r.model}: {what} (fault {args.fault})\n")
            failed = True
    return 1 if failed else 0
