"""ManagerCore: the facade a scheduler calls, less the hand-off; it checks arguments and delegates.

::

    ManagerCore ── arguments, lifecycle, the public surface (CacheManager adds the hand-off above it)
      ├─ StepQueue   (_queue)  events of the next step, checked against the ledgers, under the lock
      ├─ FlushCore   (_flush)  one flush at a time: take, plan, send/receive over the Channel, run
      └─ StepRunner  (_runner) the pool's backlog through the executor, with the failure budget
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any, TypeVar

from ._args import many, paired, slot_of
from ._channel import Channel
from ._errors import InvalidArgumentError, InvalidSlotError
from ._events import Clear, CommitDraft, CopyOnWrite, Event, Release, StepReport
from ._executors import Executor, resolve_executor
from ._flush import FlushCore
from ._host import HostPool
from ._hosttier import HostTier
from ._pool import StatePool
from ._queue import OPEN, StepQueue
from ._reserve import Reservations
from ._runner import StepRunner
from ._validate import check_request_id, check_shift, count_list, normalised, slot_list

__all__ = ["ManagerCore"]

_M = TypeVar("_M", bound="ManagerCore")
_IDS = (str, type(None))  # request id types the hot path takes without normalising


def _check_args(
    pool: Any, workspace: Any, clear_on_alloc: Any, max_failed: Any, host_pool: Any, channel: Any, group: Any
) -> None:
    """The constructor's argument checks, all made before anything is built."""
    if not isinstance(pool, StatePool):
        raise InvalidArgumentError(f"pool must be a StatePool, got {type(pool).__name__}")
    _positive_int("copy_workspace_bytes", workspace)
    _positive_int("max_failed_flushes", max_failed)
    if type(clear_on_alloc) is not bool:
        raise InvalidArgumentError(f"clear_on_alloc must be a bool, got {clear_on_alloc!r}")
    if channel is not None and (group is not None or not isinstance(channel, Channel)):
        raise InvalidArgumentError(
            f"channel must be a mambacache Channel, and not given with group=; got {type(channel).__name__}"
        )
    if host_pool is not None and not isinstance(host_pool, HostPool):
        raise InvalidArgumentError(f"host_pool must be a HostPool, got {type(host_pool).__name__}")
    if host_pool is not None and not host_pool.compatible_with(pool.spec):
        raise InvalidArgumentError(
            f"host_pool holds states of {host_pool.spec}, the pool {pool.spec}: make it with the pool's spec"
        )


def _distributed_channel(group: Any, src_rank: int, num_slots: int, timeout: float) -> Channel:
    from ._distributed import DistributedChannel  # torch.distributed only when asked for

    return DistributedChannel(group, src_rank, num_slots, timeout)


def _positive_int(name: str, value: Any) -> None:
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")


