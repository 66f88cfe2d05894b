"""A flush held in the middle of its work, for tests of what other threads may do meanwhile.

``PauseAt(at)`` is a dispatch mode (entered in the flushing thread only: torch's
mode stack is per thread) that stops before the ``at``-th aten op, sets
``paused`` and waits for ``go``. ``flush_paused(mgr, at)`` runs
``mgr.flush_nowait()`` in a thread under it and returns once the flush is
paused or finished, with the thread and the mode; ``resume(...)`` lets it go
and returns what the flush raised (None when it ran through).
"""

from __future__ import annotations

import threading
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

import mambacache as mc

__all__ = ["PauseAt", "flush_paused", "resume"]


class PauseAt(TorchDispatchMode):
    """Waits for ``go`` before the ``at``-th aten op (1-based), after setting ``paused``; counts ops."""

    def __init__(self, at: int, fault: type[BaseException] | None = None) -> None:
        super().__init__()
        self.at, self.fault, self.ops = at, fault, 0
        self.paused, self.go = threading.Event(), threading.Event()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        if self.ops == self.at:
            self.paused.set()
            assert self.go.wait(60), "the test never let the paused flush go"
            if self.fault is not None:
                raise self.fault(f"injected before op {self.ops}: {func}")
        return func(*args, **(kwargs or {}))


class Flushing:
    """A flush running in its own thread under a :class:`PauseAt`."""

    def __init__(self, mgr: mc.CacheManager, at: int, fault: type[BaseException] | None) -> None:
        self.mode = PauseAt(at, fault)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(mgr,), daemon=True)

    def _run(self, mgr: mc.CacheManager) -> None:
        try:
            with self.mode:
                mgr.flush_nowait()
        except BaseException as exc:  # handed to the test by resume()
            self.error = exc
        finally:
            self.mode.paused.set()  # ran through (or failed) without pausing: wake the test all the same


def flush_paused(mgr: mc.CacheManager, at: int, fault: type[BaseException] | None = None) -> Flushing:
    """``mgr.flush_nowait()`` in a thread, held before aten op ``at`` (then failing with ``fault``, if given)."""
    f = Flushing(mgr, at, fault)
    f.thread.start()
    assert f.mode.paused.wait(60)
    return f


def resume(f: Flushing) -> BaseException | None:
    """Let the held flush go and wait for it; returns what it raised."""
    f.mode.go.set()
    f.thread.join(60)
    assert not f.thread.is_alive()
    return f.error
