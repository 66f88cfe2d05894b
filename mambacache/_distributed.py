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
from typing import Any

import torch

from ._channel import Channel
from ._errors import DistributedError
from ._planner import Plan, decode_plan, encode_plan

__all__ = ["DistributedChannel"]

CAPACITY = 1024  # int64s in the first message; a larger plan sends its tail in a second one


class DistributedChannel(Channel):
    """A :class:`Channel` over a ``torch.distributed`` group: each plan is one int64 broadcast (two if long).

    Every message carries ``num_slots`` too, checked on every rank, so pools of
    different sizes fail loudly instead of applying slot ids that mean other slots.
    """

    def __init__(self, group: Any, src_rank: int, num_slots: int, timeout: float) -> None:
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
        self._num_slots = num_slots

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

    def send(self, step: int, plan: Plan) -> None:
        self._transfer([self._num_slots, *encode_plan(plan, step)])

    def receive(self) -> tuple[int, Plan]:
        num_slots, *message = self._transfer(None)
        if num_slots != self._num_slots:
            self._broken = f"num_slots {num_slots} on rank {self.src_rank}, {self._num_slots} here"
            raise DistributedError(f"rank {self.rank}: pools differ: {self._broken}; every rank needs the same")
        return decode_plan(message)
