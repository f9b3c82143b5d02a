"""The batcher loop in-process: batch formation, the window, deadlines, priorities, admission, cancel, shutdown.

A fake context computes ``y = 2 * x``; :class:`fakes.SleepExecutor` runs each batch on the event loop and lets it
take ``seconds_per_row`` x rows of virtual time (``looptime``), so every time asserted here is exact.
"""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
from fakes import FakeContext, PipelineExecutor, SleepExecutor, model_config, rows, signature

from batcher.errors import DeadlineExceeded, ExecutionFailed, Unavailable
from batcher.batch_steps import BatchResult
from batcher.metrics import Metrics
from batcher.scheduler import ModelRunner
from batcher.signature import ModelSignature
from engines.base import DeviceTimes, EngineError, EngineUnavailable, TensorSpec

pytestmark = pytest.mark.looptime


def runner(*, contexts: int = 1, seconds_per_row: float = 0.001, max_batch_size: int = 8, **batching):
    cfg = model_config(max_batch_size=max_batch_size, dynamic_batching=batching)
    ctxs = [FakeContext() for _ in range(contexts)]
    execs = [SleepExecutor(c, seconds_per_row=seconds_per_row) for c in ctxs]
    metrics = Metrics()
    r = ModelRunner(cfg, signature(max_batch_size), execs, metrics.for_model("m", "1"))
    return r, ctxs, execs, metrics


def submit(r: ModelRunner, n: int = 1, *, value: float = 1.0, timeout_s: float | None = None,
           priority: int | None = None) -> asyncio.Task:
    now = asyncio.get_running_loop().time()
    return asyncio.ensure_future(r.infer(rows(n, value), rows=n, received=now,
                                         deadline=None if timeout_s is None else now + timeout_s, priority=priority))


def now() -> float:
    return asyncio.get_running_loop().time()


async def test_outputs_go_back_to_their_requests_exactly():
    r, ctxs, _, _ = runner(max_queue_delay_microseconds=1000)
    tasks = [submit(r, n, value=float(i)) for i, n in enumerate([1, 3, 2])]
    outs = await asyncio.gather(*tasks)
    assert ctxs[0].batches == [6]
    for i, (n, out) in enumerate(zip([1, 3, 2], outs)):
        np.testing.assert_array_equal(out["y"], np.full((n, 4), 2.0 * i, np.float32))
    await r.close()


async def test_the_window_holds_the_first_request_for_others_as_triton_does():
    """Issue 11: 10 ms window, one second idle, two requests 3 ms apart: one batch of two, sent at 10 ms."""
    r, ctxs, _, _ = runner(max_queue_delay_microseconds=10_000)
    await submit(r)  # some history, then a quiet second
    await asyncio.sleep(1.0)
    t0 = now()
    first = submit(r)
    await asyncio.sleep(0.003)
    second = submit(r)
    await asyncio.gather(first, second)
    assert ctxs[0].batches == [1, 2]
    assert now() - t0 == pytest.approx(0.010 + 2 * 0.001)  # window, then 2 rows of execution
    await r.close()


async def test_adaptive_queue_delay_runs_a_lone_request_at_once_at_low_load():
    r, ctxs, _, _ = runner(max_queue_delay_microseconds=10_000, adaptive_queue_delay=True)
    for _ in range(12):  # sparse arrivals: the average gap grows past two windows
        await submit(r)
        await asyncio.sleep(1.0)
    t0 = now()
    await submit(r)
    assert now() - t0 == pytest.approx(0.001)  # no window: execution only
    await r.close()


async def test_a_batch_goes_at_max_batch_size_or_the_largest_preferred_size_without_waiting():
    r, ctxs, _, _ = runner(max_queue_delay_microseconds=1_000_000, max_batch_size=4)
    t0 = now()
    await asyncio.gather(*(submit(r) for _ in range(4)))
    assert ctxs[0].batches == [4] and now() - t0 == pytest.approx(0.004)
    await r.close()
    r, ctxs, _, _ = runner(max_queue_delay_microseconds=1_000_000, preferred_batch_size=[2, 3])
    t0 = now()
    await asyncio.gather(*(submit(r) for _ in range(3)))
    assert ctxs[0].batches == [3] and now() - t0 == pytest.approx(0.003)
    await r.close()


async def _done_at(tasks: list[asyncio.Task]) -> list[float]:
    """The loop time at which each task finished, in the tasks' order."""
    ends: dict[asyncio.Task, float] = {}
    for t in tasks:
        t.add_done_callback(lambda t: ends.setdefault(t, now()))
    await asyncio.gather(*tasks)
    return [ends[t] for t in tasks]


