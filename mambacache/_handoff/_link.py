"""One direction of a state transfer's link: control through the key-value store, bytes over a fresh gloo pair.

Why not the process group itself: gloo closes a pair on any timeout, so after
one late peer every later message on the group fails. Here a batch is agreed
on through the group's key-value store (whose waits time out without harm), and
the bytes go over a two-rank gloo group of their own, built by the two peers
alone and replaced after any failure of its bytes or acknowledgement, so a
closed pair never poisons a later batch. Per direction ``src > dst``, under ``mambacache/xfer/{src}>{dst}/`` of
the store (``docs/transfer.md`` has the whole protocol)::

    posted          sender: store.add -> m, the batch's header number
    hdr/{m}         sender: JSON header (batch token, seq, ids, fingerprint, pair, split, byte sizes of its messages)
    state/{m}       compare_set, first writer wins: receiver "go:<tok>" | "dup:<tok>" | "refuse:<kind>:<room>:<why>",
                    or the sender's "withdrawn" (its wait for a decision timed out: nothing was sent)
    pair/{name}/..  the gloo pair's rendezvous, name "<tok>.<epoch>.<receiver's tok>" (the epoch: after a failure
                    of the bytes or the acknowledgement; a refused or withdrawn header keeps it)
    ack/{m}         receiver: "ok:<n>" | "refuse:room:<room>:<why>" | "refuse:failed::<why>" (the bytes arrived, none
                    landed: the pair is kept) | "fail:<why>" (the bytes may not have arrived: a fresh pair next)
    taken           receiver: how many headers it has moved past (a restarted receiver continues from it; a header
                    that is absent when its wait times out while a later one was posted is counted too: its
                    sender or its receiver died between two writes, see Inbox._lost)

A batch is ``(token, seq)``: a retry of a batch in doubt carries the same pair
of them, whichever link of the sending manager sends it (the pair's name is the
link's own token), and a receiver that landed it already answers ``dup`` (an
acknowledgement) and lands nothing. Every value read from the store is parsed by
``_control.py`` (untrusted input: a malformed header is refused as ``header``, a
malformed decision or acknowledgement fails the batch). No torch in the control
path; the pair carries raw bytes.

The bytes of a batch of n states, per pool tensor ``[layers, slots + 1, *state]``::

    split=False   one message  [layers, n, *state]          (a gather on the sender, a scatter on the receiver)
    split=True    one message per layer  [n, *state]         (a slot run's rows of one layer are contiguous:
                                                              sent from and received into the host rows as they are)

The sender splits a batch whose messages are large enough that a message costs
less than a copy (:data:`SPLIT_BYTES`); the receiver follows the header. A
receiver takes its staging slots before it answers ``go``, so the bytes can
arrive straight into them. Over a pulled wire that reads pieces (NIXL,
Mooncake) a message may be :class:`~._transports._base.Pieces`: the same bytes
as the byte ranges of the rows where they lie, on both ends, so no slots need
be one run.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from .._core._errors import InvalidArgumentError, TransferError, TransferRefusedError
from . import _control as control
from ._transports._base import Message, Transport
from ._transports._gloo import RETIRED as _RETIRED  # noqa: F401 -- the gloo pairs retired, as tests count them
from ._transports._gloo import GlooTransport

__all__ = [
    "SPLIT_BYTES", "Batch", "Inbox", "NothingSent", "Outbox", "Shapes", "Withdrawn", "as_bytes", "check_timeout",
    "fingerprint", "message_sizes", "messages", "root_store",
]  # fmt: skip

# Senders whose last landed batch a receiver remembers (a retry of it is acknowledged, not landed again): far more
# than take turns on one direction; a sender restarted takes a new token, so old ones only age out.
_SENDERS_KEPT = 256
# Far beyond any wait a deployment wants, and well inside what timedelta and c10d's millisecond counts take.
MAX_TIMEOUT = 1e9
# A message costs about 40 us of gloo overhead here, a copy pass of 1 MiB about 300 us, and a split saves up to
# two (the gather and the landing copy); measured, a split at 0.26 MiB a layer was no faster than one message
# per tensor, at 2 MiB 0.66 of its time: below this many bytes of a batch per layer, one message per tensor.
SPLIT_BYTES = 1024 * 1024


class NothingSent(TransferError):
    """The sender withdrew its header before the receiver's ``go``: not a byte of this try left, and the
    receiver can never take it (first writer wins), so this try put nothing at the peer."""


class Withdrawn(Exception):  # a signal between the link and its caller, never raised to a user
    """The batch was withdrawn by its sender before this side took it: move on to the next header."""


def messages(rows: list[torch.Tensor], split: bool) -> list[torch.Tensor]:
    """A batch's wire messages (raw bytes, views of ``rows``): per ``[layers, n, *state]`` tensor, the whole of
    it, or one per layer (``split``). Every part must be contiguous: a receive writes into these very views."""
    parts = [layer for r in rows for layer in r.unbind(0)] if split else rows
    if not all(p.is_contiguous() for p in parts):
        raise InvalidArgumentError("a transfer's rows must be contiguous (per layer when split)")
    return [as_bytes(p) for p in parts]


def as_bytes(part: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat ``uint8`` view of the same memory.

    Not ``reshape(-1).view(torch.uint8)``: a tensor with a dimension of size 1
    counts as contiguous whatever that dimension's stride, and keeps it, so one
    state's row of a scalar-shaped tensor in a paged pool (stride: the page) is
    a one-element view that ``view`` to a smaller dtype refuses. Contiguous,
    its elements are ``numel`` consecutive ones from its offset: that view.
    """
    return part.as_strided((part.numel(),), (1,)).view(torch.uint8)


