"""The one exception hierarchy of mambacache.

Every error subclasses :class:`MambaCacheError` and also the builtin it is closest
to, so callers may catch either ``mc.InvalidSlotError`` or ``ValueError``.
"""

from __future__ import annotations

from typing import Literal

RefusalReason = Literal["header", "spec", "room", "failed"]
"""Why a receiver refused a batch (:attr:`TransferRefusedError.reason`; the wire's refusal carries the same word)."""


class MambaCacheError(Exception):
    """Base class of every error raised by mambacache."""


class InvalidArgumentError(MambaCacheError, ValueError):
    """An argument has the wrong value (a count, a size, a spec field)."""


class InvalidSlotError(InvalidArgumentError):
    """A slot is not an int in ``1..num_slots`` (0 is the padding slot)."""


class InvalidEventError(MambaCacheError, TypeError):
    """Something that is not a submittable event was submitted."""


class SlotStateError(MambaCacheError, RuntimeError):
    """The slot is not allocated at that point of the event order."""


class PoolExhaustedError(MambaCacheError, RuntimeError):
    """``alloc`` asked for more slots than are available (free, less what a reservation keeps); none was allocated."""


class ManagerClosedError(MambaCacheError, RuntimeError):
    """The manager was used outside its ``async with`` block."""


class UnknownExecutorError(MambaCacheError, LookupError):
    """No executor is registered under that name or device type."""


class ExecutorError(MambaCacheError, RuntimeError):
    """An executor raised during a flush; the events are kept for the next flush."""


class ManagerBrokenError(ExecutorError):
    """Too many flushes in a row failed; the manager refuses work (the pool keeps what is unfinished)."""


class UnsupportedDtypeError(MambaCacheError, TypeError):
    """The executor cannot run every stage kind on a dtype of the pool; found when the manager is made."""


class PoolAllocationError(MambaCacheError, MemoryError):
    """The pool's tensors could not be allocated (too large for the device, or for torch's size limits)."""


class BindingError(MambaCacheError, RuntimeError):
    """A transformers cache disagrees with the state bound into it (its token count, its layers): a
    transformers change the binding does not follow yet, caught before it turns into wrong tokens."""


class PlanError(MambaCacheError, RuntimeError):
    """The planner failed on a step's events (out of memory, say); they are queued again, so nothing is lost."""


class DistributedError(MambaCacheError, RuntimeError):
    """A tensor-parallel peer failed, timed out, or was used the wrong way."""


class TransferError(DistributedError):
    """A state transfer's peer died, timed out or sent something else; ``request_ids`` names the states in flight."""

    def __init__(self, message: str, request_ids: list[str] | None = None) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids or [])


class TransferRefusedError(TransferError):
    """The receiving side refused a batch before landing any of it; the sender keeps every state (send again).

    ``reason``: ``"room"`` (not enough free host slots there now: retry once it
    imported or discarded some), ``"spec"`` (the two sides' states differ in
    layers, shapes or dtypes: never retried to success), ``"header"`` (an
    impossible or malformed batch) or ``"failed"`` (it took the bytes and then
    landed none: its landing failed, or a re-slicing receiver's ranks sent
    different batches; not in doubt, so the next send ships it with whatever
    became ready since). ``room``: with ``"room"``, how many states
    the receiver could take when it refused (a sender splits the batch to that).
    """

    def __init__(
        self,
        message: str,
        request_ids: list[str] | None = None,
        reason: RefusalReason = "failed",
        room: int | None = None,
    ) -> None:
        super().__init__(message, request_ids)
        self.reason, self.room = reason, room


class TransportUnavailableError(MambaCacheError, ImportError):
    """A state transfer's transport whose package is not installed; ``extra``: mambacache's extra that installs it
    (``pip install 'mambacache[<extra>]'``), ``transport`` its name."""

    def __init__(self, message: str, transport: str = "", extra: str = "") -> None:
        super().__init__(message)
        self.transport, self.extra = transport, extra


class SlotLeakError(MambaCacheError, RuntimeError):
    """Slots are still held where none should be (``CacheManager.check_idle``).

    ``held`` maps pool slots to tenants, ``host_held`` host slots to the tenants of the offloads that filled them.
    """

    def __init__(
        self, message: str, held: dict[int, str | None] | None = None, host_held: dict[int, str | None] | None = None
    ) -> None:
        super().__init__(message)
        self.held: dict[int, str | None] = dict(held or {})
        self.host_held: dict[int, str | None] = dict(host_held or {})


class TraceError(MambaCacheError, ValueError):
    """A trace file cannot be analysed: missing, not a trace, no slot events, or malformed under ``strict``."""


class StaleHitError(MambaCacheError, LookupError):
    """A :class:`PrefixHit` whose checkpoint was evicted and dropped since ``match``: match again."""
