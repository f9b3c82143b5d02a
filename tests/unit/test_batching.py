"""Pure tests of batch forming, stacking and splitting (no event loop)."""

from __future__ import annotations

import numpy as np
import pytest

from batcher.batching import (Pending, State, batch_is_full, plan_batch, preferred_cut, shape_key, split_outputs,
                              stack_inputs)


def _p(rows: int, width: int = 8, t: float = 0.0, dtype=np.float32) -> Pending:
    inputs = {"x": np.full((rows, 3, width), t, dtype)}
    return Pending(inputs, rows, shape_key(inputs), arrival=t)


def test_shape_key_separates_shapes_and_dtypes_not_rows():
    assert shape_key({"x": np.zeros((1, 3, 8))}) == shape_key({"x": np.zeros((5, 3, 8))})
    assert shape_key({"x": np.zeros((1, 3, 8))}) != shape_key({"x": np.zeros((1, 3, 9))})
    assert shape_key({"x": np.zeros((1, 3), np.float32)}) != shape_key({"x": np.zeros((1, 3), np.float64)})


def test_batch_is_led_by_the_oldest_and_takes_only_its_shape():
    q = [_p(1, 8, 0), _p(1, 16, 1), _p(2, 8, 2), _p(1, 16, 3), _p(1, 8, 4)]
    batch, rows = plan_batch(q, 32)
    assert batch == [q[0], q[2], q[4]] and rows == 4
    q[0].state = State.DONE
    q[2].state = State.DONE
    q[4].state = State.DONE
    batch, rows = plan_batch(q, 32)
    assert batch == [q[1], q[3]] and rows == 2


def test_rows_never_exceed_max_and_requests_are_not_split():
    q = [_p(3), _p(4), _p(2), _p(1)]
    batch, rows = plan_batch(q, 6)
    assert batch == [q[0], q[2], q[3]] and rows == 6  # the 4-row request does not fit and waits, unsplit
    assert plan_batch([], 6) == ([], 0)


def test_full_and_preferred_sizes():
    assert batch_is_full(8, 8)
    assert not batch_is_full(7, 8)
    assert batch_is_full(4, 8, (2, 4))
    assert not batch_is_full(3, 8, (2, 4))


@pytest.mark.parametrize("rows, preferred, cut", [
    ([1] * 10, (4, 8), 8),  # the largest preferred size reachable; the other 2 rows wait
    ([1] * 5, (4, 8), 4),  # a smaller one goes at once too
    ([1] * 3, (4, 8), 0),  # none reachable yet: wait for the window
    ([2, 2, 3], (4, 8), 2),  # 4 rows
    ([2, 2, 2, 3], (4, 8), 2),  # 4, not 6: past a preferred size, only another preferred size moves the cut
    ([3, 3, 3], (4, 8), 2),  # none reachable, the third would pass 8: the 6 rows before it
    ([3, 3], (4, 8), 0),  # 6 rows, still room below 8: wait
    ([10, 1], (4, 8), 1),  # a first request past the largest goes alone
    ([10], (4, 8), 1),
    ([1] * 10, (8, 4), 8),  # any order
    ([1] * 10, (), 0),  # no preferred sizes: the window and max_batch_size decide
])
def test_preferred_cut_is_tritons_rule(rows, preferred, cut):
    assert preferred_cut([_p(n) for n in rows], preferred) == cut


def test_stack_and_split_round_trip_in_order():
    q = [_p(1, t=1), _p(3, t=2), _p(2, t=3)]
    stacked = stack_inputs(q)
    assert stacked["x"].shape == (6, 3, 8)
    parts = split_outputs({"y": stacked["x"][:, 0, 0] * 10}, [p.rows for p in q])
    assert [part["y"].tolist() for part in parts] == [[10.0], [20.0] * 3, [30.0] * 2]
    assert stack_inputs(q[:1])["x"] is q[0].inputs["x"]  # a lone request is not copied


def test_split_rejects_outputs_without_the_batch_rows():
    with pytest.raises(ValueError, match="expected 3 rows first"):
        split_outputs({"y": np.zeros((2, 4))}, [1, 2])


def test_batch_time_estimates_interpolate_and_never_overshoot_when_extrapolating():
    from batcher.batching import BatchTimes

    t = BatchTimes(alpha=0.5)
    assert t.estimate(4) is None and t.drain(10, 8, 1) is None
    t.record(2, 0.020)
    t.record(8, 0.050)
    assert t.estimate(8) == 0.050 and t.estimate(4) == pytest.approx(0.030)  # linear between measured sizes
    assert t.estimate(32) == 0.050  # above: a batch is never faster with more rows
    assert t.estimate(1) == pytest.approx(0.010)  # below: no fixed cost assumed
    t.record(8, 0.070)  # moving average
    assert t.estimate(8) == pytest.approx(0.060)
    assert t.drain(18, 8, 1) == pytest.approx(2 * 0.060 + 0.020) and t.drain(18, 8, 2) == pytest.approx(0.070)


