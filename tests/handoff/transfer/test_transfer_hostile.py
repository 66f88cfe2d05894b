"""The transfer against a broken or hostile peer: whatever a peer writes into the store is parsed typed.

A receiver refuses a malformed header with reason ``"header"`` (its decision written, so the next honest batch
gets through); a sender takes a malformed decision or acknowledgement as a failed batch (a TransferError, the pair
replaced). The real link in one process (``tests/support/link.py``): clients of one TCPStore on 127.0.0.1, the gloo pair
between two threads.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mambacache as mc
from mambacache._handoff import _control, _link
from mambacache._handoff._control import MAGIC
from mambacache._handoff._link import fingerprint

from ...support.link import in_thread, store, transfer
from ...support.util import quant_spec

SPEC = quant_spec(2)


# The timeout of a transfer whose batch must land: no test here waits it out, and a pulled read (Mooncake over TCP)
# on a loaded 2-core host took over the 2 s these used.
LANDS = 20.0


def _mgr(host: int = 2) -> mc.CacheManager:
    return mc.CacheManager(mc.StatePool(SPEC, 4), host_pool=mc.HostPool(SPEC, host))


def _direction(master: Any, src: int, dst: int) -> Any:
    """A raw client of direction ``src > dst``'s keys: what a broken or forged peer writes with."""
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    return dist.PrefixStore(f"mambacache/xfer/{src}>{dst}/", client)


def _export(mgr: mc.CacheManager, rid: str) -> int:
    (slot,) = mgr.alloc(1, rid, clear=False)
    mgr.flush_nowait()
    mgr.export(slot, rid)
    mgr.flush_nowait()
    return slot


def _lands_once(send: Any, into: mc.StateTransfer, dst: mc.CacheManager, rid: str) -> None:
    """``send`` in a thread while ``into`` receives: ``rid`` is sent and received once, then discarded on ``dst``."""
    thread, sent = in_thread(send)
    try:
        assert into.receive() == [rid]
    finally:
        thread.join(10)
    assert sent == [[rid]], sent
    dst.discard_arrived(rid)
    dst.flush_nowait()


def _honest_header() -> dict[str, Any]:
    fp = fingerprint(SPEC.num_layers, SPEC.shapes())
    sizes = _link.message_sizes(SPEC.num_layers, SPEC.shapes(), 1, False)
    return {"magic": MAGIC, "tok": "x", "seq": 1, "ids": ["x"], "fp": fp, "pair": "x.0", "split": False, "bytes": sizes}


def _without(key: str) -> bytes:
    header = _honest_header()
    del header[key]
    return json.dumps(header).encode()


def _with(**fields: Any) -> bytes:
    return json.dumps({**_honest_header(), **fields}).encode()


MALFORMED_HEADERS = {
    "no fp": _without("fp"),
    "no ids": _without("ids"),
    "not UTF-8": b"\xff\xfe{}",
    "nested too deep": b"[" * 200_000 + b"]" * 200_000,
    "a deep fp": _with(fp=json.loads("[" * 500 + "]" * 500)),
    "a list": b"[1, 2]",
    "a negative seq": _with(seq=-1),
    "a huge seq": _with(seq=2**70),
    "a bool seq": _with(seq=True),
    "a float magic": _with(magic=float(MAGIC)),
    "a token with a slash": _with(tok="../x"),
    "a pair without an epoch": _with(pair="x"),
    "a negative byte size": _with(bytes=[-1] * len(SPEC.shapes())),
    "ids not str": _with(ids=[1]),
    "a string split": _with(split="yes"),
    "a huge number": b'{"seq": 1' + b"0" * 5000 + b"}",
}


@pytest.mark.parametrize("raw", MALFORMED_HEADERS.values(), ids=MALFORMED_HEADERS.keys())
def test_a_malformed_header_is_refused_and_the_next_honest_batch_gets_through(raw: bytes) -> None:
    """A header with no ``fp`` raised a bare KeyError from ``receive()``, one that is not UTF-8 a
    UnicodeDecodeError, JSON nested too deep a RecursionError: no decision was written, so every later
    ``receive()`` met the same header and an honest sender's batch never got through."""
    master = store()
    with _mgr() as src, _mgr() as dst:
        out, into = transfer(src, master, 0, 1, LANDS), transfer(dst, master, 1, 0, LANDS)
        forged = _direction(master, 0, 1)
        forged.set(f"hdr/{forged.add('posted', 1)}", raw)
        with pytest.raises(mc.TransferRefusedError) as caught:
            into.receive()
        assert caught.value.reason == "header", caught.value
        assert forged.get("state/1").startswith(b"refuse:header:"), "no decision was written"
        _export(src, "r")
        _lands_once(out.send, into, dst, "r")
        dst.check_idle(host=True)
        src.flush_nowait()
        src.check_idle(host=True)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
