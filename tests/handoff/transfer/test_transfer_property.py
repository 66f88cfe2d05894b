"""Export and import (issue #20) mixed with every other event kind on two engines, against the oracle, with faults.

Two managers in one process, each with its own pool (an extra tensor of each of
two more dtypes, and draft buffers) and host pool, play a random log: allocs,
clears, forks, releases, draft commits, offloads, restores and drops on both
sides, exports and imports in both directions, flushes (each maybe faulted at a
drawn aten op, then repaired; a landing from the peer may come between the
failed flush and its repair, or while the flush runs, held mid-way, in another
thread) and transfers (``tests/support/loopback.py``: what
``StateTransfer`` does, minus the wire) at any point of a step.

The reference is plain: each side's :class:`SequentialOracle` applies every
event one at a time (an export stages the slot's state as of that point, an
import reads the staged state into its slot), a transfer copies the sender's
staged state into the receiver's oracle, and a model of each side's ledgers
says who holds which slot and host slot: an exporting slot stays held by its
request until delivery and is free right after; a landed state is held by its
request's id until imported. After every flush the bytes of every live slot and
host slot, and the ledgers, must be the model's; at every transfer the landed
bytes must be the exported slot's bytes at its export's point of the order.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mambacache as mc
from mambacache.testing import SequentialOracle, fail_at_op

from ...support.gate import flush_paused, resume
from ...support.loopback import OneBatch, loopback
from ...support.sweep import fault_points
from ...support.util import VARIANTS, fill_random, quant_spec, step_value

# The wire is stood in (tests/support/loopback.py): the same code over every transport, so run once (tests/conftest.py).
pytestmark = pytest.mark.no_transport

N, H = 5, 4  # small pools, so that slots and host slots are reused within a step and across
SPEC = quant_spec(draft_tokens=2)  # int8 conv, fp8 temporal, two extras (fp32, bf16), draft buffers
EXCS: list[type[BaseException]] = [MemoryError, RuntimeError, KeyboardInterrupt]


class Engine:
    """One side: its pools and manager, the oracle of its bytes, and the model of its ledgers.

    Each method makes one manager call and applies the same event(s) to the
    oracle and the model, so the two are compared at every flush.
    """

    def __init__(self, name: str, variant: str, seed: int, stack: contextlib.ExitStack) -> None:
        self.name = name
        self.pool, self.host = mc.StatePool(SPEC, N), mc.HostPool(SPEC, H)
        executor = VARIANTS[variant]()
        self.mgr = stack.enter_context(
            mc.CacheManager(self.pool, executor=executor, host_pool=self.host, max_failed_flushes=1000)
        )
        self.tenants: dict[int, str] = {}  # the model of mgr.held()
        self.hosts: dict[int, str | None] = {}  # the model of host.held()
        self.user_hosts: set[int] = set()  # host slots of plain offloads (restore and drop take these)
        self.exports: list[tuple[mc.Export, bool]] = []  # undelivered exports, and whether their flush ran
        self.arrived: dict[str, int] = {}  # request id -> staging host slot of a landed state not imported
        # request id -> [pool slot it awaits its state in, its alloc's flush ran, the state landed there]
        self.awaiting: dict[str, list[Any]] = {}
        self.freed: set[int] = set()  # host slots freed by events queued since the last flush
        self.captured: dict[str, tuple[list[torch.Tensor], bool]] = {}  # an export's bytes at its point of order
        self.received: dict[str, tuple[list[torch.Tensor], bool]] = {}  # the same, of states landed here
        self.count = 0
        self.steps = 0
        for _ in range(2):
            self.alloc(True)
        self.mgr.flush_nowait()
        fill_random(self.pool, seed)  # dirty: a forward wrote them all
        g = torch.Generator().manual_seed(seed + 1)
        for d in self.pool.draft_tensors:  # a verify pass wrote every draft state; events never write them
            d.copy_((torch.randn(d.shape, generator=g) * 20).clamp(-100, 100).to(d.dtype))
        self.oracle = SequentialOracle(self.pool, self.host)

    # -- the model's views --------------------------------------------------
    def free(self) -> list[int]:
        return sorted(set(range(1, N + 1)) - set(self.tenants))

    def in_place(self) -> set[int]:
        """Slots exported in place: every call that would write one is refused until delivery."""
        return {ev.slot for ev, _ in self.exports if ev.host is None}

    def awaited(self) -> set[int]:
        """Slots awaiting a state in place: every call but a release is refused until the import."""
        return {a[0] for a in self.awaiting.values()}

    def refused(self, slot: int, call: Any, write: bool = True) -> bool:
        """Whether ``slot`` may not be written (``write``) or read now; then ``call`` must be refused, changing
        nothing."""
        if slot not in self.awaited() and (not write or slot not in self.in_place()):
            return False
        before = snapshot(self)
        with pytest.raises(mc.SlotStateError, match=r"in place|awaits the state"):
            call()
        assert snapshot(self) == before
        return True

    def releasable(self) -> list[int]:
        """Live slots that are not exporting: an exporting slot is the transfer's to release."""
        exporting = {ev.slot for ev, _ in self.exports}
        return sorted(set(self.tenants) - exporting)

    def apply(self, *events: Any) -> None:
        if getattr(self, "oracle", None) is not None:
            self.oracle.apply(events)

    # -- one manager call each ------------------------------------------------
    def alloc(self, clear: bool) -> int:
        rid = f"{self.name}{self.count}"
        self.count += 1
        got = self.mgr.alloc(1, rid, clear=clear)
        assert got == self.free()[:1], "alloc hands out the lowest free slot"
        self.tenants[got[0]] = rid
        self.apply(mc.Alloc(got[0], rid, clear))
        return got[0]

    def clear(self, slot: int) -> None:
        if self.refused(slot, lambda: self.mgr.clear(slot)):
            return
        self.mgr.clear(slot)
        self.apply(mc.Clear(slot))

    def cow(self, src: int, dst: int) -> None:
        if self.refused(dst, lambda: self.mgr.copy_on_write(src, dst)):
            return
        if self.refused(src, lambda: self.mgr.copy_on_write(src, dst), write=False):
            return
        self.mgr.copy_on_write(src, dst)
        self.apply(mc.CopyOnWrite(src, dst))

    def commit(self, slot: int, accepted: int) -> None:
        if self.refused(slot, lambda: self.mgr.commit_draft(slot, accepted)):
            return
        self.mgr.commit_draft(slot, accepted)
        self.apply(mc.CommitDraft(slot, accepted))

    def release(self, slot: int) -> None:
        rid = self.tenants.pop(slot)
        self.mgr.release(slot, rid)
        self.apply(mc.Release(slot))
        if rid in self.awaiting and self.awaiting[rid][0] == slot:  # gives the state up, landed there or not
            del self.awaiting[rid]

    def offload(self, slot: int) -> int | None:
        if self.refused(slot, lambda: self.mgr.offload(slot), write=False):  # before the host pool's room
            return None
        if len(self.hosts) == H:
            with pytest.raises(mc.PoolExhaustedError):
                self.mgr.offload(slot)
            return None
        h = self.mgr.offload(slot)
        assert h not in self.hosts
        self.hosts[h] = None
        self.user_hosts.add(h)
        self.apply(mc.Offload(slot, h))
        return h

    def restore(self, h: int, slot: int, keep: bool) -> None:
        if self.refused(slot, lambda: self.mgr.restore(h, slot, keep=keep)):
            return
        self.mgr.restore(h, slot, keep=keep)
        if not keep:
            self.free_host(h)
        self.apply(mc.Restore(h, slot, keep=keep))

    def drop(self, h: int) -> None:
        self.mgr.drop(h)
        self.free_host(h)
        self.apply(mc.DropHost(h))

    def free_host(self, h: int) -> None:
        del self.hosts[h]
        self.user_hosts.discard(h)
        self.freed.add(h)

    def export(self, slot: int, in_place: bool = False) -> int | None:
        rid = self.tenants[slot]
        if in_place:  # no staging slot, no event: the send reads the slot, which nothing writes until delivery
            queued = self.mgr.queued()
            assert self.mgr.export(slot, rid, in_place=True) is None
            assert self.mgr.queued() == queued
            self.exports.append((mc.Export(slot, None, rid), False))
            self.captured[rid] = ([t[:, slot].clone() for t in self.oracle.tensors], slot in self.oracle.defined)
            return None
        if len(self.hosts) == H:
            with pytest.raises(mc.PoolExhaustedError):
                self.mgr.export(slot, rid)
            return None
        h = self.mgr.export(slot, rid)
        ev = mc.Export(slot, h, rid)
        assert self.mgr.queued()[-1] == ev and h not in self.hosts
        self.hosts[h] = rid
        self.exports.append((ev, False))
        self.apply(ev)
        self.captured[rid] = ([t[:, slot].clone() for t in self.oracle.tensors], slot in self.oracle.defined)
        return h

    def import_into(self, slot: int, rid: str) -> None:
        queued = self.mgr.queued()
        self.mgr.import_into(slot, rid)
        awaited = self.awaiting.pop(rid, None)
        if awaited is not None and awaited[2]:  # landed in the slot itself: nothing to run
            assert self.mgr.queued() == queued
            return
        h = self.arrived.pop(rid)
        events = [mc.Alloc(slot, rid, False), mc.Import(h, slot, rid)]
        if awaited is not None:  # it arrived in staging before its slot settled: restored into the slot held
            events = events[1:]
        assert self.mgr.queued()[len(queued) :] == events
        self.tenants[slot] = rid
        self.free_host(h)
        self.apply(*events)

    def expect(self, slot: int, rid: str) -> None:
        """``slot`` (free) awaits ``rid``'s state: it lands there once the alloc's flush ran."""
        if rid in self.arrived or rid in self.awaiting:
            before = snapshot(self)
            with pytest.raises(mc.SlotStateError, match="expected or arrived"):
                self.mgr.expect_import(slot, rid)
            assert snapshot(self) == before
            return
        self.mgr.expect_import(slot, rid)
        self.tenants[slot] = rid
        self.awaiting[rid] = [slot, False, False]
        self.apply(mc.Alloc(slot, rid, False))

    # -- flushes ----------------------------------------------------------------
    def flush(self, at: int = 0, peer: Engine | None = None, between: str = "") -> int:
        """Flush with a fault before aten op ``at`` (0: none), repaired by one more flush; returns the ops run.

        While the failed flush's work is unfinished, its exports are not ready (their staging copy has not run),
        and a transfer of earlier ones is refused and changes nothing. ``between`` (with a ``peer`` and ``at``):
        ``"land"``, the peer's ready exports land here between the failed flush and its repair; ``"pause"`` or
        ``"pause-fail"``, the flush runs in another thread, held before op ``at`` (then failing, or not) while
        they land: never onto a host slot the unfinished work still reads.
        """
        if between.startswith("pause") and at and peer is not None:
            return self.flush_in_thread(at, peer, between == "pause-fail")
        mgr = self.mgr
        mode = fail_at_op(at, EXCS[at % len(EXCS)])
        try:
            with mode:
                mgr.flush_nowait()
        except (mc.ExecutorError, KeyboardInterrupt) as err:
            assert at, f"no fault was injected, yet: {err!r}"
            assert mgr.pending == 0 and mgr.unfinished >= 1
            assert mgr.exports_ready() == [ev for ev, ran in self.exports if ran]  # on work done, not step numbers
            if peer is not None and mgr.exports_ready():
                before = snapshot(self), snapshot(peer)
                with pytest.raises(mc.TransferError, match="unfinished"):
                    loopback(mgr, peer.mgr)
                assert (snapshot(self), snapshot(peer)) == before
            if between == "land" and peer is not None:
                transfer(peer, self)  # the host slots the failed step freed are still read by its unfinished work
            assert mgr.flush_nowait().resumed_stages >= 1  # the repair
        else:
            assert at == 0 or at > mode.ops
        self.settle()
        self.freed.clear()
        self.check()
        return mode.ops

    def flush_in_thread(self, at: int, peer: Engine, fail: bool) -> int:
        """:meth:`flush` in another thread, held before aten op ``at`` while ``peer``'s ready exports land here."""
        held = flush_paused(self.mgr, at, RuntimeError if fail else None)
        if held.thread.is_alive():  # taken and mid-run: its step number advanced, its work is not done
            assert self.mgr.exports_ready() == [ev for ev, ran in self.exports if ran]
            transfer(peer, self)
        err = resume(held)
        if err is not None:
            assert fail and isinstance(err, mc.ExecutorError), repr(err)
            assert self.mgr.flush_nowait().resumed_stages >= 1  # the repair
        self.settle()
        self.freed.clear()
        self.check()
        return held.mode.ops

    def settle(self) -> None:
        """A flush ran everything queued: every export is ready, every awaited slot may be landed in."""
        self.exports = [(ev, True) for ev, _ in self.exports]
        for a in self.awaiting.values():
            a[1] = True

    def check(self) -> None:
        """After a flush: every live slot's and host slot's bytes, and every ledger, are the model's."""
        assert self.pool.unfinished == 0 and self.mgr.pending == 0
        self.oracle.assert_matches(self.pool, self.host)
        self.check_ledgers()

    def check_ledgers(self) -> None:
        assert self.mgr.held() == self.tenants
        assert self.host.held() == self.hosts
        assert self.mgr.exports_ready() == [ev for ev, ran in self.exports if ran]
        self.check_records()

    def check_records(self) -> None:
        """The book keeps one record per arriving state (where it awaits, where it landed, its phase), indexed by
        pool slot and by staging host slot, as the model has them."""
        book = self.mgr._handoff
        assert book is not None
        arrivals = book.arrivals
        want = {r: (a[0], None, "arrived" if a[2] else "waiting") for r, a in self.awaiting.items()}
        for r, h in self.arrived.items():
            want[r] = (want[r][0] if r in want else None, h, "arrived")
        assert {r: (a.slot, a.host, a.phase.value) for r, a in arrivals.states.items()} == want
        assert arrivals.slots == {a.slot: a for a in arrivals.states.values() if a.slot is not None}
        assert arrivals.hosts == {a.host: a for a in arrivals.states.values() if a.host is not None}

    def forward(self) -> None:
        """A forward step writes every live slot (exporting ones too: their staged state is already taken), but
        those exported in place (the engine runs no forward of a request it hands off in place)."""
        self.steps += 1
        skipped = self.in_place() | self.awaited()  # nor of one whose state it has not imported yet
        for s in self.tenants:
            if s in skipped:
                continue
            value = step_value(self.steps + (50 if self.name == "b" else 0), s)
            self.oracle.write(s, value)
            for t in self.pool.tensors:
                t[:, s] = value


