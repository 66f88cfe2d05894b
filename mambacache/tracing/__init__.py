"""Slot-lifecycle tracing with structlog.

Events (``event`` key), all with ``step`` (the flush that will run or ran them;
none on ``transfer.failed``) and, from :func:`configure`'s own pipeline,
``timestamp`` and ``level``:

====================  =====  ==========================================================================
``slot.alloc``        debug  ``slot``, ``request_id``, ``cleared``
``slot.clear``        debug  ``slot``, ``request_id``
``slot.cow``          debug  ``src``, ``dst``, ``request_id``; ``shift`` when a shifted copy; ``temporal_src``
                             when the temporal state comes from another slot than ``src``
``slot.commit``       debug  ``slot``, ``accepted``, ``request_id``
``slot.release``      debug  ``slot``, ``request_id``
``slot.handover``     debug  ``slot``, ``request_id`` (the old tenant), ``to``
``slot.offload``      debug  ``slot``, ``host``, ``request_id``
``slot.restore``      debug  ``host``, ``slot``, ``request_id``, ``keep``
``slot.export``       debug  ``slot``, ``host`` (the staging host slot; null: exported in place), ``request_id``
``slot.expect``       debug  ``slot``, ``request_id``: the slot (just allocated) awaits the state in place
``slot.import``       debug  ``host`` (null: the state landed in the slot itself), ``slot``, ``request_id``,
                             ``peer`` (when its receive was traced)
``host.drop``         debug  ``host``
``prefix.*``          debug  the prefix cache's hits, misses, inserts, evictions
``step.flush``        info   the StepReport figures, ``plan_us``, ``execute_us``
``step.error``        error  ``stage``, ``error``: an executor failed; work kept
``transfer.send``     info   ``peer``, ``request_ids``, ``n``, ``bytes``: a batch acknowledged; ``peers`` (every
                             rank, ``peer`` the first) from a re-slicing sender: one line per batch, not per rank,
                             its ``bytes`` the sum over the ranks
``transfer.receive``  info   ``peer``, ``request_ids``, ``n``, ``hosts`` (staging) or ``slots`` (in place), ``bytes``;
                             ``peers`` likewise from a re-slicing receiver
``transfer.failed``   error  ``peer``, ``request_ids``, ``call``, ``error`` (no ``step``); ``peers`` from a
                             re-slicing receiver's own checks (its ranks' shards not one state or batch)
``transfer.withdraw`` info   ``request_ids``, ``slots``: exports a release gave up (no peer)
``transfer.discard``  info   ``request_ids``: arrived states given up, never imported (no peer)
====================  =====  ==========================================================================

Tracing is off until :func:`configure` is called; off, it costs one no-op
call per submit, and structlog is not imported. The default level, ``info``, writes only ``step.flush``,
``step.error`` and the ``transfer.*`` batches: to analyse slots (``mambacache trace``, :func:`analyze`), trace at
``level="debug"``; an info-level trace is refused by the analyzer, with that hint.

:func:`analyze` reads a trace back (timelines, summary, anomalies, slots held at
the end) for tests and dashboards; ``mambacache trace`` is its command line.

Nothing here configures structlog on import, and
:func:`configure` leaves the application's structlog and logging set-up alone
unless ``use_structlog_config=True`` asks to log through it instead.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import IO, Any

from .._core import _tracer
from .._core._errors import InvalidArgumentError
from .._core._errors import TraceError as TraceError
from ._analyze import Anomaly as Anomaly
from ._analyze import BadLine as BadLine
from ._analyze import Entry as Entry
from ._analyze import TraceAnalysis as TraceAnalysis
from ._analyze import analyze as analyze
from ._analyze import analyze_lines as analyze_lines

__all__ = [
    "Anomaly",
    "BadLine",
    "Entry",
    "TraceAnalysis",
    "TraceError",
    "analyze",
    "analyze_lines",
    "configure",
    "disable",
    "is_enabled",
    "processors",
]


def processors() -> list[Any]:
    """The pipeline of :func:`configure`: level, ISO timestamp, JSON."""
    import structlog  # here, not at import: `import mambacache` stays free of structlog until tracing is used

    return [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.JSONRenderer(),
    ]


def _level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise InvalidArgumentError(f"unknown log level {level!r}; use debug, info, warning or error")
    return value


def configure(path: str | Path | None = None, level: str | int = "info", *, use_structlog_config: bool = False) -> None:
    """Turn tracing on: JSON lines appended to ``path`` (or written to stderr).

    ``level="debug"`` traces every slot event; ``"info"`` (the default) only flush
    summaries and errors, which the analyzer cannot use: trace at debug to analyse.
    With ``use_structlog_config=True`` the events go through the application's
    own structlog configuration (``structlog.get_logger("mambacache")``), which
    decides format and destination; ``path`` must then be None.
    """
    import structlog

    numeric = _level(level)
    if use_structlog_config and path is not None:
        raise InvalidArgumentError("path and use_structlog_config=True exclude each other")
    disable()
    close = None
    if use_structlog_config:
        # A lazy proxy: it follows whatever the application configured, when it logs.
        logger: Any = structlog.get_logger("mambacache")
    else:
        stream: IO[str]
        if path is None:
            stream = sys.stderr
        else:
            stream = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by disable()
            close = stream.close
        logger = structlog.wrap_logger(
            structlog.WriteLogger(stream),
            processors=processors(),
            wrapper_class=structlog.make_filtering_bound_logger(numeric),
            context_class=dict,
            cache_logger_on_first_use=True,
        )
    # Flush summaries and errors are filtered by the logger itself; per-slot events
    # are skipped before their arguments are even built when debug is off.
    _tracer.install(_tracer.LogTracer(logger if numeric <= logging.DEBUG else None, logger, close))


def disable() -> None:
    """Turn tracing off and close the file :func:`configure` opened."""
    old = _tracer.install(_tracer.OFF)
    if isinstance(old, _tracer.LogTracer) and old.close is not None:
        old.close()


def is_enabled() -> bool:
    """Whether :func:`configure` has turned tracing on."""
    return _tracer.tracer is not _tracer.OFF
