"""The one hook through which the core reports slot lifecycle events. Off by default, and then nearly free.

The core calls ``_tracer.tracer`` at three kinds of site: after a batch of
events is queued (:meth:`Tracer.events`), after a flush (:meth:`Tracer.flushed`)
and when an executor fails (:meth:`Tracer.failed`); the tiers add their own
events with :meth:`Tracer.note`, a :class:`~mambacache.StateTransfer` its
batches with :meth:`Tracer.transfer` (and its failures through
:func:`traces_failures`). The base :class:`Tracer` does nothing, so with
tracing off a submit pays one no-op call and no site tests for a logger.
:func:`mambacache.tracing.configure` installs a :class:`LogTracer` once; this
module imports no structlog, so ``import mambacache`` does not either.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from ._errors import TransferError
from ._events import (
    Alloc,
    Clear,
    CommitDraft,
    CopyOnWrite,
    DropHost,
    Export,
    Import,
    Offload,
    Release,
    Restore,
    StepReport,
)

if TYPE_CHECKING:
    from ._events import Event

__all__ = ["LogTracer", "Tracer", "install", "tracer", "traces_failures"]

P = ParamSpec("P")
R = TypeVar("R")


class Tracer:
    """Receives the core's lifecycle events; this base ignores them (tracing off)."""

    __slots__ = ()

    def events(self, events: Sequence[Event], step: int) -> None:
        """``events`` were queued for ``step``, in this order."""

    def flushed(self, report: StepReport) -> None:
        """A flush ran ``report.step``."""

    def failed(self, step: int, stage: str, error: str, failures: int) -> None:
        """An executor failed on a ``stage`` of ``step``; the work is kept (``failures`` in a row)."""

    def note(self, event: str, **fields: Any) -> None:
        """A tier's own debug event (``prefix.hit`` and the like)."""

    def transfer(self, event: str, peer: int | None, request_ids: Sequence[str], **fields: Any) -> None:
        """A state transfer's batch with rank ``peer``: ``transfer.send`` (acknowledged), ``transfer.receive``
        (landed in staging host slots) or ``transfer.failed``; or, with no peer, exports a release withdrew
        (``transfer.withdraw``) and arrived states given up (``transfer.discard``)."""


def _fields(ev: Event) -> tuple[str, dict[str, Any]]:
    """The trace name and fields of a queued event (the analyzer reads these keys)."""
    t = type(ev)
    if t is Clear or t is Release:
        return ("slot.clear" if t is Clear else "slot.release"), {"slot": ev.slot, "request_id": ev.request_id}  # type: ignore[union-attr]
    if t is CopyOnWrite:
        fields = {"src": ev.src, "dst": ev.dst, "request_id": ev.request_id}  # type: ignore[union-attr]
        if ev.shift:  # type: ignore[union-attr]  # only a shifted copy carries it: plain forks' lines stay as they were
            fields["shift"] = ev.shift  # type: ignore[union-attr]
        if ev.temporal_src is not None:  # type: ignore[union-attr]  # only a split copy (two sources) carries it
            fields["temporal_src"] = ev.temporal_src  # type: ignore[union-attr]
        return "slot.cow", fields
    if t is Alloc:
        return "slot.alloc", {"slot": ev.slot, "request_id": ev.request_id, "cleared": ev.clear}  # type: ignore[union-attr]
    if t is CommitDraft:
        return "slot.commit", {"slot": ev.slot, "accepted": ev.accepted, "request_id": ev.request_id}  # type: ignore[union-attr]
    if t is Offload:
        return "slot.offload", {"slot": ev.slot, "host": ev.host, "request_id": ev.request_id}  # type: ignore[union-attr]
    if t is Restore:
        return "slot.restore", {"host": ev.host, "slot": ev.slot, "request_id": ev.request_id, "keep": ev.keep}  # type: ignore[union-attr]
    if t is Export:
        fields = {"slot": ev.slot, "host": ev.host, "request_id": ev.request_id}  # type: ignore[union-attr]
        if ev.to is not None:  # type: ignore[union-attr]  # only a routed export carries it: other lines stay as they were
            fields["to"] = ev.to  # type: ignore[union-attr]
        return "slot.export", fields
    if t is Import:
        return "slot.import", {"host": ev.host, "slot": ev.slot, "request_id": ev.request_id}  # type: ignore[union-attr]
    assert t is DropHost
    return "host.drop", {"host": ev.host}  # type: ignore[union-attr]


