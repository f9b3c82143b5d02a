"""The live throughput / retention tracker (pure)."""

from __future__ import annotations

import pytest

from batcher.retention import ThroughputTracker


def test_retention_is_total_over_solo_throughputs():
    t = ThroughputTracker(window_s=2.0)
    counts = {"a": 0, "b": 0}
    now = 0.0
    ratio = None
    # a alone at 100/s, then b alone at 80/s, then both together at 45 + 40 /s
    for rate_a, rate_b, seconds in ((100, 0, 4), (0, 80, 4), (45, 40, 4)):
        for _ in range(seconds):
            now += 1.0
            counts["a"] += rate_a
            counts["b"] += rate_b
            rps, ratio = t.tick(now, counts)
    assert t.solo == {"a": pytest.approx(100.0), "b": pytest.approx(80.0)}
    assert rps == {"a": pytest.approx(45.0), "b": pytest.approx(40.0)}
    assert ratio == pytest.approx(85 / 180)


def test_no_ratio_without_two_active_models_with_solo_figures():
    t = ThroughputTracker(window_s=2.0)
    assert t.tick(1.0, {"a": 0})[1] is None
    rps, ratio = t.tick(2.0, {"a": 50})
    assert rps == {"a": 50.0} and ratio is None
    rps, ratio = t.tick(3.0, {"a": 100, "b": 30})  # b first seen now: counts from here, no solo figure yet
    assert ratio is None
