"""bench.soak's judgement of resident memory, on synthetic sample series (no server, no clock)."""

from __future__ import annotations

import numpy as np

from bench.soak import memory_checks, theil_sen_slope


def _series(seconds: int, rss) -> list[dict]:
    return [{"t_s": float(t), "rss_mb": float(rss(t))} for t in range(seconds)]


def test_theil_sen_ignores_a_few_outliers():
    xs = list(range(50))
    ys = [2.0 * x for x in xs]
    ys[10], ys[30] = 500.0, -400.0
    assert theil_sen_slope(xs, ys) == 2.0


def test_a_flat_run_after_warm_up_passes_both_checks():
    rng = np.random.default_rng(0)
    noise = rng.uniform(-3, 3, 600)
    samples = _series(600, lambda t: 200 + min(t, 60) * 0.5 + noise[t])  # fills for a minute, then flat
    checks, slope, window_s = memory_checks(samples, 30.0, 120.0)
    assert window_s == 479.0 and abs(slope) < 0.005
    assert list(checks.values()) == [True, True]


def test_a_leak_of_one_megabyte_a_minute_fails_the_trend_check_alone():
    samples = _series(1200, lambda t: 200 + t / 60)  # 20 MB over 20 minutes: under the level tolerance of 30
    checks, slope, _ = memory_checks(samples, 30.0, 120.0)
    assert abs(slope * 60 - 1.0) < 1e-9
    assert checks == {"resident memory trend over the run <= 10 MB": False, "resident memory growth <= 30 MB": True}


def test_a_step_past_the_tolerance_fails_the_level_check():
    samples = _series(600, lambda t: 200 if t < 500 else 240)
    checks, _, _ = memory_checks(samples, 30.0, 120.0)
    assert checks["resident memory growth <= 30 MB"] is False


def test_a_short_run_is_not_judged():
    samples = _series(16, lambda t: 230 + t)  # the CI soak's length, with a steep early rise
    checks, slope, window_s = memory_checks(samples, 30.0, 120.0)
    assert checks is None and window_s == 12.0 and slope == 1.0