async def test_preferred_sizes_send_the_largest_reachable_one_at_once_and_the_rest_waits_as_triton_does():
    """Triton's GetDynamicBatch: 10 rows queued, preferred [4, 8], max 16: a batch of 8 goes at once, not 10; the
    other 2 wait out the window (counted from their arrival), or go at once when arrivals make a preferred size."""
    r, ctxs, _, _ = runner(contexts=2, max_batch_size=16, max_queue_delay_microseconds=10_000,
                           preferred_batch_size=[4, 8])
    t0 = now()
    ends = await _done_at([submit(r) for _ in range(10)])
    assert ctxs[0].batches == [8] and ctxs[1].batches == [2]
    assert ends == pytest.approx([t0 + 0.008] * 8 + [t0 + 0.010 + 0.002] * 2)  # 8 at once; 2 at the window's end
    t0 = now()
    first = [submit(r) for _ in range(10)]
    await asyncio.sleep(0.003)
    more = [submit(r) for _ in range(2)]  # the 2 left over and these 2 make 4, a preferred size: at once
    ends = await _done_at(first + more)
    assert ctxs[0].batches[1:] == [8] and ctxs[1].batches[1:] == [4]
    assert ends == pytest.approx([t0 + 0.008] * 8 + [t0 + 0.003 + 0.004] * 4)
    await r.close()


async def test_a_batch_end_sends_the_next_preferred_batch_at_once():
    """One context, 20 rows queued at once, preferred [4, 8], max 16, 1 s window: 8, then 8 at the first batch's end
    (its callback, :meth:`ModelRunner._dispatch_full`), then the last 4 (a preferred size) without waiting."""
    r, ctxs, _, _ = runner(max_batch_size=16, max_queue_delay_microseconds=1_000_000, preferred_batch_size=[4, 8])
    t0 = now()
    ends = await _done_at([submit(r) for _ in range(20)])
    assert ctxs[0].batches == [8, 8, 4] and ends[-1] == pytest.approx(t0 + 0.020)
    await r.close()


async def test_preferred_sizes_count_rows_of_whole_requests_as_triton_does():
    """Multi-row requests, preferred [4, 8], max 16, 10 ms window. 2 + 2 + 3 rows: 4 is reachable and goes at once,
    the 3 rows wait the window. 3 + 3 + 3 rows: no preferred size is reachable, and taking the third request would
    pass the largest one, so the 6 rows before it go at once (Triton's ``best_preferred_batch_size = pending``)."""
    for sizes, first, rest in (([2, 2, 3], 4, 3), ([3, 3, 3], 6, 3)):
        r, ctxs, _, _ = runner(contexts=2, max_batch_size=16, max_queue_delay_microseconds=10_000,
                               preferred_batch_size=[4, 8])
        t0 = now()
        ends = await _done_at([submit(r, n) for n in sizes])
        assert (ctxs[0].batches, ctxs[1].batches) == ([first], [rest]), sizes
        assert ends[-1] == pytest.approx(t0 + 0.010 + rest * 0.001) and ends[0] == pytest.approx(t0 + first * 0.001)
        await r.close()


async def test_when_the_window_has_expired_triton_sends_the_largest_batch_up_to_max_batch_size():
    """No preferred size reachable (3 rows, preferred [4, 8]): the batch waits the whole window, then goes as it is.
    Requests that waited out their window behind a busy context go as one batch up to max_batch_size (Triton's
    ``delay_is_exceeded``: the preferred sizes no longer cap it), 16 of the 20 rows, then the other 4."""
    r, ctxs, _, _ = runner(max_batch_size=16, max_queue_delay_microseconds=10_000, preferred_batch_size=[4, 8])
    t0 = now()
    ends = await _done_at([submit(r) for _ in range(3)])
    assert ctxs[0].batches == [3] and ends == pytest.approx([t0 + 0.010 + 0.003] * 3)
    busy = submit(r, 16)  # holds the one context 16 ms
    await asyncio.sleep(0.001)
    waiting = [submit(r) for _ in range(20)]
    await asyncio.gather(busy, *waiting)
    assert ctxs[0].batches == [3, 16, 16, 4]
    await r.close()


async def test_with_no_queue_delay_the_preferred_sizes_still_cap_the_batch_as_triton_does():
    """max_queue_delay_microseconds 0 (Triton's ``pending_batch_delay_ns_ == 0``: the delay is never "exceeded"):
    10 rows queued, preferred [4, 8]: 8 go, then the other 2 at once (no preferred size reachable, nothing to wait
    for). The order the sizes are listed in does not matter (Triton keeps them in a ``std::set``)."""
    for preferred in ([4, 8], [8, 4]):
        r, ctxs, _, _ = runner(contexts=2, max_batch_size=16, preferred_batch_size=preferred)
        t0 = now()
        ends = await _done_at([submit(r) for _ in range(10)])
        assert (ctxs[0].batches, ctxs[1].batches) == ([8], [2])
        assert r.cfg.dynamic_batching.preferred_batch_size == preferred  # kept as written, as Triton's config is
        assert ends == pytest.approx([t0 + 0.008] * 8 + [t0 + 0.002] * 2)
        await r.close()


