"""Every call on a slot that the hand-off owns, in any order, against a model of what each phase allows
(``docs/transfer.md``, ``docs/api.md``): an export (staged or in place: queued, ready, sending) keeps its slot held
and refuses a hand-over or a second export, in place also every write (clear, copy into it); a release withdraws
it, refused while sending; a slot awaiting a state (``expect_import``) refuses every other call until its import
or a release (refused while its bytes are written); a state lands in place only in a settled awaiting slot, else
in staging; an arrived state is imported once or discarded once.

Each call the model refuses must raise a typed error (:class:`~mambacache.MambaCacheError`) and change nothing
(the ledgers, the queue, the host pool, the exports, the awaiting slots); each it allows must succeed and do
what the model says.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import mambacache as mc

from ..support.util import small_spec

SLOTS, HOST = 4, 5
ALL = list(range(1, SLOTS + 1))


class _NoBytes(Exception):
    """A landing's write that fails (the bytes never came)."""


def _snapshot(mgr: mc.CacheManager) -> tuple[Any, ...]:
    host = mgr.host_pool
    assert host is not None
    return (
        mgr.held(), mgr.queued(), host.held(), mgr.exports_ready(), [mgr.awaiting_import(s) for s in ALL],
        mgr.landing_room(),
    )  # fmt: skip


