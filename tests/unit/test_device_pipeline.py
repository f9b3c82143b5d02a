"""ThreadExecutor's pipeline for a context that takes two batches on its device at once
(:class:`batcher.device_pipeline.DevicePipeline`): the staging thread hands each staged batch straight to the context's
thread, which launches the next batch before it collects the last one.

The context here is a stand-in that records every launch and collect (``y = 2 * x``); the device thread is held
on a gate while batches are queued, so the order of calls is exact, not a matter of thread timing. The clock of
the execute times is a counter that only a collect advances (one "second" per batch on the device)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from fakes import FakeContext

from batcher.batching import Pending, shape_key
from batcher.errors import DeadlineExceeded, InvalidInput
from batcher.executor import ThreadExecutor
from engines.base import EngineError, EngineInputError


class TwoDeep(FakeContext):
    """``y = 2 * x`` with :meth:`launch` / :meth:`collect` (depth 2) and three staging slots, like a CUDA-graph
    context; ``calls`` records ``("launch", first value)`` and ``("collect", first value)`` in order. A batch
    holding a row of -1 fails at launch (``launch_fails``) or at collect; ``clock`` advances by 1 per collect."""

    pipeline_depth = 2

    def __init__(self) -> None:
        super().__init__(batch_sizes=(1, 2, 4))
        self._staging = [np.full((4, 4), np.nan, np.float32) for _ in range(3)]
        self.staging_slots = 3
        self.calls: list[tuple[str, float]] = []
        self.launched: dict[int, dict] = {}
        self.launch_fails = True
        self.clock = 0.0
        self._ids = iter(range(1000))

    def launch(self, inputs):
        x = inputs["x"]
        if len(self.launched) >= self.pipeline_depth:
            raise EngineError("2 batches launched and not collected")
        if self.launch_fails and (x == -1).any():
            self.calls.append(("launch failed", float(x[0, 0])))
            raise EngineInputError("cannot parse -1")
        self.calls.append(("launch", float(x[0, 0])))
        handle = next(self._ids)
        self.launched[handle] = {"y": x * 2, "bad": bool((x == -1).any())}  # x read at launch, as a DMA would
        return handle

    def collect(self, handle):
        out = self.launched.pop(handle)
        self.clock += 1.0
        self.calls.append(("collect", float(out["y"][0, 0] / 2)))
        if out["bad"]:
            raise EngineInputError("cannot parse -1")
        return {"y": out["y"]}


def _batch(value: float, n: int = 1, requests: int = 1) -> list[Pending]:
    out = []
    for _ in range(requests):
        inputs = {"x": np.full((n, 4), value, np.float32)}
        out.append(Pending(inputs, n, shape_key(inputs), arrival=0.0))
    return out


def _args(batch: list[Pending]) -> tuple:
    return (batch, "m", None, lambda: 0.0, (1, 2, 4), True)


@pytest.fixture
def clock(monkeypatch):
    """Execute times measured on the context's clock (``time.perf_counter`` in batcher.device_pipeline)."""
    holder: dict[str, TwoDeep] = {}
    import batcher.device_pipeline as executor

    monkeypatch.setattr(executor.time, "perf_counter", lambda: holder["ctx"].clock if "ctx" in holder else 0.0)
    return holder


async def _run_held(ex: ThreadExecutor, batches: list[list[Pending]]) -> list:
    """Queue ``batches`` while the context's thread is held, then let it go; their results in order."""
    gate = threading.Event()
    ex._pool.submit(gate.wait)
    futures = [ex.pipeline(_args(b), slot) for slot, b in enumerate(batches)]
    # every batch staged and with the device pipeline before the thread is let go
    await asyncio.get_running_loop().run_in_executor(None, ex._stager.submit(lambda: None).result)
    gate.set()
    return await asyncio.gather(*futures)