async def test_arrivals_inside_a_window_do_not_wake_the_batcher_unless_they_may_close_it(monkeypatch):
    """10 ms window, max batch 8: the batcher plans the batch when the window opens and when it ends, not once per
    arrival; the 8th row still closes it at once, and a deadline sooner than the window's end wakes it."""
    import batcher.scheduler as scheduler

    plans = []
    real = scheduler.plan_batch
    monkeypatch.setattr(scheduler, "plan_batch", lambda *a, **k: plans.append(now()) or real(*a, **k))
    r, ctxs, _, _ = runner(max_queue_delay_microseconds=10_000, seconds_per_row=0.0)
    t0 = now()
    tasks = [submit(r)]
    for _ in range(5):
        await asyncio.sleep(0.001)
        tasks.append(submit(r))
    await asyncio.gather(*tasks)
    assert ctxs[0].batches == [6] and now() - t0 == pytest.approx(0.010)
    # the idle batcher's look at the empty queue, the window opening, its end by the timer, the next empty look:
    # no re-plan for the 5 arrivals in between
    assert plans == pytest.approx([t0, t0, t0 + 0.010, t0 + 0.010])
    plans.clear()
    t0 = now()
    tasks = [submit(r)]
    await asyncio.sleep(0.001)
    tasks += [submit(r) for _ in range(7)]  # rows reach max_batch_size
    await asyncio.gather(*tasks)
    assert ctxs[0].batches == [6, 8] and now() - t0 == pytest.approx(0.001)
    plans.clear()
    t0 = now()
    tasks = [submit(r)]
    await asyncio.sleep(0.001)
    tasks.append(submit(r, timeout_s=0.005))  # its deadline, t0 + 6 ms, comes before the window's end
    await asyncio.gather(*tasks, return_exceptions=True)
    assert t0 + 0.001 in [pytest.approx(t) for t in plans]  # re-planned when it arrived
    await r.close()


async def test_requests_received_out_of_order_go_first_in_first_out_and_the_queue_is_never_sorted(monkeypatch):
    """Front-end processes stamp arrivals with their own clocks, and a request is received before its body is read,
    so requests reach the queue out of arrival order. Among equal level and deadline the queue is first in, first
    out (Triton's), and the batcher keeps walking it in order: no sort per batch over a long queue."""
    import batcher.batching as batching

    sorts = []
    real = batching.urgency
    monkeypatch.setattr(batching, "urgency", lambda *a, **k: sorts.append(1) or real(*a, **k))
    r, ctxs, _, _ = runner(seconds_per_row=0.010, max_batch_size=2)
    busy = submit(r, 2, value=-1.0)
    await asyncio.sleep(0)
    t = now()
    later = [asyncio.ensure_future(r.infer(rows(1, float(i)), rows=1, received=t - 0.001 * i)) for i in range(1, 7)]
    outs = await asyncio.gather(busy, *later)
    assert ctxs[0].batches == [2, 2, 2, 2]
    # each output is 2 x its own input: requests 1..6 answered in queue order, batches of two
    assert [float(o["y"][0, 0]) for o in outs[1:]] == [2.0 * i for i in range(1, 7)]
    assert [x[:, 0].tolist() for x in ctxs[0].inputs[1:]] == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert sorts == []  # batching.urgency is only the sort key: the queue never needed sorting
    await r.close()


async def test_a_batch_off_the_queue_front_or_out_of_its_middle_leaves_the_rest_in_order():
    """A batch that is the queue's first queued requests is cut off its front (a withdrawn entry among them goes
    too); one that is not (another shape leads: the request after the leader waits) is taken out of the middle.
    Either way the requests left keep their order, and each output is its own request's."""
    r, ctxs, _, _ = runner(seconds_per_row=0.010, max_batch_size=2)
    busy = submit(r, 2, value=-1.0)
    await asyncio.sleep(0)
    dtypes = [np.float32, np.float32, np.float32, np.float64, np.float32, np.float64, np.float32]
    tasks = [asyncio.ensure_future(r.infer({"x": np.full((1, 4), i + 1, dt)}, rows=1, received=now()))
             for i, dt in enumerate(dtypes)]
    await asyncio.sleep(0)
    tasks[1].cancel()  # request 2 leaves the queue
    outs = await asyncio.gather(busy, *tasks, return_exceptions=True)
    assert isinstance(outs[2], asyncio.CancelledError)
    assert [x[:, 0].tolist() for x in ctxs[0].inputs[1:]] == [[1.0, 3.0], [4.0, 6.0], [5.0, 7.0]]
    assert {i + 1: float(o["y"][0, 0]) for i, o in enumerate(outs[1:]) if i != 1} == {
        1: 2.0, 3: 6.0, 4: 8.0, 5: 10.0, 6: 12.0, 7: 14.0}
    assert r.queue_depth == 0
    await r.close()