def check_timeout(timeout: object) -> float:
    """``timeout`` as float seconds: a finite positive real (not a bool) of at most :data:`MAX_TIMEOUT`."""
    if type(timeout) not in (int, float) or not (0 < timeout <= MAX_TIMEOUT):  # type: ignore[operator]
        raise InvalidArgumentError(f"timeout must be positive finite seconds up to {MAX_TIMEOUT:g}, got {timeout!r}")
    return float(timeout)  # type: ignore[arg-type]


def fingerprint(layers: int, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[Any]:
    """What both sides must agree on before a byte moves: layers, then each pool tensor's per-slot shape and dtype."""
    return [layers, [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in shapes]]


def root_store(store: Any) -> Any:
    """The store under every prefix (so a process that joins later with a plain client finds the same keys)."""
    import torch.distributed as dist

    while isinstance(store, dist.distributed_c10d.PrefixStore):
        store = store.underlying_store
    return store


class _Direction:
    """The keys and the gloo pair of one direction; ``me`` is 0 on the sending side, 1 on the receiving one."""

    def __init__(self, store: Any, src: int, dst: int, me: int, timeout: float, transport: Transport | None) -> None:
        import torch.distributed as dist

        self._dist = dist
        # A clone per direction: a store client is one socket, and a thread waiting on it would block the other.
        try:
            clone = root_store(store).clone()  # a new connection: fails when the store's host is gone
        except Exception as exc:
            raise TransferError(f"the key-value store failed (connecting): {exc}") from exc
        self.store = dist.distributed_c10d.PrefixStore(f"mambacache/xfer/{src}>{dst}/", clone)
        self.src, self.dst, self.me = src, dst, me
        self.timeout = timeout
        self.wire = (transport or GlooTransport()).wire(self.store, src, dst, me, timeout)

    def wait_key(self, key: str, seconds: float) -> bytes | None:
        """The raw value of ``key`` once it is set (the peer's: parse it with ``_control``), or None after
        ``seconds`` (a store wait: retryable)."""
        try:
            self.store.wait([key], timedelta(seconds=max(seconds, 1e-3)))
        except self._dist.DistStoreError:
            return None
        except Exception as exc:  # the store's host is gone: nothing can be agreed any more
            raise TransferError(f"the key-value store failed: {exc}") from exc
        return self.value(key)

    def value(self, key: str) -> bytes:
        return bytes(self.call("get", key))

    def call(self, what: str, *args: Any) -> Any:
        """A store call, its failures a TransferError."""
        try:
            return getattr(self.store, what)(*args)
        except Exception as exc:
            raise TransferError(f"the key-value store failed ({what}): {exc}") from exc

    def drop_pair(self, peer: str | None = None) -> None:
        """After a failure of the bytes or the acknowledgement: the wire's connection with ``peer`` (None: every
        one) is replaced at the next batch."""
        self.wire.drop(peer)


class Outbox(_Direction):
    """The sending side of ``src > dst``.

    Invariant: a batch's bytes go out only after the receiver wrote ``go`` for
    its header, and the batch counts as delivered only on ``ok`` or ``dup``; a
    wait for the decision that times out withdraws the header atomically, so a
    receiver that comes later skips it.
    """

    def __init__(self, store: Any, src: int, dst: int, timeout: float, transport: Transport | None = None) -> None:
        super().__init__(store, src, dst, 0, timeout, transport)
        self.token = uuid.uuid4().hex[:16]
        self._epoch = 0

    def _cleanup(self, m: int) -> None:
        keys = ("hdr", "state", "ack", "read") if self.wire.pulls else ("hdr", "state", "ack")  # read/m: pulled only
        for key in (f"{k}/{m}" for k in keys):
            with contextlib.suppress(Exception):  # best effort: a leftover key is only a few bytes in the store
                self.store.delete_key(key)

    def send(
        self, ids: list[str], seq: int, fp: list[Any], raw: Sequence[Message], split: bool, tok: str | None = None
    ) -> None:
        """One batch ``(tok, seq)`` of messages ``raw`` (:func:`messages` of its rows, ``split`` or not, or views
        of the same bytes): header, the receiver's decision, the bytes, its acknowledgement. ``tok``: the batch's
        token (default this link's own); the receiver remembers the last batch it landed per token.

        Raises :class:`TransferRefusedError` when the receiver refused it (nothing
        landed), :class:`TransferError` on any other failure (the batch may have
        landed: retry it with the same ``(tok, seq)``).
        """
        pair = f"{self.token}.{self._epoch}"
        sizes = [t.numel() for t in raw]
        try:
            source = self.wire.source(raw)
        except Exception as exc:  # the rows' memory not registered, their metadata not published: before any header
            raise NothingSent(
                f"the batch's rows could not be offered to rank {self.dst}, nothing was sent: {exc!r}", ids
            ) from exc
        header = control.encode_header(tok or self.token, seq, ids, fp, pair, split, sizes, source)
        m = int(self.call("add", "posted", 1))
        self.call("set", f"hdr/{m}", header)
        try:
            self._deliver(m, ids, raw, pair)
        except TransferRefusedError:
            self._cleanup(m)  # a "fail" after the bytes moved to a fresh pair in _deliver; a refusal keeps it
            raise
        except NothingSent:
            # Nothing went over the pair, so it is as good as before: kept. A receiver that replaced the one it
            # was built with answers go with its own token, which names another pair (see _deliver).
            raise
        except TransferError:
            self._epoch += 1  # the pair may be closed, or the peer gone: a fresh one next time
            self.drop_pair()
            raise
        self._cleanup(m)

    def _deliver(self, m: int, ids: list[str], raw: Sequence[Message], pair: str) -> None:
        """Header ``m``'s decision, then (on ``go``) the bytes and the acknowledgement. What the receiver wrote is
        parsed by ``_control``: a value of no known form is a :class:`TransferError` (``send`` replaces the pair,
        and the batch is in doubt, as after any failure of the receiver's answers)."""
        raw_decision = self.wait_key(f"state/{m}", self.timeout)
        if raw_decision is None:
            raw_decision = bytes(self.call("compare_set", f"state/{m}", "", "withdrawn"))
        decision = self._parsed(control.decision, raw_decision, "decision", ids)
        if decision.kind == "withdrawn":
            raise NothingSent(
                f"rank {self.dst} took no batch: timed out after {self.timeout:g}s (not receiving?); nothing was sent",
                ids,
            )
        if decision.kind == "dup":
            return  # landed by an earlier try whose acknowledgement was lost
        if decision.refusal is not None:
            raise self._refused(decision.refusal, ids, "refused the batch")
        # The pair is named by both ends: this side's token and epoch (the header's), and the token of the
        # receiver that answered go. A receiver that joined the rank since builds a fresh pair, never one whose
        # other end was its predecessor, whether or not a failure bumped the epoch.
        self.wire.push(raw, f"{pair}.{decision.token}", decision.token, ids)
        raw_ack = self.wait_key(f"ack/{m}", self.timeout)
        if raw_ack is None:
            self._abandon(m)
            raise TransferError(f"rank {self.dst} did not acknowledge: timed out after {self.timeout:g}s", ids)
        ack = self._parsed(control.ack, raw_ack, "acknowledgement", ids)
        if ack.kind == "ok" and ack.landed == len(ids):
            return
        if ack.refusal is not None:  # every byte arrived, none landed: the pair is kept
            raise self._refused(ack.refusal, ids, "did not land the batch")
        if ack.kind == "fail":  # the receiver says it landed none of it (else it would have answered "dup")
            self._epoch += 1  # after the bytes: the receiver may have dropped its end of the pair
            self.drop_pair()
            raise TransferRefusedError(f"rank {self.dst} did not land the batch: {ack.why}", ids, "failed")
        raise TransferError(f"rank {self.dst} acknowledged {ack.landed} states of a batch of {len(ids)}", ids)

    def _abandon(self, m: int) -> None:
        """On a pulled wire, after the wait for the acknowledgement of header ``m`` timed out: claim the read
        (first writer wins), so that a receiver still reading lands nothing, and this side's memory is free to
        change (the batch's rows are read from it until then). A receiver that finished reading first keeps
        the batch: either way it is in doubt here, and its retry goes under the same number."""
        if self.wire.pulls:
            with contextlib.suppress(TransferError):  # the store gone: the receiver cannot claim it either
                self.call("compare_set", f"read/{m}", "", "abandoned")

    def _parsed(self, parse: Callable[[bytes], Any], raw: bytes, what: str, ids: list[str]) -> Any:
        """``parse(raw)``, its :class:`~._control.Malformed` a TransferError naming the batch's ids."""
        try:
            return parse(raw)
        except control.Malformed as exc:
            raise TransferError(f"rank {self.dst} answered with a malformed {what}: {exc}", ids) from exc

    def _refused(self, refusal: control.Refusal, ids: list[str], what: str) -> TransferRefusedError:
        """The error of a refusal (``room``: how many states the receiver could take)."""
        return TransferRefusedError(f"rank {self.dst} {what}: {refusal.text}", ids, refusal.reason, refusal.room)


@dataclass(slots=True)
class Batch:
    """A batch whose header this side accepted: :meth:`Inbox.take` answers ``go`` and receives its bytes, then
    :meth:`Inbox.answer` answers it (or refuses it, if it was never taken)."""

    number: int
    ids: list[str]
    key: tuple[str, int]
    pair: str
    split: bool
    sizes: list[int]  # of its messages, checked against this side's layout before it was accepted
    source: dict[str, Any] | None = None  # on a pulled wire, where the sender's messages lie (the header's)
    taken: bool = False  # "go" written: the sender sends the bytes
    moved: bool = False  # every byte arrived: the pair is as good as before, whatever the landing does


Shapes = list[tuple[tuple[int, ...], torch.dtype]]


def message_sizes(layers: int, shapes: Shapes, n: int, split: bool) -> list[int]:
    """The byte size of each message of a batch of ``n`` states (see :func:`messages`)."""
    per_layer = [n * math.prod(shape) * dtype.itemsize for shape, dtype in shapes]
    return [b for b in per_layer for _ in range(layers)] if split else [layers * b for b in per_layer]


class Inbox(_Direction):
    """The receiving side of ``src > dst``.

    Invariants: every header is moved past once (``taken`` counts them), a header
    is refused before anything is allocated when its fingerprint is not this
    side's or its size is impossible, ``go`` is answered only for a batch this
    side has room for already (the caller lands first: the bytes may arrive
    straight into its staging slots), and each sender's last batch landed is
    remembered so that a retry of it is acknowledged again, never landed twice.
    """

    def __init__(self, store: Any, src: int, dst: int, timeout: float, transport: Transport | None = None) -> None:
        super().__init__(store, src, dst, 1, timeout, transport)
        self.token = uuid.uuid4().hex[:16]
        # Per sender token, the number of the last batch it landed here: a sender's batch in doubt is its last,
        # and two senders may take turns on one direction, so one key for the whole direction forgot the first
        # sender's batch as soon as the second's landed, and its retry landed again. Oldest tokens go first.
        self._last: dict[str, int] = {}
        self.waiting: Batch | None = None  # accepted, not answered yet

    def _advance(self, m: int) -> None:
        self.call("add", "taken", 1)
        with contextlib.suppress(Exception):  # the sender deletes the rest once it read the answer
            self.store.delete_key(f"hdr/{m}")

    def _decide(self, m: int, decision: str) -> bool:
        """Write header ``m``'s decision (first writer wins) and move past it unless it is ``go``; False when the
        sender had withdrawn it (or another receiver decided it) first."""
        got = bytes(self.call("compare_set", f"state/{m}", "", decision))  # compared, never parsed: any bytes
        if got == decision.encode() and decision.startswith("go:"):
            return True
        self._advance(m)
        if got == b"withdrawn":  # its sender has moved on: nobody reads these any more
            with contextlib.suppress(Exception):
                self.store.delete_key(f"state/{m}")
        return got == decision.encode()

    def _lost(self, m: int) -> bool:
        """Count header ``m`` moved past, and say so, when it will never be there: absent while a later one was
        posted. A live sender takes a number only after it wrote the header of the last, so either the sender of
        ``m`` died between taking the number and writing the header, or it read the answer of a receiver that
        died before counting ``m`` and deleted the header. Waited for, either stopped the direction for good
        (every later receive "no batch"). Asked only after a wait timed out: no store call on the common path."""
        if int(self.call("add", "posted", 0)) <= m or self.call("check", [f"hdr/{m}"]):
            return False
        self.call("add", "taken", 1)
        return True

    def offer(self, layers: int, shapes: Shapes, room: Callable[[list[str]], int], deadline: float) -> Batch:
        """The next batch this side may take, judged against its layout (``layers``, ``shapes``) and ``room(ids)``
        (how many states of a batch of ``ids`` could land now: a larger batch is refused, typed, and retried by
        the sender).

        ``room`` is asked when each header arrives, not before the wait: the step
        loop may free host slots meanwhile, and a refusal tells the sender how
        many states to send next. Waits until ``deadline`` (``time.monotonic()``) for a header. A retry of
        the batch landed last is acknowledged and skipped; a refusal is written
        and raised (:class:`TransferRefusedError`). The batch returned has no
        decision yet: :meth:`take` it or :meth:`answer` it not landed.
        """
        fp = fingerprint(layers, shapes)
        while True:
            m = int(self.call("add", "taken", 0)) + 1
            raw = self.wait_key(f"hdr/{m}", deadline - time.monotonic())
            if raw is None:
                if self._lost(m):
                    continue
                raise TransferError(f"no batch from rank {self.src}: timed out after {self.timeout:g}s")
            refusal, header = _judge(
                raw, fp, room, self.src, lambda n, split: message_sizes(layers, shapes, n, split), self._last
            )
            if refusal is None:
                assert header is not None
                key = (header.tok, header.seq)
                if self._last.get(key[0]) != key[1]:
                    self.waiting = Batch(m, header.ids, key, header.pair, header.split, header.sizes, header.source)
                    return self.waiting
            if not self._decide(m, f"dup:{self.token}" if refusal is None else refusal.encode()) or refusal is None:
                continue  # withdrawn or decided elsewhere, or a duplicate acknowledged again
            raise TransferRefusedError(
                f"refused a batch from rank {self.src}: {refusal.text}", [], refusal.reason, refusal.room
            )

    def check_left(self, deadline: float) -> None:
        """After a batch its sender withdrew before this side's ``go``: :class:`TransferError` once the receive's
        wait (until ``deadline``) is spent, else nothing (take the next header). Without it a receive whose landing
        outlasts its sender's wait for a decision went on to the retry, and the next, each withdrawn in turn, for
        as long as the sender retried: past its timeout, without end."""
        if time.monotonic() >= deadline:
            raise TransferError(
                f"no batch from rank {self.src} taken within {self.timeout:g}s: its sender withdrew each before this"
                " side's go (the landing took longer than the sender waits for a decision)"
            )

    def take(self, batch: Batch, raw: Sequence[Message]) -> None:
        """Answer ``go`` for ``batch`` and receive its bytes into ``raw`` (its messages: :func:`messages` of the
        rows, or views of the same bytes, written in place).

        :class:`Withdrawn` when its sender withdrew it first (nothing arrives: move on);
        :class:`TransferError` when the bytes failed (the batch is answered failed).
        """
        if [t.numel() for t in raw] != batch.sizes:  # the caller's rows are this side's layout, which was checked
            raise AssertionError(f"rows of {[t.numel() for t in raw]} bytes for a batch of {batch.sizes}")
        if not self._decide(batch.number, f"go:{self.token}"):
            self.waiting = None
            raise Withdrawn(batch.ids)
        batch.taken = True
        # Both ends' name (_deliver); kept per sending link (the pair's token), not per batch token: a batch in doubt
        # may be retried by another link of the sending manager, under its first token, over that link's own pair.
        sender = batch.pair.rpartition(".")[0]
        try:
            self.wire.pull(raw, batch.source, f"{batch.pair}.{self.token}", sender, batch.ids)
            self._claim_read(batch)
        except TransferError:
            self.answer_raw(batch.number, "fail:the bytes did not arrive")
            raise
        batch.moved = True

    def _claim_read(self, batch: Batch) -> None:
        """On a pulled wire, once every byte is read: claim the read (first writer wins) against the sender's
        giving up (``Outbox._abandon``). Lost, the sender may have changed its rows while they were read: the
        bytes are not the batch's, and nothing lands."""
        if self.wire.pulls and self.call("compare_set", f"read/{batch.number}", "", "read") != b"read":
            raise TransferError(
                f"rank {self.src} gave up waiting for the acknowledgement while its rows were read: nothing lands",
                batch.ids,
            )

    def answer_raw(self, m: int, value: str) -> None:
        """Write the answer of header ``m`` and move past it."""
        self.waiting = None
        try:
            self.call("set", f"ack/{m}", value)
        finally:
            self._advance(m)

    def answer(self, batch: Batch, landed: bool, why: str = "") -> None:
        """Acknowledge ``batch`` (``landed``) or tell its sender it did not land (``why``: ``room:<room>:<text>``
        refuses it for room, ``<room>`` the states that could land); a batch never taken is refused, as a
        decision, and its sender sends nothing."""
        refusal = control.Refusal.of_answer(why)
        if not batch.taken:
            self.waiting = None
            self._decide(batch.number, refusal.encode())
        elif landed:
            tok, seq = batch.key
            self._last.pop(tok, None)  # re-inserted last: the dict's order is the senders' last landings
            self._last[tok] = seq
            if len(self._last) > _SENDERS_KEPT:
                del self._last[next(iter(self._last))]
            self.answer_raw(batch.number, f"ok:{len(batch.ids)}")
        elif batch.moved or refusal.reason == "room":
            # The bytes arrived whole and the landing failed (its write, a re-slicing receiver's other ranks): a
            # refusal, so the sender keeps its pair. "fail" makes both ends replace it, one ProcessGroupGloo each
            # kept for the process's life: only for bytes that may not have arrived.
            self.answer_raw(batch.number, refusal.encode())
        else:
            self.answer_raw(batch.number, f"fail:{why}")


def _judge(
    raw: bytes,
    fp: list[Any],
    room_of: Callable[[list[str]], int],
    src: int,
    sizes: Callable[[int, bool], list[int]],
    last: dict[str, int],
) -> tuple[control.Refusal | None, control.Header | None]:
    """A header's refusal, or None to take it (with the header parsed); before anything is allocated.

    ``sizes(n, split)``: the message sizes this side's layout gives a batch of ``n``. The retry of a sender's
    batch landed last (``last``: its number by the batch's token) is never refused for room: it lands nothing,
    and refused it would leave its sender sure that it never landed, and send it again as a new batch."""
    try:
        header = control.header(raw)
    except control.Malformed as exc:
        return control.Refusal("header", None, f"rank {src} sent something that is not a transfer header: {exc}"), None
    if header.fp != fp:
        why = f"rank {src} sends states of {control.shown(header.fp)}, this side holds {fp}"
        return control.Refusal("spec", None, why), header
    ids = header.ids
    n = len(ids)
    if n < 1 or len(set(ids)) != n:
        return control.Refusal("header", None, f"a batch of {n} states with {len(set(ids))} distinct ids"), header
    if last.get(header.tok) == header.seq:
        return None, header  # acknowledged again (dup), whatever the room
    room = room_of(ids)
    if n > room:
        why = f"{n} states arrived, room for {room} here (free host slots, then retry)"
        return control.Refusal("room", room, why), header
    if header.sizes != sizes(n, header.split):
        return control.Refusal("header", None, f"rank {src} announced byte sizes its fingerprint does not give"), header
    return None, header