async def test_the_next_batch_is_launched_before_the_last_is_collected(clock):
    ctx = TwoDeep()
    clock["ctx"] = ctx
    ex = ThreadExecutor(ctx, "t")
    results = await _run_held(ex, [_batch(1.0), _batch(2.0), _batch(3.0)])
    assert ctx.calls == [("launch", 1.0), ("launch", 2.0), ("collect", 1.0), ("launch", 3.0),
                         ("collect", 2.0), ("collect", 3.0)]
    for value, result in zip((1.0, 2.0, 3.0), results):
        np.testing.assert_array_equal(result.outcomes[0]["y"], np.full((1, 4), 2 * value, np.float32))
        assert result.rows == 1
    # each batch's execute time is its own second on the device, not the one it waited behind the batch before
    assert [r.times[1] for r in results] == [1.0, 1.0, 1.0]
    ex.close()
    assert ctx.released and not ctx.launched


async def test_a_batch_that_fails_at_launch_runs_request_by_request_and_the_others_are_untouched(clock):
    ctx = TwoDeep()
    clock["ctx"] = ctx
    ctx.execute = _picky_execute
    ex = ThreadExecutor(ctx, "t")
    mixed = _batch(5.0) + _batch(-1.0)
    results = await _run_held(ex, [_batch(1.0), mixed, _batch(3.0)])
    assert ctx.calls == [("launch", 1.0), ("launch failed", 5.0), ("launch", 3.0), ("collect", 1.0),
                         ("collect", 3.0)]
    good, bad = results[1].outcomes
    np.testing.assert_array_equal(good["y"], np.full((1, 4), 10.0, np.float32))
    assert isinstance(bad, InvalidInput) and "cannot parse -1" in bad.message
    np.testing.assert_array_equal(results[0].outcomes[0]["y"], np.full((1, 4), 2.0, np.float32))
    np.testing.assert_array_equal(results[2].outcomes[0]["y"], np.full((1, 4), 6.0, np.float32))
    ex.close()


async def test_a_batch_that_fails_on_the_device_is_answered_and_the_next_one_still_arrives(clock):
    ctx = TwoDeep()
    clock["ctx"] = ctx
    ctx.launch_fails = False
    ex = ThreadExecutor(ctx, "t")
    results = await _run_held(ex, [_batch(-1.0), _batch(2.0)])
    assert ctx.calls == [("launch", -1.0), ("launch", 2.0), ("collect", -1.0), ("collect", 2.0)]
    assert isinstance(results[0].outcomes[0], InvalidInput)  # a batch of one is not run again
    np.testing.assert_array_equal(results[1].outcomes[0]["y"], np.full((1, 4), 4.0, np.float32))
    ex.close()


def _picky_execute(inputs):
    """The run-alone fallback's execute: ``y = 2 * x``, failing on a row of -1 as the launch/collect do."""
    if (inputs["x"] == -1).any():
        raise EngineInputError("cannot parse -1")
    return {"y": inputs["x"] * 2}


async def test_a_batch_that_fails_on_the_device_while_another_is_launched_is_rerun_request_by_request(clock):
    ctx = TwoDeep()
    clock["ctx"] = ctx
    ctx.launch_fails = False
    ctx.execute = _picky_execute
    ex = ThreadExecutor(ctx, "t")
    results = await _run_held(ex, [_batch(5.0) + _batch(-1.0), _batch(2.0)])
    # the second batch was launched before the first failed; the first's requests then ran alone
    assert ctx.calls == [("launch", 5.0), ("launch", 2.0), ("collect", 5.0), ("collect", 2.0)]
    good, bad = results[0].outcomes
    np.testing.assert_array_equal(good["y"], np.full((1, 4), 10.0, np.float32))
    assert isinstance(bad, InvalidInput)
    np.testing.assert_array_equal(results[1].outcomes[0]["y"], np.full((1, 4), 4.0, np.float32))
    ex.close()


async def test_a_bug_in_a_context_that_only_executes_fails_its_batch_instead_of_losing_it():
    ctx = FakeContext(batch_sizes=(1, 2, 4))
    ctx.fail = RuntimeError("a bug")  # not an EngineError: run_batch lets it through
    ex = ThreadExecutor(ctx, "t")
    with pytest.raises(RuntimeError, match="a bug"):  # (wait_for: a lost batch fails here instead of hanging)
        await asyncio.wait_for(ex.pipeline(_args(_batch(1.0)), 0), 60)
    after = await ex.pipeline(_args(_batch(2.0)), 1)
    np.testing.assert_array_equal(after.outcomes[0]["y"], np.full((1, 4), 4.0, np.float32))
    ex.close()