async def test_requests_queue_while_the_context_is_busy_and_fill_the_next_batch():
    """One context busy for 50 ms with a request of 5 rows; 10 single rows arrive meanwhile: the next batch takes
    8 (max), the one after the last 2; shapes never mix; requests are never split."""
    r, ctxs, _, _ = runner(seconds_per_row=0.010, max_batch_size=8)
    busy = submit(r, 5)
    await asyncio.sleep(0)
    others = [submit(r) for _ in range(10)]
    await asyncio.gather(busy, *others)
    assert ctxs[0].batches == [5, 8, 2]
    await r.close()


async def test_only_requests_of_one_shape_share_a_batch():
    r, _, _, _ = runner(max_queue_delay_microseconds=1000)
    a = r.infer({"x": np.ones((1, 4), np.float32)}, rows=1, received=now())
    b = r.infer({"x": np.ones((1, 4), np.float64)}, rows=1, received=now())
    # the signature would refuse float64 before queueing; the queue itself still keeps shape keys apart
    ta, tb = asyncio.ensure_future(a), asyncio.ensure_future(b)
    await asyncio.gather(ta, tb)
    assert ta.result()["y"].dtype == np.float32 and tb.result()["y"].dtype == np.float64
    await r.close()


async def test_a_deadline_shorter_than_the_window_closes_it_in_time_before_and_after_the_first_batch():
    """A fresh user's report: with a 50 ms window and 20 ms deadlines every request got 504, on a model taking
    0.1 ms. Before any batch has run there is no estimate, and the deadline was not looked at; after, the window
    closed at exactly the deadline less the estimate, so any lateness dropped the batch. Now it closes the margin
    (DEADLINE_MARGIN_S) earlier still: at 18 ms with no estimate, at 17 ms with the 1 ms one."""
    from batcher.batching import DEADLINE_MARGIN_S

    r, ctxs, _, _ = runner(max_queue_delay_microseconds=50_000)
    for estimate in (0.0, 0.001):
        t0 = now()
        out = await submit(r, value=3.0, timeout_s=0.020)
        np.testing.assert_array_equal(out["y"], np.full((1, 4), 6.0, np.float32))
        assert now() - t0 == pytest.approx(0.020 - DEADLINE_MARGIN_S - estimate + 0.001)  # window, then 1 row
    assert ctxs[0].batches == [1, 1]
    await r.close()


async def test_a_queued_request_gets_504_at_its_deadline_and_never_runs():
    r, ctxs, _, metrics = runner(seconds_per_row=0.100)
    slow = submit(r, 5)  # 0.5 s
    await asyncio.sleep(0)
    t0 = now()
    late = submit(r, timeout_s=0.050)
    with pytest.raises(DeadlineExceeded, match="in the queue"):
        await late
    assert now() - t0 == pytest.approx(0.050)
    await slow
    assert ctxs[0].batches == [5]
    assert r.queue_depth == 0
    await r.close()


async def test_an_executing_request_gets_504_at_its_deadline_not_its_late_answer():
    r, _, _, _ = runner(seconds_per_row=0.100, admission_control=False)
    t0 = now()
    with pytest.raises(DeadlineExceeded, match="while its batch was executing"):
        await submit(r, 5, timeout_s=0.150)
    assert now() - t0 == pytest.approx(0.150)
    await r.close()


async def test_work_that_would_finish_after_its_deadline_is_not_started():
    """Once a 5-row batch took 50 ms, a request whose deadline falls inside its 5-row batch's execution is dropped
    before execution (504) and its batch-mate runs."""
    r, ctxs, _, _ = runner(seconds_per_row=0.010, admission_control=False, max_queue_delay_microseconds=1000)
    await submit(r, 5)  # measures t(5) = 50 ms
    doomed = submit(r, 4, timeout_s=0.030)
    fine = submit(r, 1)
    with pytest.raises(DeadlineExceeded, match="not executed"):
        await doomed
    await fine
    assert ctxs[0].batches == [5, 1]
    await r.close()


async def test_admission_control_refuses_what_cannot_drain_in_time_with_retry_after():
    r, _, _, _ = runner(seconds_per_row=0.100, priority_levels=2)
    await submit(r, 8)  # t(8) = 0.8 s measured
    backlog = [submit(r, 8, priority=1) for _ in range(3)]  # 2.4 s of work ahead of any level-2 request
    await asyncio.sleep(0)
    with pytest.raises(Unavailable) as exc:
        await submit(r, timeout_s=0.5, priority=2)
    assert exc.value.message == ("model 'm': the 24 rows ahead and this request's 1 need about 2500.0 ms, beyond its "
                                 "deadline in 500.0 ms")
    assert exc.value.retry_after_s == 3  # the 2.4 s of the rows ahead, rounded up
    ok = submit(r, timeout_s=5.0, priority=2)  # 2.4 s + its own row: fits
    await asyncio.gather(*backlog, ok)
    await r.close()


