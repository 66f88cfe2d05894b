"""The control values of a transfer's link, written and parsed in one place: headers, decisions, acknowledgements.

Every byte a peer writes into the store is untrusted input: a bug, another
version or a forgery may write anything under a direction's keys. Each parser
here takes the raw bytes the store returned and gives a typed value, or raises
:class:`Malformed` (a :class:`~mambacache.TransferError`), never a bare
``KeyError``, ``UnicodeDecodeError``, ``ValueError`` or ``RecursionError``.
The receiver refuses a malformed header with reason ``"header"`` (its decision
is written, so the next header is read); the sender takes a malformed decision
or acknowledgement as a failed batch. No torch, no store: the byte moving is
``_link.py``'s.

The grammar (``docs/transfer.md`` has the protocol)::

    header     JSON {"magic", "tok", "seq", "ids", "fp", "pair", "split", "bytes", "src"}
    src        absent over gloo; on a pulled wire (NIXL, Mooncake) where the sender's messages lie:
               {"agent": <name>, "md": <metadata version>, "mem": "DRAM" | "VRAM", "descs": [[addr, bytes, dev], ...],
                "parts": [<descriptors of message 0>, ...]}   (parts absent: one descriptor per message)
    decision   "go:<token>" | "dup:<token>" | "withdrawn" | <refusal>
    ack        "ok:<n>" | "fail:<text>" | <refusal>
    refusal    "refuse:<reason>:<room>:<text>"   reason one of REASONS, room "" or decimal digits
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

from .._core._errors import RefusalReason, TransferError

__all__ = [
    "MAGIC", "REASONS", "Ack", "Decision", "Header", "Malformed", "Reason", "Refusal", "ack", "decision",
    "encode_header", "header", "shown", "text",
]  # fmt: skip

MAGIC = 0x6D63_7847  # 7847: the pair's name ends with the receiver's token (a peer of 7846 refuses the header)
Reason = RefusalReason
REASONS: tuple[Reason, ...] = get_args(Reason)
# A count or number on the wire: what a 64-bit peer can write; larger is no honest peer's.
_MAX_INT = 2**63 - 1
# A token names a gloo pair's keys in the store (``pair/<name>/``): short, and no separator of those keys.
_TOKEN = re.compile(r"[0-9A-Za-z_-]{1,64}")
_DIGITS = re.compile(r"[0-9]{1,19}")  # ASCII digits only: str.isdigit() takes "²", which int() refuses


class Malformed(TransferError):
    """A value a peer wrote into the store is not one this version writes (a bug, another version, a forgery)."""


def text(raw: bytes) -> str:
    """``raw`` as UTF-8 text; :class:`Malformed` when it is not."""
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise Malformed(f"a control value that is not UTF-8: {shown(raw)}") from exc


def shown(value: object) -> str:
    """A peer's value in a message: its repr, cut (a forged value may be megabytes long)."""
    shown = repr(value)
    return shown if len(shown) <= 200 else f"{shown[:200]}... ({len(shown)} characters)"


def _count(field: str, value: Any) -> int:
    """A non-negative int (not a bool) a 64-bit peer can write."""
    if type(value) is not int or not 0 <= value <= _MAX_INT:
        raise Malformed(f"{field} must be an int in [0, 2**63), got {shown(value)}")
    return value


def _token(field: str, value: Any) -> str:
    if type(value) is not str or not _TOKEN.fullmatch(value):
        raise Malformed(f"{field} must be a token (1-64 letters, digits, '_' or '-'), got {shown(value)}")
    return value


@dataclass(frozen=True, slots=True)
class Header:
    """A batch's header as the receiver reads it; every field checked for its type and range.

    ``(tok, seq)`` is the batch's identity (a retry carries it again); ``pair`` the sender's half of the gloo
    pair's name, ``<sender>.<epoch>``, where ``sender`` is the sending link's own token (the pair's other end)."""

    tok: str
    seq: int
    ids: list[str]
    fp: list[Any]
    pair: str
    sender: str
    split: bool
    sizes: list[int]
    source: dict[str, Any] | None = None  # on a pulled wire: where the sender's messages lie (checked: _source)