def snapshot(e: Engine) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was: ledgers, queue, step, exports, arrivals and all bytes."""
    return state(e.mgr, e.arrived)


def state(mgr: mc.CacheManager, arrived: Any = ()) -> tuple[Any, ...]:
    """``mgr``'s ledgers, queue, step, ready exports and every byte of its pools (``arrived``: the model's)."""
    host = mgr.host_pool
    tensors = [t.clone() for t in (*mgr.pool.tensors, *(host.tensors if host is not None else []))]
    host_held = host.held() if host is not None else None
    ready = mgr.exports_ready() if host is not None else []
    return (mgr.held(), host_held, mgr.queued(), mgr.step, ready, sorted(arrived), _Bytes(tensors))


class _Bytes:
    """Tensors compared by their bytes (``==`` on tuples of tensors is elementwise and ambiguous)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Bytes) and all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(self.tensors, other.tensors, strict=True)
        )

    __hash__ = None  # type: ignore[assignment]


def transfer(s: Engine, r: Engine) -> list[str]:
    """``s``'s ready exports to ``r`` through the loopback, checked against the model; returns the ids moved."""
    ready = [ev for ev, ran in s.exports if ran]
    assert s.mgr.exports_ready() == ready
    ids = [ev.request_id or "" for ev in ready]
    if ids and all(i in r.awaiting and r.awaiting[i][1] and not r.awaiting[i][2] for i in ids):
        return transfer_in_place(s, r, ready)
    # The receiver lacks room: nothing lands, the sender keeps all. A host slot freed by an event queued in this
    # step does not count: that event's read of the old state is still to run, and landed bytes are written now.
    if len(ids) > H - len(r.hosts) - len(r.freed - set(r.hosts)):
        before = snapshot(s), snapshot(r)
        with pytest.raises(mc.PoolExhaustedError):
            loopback(s.mgr, r.mgr)
        assert (snapshot(s), snapshot(r)) == before
        return []
    queued = len(s.mgr.queued())
    assert loopback(s.mgr, r.mgr) == ids
    landed = {t: h for h, t in r.host.held().items() if h not in r.hosts}
    assert sorted(landed) == sorted(ids)
    for ev in ready:
        rid, h = ev.request_id or "", landed[ev.request_id or ""]
        rows, defined = r.received[rid] = s.captured.pop(rid)
        if defined:  # the bytes the exported slot held at the export's point of the order, exactly
            for i, (want, t) in enumerate(zip(rows, r.host.tensors, strict=True)):
                assert torch.equal(want, t[:, h]), f"{rid}: tensor {i} landed other bytes than were exported"
        r.oracle.land(h, *sent_rows(s, ev))
        r.hosts[h] = rid
        r.arrived[rid] = h
    delivered_by(s, ready, queued)
    r.check_ledgers()
    return ids