async def test_a_request_that_cannot_finish_alone_by_its_deadline_is_504_not_503():
    """Nothing ahead of it, and its own rows need longer than its deadline: no retry can help, so it is a 504 with
    no Retry-After (a fresh user's find: 503 + Retry-After, which proxies retry on another replica)."""
    r, _, _, _ = runner(seconds_per_row=0.100)
    await submit(r, 4)  # t(4) = 0.4 s measured
    with pytest.raises(DeadlineExceeded) as exc:
        await submit(r, 4, timeout_s=0.25)
    assert exc.value.message == ("model 'm': this request's 4 rows need about 400.0 ms with nothing ahead of them, "
                                 "beyond its deadline in 250.0 ms")
    assert exc.value.retry_after_s is None and exc.value.status == 504
    await r.close()


@pytest.mark.parametrize("how", ["a higher priority", "an earlier deadline"])
async def test_admission_counts_only_the_rows_that_go_before_the_request(how):
    """A fresh user's report: a request of the highest priority (or, at one level, with the earliest deadline) was
    refused for the whole queue's rows, although it goes before them. Only the executing batch is ahead of it here:
    admitted, it runs next, alone, and is answered before its deadline."""
    r, ctxs, _, _ = runner(seconds_per_row=0.100, priority_levels=2, default_priority_level=2)
    await submit(r, 8)  # t(8) = 0.8 s measured
    backlog = [submit(r, 8) for _ in range(3)]  # level 2, no deadline: one batch executing, 16 rows queued
    await asyncio.sleep(0)
    t0 = now()
    out = await submit(r, value=5.0, timeout_s=1.0, priority=1 if how == "a higher priority" else None)
    np.testing.assert_array_equal(out["y"], np.full((1, 4), 10.0, np.float32))
    assert now() - t0 == pytest.approx(0.8 + 0.1)  # behind the executing batch only
    await asyncio.gather(*backlog)
    assert ctxs[0].batches == [8, 8, 1, 8, 8]
    await r.close()


async def test_admission_never_refuses_on_an_extrapolated_guess():
    """Only single rows were measured (100 ms each); 24 rows ahead would take 2.4 s if batching gained nothing, but
    the estimate for unmeasured larger batches is a lower bound (100 ms per batch), so a 1 s deadline is admitted."""
    r, _, _, _ = runner(seconds_per_row=0.100, priority_levels=2)
    await submit(r, 1)
    backlog = [submit(r, 8, priority=1) for _ in range(3)]
    await asyncio.sleep(0)
    hopeful = submit(r, timeout_s=1.0, priority=2)
    await asyncio.gather(*backlog)
    with pytest.raises(DeadlineExceeded):  # it did not make it: answered 504 at its deadline, not refused early
        await hopeful
    await r.close()


async def test_higher_priority_runs_first_and_starvation_is_bounded():
    r, ctxs, _, _ = runner(seconds_per_row=0.100, max_batch_size=1, priority_levels=2, default_priority_level=2,
                           max_priority_wait_microseconds=250_000)
    order: list[str] = []

    async def tagged(tag: str, priority: int | None):
        await submit(r, value=len(order), priority=priority)
        order.append(tag)

    blocker = asyncio.ensure_future(tagged("blocker", 1))
    await asyncio.sleep(0)
    low = asyncio.ensure_future(tagged("low", 2))
    highs = []
    for i in range(6):  # a steady stream of level-1 requests, one per 100 ms
        highs.append(asyncio.ensure_future(tagged(f"high{i}", 1)))
        await asyncio.sleep(0.100)
    await asyncio.gather(blocker, low, *highs)
    # low waited 250 ms (the bound) and then went before the level-1 requests queued after that moment
    assert order.index("low") == 3, order
    await r.close()


async def test_queue_full_is_503():
    r, _, _, _ = runner(seconds_per_row=0.100, default_queue_policy={"max_queue_size": 2})
    running = submit(r)
    await asyncio.sleep(0)
    queued = [submit(r), submit(r)]
    await asyncio.sleep(0)
    with pytest.raises(Unavailable, match="queue is full"):
        await submit(r)
    await asyncio.gather(running, *queued)
    await r.close()


