"""A prepared accelerator check of the core: every executor on a CUDA pool, byte for byte against the reference.

Not run by the tests (it needs CUDA; ``--device cpu`` checks the script itself).
On a machine with CUDA, in a venv with torch (CUDA build) and mambacache::

    python examples/cuda_check.py                 # 6 seeds x 120 steps per executor and workspace
    python examples/cuda_check.py --quick         # 2 seeds x 40 steps
    python examples/cuda_check.py --device cpu    # the script itself, on the CPU

Two managers take the same calls: one over a pool on ``--device`` (each
executor that runs there, at two copy workspace sizes), one over a CPU pool
with the one-slot-at-a-time ``reference`` executor. Random alloc, clear,
copy-on-write (shifted too), release, commit, offload, restore and drop calls,
some invalid: both managers must answer each the same way (the same slot ids,
or the same error type). Between flushes a "forward" writes the same random
bytes into both pools' held slots and draft buffers. After every flush each
held slot and held host slot must be equal byte for byte. A decode-like step
runs under :class:`mambacache.audit.OpAudit`: no op may read device data back to
the host. Exit status: 0 all equal, 1 a mismatch, 2 no such device.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from typing import Any

import torch

import mambacache as mc
from mambacache.audit import OpAudit

SLOTS, HOST_SLOTS = 20, 12


def spec() -> mc.StateSpec:
    return mc.StateSpec(
        num_layers=3,
        conv_shapes=[(24, 4), (8, 4)],
        temporal_shape=(2, 8, 8),
        conv_dtype=torch.bfloat16,
        temporal_dtype=torch.float32,
        draft_tokens=2,
    )


class Pair:
    """The same calls on a manager over a device pool and on a reference manager over a CPU pool."""

    def __init__(self, device: str, executor: str | None, workspace: int, seed: int) -> None:
        s = spec()
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.dev = mc.StatePool(s, SLOTS, device=device)
        self.ref = mc.StatePool(s, SLOTS, device="cpu")
        self.hdev, self.href = mc.HostPool(s, HOST_SLOTS), mc.HostPool(s, HOST_SLOTS)
        self.mdev = mc.CacheManager(self.dev, executor, workspace, host_pool=self.hdev)
        self.mref = mc.CacheManager(self.ref, "reference", host_pool=self.href)
        self.stack = contextlib.ExitStack()
        for m in (self.mdev, self.mref):
            self.stack.enter_context(m)
        self.held: dict[int, str] = {}
        self.hosts: list[int] = []
        self.calls = 0

    def both(self, name: str, *args: Any, **kw: Any) -> Any:
        """Call ``name`` on both managers: equal results or equal error types (then nothing changed in either)."""
        self.calls += 1
        out: list[Any] = []
        for m in (self.mdev, self.mref):
            try:
                out.append(("ok", getattr(m, name)(*args, **kw)))
            except mc.MambaCacheError as exc:
                out.append(("err", type(exc).__name__))
        if out[0] != out[1]:
            raise AssertionError(f"{name}{args}{kw}: device {out[0]} != reference {out[1]}")
        return out[0][1] if out[0][0] == "ok" else None

    def random_call(self) -> None:
        r, rng = self.rng.random(), self.rng
        slot = rng.choice(sorted(self.held)) if self.held and rng.random() < 0.9 else rng.randrange(1, SLOTS + 1)
        other = rng.choice(sorted(self.held)) if self.held else 1
        tenant = self.held.get(slot)
        if r < 0.22:
            n = rng.randint(1, 2)
            name = f"r{self.calls}"
            for s in self.both("alloc", n, name) or []:
                self.held[s] = name
        elif r < 0.34:
            self.both("clear", slot, tenant)
        elif r < 0.52:
            shift = rng.choice([0, 0, 1, 2])
            self.both("copy_on_write", other, slot, tenant, shift=shift)
        elif r < 0.64:
            self.both("release", slot, tenant)
        elif r < 0.72:
            self.both("commit_draft", slot, rng.randint(0, 2), tenant)
        elif r < 0.82:
            h = self.both("offload", slot, tenant)
            if h is not None:
                self.hosts.append(h)
        elif r < 0.92 and self.hosts:
            h = rng.choice(self.hosts)
            self.both("restore", h, slot, tenant, keep=rng.random() < 0.5)
        elif self.hosts:
            h = self.hosts.pop(rng.randrange(len(self.hosts)))
            self.both("drop", h)

    def forward(self) -> None:
        """The same random bytes into both pools' held slots and draft buffers (what a forward would write)."""
        held = sorted(self.held)
        if not held:
            return
        idx = torch.tensor(held)
        for td, tr in zip(
            self.dev.tensors + self.dev.draft_tensors, self.ref.tensors + self.ref.draft_tensors, strict=True
        ):
            shape = (tr.shape[0], len(held), *tr.shape[2:])
            val = (
                torch.randn(shape, generator=self.gen).to(tr.dtype)
                if tr.is_floating_point()
                else torch.zeros(shape, dtype=tr.dtype)
            )
            tr[:, idx] = val
            td[:, idx.to(td.device)] = val.to(td.device)

    def compare(self, where: str) -> None:
        held = sorted(self.held)
        for i, (td, tr) in enumerate(zip(self.dev.tensors, self.ref.tensors, strict=True)):
            a, b = td[:, held].cpu(), tr[:, held]
            if not torch.equal(
                a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b
            ):
                bad = [s for j, s in enumerate(held) if not torch.equal(a[:, j], b[:, j])]
                raise AssertionError(f"{where}: pool tensor {i} differs at slots {bad}")
        hosts = sorted(self.href.held())
        for i, (hd, hr) in enumerate(zip(self.hdev.tensors, self.href.tensors, strict=True)):
            if hosts and not torch.equal(hd[:, hosts], hr[:, hosts]):
                raise AssertionError(f"{where}: host tensor {i} differs")

    def run(self, steps: int) -> None:
        for step in range(steps):
            for _ in range(self.rng.randint(1, 8)):
                self.random_call()
                # What the calls left held (a release, a restore without keep, a drop): the reference's ledger says.
                self.held = {s: t for s, t in self.held.items() if self.ref.is_allocated(s)}
                self.hosts = sorted(self.href.held())
            self.mdev.flush_nowait()
            self.mref.flush_nowait()
            if self.dev.device.type == "cuda":
                torch.cuda.synchronize()
            self.compare(f"step {step}")
            self.forward()

    def close(self) -> None:
        self.stack.close()