def encode_header(
    tok: str,
    seq: int,
    ids: list[str],
    fp: list[Any],
    pair: str,
    split: bool,
    sizes: list[int],
    source: dict[str, Any] | None = None,
) -> str:
    """The JSON header :func:`header` reads back."""
    value = {"magic": MAGIC, "tok": tok, "seq": seq, "ids": ids, "fp": fp, "pair": pair, "split": split, "bytes": sizes}
    if source is not None:
        value["src"] = source
    return json.dumps(value)


def header(raw: bytes) -> Header:
    """A header read from the store; :class:`Malformed` unless it is one this version writes. An absent ``split``
    is false (a sender from before it). The fingerprint's shape is checked here, so nothing deeper than a
    header's own nesting reaches a comparison."""
    try:
        value = json.loads(text(raw))
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested deeper than the interpreter's stack
        raise Malformed(f"a header that is not JSON: {type(exc).__name__}") from None
    if type(value) is not dict:
        raise Malformed(f"a header that is not a JSON object: {shown(value)}")
    missing = {"magic", "tok", "seq", "ids", "fp", "pair", "bytes"} - value.keys()
    if missing:
        raise Malformed(f"a header without {sorted(missing)}")
    if value["magic"] != MAGIC or type(value["magic"]) is not int:
        raise Malformed(f"a header of another version (magic {shown(value['magic'])})")
    ids, sizes, split = value["ids"], value["bytes"], value.get("split", False)
    if type(ids) is not list or not all(type(r) is str for r in ids):
        raise Malformed(f"a header whose ids are not a list of str: {shown(ids)}")
    if type(sizes) is not list:
        raise Malformed(f"a header whose byte sizes are not a list: {shown(sizes)}")
    if type(split) is not bool:
        raise Malformed(f"a header whose split is not a bool: {shown(split)}")
    pair = value["pair"]
    sender, dot, epoch = pair.rpartition(".") if type(pair) is str else ("", "", "")
    if not dot or not _DIGITS.fullmatch(epoch):
        raise Malformed(f"a header whose pair is not <token>.<epoch>: {shown(pair)}")
    return Header(
        _token("tok", value["tok"]), _count("seq", value["seq"]), ids, _fingerprint(value["fp"]), pair,
        _token("the pair's token", sender), split, [_count("a byte size", b) for b in sizes],
        _source(value.get("src"), len(sizes)),
    )  # fmt: skip


_AGENT = re.compile(r"[0-9A-Za-z_.:-]{1,128}")  # a NIXL agent's name, a Mooncake segment's host:port


def _source(src: Any, messages: int) -> dict[str, Any] | None:
    """A pulled wire's ``src`` (None: absent): its descriptors, ``parts[i]`` of them the ranges of message ``i`` in
    order (``parts`` absent: one each); :class:`Malformed` unless well formed. Whether their bytes add up to the
    messages' is the wire's to check, against its own rows."""
    if src is None:
        return None
    if type(src) is not dict or {"agent", "md", "mem", "descs"} - src.keys():
        raise Malformed(f"a header whose src is not a source of rows: {shown(src)}")
    if type(src["agent"]) is not str or not _AGENT.fullmatch(src["agent"]) or src["mem"] not in ("DRAM", "VRAM"):
        raise Malformed(f"a header whose src names no agent or memory: {shown(src)}")
    descs, parts = src["descs"], src.get("parts", [1] * messages)
    if type(parts) is not list or len(parts) != messages:
        raise Malformed(f"a header whose src's parts are not one count per message: {shown(parts)}")
    counts = [_count("src's parts", p) for p in parts]
    if type(descs) is not list or len(descs) != sum(counts) or not all(type(d) is list and len(d) == 3 for d in descs):
        raise Malformed(f"a header whose src is not [address, bytes, device] per part of a message: {shown(descs)}")
    return {
        "agent": src["agent"], "md": _count("src's metadata version", src["md"]), "mem": src["mem"],
        "descs": [[_count("an address", a), _count("a byte size", b), _count("a device", d)] for a, b, d in descs],
        "parts": counts,
    }  # fmt: skip