def sent_rows(s: Engine, ev: mc.Export) -> tuple[list[torch.Tensor], bool]:
    """What the wire carries for ``ev``: its staged state, or (in place) its slot's as it is now."""
    if ev.host is None:
        return [t[:, ev.slot].clone() for t in s.oracle.tensors], ev.slot in s.oracle.defined
    return [t[:, ev.host].clone() for t in s.oracle.host], ev.host in s.oracle.host_defined


def delivered_by(s: Engine, ready: list[mc.Export], queued: int) -> None:
    """The sender releases the exported slots, then drops their staging slots, at this point of its order."""
    delivered = [mc.Release(ev.slot, ev.request_id) for ev in ready]
    delivered += [mc.DropHost(ev.host) for ev in ready if ev.host is not None]
    s.apply(*delivered)
    for ev in ready:
        if ev.host is not None:
            s.free_host(ev.host)
        del s.tenants[ev.slot]
    assert s.mgr.queued()[queued:] == delivered
    s.exports = [(ev, ran) for ev, ran in s.exports if not ran]
    s.check_ledgers()


def transfer_in_place(s: Engine, r: Engine, ready: list[mc.Export]) -> list[str]:
    """Every state of the batch awaits ``r``'s settled slot: it lands straight in it, no host slot taken."""
    ids = [ev.request_id or "" for ev in ready]
    queued, hosts = len(s.mgr.queued()), r.host.held()
    assert loopback(s.mgr, r.mgr) == ids
    assert r.host.held() == hosts
    for ev in ready:
        rid = ev.request_id or ""
        slot = r.awaiting[rid][0]
        rows, defined = r.received[rid] = s.captured.pop(rid)
        if defined:
            for i, (want, t) in enumerate(zip(rows, r.pool.tensors, strict=True)):
                assert torch.equal(want, t[:, slot]), f"{rid}: tensor {i} landed other bytes than were exported"
        r.oracle.land_slot(slot, *sent_rows(s, ev))
        r.awaiting[rid][2] = True
    delivered_by(s, ready, queued)
    r.check_ledgers()
    return ids