async def test_max_queue_size_bounds_each_priority_level_as_triton():
    """Triton's ``default_queue_policy`` is the policy of each priority level's queue (a fresh user's find: a
    request of the highest level got 503 "queue is full" because the queue was full of the lowest level's). The
    level's own count is checked, and a level's slot comes back when its request leaves the queue."""
    r, _, _, _ = runner(seconds_per_row=0.100, max_batch_size=1, priority_levels=2,
                        default_queue_policy={"max_queue_size": 2})
    running = submit(r, priority=2)
    await asyncio.sleep(0)
    lows = [submit(r, priority=2), submit(r, priority=2)]
    await asyncio.sleep(0)
    with pytest.raises(Unavailable, match=re.escape("queue is full (2 of max_queue_size 2 at priority level 2)")):
        await submit(r, priority=2)
    highs = [submit(r, priority=1), submit(r, priority=1)]
    await asyncio.sleep(0)
    with pytest.raises(Unavailable, match="at priority level 1"):
        await submit(r, priority=1)
    assert r.queue_depth == 4
    await asyncio.gather(running, highs[0])  # the first high went next: a level-1 slot is free again
    again = submit(r, priority=1)
    await asyncio.gather(*lows, highs[1], again)
    await r.close()


async def test_a_cancelled_queued_request_never_runs_and_its_batch_mates_are_unaffected():
    r, ctxs, _, _ = runner(seconds_per_row=0.100, max_queue_delay_microseconds=1000)
    running = submit(r)
    await asyncio.sleep(0.002)  # its window closed: it executes for 100 ms
    gone, stays = submit(r, 3), submit(r, 2)
    await asyncio.sleep(0.010)
    gone.cancel()
    await asyncio.gather(running, stays)
    assert ctxs[0].batches == [1, 2]
    assert r.queue_depth == 0
    await r.close()


async def test_an_engine_error_fails_its_batch_only_and_a_lost_worker_is_503():
    r, ctxs, _, _ = runner(max_queue_delay_microseconds=1000)
    ctxs[0].fail = EngineError("kaput")
    with pytest.raises(ExecutionFailed, match="kaput"):
        await submit(r)
    await submit(r)  # keeps serving
    ctxs[0].fail = EngineUnavailable("worker died")
    with pytest.raises(Unavailable, match="worker died"):
        await submit(r)
    await r.close()


async def test_two_contexts_take_batches_as_they_become_idle():
    r, ctxs, _, _ = runner(contexts=2, seconds_per_row=0.010, max_batch_size=4)
    await asyncio.gather(*(submit(r) for _ in range(16)))
    assert sum(c.batches.count(4) for c in ctxs) == 4 and all(c.batches for c in ctxs)
    await r.close()


async def test_close_answers_queued_503_lets_the_running_batch_finish_and_releases_contexts():
    r, ctxs, execs, _ = runner(seconds_per_row=0.100)
    running = submit(r, 2)
    await asyncio.sleep(0)
    queued = submit(r)
    await asyncio.sleep(0.010)
    await r.close()
    assert (await running)["y"].shape == (2, 4)
    with pytest.raises(Unavailable, match="shutting down"):
        await queued
    with pytest.raises(Unavailable, match="shutting down"):
        await submit(r)
    assert execs[0].closed and ctxs[0].released and ctxs[0].batches == [2]


async def test_queue_metrics_and_statistics_follow_the_batches():
    r, _, _, metrics = runner(seconds_per_row=0.010, max_queue_delay_microseconds=2000)
    await asyncio.gather(*(submit(r) for _ in range(3)))
    assert r.stats.execution_count == 1 and r.stats.inference_count == 3
    assert r.stats.queue.count == 3 and r.stats.queue.ns == 3 * 2_000_000
    assert r.stats.compute_infer.ns == 3 * 30_000_000  # each request is charged its batch's 30 ms
    sample = metrics.registry.get_sample_value
    assert sample("batcher_batch_size_count", {"model": "m", "version": "1"}) == 1
    assert sample("batcher_queue_depth", {"model": "m", "version": "1"}) == 0
    await r.close()


async def test_device_times_of_the_batches_reach_the_device_metrics():
    r, ctxs, _, metrics = runner(seconds_per_row=0.010, max_queue_delay_microseconds=2000)
    sample = metrics.registry.get_sample_value
    labels = {"model": "m", "version": "1"}
    await submit(r)  # an untimed context (CPU): no device series at all
    assert sample("batcher_device_busy_seconds_total", labels) is None
    ctxs[0].timed = DeviceTimes(busy_s=0.002, idle_s=None)  # the context's first timed batch: no idle gap yet
    await submit(r)
    ctxs[0].timed = DeviceTimes(busy_s=0.003, idle_s=0.0005)
    await asyncio.gather(submit(r), submit(r))  # one batch of two
    assert sample("batcher_device_busy_seconds_total", labels) == pytest.approx(0.005)
    assert sample("batcher_device_idle_seconds_count", labels) == 1
    assert sample("batcher_device_idle_seconds_sum", labels) == pytest.approx(0.0005)
    assert sample("batcher_device_idle_seconds_bucket", {**labels, "le": "0.00025"}) == 0
    assert sample("batcher_device_idle_seconds_bucket", {**labels, "le": "0.0005"}) == 1
    await r.close()


