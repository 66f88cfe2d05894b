"""Tensor-parallel mode: one scheduler (the source rank) plans, every rank applies.

Each rank's pool holds its own shard of every state (heads or channels split),
with the same ``num_slots``. Per flush, the source rank plans the step and
broadcasts the plan as one int64 tensor message (the planner's wire format: no
pickling); every other rank decodes it and runs the same stages on its shard.
Slot bookkeeping lives on the source rank only.

The plan is host data of a few bytes per event, so it travels on a CPU (gloo)
group: the given group when it is gloo, else a gloo group over the same ranks.
Device data never crosses ranks. The wait runs in a worker thread, so the event
loop is never blocked, and it has a timeout: a dead or silent peer surfaces as
:class:`DistributedError` on every live rank instead of a hang.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ._errors import DistributedError
from ._planner import Plan, decode_plan, encode_plan

if TYPE_CHECKING:
    from ._manager import CacheManager
    from ._pool import StatePool

__all__ = ["PlanChannel"]

CAPACITY = 1024  # int64s in the first message; a larger plan sends its tail in a second one


class PlanChannel:
    def __init__(self, group: Any, src_rank: int, pool: StatePool, timeout: float) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise DistributedError("torch.distributed is not initialized: call init_process_group first")
        self._dist = dist
        self.rank = dist.get_rank()
        self.src_rank = src_rank
        ranks = dist.get_process_group_ranks(group)
        if src_rank not in ranks:
            raise DistributedError(f"src_rank {src_rank} is not in the group (ranks {ranks})")
        self.is_source = self.rank == src_rank
        self.group = group if dist.get_backend(group) == "gloo" else dist.new_group(ranks, backend="gloo")
        self.timeout = timedelta(seconds=timeout)
        self._broken: str | None = None
        self._num_slots = pool.num_slots  # sent with every plan, checked on every rank

    def check_source(self, what: str) -> None:
        if not self.is_source:
            raise DistributedError(
                f"{what} on rank {self.rank}: in tensor-parallel mode only the source rank {self.src_rank} submits"
                " events; the other ranks only flush"
            )

    def _broadcast(self, tensor: torch.Tensor) -> None:
        work = self._dist.broadcast(tensor, src=self.src_rank, group=self.group, async_op=True)
        work.wait(self.timeout)

    def _transfer(self, message: list[int] | None) -> list[int]:
        """Broadcast ``message`` from the source; receive it elsewhere. Blocking, bounded by the timeout.

        Every message gets fresh buffers, so a send still in flight (after a
        timeout) can never be overwritten by the next plan; after any failure
        the channel is broken for good on this rank.
        """
        if self._broken is not None:
            raise DistributedError(f"the plan channel failed earlier: {self._broken}")
        head = CAPACITY - 1  # the last cell carries the total length
        try:
            buf = torch.zeros(CAPACITY, dtype=torch.int64)
            if message is not None:
                n = min(len(message), head)
                buf[:n] = torch.tensor(message[:n], dtype=torch.int64)
                buf[head] = len(message)
            self._broadcast(buf)
            total = int(buf[head])
            data: list[int] = buf[: min(total, head)].tolist()
            if total > head:
                if message is not None:
                    tail = torch.tensor(message[head:], dtype=torch.int64)
                else:
                    tail = torch.zeros(total - head, dtype=torch.int64)
                self._broadcast(tail)
                data += tail.tolist()
            return data
        except BaseException as exc:
            self._broken = repr(exc)
            if not isinstance(exc, Exception):
                raise
            raise DistributedError(
                f"rank {self.rank}: plan broadcast from rank {self.src_rank} failed or timed out after"
                f" {self.timeout.total_seconds():g}s (a peer died or stopped flushing): {exc}"
            ) from exc

    def _take_plan(self, mgr: CacheManager) -> tuple[list[int], int, Plan, float]:
        plan, step, plan_s = mgr._take_plan()
        return [self._num_slots, *encode_plan(plan, step)], step, plan, plan_s

    def _received(self, mgr: CacheManager, data: list[int]) -> tuple[int, Plan, float]:
        num_slots, *message = data
        if num_slots != self._num_slots:
            self._broken = f"num_slots {num_slots} on rank {self.src_rank}, {self._num_slots} here"
            raise DistributedError(f"rank {self.rank}: pools differ: {self._broken}; every rank needs the same")
        step, plan = decode_plan(message)
        with mgr._lock:
            mgr._step = step + 1
        return step, plan, 0.0

    def exchange_blocking(self, mgr: CacheManager) -> tuple[int, Plan, float]:
        """The step's plan on every rank: planned and sent on the source, received elsewhere."""
        if self.is_source:
            message, step, plan, plan_s = self._take_plan(mgr)
            self._transfer(message)
            return step, plan, plan_s
        return self._received(mgr, self._transfer(None))

    async def exchange(self, mgr: CacheManager) -> tuple[int, Plan, float]:
        """As :meth:`exchange_blocking`, with the wait in a worker thread; the caller shields it.

        Once the source has taken the events, the broadcast and the local apply
        must both happen, or the ranks part: so the whole exchange runs shielded
        from cancellation, bounded by the channel's timeout instead.
        """
        if self.is_source:
            message, step, plan, plan_s = self._take_plan(mgr)
            await anyio.to_thread.run_sync(self._transfer, message)
            return step, plan, plan_s
        data = await anyio.to_thread.run_sync(self._transfer, None)
        return self._received(mgr, data)
