"""Executors: the thread that owns one execution context, and how a batch gets there.

A batch's two steps (:mod:`batcher.batch_steps`: stage, then run) run on the context's thread.
:class:`ThreadExecutor` is the production hand-off: one single-thread pool per context, so a context is used by
one thread at a time as the engine contract requires; for a context with two staging buffers it stages the next
batch on a second thread while the current one runs, that thread handing each staged batch straight to the
context's (:class:`~batcher.device_pipeline.DevicePipeline`, which launches a batch behind the running one on a
context that takes two); and a CPU context whose batches take less CPU than the hand-off itself runs them on the
event loop instead (``server.inline_execution_us``). The scheduler only needs ``submit(fn, *args) -> awaitable``
and ``close()`` (and ``depth``/``pipeline`` for a pipeline), so tests can hand it an executor that runs batches on
the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from engines.base import ExecutionContext

from . import batch_trace
from .batch_steps import BatchResult, stage_batch
from .device_pipeline import DevicePipeline, _Job, _post

log = logging.getLogger(__name__)


class Executor(Protocol):
    """How the scheduler hands a batch to the owner of one execution context."""

    context: ExecutionContext
    #: batches it takes at once (optional; default 1): 2 or more when one can be staged while another runs, and
    #: then it has :meth:`pipeline`
    depth: int

    def submit(self, fn: Callable[..., BatchResult], *args: Any, key: Hashable = None) -> Awaitable[BatchResult]:
        """Run ``fn(context, *args)`` where the context lives; the awaitable gives its result. ``key``: the
        batch's shape key (:func:`batcher.batching.shape_key`), which an executor may use to tell batches apart."""

    def pipeline(self, args: tuple, slot: int, done: Callable[[asyncio.Future], None] | None = None
                 ) -> Awaitable[BatchResult]:
        """(``depth`` >= 2 only) One batch in two steps: :func:`stage_batch` ``(context, *args, slot)``, then run
        it (:func:`run_batch`, or launched and collected, :class:`DevicePipeline`); ``args`` are
        :func:`stage_batch`'s after the context (batch, model, estimate, clock, allowed, batched). ``done(future)``
        is called on the event loop right after the future is settled, in the same callback."""

    def close(self) -> None:
        """Wait for the running call, then release the context."""


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
#: shape keys a context remembers as cheap (then it starts over: each shape's next batch goes to the thread once)
CHEAP_KEYS = 1024


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
            two). One batch fifty times the bound lifts the inline average over that and sends the next ones back
            to the thread. A batch whose shape key (``submit``'s ``key``) has not yet run on the thread within
            :data:`PROBE_FACTOR` of the bound never runs inline: a model with dynamic dims whose 4x4 batches ran
            inline ran its first 5500x5500 one there too, and held every request of the process for seconds (a
            new user's report). 0: never.
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
        #: shape keys with a batch measured on the thread within PROBE_FACTOR of the bound (at most CHEAP_KEYS)
        self._cheap: set[Hashable] = set()

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

    def submit(self, fn: Callable[..., BatchResult], *args: Any, key: Hashable = None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if not self._inline_s:
            return loop.run_in_executor(self._pool, fn, self.context, *args)
        if key is not None and key not in self._cheap:  # a shape not measured cheap yet: learned on the thread
            return loop.run_in_executor(self._pool, self._first_of_shape, fn, args, key)
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

    def _first_of_shape(self, fn: Callable[..., BatchResult], args: tuple, key: Hashable) -> BatchResult:
        """A batch of a shape not measured cheap yet, on the thread; its shape becomes cheap when it cost at most
        :data:`PROBE_FACTOR` times the bound (the context's averages are left to the shapes that may run inline)."""
        measured = [0, 0.0]
        result = self._timed(fn, args, measured)
        if measured[0] and measured[1] <= PROBE_FACTOR * self._inline_s:
            if len(self._cheap) >= CHEAP_KEYS:
                self._cheap.clear()
            self._cheap.add(key)
        return result

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