@pytest.mark.looptime
async def test_the_queue_depth_gauge_is_written_once_per_pass_of_the_event_loop():
    """Three arrivals in one pass: one write of batcher_queue_depth (3), after the pass, not three; the batch's
    dispatch writes it once more (0)."""
    r, _, _, metrics = runner(seconds_per_row=0.010, max_queue_delay_microseconds=5000)
    writes = []
    gauge = r.metrics.queue_depth
    set_value = gauge.set
    gauge.set = lambda v: (writes.append(v), set_value(v))  # type: ignore[method-assign]
    tasks = [submit(r) for _ in range(3)]
    await asyncio.sleep(0)  # the tasks queue their requests in this pass
    assert r.queue_depth == 3 and writes == []
    await asyncio.sleep(0.001)
    assert writes == [3]
    assert metrics.registry.get_sample_value("batcher_queue_depth", {"model": "m", "version": "1"}) == 3
    await asyncio.gather(*tasks)
    assert writes == [3, 0]
    await r.close()


async def test_an_answered_request_keeps_nothing_of_its_inputs_alive():
    """The batcher loop waits for the next idle executor holding no reference to the last batch: a request's
    inputs (a shared-memory view, a request body) are freed once it is answered, not at the next batch."""
    import gc
    import weakref

    r, _, _, _ = runner()
    x = np.ones((1, 4), np.float32)
    alive = weakref.ref(x)
    out = await r.infer({"x": x}, rows=1, received=now())
    np.testing.assert_array_equal(out["y"], np.full((1, 4), 2.0))
    del x, out
    gc.collect()
    assert alive() is None
    await r.close()


async def test_a_two_stage_executor_stages_the_next_batch_while_one_runs():
    """A GPU context's executor stages (4 ms) on one thread while the device runs the last batch (8 ms): 64 rows in
    batches of 8 take 4 + 8 x 8 = 68 ms, the device never idle after the first stage (one stage at a time would
    take 8 x 12 = 96 ms); the two staging slots alternate."""
    cfg = model_config(max_batch_size=8)
    ctx = FakeContext()
    ex = PipelineExecutor(ctx, seconds_per_row=0.001, stage_s=0.004)
    r = ModelRunner(cfg, signature(8), [ex], Metrics().for_model("m", "1"))
    t0 = now()
    outs = await asyncio.gather(*(submit(r, value=float(i)) for i in range(64)))
    assert now() - t0 == pytest.approx(0.068)
    assert ctx.batches == [8] * 8 and ex.slots == [0, 1] * 4
    assert [o["y"][0, 0] for o in outs] == [2.0 * i for i in range(64)]
    await r.close()


async def test_a_third_staging_slot_takes_full_batches_only():
    """Lookahead (LOOKAHEAD_SLOT): with 64 requests queued at once every batch is full, and the third slot's token
    stages a batch while two are ahead of it; with requests trickling in (one each 3 ms, a 2 ms window) the
    batches are partial and the third token stays parked: never more than two partial batches at the device."""
    cfg = model_config(max_batch_size=8, dynamic_batching={"max_queue_delay_microseconds": 2000})
    ctx = FakeContext()
    ex = PipelineExecutor(ctx, seconds_per_row=0.001, stage_s=0.004, depth=3)
    r = ModelRunner(cfg, signature(8), [ex], Metrics().for_model("m", "1"))
    outs = await asyncio.gather(*(submit(r, value=float(i)) for i in range(64)))
    assert ctx.batches == [8] * 8 and 2 in ex.slots
    assert all(rows == 8 for slot, rows in zip(ex.slots, ex.staged_rows) if slot == 2)
    assert [o["y"][0, 0] for o in outs] == [2.0 * i for i in range(64)]
    ex.slots.clear()

    async def trickle(i: int):
        await asyncio.sleep(0.003 * i)
        return await submit(r, value=float(i))

    outs = await asyncio.gather(*(trickle(i) for i in range(24)))
    assert [o["y"][0, 0] for o in outs] == [2.0 * i for i in range(24)]
    assert ex.slots and 2 not in ex.slots and max(ctx.batches[8:]) < 8
    await r.close()


class HeldExecutor:
    """A pipelined executor (``depth`` tokens) whose batches end when the test says: :meth:`end` settles one as
    :class:`batcher.executor.ThreadExecutor` does, its result and then its ``done`` hook in one callback."""

    def __init__(self, depth: int = 2) -> None:
        self.context, self.depth = FakeContext(), depth
        self.batches: list[tuple[list, int, asyncio.Future, object]] = []  # (requests, slot, future, done)

    def pipeline(self, args, slot: int, done=None) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.batches.append((args[0], slot, fut, done))
        return fut

    def end(self, k: int) -> None:
        batch, _, fut, done = self.batches[k]
        fut.set_result(BatchResult([{"y": p.inputs["x"] * 2} for p in batch], (0.0, 0.001, 0.0),
                                   sum(p.rows for p in batch)))
        done(fut)

    def close(self) -> None:
        pass