# -- the property -----------------------------------------------------------------
KINDS = (
    "alloc", "alloc", "clear", "cow", "cow", "release", "commit", "offload", "restore", "drop", "export", "export",
    "export", "import", "import", "recycle", "flush", "flush", "flush", "transfer", "transfer", "expect", "expect",
)  # fmt: skip
transfer_ops = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 1), st.integers(0, 10**6), st.integers(0, 10**6)),
    min_size=20,
    max_size=90,
)


def play(e: Engine, other: Engine, kind: str, a: int, b: int, faults: Any) -> None:
    """One drawn op on side ``e`` (its peer ``other``); an op with nothing to act on does nothing."""
    live, free = sorted(e.tenants), e.free()
    if kind == "alloc" and free:
        e.alloc(b % 4 != 0)
    elif kind == "clear" and live:
        e.clear(live[a % len(live)])
    elif kind == "cow" and live:
        e.cow(live[a % len(live)], live[b % len(live)])
    elif kind == "commit" and live:
        e.commit(live[a % len(live)], b % (SPEC.draft_tokens + 1))
    elif kind == "release" and e.releasable():
        e.release(e.releasable()[a % len(e.releasable())])
    elif kind == "offload" and live:
        e.offload(live[a % len(live)])
    elif kind == "restore" and live and e.user_hosts:
        e.restore(sorted(e.user_hosts)[b % len(e.user_hosts)], live[a % len(live)], keep=a % 3 == 0)
    elif kind == "drop" and e.user_hosts:
        e.drop(sorted(e.user_hosts)[a % len(e.user_hosts)])
    elif kind == "export" and e.releasable() and len(e.exports) + len(other.exports) < H - 1:
        # Fewer states in flight than a host pool holds, or each side could fill its staging area with its own
        # exports and have no room to land the other's: no batch could move (the drain below must end).
        slot = e.releasable()[a % len(e.releasable())]
        if not e.refused(slot, lambda: e.mgr.export(slot, e.tenants[slot]), write=False):
            e.export(slot, in_place=b % 2 == 1)
    elif kind == "import" and (e.arrived or e.awaiting):
        rids = sorted({*e.arrived, *e.awaiting})
        rid = rids[a % len(rids)]
        if rid in e.awaiting and (e.awaiting[rid][2] or rid in e.arrived):
            e.import_into(e.awaiting[rid][0], rid)  # into the slot it awaits, landed there or in staging
        elif rid in e.awaiting:
            slot = e.awaiting[rid][0]
            before = snapshot(e)
            with pytest.raises(mc.SlotStateError, match="no state has arrived"):
                e.mgr.import_into(slot, rid)
            assert snapshot(e) == before
        elif free:
            e.import_into(free[b % len(free)], rid)
    elif kind == "expect" and free and other.exports:
        e.expect(free[b % len(free)], other.exports[a % len(other.exports)][0].request_id or "")
    elif kind == "recycle" and set(e.arrived) - set(e.awaiting) and e.releasable():
        # A clear and a release of the target queued before the import never wipe it; a clear after it does.
        slot = e.releasable()[b % len(e.releasable())]
        if a % 2:
            e.clear(slot)
        e.release(slot)
        rids = sorted(set(e.arrived) - set(e.awaiting))
        e.import_into(slot, rids[a % len(rids)])
        if b % 3 == 0:
            e.clear(slot)
    elif kind == "flush":
        e.flush(next(faults, 0), other, ("", "land", "pause", "pause-fail")[a % 4])
        e.forward()
    elif kind == "transfer":
        transfer(e, other)


