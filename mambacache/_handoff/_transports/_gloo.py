"""The gloo wire: a two-rank gloo group of the two peers alone, per peer, replaced after any failure.

Why not the process group itself: gloo closes a pair on any timeout, so after
one late peer every later message on the group fails. Here the bytes go over a
two-rank group built by the two peers alone (its rendezvous under
``pair/{name}/`` of the direction's keys) and replaced after any failure of its
bytes or acknowledgement, so a closed pair never poisons a later batch. The
sender pushes: one gloo send per message, one tag each, all posted together.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from ..._core._errors import TransferError
from ._base import Message, Transport, Wire

__all__ = ["RETIRED", "GlooTransport", "GlooWire"]

RETIRED: list[Any] = []  # gloo pairs replaced after a failure (see GlooWire.drop)


class GlooWire(Wire):
    """The gloo pairs of one direction, one kept per peer token."""

    def __init__(self, store: Any, src: int, dst: int, me: int, timeout: float) -> None:
        import torch.distributed as dist

        self._dist, self._store = dist, store
        self.src, self.dst, self.me, self.timeout = src, dst, me, timeout
        # Per token of the other end (a receiver's, or a sender's), the name of the pair with it and the group.
        self._pairs: dict[str, tuple[str, Any]] = {}

    def pair(self, name: str, peer: str) -> Any:
        """The gloo pair called ``name`` with the other end whose token is ``peer``, built (both peers build it,
        nobody else) unless it is the one kept for that peer.

        One kept per peer, not one in all: two transfers that take turns on one
        direction (two senders of one rank, or two receivers) would otherwise each retire the
        other's pair, and the next batch rebuild a name its other end still
        holds the old group of (stale rendezvous keys: the bytes time out).
        """
        kept = self._pairs.get(peer)
        if kept is None or kept[0] != name:
            self.drop(peer)
            prefix = self._dist.distributed_c10d.PrefixStore(f"pair/{name}/", self._store)
            pg = self._dist.ProcessGroupGloo(prefix, self.me, 2, timedelta(seconds=self.timeout))
            self._pairs[peer] = kept = (name, pg)
        return kept[1]

    def drop(self, peer: str | None = None) -> None:
        """After a failure the pair with ``peer`` (None: every pair) may be closed (gloo closes it on a timeout):
        the next batch builds another.

        The old one is kept, never destroyed while the process runs: destroying a
        gloo group whose peer died can abort the process inside gloo. A pair is
        only replaced after a failure of its bytes or acknowledgement, so these are
        few (a header withdrawn or refused before the receiver's ``go`` keeps it:
        nothing went over it; a receiver that took the rank since, or another
        sender, gets a pair of its own beside it).
        """
        for key in list(self._pairs) if peer is None else [peer]:  # None: every peer's
            kept = self._pairs.pop(key, None)
            if kept is not None:
                RETIRED.append(kept[1])

    def push(self, raw: Sequence[Message], name: str, peer: str, ids: list[str]) -> None:
        self._move(raw, True, name, peer, ids)

    def pull(self, raw: Sequence[Message], source: dict[str, Any] | None, name: str, peer: str, ids: list[str]) -> None:
        self._move(raw, False, name, peer, ids)

    def _move(self, raw: Sequence[Message], send: bool, name: str, peer: str, ids: list[str]) -> None:
        """Every tensor over pair ``name`` with ``peer`` (posted together, one tag each), all within one timeout."""
        start = time.monotonic()
        try:
            tensors = [m for m in raw if isinstance(m, torch.Tensor)]
            if len(tensors) != len(raw):  # this wire takes no Pieces (``pieces`` False): the transfer gathers them
                raise TypeError("a gloo pair moves whole tensors, not pieces of rows")
            pg = self.pair(name, peer)
            other = 1 - self.me
            works = [
                pg.send([t], other, i) if send else pg.recv([t], other, i) for i, t in enumerate(tensors) if t.numel()
            ]
            for w in works:
                w.wait(timedelta(seconds=max(self.timeout - (time.monotonic() - start), 1e-3)))
        except Exception as exc:  # gloo: a dead peer, a timeout, a closed pair, all RuntimeError
            self.drop(peer)
            raise TransferError(
                f"the states' bytes {'to' if send else 'from'} rank {self.dst if send else self.src} failed or"
                f" timed out after {self.timeout:g}s: {exc}",
                ids,
            ) from exc


class GlooTransport(Transport):
    """The embedded default: gloo pairs over the group's store, no package beyond torch, no registration."""

    name = "gloo"

    def wire(self, store: Any, src: int, dst: int, me: int, timeout: float) -> Wire:
        return GlooWire(store, src, dst, me, timeout)
