"""SlotLedger: which slots of a pool are held, by whom, and which are free; StatePool and HostPool share it.

Pure Python, no torch. The manager drives it under its lock: the ledger checks
a batch of events against the slots' state at each event's point of the order
(:meth:`SlotLedger.apply_batch`), and otherwise trusts its callers' arguments
(ranges and types are checked before) and keeps its invariants cheap.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Any

from ._errors import InvalidArgumentError, InvalidEventError, PoolExhaustedError, SlotStateError
from ._events import CommitDraft, CopyOnWrite, Event, Release

__all__ = ["ReservedSlots", "SlotLedger"]


class SlotLedger:
    """The bookkeeping of slots ``1..size`` (slot 0 is never handed out).

    Invariants:

    * ``held[s]`` is the truth: a slot is held or free, never both, and
      ``tenants[s]`` names the holder of a held slot (None for a free one);
    * ``take`` hands out the lowest free slots first, so new requests land in
      runs of slots that copy in one op per layer;
    * the free heap may hold stale entries (slots taken by ``take_exact``, or
      pushed twice); ``take`` skips what ``held`` marks taken, and the heap is
      rebuilt when stale entries outnumber the slots (amortised O(1));
    * a slot freed with ``free_later`` (a host slot whose content a queued
      restore still reads) goes back to the heap only at ``reuse_freed()``, the
      flush that takes the freeing event; before that ``take`` hands it out only
      when nothing else is free, and the planner orders the read first;
    * from ``reuse_freed(ticket)`` until that ticket's work has run (the
      backlog's ``done`` passes it), such a slot is *busy*: planned work may
      take it (it runs after the read, oldest first), but :meth:`take_free_now`,
      for a write made at once outside the step order (a transfer landing
      states), never does;
    * a tenant may take only what leaves free the slots kept for the other
      tenants' reservations (``quota``, :class:`ReservedSlots`; :meth:`available`);
      every take, give-back and hand-over keeps its counts.
    """

    __slots__ = (
        "_busy", "_free", "_later", "_num_free", "_pending", "held", "name", "owner", "quota", "size", "tenants",
    )  # fmt: skip

    def __init__(self, size: int, name: str = "pool") -> None:
        self.size = size
        self.name = name  # for the exhaustion message: "pool", "host pool"
        self.held = bytearray(size + 1)
        self.tenants: list[str | None] = [None] * (size + 1)
        self._free: list[int] = list(range(1, size + 1))  # a heap: sorted is a valid heap
        self._num_free = size  # free slots in the heap (its stale entries aside)
        self._later: list[int] = []  # freed by free_later, in order
        self._pending = bytearray(size + 1)  # 1 for the slots in _later (O(1) membership)
        self._busy: list[int] | None = None  # per slot: the ticket whose work still reads it (made on first use)
        self.owner: object | None = None  # the lifecycle of the open manager driving this ledger, if any
        self.quota = ReservedSlots()

    def claim(self, owner: object) -> None:
        """Make ``owner`` (an open manager's lifecycle) the only one driving this ledger."""
        if self.owner is not None:
            raise InvalidArgumentError(f"this {self.name} is already managed by another open CacheManager")
        self.owner = owner

    def unclaim(self, owner: object) -> None:
        """``owner`` closed: another manager may drive the ledger."""
        if self.owner is owner:
            self.owner = None
            self.quota = ReservedSlots()  # the reservations were the manager's

    @property
    def num_free(self) -> int:
        """Slots ``take`` can hand out now, those freed by ``free_later`` included."""
        return self._num_free + len(self._later)

    @property
    def reserved(self) -> int:
        """Slots reserved, all reservations together (0: none)."""
        return sum(r[0] for r in self.quota.by_tenant.values())

    @property
    def reservations(self) -> dict[str | None, list[int]]:
        """Each standing reservation's tenant -> ``[reserved, held]`` (read only)."""
        return self.quota.by_tenant

    @property
    def kept(self) -> int:
        """Free slots kept back for their tenants' reservations."""
        return self.quota.kept

    def available(self, tenant: str | None) -> int:
        """Slots ``take(n, tenant)`` can hand out now: the free ones less those kept for other tenants'
        reservations (all free ones with none)."""
        quota = self.quota
        if not quota.kept:
            return self.num_free
        return max(0, self.num_free - (quota.kept - quota.own_kept(tenant)))

    def check_available(self, n: int, tenant: str | None) -> None:
        """:class:`PoolExhaustedError` unless ``n`` slots are :meth:`available` to ``tenant``."""
        if n > self.num_free or (self.quota.kept and n > self.available(tenant)):
            raise self._exhausted(n, tenant)

    def check_ever_available(self, n: int, tenant: str | None, what: str) -> None:
        """:class:`InvalidArgumentError` when ``n`` exceeds what ``tenant`` could hold with every other
        reservation kept: ``what`` (``alloc_wait(n)``) can never be met."""
        self.quota.check_ever(n, tenant, self.size, self.name, what)

    def _exhausted(self, n: int, tenant: str | None) -> PoolExhaustedError:
        msg = f"{self.name} exhausted: asked for {n} slot(s), {self.num_free} of {self.size} are free"
        return PoolExhaustedError(msg + self.quota.describe(tenant))

    def reserve(self, n: int, tenant: str) -> None:
        """Keep ``n`` slots for ``tenant`` (0: none); all or nothing (:meth:`ReservedSlots.reserve` says when it
        refuses). Counts the tenant's slots once (O(size)): not for the hot path."""
        held, tenants = self.held, self.tenants
        count = sum(1 for s in range(1, self.size + 1) if held[s] and tenants[s] == tenant)
        self.quota.reserve(n, tenant, count, self.num_free, self.size, self.name)

    def hand_over(self, slot: int, to: str | None) -> str | None:
        """``slot``'s tenant becomes ``to`` (held: the caller checked); returns the old tenant."""
        old, self.tenants[slot] = self.tenants[slot], to
        quota = self.quota
        if quota.by_tenant and old != to:
            if old in quota.by_tenant:
                quota.count(old, -1)
            if to in quota.by_tenant:
                quota.count(to, +1)
        return old

    def is_held(self, slot: int) -> bool:
        return 0 < slot <= self.size and bool(self.held[slot])

    def held_by(self) -> dict[int, str | None]:
        """Held slots and their tenants, in slot order."""
        held, tenants = self.held, self.tenants
        return {s: tenants[s] for s in range(1, self.size + 1) if held[s]}

    def take(self, n: int, tenant: str | None) -> list[int]:
        """The ``n`` lowest free slots, now held by ``tenant``; :class:`PoolExhaustedError` (nothing taken) if
        fewer are :meth:`available` to ``tenant``."""
        if n > self._num_free + len(self._later) or (self.quota.kept and n > self.available(tenant)):  # num_free
            raise self._exhausted(n, tenant)
        if tenant in self.quota.by_tenant:
            self.quota.count(tenant, n)
        free, held, tenants, pending = self._free, self.held, self.tenants, self._pending
        slots: list[int] = []
        while len(slots) < n and self._num_free:
            s = heapq.heappop(free)
            if not held[s] and not pending[s]:  # skip stale entries: taken, or freed only later
                held[s] = 1
                tenants[s] = tenant
                slots.append(s)
                self._num_free -= 1
        while len(slots) < n:  # only slots freed in this step are left: see the class docstring
            s = self._later.pop(0)
            pending[s] = 0
            held[s] = 1
            tenants[s] = tenant
            slots.append(s)
        return slots

    def take_exact(self, slots: list[int], tenant: str | None) -> None:
        """Hold exactly ``slots`` (free, unique: the caller checked) for ``tenant``."""
        held, tenants = self.held, self.tenants
        for s in slots:
            held[s] = 1
            tenants[s] = tenant
        self._num_free -= len(slots)
        if tenant in self.quota.by_tenant:
            self.quota.count(tenant, len(slots))

    def give_back(self, slots: Iterable[int]) -> None:
        """Free ``slots`` now: the next ``take`` may hand them out."""
        held, tenants, free, res = self.held, self.tenants, self._free, self.quota.by_tenant
        for s in slots:
            if res and tenants[s] in res:
                self.quota.count(tenants[s], -1)
            held[s] = 0
            tenants[s] = None
            heapq.heappush(free, s)
            self._num_free += 1
        if len(free) > 2 * self.size:
            self._free = [s for s in range(1, self.size + 1) if not held[s] and not self._pending[s]]

    def free_later(self, slot: int) -> None:
        """Free ``slot`` as of the end of the event queue; it rejoins the heap at :meth:`reuse_freed`."""
        if self.tenants[slot] in self.quota.by_tenant:
            self.quota.count(self.tenants[slot], -1)
        self.held[slot] = 0
        self.tenants[slot] = None
        self._later.append(slot)
        self._pending[slot] = 1

    def reuse_freed(self, ticket: int = -1) -> None:
        """The flush (of backlog ticket ``ticket``) took the events that freed the ``free_later`` slots: planned
        work may take them now; :meth:`take_free_now` only once ``ticket`` ran (-1: at once)."""
        later = self._later
        if ticket >= 0 and later:
            busy = self._busy
            if busy is None:
                busy = self._busy = [-1] * (self.size + 1)
            for s in later:
                busy[s] = ticket
        for s in later:  # an interrupt part-way leaves pushes that a repeat makes again (stale entries)
            heapq.heappush(self._free, s)
            self._pending[s] = 0
        self._num_free, self._later = self._num_free + len(later), []  # one line: a repeat counts them once

    def num_free_now(self, done: int) -> int:
        """Slots free now: free, and no unfinished work (a ticket from ``done`` on) nor queued event reads them:
        O(size)."""
        busy, held, pending = self._busy, self.held, self._pending
        return sum(
            1 for s in range(1, self.size + 1) if not held[s] and not pending[s] and (busy is None or busy[s] < done)
        )

    def take_free_now(self, n: int, tenant: str | None, done: int) -> list[int]:
        """The ``n`` lowest slots free now (free, and no queued event nor unfinished work, a ticket from ``done``
        on, still reads or writes them), now held by ``tenant``: for a write made at once, outside the step order.

        :class:`PoolExhaustedError` (nothing taken) when fewer are; the message
        counts those that are free only later.
        """
        busy, held, tenants, pending, free = self._busy, self.held, self.tenants, self._pending, self._free
        slots: list[int] = []
        seen: set[int] = set()
        kept: list[int] = []  # free, but unfinished work still reads them: back on the heap after
        while len(slots) < n and free:
            s = heapq.heappop(free)
            if held[s] or pending[s] or s in seen:
                continue  # a stale or duplicate entry, dropped as take() drops it
            seen.add(s)
            if busy is not None and busy[s] >= done:
                kept.append(s)
            else:
                slots.append(s)
        for s in kept:
            heapq.heappush(free, s)
        if len(slots) < n:
            for s in slots:
                heapq.heappush(free, s)
            now = self.num_free_now(done)
            later = self.num_free - now
            more = f" (and {later} more once queued or unfinished work has read them)" if later else ""
            raise PoolExhaustedError(f"{self.name}: {n} slot(s) wanted at once, {now} free{more}")
        for s in slots:
            held[s] = 1
            tenants[s] = tenant
        self._num_free -= len(slots)
        return slots

    # -- validation ------------------------------------------------------
    def check_held(self, kind: str, slot: int, tenant: str | None) -> None:
        """``slot`` is held, by ``tenant`` when one is given; else :class:`SlotStateError`."""
        if not self.held[slot]:
            raise not_held(kind, "the", slot)
        if tenant is not None and self.tenants[slot] != tenant:
            raise tenant_error(kind, slot, self.tenants[slot], tenant)

    def apply_batch(self, events: Sequence[Event], draft_tokens: int) -> None:
        """Check ``events`` (clears, copies, commits, releases) in order, then free what they release.

        Each event is checked against the slots' state at its own point of the
        order: a slot released earlier in the batch is no longer held. All or
        nothing: the first invalid event raises and the ledger is unchanged.
        The decode-step hot path, so the checks are inlined.
        """
        held, tenants = self.held, self.tenants
        released: dict[int, None] | None = None  # ordered: freed in release order
        for ev in events:
            t = type(ev)
            rid = ev.request_id  # type: ignore[union-attr]
            if t is CopyOnWrite:
                a, b = ev.src, ev.dst  # type: ignore[union-attr]
                if not held[a] or (released is not None and a in released):
                    raise not_held("CopyOnWrite", "source", a)
                ts = ev.temporal_src  # type: ignore[union-attr]
                if ts is not None and (not held[ts] or (released is not None and ts in released)):
                    raise not_held("CopyOnWrite", "temporal source", ts)
                if not held[b] or (released is not None and b in released):
                    raise not_held("CopyOnWrite", "destination", b)
                if rid is not None and tenants[b] != rid:
                    raise tenant_error("CopyOnWrite", b, tenants[b], rid)
            else:
                slot = ev.slot  # type: ignore[union-attr]
                if not held[slot] or (released is not None and slot in released):
                    raise not_held(t.__name__, "the", slot)
                if t is CommitDraft and not 0 <= ev.accepted <= draft_tokens:  # type: ignore[union-attr]
                    raise _bad_commit(ev.accepted, draft_tokens)  # type: ignore[union-attr]
                if rid is not None and tenants[slot] != rid:
                    raise tenant_error(t.__name__, slot, tenants[slot], rid)
                if t is Release:
                    if released is None:
                        released = {}
                    released[slot] = None
        if released is not None:
            self.give_back(released)


class ReservedSlots:
    """The slots kept for tenants of one ledger: several tenants may each hold a reservation (two prefix caches on
    one manager), each resized alone.

    Invariants: ``by_tenant[t]`` is ``[k, held]`` for each standing reservation,
    ``held`` counting the slots ``t`` holds (the ledger reports every take,
    give-back and hand-over through :meth:`count`, so reading it is O(1));
    ``kept`` is the sum of every reservation's ``max(0, k - held)``, the free
    slots kept back; the sum of the ``k`` stays below the ledger's size.
    """

    __slots__ = ("by_tenant", "kept")

    def __init__(self) -> None:
        self.by_tenant: dict[str | None, list[int]] = {}  # tenant -> [reserved, held]; only standing ones
        self.kept = 0

    def own_kept(self, tenant: str | None) -> int:
        """The free slots kept for ``tenant``'s own reservation (0 without one)."""
        r = self.by_tenant.get(tenant)
        return r[0] - r[1] if r is not None and r[0] > r[1] else 0

    def count(self, tenant: str | None, delta: int) -> None:
        """``tenant`` holds ``delta`` more slots: its reservation's count and ``kept`` follow (the caller checked
        that it has one)."""
        r = self.by_tenant[tenant]
        before = r[0] - r[1] if r[0] > r[1] else 0
        r[1] += delta
        self.kept += (r[0] - r[1] if r[0] > r[1] else 0) - before

    def describe(self, tenant: str | None) -> str:
        """What the other tenants' reservations keep back, for an exhaustion message."""
        return "".join(
            f", {max(0, k - h)} of them kept for {t!r} ({k} reserved, {h} held)"
            for t, (k, h) in self.by_tenant.items()
            if t != tenant
        )

    def check_ever(self, n: int, tenant: str | None, size: int, name: str, what: str) -> None:
        """:class:`InvalidArgumentError` when ``n`` exceeds what ``tenant`` could hold of ``size`` slots with
        every other reservation kept."""
        others = {t: r[0] for t, r in self.by_tenant.items() if t != tenant}
        if others and n > size - sum(others.values()):
            names = ", ".join(f"{t!r} ({k})" for t, k in others.items())
            raise InvalidArgumentError(
                f"{what} can never be met: {sum(others.values())} of the {name}'s {size} slots are reserved for {names}"
            )

    def reserve(self, n: int, tenant: str, count: int, num_free: int, size: int, name: str) -> None:
        """Keep ``n`` slots for ``tenant``, who holds ``count`` (0: none); all or nothing.

        Each tenant has at most one reservation (its own is resized) and other
        tenants' stand beside it. :class:`InvalidArgumentError` when all of them
        together would reach ``size`` (no slot left for anyone else);
        :class:`PoolExhaustedError` when fewer than ``n - count`` of the
        ``num_free`` free slots are left beyond those kept for the other
        reservations, so a reservation is always met when it is made.
        """
        others = sum(r[0] for r in self.by_tenant.values()) - (
            self.by_tenant[tenant][0] if tenant in self.by_tenant else 0
        )
        if n and others + n >= size:
            raise InvalidArgumentError(
                f"{name}: cannot reserve {n} slot(s) for {tenant!r}: {others} of its {size} are reserved"
                " for other tenants, and the reservations together must leave a slot"
            )
        free = num_free - (self.kept - self.own_kept(tenant))
        if n and n - count > free:
            raise PoolExhaustedError(
                f"{name}: cannot reserve {n} slot(s) for {tenant!r}: it holds {count} and {free} are free"
                + (" beyond those kept for other reservations" if free != num_free else "")
            )
        self.kept -= self.own_kept(tenant)
        if n:
            self.by_tenant[tenant] = [n, count]
            self.kept += max(0, n - count)
        else:
            self.by_tenant.pop(tenant, None)


def not_held(kind: str, role: str, slot: int) -> SlotStateError:
    return SlotStateError(
        f"{kind}: {role} slot {slot} is not allocated at this point of the event order (released, or never allocated)"
    )


def tenant_error(kind: str, slot: int, tenant: str | None, request_id: Any) -> SlotStateError:
    return SlotStateError(
        f"{kind}: slot {slot} belongs to {tenant!r}, not {request_id!r} (pass request_id=None to skip the check)"
    )


def _bad_commit(accepted: int, draft_tokens: int) -> Exception:
    if not draft_tokens:
        return InvalidEventError(
            "CommitDraft on a pool without draft buffers: make it with StatePool(..., draft_tokens=k)"
        )
    return InvalidArgumentError(
        f"CommitDraft: accepted must be in 0..{draft_tokens} (the pool's draft_tokens), got {accepted}"
    )