def drain(a: Engine, b: Engine) -> None:
    """Deliver and import everything in flight, free every slot: nothing may stay held on either side."""
    for _ in range(2):
        for e in (a, b):
            for slot in e.releasable():
                e.release(slot)
            for h in sorted(e.user_hosts):
                e.drop(h)
            for rid in sorted({*e.arrived, *e.awaiting}):
                if rid in e.awaiting and (e.awaiting[rid][2] or rid in e.arrived):
                    slot = e.awaiting[rid][0]
                elif rid in e.awaiting:
                    continue  # released below: a state that comes later lands in staging
                else:
                    slot = e.free()[0]
                e.import_into(slot, rid)
                e.release(slot)
            for a in list(e.awaiting.values()):
                e.release(a[0])
            e.flush()
        for s, r in ((a, b), (b, a)):
            transfer(s, r)
    for e in (a, b):
        assert not e.exports and not e.arrived and not e.awaiting
        e.mgr.check_idle()


def run(raw: list[tuple[str, int, int, int]], variants: tuple[str, str], faults: list[int], seed: int) -> None:
    with contextlib.ExitStack() as stack:
        a = Engine("a", variants[0], seed, stack)
        b = Engine("b", variants[1], seed + 7, stack)
        fault_iter = iter(faults)
        for kind, side, x, y in raw:
            e, other = (a, b) if side == 0 else (b, a)
            play(e, other, kind, x, y, fault_iter)
        for e in (a, b):
            e.flush(next(fault_iter, 0), b if e is a else a)
        drain(a, b)


