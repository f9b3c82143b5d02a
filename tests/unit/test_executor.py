"""execute_batch: a batch the engine fails on is run again request by request, so only the request at fault fails.
ThreadExecutor's hand-off: a context whose batches cost less CPU than the hand-off runs them on the event loop
(``server.inline_execution_us``), a costly batch sends the next ones back to the thread, and contexts that must
stay on their own thread never run inline."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from fakes import FakeContext, rows

from batcher.batching import Pending, shape_key
from batcher.errors import ExecutionFailed, InvalidInput
from batcher.batch_steps import BatchResult, execute_batch
from batcher.executor import INLINE_AFTER, LEAVE_FACTOR, PROBE_EVERY, PROBE_FACTOR, ThreadExecutor
from engines.base import EngineError, EngineInputError


class PickyContext(FakeContext):
    """``y = 2 * x``, but a batch holding a row of -1 fails with ``error`` (as a string-parsing model fails on text
    it cannot parse)."""

    def __init__(self, error: type[EngineError]) -> None:
        super().__init__()
        self.error = error

    def execute(self, inputs):
        if (inputs["x"] == -1).any():
            self.batches.append(-inputs["x"].shape[0])
            raise self.error("cannot parse -1")
        return super().execute(inputs)


def _pending(value: float, n: int = 1) -> Pending:
    inputs = rows(n, value)
    return Pending(inputs, n, shape_key(inputs), arrival=0.0)


def test_one_bad_request_fails_alone_and_its_batch_mates_get_their_outputs():
    ctx = PickyContext(EngineInputError)
    batch = [_pending(1.0), _pending(-1.0), _pending(3.0, n=2)]
    result = execute_batch(ctx, batch, "m", None, now=lambda: 0.0)
    good0, bad, good2 = result.outcomes
    np.testing.assert_array_equal(good0["y"], np.full((1, 4), 2.0, np.float32))
    np.testing.assert_array_equal(good2["y"], np.full((2, 4), 6.0, np.float32))
    assert isinstance(bad, InvalidInput) and "cannot run on this request's input: cannot parse -1" in bad.message
    assert ctx.batches == [-4, 1, -1, 2]  # the batch, then each request alone
    assert result.rows == 4


def test_an_engine_failure_that_is_not_the_input_is_a_500_for_the_request_that_fails():
    ctx = PickyContext(EngineError)
    outcomes = execute_batch(ctx, [_pending(-1.0)], "m", None, now=lambda: 0.0).outcomes
    assert isinstance(outcomes[0], ExecutionFailed) and outcomes[0].status == 500
    assert ctx.batches == [-1]  # a batch of one is not run twice


def test_an_engine_failure_is_a_warning_once_per_interval_per_model_with_the_count_left_out(caplog, monkeypatch):
    """A 500 from the engine was answered without any log line (a new user's report): the operator now sees a
    WARNING, at most one per 10 s per model (a client can repeat the request), telling how many were left out."""
    from batcher import lograte
    from batcher.lograte import EveryFewSeconds

    now = [0.0]
    monkeypatch.setattr(lograte, "_due",
                        {("engine failure", m): EveryFewSeconds(10.0, clock=lambda: now[0]) for m in ("m", "n")})
    ctx = PickyContext(EngineError)
    with caplog.at_level("WARNING", logger="batcher.batch_steps"):
        for t in (0.0, 1.0, 9.9, 10.0):
            now[0] = t
            execute_batch(ctx, [_pending(-1.0)], "m", None, now=lambda: 0.0)
        execute_batch(ctx, [_pending(-1.0)], "n", None, now=lambda: 0.0)
    assert [r.getMessage() for r in caplog.records] == [
        "model 'm' failed on a batch of 1 rows: cannot parse -1 (0 more engine failures of this model since the "
        "last warning)",
        "model 'm' failed on a batch of 1 rows: cannot parse -1 (2 more engine failures of this model since the "
        "last warning)",
        "model 'n' failed on a batch of 1 rows: cannot parse -1 (0 more engine failures of this model since the "
        "last warning)"]
    assert {r.levelname for r in caplog.records} == {"WARNING"}

def batch(ctx, threads: list[int], burn_s: float = 0.0) -> BatchResult:
    """A batch function: records the thread it ran on; ``burn_s`` of CPU time."""
    threads.append(threading.get_ident())
    end = time.thread_time() + burn_s
    while time.thread_time() < end:
        pass
    return BatchResult([{}], (0.0, 0.0, 0.0), rows=1)


async def test_cheap_batches_move_to_the_event_loop_and_a_costly_one_moves_them_back():
    ex = ThreadExecutor(FakeContext(), "t", inline_s=100e-6)
    loop_thread = threading.get_ident()
    threads: list[int] = []
    for _ in range(INLINE_AFTER):
        await ex.submit(batch, threads)
    assert loop_thread not in threads  # measured in the context's thread first
    assert ex.inline
    await ex.submit(batch, threads)
    assert threads[-1] == loop_thread  # cheap: no hand-off any more
    await ex.submit(batch, threads, 0.005)  # one batch 50x the bound (a new shape, say) runs inline once...
    assert not ex.inline
    await ex.submit(batch, threads)
    assert threads[-1] != loop_thread  # ...and the next ones go back to the thread
    ex.close()


async def test_an_inline_context_stays_inline_until_its_average_passes_leave_factor_times_the_bound():
    """Hysteresis: a context running inline whose average drifts over the bound (but under LEAVE_FACTOR x) keeps
    running inline; a context on its thread comes back only at the bound."""
    ex = ThreadExecutor(FakeContext(), "t", inline_s=100e-6)
    loop_thread = threading.get_ident()
    threads: list[int] = []
    for _ in range(INLINE_AFTER + 1):
        await ex.submit(batch, threads)
    assert threads[-1] == loop_thread
    for _ in range(30):  # 150 us a batch inline: the average climbs over the bound, stays under 2x
        await ex.submit(batch, threads, 150e-6)
    assert threads[-30:] == [loop_thread] * 30 and 100e-6 < ex._on_loop[1] < LEAVE_FACTOR * 100e-6
    assert ex.inline
    for _ in range(20):  # 300 us a batch: over LEAVE_FACTOR x the bound, back to the thread
        await ex.submit(batch, threads, 300e-6)
    assert threads[-1] != loop_thread and not ex.inline
    while threads[-1] != loop_thread:  # on the thread: the next inline batch is a probe...
        await ex.submit(batch, threads, 150e-6)
    assert not ex.inline  # ...at 150 us: over the bound, so it does not come back (no re-entry above the bound)
    ex.close()


async def test_a_shape_not_measured_cheap_runs_on_the_thread_even_when_the_context_runs_inline():
    """A model with dynamic dims: its small batches run inline, and the first batch of a new shape goes to the
    thread (where a 5500x5500 MatMul once held the event loop for seconds: a new user's report). A new shape that
    costs little there runs inline from its next batch; one that costs more than PROBE_FACTOR x the bound never."""
    ex = ThreadExecutor(FakeContext(), "t", inline_s=100e-6)
    loop_thread = threading.get_ident()
    threads: list[int] = []
    for _ in range(INLINE_AFTER + 2):  # the shape's first batch, then INLINE_AFTER measured on the thread
        await ex.submit(batch, threads, key="4x4")
    assert threads[-1] == loop_thread  # small, cheap: inline
    await ex.submit(batch, threads, 0.02, key="5500x5500")  # 20 ms: a shape never seen
    assert threads[-1] != loop_thread
    for _ in range(3):
        await ex.submit(batch, threads, 0.02, key="5500x5500")
        assert threads[-1] != loop_thread  # measured far over the bound: never inline
    await ex.submit(batch, threads, key="4x4")
    assert threads[-1] == loop_thread  # the cheap shape still runs inline
    await ex.submit(batch, threads, key="8x8")  # new, cheap on the thread...
    assert threads[-1] != loop_thread
    await ex.submit(batch, threads, key="8x8")
    assert threads[-1] == loop_thread  # ...then inline
    ex.close()


async def test_no_inline_execution_when_disabled_or_when_the_context_owns_its_thread():
    threads: list[int] = []
    never = ThreadExecutor(FakeContext(), "t", inline_s=0.0)
    for _ in range(INLINE_AFTER + 4):
        await never.submit(batch, threads)
    assert threading.get_ident() not in threads and not never.inline
    never.close()

    owned = OwnThreadContext()  # a CUDA-graph context: its batches run on its own thread
    bound = ThreadExecutor(owned, "t", inline_s=1.0)
    for _ in range(INLINE_AFTER + 4):
        await bound.submit(batch, threads)
    assert not bound.inline and threading.get_ident() not in threads
    owned.executor.shutdown()


class OwnThreadContext(FakeContext):
    def __init__(self) -> None:
        super().__init__()
        self._executor = ThreadPoolExecutor(max_workers=1)

    @property
    def executor(self) -> ThreadPoolExecutor:
        return self._executor


def test_onnxruntime_failing_on_an_input_with_a_dimension_of_size_0_is_the_inputs_fault():
    """engines.onnxruntime.cpu.run_failure, shared by the CPU and CUDA sessions contexts: a 400 for a dimension of
    size 0 (what the model's dynamic dims admit and its operators refuse), else a 500; one line either way."""
    from engines.onnxruntime.cpu import run_failure

    exc = RuntimeError("INVALID_ARGUMENT :\nInvalid input shape: {0,32}")
    empty = run_failure(exc, {"x": np.ones((1, 3, 0, 32), np.float32)}, "onnxruntime (cuda)")
    assert isinstance(empty, EngineInputError)
    assert str(empty) == ("onnxruntime (cuda) cannot run on an input with a dimension of size 0: INVALID_ARGUMENT : "
                          "Invalid input shape: {0,32}")
    other = run_failure(exc, {"x": np.ones((1, 3, 32, 32), np.float32)})
    assert type(other) is EngineError and str(other) == "onnxruntime: INVALID_ARGUMENT : Invalid input shape: {0,32}"


def dearer_on_thread(ctx, threads: list[int], loop_thread: int, inline_s: float, thread_s: float) -> BatchResult:
    """A batch of ``inline_s`` CPU on the event loop and ``thread_s`` on the context's thread (where its CPU time also
    holds the GIL's hand-offs to and from a busy event loop)."""
    return batch(ctx, threads, inline_s if threading.get_ident() == loop_thread else thread_s)


async def test_a_batch_dearer_on_its_thread_is_probed_inline_and_moves_there_when_cheap_there():
    ex = ThreadExecutor(FakeContext(), "t", inline_s=100e-6)
    loop_thread = threading.get_ident()
    threads: list[int] = []
    for _ in range(INLINE_AFTER):  # 300 us on the thread: over the bound, within PROBE_FACTOR of it
        await ex.submit(dearer_on_thread, threads, loop_thread, 20e-6, 300e-6)
    assert loop_thread not in threads and not ex.inline
    await ex.submit(dearer_on_thread, threads, loop_thread, 20e-6, 300e-6)
    assert threads[-1] == loop_thread  # the probe: measured inline at 20 us...
    assert ex.inline
    for _ in range(3):
        await ex.submit(dearer_on_thread, threads, loop_thread, 20e-6, 300e-6)
    assert threads[-3:] == [loop_thread] * 3  # ...so the next batches stay on the event loop
    ex.close()


async def test_a_batch_dear_inline_too_goes_back_to_the_thread_and_one_far_over_the_bound_is_never_probed():
    loop_thread = threading.get_ident()
    threads: list[int] = []
    dear = ThreadExecutor(FakeContext(), "t", inline_s=100e-6)
    for _ in range(INLINE_AFTER + 1):  # 300 us on the thread and 2 ms inline
        await dear.submit(dearer_on_thread, threads, loop_thread, 2e-3, 300e-6)
    assert threads[-1] == loop_thread and not dear.inline  # probed once: over the bound inline too
    for _ in range(PROBE_EVERY):
        await dear.submit(dearer_on_thread, threads, loop_thread, 2e-3, 300e-6)
    assert loop_thread not in threads[-PROBE_EVERY:]  # back on the thread until the next probe
    await dear.submit(dearer_on_thread, threads, loop_thread, 2e-3, 300e-6)
    assert threads[-1] == loop_thread and not dear.inline  # probed again, still over the bound
    dear.close()

    threads.clear()
    far = ThreadExecutor(FakeContext(), "t", inline_s=100e-6)
    for _ in range(INLINE_AFTER + 3 * PROBE_EVERY):  # beyond PROBE_FACTOR x the bound on the thread: no probe
        await far.submit(dearer_on_thread, threads, loop_thread, 20e-6, PROBE_FACTOR * 100e-6 + 200e-6)
    assert loop_thread not in threads and not far.inline
    far.close()
