"""Where lifecycle events go. Off by default, and then nearly free.

The manager reads ``state.slot_log`` / ``state.step_log`` once per call: both are
None until :func:`mambacache.tracing.configure` or ``tracing.enable`` is called,
so with tracing off a submit costs one attribute read and a comparison.
"""

from __future__ import annotations

from typing import Any

import structlog

# A lazy proxy: it follows whatever the application configured, when it logs.
logger = structlog.get_logger("mambacache")


class _State:
    __slots__ = ("close", "slot_log", "step_log")

    def __init__(self) -> None:
        self.slot_log: Any | None = None  # per-slot events (debug level)
        self.step_log: Any | None = None  # flush summaries (info level)
        self.close: Any | None = None


state = _State()
