"""Per-model queue, batcher coroutine and the hand-off to executors.

Flow for one model::

    infer() --> bounded queue (max_queue_size requests per priority level; full -> 503 + Retry-After)
            --> batcher coroutine (:meth:`ModelRunner._batcher`): an idle executor, then a batch
            --> the executor (:mod:`batcher.executor`, the steps in :mod:`batcher.batch_steps`): re-check deadlines,
                stack, run, split (for a GPU context in two steps on two threads, so the next batch is stacked
                while the current one runs)
            --> each request's own future, settled exactly once, on the event loop

The batcher loop, after Ray Serve's ``_BatchQueue.wait_for_batch``:

* **Waits for** an idle executor first (so a batch is formed as late as possible and can hold everything that
  arrived meanwhile), then for the next batch (:meth:`ModelRunner._next_batch`): the most urgent queued request
  leads (:func:`batcher.batching.plan_batch`: priority, earliest deadline, arrival); the batch goes when it
  reaches ``max_batch_size`` rows, or at once cut to the largest ``preferred_batch_size`` its leading requests
  reach (Triton's ``GetDynamicBatch``, :func:`batcher.batching.preferred_cut`: the rest stays queued), or whole
  when the window (:func:`batcher.batching.window_wait`) closes: ``max_queue_delay_microseconds`` after the
  batch's first request arrived, earlier when its earliest deadline needs the time to execute. New arrivals,
  expiries and cancels wake it (``_wakeup``).
* **Guarantees:** a request is in at most one batch; a batch never exceeds ``max_batch_size`` rows (the largest
  allowed batch size; the executor pads smaller batches up to an allowed size) and never splits a request; every
  request's future is settled exactly once - outputs, or the error for it - by whichever comes first of its
  deadline timer (:meth:`_expire`, 504), its batch's end (:meth:`_finish`), a cancel (the client left: never
  executed if still queued) or :meth:`close` (503).
* **On cancel** (:meth:`close`): the loop task is cancelled where it waits (the idle executor it held goes back),
  queued requests get 503, executing batches run to their end, then executors and contexts are released.

Deadlines: a queued request whose deadline passes is answered 504 at that moment by its own timer and never
executes; the executor checks again just before running the batch; a request whose deadline passes while its
batch executes is answered 504 then and its rows are discarded, so no answer ever comes after a deadline.
Time is the event loop's clock (``loop.time()``, monotonic), so tests can run on a virtual clock.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Sequence
from functools import partial

import numpy as np

from . import batch_trace
from .batching import (
    ArrivalGaps,
    BatchTimes,
    Pending,
    State,
    Verdict,
    admission,
    arrival_may_end_window,
    batch_is_full,
    plan_batch,
    preferred_cut,
    priority_level,
    urgency,
    shape_key,
    window_wait,
    worth_waiting,
)
from .config import ModelConfig
from .errors import DeadlineExceeded, ExecutionFailed, Unavailable
from .batch_steps import BatchResult, execute_batch
from .executor import Executor
from .metrics import ModelMetrics, observe_many
from .protocol import Lease
from .signature import ModelSignature
from .stats import Stats

log = logging.getLogger(__name__)

def _batch_result(model: str, fut: asyncio.Future, requests: int) -> BatchResult:
    """What a finished batch future came to for its ``requests``: the executor's result; when cancelled (the model
    is closing) 503 for each; when it raised (a bug, not an engine error: logged, the runner keeps serving) 500 for
    each. A failed or cancelled batch reports no rows, so it is not recorded."""
    if fut.cancelled():
        return BatchResult([Unavailable(f"model '{model}' is shutting down")] * requests, (0.0, 0.0, 0.0), 0)
    if fut.exception() is not None:
        log.error("model %s: batch failed", model, exc_info=fut.exception())
        return BatchResult([ExecutionFailed(f"model '{model}': {fut.exception()!r}")] * requests, (0.0, 0.0, 0.0), 0)
    return fut.result()


#: the first staging slot whose token takes full batches only (:meth:`ModelRunner._batcher`): a pipelined
#: executor stages a batch while one runs (slots 0 and 1) and, with more slots (a CUDA-graph context has four),
#: one more per slot while full batches are queued.
LOOKAHEAD_SLOT = 2


class ModelRunner:
    """One model version being served: its queue, batcher task and executors (one per execution context).

    Created on a running event loop; the batcher task starts at once. Stop it with :meth:`close`.
    """

    def __init__(self, cfg: ModelConfig, signature: ModelSignature, executors: Sequence[Executor],
                 metrics: ModelMetrics, stats: Stats | None = None) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.version = str(cfg.version)
        self.signature = signature
        self.metrics = metrics
        self.stats = stats if stats is not None else Stats()
        self._executors = list(executors)
        # one token per batch an executor takes at once: (executor, staging slot); a pipelined executor has one
        # per staging slot, and those from LOOKAHEAD_SLOT on take full batches only (:meth:`_batcher`)
        self._idle: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        self._parked: list[tuple[int, int]] = []  # lookahead tokens waiting for a full batch to be queued
        for i, ex in enumerate(self._executors):
            for slot in range(getattr(ex, "depth", 1)):
                self._idle.put_nowait((i, slot))
        db = cfg.dynamic_batching
        self._delay_s = db.max_queue_delay_microseconds / 1e6
        self._max_batch = signature.max_batch_size or 1  # no batch dimension: one request per execution
        self._allowed = signature.allowed_batch_sizes
        self._preferred = tuple(sorted(set(db.preferred_batch_size)))  # any order, as Triton's std::set
        self._adaptive = db.adaptive_queue_delay
        self._levels = db.priority_levels
        #: queued requests per priority level (index 1..levels): max_queue_size bounds each level's queue
        self._level_depth = [0] * (self._levels + 1)
        self._default_level = db.default_priority_level or (db.priority_levels + 1) // 2
        self._starve_s = db.max_priority_wait_microseconds / 1e6 if db.priority_levels > 1 else None
        self._queue: list[Pending] = []
        self._seq = itertools.count(1)  # Pending.seq: first in, first out among equal level and deadline
        # the last request's urgency key while the queue is in urgency order (one level, deadlines as ordered as
        # the queue), None once it is not: plan_batch then needs no sort
        self._tail: tuple | None = ()
        self._depth = self._queued_rows = self._executing_rows = 0
        self._depth_due = False  # a write of the queue-depth gauge is scheduled (_set_depth)
        self.times = BatchTimes(allowed=self._allowed)  # seconds per batch size: admission, windows, late drops
        self._gaps, self._wakeup = ArrivalGaps(), asyncio.Event()  # gaps: adaptive_queue_delay's moving average
        self._window_end: float | None = None  # while the batcher waits out a window: when it ends
        self._loop = asyncio.get_running_loop()
        # no timer under uvloop's 1 ms tick: it would fire at once and the batch window would spin
        self._tick = 0.001 if type(self._loop).__module__.startswith("uvloop") else 0.0
        self._running: set[asyncio.Future] = set()
        self._closing = False
        self._task = asyncio.create_task(self._batcher(), name=f"batcher-{cfg.name}")

    # ------------------------------------------------------------------ submit
    @property
    def queue_depth(self) -> int:
        """Requests waiting in the queue (not yet in an executing batch)."""
        return self._depth

    def drain_seconds(self) -> float | None:
        """Estimated seconds until a newly queued request would start executing (None before any batch ran)."""
        return self.times.drain(self._queued_rows + self._executing_rows, self._max_batch, len(self._executors))

    async def infer(self, inputs: dict[str, np.ndarray], *, rows: int, received: float,
                    deadline: float | None = None, priority: int | None = None, lease: Lease | None = None) -> dict:
        """Queue one validated request and wait for its outputs (:meth:`enqueue`, then its future).

        Args:
            inputs: inputs validated against the signature (:meth:`ModelSignature.check`), first dim ``rows``.
            received: event-loop time (s) the request arrived; its batch window counts from here.
            deadline: event-loop time after which it must not be answered with outputs.
            priority: ``parameters.priority`` (:func:`batcher.batching.priority_level`). lease: held from queueing
                until the inputs are no longer read (:class:`batcher.protocol.Lease`).

        Returns:
            the request's rows of every output (views into its batch's outputs).

        Raises:
            Unavailable: queue full, model closing, or (admission control) the rows ahead cannot drain before the
                deadline (503 + Retry-After from the estimated drain time). DeadlineExceeded: deadline passed
                (504). ExecutionFailed: engine error for its batch (500). CancelledError: the caller was
                cancelled (a queued request is then never executed).
        """
        p = self.enqueue(inputs, rows=rows, received=received, deadline=deadline, priority=priority, lease=lease)
        try:
            return await p.future
        except asyncio.CancelledError:
            self.withdraw(p)
            raise

    def enqueue(self, inputs: dict[str, np.ndarray], *, rows: int, received: float, deadline: float | None = None,
                priority: int | None = None, lease: Lease | None = None) -> Pending:
        """Queue one validated request without waiting (arguments as :meth:`infer`'s). Its ``future`` is settled
        exactly once, with what :meth:`infer` returns or raises; a caller that stops waiting for it cancels it
        with :meth:`withdraw`.

        Raises:
            Unavailable, DeadlineExceeded: as :meth:`infer`, before anything is queued.
        """
        if self._closing:
            raise Unavailable(f"model '{self.name}' is shutting down")
        level = priority_level(priority, self._levels, self._default_level)
        if self._level_depth[level] >= self.cfg.max_queue_size:  # each level's own queue, as Triton's policies
            at = f" at priority level {level}" if self._levels > 1 else ""
            raise Unavailable(f"model '{self.name}' queue is full ({self._level_depth[level]} of max_queue_size "
                              f"{self.cfg.max_queue_size}{at})")
        now = self._loop.time()
        if deadline is not None:
            if self.cfg.dynamic_batching.admission_control:
                self._admit(now, deadline, rows, level)
            if deadline <= now:
                raise DeadlineExceeded(f"model '{self.name}': deadline passed before the request was queued")
        p = Pending(inputs, rows, shape_key(inputs), received, deadline, self._loop.create_future(),
                    priority=level, lease=lease, seq=next(self._seq))
        self._gaps.arrive(received)
        if deadline is not None:
            p.timer = self._loop.call_at(deadline, self._expire, p)
        if self._tail is not None:
            key = urgency(p, received)
            self._tail = key if self._starve_s is None and (not self._tail or key >= self._tail) else None
        self._queue.append(p)
        self._queued_rows += rows
        self._level_depth[level] += 1
        self._set_depth(self._depth + 1)
        if self._parked and self._full_queued():
            self._idle.put_nowait(self._parked.pop())
        if arrival_may_end_window(now, self._window_end, deadline, self._queued_rows, self._max_batch, self._preferred,
                                  self._levels):
            self._wakeup.set()
        return p

    def withdraw(self, p: Pending) -> None:
        """The caller no longer waits for ``p`` (its client went away): a request still queued is never executed;
        one whose batch executes has its rows discarded. Its future is cancelled if not settled yet."""
        if p.state is State.QUEUED:
            self._settle_queued(p)
        if not p.future.done():
            p.future.cancel()

    def _admit(self, now: float, deadline: float, rows: int, level: int) -> None:
        """Admission control for a request of ``rows`` rows, priority ``level`` and ``deadline``: refused (503) when
        the rows that go before it (executing, and queued ones more urgent by :func:`urgency`: a higher level, or
        the same level and a deadline no later) and its own cannot drain by its deadline. The whole queue is looked
        at only when the queued rows in all would refuse it (a fresh user's report: a request of the highest
        priority, or with the earliest deadline, was refused for the rows queued behind it)."""
        ahead = self._queued_rows + self._executing_rows
        verdict, drain = admission(now, deadline, rows, ahead, self.times, self._max_batch, len(self._executors))
        if verdict is Verdict.CANNOT_FINISH and self._queued_rows:
            key = (level, deadline)
            ahead = self._executing_rows + sum(p.rows for p in self._queue if p.state is State.QUEUED
                                               and urgency(p, now, self._starve_s)[:2] <= key)
            verdict, drain = admission(now, deadline, rows, ahead, self.times, self._max_batch, len(self._executors))
        if verdict is Verdict.LATE:
            raise DeadlineExceeded(f"model '{self.name}': deadline passed before the request was queued")
        if verdict is Verdict.CANNOT_FINISH:
            need = self.times.drain(ahead + rows, self._max_batch, len(self._executors)) or 0.0
            if not ahead:  # alone, it still cannot finish: no retry can help (a fresh user's find: 503 + Retry-After)
                left_ms = (deadline - now) * 1e3
                raise DeadlineExceeded(f"model '{self.name}': this request's {rows} rows need about {need * 1e3:.1f} "
                                       f"ms with nothing ahead of them, beyond its deadline in {left_ms:.1f} ms")
            raise Unavailable(
                f"model '{self.name}': the {ahead} rows ahead and this request's {rows} need about {need * 1e3:.1f} "
                f"ms, beyond its deadline in {(deadline - now) * 1e3:.1f} ms", retry_after_s=max(1, math.ceil(drain)))

    def _set_depth(self, n: int) -> None:
        """The queue's depth, and its gauge once per pass of the event loop (one write for the arrivals of the
        same socket reads instead of one each: in multi-process mode every write goes to a shared file)."""
        self._depth = n
        if not self._depth_due:
            self._depth_due = True
            self._loop.call_soon(self._publish_depth)

    def _publish_depth(self) -> None:
        self._depth_due = False
        self.metrics.queue_depth.set(self._depth)

    def _settle_queued(self, p: Pending) -> None:
        """Take a QUEUED request out of the queue's count (it stays in the list until the next purge, without its
        inputs: a withdrawn binary request's arrays are views of its whole body, which must not wait for the purge
        to be freed)."""
        p.settle()
        p.inputs = {}
        self._queued_rows -= p.rows
        self._level_depth[p.priority] -= 1
        self._set_depth(self._depth - 1)

    def _expire(self, p: Pending) -> None:
        """A request's deadline timer: answer 504 now, whether it is still queued (it will never run) or its batch
        is executing (its rows will be discarded)."""
        waited_ms = (self._loop.time() - p.arrival) * 1e3
        if p.state is State.QUEUED:
            self._settle_queued(p)
            where = "in the queue"
            self._wakeup.set()
        elif p.state is State.EXECUTING:
            where = "while its batch was executing; its result is discarded"
        else:
            return
        if not p.future.done():
            p.future.set_exception(
                DeadlineExceeded(f"model '{self.name}': deadline expired after {waited_ms:.1f} ms {where}"))

    # ------------------------------------------------------------------ batcher
    def _full_queued(self) -> bool:
        """Whether the queue holds rows enough for a batch to go at once (:func:`batch_is_full`)."""
        return batch_is_full(self._queued_rows, self._max_batch, self._preferred)

    async def _batcher(self) -> None:
        """Waits for an executor's token, then for a batch (:meth:`_next_batch`), and dispatches it; forever.

        A lookahead token (staging slot :data:`LOOKAHEAD_SLOT` and up) is used only while a full batch is queued,
        else parked until one is (:meth:`infer` hands it back): at saturation the context then always has its next
        full batch staged, although the event loop that forms batches reaches each step a pass late, while below
        saturation no more partial batches wait behind the device than with two tokens. Measured on the H200 (8
        front ends, resnet18, one run each, README "Many front ends, shared memory, two GPUs"): a third token for
        every batch lifted binary HTTP from 0.84 to 0.87 of the raw engine and system shared memory from 0.83 to
        0.90; with the full-batch rule, 0.82-0.93 and 0.93-0.97 in two runs."""
        while True:
            token = await self._idle.get()
            if token[1] >= LOOKAHEAD_SLOT and not self._full_queued():
                self._parked.append(token)
                continue
            try:
                batch = await self._next_batch()
            except asyncio.CancelledError:
                self._idle.put_nowait(token)
                raise
            self._dispatch(token, batch)
            del batch  # this frame now waits for an idle executor: it must not keep the batch's inputs alive

    def _dispatch(self, token: tuple[int, int], batch: list[Pending]) -> None:
        """Hand ``batch`` to executor ``token[0]`` (staging slot ``token[1]``); :meth:`_finish` settles it."""
        batch_trace.mark(batch, "dispatch")
        now = self._loop.time()
        waited = [now - p.arrival for p in batch]
        level_depth = self._level_depth
        for p, w in zip(batch, waited):
            p.state = State.EXECUTING  # its deadline timer stays armed (see _expire)
            level_depth[p.priority] -= 1
            self.stats.queue.add(w)
        observe_many(self.metrics.queue_duration, waited)  # one write per bucket, not two per request
        rows = sum(p.rows for p in batch)
        self._set_depth(self._depth - len(batch))
        self._queued_rows -= rows
        self._executing_rows += rows
        ex, args = self._executors[token[0]], (batch, self.name, self.times.estimate(rows), self._loop.time,
                                                self._allowed, self.signature.batched)
        finish = partial(self._finish, token, batch)
        if getattr(ex, "depth", 1) > 1:  # staged on one thread while the last batch runs on the context's
            # ``done``: _finish runs in the pass of the event loop that settles the batch, not one pass later
            fut = asyncio.ensure_future(ex.pipeline(args, token[1], done=finish))
        else:
            fut = asyncio.ensure_future(ex.submit(execute_batch, *args, key=batch[0].key))
        self._running.add(fut)
        fut.add_done_callback(finish)  # (for a pipelined batch: only if ``done`` never ran, e.g. cancelled)

    def _plan(self, now: float) -> tuple[list[Pending], int]:
        """The batch :func:`plan_batch` would take now and its rows (nothing is taken off the queue)."""
        if len(self._queue) > 2 * self._depth + 16:  # drop settled entries now and then
            self._queue = [p for p in self._queue if p.state is State.QUEUED]
        if not self._queue:
            self._tail = ()  # an empty queue is in order
        return plan_batch(self._queue, self._max_batch, now, self._starve_s, self._allowed,
                          presorted=self._tail is not None)

    def _take(self, batch: list[Pending]) -> list[Pending]:
        """Take ``batch`` (planned by :meth:`_plan`) off the queue.

        When the batch is the queue's first QUEUED requests in order (one priority level, deadlines in arrival
        order: the common case), that front is cut off, whatever the queue's length; otherwise the queue is built
        anew without them. At saturation the queue holds hundreds of requests, and rebuilding it for every batch
        took about 2 % of the event loop (py-spy, ``bench.peers``' MLP at 8,000 req/s on 2 cores)."""
        queue, i, n = self._queue, 0, len(self._queue)
        for p in batch:
            while i < n and queue[i].state is not State.QUEUED:
                i += 1
            if i == n or queue[i] is not p:
                break
            i += 1
        else:
            del queue[:i]
            return batch
        taken = set(map(id, batch))
        self._queue = [p for p in self._queue if id(p) not in taken and p.state is State.QUEUED]
        return batch

    def _dispatch_full(self) -> None:
        """While a full batch is queued and an executor's token is idle, dispatch it now (from :meth:`_finish`).

        A batch's end frees its token in the pass of the event loop that settles it; through the batcher task the
        next batch would leave two passes later (the token's queue wakes the task, which then runs), and at
        saturation one pass of the engine process's loop reads every front end's messages. Only full batches go
        this way (``max_batch_size`` rows, or cut to a preferred size: :meth:`_cut`), which the batcher task would
        dispatch at once too, so batches are the same and only leave sooner; anything else (a window, a deadline,
        parked lookahead tokens) stays with the task. Measured on the H200 (README "Many front ends, shared memory,
        two GPUs", fifth session): throughput equal to the code before within the spread between runs."""
        while not self._closing and not self._idle.empty() and self._full_queued():
            now = self._loop.time()
            batch, rows = self._plan(now)
            cut = self._cut(batch, now)
            if cut:
                batch = batch[:cut]
            elif rows < self._max_batch:
                return
            self._dispatch(self._idle.get_nowait(), self._take(batch))

    def _cut(self, batch: list[Pending], now: float) -> int:
        """How many of the planned ``batch``'s leading requests go at once by the preferred batch sizes
        (:func:`preferred_cut`); 0 when none do, and once the batch's window has expired: Triton then sends the
        batch as it is, up to ``max_batch_size`` rows (``delay_is_exceeded`` in ``GetDynamicBatch``,
        triton-inference-server/core ``src/dynamic_batch_scheduler.cc``). Without a window (delay 0) the preferred
        sizes always apply, as there."""
        if not self._preferred or not batch or (
                self._delay_s and window_wait(now, min(p.arrival for p in batch), self._delay_s) <= 0):
            return 0
        return preferred_cut(batch, self._preferred)

    async def _next_batch(self) -> list[Pending]:
        while True:
            self._wakeup.clear()
            now = self._loop.time()
            batch, rows = self._plan(now)
            if not batch:
                await self._wakeup.wait()
                continue
            cut = self._cut(batch, now)
            if cut:
                return self._take(batch[:cut])
            deadlines = [p.deadline for p in batch if p.deadline is not None]
            wait = window_wait(now, min(p.arrival for p in batch), self._delay_s,
                               min(deadlines) if deadlines else None, self.times.estimate(rows))
            if (wait <= 0 or rows >= self._max_batch
                    or (self._adaptive and not worth_waiting(self._gaps.mean_s, self._delay_s))):
                return self._take(batch)
            timer = self._loop.call_later(max(wait, self._tick), self._wakeup.set)  # or an arrival wakes it
            self._window_end = now + wait
            try:
                await self._wakeup.wait()
            finally:
                self._window_end = None
                timer.cancel()

    def _finish(self, token: tuple[int, int], batch: list[Pending], fut: asyncio.Future) -> None:
        """A batch's end, once (its executor's ``done`` hook or, failing that, the future's callback): its token
        goes to the next full batch at once (:meth:`_dispatch_full`) or back to the batcher, then every request
        of the batch is settled."""
        if fut not in self._running:  # settled already through the other way in
            return
        self._running.discard(fut)
        self._idle.put_nowait(token)
        self._executing_rows -= sum(p.rows for p in batch)
        result = _batch_result(self.name, fut, len(batch))
        batch_trace.end(batch, result.rows, result.padded_rows, result.device)
        if result.rows:
            self._record_batch(result, len(batch))
        try:
            self._dispatch_full()
        finally:  # a bug there (logged by the event loop) must not leave this batch's requests unanswered
            self._settle_batch(batch, result)

    def _settle_batch(self, batch: list[Pending], result: BatchResult) -> None:
        for p, out in zip(batch, result.outcomes):
            p.settle()
            if p.future.done():  # the client went away or the deadline passed: its rows are discarded
                continue
            if isinstance(out, BaseException):
                p.future.set_exception(out)
            else:
                p.future.set_result(out)

    def _record_batch(self, result: BatchResult, requests: int) -> None:
        self.metrics.batch(result.rows, result.padded_rows, result.times, result.device)
        self.stats.batch(result.rows, requests, *result.times, result.padded_rows)
        self.times.record(result.rows + result.padded_rows, sum(result.times))

    # ------------------------------------------------------------------ lifecycle
    def shed(self) -> int:
        """Answer every request still queued 503 now (SIGTERM's grace is over: they would not run before the
        exit, and the exit would close their connections without an answer); batches executing run on. Returns
        how many were answered."""
        shed = 0
        for p in self._queue:
            if p.state is State.QUEUED:
                self._settle_queued(p)
                if not p.future.done():
                    p.future.set_exception(Unavailable(f"model '{self.name}': the server is shutting down and its "
                                                       "drain's grace (server.shutdown_grace_s) is over"))
                    shed += 1
        return shed

    async def close(self) -> None:
        """Stop batching, answer queued requests 503, let executing batches finish, release the executors."""
        self._closing = True
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        for p in self._queue:
            if p.state is State.QUEUED:
                self._settle_queued(p)
                if not p.future.done():
                    p.future.set_exception(Unavailable(f"model '{self.name}' is shutting down"))
        self._queue.clear()
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        await asyncio.to_thread(self._release)

    def _release(self) -> None:
        for ex in self._executors:
            ex.close()
