"""A blocking call in a worker thread, waited for to its end under asyncio's own cancellation.

An anyio shield (``CancelScope(shield=True)``) keeps anyio's cancellation from
a call it wraps, but not asyncio's own (``Task.cancel()``: ``asyncio.timeout``,
``wait_for``, a ``TaskGroup``): that one reaches ``anyio.to_thread.run_sync``,
which raises it while its thread runs on, and the result of a call that sent or
landed something would be lost. :func:`run_in_worker` waits for the thread
instead, and tells a call that never started (the cancellation came before the
thread took it, and anyio then skips it) from one that ran; :func:`unwrap` turns
the outcome of one that ran back into its value or its exception.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import anyio


async def run_in_worker(call: Callable[[], Any], cancelled: list[BaseException]) -> tuple[bool, Any] | None:
    """``call()`` in a worker thread: ``(True, its value)`` or ``(False, the exception it raised)``; None when
    asyncio's cancellation came before the thread took it (it never runs, and never will).

    Every cancellation that comes meanwhile is appended to ``cancelled`` (the
    caller delivers it once it has dealt with the outcome); while the call runs
    it is waited for, polling (the rare path), so nothing it did goes unseen.
    """
    lock = threading.Lock()
    state = ["queued"]  # then "running" (the thread took it) or "dropped" (the cancellation came first)
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        with lock:
            if state[0] == "dropped":
                return
            state[0] = "running"
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the waiting task
            outcome.append((False, exc))

    try:
        await anyio.to_thread.run_sync(run)
    except anyio.get_cancelled_exc_class() as exc:
        cancelled.append(exc)
        with lock:
            if state[0] == "queued":  # anyio may still hand it to a thread: it must not run then
                state[0] = "dropped"
                return None
    while not outcome:
        try:
            await anyio.sleep(0.001)
        except anyio.get_cancelled_exc_class() as exc:
            cancelled.append(exc)
    return outcome[0]


def unwrap(outcome: tuple[bool, Any]) -> Any:
    """The value of a call :func:`run_in_worker` ran, from its ``(ok, value)`` outcome; the exception it raised is
    raised here, in the waiting task."""
    ok, value = outcome
    if not ok:
        raise value
    return value


def cancel_again(cancelled: list[BaseException]) -> None:
    """Request asyncio's cancellation held back in ``cancelled`` again, for the task's next checkpoint to raise:
    once, as often as it was requested (``Task.cancelling()``, which ``asyncio.timeout`` counts, unchanged).

    Requested when the task next suspends, not now: a request made now stays pending for good (before Python
    3.13 ``uncancel()`` does not rescind it), so an ``asyncio.timeout`` block that ends first, its request
    withdrawn, would leave the task cancelled at its next await outside the block; and a task whose body is the
    call alone (``wait_for``'s, a ``TaskGroup``'s) would end cancelled, the result that moved lost. Still
    requested when the task suspends (``cancelling()`` not back to 0, the task not done), it is delivered there.
    """
    if not cancelled or not isinstance(cancelled[0], asyncio.CancelledError):
        return  # anyio's own cancellation, under a shield: its scope delivers it again by itself
    task = asyncio.current_task()
    assert task is not None
    message = cancelled[0].args[0] if cancelled[0].args else None
    uncancel = getattr(task, "uncancel", None)  # Python 3.11+: the request counted once already

    def again() -> None:
        if task.done():
            return
        if uncancel is not None:
            if task.cancelling() == 0:  # withdrawn meanwhile (the timeout that asked ended)
                return
            uncancel()
        task.cancel(message)

    # Runs before the task resumes from its next suspension (its wake-up is scheduled after this).
    asyncio.get_running_loop().call_soon(again)
