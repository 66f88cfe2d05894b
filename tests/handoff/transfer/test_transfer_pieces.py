"""A pulled wire (NIXL, Mooncake) reads a batch's rows where they lie: from scattered slots into scattered slots.

Over gloo the sender gathers rows that are not one run of contiguous host
memory into its kept buffers (one copy), and the receiver lands them through
its own (one more). A wire whose receiver reads the sender's registered memory
needs neither: the header names every row's byte range (consecutive rows
merged), the receiver cuts them against its own landing rows and reads each
piece straight into place. Run over every transport (tests/conftest.py): the
bytes arrive exact on every pool layout (stacked, paged rows with a gap,
separately allocated layers; int8, fp8 and a scalar-shaped extra), staged and
in place, and over a pulled wire neither side's kept buffers are ever grown.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import mambacache as mc

from ...support import link
from ...support.layered import layered_pool, pool_tensors
from ...support.util import fill_random, paged_pool, quant_spec

SPEC = quant_spec(3)
LAYOUTS: dict[str, Callable[[mc.StateSpec, int], mc.StatePool]] = {
    "stacked": mc.StatePool,
    "paged": paged_pool,
    "layered": lambda spec, n: layered_pool(spec, n, mc.StatePool),
}


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, whatever its strides (fp8 and scalar-shaped rows compare bit for bit)."""
    return t.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "in place"])
def test_scattered_rows_arrive_exactly_and_a_pulled_wire_gathers_and_scatters_nothing(
    layout: str, in_place: bool, transport: str
) -> None:
    make = LAYOUTS[layout]
    master = link.store()
    with (
        mc.CacheManager(make(SPEC, 8), host_pool=mc.HostPool(SPEC, 4)) as src,
        mc.CacheManager(make(SPEC, 8), host_pool=mc.HostPool(SPEC, 4)) as dst,
    ):
        out, into = link.transfer(src, master, 0, 1, 5.0), link.transfer(dst, master, 1, 0, 5.0)
        ids, slots, targets = ["a", "b", "c"], [2, 5, 7], [1, 4, 6]
        fill_random(src.pool, 11)
        for s, r in zip([*slots, 8], [*ids, "pad"], strict=True):
            src.alloc_slots([s], r, clear=False)
        src.flush_nowait()
        want = [[_raw(t[:, s]) for s in slots] for t in pool_tensors(src.pool)]
        src.export(2, "a", in_place=in_place)
        src.export(8, "pad", to=7, in_place=in_place)  # staged: host slots 1, 3, 4 for a, b, c (not one run)
        src.export(5, "b", in_place=in_place)
        src.export(7, "c", in_place=in_place)
        src.flush_nowait()
        if in_place:  # the states land straight in the pool slots 1, 4, 6 they await
            for s, r in zip(targets, ids, strict=True):
                dst.expect_import(s, r)
            dst.flush_nowait()
        else:  # host slot 2 held: the batch lands in staging host slots 1, 3, 4
            dst.alloc_slots([7, 8], "hold", clear=False)
            held = dst.offload_many([7, 8], "hold")
            dst.flush_nowait()
            dst.drop(held[0])
            dst.flush_nowait()
        thread, sent = link.in_thread(out.send)
        try:
            got = into.receive()
        finally:
            thread.join(10)
        assert got == ids and sent == [ids], sent
        for s, r in zip(targets, ids, strict=True):
            dst.import_into(s, r)
        dst.flush_nowait()
        for t, rows in zip(pool_tensors(dst.pool), want, strict=True):
            for s, row in zip(targets, rows, strict=True):
                assert torch.equal(_raw(t[:, s]), row), (layout, in_place, s)
        if transport != "gloo":  # read from and into the rows themselves: no kept buffer was ever grown
            assert not out._send_bufs._flat and not into._bufs._flat  # type: ignore[attr-defined]
        src.release(8, "pad")
        for s, r in zip(targets, ids, strict=True):
            dst.release(s, r)
        if not in_place:
            dst.drop(held[1])
            dst.release_many([7, 8], "hold")
        src.flush_nowait()
        dst.flush_nowait()
        src.check_idle(host=True)
        dst.check_idle(host=True)
