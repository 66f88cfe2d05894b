"""A state transfer between two managers of one process: what :class:`mambacache.StateTransfer` does, minus the wire.

``loopback(sender, receiver)`` takes the sender's exports whose flush has run
(``exports_ready``), gathers their staging host rows (or, exported in place,
their pool slots' rows), lands them on the receiver (``land_in_place`` when
every one awaits it in a settled slot, else ``land``: staging host slots held
by each request id), copies the rows in and
only then tells the sender they were delivered (``exports_delivered``: it drops
the staging slots and releases the exported slots). It refuses, as ``send`` does,
exports whose flush left work unfinished. A failing ``land`` raises before the
sender lets go of anything, so the sender keeps every slot (as after a send with
no acknowledgement).

Property and fault tests use it to mix transfers with every other event in one
process; tests/handoff/transfer/test_transfer.py runs the real thing over gloo.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import mambacache as mc
from mambacache._handoff._transfer import export_rows, write_pool

__all__ = ["OneBatch", "loopback", "stand_in_transfer"]


def loopback(
    sender: mc.CacheManager, receiver: mc.CacheManager, *, row: int | None = None, to: int | None = None
) -> list[str]:
    """Move every ready export of ``sender`` into staging host slots of ``receiver``; returns their request ids.

    ``to``: only the exports addressed to that peer (or to none), as ``StateTransfer`` to peer ``to`` takes them.
    ``row`` (for mutation checks only): gather that host row for every export instead of each export's own.
    """
    ready = sender.exports_ready(to=to)
    if not ready:
        return []
    if sender.unfinished:
        raise mc.TransferError("the flush that ran the exports left work unfinished: flush again first", [])
    src, dst = sender.host_pool, receiver.host_pool
    assert src is not None and dst is not None
    ids = [ev.request_id or "" for ev in ready]
    # The bytes that would go on the wire: each export's staging row, or its pool slot when exported in place.
    if row is None:
        parts = [export_rows(sender, [ev]) for ev in ready]
    else:
        parts = [[t[:, [row]] for t in src.tensors] for _ in ready]
    rows = [torch.cat(column, dim=1) for column in zip(*parts, strict=True)]
    if receiver.land_in_place(ids, lambda slots: write_pool(receiver, slots, rows)) is None:
        slots = receiver.land(ids)
        index = torch.tensor(slots, dtype=torch.long)
        for t, buf in zip(dst.tensors, rows, strict=True):
            # Indexed assignment, not index_copy_: CPU has no index_copy_ for float8 (see test_transfer_property).
            t[:, index] = buf
    sender.exports_delivered(ready)
    return ids


class OneBatch:
    """A stand-in for a transfer's inbox (``StateTransfer._in``) that offers one batch of ``rows`` (one message
    per pool tensor) for request ``"r"``, or ``"r0"``, ``"r1"``, ... when the rows hold several states, so
    ``receive()`` runs its landing with the wire stood in."""

    timeout = 5.0

    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows, self.waiting = rows, None
        self.offers = 0
        self.rooms: list[int] = []  # the room each offer was judged against
        self.answers: list[tuple[bool, str]] = []

    def offer(self, layers: int, shapes: Any, room: Callable[[list[str]], int], deadline: float) -> Any:
        from mambacache._handoff._link import Batch, message_sizes

        self.offers += 1
        n = len(self.rows[0][0]) if self.rows else 1
        ids = ["r"] if n == 1 else [f"r{i}" for i in range(n)]
        self.rooms.append(room(ids))  # asked when the header arrives, as Inbox.offer does
        self.waiting = Batch(1, ids, ("t", 1), "p", False, message_sizes(layers, shapes, n, False))
        return self.waiting

    def take(self, batch: Any, raw: list[torch.Tensor]) -> None:
        from mambacache._handoff._link import messages

        for into, message in zip(raw, messages([r.contiguous() for r in self.rows], False), strict=True):
            into.copy_(message)
        batch.taken = True

    def answer(self, batch: Any, landed: bool, why: str = "") -> None:
        self.answers.append((landed, why))
        self.waiting = None

    def transfer(self, mgr: mc.CacheManager) -> mc.StateTransfer:
        """A ``StateTransfer`` of ``mgr`` (from peer 1) whose inbox is this stand-in: no pair, no transport."""
        return stand_in_transfer(mgr, self)


class _NoWires:
    """The wires of a stood-in link: nothing to register or release."""

    def register(self, memory: list[torch.Tensor]) -> None:
        pass

    def close(self) -> None:
        pass


def stand_in_transfer(mgr: mc.CacheManager, inbox: Any = None) -> mc.StateTransfer:
    """A ``StateTransfer`` of ``mgr`` with peer 1, built by its own ``__init__`` on an in-process store, its link
    (``_transfer.open_link``) stood in: ``inbox`` receives (:class:`OneBatch`, or None: nothing to receive), no
    outbox sends, and no transport is made."""
    from unittest import mock

    import torch.distributed as dist

    from mambacache._handoff import _transfer

    def link(*args: Any) -> tuple[_NoWires, None, Any]:
        return _NoWires(), None, inbox

    with mock.patch.object(_transfer, "open_link", link):
        return mc.StateTransfer(mgr, None, 1, store=dist.HashStore(), rank=0)
