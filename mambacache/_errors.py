"""The one exception hierarchy of mambacache.

Every error subclasses :class:`MambaCacheError` and also the builtin it is closest
to, so callers may catch either ``mc.InvalidSlotError`` or ``ValueError``.
"""

from __future__ import annotations


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
    """``alloc`` asked for more slots than are free; nothing was allocated."""


class ManagerClosedError(MambaCacheError, RuntimeError):
    """The manager was used outside its ``async with`` block."""


class UnknownExecutorError(MambaCacheError, LookupError):
    """No executor is registered under that name or device type."""


class ExecutorError(MambaCacheError, RuntimeError):
    """An executor raised during a flush; the events are kept for the next flush."""


class DistributedError(MambaCacheError, RuntimeError):
    """A tensor-parallel peer failed, timed out, or was used the wrong way."""
