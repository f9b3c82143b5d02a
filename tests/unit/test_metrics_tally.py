"""batcher.metrics' per-pass writes: observe_many() against prometheus-client's own observe(), and the Tally that
gathers one pass of the event loop's per-request counts (written at its end, or when the metrics are read)."""

from __future__ import annotations

import asyncio
import math

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from batcher.metrics import LATENCY_BUCKETS_S, Metrics, Tally, observe_many

VALUES = [0.0001, 0.00007, 0.003, 0.05, 0.05, 0.7, 12.0, 0.0025, float("nan"), 3.3]


def exposition(observe) -> list[str]:
    registry = CollectorRegistry()
    child = Histogram("h_seconds", "h", ["m"], buckets=LATENCY_BUCKETS_S, registry=registry).labels("a")
    observe(child)
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_observe_many_exposes_exactly_what_observing_one_by_one_does():
    one_by_one = exposition(lambda h: [h.observe(v) for v in VALUES])
    assert exposition(lambda h: observe_many(h, VALUES)) == one_by_one
    # a value on a bound lands in that bound's bucket, beyond the last finite bound in +Inf only
    assert 'h_seconds_bucket{le="0.0001",m="a"} 2.0' in one_by_one
    assert 'h_seconds_bucket{le="10.0",m="a"} 8.0' in one_by_one
    assert 'h_seconds_bucket{le="+Inf",m="a"} 9.0' in one_by_one
    assert exposition(lambda h: observe_many(h, [0.2])) == exposition(lambda h: h.observe(0.2))
    assert exposition(lambda h: observe_many(h, [])) == exposition(lambda h: None)


class Recorder:
    """A counter or histogram child that records each write."""

    def __init__(self) -> None:
        self.writes: list[float] = []

    def inc(self, amount: float = 1.0) -> None:
        self.writes.append(amount)

    def observe(self, value: float) -> None:
        self.writes.append(value)


def test_a_pass_of_the_event_loop_is_written_once_at_its_end():
    tally, counter, histogram = Tally(), Recorder(), Recorder()

    async def one_pass() -> list:
        for v in (0.1, 0.2, 0.3):
            tally.inc(counter)
            tally.observe(histogram, v)
        before = (list(counter.writes), list(histogram.writes))
        await asyncio.sleep(0)  # the pass ends: the tally's flush runs
        return [before, (list(counter.writes), list(histogram.writes))]

    before, after = asyncio.run(one_pass())
    assert before == ([], [])
    assert after == ([3.0], [0.1, 0.2, 0.3])  # one increment of 3; a recorder has no buckets: one by one
    tally.inc(counter, 2.0)  # no event loop: written at once
    assert counter.writes == [3.0, 2.0]


def test_reading_the_metrics_writes_what_is_pending_first():
    metrics = Metrics()
    outcomes = metrics.outcomes("m", "1")
    labels = {"model": "m", "version": "1"}

    async def answered() -> tuple:
        for seconds in (0.004, 0.03):
            outcomes.succeeded(seconds)
        # read in the same pass, before the flush callback: the read itself writes them
        read = metrics.registry.get_sample_value("batcher_request_success_total", labels)
        count = metrics.registry.get_sample_value("batcher_request_duration_seconds_count", labels)
        total = metrics.registry.get_sample_value("batcher_request_duration_seconds_sum", labels)
        await asyncio.sleep(0)
        again = metrics.registry.get_sample_value("batcher_request_success_total", labels)
        return read, count, total, again

    read, count, total, again = asyncio.run(answered())
    assert (read, count, again) == (2.0, 2.0, 2.0)  # counted once, not again by the flush that follows
    assert math.isclose(total, 0.034)
    assert b"batcher_request_success_total" in generate_latest(metrics.registry)
