"""Executors: the thread that owns one execution context, and what it does with one batch.

:func:`execute_batch` runs in the context's own thread (never on the event loop): it drops requests that would
finish after their deadline, stacks the rest (into the context's pinned staging buffer where it has one), padded
with zero rows up to the smallest allowed batch size that holds them, runs the engine once, drops the padding rows
of the outputs and splits the rest into per-request views. It never raises: every request of the batch gets an
outcome, outputs or a :class:`~batcher.errors.BatcherError`.

:class:`ThreadExecutor` is the production hand-off: one single-thread pool per context, so a context is used by
one thread at a time as the engine contract requires. The scheduler only needs ``submit(fn, *args) -> awaitable``
and ``close()``, so tests can hand it an executor that runs batches inline on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from engines.base import EngineError, EngineInputError, EngineUnavailable, ExecutionContext

from .batch_sizes import padded_size
from .batching import Pending, split_outputs, stack_inputs
from .errors import BatcherError, DeadlineExceeded, ExecutionFailed, InvalidInput, Unavailable


@dataclass
class BatchResult:
    """What one batch came to.

    Attributes:
        outcomes: per request, in batch order: its outputs (dict of views) or the BatcherError to answer with.
        times: seconds spent stacking inputs, executing, splitting outputs (0.0 each when nothing ran).
        rows: the requests' rows executed (requests dropped before execution excluded).
        padded_rows: zero rows added to reach an allowed batch size (executed, never answered).
    """

    outcomes: list[dict | BatcherError]
    times: tuple[float, float, float]
    rows: int
    padded_rows: int = 0


def execute_batch(ctx: ExecutionContext, batch: Sequence[Pending], model: str, batch_s: float | None,
                  now: Callable[[], float] = time.monotonic, allowed: Sequence[int] | None = None) -> BatchResult:
    """Run one batch on ``ctx`` (blocking; call it from the context's thread).

    Args:
        batch: the requests, their inputs validated and of one shape key.
        model: the model's name, for messages.
        batch_s: the estimated seconds of this batch (None before the first batch): a request whose deadline falls
            before the batch would finish is not run (its answer would be a 504 anyway), so the work goes to
            requests that can still make it.
        now: the clock deadlines are measured on (the event loop's, ``time.monotonic``).
        allowed: the model's allowed batch sizes (ascending; None: no padding): the rows that run are padded with
            zero rows up to the smallest allowed size that holds them, and those rows' outputs are dropped.
    """
    finish = now() + (batch_s or 0.0)
    results: dict[int, Any] = {}
    live = []
    for p in batch:
        if p.deadline is not None and finish >= p.deadline:
            results[id(p)] = DeadlineExceeded(
                f"model '{model}': deadline expired, or would before execution finished; not executed")
        else:
            live.append(p)
    rows = sum(p.rows for p in live)
    pad = 0
    t0 = t1 = t2 = t3 = 0.0
    if live:
        t0 = time.perf_counter()
        try:
            pad = padded_size(rows, allowed) - rows
            stacked = stack_inputs(live, ctx.host_buffer, rows + pad)
            t1 = time.perf_counter()
            outputs = ctx.execute(stacked)
            t2 = time.perf_counter()
            # the padding rows form a last share that nobody gets; the split checks every output has rows + pad
            parts: list = split_outputs(outputs, [p.rows for p in live] + [pad] * bool(pad))[:len(live)]
        except (EngineError, ValueError) as exc:
            t1 = t2 = t1 or time.perf_counter()
            if len(live) > 1 and not isinstance(exc, EngineUnavailable):
                # one request's data may be what the engine rejected: run each alone so only that one fails
                parts = [_run_alone(ctx, p, model, allowed) for p in live]
            else:
                parts = [_failure(exc, model, rows)] * len(live)
        t3 = time.perf_counter()
        for p, part in zip(live, parts):
            results[id(p)] = part
    return BatchResult([results[id(p)] for p in batch], (t1 - t0, t2 - t1, t3 - t2), rows, pad)


def _failure(exc: Exception, model: str, rows: int) -> BatcherError:
    """The answer for the requests of a batch the engine failed on."""
    if isinstance(exc, EngineUnavailable):  # e.g. the worker process died with the batch; the next one restarts it
        return Unavailable(f"model '{model}': {exc}", retry_after_s=1)
    if isinstance(exc, EngineInputError):  # the request's data (a batch of one, or run alone)
        return InvalidInput(f"model '{model}' cannot run on this request's input: {exc}")
    return ExecutionFailed(f"model '{model}' failed on a batch of {rows} rows: {exc}")


def _run_alone(ctx: ExecutionContext, p: Pending, model: str, allowed: Sequence[int] | None) -> dict | BatcherError:
    """One request of a failed batch, executed on its own (padded like any batch): its outputs, or its failure."""
    pad = padded_size(p.rows, allowed) - p.rows
    try:
        outputs = ctx.execute(stack_inputs([p], ctx.host_buffer, p.rows + pad))
        return split_outputs(outputs, [p.rows] + [pad] * bool(pad))[0]
    except (EngineError, ValueError) as exc:
        return _failure(exc, model, p.rows)


class Executor(Protocol):
    """How the scheduler hands a batch to the owner of one execution context."""

    context: ExecutionContext

    def submit(self, fn: Callable[..., BatchResult], *args: Any) -> Awaitable[BatchResult]:
        """Run ``fn(context, *args)`` where the context lives; the awaitable gives its result."""

    def close(self) -> None:
        """Wait for the running call, then release the context."""


class ThreadExecutor:
    """One execution context and the single thread that uses it (engine contexts are not thread-safe)."""

    def __init__(self, context: ExecutionContext, name: str) -> None:
        self.context = context
        # A context bound to its own thread (a CUDA-graph context) runs its batches there: no hop per batch.
        self._own = context.executor is None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) if self._own else context.executor

    def submit(self, fn: Callable[..., BatchResult], *args: Any) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, self.context, *args)

    def close(self) -> None:
        if self._own:
            self._pool.shutdown(wait=True)
        self.context.release()