class ManagerCore(Reservations, HostTier):
    """:class:`~mambacache.CacheManager` less the hand-off: the core's whole surface (arguments, lifecycle,
    submitting, flushing, the host tier, reservations), whose invariants that class's docstring states.

    The hand-off layer (``mambacache/_handoff/``) makes the public class out of
    this one and its ``HandOff`` mixin, so the core never imports a layer above
    it; a mixin that needs state of its own sets it up in its ``__init__``,
    which this class's calls last (cooperatively, through ``super()``), once
    the pools, the queue and the flush core exist and before the manager opens.
    """

    def __init__(
        self,
        pool: StatePool,
        executor: Any = None,
        copy_workspace_bytes: int = 64 << 20,
        *,
        group: Any = None,
        src_rank: int = 0,
        timeout: float = 300.0,
        clear_on_alloc: bool = True,
        max_failed_flushes: int = 8,
        host_pool: HostPool | None = None,
        channel: Channel | None = None,
    ) -> None:
        _check_args(pool, copy_workspace_bytes, clear_on_alloc, max_failed_flushes, host_pool, channel, group)
        self._pool, self._host, self._clear_on_alloc = pool, host_pool, clear_on_alloc
        self._executor: Executor = resolve_executor(executor, pool.device, copy_workspace_bytes)
        self._runner = runner = StepRunner(pool, max_failed_flushes)
        runner.check(self._executor)
        channel = channel if group is None else _distributed_channel(group, src_rank, pool.num_slots, timeout)
        host_ledger = host_pool.ledger if host_pool is not None else None
        self._queue = StepQueue(threading.Lock(), pool.ledger, host_ledger, pool.spec.draft_tokens, runner, channel)
        host_tensors = pool.exec_split(host_pool.exec_tensors) if host_pool is not None else None
        self._core = FlushCore(self._queue, runner, self._executor, host_tensors, pool.spec.slot_bytes, channel)
        super().__init__()  # the layers' mixins (the hand-off book), over the finished core

    # -- lifecycle -------------------------------------------------------
    async def __aenter__(self: _M) -> _M:
        self._queue.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._core.close_async(exc)

    def __enter__(self: _M) -> _M:
        self._queue.open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._core.close_sync(exc)

    def check_open(self) -> None:
        """Raise :class:`ManagerClosedError` or :class:`ManagerBrokenError` unless the manager takes work."""
        # Read without the lock for the common case; submits re-check under it.
        if self._queue.state != OPEN:
            raise self._queue.closed_error()
        self._runner.raise_if_broken()

    # -- properties ------------------------------------------------------
    @property
    def executor(self) -> Executor:
        """The executor that runs this manager's new work."""
        return self._executor

    @property
    def pool(self) -> StatePool:
        """The pool this manager drives."""
        return self._pool

    @property
    def step(self) -> int:
        """The step the next flush runs; queued events belong to it."""
        return self._queue.step

    @property
    def clear_on_alloc(self) -> bool:
        """Whether ``alloc`` zeroes new slots by default."""
        return self._clear_on_alloc

    @property
    def pending(self) -> int:
        """Events queued for the next flush."""
        return len(self._queue.events)

    def queued(self) -> list[Event]:
        """A copy of the events queued for the next flush, in submission order (allocs and host events included)."""
        return self._queue.snapshot()

    @property
    def waiting(self) -> int:
        """``alloc_wait`` calls waiting for slots now (backpressure, for an engine's metrics)."""
        return self._queue.waiting

    @property
    def unfinished(self) -> int:
        """Stages of failed flushes that the next flush runs first (the pool's backlog)."""
        return self._runner.pending

    @property
    def broken(self) -> str | None:
        """Why the manager refuses work after too many failed flushes in a row, or None."""
        return self._runner.broken

    def held(self) -> dict[int, str | None]:
        """Held slots and their tenants (the ``request_id`` they were allocated with)."""
        return self._queue.held()

    def check_idle(self, host: bool | None = None) -> None:
        """Raise :class:`SlotLeakError` naming every held slot and its tenant, if any is held.

        For an engine's idle check: with no request running, no slot should be
        held, nor a host slot (a swapped-out request aborted without ``drop``).
        ``host``: whether to check the host pool too (None: when one is
        attached; True without one raises :class:`InvalidArgumentError`). The
        error's ``held`` and ``host_held`` map slots and host slots to their
        tenants (a host slot's: the ``request_id`` of its offload).
        """
        self._queue.check_idle(host)

    # -- allocating ------------------------------------------------------
    def alloc(self, n: int, request_id: str | None = None, *, clear: bool | None = None) -> list[int]:
        """Allocate the ``n`` lowest free slots to ``request_id``; returns them.

        Each reads as zeros after the next flush (unless a later copy targets it).
        ``clear=False`` (default: the manager's ``clear_on_alloc``) skips the zeroing,
        for a scheduler that always forks or clears a new slot itself. Raises
        :class:`PoolExhaustedError` (nothing allocated) when fewer than ``n`` are :attr:`available`.
        """
        return self._queue.alloc(n, request_id, _alloc_args(self, n, request_id, clear))

    def alloc_slots(self, slots: Any, request_id: str | None = None, *, clear: bool | None = None) -> list[int]:
        """Allocate exactly ``slots`` (for engines that pick slot ids); returns them as ints.

        All or nothing: :class:`InvalidSlotError` for a slot out of range or repeated, :class:`SlotStateError`
        for one held, :class:`PoolExhaustedError` for more than are :attr:`available` (a reservation).
        """
        cleared = _alloc_args(self, 0, request_id, clear)
        wanted = slot_list(slots, self._pool.num_slots)
        if len(set(wanted)) != len(wanted):
            raise InvalidSlotError(f"alloc_slots: a slot is repeated in {wanted[:20]}")
        self._queue.alloc_exact(wanted, request_id, cleared)
        return wanted

    async def alloc_wait(self, n: int, request_id: str | None = None, *, clear: bool | None = None) -> list[int]:
        """Like :meth:`alloc`, but wait until ``n`` slots are available instead of raising: backpressure.

        Waiters are served first come, first served, and a concurrent ``alloc``
        from another thread makes one wait longer, never raise; a count larger
        than the pool (or than its unreserved slots, for a tenant without the
        reservation) raises :class:`InvalidArgumentError`. Reserved slots are
        never taken: the wait ends when enough are :attr:`available`.
        Cancelling the wait allocates nothing.
        """
        cleared = _alloc_args(self, n, request_id, clear)
        if n > self._pool.num_slots:
            raise InvalidArgumentError(f"alloc_wait({n}) can never be met: the pool has {self._pool.num_slots} slots")
        return await self._queue.alloc_in_turn(n, request_id, cleared, self.check_open)

    # -- submitting ------------------------------------------------------
    # The single-event forms are the decode-step hot path: plain int slots and str
    # ids skip normalisation; the open/closed check happens under the lock.
    def clear(self, slot: int, request_id: str | None = None) -> None:
        """Zero ``slot`` at this point of the event order (on the next flush)."""
        n = self._pool.num_slots
        if type(slot) is int and 0 < slot <= n and type(request_id) in _IDS:
            self._queue.submit((Clear(slot, request_id),))
        else:
            self._submit((Clear(slot, request_id),))

    def release(self, slot: int, request_id: str | None = None) -> None:
        """Free ``slot`` from this point; events queued before still see its content."""
        n = self._pool.num_slots
        if type(slot) is int and 0 < slot <= n and type(request_id) in _IDS:
            self._queue.submit((Release(slot, request_id),))
        else:
            self._submit((Release(slot, request_id),))

    def copy_on_write(
        self, src: int, dst: int, request_id: str | None = None, *, shift: int = 0, temporal_src: int | None = None
    ) -> None:
        """``dst`` gets ``src``'s state as of this point of the event order (a fork); ``shift=k``: its conv
        states moved ``k`` tokens to the front of their time axis, zeros after (``0 <= k <`` conv width);
        ``temporal_src``: its temporal state and extra tensors from that slot instead (as of the same point)."""
        n = self._pool.num_slots
        plain = type(src) is int and type(dst) is int and 0 < src <= n and 0 < dst <= n and type(request_id) in _IDS
        if plain and shift == 0 and type(shift) is int and temporal_src is None:
            self._queue.submit((CopyOnWrite(src, dst, request_id),))
            return
        self._submit((CopyOnWrite(src, dst, request_id, shift, temporal_src),))

    def commit_draft(self, slot: int, accepted: int, request_id: str | None = None) -> None:
        """``slot`` becomes the state after ``accepted`` draft tokens (0: unchanged), read from its draft buffer
        at this point of the event order: a fork after the commit carries the committed state, one before does not.
        """
        self._submit((CommitDraft(slot, accepted, request_id),))

    def submit(self, *events: Clear | CopyOnWrite | Release | CommitDraft) -> None:
        """Queue ``events`` in order, all or none: any invalid event raises and queues nothing."""
        self._submit(events)

    def clear_many(self, slots: Any, request_id: str | None = None) -> None:
        """``clear`` for each of ``slots`` (a list, numpy array or 1-D CPU int tensor), all or none."""
        self._submit([Clear(s, request_id) for s in many(self, slots, request_id)], checked=True)

    def release_many(self, slots: Any, request_id: str | None = None) -> None:
        """``release`` for each of ``slots``, in order, all or none."""
        self._submit([Release(s, request_id) for s in many(self, slots, request_id)], checked=True)

    def copy_many(self, srcs: Any, dsts: Any, request_id: str | None = None, *, shift: int = 0) -> None:
        """``copy_on_write(srcs[i], dsts[i], shift=shift)`` for each ``i``, in order, all or none."""
        self._submit(_copies(self, srcs, dsts, request_id, shift), checked=True)

    def commit_many(self, slots: Any, accepted: Any, request_id: str | None = None) -> None:
        """``commit_draft(slots[i], accepted[i])`` for each ``i`` (or one ``accepted`` int for all), all or none."""
        self._submit(_commits(self, slots, accepted, request_id), checked=True)

    def _submit(self, events: Any, checked: bool = False) -> None:
        # `checked`: slots and request ids are plain and in range (the hot path).
        self._queue.submit(events if checked else normalised(events, self._pool.num_slots, self._pool.spec.conv_shapes))

    def hand_over(self, slot: int, to: str | None, request_id: str | None = None) -> None:
        """``slot``'s tenant becomes ``to`` from this point (an engine's cache takes a finished request's slot):
        bookkeeping only, no device work; ``request_id`` checks the current tenant, as for every event."""
        check_request_id(to)
        self._queue.hand_over(slot_of(self._pool, slot, request_id), request_id, to)

    # -- flushing --------------------------------------------------------
    async def flush(self, stream: Any | None = None) -> StepReport:
        """Run everything queued so far on ``stream``; returns what the step did.

        The device work is enqueued, not waited for. If the executor raises, this
        raises :class:`ExecutorError`; the work is kept and the next flush runs it
        first. Cancellation: before the step's events are taken, a cancelled flush
        takes nothing; once taken (at once when uncontended), the step runs to the
        end, shielded. In tensor-parallel mode the broadcast is shielded too, so a
        cancelled flush never leaves ranks apart.
        """
        self.check_open()
        return await self._core.flush_async(stream)

    def flush_nowait(self, stream: Any | None = None) -> StepReport:
        """The synchronous flush, for schedulers without an event loop; same semantics and report.

        Safe against a concurrent async flush or one in another thread: one runs at
        a time (this blocks while another thread flushes). In tensor-parallel mode
        it blocks on the plan broadcast (up to ``timeout``).
        """
        self.check_open()
        return self._core.flush_sync(stream)


