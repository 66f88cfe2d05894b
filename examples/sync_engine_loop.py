"""A synchronous scheduler loop written the way SGLang's is: no event loop, engine-owned tensors,
engine-chosen slot ids, a persistent device index buffer for the kernels, and an idle leak check.

The "model" is a toy recurrence that reads its slots through the index tensor, so a wrong
clear or fork shows up as a wrong output: every request is checked against running it alone.

    python examples/sync_engine_loop.py
"""

from __future__ import annotations

import random

import torch

import mambacache as mc

LAYERS, SLOTS, CONV, HEADS = 2, 6, (8, 3), (2, 4, 4)
MAX_BATCH = 4


class Engine:
    """Owns its state tensors, as engines allocate them: views into one raw buffer."""

    def __init__(self) -> None:
        rows = LAYERS * (SLOTS + 1)
        sizes = [rows * 8 * 3, rows * 2 * 4 * 4]
        self.raw = torch.zeros(sum(sizes))
        conv, temporal = self.raw.split(sizes)
        self.conv = conv.view(LAYERS, SLOTS + 1, *CONV)
        self.temporal = temporal.view(LAYERS, SLOTS + 1, *HEADS)
        self.free = list(range(SLOTS, 0, -1))  # the engine picks slot ids itself (pops from the end)

    def forward(self, idx: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step for the batch: reads and writes each request's slot through `idx`."""
        conv, temporal = self.conv[:, idx], self.temporal[:, idx]
        shape = (1, -1) + (1,) * (conv.dim() - 2)
        conv = torch.roll(conv, 1, dims=-1) * 0.5 + tokens.view(shape)
        temporal = temporal * 0.9 + conv.mean(dim=(-2, -1)).view(*conv.shape[:2], 1, 1, 1)
        self.conv[:, idx], self.temporal[:, idx] = conv, temporal
        return temporal.sum(dim=(0, 2, 3, 4))


def alone(prefix: list[float], tokens: list[float]) -> list[float]:
    """The same request on a fresh engine with no batching, no forks, no reuse."""
    eng = Engine()
    idx = torch.tensor([1])
    for t in prefix:
        eng.forward(idx, torch.tensor([t]))
    return [float(eng.forward(idx, torch.tensor([t]))[0]) for t in tokens]


def main() -> None:
    rng = random.Random(0)
    eng = Engine()
    eng.raw.normal_()  # the pool starts dirty: a missed clear would show
    pool = mc.StatePool.from_tensors(conv=[eng.conv], temporal=eng.temporal)
    idx = mc.StateIndices(capacity=MAX_BATCH, device=pool.device, num_slots=SLOTS)
    prefix = [0.3, -1.0, 0.7]
    requests = {f"r{i}": [rng.uniform(-1, 1) for _ in range(rng.randint(2, 6))] for i in range(12)}
    waiting, running, outputs = list(requests), {}, {rid: [] for rid in requests}
    steps = 0
    with mc.CacheManager(pool) as mgr:
        # A cached prefix state, computed once, forked into every request.
        (cached,) = mgr.alloc_slots([eng.free.pop()], request_id="prefix-cache")
        mgr.flush_nowait()
        for t in prefix:
            idx.update([cached])
            eng.forward(idx.tensor[:1], torch.tensor([t]))
        while waiting or running:
            # Admit: the engine picks slot ids; new slots are forked from the prefix (no clear needed).
            while waiting and len(running) < MAX_BATCH and eng.free:
                rid = waiting.pop(0)
                (slot,) = mgr.alloc_slots([eng.free.pop()], request_id=rid, clear=rng.random() < 0.5)
                mgr.copy_on_write(cached, slot, request_id=rid)
                running[rid] = slot
            # The deferred clears and forks run before the forward, on its stream, in one flush.
            mgr.flush_nowait()
            batch = list(running)
            idx.update([running[r] for r in batch])  # same tensor, same address every step
            pos = {r: len(outputs[r]) for r in batch}
            tokens = torch.tensor([requests[r][pos[r]] for r in batch])
            out = eng.forward(idx.tensor[: len(batch)], tokens)
            for r, y in zip(batch, out.tolist(), strict=True):
                outputs[r].append(y)
            finished = [r for r in batch if len(outputs[r]) == len(requests[r])]
            if finished:
                slots = [running.pop(r) for r in finished]
                for r, s in zip(finished, slots, strict=True):
                    mgr.release(s, request_id=r)
                eng.free.extend(slots)
            steps += 1
        mgr.release(cached, request_id="prefix-cache")
        mgr.flush_nowait()
        mgr.check_idle()  # raises SlotLeakError naming any slot still held
    exact = all(
        torch.allclose(torch.tensor(outputs[r]), torch.tensor(alone(prefix, requests[r])), atol=1e-5) for r in requests
    )
    print(f"sync loop: {len(requests)} requests in {steps} steps through {SLOTS} slots;"
          f" outputs {'exact' if exact else 'WRONG'}; 0 slots held")  # fmt: skip


if __name__ == "__main__":
    main()
