"""Choosing a state transfer's transport: a name that is none, or one whose package is missing, is a typed error
raised before anything is made (the transfer suite itself runs over each transport: tests/conftest.py)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mambacache as mc
from mambacache._handoff._reslice import ReslicingSender, StateLayout
from mambacache._handoff._transports._base import Pieces
from mambacache._handoff._transports._regions import Regions, plan

from ..support import link
from ..support.util import small_spec


def _manager() -> mc.CacheManager:
    return mc.CacheManager(mc.StatePool(small_spec(), 4), host_pool=mc.HostPool(small_spec(), 2))


@pytest.mark.parametrize("name", ["tcp", "", "NIXL", None, 1])
def test_an_unknown_transport_is_a_typed_error(name: Any) -> None:
    master = link.store()
    with _manager() as mgr, pytest.raises(mc.InvalidArgumentError, match="transport must be one of 'gloo', 'nixl'"):
        mc.StateTransfer(mgr, None, peer=1, store=master, rank=0, timeout=1.0, transport=name)
    with _manager() as mgr, pytest.raises(mc.InvalidArgumentError, match="transport must be one of"):
        ReslicingSender(mgr, None, [1], StateLayout.synthetic(small_spec()), transport=name)


@pytest.mark.parametrize(("name", "module"), [("nixl", "nixl_cu12"), ("mooncake", "mooncake")])
def test_a_transport_whose_package_is_missing_names_the_extra_to_install(
    name: str, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == module else real(m, *a))
    master = link.store()
    with _manager() as mgr, pytest.raises(mc.TransportUnavailableError) as got:
        mc.StateTransfer(mgr, None, peer=1, store=master, rank=0, timeout=1.0, transport=name)
    assert isinstance(got.value, ImportError) and got.value.extra == name and got.value.transport == name
    assert f"pip install 'mambacache[{name}]'" in str(got.value)
    assert master.num_keys() == 0  # nothing was made: no key of a direction, an agent or a pair


@pytest.mark.parametrize(
    "args",
    [
        ["simulate", "--scenario", "pd", "--model", "toy", "--transport"],
        ["bench", "--transfer", "--quick", "--transport"],
    ],
    ids=["simulate", "bench"],
)
@pytest.mark.parametrize(("name", "module"), [("nixl", "nixl_cu12"), ("mooncake", "mooncake")])
def test_a_command_over_a_transport_whose_package_is_missing_is_one_line_and_exit_2(
    args: list[str], name: str, module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mambacache._cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == module else real(m, *a))
    assert main([*args, name]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"pip install 'mambacache[{name}]'" in err, err


class _Pulled:
    """A pulled wire in one process: the sender's messages by address (its ``source``), read by the receiver
    with a copy; ``delay``: seconds the next read takes (then 0), as a slow reader's would."""

    pulls = True
    rows: dict[int, Any] = {}  # noqa: RUF012 -- shared by both ends, as the memory of two processes is not
    delay = 0.0

    def source(self, raw: list[Any]) -> dict[str, Any]:
        for t in raw:
            _Pulled.rows[t.data_ptr()] = t
        return {"agent": "here", "md": 1, "mem": "DRAM", "descs": [[t.data_ptr(), t.numel(), 0] for t in raw]}

    def push(self, *args: Any) -> None:
        return

    def pull(self, raw: list[Any], source: Any, name: str, peer: str, ids: list[str]) -> None:
        import time

        time.sleep(_Pulled.delay)
        _Pulled.delay = 0.0
        for t, (address, _, _) in zip(raw, source["descs"], strict=True):
            t.copy_(_Pulled.rows[address])

    def drop(self, peer: str | None = None) -> None:
        return


class _PulledTransport:
    name = "pulled"

    def wire(self, *args: Any) -> _Pulled:
        return _Pulled()

    def register(self, tensors: Any) -> None:
        return