_FIELDS = st.sampled_from(["magic", "tok", "seq", "ids", "fp", "pair", "split", "bytes"])


@pytest.mark.no_transport
@given(st.dictionaries(_FIELDS, _JSON, max_size=8), st.booleans())
def test_any_json_in_place_of_a_header_parses_or_is_malformed(fields: dict[str, Any], over: bool) -> None:
    """Fields of any JSON value, over an honest header or alone: a Header whose fields have the honest types, or
    Malformed (a TransferError); never another exception."""
    raw = json.dumps({**_honest_header(), **fields} if over else fields).encode()
    try:
        header = _control.header(raw)
    except _control.Malformed:
        return
    assert type(header.seq) is int and 0 <= header.seq < 2**63 and all(type(r) is str for r in header.ids)
    assert all(type(b) is int and b >= 0 for b in header.sizes) and type(header.split) is bool


@pytest.mark.no_transport
@given(st.binary(max_size=64) | st.text(max_size=24).map(str.encode))
def test_any_bytes_in_place_of_a_control_value_parse_or_are_malformed(raw: bytes) -> None:
    """Any bytes as a header, a decision or an acknowledgement: parsed, or Malformed; never another exception."""
    for parse in (_control.header, _control.decision, _control.ack):
        with contextlib.suppress(_control.Malformed):
            parse(raw)


@pytest.mark.no_transport
@given(st.text(max_size=30))
def test_a_receivers_answer_round_trips_through_the_parser(why: str) -> None:
    """Whatever ``why`` an engine passes to ``acknowledge(landed=False)``, the refusal written parses back to the
    same refusal (the sender never meets a malformed answer from an honest receiver)."""
    refusal = _control.Refusal.of_answer(why)
    assert _control.ack(refusal.encode().encode()).refusal == refusal
    assert _control.decision(refusal.encode().encode()).refusal == refusal


MALFORMED_DECISIONS = {
    "a superscript room": "refuse:room:\u00b2:x".encode(),
    "not UTF-8": b"\xff\xfe",
    "an unknown reason": b"refuse:tired::x",
    "an unknown kind": b"maybe",
    "go with a token that names other keys": b"go:../../x",
    "go without a token": b"go:",
}


@pytest.mark.parametrize("raw", MALFORMED_DECISIONS.values(), ids=MALFORMED_DECISIONS.keys())
def test_a_malformed_decision_is_a_transfer_error_the_pair_replaced(raw: bytes) -> None:
    """A receiver's decision ``refuse:room:²:x`` made ``send()`` raise a bare ValueError (``"²".isdigit()``
    holds, ``int("²")`` fails), one not UTF-8 a UnicodeDecodeError; the batch was then in doubt over a pair
    that was not replaced. A TransferError, the pair replaced, as any failed batch; the retry lands once."""
    master = store()
    with _mgr() as src, _mgr() as dst:
        out, into = transfer(src, master, 0, 1, LANDS), transfer(dst, master, 1, 0, LANDS)
        forged = _direction(master, 0, 1)
        _export(src, "r")
        thread, sent = in_thread(out.send)
        forged.wait(["hdr/1"], timedelta(seconds=10))
        forged.set("state/1", raw)
        forged.add("taken", 1)  # the forged receiver settled header 1
        thread.join(10)
        assert len(sent) == 1 and type(sent[0]) is mc.TransferError, sent
        assert sent[0].request_ids == ["r"] and "malformed decision" in str(sent[0])
        assert out._out._epoch == 1, "the pair was not replaced"  # type: ignore[attr-defined]
        _lands_once(out.send, into, dst, "r")
        src.flush_nowait()
        src.check_idle(host=True)


MALFORMED_ACKS = {
    "a superscript room": "refuse:room:\u00b2:x".encode(),
    "not UTF-8": b"\xff",
    "ok with a superscript count": "ok:\u00b9".encode(),
    "an unknown kind": b"fine",
}


