"""What one batch does on the thread that owns its execution context: two steps that never raise.

:func:`stage_batch` drops requests that would finish after their deadline and stacks the rest (into the context's
pinned staging buffer where it has one), padded with zero rows up to the smallest allowed batch size that holds
them; :func:`run_batch` runs the engine once, drops the padding rows of the outputs and splits the rest into
per-request views (:func:`finish_batch`, which also runs each request alone when a batch of several failed, so only
the one whose data the engine rejected fails). Every request of the batch gets an outcome: outputs or a
:class:`~batcher.errors.BatcherError`. :func:`execute_batch` does both in one call. Who calls them, and on which
thread: :mod:`batcher.executor`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from engines.base import DeviceTimes, EngineError, EngineInputError, EngineUnavailable, ExecutionContext

from .batch_sizes import padded_size
from .batching import Pending, split_outputs, stack_inputs
from .errors import BatcherError, DeadlineExceeded, ExecutionFailed, InvalidInput, Unavailable
from . import lograte

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