async def test_a_batch_end_hands_its_token_to_the_next_full_batch_in_the_same_callback():
    """With every token busy and full batches queued, a batch's end dispatches the next full batch before that
    callback returns (no pass of the event loop through the batcher task); a partial batch stays with the task and
    its window (2 ms here)."""
    cfg = model_config(max_batch_size=4, dynamic_batching={"max_queue_delay_microseconds": 2000})
    ex = HeldExecutor(depth=2)
    r = ModelRunner(cfg, signature(4), [ex], Metrics().for_model("m", "1"))
    tasks = [submit(r, value=float(i)) for i in range(14)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert [len(b[0]) for b in ex.batches] == [4, 4]  # both tokens busy, 6 requests queued
    ex.end(0)
    assert [len(b[0]) for b in ex.batches] == [4, 4, 4]  # already: in the callback that ended batch 0
    assert ex.batches[2][1] == ex.batches[0][1]  # on the token batch 0 gave back
    ex.end(1)
    assert len(ex.batches) == 3  # 2 queued: not full, the batcher task takes them after its window
    t0 = now()
    await asyncio.sleep(0.01)
    assert [len(b[0]) for b in ex.batches] == [4, 4, 4, 2] and now() - t0 == pytest.approx(0.01)
    ex.end(2)
    ex.end(3)
    outs = await asyncio.gather(*tasks)
    assert [o["y"][0, 0] for o in outs] == [2.0 * i for i in range(14)]
    await r.close()


async def test_a_later_request_with_an_earlier_deadline_still_goes_first():
    """The queue skips sorting while arrivals keep it in urgency order; a request that breaks the order (its
    deadline before those queued ahead) is still served first."""
    r, ctxs, _, _ = runner(seconds_per_row=0.100, max_batch_size=1, admission_control=False)
    order: list[str] = []

    async def tagged(tag: str, n: int = 1, timeout_s: float | None = None) -> None:
        await submit(r, n, timeout_s=timeout_s)
        order.append(tag)

    first = asyncio.ensure_future(tagged("running"))
    await asyncio.sleep(0)
    late = [asyncio.ensure_future(tagged(f"late{i}", timeout_s=10.0 + i)) for i in range(3)]
    urgent = asyncio.ensure_future(tagged("urgent", timeout_s=1.0))
    await asyncio.gather(first, *late, urgent)
    assert order == ["running", "urgent", "late0", "late1", "late2"]
    await r.close()


async def test_a_model_without_a_batch_dim_runs_each_request_alone_with_its_full_shape():
    """max_batch_size 0: inputs are full shapes ([3, 4] here, not rows of [4]); requests of the same shape queued
    together still execute one by one, each getting its whole output."""
    cfg = model_config(max_batch_size=0)
    sig = ModelSignature((TensorSpec("x", "FP32", (3, 4)),), (TensorSpec("y", "FP32", (3, 4)),), 0)
    ctx = FakeContext()
    r = ModelRunner(cfg, sig, [SleepExecutor(ctx, seconds_per_row=0.010)], Metrics().for_model("m", "1"))
    xs = [np.full((3, 4), float(i), np.float32) for i in range(3)]
    t0 = now()
    outs = await asyncio.gather(*(r.infer({"x": x}, rows=1, received=t0) for x in xs))
    assert ctx.batches == [3, 3, 3]  # three executions of a [3, 4] input
    for x, out in zip(xs, outs):
        np.testing.assert_array_equal(out["y"], x * 2)
    assert now() - t0 == pytest.approx(0.030)  # one after another, 10 ms each
    assert r.stats.execution_count == 3 and r.stats.inference_count == 3
    await r.close()


async def test_a_request_withdrawn_from_the_queue_lets_its_inputs_go_before_the_next_batch():
    """A client that goes away while its request waits in the batch window: the request is never executed and its
    inputs (in binary mode, views of its whole body) are released at once, not when a later batch purges the
    queue (the new-user report: 40 cancelled 2.4 MB requests stayed alive at queue depth 0)."""
    import gc
    import weakref

    r, ctxs, _, _ = runner(max_queue_delay_microseconds=10_000_000)  # a window nothing ends in this test
    x = rows(1)
    ref = weakref.ref(x["x"])
    task = asyncio.ensure_future(r.infer(x, rows=1, received=asyncio.get_running_loop().time(), deadline=None))
    del x
    await asyncio.sleep(0)
    assert r.queue_depth == 1
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()
    del task  # its cancellation's traceback holds the caller's frame, and so the inputs, as a handler's does
    gc.disable()  # freed by reference counting, not by a collection that happens to run
    try:
        assert r.queue_depth == 0 and ref() is None
    finally:
        gc.enable()
    assert ctxs[0].batches == []
    await r.close()