# Each side on its own executor variant; the one-element npu workspace (a hundred times slower, one element of
# scratch at a time) runs in the sweep below only.
QUICK = sorted(set(VARIANTS) - {"npu-one-element"})


@given(
    raw=transfer_ops,
    variants=st.tuples(st.sampled_from(QUICK), st.sampled_from(QUICK)),
    faults=st.lists(st.one_of(st.integers(0, 20), st.integers(0, 150)), max_size=12),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=150, deadline=None)
def test_exports_and_imports_mixed_with_every_event_on_both_sides_match_the_oracle(
    raw: list[tuple[str, int, int, int]], variants: tuple[str, str], faults: list[int], seed: int
) -> None:
    run(raw, variants, faults, seed)


# -- a fault at every op of a flush with export and import stages, on both sides ---------------------------------
def heavy(variant: str, at: int) -> tuple[int, int]:
    """Both sides run a step with every event kind, exports and imports among them, faulted before op ``at``;
    then both transfer and import. Returns the ops of the two faulted flushes (``at`` 0: none)."""
    with contextlib.ExitStack() as stack:
        a, b = Engine("a", variant, 1, stack), Engine("b", variant, 2, stack)
        sides = ((a, b), (b, a))
        users = {}
        for e, _ in sides:  # each side sends one state ahead, and keeps a host copy of a running slot
            e.export(e.alloc(True))
            users[e.name] = e.offload(2)
            e.flush()
        for e, p in sides:
            transfer(e, p)
        for e, _ in sides:
            e.flush()
            e.forward()
        importers = {}
        for e, _ in sides:  # the faulted step: 1 and 2 run, 3..5 free, one state arrived
            (rid,) = e.arrived
            n1, n2 = e.alloc(True), e.alloc(False)
            e.export(1)  # staged as of here ...
            e.clear(1)  # ... so a clear queued after it never reaches what is sent
            e.cow(2, 1)
            e.commit(2, 2)
            e.cow(2, n2)
            e.export(2)  # the committed state goes
            e.offload(n1)  # a cleared slot, offloaded
            h = users[e.name]
            assert h is not None
            e.restore(h, n1, keep=False)
            e.clear(n1)
            e.release(n1)  # a clear and a release queued before the import never wipe it
            e.import_into(n1, rid)
            n3 = e.alloc(True)
            e.cow(n1, n3)  # the imported state, read within its own step
            importers[e.name] = (rid, [n1, n3])
        ops = a.flush(at, b), b.flush(at, a)
        for e, _ in sides:  # the retried flush put exactly the state that was sent into the importing slots
            rid, slots = importers[e.name]
            rows, defined = e.received[rid]
            assert defined
            for slot in slots:
                for want, t in zip(rows, e.pool.tensors, strict=True):
                    assert torch.equal(want, t[:, slot]), (e.name, slot)
        for e, p in sides:
            transfer(e, p)  # what the retried flush staged is what each export saw, byte for byte
        for e, _ in sides:
            e.flush()
            for rid in sorted(e.arrived):
                e.import_into(e.free()[0], rid)
            e.flush()
        drain(a, b)
        return ops


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_fault_at_every_op_of_steps_with_exports_and_imports_loses_nothing(variant: str) -> None:
    """Every op of both sides' step (sampled unless MAMBACACHE_FULL_SWEEP is set); each time the retried flush
    leaves exactly the oracle's state, a transfer before the retry is refused, and the transfer after it moves
    exactly the exported bytes."""
    ops = heavy(variant, 0)
    assert min(ops) > 10, ops
    for at in fault_points(max(ops)):
        heavy(variant, at)


