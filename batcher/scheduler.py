"""Per-model queue, batcher coroutine and executor threads.

Flow for one model::

    submit() --> bounded queue (max_queue_size requests; full -> 503 + Retry-After)
             --> batcher coroutine: waits for an idle execution context, then for a batch: the oldest request
                 opens the window; the batch goes at max_batch_size rows, at the largest preferred batch size, or
                 max_queue_delay_us after the first request arrived (time.monotonic, the event loop's clock)
             --> executor thread owning that context: re-check deadlines, stack, execute, split
             --> each request's own future, settled exactly once on the event loop

Deadlines: a queued request whose deadline passes is answered 504 at that moment by its own timer (not when a
context frees up) and is never executed; the executor thread checks again just before running the batch; a
request whose deadline passes while its batch executes is answered 504 then and its rows are discarded, so no
answer ever comes after a request's deadline.

An engine error fails only its batch (500 with the engine's reason); the model keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np

from engines.base import Engine, EngineError, ExecutionContext
from engines.datatypes import NUMPY_DTYPES
from engines.multiproc import WorkerCrashed

from .batching import Pending, State, batch_is_full, plan_batch, shape_key, split_outputs, stack_inputs
from .config import ModelConfig
from .errors import BatcherError, DeadlineExceeded, ExecutionFailed, InvalidInput, Unavailable
from .metrics import ModelMetrics
from .signature import ModelSignature

log = logging.getLogger(__name__)

#: dynamic dims of warm-up inputs where the config gives no ``warmup_dims``.
WARMUP_DIM = 32


def warmup_inputs(signature: ModelSignature, cfg: ModelConfig, rows: int = 1) -> dict[str, np.ndarray]:
    """Zero inputs of ``rows`` rows; dynamic dims take ``warmup_dims`` from the config, else 32."""
    declared = {i.name: i.warmup_dims for i in cfg.inputs}
    out = {}
    for spec in signature.inputs:
        wd = declared.get(spec.name)
        dims = [d if d != -1 else (wd[k] if wd and k < len(wd) else WARMUP_DIM) for k, d in enumerate(spec.shape[1:])]
        dtype = NUMPY_DTYPES[spec.datatype]
        out[spec.name] = (np.full((rows, *dims), b"", dtype=object) if spec.datatype == "BYTES"
                          else np.zeros((rows, *dims), dtype=dtype))
    return out


@dataclass
class Duration:
    """A count and a total duration, as Triton's statistics extension reports them (``{"count", "ns"}``)."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, n: int = 1) -> None:
        self.count += n
        self.ns += int(seconds * 1e9)

    def json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class Stats:
    """Cumulative per-model statistics for ``GET /v2/models/{m}/stats`` (Triton's statistics extension).

    Updated on the event loop only. ``success``/``fail`` time whole requests from arrival to answer; ``queue``
    times the wait for a batch; compute phases are per request (each request of a batch is charged the batch's
    phase time, as Triton does).
    """

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    #: batch size -> executions and their phase times
    batches: dict[int, list[Duration]] = field(default_factory=dict)

    def batch(self, rows: int, requests: int, t_input: float, t_infer: float, t_output: float) -> None:
        self.inference_count += rows
        self.execution_count += 1
        self.compute_input.add(t_input * requests, requests)
        self.compute_infer.add(t_infer * requests, requests)
        self.compute_output.add(t_output * requests, requests)
        per = self.batches.setdefault(rows, [Duration(), Duration(), Duration()])
        for d, t in zip(per, (t_input, t_infer, t_output)):
            d.add(t)


#: weight of the newest gap in the moving average of inter-arrival times.
GAP_EWMA_ALPHA = 0.2


def worth_waiting(mean_gap_s: float, delay_s: float) -> bool:
    """Whether holding a batch open for up to ``delay_s`` is likely to gather another request.

    The adaptive part of the batch window: when requests arrive on average more than two windows apart, a lone
    request would almost always wait the whole window for nothing (Triton waits anyway), so it runs at once. At
    load, gaps shrink below the window and batches form as configured.
    """
    return delay_s > 0 and mean_gap_s < 2 * delay_s


def request_deadline(received: float, timeout_us: int | None, default_timeout_s: float | None) -> float | None:
    """A request's deadline (event-loop seconds): its ``parameters.timeout`` (microseconds), else the model's
    default timeout, counted from ``received``; None when neither is set."""
    if timeout_us:
        return received + timeout_us / 1e6
    if default_timeout_s:
        return received + default_timeout_s
    return None


