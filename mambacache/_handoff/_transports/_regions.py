"""The memory a pulled transport (NIXL, Mooncake) registered: whole storages, kept or per batch.

A message is a view into a tensor's storage, or pieces of rows in storages; a
transport reads and writes only registered memory, so each byte range must lie
in a registered region. The transfer's pools and host pools are registered
once, kept; a message outside them (a fresh tensor of ``send_rows`` or
``receive_rows``, a grown buffer) gets its storage registered for its wire's
batches until a batch of that wire needs memory no region holds (a wire moves
one batch at a time, so the region it replaces is no longer read). A batch that
needs nothing new keeps the wire's regions: a wire whose batches take turns
between the pools and its kept buffers registers those buffers once, not at
every turn (each registration is a new metadata version its peer must load).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._base import Message, Pieces, spans

__all__ = ["Regions", "matched", "plan"]


class Regions:
    """Registered storages, by address: ``add(address, bytes, tensor)`` registers one and returns its handle,
    ``remove(handle)`` deregisters it."""

    def __init__(self, add: Callable[[int, int, torch.Tensor], Any], remove: Callable[[Any], None]) -> None:
        self._add, self._remove = add, remove
        self._lock = threading.Lock()
        # address -> (end, storage kept alive while registered, handle, owner's id: None when kept for good). The
        # owner's id, not the owner: a wire holds its transport, which holds these, and a transport must stay
        # collectable once its transfer is dropped (its finalizer releases the agent or engine).
        self._held: dict[int, tuple[int, Any, Any, int | None]] = {}
        self._bases: list[int] = []  # the keys of _held, sorted (regions are whole storages: disjoint)

    def keep(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Register the storages of ``tensors`` for good; True when one was new."""
        with self._lock:
            return any([self._register(t, None) for t in tensors])

    def cover(self, raw: Sequence[Message], owner: object) -> bool:
        """Make every byte range of ``raw`` lie in a registered region, registering their storages for ``owner``
        (a wire) where none does; when one was registered, ``owner``'s earlier regions that no range of ``raw``
        lies in are released. True when the registrations changed."""
        who = id(owner)
        with self._lock:
            used: set[int] = set()
            changed = False
            for message in raw:
                for start, size, within in _ranges(message):
                    base = self._find(start, start + size)
                    if base is None:
                        holder = next((t for t in within if _holds(t, start, size)), None)
                        if holder is None:
                            raise ValueError(f"a message's {size} bytes at {start:#x} lie in none of its tensors")
                        changed = self._register(holder, who) or changed
                        base = holder.untyped_storage().data_ptr()
                    used.add(base)
            if changed:
                for base, (_, _, handle, whose) in list(self._held.items()):
                    if whose == who and base not in used:
                        self._drop(base)
                        self._remove(handle)
            return changed

    def _find(self, start: int, end: int) -> int | None:
        i = bisect.bisect_right(self._bases, start) - 1
        if i >= 0 and end <= self._held[self._bases[i]][0]:
            return self._bases[i]
        return None

    def _drop(self, base: int) -> None:
        del self._held[base]
        self._bases.remove(base)

    def _register(self, t: torch.Tensor, owner: int | None) -> bool:
        storage = t.untyped_storage()
        base, size = storage.data_ptr(), storage.nbytes()
        if not size or self._find(base, base + size) is not None:
            return False
        self._held[base] = (base + size, storage, self._add(base, size, t), owner)
        bisect.insort(self._bases, base)
        return True

    def close(self) -> None:
        """Deregister everything."""
        with self._lock:
            for _, _, handle, _ in self._held.values():
                self._remove(handle)
            self._held.clear()
            self._bases.clear()


def _ranges(message: Message) -> list[tuple[int, int, Sequence[torch.Tensor]]]:
    """A message's non-empty byte ranges, each with the tensors one of whose storages holds it."""
    if isinstance(message, Pieces):
        return [(start, size, message.within) for start, size in message.spans if size]
    return [(message.data_ptr(), message.numel() * message.element_size(), (message,))] if message.numel() else []


def _holds(t: torch.Tensor, start: int, size: int) -> bool:
    storage = t.untyped_storage()
    return storage.data_ptr() <= start and start + size <= storage.data_ptr() + storage.nbytes()


def matched(local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """The byte ranges of one message on both ends (``(address, bytes)`` each, in the message's order, of equal
    totals) cut at each other's boundaries: ``(local address, remote address, bytes, index of the remote
    range)``, one transfer each."""
    out: list[tuple[int, int, int, int]] = []
    i = j = 0
    la, lsize = local[0] if local else (0, 0)
    ra, rsize = remote[0] if remote else (0, 0)
    while i < len(local) and j < len(remote):
        step = min(lsize, rsize)
        if step:
            out.append((la, ra, step, j))
        la, lsize, ra, rsize = la + step, lsize - step, ra + step, rsize - step
        if not lsize:
            i += 1
            if i < len(local):
                la, lsize = local[i]
        if not rsize:
            j += 1
            if j < len(remote):
                ra, rsize = remote[j]
    return out


def plan(raw: Sequence[Message], descs: Any, parts: Any) -> list[list[tuple[int, int, int, int]]]:
    """Per message of ``raw``, its reads: ``(local address, remote address, bytes, remote device)``, the header's
    descriptors (``parts`` of them per message; None: one each) cut against the message's own ranges.
    ValueError unless the descriptors give each message exactly its bytes."""
    counts = [1] * len(raw) if parts is None else [int(p) for p in parts]
    if len(counts) != len(raw) or sum(counts) != len(descs):
        raise ValueError("its descriptors are not the batch's messages")
    out, at = [], 0
    for m, count in zip(raw, counts, strict=True):
        theirs = [(int(d[0]), int(d[1]), int(d[2])) for d in descs[at : at + count]]
        at += count
        if sum(size for _, size, _ in theirs) != m.numel():
            raise ValueError("its descriptors are not the batch's messages")
        mine = spans(m)
        if [size for _, size in mine] == [size for _, size, _ in theirs]:  # the same rows on both ends: no cut
            out.append([(la, ra, size, dev) for (la, size), (ra, _, dev) in zip(mine, theirs, strict=True) if size])
            continue
        cuts = matched(mine, [(a, size) for a, size, _ in theirs])
        out.append([(la, ra, size, theirs[j][2]) for la, ra, size, j in cuts])
    return out
