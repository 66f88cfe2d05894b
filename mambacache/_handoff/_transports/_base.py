"""The one interface a state transfer's bytes go over: a :class:`Transport` per transfer, a :class:`Wire` per
direction of it.

A wire moves one batch's messages (flat ``uint8`` views, ``_link.messages``)
between the two ends of a direction and reports completion, or fails with a
:class:`~mambacache.TransferError` (a failure, a dead peer, a timeout): what is
in flight when it fails is aborted before it returns, so no byte of that try
lands later. Everything else (headers, decisions, acknowledgements, duplicates,
batches in doubt, room, re-slicing) is the protocol's, in ``_link`` and above,
the same over every wire.

Two shapes of wire:

* pushed (``pulls`` False, gloo): after the receiver's ``go`` the sender
  :meth:`Wire.push` es the messages and the receiver :meth:`Wire.pull` s them
  into its own;
* pulled (``pulls`` True, NIXL, Mooncake): the sender's header carries
  :meth:`Wire.source`, where its messages lie in its registered memory; after
  ``go`` the receiver reads them from there (:meth:`Wire.pull`) while the sender
  waits for the acknowledgement, and the sender's memory stays as it is until
  the read is claimed (``_link``: the ``read/{m}`` key, first writer wins).

A message is a flat ``uint8`` tensor, or, on a wire whose ``pieces`` is True,
:class:`Pieces`: its bytes as byte ranges in order (the rows of scattered
slots, read from and written into where they lie, with no gather or scatter
copy), on a device type the wire names in ``devices``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Message", "Pieces", "Transport", "Wire", "spans"]


@dataclass(slots=True)
class Pieces:
    """One message as the byte ranges ``spans`` (``(address, bytes)``, in the message's order) of memory on
    ``device``; each lies in the storage of one of ``within`` (the tensors it was cut from: what a transport
    registers when no region holds a range)."""

    spans: list[tuple[int, int]]
    within: list[torch.Tensor]
    device: torch.device

    def numel(self) -> int:
        """The message's bytes (a ``uint8`` message's ``numel``)."""
        return sum(size for _, size in self.spans)


Message = torch.Tensor | Pieces


def spans(message: Message) -> list[tuple[int, int]]:
    """A message's byte ranges ``(address, bytes)``, in order (a tensor: one, its own, if it has bytes)."""
    if isinstance(message, Pieces):
        return message.spans
    return [(message.data_ptr(), message.numel())] if message.numel() else []


class Wire(ABC):
    """The bytes of one direction ``src > dst`` of a transfer; ``me`` is 0 on the sending end, 1 on the other."""

    pulls = False  # whether the receiver reads the bytes from the sender's memory (else the sender pushes them)
    pieces = False  # whether a message may be Pieces (scattered ranges); else one contiguous tensor
    devices: tuple[str, ...] = ("cpu",)  # the device types whose memory a message may lie in

    def source(self, raw: Sequence[Message]) -> dict[str, Any] | None:
        """Sending end: what the header carries for the receiver to read ``raw`` (None: nothing, pushed)."""
        return None

    @abstractmethod
    def push(self, raw: Sequence[Message], name: str, peer: str, ids: list[str]) -> None:
        """Sending end, after the receiver's ``go`` for a batch of messages ``raw`` over connection ``name`` (both
        ends' tokens: a peer that restarted is a new connection) with the end whose token is ``peer``."""

    @abstractmethod
    def pull(self, raw: Sequence[Message], source: dict[str, Any] | None, name: str, peer: str, ids: list[str]) -> None:
        """Receiving end, after its ``go``: the batch's messages into ``raw`` (written in place), read from
        ``source`` (the header's) on a pulled wire. Returns once every byte arrived; a failure or a timeout is a
        :class:`~mambacache.TransferError`, with nothing of this try still in flight."""

    def drop(self, peer: str | None = None) -> None:  # noqa: B027 -- a wire with no connection state keeps nothing
        """After a failure of the bytes or the acknowledgement: forget the connection with ``peer`` (None:
        every one), so that the next batch starts a fresh one."""


class Transport(ABC):
    """A transfer's transport: its wires, and the memory it registered (once, when the transfer is made)."""

    name = ""

    @abstractmethod
    def wire(self, store: Any, src: int, dst: int, me: int, timeout: float) -> Wire:
        """The wire of direction ``src > dst`` (``store``: that direction's prefix of the group's store)."""

    def register(self, tensors: Sequence[torch.Tensor]) -> None:  # noqa: B027 -- gloo sends from any memory
        """Make ``tensors`` (a pool's, a host pool's: kept for the transfer's life) readable and writable by the
        transport without a registration per batch (those on a device type its wires' ``devices`` do not name are
        left out: their rows go through host buffers)."""

    def close(self) -> None:  # noqa: B027 -- gloo holds nothing beyond its wires' pairs
        """Release what the transport holds (an agent or engine, its threads, its registrations) now, not when it
        is collected; idempotent. A wire of a closed transport fails with a TransferError."""