# -- the bulk forms' arguments: every check is made before anything is queued --------
def _copies(mgr: ManagerCore, srcs: Any, dsts: Any, request_id: Any, shift: Any) -> list[CopyOnWrite]:
    a = many(mgr, srcs, request_id)
    b = paired("copy_many", a, slot_list(dsts, mgr.pool.num_slots))
    k = check_shift(shift, mgr.pool.spec.conv_shapes)
    return [CopyOnWrite(s, d, request_id, k) for s, d in zip(a, b, strict=True)]


def _commits(mgr: ManagerCore, slots: Any, accepted: Any, request_id: Any) -> list[CommitDraft]:
    """``commit_many``'s events: ``accepted`` ints (their range is the ledger's check, at each one's turn)."""
    ss = many(mgr, slots, request_id)
    counts = count_list(accepted, len(ss), "accepted")
    return [CommitDraft(s, a, request_id) for s, a in zip(ss, counts, strict=True)]


def _alloc_args(mgr: ManagerCore, n: Any, request_id: Any, clear: Any) -> bool:
    """The checks every alloc form makes first; returns whether to zero the new slots."""
    mgr.check_open()
    if type(n) is not int or n < 0:
        raise InvalidArgumentError(f"alloc count must be a non-negative int, got {n!r}")
    check_request_id(request_id)
    if clear is None:
        return mgr.clear_on_alloc
    if type(clear) is not bool:
        raise InvalidArgumentError(f"clear must be a bool or None, got {clear!r}")
    return clear