# -- bad input: a typed error, and nothing changed ---------------------------------------------------------------
def _pair(stack: contextlib.ExitStack, host: int = 3) -> tuple[mc.CacheManager, mc.CacheManager]:
    spec = SPEC
    return tuple(  # type: ignore[return-value]
        stack.enter_context(mc.CacheManager(mc.StatePool(spec, 4), host_pool=mc.HostPool(spec, host))) for _ in range(2)
    )


def test_bad_exports_and_imports_are_typed_errors_that_change_nothing() -> None:
    with mc.CacheManager(mc.StatePool(SPEC, 4)) as plain:  # no host pool: no staging area
        (s,) = plain.alloc(1, "r")
        before = state(plain)
        with pytest.raises(mc.InvalidArgumentError, match="host pool"):
            plain.export(s, "r")
        with pytest.raises(mc.InvalidArgumentError, match="host pool"):
            plain.import_into(2, "r")
        assert state(plain) == before
    with contextlib.ExitStack() as stack:
        send, recv = _pair(stack)
        (s,) = send.alloc(1, "r")
        send.flush_nowait()
        before = state(send)
        with pytest.raises(mc.SlotStateError):
            send.export(2, "r")  # a free slot
        with pytest.raises(mc.SlotStateError, match="belongs to 'r'"):
            send.export(s, "q")  # another request's slot
        with pytest.raises(mc.InvalidSlotError):
            send.export(5, "r")
        with pytest.raises(mc.InvalidArgumentError):
            send.export(s, None)  # type: ignore[arg-type]
        assert state(send) == before
        others = send.alloc(3, "r")
        send.export(s, "r", to=0)
        before = state(send)
        with pytest.raises(mc.SlotStateError, match="exported already"):
            send.export(others[0], "r")  # another state of "r" in one batch with it: the peer imports one
        assert state(send) == before
        for i, t in enumerate(others[:2], 1):
            send.export(t, "r", to=i)  # each to its own peer
        full = state(send)
        with pytest.raises(mc.SlotStateError, match="exporting"):
            send.export(s, "r")  # already exporting
        with pytest.raises(mc.PoolExhaustedError):
            send.export(others[2], "r", to=3)  # no staging slot left
        assert state(send) == full
        # The receiver: nothing arrived, a held slot, a bad id or slot.
        (held,) = recv.alloc(1, "old")
        before = state(recv)
        with pytest.raises(mc.SlotStateError, match="no state has arrived"):
            recv.import_into(2, "r")
        assert state(recv) == before
        assert recv.land(["r"]) == [1]
        before = state(recv)
        with pytest.raises(mc.SlotStateError, match="held by 'old'"):
            recv.import_into(held, "r")
        with pytest.raises(mc.InvalidSlotError):
            recv.import_into(0, "r")
        with pytest.raises(mc.InvalidArgumentError):
            recv.import_into(2, None)  # type: ignore[arg-type]
        # land: an id that arrived and is not imported, an id twice in a batch, more states than host slots.
        with pytest.raises(mc.SlotStateError, match="arrived twice"):
            recv.land(["q", "r"])
        with pytest.raises(mc.SlotStateError, match="arrived twice"):
            recv.land(["q", "q"])
        with pytest.raises(mc.PoolExhaustedError):
            recv.land(["p", "q", "s"])
        assert state(recv) == before
        recv.import_into(2, "r")  # what did arrive is still there to import, once
        with pytest.raises(mc.SlotStateError, match="no state has arrived"):
            recv.import_into(3, "r")
        assert recv.held() == {held: "old", 2: "r"}


