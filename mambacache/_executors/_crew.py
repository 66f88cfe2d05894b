"""The host threads that share a large CPU stage's foreach op (one crew per process).

Why not torch's own threads: a CPU stage is cut into pieces under ATen's grain
(``GRAIN`` in ``_base.py``), so that no op is an OpenMP parallel region that
waits, op after op, for a pool thread another process holds. Cut that way, the
whole stage runs on the calling thread: on a quiet host a large copy then moves
at one thread's bandwidth, about half a two-thread memcpy (docs/benchmarks.md,
"Contention"). The crew gives the parallelism back without the barriers: the
stage's views are split into chunks of about ``CHUNK_BYTES``, and the calling
thread and ``torch.get_num_threads() - 1`` helper threads each take the next
chunk as they come free. A helper that another process has descheduled holds
up at most the one chunk it runs; the others take the rest::

    views  [v0 v1 v2 | v3 v4 v5 | v6 v7 v8 | v9 ...]    chunks of ~CHUNK_BYTES
             caller     helper     caller    whoever is free first

Each chunk is one ``_foreach_zero_`` / ``_foreach_copy_`` over its views, which
drops the GIL while it moves bytes.

Invariants:

* :meth:`Crew.run` returns or raises only once no chunk of its stage is
  running: a helper never writes after it, so an executor's resume contract
  (a stage run again after a fault) holds as on one thread; the first
  exception of any chunk is raised, and no chunk starts after it; an
  interrupt on the calling thread is raised even after a chunk's failure (that
  failure its context).
* An inbox is listed only once a helper thread serves it (the helper lists it).
* Only stages whose views can go in any order come here (the zero and copy
  stages' disjoint sources and destinations, host stages, commits).
* Only CPU views under the grain (each op inline on the thread that runs it: a
  larger one would start a second OpenMP team from a helper; an accelerator's
  ops go on the calling thread's current stream).
* Inline, as before, whenever the crew would not pay or would change what an
  observer sees: under ``CHUNK_BYTES * 2`` bytes, one torch thread, the crew
  busy with another thread's stage, or a Python dispatch or function mode active
  (modes are thread-local, so a fault or op-counting mode would miss the
  helpers' ops), or a profiler active on the calling thread (``torch.profiler``
  records the ops of the threads it was started on). A default-device context
  (``torch.set_default_device``, ``with torch.device(...)``; its own type, not
  a subclass) is the one function mode that does not keep a stage inline: it
  only gives factory functions a device, and a stage's in-place ops on the
  pool's own tensors create nothing.
* A helper runs a stage under its caller's inference and grad modes (also
  thread-local): an engine's pool made under ``torch.inference_mode`` holds
  inference tensors, which refuse an in-place op outside it.
"""

from __future__ import annotations

import os
import queue
import threading

import torch
import torch.utils._device  # the default-device context's type (see only_device_contexts)

from ._base import GRAIN

__all__ = ["CHUNK_BYTES", "MIN_VIEWS", "Crew", "crew"]

# About 100-300 us of one thread's copying here: large against a chunk's hand-off (a queue put and a
# foreach call, some microseconds), small against a scheduler slice a descheduled helper may hold it for.
CHUNK_BYTES = 1 << 20
# A stage of fewer views is not summed up at all (a decode step's few single-slot views): the check that
# keeps the crew off the hot path costs one len().
MIN_VIEWS = 16


def _bounds(views: list[torch.Tensor], chunk: int) -> list[tuple[int, int]]:
    """``views`` as consecutive ``[i, j)`` ranges of about ``chunk`` bytes each (a view is never split)."""
    out: list[tuple[int, int]] = []
    start = size = 0
    for i, v in enumerate(views):
        size += v.numel() * v.element_size()
        if size >= chunk:
            out.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(views):
        out.append((start, len(views)))
    return out