@pytest.mark.parametrize("raw", MALFORMED_ACKS.values(), ids=MALFORMED_ACKS.keys())
def test_a_malformed_acknowledgement_is_a_transfer_error_and_the_retry_lands_once(raw: bytes, transport: str) -> None:
    """The receiver landed the batch and wrote an acknowledgement of no known form: ``send()`` raised it bare
    (ValueError, UnicodeDecodeError), in doubt over a pair not replaced. A TransferError (in doubt: it may have
    landed), a fresh pair (the link's next epoch; over gloo the pair's group retired), and the retry is
    acknowledged as a duplicate, landed once."""
    master = store()
    with _mgr() as src, _mgr() as dst:
        out, into = transfer(src, master, 0, 1, LANDS), transfer(dst, master, 1, 0, LANDS)
        inbox = into._in  # type: ignore[attr-defined]
        real = inbox.call

        def forge_once(what: str, *args: Any) -> Any:
            if what == "set" and str(args[0]).startswith("ack/"):
                inbox.call = real
                return real(what, args[0], raw)
            return real(what, *args)

        inbox.call = forge_once
        retired = len(_link._RETIRED)
        _export(src, "r")
        thread, sent = in_thread(out.send)
        try:
            assert into.receive() == ["r"]
        finally:
            thread.join(10)
        assert len(sent) == 1 and type(sent[0]) is mc.TransferError, sent
        assert sent[0].request_ids == ["r"]
        assert out._out._epoch == 1, "the pair the batch went over was kept"  # type: ignore[attr-defined]
        if transport == "gloo":  # a pulled wire (NIXL, Mooncake) holds no group per pair: the receiver reads
            assert len(_link._RETIRED) == retired + 1, "the gloo pair the batch went over was kept"
        thread, sent = in_thread(out.send)  # the retry: acknowledged again, not landed again
        try:
            with pytest.raises(mc.TransferError, match="no batch"):
                into.receive()
        finally:
            thread.join(10)
        assert sent == [["r"]], sent
        assert dst.discard_arrived("r") > 0
        dst.flush_nowait()
        dst.check_idle(host=True)
        src.flush_nowait()
        src.check_idle(host=True)


# -- bad arguments -------------------------------------------------------------------------------------------------
@pytest.mark.no_transport
@pytest.mark.parametrize("spec", ["x", None, 3, SPEC.shapes()])
def test_a_layout_of_something_else_than_a_spec_is_a_typed_error(spec: Any) -> None:
    """``StateLayout.synthetic("x")`` raised a bare AttributeError (``'str' object has no attribute 'conv_shapes'``)."""
    from mambacache._handoff._reslice import StateLayout

    with pytest.raises(mc.InvalidArgumentError, match="StateSpec"):
        StateLayout.synthetic(spec)


def _posted(master: Any) -> int:
    return int(_direction(master, 0, 1).add("posted", 0))


