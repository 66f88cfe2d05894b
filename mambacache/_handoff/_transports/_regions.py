"""The memory a pulled transport (NIXL, Mooncake) registered: whole storages, kept or per batch.

A message is a view into a tensor's storage; a transport reads and writes only
registered memory, so each message must lie in a registered region. The
transfer's pools and host pools are registered once, kept; a message outside
them (a fresh tensor of ``send_rows`` or ``receive_rows``, a grown buffer) gets
its storage registered for its wire's batches until another batch of that wire
needs other memory (a wire moves one batch at a time, so the region it replaces
is settled).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Regions", "span"]


def span(t: torch.Tensor) -> tuple[int, int, int]:
    """A contiguous tensor's ``(address, bytes, device index)``: one descriptor of a transport."""
    return t.data_ptr(), t.numel() * t.element_size(), max(t.get_device(), 0)


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

    def keep(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Register the storages of ``tensors`` for good; True when one was new."""
        with self._lock:
            return any([self._register(t, None) for t in tensors])

    def cover(self, raw: Sequence[torch.Tensor], owner: object) -> bool:
        """Make every message of ``raw`` lie in a registered region, registering their storages for ``owner``
        (a wire) where none does; ``owner``'s earlier regions that none of ``raw`` lies in are released. True
        when the registrations changed."""
        who = id(owner)
        with self._lock:
            used: set[int] = set()
            changed = False
            for t in raw:
                if not t.numel():
                    continue
                start, size, _ = span(t)
                base = self._find(start, start + size)
                if base is None:
                    changed = True
                    base = self._register(t, who) and t.untyped_storage().data_ptr()
                used.add(int(base))
            for base, (_, _, handle, whose) in list(self._held.items()):
                if whose == who and base not in used:
                    del self._held[base]
                    self._remove(handle)
                    changed = True
            return changed

    def _find(self, start: int, end: int) -> int | None:
        for base, (stop, *_) in self._held.items():
            if base <= start and end <= stop:
                return base
        return None

    def _register(self, t: torch.Tensor, owner: int | None) -> bool:
        storage = t.untyped_storage()
        base, size = storage.data_ptr(), storage.nbytes()
        if not size or self._find(base, base + size) is not None:
            return False
        self._held[base] = (base + size, storage, self._add(base, size, t), owner)
        return True

    def close(self) -> None:
        """Deregister everything."""
        with self._lock:
            for _, _, handle, _ in self._held.values():
                self._remove(handle)
            self._held.clear()