def test_a_pulled_batch_whose_sender_gave_up_before_the_read_was_claimed_lands_nothing_and_its_retry_lands_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over a wire whose receiver reads the sender's rows (NIXL's, Mooncake's shape), the sender's wait for the
    acknowledgement times out while the read is still going (the rows it reads from are free to change from
    then): the sender claims the read abandoned first, so the receiver, its read done, lands nothing; the
    batch in doubt goes again under its number and lands once, exactly."""
    import mambacache._handoff._transfer as transfer_mod

    monkeypatch.setattr(transfer_mod, "check_transport", lambda name: name)
    monkeypatch.setattr(transfer_mod, "make_transport", lambda *args: _PulledTransport())
    master = link.store()
    with _manager() as sender, _manager() as receiver:
        out, into = link.transfer(sender, master, 0, 1, 1.0), link.transfer(receiver, master, 1, 0, 1.0)
        (slot,) = sender.alloc(1, "a", clear=False)
        sender.flush_nowait()
        for t in sender.pool.tensors:
            t[:, slot] = 7.0
        sender.export(slot, "a")
        sender.flush_nowait()
        _Pulled.delay = 2.5  # past the sender's wait for the acknowledgement (1 s)
        thread, got = link.in_thread(into.receive)
        with pytest.raises(mc.TransferError, match="did not acknowledge"):
            out.send()
        thread.join(10)
        assert isinstance(got[0], mc.TransferError) and "gave up waiting" in str(got[0]), got
        assert receiver.host_pool is not None and receiver.host_pool.num_held == 0  # nothing landed
        thread, got = link.in_thread(into.receive)
        assert out.send() == ["a"]
        thread.join(10)
        assert got == [["a"]]
        (dst,) = receiver.alloc(1)
        receiver.release(dst)
        receiver.flush_nowait()
        receiver.import_into(dst, request_id="a")
        receiver.flush_nowait()
        assert all(t[:, dst].eq(7.0).all() for t in receiver.pool.tensors)


# -- what a pulled wire registers and reads ----------------------------------------------------------------------
def test_a_wire_whose_batches_take_turns_between_the_pools_and_its_buffer_registers_the_buffer_once() -> None:
    """A transfer's batches alternate between rows read where they lie (the pools, registered for good) and its
    kept buffers (registered for the wire): each registration is a new metadata version its peer must load
    before its next read (over NIXL: the remote agent removed and added again, a new connection). A batch that
    needed nothing new released the wire's buffer, so every turn registered it again; only memory no region
    holds replaces it."""
    added: list[int] = []
    removed: list[int] = []
    regions = Regions(lambda base, size, t: added.append(base) or base, removed.append)
    pool = torch.zeros(4, 16, dtype=torch.uint8)
    buf = torch.zeros(64, dtype=torch.uint8)
    regions.keep([pool])
    wire = object()
    changed = []
    for _ in range(3):
        changed.append(regions.cover([buf[:32], buf[32:48]], wire))
        changed.append(regions.cover([pool[1], Pieces([(pool[2].data_ptr(), 8)], [pool], pool.device)], wire))
    assert changed == [True, False, False, False, False, False]
    assert added == [pool.data_ptr(), buf.data_ptr()] and removed == []
    fresh = torch.zeros(8, dtype=torch.uint8)  # rows no region holds: they replace the wire's buffer
    assert regions.cover([Pieces([(fresh.data_ptr() + 2, 4)], [pool, fresh], fresh.device)], wire)
    assert added[-1] == fresh.data_ptr() and removed == [buf.data_ptr()]
    with pytest.raises(ValueError, match="lie in none of its tensors"):
        regions.cover([Pieces([(buf.data_ptr(), 4)], [pool], pool.device)], wire)


def _cuts(total: int) -> st.SearchStrategy[list[int]]:
    """A split of ``total`` bytes into piece sizes, empty pieces among them."""
    return st.lists(st.integers(0, total), max_size=6).map(
        lambda cuts: [b - a for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), total], strict=True)]
    )


def _laid(sizes: list[int], gaps: list[int], base: int) -> list[tuple[int, int]]:
    """Pieces of ``sizes`` bytes laid out from ``base`` with ``gaps`` bytes between (0: touching)."""
    out, at = [], base
    for size, gap in zip(sizes, gaps + [0] * len(sizes), strict=False):
        out.append((at, size))
        at += size + gap
    return out


@given(st.data())
def test_a_message_read_from_pieces_into_pieces_moves_each_byte_to_its_place(data: st.DataObject) -> None:
    """``plan`` cuts both ends' ranges of each message at each other's boundaries; the reference: the message's
    bytes numbered in order on each end, byte ``i`` of the local ranges from byte ``i`` of the remote ones."""
    totals = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=3))
    raw: list[Any] = []
    descs: list[list[int]] = []
    parts = []
    want: list[tuple[int, int]] = []
    for k, total in enumerate(totals):
        gaps = data.draw(st.lists(st.integers(0, 3), max_size=6))
        mine = _laid(data.draw(_cuts(total)), gaps, 10_000 * (k + 1))
        theirs = _laid(data.draw(_cuts(total)), gaps[::-1], 1_000_000 + 10_000 * k)
        raw.append(Pieces(mine, [], torch.device("cpu")))
        descs += [[a, size, 3] for a, size in theirs]
        parts.append(len(theirs))
        local = [a + i for a, size in mine for i in range(size)]
        remote = [a + i for a, size in theirs for i in range(size)]
        want += list(zip(local, remote, strict=True))
    reads = plan(raw, descs, parts)
    got = [(la + i, ra + i) for cuts in reads for la, ra, size, dev in cuts for i in range(size)]
    assert got == want
    assert all(size > 0 and dev == 3 for cuts in reads for _, _, size, dev in cuts)
    if sum(totals):
        with pytest.raises(ValueError, match="not the batch's messages"):
            plan(raw, [[d[0], d[1] + 1, d[2]] if d[1] else d for d in descs], parts)
