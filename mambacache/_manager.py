"""CacheManager: the class a scheduler calls; it checks arguments and delegates to the parts it holds.

::

    CacheManager ── arguments (_validate), the public surface
      ├─ Lifecycle   (_lifecycle)        the one phase: new, open, broken, closing, ..., closed
      ├─ StepQueue   (_queue)            events of the next step, checked against the ledgers, under the lock
      ├─ FlushCore   (_flush)            one flush at a time: take, plan, send/receive over the Channel, run
      ├─ StepRunner  (_runner)           the pool's backlog through the executor, the failure budget
      ├─ HostTier    (_tiers/_hosttier)  offloads, restores and drops (with a host pool)
      └─ HandOffBook (_handoff/_book)    exports and arrivals, the queue's guard (with a host pool)

Reservations are the pool ledger's (:class:`~mambacache._core._ledger.ReservedSlots`),
changed through the queue. The class stands above the core and the parts it
holds from the tiers (the host tier) and the hand-off (the book): the core
imports none of them (``tests/package/test_layers.py``), and the queue asks the book
through the ``SubmitGuard`` protocol it defines itself. The hand-off's events are planned
as the host tier's offload and freeing restore (``docs/transfer.md``); a
:class:`~mambacache._handoff._transfer.StateTransfer` moves the staged bytes
between engines.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

from ._core._channel import Channel
from ._core._errors import InvalidArgumentError, InvalidSlotError
from ._core._events import Clear, CommitDraft, CopyOnWrite, Event, Export, Release, StepReport
from ._core._flush import FlushCore
from ._core._lifecycle import Lifecycle
from ._core._pool import StatePool
from ._core._queue import StepQueue
from ._core._runner import StepRunner
from ._core._validate import (
    as_slot,
    check_batch_key,
    check_bool,
    check_callable,
    check_count,
    check_exports,
    check_instance,
    check_peer,
    check_positive_int,
    check_request_id,
    check_request_ids,
    check_shift,
    check_str,
    count_list,
    host_slot,
    host_slot_list,
    named_request_id,
    need_host,
    normalised,
    paired,
    slot_list,
)
from ._executors import Executor, resolve_executor
from ._handoff._book import HandOffBook
from ._tiers._hostpool import HostPool
from ._tiers._hosttier import HostTier

__all__ = ["CacheManager"]

_M = TypeVar("_M", bound="CacheManager")
_IDS = (str, type(None))  # request id types the hot path takes without normalising


class CacheManager:
    """Batches a step's slot events and applies them with exactly sequential semantics.

    Invariants:

    * the pool's held slots (and each slot's tenant) are the state at the *end*
      of the event queue: ``alloc`` and ``release`` update them at once, and
      every event is validated against the state at its own point of the order;
    * a flush leaves every held slot as running all queued events one at a
      time, in submission order, would (see ``docs/semantics.md``);
    * nothing is lost: a submit that fails changes nothing; a flush whose
      executor fails keeps the unfinished work in the pool's backlog, and the
      next flush (of this manager, or of the next one opened on the pool) runs
      it before anything newer; a submit either is taken by a flush or raises
      ``ManagerClosedError``, never both nor neither;
    * kept work is bounded: while the backlog fails, new events stay queued and
      are not planned, and after ``max_failed_flushes`` failures in a row the
      manager is broken and refuses work (``ManagerBrokenError``).

    Submitting (``alloc``, ``clear``, ``copy_on_write``, ``release``, ``submit``
    and the bulk forms) is synchronous and thread-safe; flushes (``await
    flush()`` or ``flush_nowait()``) run one at a time.
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
        # Every argument is checked before anything is built.
        check_instance("pool", pool, StatePool)
        check_positive_int("copy_workspace_bytes", copy_workspace_bytes)
        check_positive_int("max_failed_flushes", max_failed_flushes)
        check_bool("clear_on_alloc", clear_on_alloc)
        if channel is not None:
            if group is not None:
                raise InvalidArgumentError("channel and group= exclude each other: give one")
            check_instance("channel", channel, Channel)
        if host_pool is not None:
            check_instance("host_pool", host_pool, HostPool)
        if host_pool is not None and not host_pool.compatible_with(pool.spec):
            raise InvalidArgumentError(
                f"host_pool holds states of {host_pool.spec}, the pool {pool.spec}: make it with the pool's spec"
            )
        self._pool, self._host, self._clear_on_alloc = pool, host_pool, clear_on_alloc
        self._executor: Executor = resolve_executor(executor, pool.device, copy_workspace_bytes)
        self._life = life = Lifecycle(threading.Lock())
        self._runner = runner = StepRunner(pool, max_failed_flushes, life)
        runner.check(self._executor)
        if group is not None:
            from ._core._distributed import DistributedChannel  # torch.distributed only when asked for

            channel = DistributedChannel(group, src_rank, pool.num_slots, timeout)
        host_ledger = host_pool.ledger if host_pool is not None else None
        self._queue = queue = StepQueue(life, pool.ledger, host_ledger, pool.spec.draft_tokens, runner.backlog, channel)
        host_tensors = pool.exec_split(host_pool.exec_tensors) if host_pool is not None else None
        self._core = FlushCore(queue, runner, self._executor, host_tensors, pool.spec.slot_bytes, channel)
        self._tier: HostTier | None = None
        self._handoff: HandOffBook | None = None
        # Without a host pool there is nothing to stage in: no book, and the queue keeps its no-op guard (the
        # decode step asks nothing more).
        if host_pool is not None:
            self._tier = HostTier(queue, host_pool)
            # A proxy, not the queue: the queue holds the book, and a cycle would keep the manager's
            # graph (its process group with it) alive until the cyclic GC ran, at exit after
            # destroy_process_group at worst, where gloo's destructor aborts the process.
            self._handoff = HandOffBook(weakref.proxy(queue), queue.ledger, host_pool.ledger, pool.backlog)
            queue.guard_with(self._handoff)

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
        self._life.check()

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
        return self._life.why

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
        check_bool("host", host, none=True)
        if host:
            need_host("check_idle(host=True)", self._host)
        self._queue.check_idle(host)

    # -- allocating ------------------------------------------------------
    def alloc(self, n: int, request_id: str | None = None, *, clear: bool | None = None) -> list[int]:
        """Allocate the ``n`` lowest free slots to ``request_id``; returns them.

        Each reads as zeros after the next flush (unless a later copy targets it).
        ``clear=False`` (default: the manager's ``clear_on_alloc``) skips the zeroing,
        for a scheduler that always forks or clears a new slot itself. Raises
        :class:`PoolExhaustedError` (nothing allocated) when fewer than ``n`` are :attr:`available`.
        """
        return self._queue.alloc(n, request_id, self._alloc_args(n, request_id, clear))

    def alloc_slots(self, slots: Any, request_id: str | None = None, *, clear: bool | None = None) -> list[int]:
        """Allocate exactly ``slots`` (for engines that pick slot ids); returns them as ints.

        All or nothing: :class:`InvalidSlotError` for a slot out of range or repeated, :class:`SlotStateError`
        for one held, :class:`PoolExhaustedError` for more than are :attr:`available` (a reservation).
        """
        cleared = self._alloc_args(0, request_id, clear)
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
        cleared = self._alloc_args(n, request_id, clear)
        if n > self._pool.num_slots:
            raise InvalidArgumentError(f"alloc_wait({n}) can never be met: the pool has {self._pool.num_slots} slots")
        return await self._queue.alloc_in_turn(n, request_id, cleared, self.check_open)

    def _alloc_args(self, n: Any, request_id: Any, clear: Any) -> bool:
        """The checks every alloc form makes first; returns whether to zero the new slots."""
        self.check_open()
        check_count("alloc count", n)
        check_request_id(request_id)
        check_bool("clear", clear, none=True)
        return self._clear_on_alloc if clear is None else clear

    # -- submitting ------------------------------------------------------
    # The single-event forms are the decode-step hot path: int slots in range and str or None ids skip
    # `normalised` (which makes the same test) and go to the queue, where the open check is made under the
    # lock. Measured (tools/benchmarks/ab_host.py, docs/benchmarks.md): through `normalised` a submit costs
    # 18 % more and the decode step 3 %; through one shared per-event function, 9 % and 1 %.
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
        self._submit([Clear(s, request_id) for s in self._slots(slots, request_id)], checked=True)

    def release_many(self, slots: Any, request_id: str | None = None) -> None:
        """``release`` for each of ``slots``, in order, all or none."""
        self._submit([Release(s, request_id) for s in self._slots(slots, request_id)], checked=True)

    def copy_many(self, srcs: Any, dsts: Any, request_id: str | None = None, *, shift: int = 0) -> None:
        """``copy_on_write(srcs[i], dsts[i], shift=shift)`` for each ``i``, in order, all or none."""
        a = self._slots(srcs, request_id)
        b = paired("copy_many", a, slot_list(dsts, self._pool.num_slots))
        k = check_shift(shift, self._pool.spec.conv_shapes)
        self._submit([CopyOnWrite(s, d, request_id, k) for s, d in zip(a, b, strict=True)], checked=True)

    def commit_many(self, slots: Any, accepted: Any, request_id: str | None = None) -> None:
        """``commit_draft(slots[i], accepted[i])`` for each ``i`` (or one ``accepted`` int for all), all or none."""
        ss = self._slots(slots, request_id)
        counts = count_list(accepted, len(ss), "accepted")  # their range is the ledger's check, at each one's turn
        self._submit([CommitDraft(s, a, request_id) for s, a in zip(ss, counts, strict=True)], checked=True)

    def _slots(self, slots: Any, request_id: Any) -> list[int]:
        """A bulk form's slots as ints in range, after the checks its single form makes first."""
        self.check_open()
        check_request_id(request_id)
        return slot_list(slots, self._pool.num_slots)

    def _slot(self, slot: Any, request_id: Any) -> int:
        check_request_id(request_id)
        return as_slot(slot, self._pool.num_slots)

    def _submit(self, events: Any, checked: bool = False) -> None:
        # `checked`: slots and request ids are plain and in range (the hot path).
        self._queue.submit(events if checked else normalised(events, self._pool.num_slots, self._pool.spec.conv_shapes))

    def hand_over(self, slot: int, to: str | None, request_id: str | None = None) -> None:
        """``slot``'s tenant becomes ``to`` from this point (an engine's cache takes a finished request's slot):
        bookkeeping only, no device work; ``request_id`` checks the current tenant, as for every event."""
        check_request_id(to)
        self._queue.hand_over(self._slot(slot, request_id), request_id, to)

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

    # -- reservations (the pool ledger's, changed through the queue) ----------
    @property
    def available(self) -> int:
        """Slots a request can allocate now: ``pool.num_free`` less the reserved slots its tenant does not hold
        yet (``pool.num_available``; for a scheduler's admission check)."""
        return self._pool.num_available

    @property
    def reserved(self) -> int:
        """Slots reserved by :meth:`reserve` (``PrefixCache(..., reserved=k)``'s checkpoints), all tenants together;
        0: none."""
        return self._pool.ledger.reserved

    @property
    def reservations(self) -> dict[str, int]:
        """Each standing reservation: its tenant and the slots it keeps (a copy)."""
        return {str(t): r[0] for t, r in self._pool.ledger.reservations.items()}

    def reserve(self, n: int, tenant: str) -> None:
        """Keep ``n`` slots for ``tenant``: every other tenant's allocation leaves ``n`` minus what ``tenant`` holds
        free, and raises :class:`PoolExhaustedError` (nothing allocated) beyond that.

        ``tenant``'s own allocations take any free slot not kept for another
        reservation. One reservation per tenant, beside other tenants' ones: the
        same tenant's call resizes it (0 ends it); all end when the manager
        closes. Raises :class:`InvalidArgumentError` when the reservations
        together would keep every slot, :class:`PoolExhaustedError` when fewer
        than ``n`` minus what ``tenant`` holds are free now (beyond those kept
        for the others), and :class:`ManagerClosedError` unless the manager is
        open. All or nothing.

        Invariant: while a reservation of ``k`` slots for a tenant stands, at
        least ``k`` minus what that tenant holds are free (a hand-over away from
        the tenant aside): other tenants' allocations stop short of them. Several
        tenants may each have one (two prefix caches on one manager); each counts
        only its own tenant's slots.
        """
        check_count("reserve's n", n, below=self._pool.num_slots)
        check_str("reserve's tenant", tenant)
        self._queue.reserve(n, tenant)  # checks, under the lock, that the manager is open

    # -- the host tier (HostTier: a host slot is held from the offload that fills it to the drop or freeing
    # restore that ends it; reads queued before its end see its state) ----------------------------------
    @property
    def host_pool(self) -> HostPool | None:
        """The host pool (None without one)."""
        return self._host

    def _need_tier(self, what: str) -> HostTier:
        self.check_open()
        return need_host(what, self._tier)

    def offload(self, slot: int, request_id: str | None = None) -> int:
        """Copy ``slot``'s state as of this point of the event order to a free host slot; returns the host slot.

        Later events on ``slot`` (a release and a new tenant, a clear) do not reach the copy, so ``offload`` then
        ``release`` is preemption by swap. The copy runs on the next flush's stream, before anything in that step
        writes the slot. Raises :class:`PoolExhaustedError` when the host pool is full.
        """
        tier = self._need_tier("offload")
        return tier.offload([self._slot(slot, request_id)], request_id)[0]

    def offload_many(self, slots: Any, request_id: str | None = None) -> list[int]:
        """``[offload(s) for s in slots]``, all or none (too few free host slots: nothing taken); the host slots."""
        tier = self._need_tier("offload_many")
        return tier.offload(self._slots(slots, request_id), request_id)

    def restore(self, host: int, slot: int, request_id: str | None = None, *, keep: bool = False) -> None:
        """``slot`` gets host slot ``host``'s state as of this point of the event order.

        ``host`` is freed after the read unless ``keep`` (a checkpoint restored many times). A host slot freed in a
        step is handed out again in that step only when no other is free, and the planner orders this read before
        the offload that rewrites it, so the read always sees the offloaded state.
        """
        tier = self._need_tier("restore")
        h = host_slot(host, tier.pool.num_slots)
        s = self._slot(slot, request_id)
        check_bool("keep", keep)
        tier.restore([h], [s], request_id, keep)

    def restore_many(self, hosts: Any, slots: Any, request_id: str | None = None, *, keep: bool = False) -> None:
        """``restore(hosts[i], slots[i], keep=keep)`` for each ``i``, in order, all or none."""
        tier = self._need_tier("restore_many")
        hs = host_slot_list(hosts, tier.pool.num_slots)
        ss = paired("restore_many", hs, self._slots(slots, request_id))
        check_bool("keep", keep)
        tier.restore(hs, ss, request_id, keep)

    def drop(self, host: int) -> None:
        """Free host slot ``host`` from this point; earlier restores still read it."""
        tier = self._need_tier("drop")
        tier.drop(host_slot(host, tier.pool.num_slots))

    # -- the hand-off (HandOffBook: an export's staging host slot and the exported pool slot stay held by the
    # request until the peer acknowledges; an import reads exactly the state that arrived for its request, once;
    # a host slot that belongs to a transfer is changed by no other call) -------------------------------------
    def _book(self, what: str) -> HandOffBook:
        return need_host(what, self._handoff)

    @overload
    def export(self, slot: int, request_id: str, *, to: int | None = None, in_place: Literal[False] = False) -> int: ...

    @overload
    def export(self, slot: int, request_id: str, *, to: int | None = None, in_place: Literal[True]) -> None: ...

    @overload
    def export(self, slot: int, request_id: str, *, to: int | None = None, in_place: bool) -> int | None: ...

    def export(self, slot: int, request_id: str, *, to: int | None = None, in_place: bool = False) -> int | None:
        """``slot``'s state as of this point of the event order goes to the peer (on the transfer's next send).

        Later events on ``slot`` do not reach what is sent. ``slot`` stays held by
        ``request_id`` until the peer acknowledges; the transfer then releases it.
        Releasing it first withdraws the export (refused while a send of it awaits
        the ack); handing it over or exporting it again is refused. ``to``: the
        peer's rank it is for (a transfer to another peer leaves it alone), or
        None for whichever transfer sends first. Returns the staging host slot.
        Needs a host pool (the staging area).

        ``in_place=True``: no staging copy and no host slot (returns None): the
        send reads ``slot`` itself once every event queued before the export ran.
        Until the peer acknowledges, every call that would write ``slot`` (a
        clear, a copy or commit into it, a restore into it) is refused
        (:class:`SlotStateError`, nothing changed), and the engine must not write
        it either (no forward pass of the request): for a request whose prefill is
        done and that waits only to be sent, as a disaggregated prefill engine's
        are. It saves one pass over the state's bytes.
        """
        rid = named_request_id("export", request_id, "the peer imports by it")
        check_bool("in_place", in_place)
        dest = check_peer("to", to)
        book = self._book("export")
        return book.export(as_slot(slot, self._pool.num_slots), rid, dest, in_place)

    def import_into(self, slot: int, request_id: str) -> None:
        """Allocate free ``slot`` to ``request_id`` without a clear; it reads the state received for it.

        A clear or release of ``slot`` queued before this never wipes the imported
        state, one queued after it does. The state must have arrived (the
        transfer's ``receive``); else :class:`SlotStateError`, nothing changed.
        After :meth:`expect_import`, ``slot`` must be the slot it named: a state
        that arrived in it is taken as it is (nothing to copy), one that arrived
        in staging is restored into it.
        """
        rid = named_request_id("import_into", request_id, "the state arrived under it")
        book = self._book("import_into")
        book.arrivals.import_into(as_slot(slot, self._pool.num_slots), rid)

    def expect_import(self, slot: int, request_id: str) -> None:
        """Allocate free ``slot`` to ``request_id`` without a clear, as the place its state lands in on arrival.

        A receive that brings the state once the flush that takes this alloc has
        run writes it straight into ``slot``: no staging host slot and no copy at
        the import (one arriving earlier lands in staging as without this call).
        Until :meth:`import_into` of ``slot`` every other call on it, read or
        write, is refused (:class:`SlotStateError`, nothing changed), and the
        engine must not run the request; releasing it gives the state up
        (refused while its bytes are being written). :class:`SlotStateError`,
        nothing changed, when ``slot`` is held or a state of ``request_id`` is
        expected or has arrived already. Needs a host pool, as every hand-off call.
        """
        rid = named_request_id("expect_import", request_id, "the state arrives under it")
        book = self._book("expect_import")
        book.arrivals.expect(as_slot(slot, self._pool.num_slots), rid)

    def awaiting_import(self, slot: int) -> str | None:
        """The request whose state ``slot`` awaits from a peer (:meth:`expect_import`, not imported or released
        since), else None: such a slot holds no state yet, so every call that reads or writes it is refused."""
        slot = as_slot(slot, self._pool.num_slots)
        book = self._handoff
        return None if book is None else book.arrivals.awaiting_in(slot)

    def discard_arrived(self, request_id: str) -> int:
        """The state that arrived for ``request_id`` will not be imported (the request was aborted): its staging
        host slot is dropped from this point. Returns it; :class:`SlotStateError`, nothing changed, when no state
        for ``request_id`` awaits an import."""
        check_request_id(request_id)
        return self._book("discard_arrived").arrivals.discard(request_id)

    # -- the transfer's side (StateTransfer calls these; engines call the two above) --------
    def exports_ready(self, to: int | None = None) -> list[Export]:
        """The exports whose staging copy has run (work done, not a step number), not acknowledged and not being
        sent, in export order; with ``to``, only those addressed to ``to`` or to no one."""
        dest = check_peer("to", to)
        return self._book("exports_ready").ready(dest, take=False)

    def take_exports(self, to: int | None = None) -> list[Export]:
        """:meth:`exports_ready`, now being sent: until :meth:`exports_delivered` or :meth:`exports_returned`,
        a release of their slots is refused (the peer may or may not hold their states). On a closed or
        closing manager :class:`ManagerClosedError`, before anything is taken."""
        dest = check_peer("to", to)
        return self._book("take_exports").ready(dest, take=True)

    def exports_returned(self, exports: list[Export], *, peer: int | None = None, batch: Hashable = None) -> None:
        """The send of ``exports`` failed: they wait for the next send, and releasing a slot withdraws its export.

        ``peer``: the send to that rank failed after it may have landed them (in doubt): those exported to no
        one in particular are from now on taken only for ``peer``, never delivered to a second peer. ``batch``
        (with ``peer``): the batch they may have landed under, which :meth:`exports_in_doubt` names to every
        later sender to ``peer``, so that whichever sends them again sends that batch (the peer acknowledges it
        without landing it twice); ``peer`` without it: under no batch (a retry the peer refused). Without
        ``peer`` (sent nowhere, or refused on a first try) each export's record stays as it was."""
        dest = check_peer("peer", peer)
        check_batch_key(batch, dest)
        book = self._book("exports_returned")
        book.returned(check_exports("exports_returned", exports), dest, batch)

    def exports_in_doubt(self, exports: list[Export]) -> list[Hashable]:
        """Per export (as :meth:`take_exports` gave it), the batch under which its send may have landed at its
        peer (:meth:`exports_returned`'s ``batch``): send it again as that batch; None where it is in doubt under
        none. The record is the manager's, not a transfer's: any transfer of the manager to that peer finds it."""
        book = self._book("exports_in_doubt")
        return book.in_doubt(check_exports("exports_in_doubt", exports))

    def exports_delivered(self, exports: list[Export]) -> None:
        """The peer acknowledged ``exports``: release their pool slots and drop their staging slots (all or none).

        Taken on a closing manager too (its last flush runs the releases); on a
        closed one the slots and staging slots are freed at once, and the closed
        manager's ledgers stay claimed until its last send in flight ends."""
        book = self._book("exports_delivered")
        book.delivered(check_exports("exports_delivered", exports))

    def landing_room(self, request_ids: list[str] | None = None) -> int:
        """How many states :meth:`land` could take at once now: the free host slots that no queued event and no
        unfinished work reads (``host_pool.num_free`` also counts those freed in this step, which a landing
        cannot take until the step's flush has run); with ``request_ids`` that all land in place now
        (:meth:`land_in_place`), their number. Needs a host pool."""
        if request_ids is not None:
            check_request_ids("landing_room", request_ids)
        return self._book("landing_room").arrivals.room(request_ids)

    def land(
        self,
        request_ids: list[str],
        write: Callable[[list[int]], None] | None = None,
        *,
        arrived: Callable[[list[int]], None] | None = None,
    ) -> list[int]:
        """Staging host slots for states arriving for ``request_ids`` (each held by its id until imported).

        ``write(slots)`` (a transfer's receive): writes the arrived rows into the
        slots, called outside the manager's lock; the states count as arrived
        (importable, discardable) only once it returned, and if it raises the
        slots are freed and nothing arrived (its error is raised).
        ``arrived(slots)``: called under the manager's lock in the hold that
        makes them arrived, so before any import of them can be (a transfer
        traces its receive line there), before they count: if it raises, none
        arrived and its error is raised; it must not call the manager.
        All or none: :class:`InvalidArgumentError` unless a list of str,
        :class:`SlotStateError` when a state for one of them arrived already and
        is not imported yet, :class:`PoolExhaustedError` when too few host slots
        are free of every queued or unfinished read and write (a flush in
        progress, a failed flush awaiting its repair).
        """
        check_request_ids("land", request_ids)
        check_callable("land's write", write, none=True)
        check_callable("land's arrived", arrived, none=True)
        return self._book("land").arrivals.land(request_ids, write, arrived)

    def land_in_place(
        self,
        request_ids: list[str],
        write: Callable[[list[int]], None],
        *,
        arrived: Callable[[list[int]], None] | None = None,
    ) -> list[int] | None:
        """The pool slots ``request_ids`` await their states in (:meth:`expect_import`), for ``write(slots)`` (a
        transfer's receive) to write the arrived rows into, outside the manager's lock; None, with nothing
        changed, unless every one of them lands in place now (expected, and the flush that took its alloc
        ran). Until ``write`` returns a release of those slots is refused; if it raises nothing arrived.
        ``arrived(slots)``: as in :meth:`land`.
        :class:`SlotStateError` (nothing changed) when a state for one of them arrived already."""
        check_request_ids("land_in_place", request_ids)
        check_callable("land_in_place's write", write)
        check_callable("land_in_place's arrived", arrived, none=True)
        return self._book("land_in_place").arrivals.land_in_place(request_ids, write, arrived)