def audit_decode(device: str) -> list[str]:
    """One decode-like step (2 releases, 2 allocs, 2 forks) under OpAudit: the ops that read device data back."""
    s = spec()
    pool = mc.StatePool(s, SLOTS, device=device)
    with mc.CacheManager(pool) as mgr:
        a = mgr.alloc(4, "warm")
        mgr.flush_nowait()
        mgr.release_many(a[:2], "warm")
        b = mgr.alloc(2, "new")
        mgr.copy_on_write(a[2], b[0], "new")
        mgr.copy_on_write(a[3], b[1], "new")
        with OpAudit() as audit:
            mgr.flush_nowait()
        mgr.release_many(a[2:], "warm")
        mgr.release_many(b, "new")
        mgr.flush_nowait()
    return list(audit.report().sync_ops)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    seeds, steps = (2, 40) if args.quick else (6, 120)
    failed = 0
    for executor in (None, "torch", "npu"):
        for workspace in (1 << 10, 64 << 20):
            t0 = time.perf_counter()
            calls = 0
            try:
                for seed in range(seeds):
                    pair = Pair(args.device, executor, workspace, seed)
                    try:
                        pair.run(steps)
                    finally:
                        calls += pair.calls
                        pair.close()
                status = "equal"
            except AssertionError as exc:
                failed += 1
                status = f"MISMATCH: {exc}"
            except mc.MambaCacheError as exc:
                status = f"refused: {type(exc).__name__}: {exc}"
            print(
                f"executor={executor or 'default'} workspace={workspace}: {seeds} seeds x {steps} steps,"
                f" {calls} calls, {time.perf_counter() - t0:.1f}s: {status}",
                flush=True,
            )
    syncs = audit_decode(args.device)
    print(f"decode step host reads: {syncs or 'none'}")
    failed += bool(syncs)
    print("ok" if not failed else f"FAILED ({failed})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