@pytest.mark.parametrize("kind", ["sparse", "sparse_csr", "meta"])
def test_send_rows_of_a_sparse_or_device_tensor_is_a_typed_error_before_anything_is_posted(kind: str) -> None:
    """A sparse tensor's rows raised a bare RuntimeError (a sparse tensor has no strides to send its bytes from);
    rows that are not host memory cannot go over gloo either. Refused before a header is posted."""
    import torch

    dense = torch.zeros(2, 1, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "Sparse CSR tensor support is in beta state"
        rows = dense.to_sparse() if kind == "sparse" else dense.to("meta") if kind == "meta" else dense.to_sparse_csr(1)
    master = store()
    with _mgr() as mgr:
        out = transfer(mgr, master, 0, 1, 0.3)
        with pytest.raises(mc.InvalidArgumentError, match="strided, on the CPU"):
            out.send_rows(["a"], [rows], 1)
        assert _posted(master) == 0, "a header went out for a call that was refused"


@pytest.mark.parametrize(("rank", "peer"), [(0, 2**70), (2**70, 0), (0, 2**31), (True, 0), (0, -1)])
def test_a_rank_no_process_can_have_is_refused(rank: Any, peer: Any) -> None:
    """``StateTransfer(peer=2**70, store=...)`` was accepted: a direction no process could ever answer on."""
    import torch.distributed as dist

    master = store()
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    with _mgr() as mgr, pytest.raises(mc.InvalidArgumentError, match="two distinct ranks"):
        mc.StateTransfer(mgr, None, peer=peer, store=client, rank=rank, timeout=1.0)


# -- a second sender of the manager --------------------------------------------------------------------------------
@pytest.mark.parametrize("first", ["kept", "dropped"])
def test_a_state_in_doubt_is_recognised_whichever_transfer_of_the_manager_sends_it_again(
    first: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Transfer A's batch landed, but its acknowledgement came after A's timeout: in doubt. The engine then sent
    through a second StateTransfer of the same manager to the same peer (a second sender on the rank, or a fresh
    one built after the failure, A ``dropped``): B shipped the state as a new batch under its own token, and the
    peer, which remembers what it landed per sender token, took it for a new state (refused as arrived twice
    while the first copy waited, landed twice once it was imported). The doubt is the manager's book's: B sends
    it again under A's batch, and the peer acknowledges it without landing it twice."""
    import gc

    import mambacache._handoff._transfer as transfer_mod

    real = transfer_mod._acknowledge_landed

    def late(*args: Any) -> None:
        import time

        time.sleep(1.5)  # past the sender's 1 s wait for the acknowledgement
        real(*args)

    master = store()
    with _mgr() as src, _mgr() as dst:
        a, into = transfer(src, master, 0, 1, 1.0), transfer(dst, master, 1, 0, 2.0)
        _export(src, "r")
        monkeypatch.setattr(transfer_mod, "_acknowledge_landed", late)
        thread, sent = in_thread(a.send)
        try:
            assert into.receive() == ["r"]
        finally:
            thread.join(10)
        monkeypatch.setattr(transfer_mod, "_acknowledge_landed", real)
        assert type(sent[0]) is mc.TransferError and "did not acknowledge" in str(sent[0]), sent  # in doubt
        if first == "dropped":
            del a, thread, sent
            gc.collect()
        b = transfer(src, master, 0, 1, LANDS)
        thread, sent = in_thread(b.send)
        try:
            with pytest.raises(mc.TransferError, match="no batch"):
                into.receive()  # nothing new lands: the retry was answered "dup" inside the wait
        finally:
            thread.join(10)
        assert sent == [["r"]], sent
        assert dst.discard_arrived("r") > 0  # arrived once, and is here
        dst.flush_nowait()
        dst.check_idle(host=True)
        # A new export after the doubt goes as a new batch, through either transfer.
        _export(src, "s")
        _lands_once(b.send if first == "dropped" else a.send, into, dst, "s")
        src.flush_nowait()
        src.check_idle(host=True)


class _Peer:
    """A receiver behind a fake wire that keeps the link's promise: it remembers the last batch it landed per
    token (``Inbox``'s memory), lands a batch it does not remember, and counts every landing of each id."""

    def __init__(self, mgr: mc.CacheManager) -> None:
        self.mgr = mgr
        self.last: dict[str, int] = {}
        self.landings: dict[str, int] = {}
        self.lose: set[str] = set()  # ids whose next acknowledgement is lost (the batch lands: in doubt)
        self.during: list[Any] = []  # calls made while the next batch is on the wire (another sender's send)

    def ship(self, batch: list[mc.Export], ids: list[str], ident: tuple[str, int], retry: bool) -> None:
        tok, seq = ident
        if self.last.get(tok) != seq:
            for rid in ids:
                self.landings[rid] = self.landings.get(rid, 0) + 1
            self.last[tok] = seq
        if self.during:
            self.during.pop(0)()
        if self.lose & set(ids):
            self.lose -= set(ids)
            raise mc.TransferError("the acknowledgement timed out", ids)


@pytest.mark.no_transport
def test_two_batches_in_doubt_with_one_peer_are_each_retried_under_their_own_batch() -> None:
    """Sender B retries A's batch in doubt (``a``) while A sends a new export (``b``) under a fresh token; both
    acknowledgements are lost, so two batches are in doubt with the peer at once. The next send retries each
    under its own batch: neither lands twice (putting back the exports a retry leaves for later must not forget
    their doubt)."""
    from mambacache._handoff._transfer import Batches, send_exports

    with _mgr(host=4) as mgr:
        peer, a, b = _Peer(mgr), Batches(), Batches()
        _export(mgr, "a")
        peer.lose = {"a"}
        with pytest.raises(mc.TransferError):
            send_exports(mgr, peer.ship, [1], a)
        _export(mgr, "b")

        def a_sends_b() -> None:
            peer.lose.add("b")
            with pytest.raises(mc.TransferError):
                send_exports(mgr, peer.ship, [1], a)  # takes only "b": "a" is being sent by B

        peer.during = [a_sends_b]
        peer.lose = {"a"}
        with pytest.raises(mc.TransferError):
            send_exports(mgr, peer.ship, [1], b)  # the retry of a's batch, lost again
        assert peer.landings == {"a": 1, "b": 1}
        assert sorted(send_exports(mgr, peer.ship, [1], b)) == ["a", "b"]
        assert peer.landings == {"a": 1, "b": 1}, "a state in doubt landed twice"
        mgr.flush_nowait()
        mgr.check_idle(host=True)
