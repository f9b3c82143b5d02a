"""Executors: the thread that owns one execution context, and what it does with one batch.

A batch takes two steps, never on the event loop. :func:`stage_batch` drops requests that would finish after
their deadline and stacks the rest (into the context's pinned staging buffer where it has one), padded with zero
rows up to the smallest allowed batch size that holds them; :func:`run_batch`, on the context's own thread, runs
the engine once, drops the padding rows of the outputs and splits the rest into per-request views. Neither
raises: every request of the batch gets an outcome, outputs or a :class:`~batcher.errors.BatcherError`.
:func:`execute_batch` does both in one call.

:class:`ThreadExecutor` is the production hand-off: one single-thread pool per context, so a context is used by
one thread at a time as the engine contract requires; for a context with two staging buffers it stages the next
batch on a second thread while the current one runs, that thread handing each staged batch straight to the
context's (:class:`DevicePipeline`, which launches a batch behind the running one on a context that takes two),
and a CPU context whose batches take less CPU than the hand-off itself runs them on the event loop
(``server.inline_execution_us``). The scheduler only needs ``submit(fn, *args) -> awaitable`` and ``close()`` (and
``depth``/``pipeline`` for a pipeline), so tests can hand it an executor that runs batches on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np

from engines.base import DeviceTimes, EngineError, EngineInputError, EngineUnavailable, ExecutionContext

from .batch_sizes import padded_size
from .batching import Pending, split_outputs, stack_inputs
from .errors import BatcherError, DeadlineExceeded, ExecutionFailed, InvalidInput, Unavailable
from . import batch_trace, lograte

log = logging.getLogger(__name__)


@dataclass
class BatchResult:
    """What one batch came to.

    Attributes:
        outcomes: per request, in batch order: its outputs (dict of views) or the BatcherError to answer with.
        times: seconds spent stacking inputs, executing, splitting outputs (0.0 each when nothing ran).
        rows: the requests' rows executed (requests dropped before execution excluded).
        padded_rows: zero rows added to reach an allowed batch size (executed, never answered).
        device: the batch's time on the device and the device's idle time before it, where the context times its
            device (:meth:`~engines.base.ExecutionContext.device_times`: CUDA-graph contexts); None otherwise.
    """

    outcomes: list[dict | BatcherError]
    times: tuple[float, float, float]
    rows: int
    padded_rows: int = 0
    device: DeviceTimes | None = None


@dataclass
class Staged:
    """A batch after its first step (:func:`stage_batch`): the requests that run, their stacked inputs, and the
    answers of those dropped before execution.

    Attributes:
        slot: the context's staging buffer the inputs were stacked into (:attr:`ExecutionContext.staging_slots`).
        batched: False for a model without a batch dimension: one request, its inputs and outputs passed whole.
        inputs: the stacked, padded inputs (None when nothing runs or stacking failed: ``error``).
        seconds: time spent stacking.
    """

    batch: Sequence[Pending]
    live: list[Pending]
    dropped: dict[int, BatcherError]
    rows: int
    pad: int
    slot: int = 0
    batched: bool = True
    inputs: dict[str, Any] | None = None  # arrays, or RowParts a context reads in place
    seconds: float = 0.0
    error: Exception | None = None


def stage_batch(ctx: ExecutionContext, batch: Sequence[Pending], model: str, batch_s: float | None,
                now: Callable[[], float] = time.monotonic, allowed: Sequence[int] | None = None,
                batched: bool = True, slot: int = 0) -> Staged:
    """The first step of a batch (blocking; any thread): drop what cannot finish in time, stack the rest.

    Args:
        batch: the requests, their inputs validated and of one shape key.
        model: the model's name, for messages.
        batch_s: the estimated seconds of this batch (None before the first batch): a request whose deadline falls
            before the batch would finish is not run (its answer would be a 504 anyway), so the work goes to
            requests that can still make it.
        now: the clock deadlines are measured on (the event loop's, ``time.monotonic``).
        allowed: the model's allowed batch sizes (ascending; None: no padding): the rows that run are padded with
            zero rows up to the smallest allowed size that holds them.
        batched: False for a model without a batch dimension: the batch is one request, whose inputs are passed
            whole (no stacking, no padding) and whose outputs :func:`run_batch` passes whole.
        slot: which of the context's staging buffers to stack into (``host_buffer(..., slot=slot)``).
    """
    finish = now() + (batch_s or 0.0)
    dropped: dict[int, BatcherError] = {}
    live = []
    for p in batch:
        if p.deadline is not None and finish >= p.deadline:
            dropped[id(p)] = DeadlineExceeded(
                f"model '{model}': deadline expired, or would before execution finished; not executed")
        else:
            live.append(p)
    rows = sum(p.rows for p in live)
    staged = Staged(batch, live, dropped, rows, 0, slot, batched)
    if not batched and live:
        staged.inputs = live[0].inputs
    elif live:
        t0 = time.perf_counter()
        try:
            staged.pad = padded_size(rows, allowed) - rows
            staged.inputs = stack_inputs(live, _staging(ctx, slot), rows + staged.pad, ctx.gather_rows)
        except (EngineError, ValueError) as exc:
            staged.error = exc
        staged.seconds = time.perf_counter() - t0
    return staged


def run_batch(ctx: ExecutionContext, staged: Staged, model: str, allowed: Sequence[int] | None = None
              ) -> BatchResult:
    """The second step of a batch (blocking; the context's own thread): execute once, drop the padding rows of
    the outputs and split the rest into per-request views. Never raises: every request gets its outputs or a
    :class:`~batcher.errors.BatcherError`."""
    if not staged.live:
        return finish_batch(ctx, staged, model, allowed, {}, 0.0)
    t1 = time.perf_counter()
    try:
        if staged.error is not None:
            raise staged.error
        outputs: dict | Exception = ctx.execute(staged.inputs)
    except (EngineError, ValueError) as exc:
        outputs = exc
    return finish_batch(ctx, staged, model, allowed, outputs, time.perf_counter() - t1, device_times(ctx, outputs))


def device_times(ctx: ExecutionContext, outputs: dict | Exception) -> DeviceTimes | None:
    """The device times of the batch ``ctx`` just returned ``outputs`` for (None when it failed or the context
    does not time its device); on the thread that ran it."""
    return None if isinstance(outputs, Exception) else ctx.device_times()


def finish_batch(ctx: ExecutionContext, staged: Staged, model: str, allowed: Sequence[int] | None,
                 outputs: dict | Exception, execute_s: float, device: DeviceTimes | None = None) -> BatchResult:
    """The end of a batch's second step (the context's own thread): ``outputs`` (what the engine returned, or the
    EngineError/ValueError it raised) split into per-request views without the padding rows; when the engine
    failed, or an output has the wrong rows, and the batch holds several requests, each runs alone (one
    request's data may be what the engine rejected), so only that one fails. ``execute_s``: the engine's seconds
    for the batch; ``device``: its device times (:func:`device_times`). Never raises."""
    live, rows, pad = staged.live, staged.rows, staged.pad
    t2 = time.perf_counter()
    parts: list = []
    if live:
        try:
            if isinstance(outputs, Exception):
                raise outputs
            # the padding rows form a last share that nobody gets; the split checks every output has rows + pad
            parts = (split_outputs(outputs, [p.rows for p in live] + [pad] * bool(pad))[:len(live)] if staged.batched
                     else [outputs])
        except (EngineError, ValueError) as exc:
            if len(live) > 1 and not isinstance(exc, EngineUnavailable):
                parts = [_run_alone(ctx, p, model, allowed, staged.slot) for p in live]
            else:
                parts = [_failure(exc, model, rows)] * len(live)
    t3 = time.perf_counter()
    results: dict[int, Any] = {**staged.dropped, **{id(p): part for p, part in zip(live, parts)}}
    return BatchResult([results[id(p)] for p in staged.batch], (staged.seconds, execute_s, t3 - t2), rows, pad,
                       device)


def execute_batch(ctx: ExecutionContext, batch: Sequence[Pending], model: str, batch_s: float | None,
                  now: Callable[[], float] = time.monotonic, allowed: Sequence[int] | None = None,
                  batched: bool = True) -> BatchResult:
    """Both steps of a batch in one call (blocking; the context's thread): :func:`stage_batch` into staging
    buffer 0, then :func:`run_batch`."""
    return run_batch(ctx, stage_batch(ctx, batch, model, batch_s, now, allowed, batched), model, allowed)


def _staging(ctx: ExecutionContext, slot: int) -> Callable[[str, tuple[int, ...], np.dtype], np.ndarray | None]:
    """The ``buffer`` argument of :func:`stack_inputs` for staging buffer ``slot`` of ``ctx``."""
    return ctx.host_buffer if slot == 0 else partial(ctx.host_buffer, slot=slot)


def _failure(exc: Exception, model: str, rows: int) -> BatcherError:
    """The answer for the requests of a batch the engine failed on."""
    if isinstance(exc, EngineUnavailable):  # e.g. the worker process died with the batch; the next one restarts it
        return Unavailable(f"model '{model}': {exc}", retry_after_s=1)
    if isinstance(exc, EngineInputError):  # the request's data (a batch of one, or run alone)
        return InvalidInput(f"model '{model}' cannot run on this request's input: {exc}")
    failed = ExecutionFailed(f"model '{model}' failed on a batch of {rows} rows: {exc}")
    suppressed = lograte.due("engine failure", model)
    if suppressed is not None:  # a 500: the operator hears of it, once per 10 s per model (a client may repeat it)
        log.warning("%s (%d more engine failures of this model since the last warning)", failed.message, suppressed)
    return failed


def _run_alone(ctx: ExecutionContext, p: Pending, model: str, allowed: Sequence[int] | None,
               slot: int = 0) -> dict | BatcherError:
    """One request of a failed batch, executed on its own (padded like any batch, staged in the failed batch's
    buffer): its outputs, or its failure."""
    pad = padded_size(p.rows, allowed) - p.rows
    try:
        outputs = ctx.execute(stack_inputs([p], _staging(ctx, slot), p.rows + pad))
        return split_outputs(outputs, [p.rows] + [pad] * bool(pad))[0]
    except (EngineError, ValueError) as exc:
        return _failure(exc, model, p.rows)


class Executor(Protocol):
    """How the scheduler hands a batch to the owner of one execution context."""

    context: ExecutionContext
    #: batches it takes at once (optional; default 1): 2 or more when one can be staged while another runs, and
    #: then it has :meth:`pipeline`
    depth: int

    def submit(self, fn: Callable[..., BatchResult], *args: Any) -> Awaitable[BatchResult]:
        """Run ``fn(context, *args)`` where the context lives; the awaitable gives its result."""

    def pipeline(self, args: tuple, slot: int, done: Callable[[asyncio.Future], None] | None = None
                 ) -> Awaitable[BatchResult]:
        """(``depth`` >= 2 only) One batch in two steps: :func:`stage_batch` ``(context, *args, slot)``, then run
        it (:func:`run_batch`, or launched and collected, :class:`DevicePipeline`); ``args`` are
        :func:`stage_batch`'s after the context (batch, model, estimate, clock, allowed, batched). ``done(future)``
        is called on the event loop right after the future is settled, in the same callback."""

    def close(self) -> None:
        """Wait for the running call, then release the context."""


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


#: batches measured before a context may run batches inline, and the weight of the newest in their averages.
INLINE_AFTER, INLINE_EWMA_ALPHA = 16, 0.1
#: a context whose batches average at most PROBE_FACTOR times the inline bound on its thread runs one batch in
#: PROBE_EVERY inline, to measure what it costs there: on the thread its CPU time also holds the GIL's hand-offs
#: to and from a busy event loop (``bench.peers``' trivial model on 2 cores: 75-125 us a batch of 8 on its thread,
#: over the 100 us bound, and under HTTP load its batches all ran there; bench/results/peers/frontend_day14)
PROBE_FACTOR, PROBE_EVERY = 4.0, 16
#: a context running its batches inline keeps them there until their inline average passes LEAVE_FACTOR times the
#: bound (it comes back at the bound): the trivial model's batches average 60-77 us inline on 2 cores under
#: ``h2load -c 16``, and with one threshold that average crossed 100 us now and then and sent about 1 batch in 9 to
#: the thread (a console run with the averages logged; bench/results/peers/frontend_day15/runs.md)
LEAVE_FACTOR = 2.0


class ThreadExecutor:
    """One execution context and the single thread that uses it (engine contexts are not thread-safe).

    A context with several staging buffers (``staging_slots`` >= 2: a GPU context, whose execution runs on the
    device while the host waits) gets a second thread that stages the next batch (:meth:`pipeline`: deadline checks,
    stacking into another pinned buffer) while the context's thread runs the current one, so the device is not
    idle while a batch is copied together: a two-stage pipeline taking :attr:`depth` (= ``staging_slots``)
    batches at once (the scheduler gives slots from the third on to full batches only).

    Args:
        inline_s: a context whose batches take at most this much CPU time on average (seconds, stack + execute +
            split; moving averages, one of the batches run on the event loop and one of those run on the thread,
            after the first :data:`INLINE_AFTER`) runs its next batches on the event loop instead: handing a batch
            to the thread and its result back costs more than that (``server.inline_execution_us``; measured in
            the README's "Serving modes"). Once a batch has run inline, the inline average decides; before that,
            the thread's. Measured on the thread a batch also pays the GIL's hand-offs, so a context whose thread
            average is within :data:`PROBE_FACTOR` of the bound runs one batch in :data:`PROBE_EVERY` inline, to
            learn its inline cost. A context running inline stays there until its inline average passes
            :data:`LEAVE_FACTOR` times the bound (hysteresis: an average near the bound does not flap between the
            two). One batch fifty times the bound (a new input shape) lifts the inline average over that and sends
            the next ones back to the thread. 0: never.
    """

    def __init__(self, context: ExecutionContext, name: str, inline_s: float = 0.0) -> None:
        self.context = context
        # A context bound to its own thread (a CUDA-graph context) runs its batches there: no hop per batch.
        self._own = context.executor is None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) if self._own else context.executor
        self.depth = max(1, getattr(context, "staging_slots", 1))
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-stage") if self.depth > 1 else None
        self._device = DevicePipeline(context, self._pool) if self.depth > 1 else None
        self._inline_s = inline_s if self._own and self.depth == 1 else 0.0
        # moving averages of the batches' CPU seconds, [n, average]: run on the thread, and run inline
        self._on_thread = [0, 0.0]
        self._on_loop = [0, 0.0]
        self._since_probe = 0  # batches run on the thread since the last one run inline
        self._staying = False  # the last batch ran inline because :attr:`inline` said so (not as a probe)

    @property
    def inline(self) -> bool:
        """Whether the next batch runs on the event loop (besides the probes of :data:`PROBE_EVERY`)."""
        if self._on_thread[0] + self._on_loop[0] < INLINE_AFTER:
            return False
        if not self._on_loop[0]:
            return self._on_thread[1] <= self._inline_s
        return self._on_loop[1] <= (LEAVE_FACTOR * self._inline_s if self._staying else self._inline_s)

    def _probe(self) -> bool:
        """Whether this batch, due on the thread, runs inline once to measure its cost there."""
        return (self._since_probe >= PROBE_EVERY and self._on_thread[0] >= INLINE_AFTER
                and self._on_thread[1] <= PROBE_FACTOR * self._inline_s)

    def submit(self, fn: Callable[..., BatchResult], *args: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if not self._inline_s:
            return loop.run_in_executor(self._pool, fn, self.context, *args)
        self._staying = self.inline
        if not self._staying and not self._probe():
            self._since_probe += 1
            return loop.run_in_executor(self._pool, self._timed, fn, args, self._on_thread)
        self._since_probe = 0
        fut = loop.create_future()
        try:
            fut.set_result(self._timed(fn, args, self._on_loop))
        except BaseException as exc:  # execute_batch never raises; anything else fails its batch as usual
            fut.set_exception(exc)
        return fut

    def _timed(self, fn: Callable[..., BatchResult], args: tuple, average: list) -> BatchResult:
        """Run one batch and take its CPU time in the running thread (not its wall time, which waiting for the GIL
        behind a busy event loop would inflate) into ``average`` ([n, seconds])."""
        t0 = time.thread_time()
        result = fn(self.context, *args)
        took = time.thread_time() - t0
        if result.rows:  # a batch that ran (not dropped before executing)
            average[0] += 1
            average[1] = took if average[0] == 1 else average[1] + INLINE_EWMA_ALPHA * (took - average[1])
        return result

    def pipeline(self, args: tuple, slot: int, done: Callable[[asyncio.Future], None] | None = None
                 ) -> asyncio.Future:
        """One batch staged on the staging thread into staging buffer ``slot``, which hands it straight to the
        context's thread (:class:`DevicePipeline`); the future gives its :class:`BatchResult`, and ``done(future)``
        runs on the event loop in the callback that settles it. ``args``: :func:`stage_batch`'s after the context
        (batch, model, estimate, clock, allowed, batched)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        device = self._device
        assert self._stager is not None and device is not None, "pipeline() needs depth >= 2"

        def stage() -> None:
            batch_trace.mark(args[0], "stage0")
            try:
                staged = stage_batch(self.context, *args, slot)
            except Exception as exc:  # a bug (stage_batch catches the engine's errors): the batch fails
                _post(_Job(None, args[1], args[4], loop, future, done), None, exc)  # type: ignore[arg-type]
                return
            batch_trace.mark(args[0], "stage1")
            device.put(_Job(staged, args[1], args[4], loop, future, done))

        self._stager.submit(stage)
        return future

    def close(self) -> None:
        if self._stager is not None:
            self._stager.shutdown(wait=True)  # every staged batch is with the device pipeline now
            if not self._own:  # the context's own thread: wait until its drain has settled them all
                try:
                    self._pool.submit(lambda: None).result()
                except RuntimeError:  # that thread is stopped: the context was released already
                    pass
        if self._own:
            self._pool.shutdown(wait=True)
        self.context.release()


def executor_for(factory: Callable[[ExecutionContext, str], Executor], cfg: Any, context: ExecutionContext,
                 name: str, inline_us: int = 0) -> Executor:
    """The owner of one of ``cfg``'s contexts: ``factory(context, name)``; a :class:`ThreadExecutor` factory gives a
    CPU context in this process one that may run tiny batches inline when ``inline_us`` is set
    (``server.inline_execution_us``); worker-process and GPU contexts never run inline."""
    if factory is ThreadExecutor and inline_us and cfg.mode == "inprocess" and cfg.device == "cpu":
        return ThreadExecutor(context, name, inline_s=inline_us / 1e6)
    return factory(context, name)