class ModelRunner:
    """One model version being served: its contexts, executor threads, queue and batcher task.

    Create with :meth:`start` (loads nothing; takes a loaded engine) and stop with :meth:`close`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        engine: Engine,
        contexts: Sequence[ExecutionContext],
        signature: ModelSignature,
        metrics: ModelMetrics,
    ) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.version = str(cfg.version)
        self.engine = engine
        self.signature = signature
        self.metrics = metrics
        self._contexts = list(contexts)
        self._executors = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{cfg.name}-ctx{i}") for i in range(len(contexts))
        ]
        self._idle: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(contexts)):
            self._idle.put_nowait(i)
        self._queue: list[Pending] = []
        self._depth = 0
        self._wakeup = asyncio.Event()
        db = cfg.dynamic_batching
        self._delay_s = db.max_queue_delay_microseconds / 1e6
        self._last_arrival: float | None = None
        self._queued_rows = 0
        self._executing_rows = 0
        self._row_s: float | None = None  # moving average of execution seconds per row
        levels = db.priority_levels
        self._default_level = db.default_priority_level or (levels + 1) // 2
        self._starve_s = db.max_priority_wait_microseconds / 1e6 if levels > 1 else None
        # moving average of the time between arrivals (s, each gap capped at 1 s); it starts at 0, "busy", so that
        # a first burst batches; slow arrivals raise it within a few requests
        self._gap_s = 0.0
        self._max_batch = signature.max_batch_size
        self._preferred = tuple(db.preferred_batch_size)
        self._adaptive = db.adaptive_queue_delay
        self._loop = asyncio.get_running_loop()
        self._running: set[asyncio.Future] = set()
        self._closing = False
        self.stats = Stats()
        self._task = asyncio.create_task(self._batcher(), name=f"batcher-{cfg.name}")

    # ------------------------------------------------------------------ submit
    @property
    def queue_depth(self) -> int:
        """Requests waiting in the queue (not yet in an executing batch)."""
        return self._depth

    def validate(self, inputs: dict[str, np.ndarray], output_names: Sequence[str] = ()) -> int:
        """Check a request against the signature; returns its rows. Raises InvalidInput (400)."""
        rows = self.signature.check(self.name, inputs)
        if output_names:
            self.signature.check_outputs(self.name, output_names)
        return rows

    async def infer(
        self, inputs: dict[str, np.ndarray], *, rows: int, received: float, deadline: float | None = None,
        priority: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Queue one validated request and wait for its outputs.

        Args:
            inputs: validated inputs (see :meth:`validate`), first dim ``rows``.
            received: event-loop time (s, monotonic) the request arrived.
            deadline: event-loop time after which it must not start executing (:func:`request_deadline`).
            priority: priority level 1..priority_levels (1 first); None: the model's default level.

        Returns:
            the request's rows of every output.

        Raises:
            InvalidInput: priority outside 1..priority_levels (400). Unavailable: queue full, model closing, or
            (admission control) the rows ahead cannot drain before the deadline (503 + Retry-After from the
            estimated drain time). DeadlineExceeded: deadline passed before execution (504). ExecutionFailed:
            engine error for its batch (500).
        """
        m = self.metrics
        try:
            if self._closing:
                raise Unavailable(f"model '{self.name}' is shutting down")
            if self._depth >= self.cfg.max_queue_size:
                raise Unavailable(
                    f"model '{self.name}' queue is full ({self._depth} of max_queue_size {self.cfg.max_queue_size})"
                )
            if priority is None:
                level = self._default_level
            elif 1 <= priority <= self.cfg.dynamic_batching.priority_levels:
                level = priority
            else:
                raise InvalidInput(f"model '{self.name}': priority {priority} is outside 1..{self.cfg.dynamic_batching.priority_levels}")
            if deadline is not None and self.cfg.dynamic_batching.admission_control:
                self._admit(rows, deadline)
            p = Pending(inputs, rows, shape_key(inputs), received, deadline, self._loop.create_future(),
                        priority=level)
            if self._last_arrival is not None:
                self._gap_s += GAP_EWMA_ALPHA * (min(received - self._last_arrival, 1.0) - self._gap_s)
            self._last_arrival = received
            if deadline is not None:
                if deadline <= self._loop.time():
                    raise DeadlineExceeded(f"model '{self.name}': deadline passed before the request was queued")
                p.timer = self._loop.call_at(deadline, self._expire, p)
            self._queue.append(p)
            self._queued_rows += rows
            self._set_depth(self._depth + 1)
            self._wakeup.set()
            try:
                result = await p.future
            except asyncio.CancelledError:
                if p.state is State.QUEUED:  # client went away while queued: never execute it
                    self._settle_queued(p)
                m.fail("canceled")
                raise
        except BatcherError as exc:
            m.fail(exc.reason)
            self.stats.fail.add(self._loop.time() - received)
            raise
        elapsed = self._loop.time() - received
        m.success.inc()
        m.request_duration.observe(elapsed)
        self.stats.success.add(elapsed)
        self.stats.last_inference_ms = int(time.time() * 1e3)
        return result

    def drain_seconds(self) -> float | None:
        """Estimated time until a newly queued request would start executing: the rows queued and executing
        ahead of it, at the measured seconds per row, spread over the instances. None before any batch ran."""
        if self._row_s is None:
            return None
        ahead = self._queued_rows + self._executing_rows
        return ahead * self._row_s / len(self._contexts) if ahead else 0.0

    def _admit(self, rows: int, deadline: float) -> None:
        drain = self.drain_seconds()
        if drain is None:
            return
        now = self._loop.time()
        if now >= deadline:
            raise DeadlineExceeded(f"model '{self.name}': deadline passed before the request was queued")
        # finished in time = the rows ahead drained and its own rows executed before the deadline
        if now + drain + rows * self._row_s / len(self._contexts) > deadline:
            raise Unavailable(
                f"model '{self.name}': the {self._queued_rows + self._executing_rows} rows ahead need about "
                f"{drain * 1e3:.0f} ms, beyond this request's deadline in {(deadline - now) * 1e3:.0f} ms",
                retry_after_s=max(1, math.ceil(drain)),
            )

    def _set_depth(self, n: int) -> None:
        self._depth = n
        self.metrics.queue_depth.set(n)

    def _settle_queued(self, p: Pending) -> None:
        """Take a QUEUED request out of the queue's count (it stays in the list until the next purge)."""
        p.state = State.DONE
        if p.timer is not None:
            p.timer.cancel()
        self._queued_rows -= p.rows
        self._set_depth(self._depth - 1)

    def _expire(self, p: Pending) -> None:
        """A request's deadline timer: answer 504 now, whether it is still queued (it will never run) or its batch
        is executing (its rows will be discarded): no answer is sent after a deadline."""
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
                DeadlineExceeded(f"model '{self.name}': deadline expired after {waited_ms:.1f} ms {where}")
            )

    # ------------------------------------------------------------------ batcher
    async def _batcher(self) -> None:
        while True:
            idx = await self._idle.get()
            try:
                batch = await self._next_batch()
            except asyncio.CancelledError:
                self._idle.put_nowait(idx)
                raise
            now = self._loop.time()
            for p in batch:
                p.state = State.EXECUTING  # its deadline timer stays armed (see _expire)
                self.metrics.queue_duration.observe(now - p.arrival)
                self.stats.queue.add(now - p.arrival)
            self._set_depth(self._depth - len(batch))
            rows = sum(p.rows for p in batch)
            self._queued_rows -= rows
            self._executing_rows += rows
            fut = self._loop.run_in_executor(self._executors[idx], self._execute, self._contexts[idx], batch)
            self._running.add(fut)
            fut.add_done_callback(partial(self._finish, idx, batch))

    async def _next_batch(self) -> list[Pending]:
        while True:
            self._wakeup.clear()
            if len(self._queue) > 2 * self._depth + 16:  # drop settled entries now and then
                self._queue = [p for p in self._queue if p.state is State.QUEUED]
            now = self._loop.time()
            batch, rows = plan_batch(self._queue, self._max_batch, now, self._starve_s)
            if batch:
                wait = min(p.arrival for p in batch) + self._delay_s - now
                deadlines = [p.deadline for p in batch if p.deadline is not None]
                if deadlines and self._row_s is not None:  # close the window early for a deadline that needs it
                    wait = min(wait, min(deadlines) - now - rows * self._row_s)
                if (wait <= 0 or batch_is_full(rows, self._max_batch, self._preferred)
                        or (self._adaptive and not worth_waiting(self._gap_s, self._delay_s))):
                    taken = set(map(id, batch))
                    self._queue = [p for p in self._queue if id(p) not in taken and p.state is State.QUEUED]
                    return batch
                try:
                    await asyncio.wait_for(self._wakeup.wait(), wait)
                except asyncio.TimeoutError:
                    pass
            else:
                await self._wakeup.wait()

    def _execute(self, ctx: ExecutionContext, batch: list[Pending]) -> tuple[list, tuple[float, float, float], int]:
        """Runs in the context's executor thread.

        Returns:
            per-request outcomes (output dict or BatcherError) in batch order, the seconds spent stacking
            inputs, executing and splitting outputs, and the rows executed.
        """
        now = time.monotonic()
        # a request that would finish after its deadline is not run (its answer would be a 504 anyway): the work
        # goes to requests that can still make it
        row_s = self._row_s
        finish = now + (sum(p.rows for p in batch) * row_s if row_s is not None else 0.0)
        live = [p for p in batch if p.deadline is None or finish < p.deadline]
        results: dict[int, object] = {}
        for p in batch:
            if p.deadline is not None and finish >= p.deadline:
                results[id(p)] = DeadlineExceeded(
                    f"model '{self.name}': deadline expired, or would before execution finished; not executed")
        rows = sum(p.rows for p in live)
        t0 = t1 = t2 = t3 = 0.0
        if live:
            t0 = time.perf_counter()
            try:
                stacked = stack_inputs(live, ctx.host_buffer)
                t1 = time.perf_counter()
                outputs = ctx.execute(stacked)
                t2 = time.perf_counter()
                parts = split_outputs(outputs, [p.rows for p in live])
            except WorkerCrashed as exc:  # the batch is lost with the worker; the next one restarts it
                err = Unavailable(f"model '{self.name}': {exc}", retry_after_s=1)
                parts = [err] * len(live)
                t1 = t2 = t1 or time.perf_counter()
            except (EngineError, ValueError) as exc:
                err = ExecutionFailed(f"model '{self.name}' failed on a batch of {rows} rows: {exc}")
                parts = [err] * len(live)
                t1 = t2 = t1 or time.perf_counter()
            t3 = time.perf_counter()
            for p, part in zip(live, parts):
                results[id(p)] = part
        return [results[id(p)] for p in batch], (t1 - t0, t2 - t1, t3 - t2), rows

    def _finish(self, idx: int, batch: list[Pending], fut: asyncio.Future) -> None:
        self._running.discard(fut)
        self._idle.put_nowait(idx)
        self._executing_rows -= sum(p.rows for p in batch)
        if fut.cancelled():
            outcomes: list = [Unavailable(f"model '{self.name}' is shutting down")] * len(batch)
        elif fut.exception() is not None:  # a bug, not an engine error: fail the batch, keep serving
            log.error("model %s: batch failed", self.name, exc_info=fut.exception())
            outcomes = [ExecutionFailed(f"model '{self.name}': {fut.exception()!r}")] * len(batch)
        else:
            outcomes, (t_input, t_infer, t_output), rows = fut.result()
            if rows:
                m = self.metrics
                m.execution_count.inc()
                m.inference_count.inc(rows)
                m.batch_size.observe(rows)
                m.compute_duration.observe(t_input + t_infer + t_output)
                m.compute_input.inc(t_input)
                m.compute_infer.inc(t_infer)
                m.compute_output.inc(t_output)
                self.stats.batch(rows, len(batch), t_input, t_infer, t_output)
                row_s = (t_input + t_infer + t_output) / rows
                self._row_s = row_s if self._row_s is None else self._row_s + 0.2 * (row_s - self._row_s)
        for p, out in zip(batch, outcomes):
            p.state = State.DONE
            if p.timer is not None:
                p.timer.cancel()
            if p.future.done():  # client went away or deadline passed: its rows are discarded
                continue
            if isinstance(out, BaseException):
                p.future.set_exception(out)
            else:
                p.future.set_result(out)

    # ------------------------------------------------------------------ lifecycle
    async def close(self) -> None:
        """Stop batching, answer queued requests 503, finish executing batches, release contexts and engine."""
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
        for ex in self._executors:
            ex.shutdown(wait=True)
        for ctx in self._contexts:
            ctx.release()
        self.engine.release()