class SlotUses(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        spec = small_spec(1)
        self.mgr = mc.CacheManager(mc.StatePool(spec, SLOTS), host_pool=mc.HostPool(spec, HOST))
        self.mgr.__enter__()
        self.n = 0
        self.held: dict[int, str] = {}
        self.exports: dict[int, list[Any]] = {}  # slot -> [in_place, "queued" | "ready" | "sending"]
        self.awaits: dict[int, list[Any]] = {}  # slot -> [request id, settled (its alloc's flush ran)]
        self.arrived: dict[str, str] = {}  # request id -> "slot" (in the slot it awaited) | "host" (staging)
        self.sending: list[list[mc.Export]] = []
        self.offloaded: set[int] = set()  # host slots of the engine's own offloads (not the hand-off's)

    def teardown(self) -> None:
        self.mgr.__exit__(None, None, None)

    def _rid(self) -> str:
        self.n += 1
        return f"r{self.n}"

    def _refused(self, call: Any, *args: Any, **kw: Any) -> None:
        before = _snapshot(self.mgr)
        with pytest.raises(mc.MambaCacheError) as refused:
            call(*args, **kw)
        event(f"refused {call.__name__}: {type(refused.value).__name__}")
        assert _snapshot(self.mgr) == before, f"a refused {call.__name__}{args} changed something"

    def _in_place(self, slot: int) -> bool:
        return slot in self.exports and self.exports[slot][0]

    def _awaited(self, rid: str) -> int | None:
        return next((s for s, (r, _) in self.awaits.items() if r == rid), None)

    # -- the engine's calls ----------------------------------------------------------------------
    @rule()
    def alloc(self) -> None:
        if len(self.held) == SLOTS:
            self._refused(self.mgr.alloc, 1, "x")
            return
        rid = self._rid()
        (s,) = self.mgr.alloc(1, rid)
        self.held[s] = rid

    @rule(slot=st.sampled_from(ALL), in_place=st.booleans())
    def export(self, slot: int, in_place: bool) -> None:
        rid = self.held.get(slot, "nobody")
        if slot not in self.held or slot in self.exports or slot in self.awaits:
            self._refused(self.mgr.export, slot, rid, in_place=in_place)
            return
        before = _snapshot(self.mgr)
        try:
            self.mgr.export(slot, rid, in_place=in_place)
        except mc.PoolExhaustedError:
            assert not in_place and _snapshot(self.mgr) == before
            return
        self.exports[slot] = [in_place, "queued"]

    @rule(slot=st.sampled_from(ALL))
    def release(self, slot: int) -> None:
        rid = self.held.get(slot)
        if rid is None or (slot in self.exports and self.exports[slot][1] == "sending"):
            self._refused(self.mgr.release, slot, rid or "nobody")
            return
        self.mgr.release(slot, rid)
        del self.held[slot]
        self.exports.pop(slot, None)
        if slot in self.awaits:
            del self.awaits[slot]
            if self.arrived.get(rid) == "slot":
                del self.arrived[rid]  # given up; one in staging stays, for an import elsewhere or a discard

    @rule(slot=st.sampled_from(ALL))
    def clear(self, slot: int) -> None:
        rid = self.held.get(slot)
        if rid is None or self._in_place(slot) or slot in self.awaits:
            self._refused(self.mgr.clear, slot, rid or "nobody")
            return
        self.mgr.clear(slot, rid)

    @rule(src=st.sampled_from(ALL), dst=st.sampled_from(ALL))
    def copy(self, src: int, dst: int) -> None:
        ok = src in self.held and dst in self.held
        if not ok or self._in_place(dst) or dst in self.awaits or src in self.awaits:
            self._refused(self.mgr.copy_on_write, src, dst)
            return
        self.mgr.copy_on_write(src, dst)

    @rule(slot=st.sampled_from(ALL))
    def hand_over(self, slot: int) -> None:
        rid = self.held.get(slot)
        new = self._rid()
        if rid is None or slot in self.exports or slot in self.awaits:
            self._refused(self.mgr.hand_over, slot, new, rid or "nobody")
            return
        self.mgr.hand_over(slot, new, rid)
        self.held[slot] = new

    @rule()
    def flush(self) -> None:
        self.mgr.flush_nowait()
        for x in self.exports.values():
            if x[1] == "queued":
                x[1] = "ready"
        for a in self.awaits.values():
            a[1] = True

    @rule(slot=st.sampled_from(ALL))
    def offload(self, slot: int) -> None:
        if slot not in self.held or slot in self.awaits:
            self._refused(self.mgr.offload, slot)
            return
        before = _snapshot(self.mgr)
        try:
            h = self.mgr.offload(slot)
        except mc.PoolExhaustedError:
            assert _snapshot(self.mgr) == before
            return
        self.offloaded.add(h)

    @rule(h=st.integers(1, HOST), slot=st.sampled_from(ALL), drop=st.booleans())
    def restore_or_drop(self, h: int, slot: int, drop: bool) -> None:
        """A host slot's engine calls: only its own offloads' are allowed; the hand-off's (a staging slot, an
        arrived state) are refused."""
        if drop:
            if h not in self.offloaded:
                self._refused(self.mgr.drop, h)
                return
            self.mgr.drop(h)
        else:
            if h not in self.offloaded or slot not in self.held or self._in_place(slot) or slot in self.awaits:
                self._refused(self.mgr.restore, h, slot)
                return
            self.mgr.restore(h, slot)
        self.offloaded.discard(h)

    # -- the transfer's side ---------------------------------------------------------------------
    @rule()
    def take(self) -> None:
        got = self.mgr.take_exports()
        assert sorted(ev.slot for ev in got) == sorted(s for s, x in self.exports.items() if x[1] == "ready")
        for ev in got:
            self.exports[ev.slot][1] = "sending"
        if got:
            self.sending.append(got)

    @precondition(lambda self: self.sending)
    @rule(delivered=st.booleans())
    def settle(self, delivered: bool) -> None:
        batch = self.sending.pop(0)
        if delivered:
            self.mgr.exports_delivered(batch)
            for ev in batch:
                del self.exports[ev.slot]
                del self.held[ev.slot]
        else:
            self.mgr.exports_returned(batch)
            for ev in batch:
                self.exports[ev.slot][1] = "ready"

    # -- the receiver ----------------------------------------------------------------------------
    @rule(slot=st.sampled_from(ALL), fresh=st.booleans(), data=st.data(), free=st.booleans())
    def expect_import(self, slot: int, fresh: bool, data: st.DataObject, free: bool) -> None:
        known = sorted({*self.arrived, *(r for r, _ in self.awaits.values())})
        rid = self._rid() if fresh or not known else data.draw(st.sampled_from(known))
        if free and len(self.held) < SLOTS:  # most often a free slot
            slot = min(s for s in ALL if s not in self.held)
        if slot in self.held or rid in self.arrived or self._awaited(rid) is not None:
            self._refused(self.mgr.expect_import, slot, rid)
            return
        self.mgr.expect_import(slot, rid)
        self.held[slot] = rid
        self.awaits[slot] = [rid, False]

    @rule(data=st.data(), fail=st.booleans(), expected=st.booleans())
    def land(self, data: st.DataObject, fail: bool, expected: bool) -> None:
        """A receive of one state: in place when its slot awaits it settled, else in staging (the transfer's
        order). While its bytes are written, every call on the slot or the state is refused."""
        waiting = [r for r, _ in self.awaits.values() if r not in self.arrived]
        if expected and waiting:  # most often a state some slot awaits
            rid = data.draw(st.sampled_from(waiting))
        else:
            rid = data.draw(st.sampled_from([*waiting, *self.arrived, self._rid()]))
        if rid in self.arrived:
            self._refused(self.mgr.land_in_place, [rid], lambda slots: None)
            self._refused(self.mgr.land, [rid], lambda slots: None)
            return
        slot = self._awaited(rid)
        in_place = slot is not None and self.awaits[slot][1]
        before = _snapshot(self.mgr)

        def write(slots: list[int]) -> None:
            if in_place:
                assert slots == [slot]
                self._refused(self.mgr.release, slot, rid)
                self._refused(self.mgr.clear, slot, rid)
            self._refused(self.mgr.import_into, slot or ALL[0], rid)
            self._refused(self.mgr.discard_arrived, rid)
            if fail:
                raise _NoBytes("the bytes did not come")

        try:
            if self.mgr.land_in_place([rid], write) is None:
                assert not in_place, "a state awaited in a settled slot did not land in place"
                self.mgr.land([rid], write)
            else:
                assert in_place, "landed in place in a slot not settled"
        except _NoBytes:
            assert fail and _snapshot(self.mgr) == before
            return
        except mc.PoolExhaustedError:
            assert not in_place and _snapshot(self.mgr) == before
            return
        assert not fail
        event(f"landed {'in place' if in_place else 'in staging'}")
        self.arrived[rid] = "slot" if in_place else "host"

    @rule(slot=st.sampled_from(ALL), data=st.data())
    def import_into(self, slot: int, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from([*sorted(self.arrived), *sorted(set(self.held.values())), "nobody"]))
        awaited = self._awaited(rid)
        ok = rid in self.arrived and (slot == awaited if awaited is not None else slot not in self.held)
        if not ok:
            self._refused(self.mgr.import_into, slot, rid)
            return
        self.mgr.import_into(slot, rid)
        del self.arrived[rid]
        self.awaits.pop(slot, None)
        self.held[slot] = rid

    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from([*sorted(self.arrived), "nobody"]))
        if self.arrived.get(rid) != "host":
            self._refused(self.mgr.discard_arrived, rid)
            return
        self.mgr.discard_arrived(rid)
        del self.arrived[rid]  # a slot that awaited it awaits a state again

    # -- what must hold after every call ------------------------------------------------------------
    @invariant()
    def agrees(self) -> None:
        assert self.mgr.held() == self.held
        assert {s: self.mgr.awaiting_import(s) for s in ALL if self.mgr.awaiting_import(s)} == {
            s: r for s, (r, _) in self.awaits.items()
        }
        assert sorted(ev.slot for ev in self.mgr.exports_ready()) == sorted(
            s for s, x in self.exports.items() if x[1] == "ready"
        )


SlotUses.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
test_slot_uses = SlotUses.TestCase