def test_admission_verdicts():
    from batcher.batching import BatchTimes, Verdict, admission

    t = BatchTimes()
    assert admission(0.0, 1.0, 1, 100, t, 8, 1) == (Verdict.ADMIT, 0.0)  # no estimate yet
    t.record(8, 0.1)
    assert admission(2.0, 1.0, 1, 0, t, 8, 1)[0] is Verdict.LATE
    assert admission(0.0, 1.0, 1, 80, t, 8, 1) == (Verdict.CANNOT_FINISH, pytest.approx(1.0))
    assert admission(0.0, 1.0, 1, 72, t, 8, 1)[0] is Verdict.ADMIT  # 0.9 s + its own row (0.0125 s)
    assert admission(0.0, 1.0, 1, 80, t, 8, 2)[0] is Verdict.ADMIT


def test_the_batch_window_is_held_only_when_more_requests_are_likely():
    from batcher.batching import worth_waiting

    assert worth_waiting(0.0002, 0.0005)  # arrivals 0.2 ms apart: a 0.5 ms window gathers more
    assert not worth_waiting(0.002, 0.0005)  # 2 ms apart: a lone request would wait for nothing
    assert not worth_waiting(0.0001, 0.0)  # no window configured


def test_arrival_gaps_are_an_ewma_of_gaps_each_capped_at_one_second():
    from batcher.batching import GAP_EWMA_ALPHA, ArrivalGaps

    gaps = ArrivalGaps()
    gaps.arrive(10.0)
    assert (gaps.mean_s, gaps.last) == (0.0, 10.0)  # one arrival: no gap yet, still "busy"
    gaps.arrive(10.1)
    assert gaps.mean_s == pytest.approx(GAP_EWMA_ALPHA * 0.1)
    gaps.arrive(15.1)  # a 5 s quiet spell counts as 1 s
    assert gaps.mean_s == pytest.approx(0.02 + GAP_EWMA_ALPHA * (1.0 - 0.02))
    assert gaps.last == 15.1


def _pd(t: float, deadline: float | None = None, priority: int = 1, rows: int = 1, width: int = 3) -> Pending:
    inputs = {"x": np.zeros((rows, width), np.float32)}
    return Pending(inputs, rows, shape_key(inputs), arrival=t, deadline=deadline, priority=priority)


def test_earliest_deadline_first_then_arrival():
    q = [_pd(0.0), _pd(0.1, deadline=5.0), _pd(0.2, deadline=2.0), _pd(0.3)]
    batch, _ = plan_batch(q, 2, now=0.5)
    assert batch == [q[2], q[1]]  # deadlines first, earliest first; requests without one after, by arrival
    batch, _ = plan_batch(q, 4, now=0.5)
    assert batch == [q[2], q[1], q[0], q[3]]


def test_priority_levels_then_the_starvation_bound():
    low_old, high_new = _pd(0.0, priority=2), _pd(0.9, priority=1)
    assert plan_batch([low_old, high_new], 1, now=1.0, starve_after_s=5.0)[0] == [high_new]
    # waited 1 s >= the 0.5 s bound: promoted above every level
    assert plan_batch([low_old, high_new], 1, now=1.0, starve_after_s=0.5)[0] == [low_old]


def test_the_window_rounds_sub_microsecond_waits_to_zero():
    from batcher.batching import DEADLINE_MARGIN_S, window_wait

    assert window_wait(0.1 + 0.2, 0.1, 0.2) == 0.0  # 0.1 + 0.2 - 0.30000000000000004 is not exactly 0
    assert window_wait(1.0, 1.0, 0.002) == pytest.approx(0.002)
    # a deadline closes it early: less the batch's estimate and the margin for what comes late; before any batch
    # has run (no estimate), less the margin alone (it was not looked at: a fresh user's deadlines shorter than the
    # window were all 504)
    assert window_wait(1.0, 1.0, 0.002, earliest_deadline=1.0045, batch_seconds=0.001) == pytest.approx(0.0015)
    assert window_wait(1.0, 1.0, 0.050, earliest_deadline=1.020) == pytest.approx(0.020 - DEADLINE_MARGIN_S)
    assert window_wait(1.0, 1.0, 0.050, earliest_deadline=1.0015) == 0.0


def test_a_presorted_queue_gives_the_same_batch_without_sorting():
    q = [_pd(0.1 * i, deadline=5.0 + i) for i in range(6)]
    q[1].state = State.DONE
    assert plan_batch(q, 4, now=1.0, presorted=True) == plan_batch(list(reversed(q)), 4, now=1.0)


def test_a_presorted_walk_agrees_with_the_sorted_plan_on_random_queues():
    """Mixed shape keys, 1-3 rows, some settled, with and without allowed sizes: the early-stopping walk of a
    presorted queue plans exactly the batch the sorted plan does."""
    import random

    rng = random.Random(7)
    for _ in range(500):
        q = [_pd(0.01 * i, rows=rng.choice([1, 1, 2, 3]), width=rng.choice([4, 4, 4, 8]))
             for i in range(rng.randint(0, 40))]
        for p in q:
            if rng.random() < 0.2:
                p.state = State.DONE
        max_rows, allowed = rng.choice([(4, None), (8, None), (8, (1, 2, 4, 8)), (16, (4, 8, 16))])
        assert plan_batch(q, max_rows, 1.0, allowed=allowed, presorted=True) == plan_batch(q, max_rows, 1.0, allowed=allowed)


def test_a_presorted_walk_stops_at_a_full_batch():
    class Untouchable:
        @property
        def state(self):
            raise AssertionError("read past the full batch")

    head = [_pd(0.01 * i) for i in range(4)]
    assert plan_batch([*head, Untouchable()], 4, 1.0, presorted=True) == (head, 4)