def _fingerprint(fp: Any) -> list[Any]:
    """``[layers, [[shape, dtype], ...]]`` (``_link.fingerprint``'s shape), or :class:`Malformed`."""
    ok = type(fp) is list and len(fp) == 2 and type(fp[0]) is int and type(fp[1]) is list
    for entry in fp[1] if ok else ():
        ok = (
            type(entry) is list
            and len(entry) == 2
            and type(entry[0]) is list
            and all(type(d) is int for d in entry[0])
            and type(entry[1]) is str
        )
        if not ok:
            break
    if not ok:
        raise Malformed(f"a header whose fingerprint is not [layers, [[shape, dtype], ...]]: {shown(fp)}")
    return fp  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class Refusal:
    """``refuse:<reason>:<room>:<text>``: the receiver landed nothing. ``room``: with ``"room"``, the states it
    could take (None when it did not say)."""

    reason: Reason
    room: int | None
    text: str

    def encode(self) -> str:
        return f"refuse:{self.reason}:{'' if self.room is None else self.room}:{self.text}"

    @classmethod
    def of_answer(cls, why: str) -> Refusal:
        """A receiver's answer that nothing landed, from its ``why``: ``room:<k>:<text>`` (``k`` decimal digits) a
        refusal for room, anything else a refusal ``failed`` with ``why`` as its text."""
        kind, _, rest = why.partition(":")
        room, _, said = rest.partition(":")
        if kind == "room" and _DIGITS.fullmatch(room):
            return cls("room", int(room), said)
        return cls("failed", None, why)


def _refusal(rest: str) -> Refusal:
    reason, _, rest = rest.partition(":")
    room, _, said = rest.partition(":")
    if reason not in REASONS or not (room == "" or _DIGITS.fullmatch(room)):
        raise Malformed(f"a refusal of unknown form: {shown('refuse:' + reason + ':' + room)}")
    return Refusal(reason, int(room) if room else None, said)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Decision:
    """The receiver's decision on a header: ``go`` (send the bytes; ``token``: the receiver's, completing the
    pair's name), ``dup`` (landed already: acknowledged), ``withdrawn`` (the sender's own), or a ``refusal``."""

    kind: Literal["go", "dup", "withdrawn", "refuse"]
    token: str = ""
    refusal: Refusal | None = None


def decision(raw: bytes) -> Decision:
    """A decision read from the store; :class:`Malformed` unless it is one this version writes."""
    value = text(raw)
    if value == "withdrawn":
        return Decision("withdrawn")
    kind, _, rest = value.partition(":")
    if kind in ("go", "dup"):
        return Decision(kind, _token("the receiver's token", rest))  # type: ignore[arg-type]
    if kind == "refuse":
        return Decision("refuse", refusal=_refusal(rest))
    raise Malformed(f"a decision of unknown form: {shown(value)}")


@dataclass(frozen=True, slots=True)
class Ack:
    """The receiver's acknowledgement: ``ok`` (``landed`` states landed), ``fail`` (the bytes may not have all
    arrived, none landed: ``why``), or a ``refusal`` (every byte arrived, none landed)."""

    kind: Literal["ok", "fail", "refuse"]
    landed: int = 0
    why: str = ""
    refusal: Refusal | None = None


def ack(raw: bytes) -> Ack:
    """An acknowledgement read from the store; :class:`Malformed` unless it is one this version writes."""
    value = text(raw)
    kind, _, rest = value.partition(":")
    if kind == "ok" and _DIGITS.fullmatch(rest):
        return Ack("ok", landed=int(rest))
    if kind == "fail":
        return Ack("fail", why=rest)
    if kind == "refuse":
        return Ack("refuse", refusal=_refusal(rest))
    raise Malformed(f"an acknowledgement of unknown form: {shown(value)}")
