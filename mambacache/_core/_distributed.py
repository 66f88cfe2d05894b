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

A broadcast stopped by an interrupt is resumed, not repeated: each rank keeps
its plan's message (the buffers and the works of the broadcasts issued) until
it is done, and the next send (the same step's) or receive waits on what was
issued and issues the rest. Only an interrupt between a broadcast's issue and
its record leaves a rank unable to tell what it sent or took: the channel is
then broken on that rank (:class:`DistributedError` from then on).
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from typing import Any

import torch

from ._channel import Channel
from ._errors import DistributedError
from ._planner import Plan, decode_plan, encode_plan

__all__ = ["DistributedChannel"]

CAPACITY = 1024  # int64s in the first message; a larger plan sends its tail in a second one
_HEAD = CAPACITY - 1  # the last cell of the first message carries the total length


class _Message:
    """One plan's broadcasts on this rank: the buffers (the head, then the tail of a long plan), the works of
    those issued, and the broadcast last begun (``issuing``): begun and its work not recorded, a stop there
    leaves the rank unable to tell whether it was issued (:attr:`in_doubt`)."""

    __slots__ = ("bufs", "issuing", "step", "works")

    def __init__(self, step: int, bufs: list[torch.Tensor]) -> None:
        self.step, self.bufs = step, bufs
        self.works: list[Any] = []
        self.issuing = -1

    @property
    def in_doubt(self) -> bool:
        return self.issuing == len(self.works)

    @property
    def begun(self) -> bool:
        """Whether a broadcast of it was issued, or may have been."""
        return bool(self.works) or self.in_doubt


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
        self._message: _Message | None = None  # the plan being sent or received (received: until consumed)

    def check_source(self, what: str) -> None:
        if not self.is_source:
            raise DistributedError(
                f"{what} on rank {self.rank}: in tensor-parallel mode only the source rank {self.src_rank} submits"
                " events; the other ranks only flush"
            )

    def _check(self) -> None:
        if self._broken is not None:
            raise DistributedError(f"the plan channel failed earlier: {self._broken}")

    def _run(self, message: _Message) -> None:
        """Issue the broadcasts of ``message`` not issued yet and wait for each (a wait repeated on a finished
        broadcast returns at once). Blocking, bounded by the timeout; after a failure, or a stop between an
        issue and its record, the channel is broken for good on this rank.

        Every message gets fresh buffers, so a broadcast still in flight (after a
        timeout) can never be overwritten by the next plan.
        """
        broadcast = partial(self._dist.broadcast, src=self.src_rank, group=self.group, async_op=True)
        try:
            i = 0
            while i < len(message.bufs):
                if i == len(message.works):
                    message.issuing = i
                    message.works.append(broadcast(message.bufs[i]))  # one line: issued and recorded, or neither
                message.works[i].wait(self.timeout)
                total = int(message.bufs[0][_HEAD])
                if i == 0 and total > _HEAD and len(message.bufs) == 1:  # a receiver learns of a tail
                    message.bufs.append(torch.zeros(total - _HEAD, dtype=torch.int64))
                i += 1
        except BaseException as exc:
            if isinstance(exc, Exception) or message.in_doubt:
                self._broken = repr(exc)
            if not isinstance(exc, Exception):
                raise
            raise DistributedError(
                f"rank {self.rank}: plan broadcast from rank {self.src_rank} failed or timed out after"
                f" {self.timeout.total_seconds():g}s (a peer died or stopped flushing): {exc}"
            ) from exc

    def send(self, step: int, plan: Plan) -> None:
        self._check()
        message = self._message
        if message is None or message.step != step or not message.begun:
            data = [self._num_slots, *encode_plan(plan, step)]
            head = torch.zeros(CAPACITY, dtype=torch.int64)
            n = min(len(data), _HEAD)
            head[:n] = torch.tensor(data[:n], dtype=torch.int64)
            head[_HEAD] = len(data)
            bufs = [head] if len(data) <= _HEAD else [head, torch.tensor(data[_HEAD:], dtype=torch.int64)]
            message = self._message = _Message(step, bufs)
        elif message.in_doubt:  # the last send stopped between an issue and its record
            self._broken = f"a send of step {step} stopped as it issued a broadcast"
            self._check()
        self._run(message)  # a repeat of a step that left: waits on what was issued, issues the rest

    def sent(self, step: int) -> bool | None:
        message = self._message
        if message is None or message.step != step or not message.begun:
            return False
        if message.in_doubt or self._broken is not None:
            self._broken = self._broken or f"a send of step {step} stopped as it issued a broadcast"
            return None
        return True

    def receive(self) -> tuple[int, Plan]:
        self._check()
        message = self._message
        if message is None:
            message = self._message = _Message(-1, [torch.zeros(CAPACITY, dtype=torch.int64)])
        elif message.in_doubt:  # the last receive stopped between an issue and its record
            self._broken = "a receive stopped as it issued a broadcast"
            self._check()
        self._run(message)
        total = int(message.bufs[0][_HEAD])
        data: list[int] = message.bufs[0][: min(total, _HEAD)].tolist()
        if total > _HEAD:
            data += message.bufs[1].tolist()
        num_slots, *rest = data
        if num_slots != self._num_slots:
            self._broken = f"num_slots {num_slots} on rank {self.src_rank}, {self._num_slots} here"
            raise DistributedError(f"rank {self.rank}: pools differ: {self._broken}; every rank needs the same")
        step, plan = decode_plan(rest)
        message.step = step
        return step, plan

    def consumed(self, step: int) -> None:
        message = self._message
        if message is not None and message.step == step:
            self._message = None
