"""One direction of a state transfer's link: control through the key-value store, bytes over a fresh gloo pair.

Why not the process group itself: gloo closes a pair on any timeout, so after
one late peer every later message on the group fails. Here a batch is agreed
on through the group's key-value store (whose waits time out without harm), and
the bytes go over a two-rank gloo group of their own, built by the two peers
alone and replaced after any failure, so a closed pair never poisons a later
batch. Per direction ``src > dst``, under ``mambacache/xfer/{src}>{dst}/`` of
the store (``docs/transfer.md`` has the whole protocol)::

    posted          sender: store.add -> m, the batch's header number
    hdr/{m}         sender: JSON header (token, seq, ids, fingerprint, pair, byte sizes)
    state/{m}       compare_set, first writer wins: receiver "go:<tok>" | "dup:<tok>" | "refuse:<kind>:<room>:<why>",
                    or the sender's "withdrawn" (its wait for a decision timed out: nothing was sent)
    pair/{name}/..  the gloo pair's rendezvous (name changes after every failure)
    ack/{m}         receiver: "ok:<n>" | "refuse:room:<room>:<why>" | "fail:<why>"
    taken           receiver: how many headers it has settled (a restarted receiver continues from it)

A batch is ``(token, seq)``: a retry of a batch in doubt carries the same pair,
and a receiver that landed it already answers ``dup`` (an acknowledgement) and
lands nothing. No torch in the control path; the pair carries raw bytes.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from .._errors import InvalidArgumentError, TransferError, TransferRefusedError

__all__ = ["Batch", "Inbox", "Outbox", "check_timeout", "fingerprint", "root_store"]

MAGIC = 0x6D63_7846
# Far beyond any wait a deployment wants, and well inside what timedelta and c10d's millisecond counts take.
MAX_TIMEOUT = 1e9
_RETIRED: list[Any] = []  # gloo pairs replaced after a failure (see _Direction.drop_pair)


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

    def __init__(self, store: Any, src: int, dst: int, me: int, timeout: float) -> None:
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
        self._pair: tuple[str, Any] | None = None

    def wait_key(self, key: str, seconds: float) -> str | None:
        """The value of ``key`` once it is set, or None after ``seconds`` (a store wait: retryable)."""
        try:
            self.store.wait([key], timedelta(seconds=max(seconds, 1e-3)))
        except self._dist.DistStoreError:
            return None
        except Exception as exc:  # the store's host is gone: nothing can be agreed any more
            raise TransferError(f"the key-value store failed: {exc}") from exc
        return self.value(key)

    def value(self, key: str) -> str:
        return bytes(self.call("get", key)).decode()

    def call(self, what: str, *args: Any) -> Any:
        """A store call, its failures a TransferError."""
        try:
            return getattr(self.store, what)(*args)
        except Exception as exc:
            raise TransferError(f"the key-value store failed ({what}): {exc}") from exc

    def pair(self, name: str) -> Any:
        """The gloo pair called ``name``, built (both peers build it, nobody else) unless it is the current one."""
        if self._pair is None or self._pair[0] != name:
            self.drop_pair()
            prefix = self._dist.distributed_c10d.PrefixStore(f"pair/{name}/", self.store)
            pg = self._dist.ProcessGroupGloo(prefix, self.me, 2, timedelta(seconds=self.timeout))
            self._pair = (name, pg)
        return self._pair[1]

    def drop_pair(self) -> None:
        """After a failure the pair may be closed (gloo closes it on a timeout): the next batch builds another.

        The old one is kept, never destroyed while the process runs: destroying a
        gloo group whose peer died can abort the process inside gloo. A pair is
        only replaced after a failure, so these are few.
        """
        if self._pair is not None:
            _RETIRED.append(self._pair[1])
        self._pair = None

    def move(self, tensors: list[torch.Tensor], send: bool, name: str, ids: list[str]) -> None:
        """Every tensor over pair ``name`` (posted together, one tag each), all within one timeout."""
        start = time.monotonic()
        try:
            pg = self.pair(name)
            other = 1 - self.me
            works = [
                pg.send([t], other, i) if send else pg.recv([t], other, i) for i, t in enumerate(tensors) if t.numel()
            ]
            for w in works:
                w.wait(timedelta(seconds=max(self.timeout - (time.monotonic() - start), 1e-3)))
        except Exception as exc:  # gloo: a dead peer, a timeout, a closed pair, all RuntimeError
            self.drop_pair()
            raise TransferError(
                f"the states' bytes {'to' if send else 'from'} rank {self.dst if send else self.src} failed or"
                f" timed out after {self.timeout:g}s: {exc}",
                ids,
            ) from exc


class Outbox(_Direction):
    """The sending side of ``src > dst``.

    Invariant: a batch's bytes go out only after the receiver wrote ``go`` for
    its header, and the batch counts as delivered only on ``ok`` or ``dup``; a
    wait for the decision that times out withdraws the header atomically, so a
    receiver that comes later skips it.
    """

    def __init__(self, store: Any, src: int, dst: int, timeout: float) -> None:
        super().__init__(store, src, dst, 0, timeout)
        self.token = uuid.uuid4().hex[:16]
        self._epoch = 0

    def _cleanup(self, m: int) -> None:
        for key in (f"hdr/{m}", f"state/{m}", f"ack/{m}"):
            with contextlib.suppress(Exception):  # best effort: a leftover key is only a few bytes in the store
                self.store.delete_key(key)

    def send(self, ids: list[str], seq: int, fp: list[Any], rows: list[torch.Tensor]) -> None:
        """One batch: header, the receiver's decision, the bytes, its acknowledgement.

        Raises :class:`TransferRefusedError` when the receiver refused it (nothing
        landed), :class:`TransferError` on any other failure (the batch may have
        landed: retry it with the same ``seq``).
        """
        pair = f"{self.token}.{self._epoch}"
        raw = [r.reshape(-1).view(torch.uint8) for r in rows]
        header = {"magic": MAGIC, "tok": self.token, "seq": seq, "ids": ids, "fp": fp, "pair": pair}
        header["bytes"] = [t.numel() for t in raw]
        m = int(self.call("add", "posted", 1))
        self.call("set", f"hdr/{m}", json.dumps(header))
        try:
            self._settle(m, ids, raw, pair)
        except TransferRefusedError as exc:
            self._cleanup(m)
            if exc.reason == "failed":  # after the bytes: the receiver may have dropped its end of the pair
                self._epoch += 1
                self.drop_pair()
            raise
        except TransferError:
            self._epoch += 1  # the pair may be closed, or the peer gone: a fresh one next time
            self.drop_pair()
            raise
        self._cleanup(m)

    def _settle(self, m: int, ids: list[str], raw: list[torch.Tensor], pair: str) -> None:
        decision = self.wait_key(f"state/{m}", self.timeout)
        if decision is None:
            decision = bytes(self.call("compare_set", f"state/{m}", "", "withdrawn")).decode()
            if decision == "withdrawn":
                raise TransferError(
                    f"rank {self.dst} took no batch: timed out after {self.timeout:g}s (not receiving?);"
                    " nothing was sent",
                    ids,
                )
        kind, _, why = decision.partition(":")
        if kind == "dup":
            return  # landed by an earlier try whose acknowledgement was lost
        if kind == "refuse":
            raise self._refused(why, ids)
        self.move(raw, True, pair, ids)
        ack = self.wait_key(f"ack/{m}", self.timeout)
        if ack is None:
            raise TransferError(f"rank {self.dst} did not acknowledge: timed out after {self.timeout:g}s", ids)
        kind, _, why = ack.partition(":")
        if kind == "ok" and why == str(len(ids)):
            return
        if kind == "refuse":
            raise self._refused(why, ids)
        if kind == "fail":  # the receiver says it landed none of it (else it would have answered "dup")
            raise TransferRefusedError(f"rank {self.dst} did not land the batch: {why}", ids, "failed")
        raise TransferError(f"rank {self.dst} did not land the batch: {ack}", ids)

    def _refused(self, why: str, ids: list[str]) -> TransferRefusedError:
        """The error of a refusal ``<reason>:<room>:<text>`` (room: how many states the receiver could take)."""
        reason, _, rest = why.partition(":")
        room, _, text = rest.partition(":")
        return TransferRefusedError(
            f"rank {self.dst} refused the batch: {text}", ids, reason, int(room) if room.isdigit() else None
        )


@dataclass(slots=True)
class Batch:
    """A batch whose bytes arrived and which awaits its answer (:meth:`Inbox.answer`)."""

    number: int
    ids: list[str]
    rows: list[torch.Tensor]
    key: tuple[str, int]


class Inbox(_Direction):
    """The receiving side of ``src > dst``.

    Invariants: every header is settled once (``taken`` counts them), a header
    is refused before any tensor is allocated when its fingerprint is not this
    side's or its size is impossible, and the last batch landed is remembered so
    that a retry of it is acknowledged again, never landed twice.
    """

    def __init__(self, store: Any, src: int, dst: int, timeout: float) -> None:
        super().__init__(store, src, dst, 1, timeout)
        self.token = uuid.uuid4().hex[:16]
        self._last: tuple[str, int] | None = None
        self.waiting: Batch | None = None  # received, not answered yet

    def _advance(self, m: int) -> None:
        self.call("add", "taken", 1)
        with contextlib.suppress(Exception):  # the sender deletes the rest once it read the answer
            self.store.delete_key(f"hdr/{m}")

    def receive(self, fp: list[Any], room: int, rows_for: Any) -> Batch:
        """The next batch's bytes, into ``rows_for(n)`` (one ``[layers, n, *state]`` tensor per pool tensor).

        ``fp``: this side's :func:`fingerprint`; ``room``: how many states could
        land now (a larger batch is refused, typed, and retried by the sender).
        Waits up to ``timeout`` for a header, then up to ``timeout`` for its bytes.
        """
        deadline = time.monotonic() + self.timeout
        while True:
            m = int(self.call("add", "taken", 0)) + 1
            text = self.wait_key(f"hdr/{m}", deadline - time.monotonic())
            if text is None:
                raise TransferError(f"no batch from rank {self.src}: timed out after {self.timeout:g}s")
            refusal, header = _judge(text, fp, room, self.src)
            key = (str(header.get("tok")), int(header.get("seq", -1))) if refusal is None else ("", -1)
            decision = refusal or (f"dup:{self.token}" if key == self._last else f"go:{self.token}")
            got = bytes(self.call("compare_set", f"state/{m}", "", decision)).decode()
            if got != decision:  # withdrawn by its sender, or settled by a receiver before this one
                self._advance(m)
                if got == "withdrawn":  # its sender has moved on: nobody reads these any more
                    with contextlib.suppress(Exception):
                        self.store.delete_key(f"state/{m}")
                continue
            if refusal is not None:
                self._advance(m)
                reason, _, rest = refusal.removeprefix("refuse:").partition(":")
                why = rest.partition(":")[2]
                raise TransferRefusedError(f"refused a batch from rank {self.src}: {why}", [], reason, room)
            if decision.startswith("dup"):
                self._advance(m)
                continue
            return self._bytes(m, header, key, rows_for)

    def _bytes(self, m: int, header: dict[str, Any], key: tuple[str, int], rows_for: Any) -> Batch:
        ids = list(header["ids"])
        rows: list[torch.Tensor] = rows_for(len(ids))
        raw = [r.reshape(-1).view(torch.uint8) for r in rows]
        if [t.numel() for t in raw] != header["bytes"]:  # the fingerprint matched: a header that lies
            self.answer_raw(m, "fail:byte sizes do not match the fingerprint")
            raise TransferError(f"rank {self.src} announced byte sizes its fingerprint does not give", ids)
        try:
            self.move(raw, False, str(header["pair"]), ids)
        except TransferError:
            self.answer_raw(m, "fail:the bytes did not arrive")
            raise
        self.waiting = Batch(m, ids, rows, key)
        return self.waiting

    def answer_raw(self, m: int, value: str) -> None:
        """Write the answer of header ``m`` and move past it."""
        self.waiting = None
        try:
            self.call("set", f"ack/{m}", value)
        finally:
            self._advance(m)

    def answer(self, batch: Batch, landed: bool, why: str = "") -> None:
        """Acknowledge ``batch`` (``landed``) or tell its sender it did not land (``why``: ``room:<room>:<text>``
        refuses it for room, ``<room>`` the states that could land)."""
        if landed:
            self._last = batch.key
            self.answer_raw(batch.number, f"ok:{len(batch.ids)}")
        else:
            self.answer_raw(batch.number, f"refuse:{why}" if why.startswith("room:") else f"fail:{why}")


def _judge(text: str, fp: list[Any], room: int, src: int) -> tuple[str | None, dict[str, Any]]:
    """A header's refusal (``refuse:<kind>:<why>``), or None to take it; before anything is allocated."""
    try:
        header = json.loads(text)
        ids, sizes = header["ids"], header["bytes"]
        ok = (
            header["magic"] == MAGIC
            and isinstance(ids, list)
            and all(type(r) is str for r in ids)
            and isinstance(sizes, list)
            and all(type(b) is int and b >= 0 for b in sizes)
            and type(header["seq"]) is int
            and isinstance(header["tok"], str)
            and isinstance(header["pair"], str)
        )
    except (ValueError, KeyError, TypeError):
        ok, header = False, {}
    if not ok:
        return f"refuse:header::rank {src} sent something that is not a transfer header", header
    if header["fp"] != fp:
        return f"refuse:spec::rank {src} sends states of {header['fp']}, this side holds {fp}", header
    n = len(ids)
    if n < 1 or len(set(ids)) != n:
        return f"refuse:header::a batch of {n} states with {len(set(ids))} distinct ids", header
    if n > room:
        return f"refuse:room:{room}:{n} states arrived, room for {room} here (free host slots, then retry)", header
    return None, header
