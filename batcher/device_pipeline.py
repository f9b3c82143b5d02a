"""The second step of a pipelined context's batches (:class:`DevicePipeline`): on the context's own thread, fed
straight by the staging thread, launching each batch behind the running one so the device does not wait for the
host between batches. Used by :class:`batcher.executor.ThreadExecutor` for a context with two or more staging
buffers (a CUDA-graph context).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engines.base import EngineError, ExecutionContext

from . import batch_trace
from .batch_steps import BatchResult, Staged, device_times, finish_batch, run_batch

log = logging.getLogger(__name__)


class _Job:
    """One staged batch for :class:`DevicePipeline`, and the event-loop future its result settles."""

    __slots__ = ("allowed", "done", "future", "launched", "loop", "model", "staged", "start")

    def __init__(self, staged: Staged, model: str, allowed: Sequence[int] | None, loop: asyncio.AbstractEventLoop,
                 future: asyncio.Future, done: Callable[[asyncio.Future], None] | None = None) -> None:
        self.staged, self.model, self.allowed, self.loop, self.future = staged, model, allowed, loop, future
        self.done = done
        self.launched: Any = None
        self.start = 0.0


def _settle(future: asyncio.Future, result: Any, error: BaseException | None,
            done: Callable[[asyncio.Future], None] | None = None) -> None:
    if future.done():  # cancelled meanwhile (the model is closing): nobody waits for it
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    if done is not None:  # the future's own callbacks run a pass of the event loop later
        done(future)


def _post(job: _Job, result: BatchResult | None, error: BaseException | None = None) -> None:
    """Settle a batch's future from any thread (on its event loop), then call its ``done`` hook there."""
    if job.staged is not None:
        batch_trace.mark(job.staged.batch, "post")
    try:
        job.loop.call_soon_threadsafe(_settle, job.future, result, error, job.done)
    except RuntimeError:  # the event loop is closed: nobody waits for it
        pass


class DevicePipeline:
    """The second step of a context's batches, on the context's thread, fed straight by the staging thread (no pass
    of the event loop between staging and running).

    For a context with :attr:`~engines.base.ExecutionContext.pipeline_depth` 2 (a CUDA-graph context), each
    batch is launched as soon as it is here and a launch slot is free, and only then is the oldest collected:
    at saturation the next batch is always queued on the device behind the running one, so the device does not
    wait for the host between batches (the H200 measure: 3.3 ms of execution in each 4.4 ms between batches when
    each batch was executed only after the last one was collected; README "Many front ends, shared memory, two
    GPUs"). A batch that arrives while the thread waits for the oldest is launched after it, as before.
    Depth 1: each batch runs whole (:func:`run_batch`).

    Guarantees: batches are launched, and collected, in the order they arrive; every batch's future is settled
    once, with its :class:`BatchResult` (a failed launch or collect goes through :func:`finish_batch`, whose
    fallback runs each request alone). A batch's execute time counts from its launch or the previous batch's end,
    whichever is later, so the time it waited behind that batch on the device is not counted as its own (the
    scheduler's estimates, deadline checks and admission control use it).
    """

    def __init__(self, context: ExecutionContext, pool: ThreadPoolExecutor) -> None:
        self.context = context
        self.depth = max(1, int(getattr(context, "pipeline_depth", 1)))
        self._pool = pool
        self._jobs: deque[_Job] = deque()  # staged batches not yet taken by the drain; under _lock
        self._lock = threading.Lock()
        self._active = False  # a drain is submitted to the pool and has not returned

    def put(self, job: _Job) -> None:
        """Queue a staged batch (any thread); the context's thread drains the queue."""
        batch_trace.mark(job.staged.batch, "put")
        with self._lock:
            self._jobs.append(job)
            if self._active:
                return
            self._active = True
        self._submit_drain()

    def _submit_drain(self) -> None:
        try:
            self._pool.submit(self._drain)
        except RuntimeError as exc:  # the context's thread is stopped (released): fail what is queued
            with self._lock:
                self._active = False
                jobs, self._jobs = self._jobs, deque()
            for job in jobs:
                _post(job, None, exc)

    def _next(self, may_end: bool) -> _Job | None:
        """The next queued batch; None when there is none now. With ``may_end`` and none queued, the drain ends
        (``_active`` cleared under the lock, so a batch put meanwhile submits a new drain)."""
        with self._lock:
            if self._jobs:
                return self._jobs.popleft()
            if may_end:
                self._active = False
            return None

    def _drain(self) -> None:
        """On the context's thread: launch what is queued (up to ``depth`` on the device), collect the oldest,
        until nothing is queued or on the device. A bug (anything :func:`finish_batch` does not catch) fails the
        batches on hand with it, logged by the scheduler, and the drain goes on."""
        inflight: deque[_Job] = deque()
        try:
            self._drain_loop(inflight)
        except BaseException as exc:
            for job in inflight:
                if job.launched is not None:  # give its launch slot back
                    try:
                        self.context.collect(job.launched)
                    except Exception as failed:  # the batch fails with ``exc`` anyway
                        log.debug("collecting a batch after %r failed too: %r", exc, failed)
                _post(job, None, exc)
            with self._lock:
                self._active = bool(self._jobs)
            if self._active:
                self._submit_drain()
            if not isinstance(exc, Exception):
                raise

    def _drain_loop(self, inflight: deque[_Job]) -> None:
        last_end = 0.0
        while True:
            job = self._next(may_end=not inflight) if len(inflight) < self.depth else None
            if job is None and not inflight:
                return
            if job is not None:
                inflight.append(job)  # on hand until answered: a bug below fails it with the others
                if self.depth == 1:
                    _post(job, run_batch(self.context, job.staged, job.model, job.allowed))
                    inflight.pop()
                elif not self._launch(job):
                    inflight.pop()
                continue
            job = inflight[0]
            batch_trace.mark(job.staged.batch, "collect0")
            try:
                outputs: dict | Exception = self.context.collect(job.launched)
            except (EngineError, ValueError) as exc:
                outputs = exc
            batch_trace.mark(job.staged.batch, "collect1")
            execute_s = time.perf_counter() - max(job.start, last_end)
            _post(job, finish_batch(self.context, job.staged, job.model, job.allowed, outputs, execute_s,
                                    device_times(self.context, outputs)))
            last_end = time.perf_counter()  # after any re-runs of its requests alone: the next batch's time
            inflight.popleft()

    def _launch(self, job: _Job) -> bool:
        """Launch a batch; False when it is done already (nothing to run, or the launch failed: then answered
        through :func:`finish_batch`)."""
        staged = job.staged
        if not staged.live or staged.error is not None:
            _post(job, run_batch(self.context, staged, job.model, job.allowed))
            return False
        job.start = time.perf_counter()
        batch_trace.mark(staged.batch, "launch0")
        try:
            job.launched = self.context.launch(staged.inputs)
        except (EngineError, ValueError) as exc:
            _post(job, finish_batch(self.context, staged, job.model, job.allowed, exc,
                                    time.perf_counter() - job.start))
            return False
        batch_trace.mark(staged.batch, "launch1")
        return True
