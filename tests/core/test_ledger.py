"""SlotLedger alone, against a plain set: the bookkeeping StatePool and HostPool share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mambacache as mc
from mambacache._core._ledger import SlotLedger

ops = st.lists(
    st.tuples(st.sampled_from(["take", "exact", "give", "later", "reuse"]), st.integers(0, 10**6), st.integers(1, 4)),
    max_size=80,
)


@given(ops, st.integers(1, 9))
def test_the_ledger_matches_a_set_model(raw: list[tuple[str, int, int]], size: int) -> None:
    ledger = SlotLedger(size)
    held: dict[int, str] = {}
    later: list[int] = []  # freed, not yet reusable
    for i, (kind, a, n) in enumerate(raw):
        free = sorted(set(range(1, size + 1)) - set(held) - set(later))
        if kind == "take":
            if n > len(free) + len(later):
                with pytest.raises(mc.PoolExhaustedError):
                    ledger.take(n, f"t{i}")
                continue
            got = ledger.take(n, f"t{i}")
            want = free[:n] + later[: max(0, n - len(free))]  # lowest free first, then freed-this-step
            assert got == want
            del later[: max(0, n - len(free))]
            held.update(dict.fromkeys(got, f"t{i}"))
        elif kind == "exact" and free:
            slots = free[a % len(free) :][:n]
            ledger.take_exact(slots, f"x{i}")
            held.update(dict.fromkeys(slots, f"x{i}"))
        elif kind == "give" and held:
            slots = sorted(held)[a % len(held) :][:n]
            ledger.give_back(slots)
            for s in slots:
                del held[s]
        elif kind == "later" and held:
            s = sorted(held)[a % len(held)]
            ledger.free_later(s)
            del held[s]
            later.append(s)
        elif kind == "reuse":
            ledger.reuse_freed()
            later.clear()
        assert ledger.held_by() == dict(sorted(held.items()))
        assert ledger.num_free == size - len(held)
        assert all(ledger.tenants[s] is None for s in range(1, size + 1) if s not in held)