class _Job:
    """One stage's chunks, taken in order by whoever is free. The state of the job, not a count of signals, says
    when it is over: ``running`` helpers' chunks in progress, ``closed`` once its caller leaves (no chunk starts
    after), so no interrupt can lose or carry over a signal into the next job."""

    __slots__ = ("bounds", "closed", "cond", "dests", "error", "grad", "inference", "next", "running", "sources")

    def __init__(
        self, dests: list[torch.Tensor], sources: list[torch.Tensor] | None, bounds: list[tuple[int, int]]
    ) -> None:
        self.dests, self.sources, self.bounds = dests, sources, bounds
        # The caller's thread-local autograd state, which its helpers take on: an engine's pool made under
        # inference_mode holds inference tensors, which refuse an in-place op outside it.
        self.inference, self.grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        self.next = self.running = 0
        self.closed = False
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def take(self, helper: bool) -> tuple[int, int] | None:
        with self.cond:
            if self.closed or self.error is not None or self.next == len(self.bounds):
                return None
            self.next += 1
            # Only helpers' chunks are counted: the caller's chunk cannot outlive its own raise, and a signal
            # (delivered only to the main thread) between this count and its decrement would leave it counted.
            self.running += helper
            return self.bounds[self.next - 1]

    def fail(self, error: BaseException) -> None:
        """Record ``error``: the first one, except that an interrupt (a KeyboardInterrupt, a SystemExit: not an
        ``Exception``) replaces a chunk's failure, with that failure as its context, and is what run raises. The
        flush turns an ``Exception`` into an ExecutorError and carries on; an interrupt must reach its caller."""
        with self.cond:
            if self.error is None:
                self.error = error
            elif isinstance(self.error, Exception) and not isinstance(error, Exception):
                if error.__context__ is None and error is not self.error:
                    error.__context__ = self.error
                self.error = error

    def work(self, helper: bool = False) -> None:
        while (got := self.take(helper)) is not None:
            i, j = got
            try:
                if self.sources is None:
                    torch._foreach_zero_(self.dests[i:j])
                else:
                    torch._foreach_copy_(self.dests[i:j], self.sources[i:j])
            except BaseException as e:  # recorded and re-raised by Crew.run on the calling thread
                self.fail(e)
            finally:
                if helper:
                    with self.cond:
                        self.running -= 1
                        if not self.running:
                            self.cond.notify_all()

    def close(self) -> None:
        """No chunk starts after this; returns once none runs. An interrupt meanwhile is recorded (raised by
        :meth:`Crew.run` after) and the wait goes on: the caller must not leave a helper writing."""
        while True:
            try:
                with self.cond:
                    self.closed = True
                    while self.running:
                        self.cond.wait()
                return
            except BaseException as e:
                self.fail(e)