# Every count of a report; its seconds go out rounded to microseconds instead.
_REPORT_FIELDS = tuple(f.name for f in dataclasses.fields(StepReport) if not f.name.endswith("_s"))


class LogTracer(Tracer):
    """Writes events to structlog loggers: ``slots`` (debug, per slot; None to skip) and ``steps`` (flushes).

    ``slot.import`` lines carry the ``peer`` whose ``transfer.receive`` landed
    their staging host slot, or their pool slot when it landed in place
    (remembered per such slot, so at most one entry per slot; a state received
    before tracing was on imports without it).
    """

    __slots__ = ("_peers", "_slots", "_steps", "close")

    def __init__(self, slots: Any | None, steps: Any, close: Callable[[], None] | None = None) -> None:
        self._slots = slots
        self._steps = steps
        self.close = close  # closes the file configure() opened, if any
        # (False, staging host slot) or (True, pool slot it landed in place) -> the rank its received state came from
        self._peers: dict[tuple[bool, int], int] = {}

    def events(self, events: Sequence[Event], step: int) -> None:
        log = self._slots
        if log is not None:
            for ev in events:
                name, fields = _fields(ev)
                if type(ev) is Import:
                    key = (True, ev.slot) if ev.host is None else (False, ev.host)
                    peer = self._peers.pop(key, None)
                    if peer is not None:
                        fields["peer"] = peer
                log.debug(name, **fields, step=step)

    def flushed(self, report: StepReport) -> None:
        figures = {name: getattr(report, name) for name in _REPORT_FIELDS}
        self._steps.info(
            "step.flush", **figures, plan_us=round(report.plan_s * 1e6, 1), execute_us=round(report.execute_s * 1e6, 1)
        )

    def failed(self, step: int, stage: str, error: str, failures: int) -> None:
        self._steps.error("step.error", step=step, stage=stage, error=error, failures=failures)

    def note(self, event: str, **fields: Any) -> None:
        if self._slots is not None:
            self._slots.debug(event, **fields)

    def transfer(self, event: str, peer: int | None, request_ids: Sequence[str], **fields: Any) -> None:
        if peer is None:  # a withdraw or a discard: no peer took part
            self._steps.info(event, request_ids=list(request_ids), **fields)
            return
        if event == "transfer.failed":
            self._steps.error(event, peer=peer, request_ids=list(request_ids), **fields)
            return
        if event == "transfer.receive" and self._slots is not None:
            for h in fields.get("hosts", ()):
                self._peers[False, h] = peer
            for s in fields.get("slots", ()):
                self._peers[True, s] = peer
        self._steps.info(event, peer=peer, request_ids=list(request_ids), **fields)


OFF = Tracer()
tracer: Tracer = OFF


def traces_failures(method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
    """Wrap a :class:`~mambacache.StateTransfer` method: a :class:`TransferError` it raises is traced as
    ``transfer.failed`` (the ``peer``, the ids in flight, the method as ``call``, the ``error``), then re-raised.

    A decorator rather than a line at each raise: every failure of the wire,
    the header, the ids or the acknowledgement is traced, whatever the body.
    """

    def traced(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except TransferError as exc:
            tracer.transfer("transfer.failed", self.peer, exc.request_ids, call=method.__name__, error=str(exc))
            raise

    functools.update_wrapper(traced, method)  # its name, docstring and signature, for help() and the API docs
    return traced


def install(new: Tracer) -> Tracer:
    """Make ``new`` the core's tracer; returns the one it replaces."""
    global tracer
    old, tracer = tracer, new
    return old