def test_a_batch_that_cannot_land_leaves_both_sides_as_they_were_and_moves_later() -> None:
    with contextlib.ExitStack() as stack:
        send, recv = _pair(stack, host=2)
        slots = [send.alloc(1, f"r{i}")[0] for i in range(2)]
        (old,) = recv.alloc(1, "old")
        h = recv.offload(old)  # one of the receiver's two host slots is taken: a batch of two cannot land
        send.flush_nowait()
        recv.flush_nowait()
        for i, s in enumerate(slots):
            for t in send.pool.tensors:
                t[:, s] = 10 + i
            send.export(s, f"r{i}")
        send.flush_nowait()
        before = state(send), state(recv)
        with pytest.raises(mc.PoolExhaustedError):
            loopback(send, recv)
        assert (state(send), state(recv)) == before  # the sender keeps its slots, the receiver holds nothing more
        recv.drop(h)
        recv.flush_nowait()
        assert loopback(send, recv) == ["r0", "r1"]
        recv.import_into(3, "r1")
        recv.import_into(4, "r0")
        recv.flush_nowait()
        for t in recv.pool.tensors:
            assert bool((t[:, 3] == 11).all()) and bool((t[:, 4] == 10).all())
        send.flush_nowait()
        assert send.held() == {} and send.exports_ready() == []


def test_a_second_export_of_an_exporting_slot_is_refused() -> None:
    with contextlib.ExitStack() as stack:
        send, _ = _pair(stack)
        (s,) = send.alloc(1, "r")
        send.flush_nowait()
        send.export(s, "r")
        before = state(send)
        with pytest.raises(mc.SlotStateError):
            send.export(s, "r")
        assert state(send) == before


def test_landing_never_overwrites_a_host_slot_a_queued_event_still_reads() -> None:
    with contextlib.ExitStack() as stack:
        send, recv = _pair(stack, host=2)
        a, b = send.alloc(1, "a")[0], send.alloc(1, "b")[0]
        (held,) = recv.alloc(1, "old")
        recv.offload(held)  # takes receiver host slot 1; slot 2 is free
        send.flush_nowait()
        recv.flush_nowait()
        for s, value in ((a, 1.0), (b, 2.0)):
            for t in send.pool.tensors:
                t[:, s] = value
        send.export(a, "a")
        send.flush_nowait()
        assert loopback(send, recv) == ["a"]  # lands in host slot 2
        recv.import_into(3, "a")  # queued: reads host slot 2 at the next flush, and frees it
        send.export(b, "b")
        send.flush_nowait()
        with contextlib.suppress(mc.PoolExhaustedError):  # refusing is right too: the sender keeps "b"
            loopback(send, recv)  # the only host slot a land can take is 2, still to be read by the import
        recv.flush_nowait()
        for t in recv.pool.tensors:
            assert bool((t[:, 3] == 1.0).all()), "the import read the state that landed after it was queued"


def test_state_transfer_receive_lands_a_float8_state() -> None:
    with contextlib.ExitStack() as stack:
        send, recv = _pair(stack)
        (s,) = send.alloc(1, "r")
        send.flush_nowait()
        send.export(s, "r")
        send.flush_nowait()
        (ev,) = send.exports_ready()
        src = send.host_pool
        assert src is not None
        rows = [t.index_select(1, torch.tensor([ev.host])) for t in src.tensors]
        xfer = OneBatch(rows).transfer(recv)  # receive() with the wire stood in: the rows, no ack
        assert xfer.receive() == ["r"]