class Crew:
    """Helper threads (started on first use, daemons, kept) that share the chunks of one stage at a time."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, min_views: int = MIN_VIEWS) -> None:
        self.chunk_bytes, self.min_views = chunk_bytes, min_views
        self.stages = 0  # stages shared with helpers (a count the tests read)
        self._reset()

    def _reset(self) -> None:
        """No helpers yet, and the crew free: at start, and in a forked child, which has none of its parent's
        threads (and whose copy of ``_busy`` may be held by a parent thread that does not exist there)."""
        self._busy = threading.Lock()  # one stage at a time; another thread's stage runs inline meanwhile
        self._inbox: list[queue.SimpleQueue[_Job]] = []

    def _helpers(self, want: int) -> list[queue.SimpleQueue[_Job]]:
        """Up to ``want`` helpers' inboxes, starting helpers that are missing; fewer where a thread cannot be
        started (a pids or memory limit): the stage then runs with the helpers there are.

        A helper lists its own inbox, on its own thread, where no signal is delivered, so an inbox is listed
        only once a thread serves it: an inbox no one served would take every later shared stage's job for
        good, and keep its views' storage alive. An interrupt here after the start leaves the helper to list
        itself, and the next stage finds it."""
        while len(self._inbox) < want:
            listed = threading.Event()
            thread = threading.Thread(target=_serve, args=(self._inbox, listed), name="mambacache-crew", daemon=True)
            try:
                thread.start()
            except Exception:  # no thread to be had now; a later stage tries again
                break
            listed.wait()
        return self._inbox[:want]

    def open(self) -> bool:
        """Whether this thread's stages may leave it at all (whatever their views): more than one torch
        thread, no Python dispatch or function mode (a default-device context aside) and no profiler active.
        The torch executor asks it too before it picks how a large stage runs."""
        return torch.get_num_threads() >= 2 and unobserved()

    def shares(self, dests: list[torch.Tensor], nbytes: int | None = None) -> bool:
        """Whether a stage over ``dests`` goes to the crew: see the module's invariants. ``nbytes``, the
        stage's size where the caller knows it: a stage under the threshold is then inline without a look at
        each of its views (a per-layer pool's decode step has two views per layer, and the look costs about
        0.1 us a view)."""
        if nbytes is not None and nbytes < 2 * self.chunk_bytes:
            return False
        if len(dests) < self.min_views or not dests[0].is_cpu or not self.open():
            return False
        size = 0
        for v in dests:
            n = v.numel()
            if n >= GRAIN:  # an op that is a parallel region of its own: on a helper, a second OpenMP team
                return False
            size += n * v.element_size()
        return size >= 2 * self.chunk_bytes

    def run(
        self, dests: list[torch.Tensor], sources: list[torch.Tensor] | None = None, nbytes: int | None = None
    ) -> None:
        """Zero ``dests`` (``sources`` None) or copy ``sources`` into them, pairwise, in any order. ``nbytes``:
        the bytes of ``dests`` together, where the caller knows them without a look at each view."""
        if not self.shares(dests, nbytes) or not self._busy.acquire(blocking=False):
            _inline(dests, sources)
            return
        try:
            job = _Job(dests, sources, _bounds(dests, self.chunk_bytes))
            try:
                for inbox in self._helpers(min(torch.get_num_threads(), len(job.bounds)) - 1):
                    inbox.put(job)
                self.stages += 1
                job.work()
            finally:  # whatever raised above, including an interrupt between two puts
                job.close()
            if job.error is not None:
                raise job.error
        finally:
            self._busy.release()


def _serve(listing: list[queue.SimpleQueue[_Job]], listed: threading.Event) -> None:
    """A helper: lists its inbox in ``listing`` (then sets ``listed``), and runs each job it is handed, under
    the job's autograd modes, until the job is closed or done. Holds no job between jobs (a job's views keep
    the pool's storage alive)."""
    inbox: queue.SimpleQueue[_Job] = queue.SimpleQueue()
    try:
        listing.append(inbox)
    finally:
        listed.set()
    while True:
        job: _Job | None = inbox.get()
        assert job is not None
        try:
            with torch.inference_mode(job.inference), torch.set_grad_enabled(job.grad):
                job.work(helper=True)
        except BaseException as e:  # raised by run() on the caller's thread; this helper serves on
            job.fail(e)
        finally:
            job = None


def unobserved() -> bool:
    """Whether no one watches this thread's ops one by one: no Python dispatch mode, no function mode but a
    default-device context, no profiler (it records only the threads it was started on). Work that leaves
    the thread or bypasses ATen (the crew's helpers, a ``memmove``) is only for such a thread."""
    if torch._C._len_torch_dispatch_stack():
        return False
    if (modes := torch._C._len_torch_function_stack()) and not only_device_contexts(modes):
        return False
    return not torch.autograd._profiler_enabled()  # type: ignore[attr-defined]


def only_device_contexts(modes: int) -> bool:
    """Whether each of the ``modes`` function modes on this thread's stack is a default-device context: an
    engine that set a default device once (even ``'cpu'``) would otherwise run every stage on one thread. The
    type itself, not a subclass: a user's mode built on it may count or fault ops, and must see every one."""
    context = torch.utils._device.DeviceContext
    return all(type(torch._C._get_function_stack_at(i)) is context for i in range(modes))


def _inline(dests: list[torch.Tensor], sources: list[torch.Tensor] | None) -> None:
    if sources is None:
        torch._foreach_zero_(dests)
    else:
        torch._foreach_copy_(dests, sources)


crew = Crew()
"""The process's crew: every torch executor shares its helper threads."""
os.register_at_fork(after_in_child=crew._reset)