async def test_a_bug_in_the_engine_fails_the_batches_on_hand_and_later_batches_still_run(clock):
    ctx = TwoDeep()
    clock["ctx"] = ctx
    real = ctx.collect
    broken = {"once": True}

    def collect(handle):
        if broken.pop("once", False):
            raise RuntimeError("a bug")  # not an EngineError: nothing below the executor expects it
        return real(handle)

    ctx.collect = collect
    ex = ThreadExecutor(ctx, "t")
    gate = threading.Event()
    ex._pool.submit(gate.wait)
    first = [ex.pipeline(_args(_batch(v)), slot) for slot, v in enumerate((1.0, 2.0))]
    await asyncio.get_running_loop().run_in_executor(None, ex._stager.submit(lambda: None).result)
    gate.set()
    outcomes = await asyncio.gather(*first, return_exceptions=True)
    assert [type(o) for o in outcomes] == [RuntimeError, RuntimeError]
    assert not ctx.launched  # their launch slots were given back
    later = await ex.pipeline(_args(_batch(3.0)), 0)
    np.testing.assert_array_equal(later.outcomes[0]["y"], np.full((1, 4), 6.0, np.float32))
    ex.close()


async def test_a_batch_with_nothing_left_to_run_is_answered_without_a_launch():
    ctx = TwoDeep()
    ex = ThreadExecutor(ctx, "t")
    late = _batch(1.0)
    late[0].deadline = -1.0  # passed: dropped at staging
    result = await ex.pipeline(_args(late), 0)
    assert isinstance(result.outcomes[0], DeadlineExceeded) and result.rows == 0
    assert ctx.calls == []
    ex.close()


async def test_a_context_that_only_executes_runs_each_batch_whole_in_order():
    ctx = FakeContext(batch_sizes=(1, 2, 4))  # staging_slots 2, no launch/collect
    ex = ThreadExecutor(ctx, "t")
    assert ex.depth == 2
    results = await _run_held(ex, [_batch(1.0, n=2), _batch(2.0)])
    assert ctx.batches == [2, 1]
    np.testing.assert_array_equal(results[0].outcomes[0]["y"], np.full((2, 4), 2.0, np.float32))
    ex.close()


async def test_batches_queued_behind_a_closing_executor_are_all_settled():
    ctx = TwoDeep()
    ex = ThreadExecutor(ctx, "t")
    futures = [ex.pipeline(_args(_batch(float(v))), slot) for slot, v in enumerate((1, 2, 3))]
    await asyncio.get_running_loop().run_in_executor(None, ex.close)  # waits for staging and the device thread
    results = await asyncio.gather(*futures)
    assert [float(r.outcomes[0]["y"][0, 0]) for r in results] == [2.0, 4.0, 6.0]
    assert not ctx.launched


async def test_the_done_hook_runs_in_the_callback_that_settles_the_batch(clock):
    """``pipeline(..., done=hook)``: the hook sees its batch's future settled and runs before any callback the
    future itself schedules (those run a pass of the event loop later): the scheduler's next batch leaves then."""
    ctx = TwoDeep()
    clock["ctx"] = ctx
    ex = ThreadExecutor(ctx, "t")
    seen: list[tuple[str, float]] = []

    def hook(fut: asyncio.Future) -> None:
        seen.append(("done", float(fut.result().outcomes[0]["y"][0, 0])))

    futures = [ex.pipeline(_args(_batch(v)), slot, done=hook) for slot, v in enumerate((1.0, 2.0))]
    for fut in futures:
        fut.add_done_callback(lambda f: seen.append(("callback", float(f.result().outcomes[0]["y"][0, 0]))))
    await asyncio.gather(*futures)
    await asyncio.sleep(0)
    assert sorted(seen) == [("callback", 2.0), ("callback", 4.0), ("done", 2.0), ("done", 4.0)]  # y = 2 x
    for y in (2.0, 4.0):
        assert seen.index(("done", y)) < seen.index(("callback", y))
    ex.close()
