"""Live throughput per model and the retention ratio (the seed's "how much throughput each model keeps when
models share the process"). Pure: fed cumulative counts by a timer, testable without an event loop.

Definitions (per tick):

* a model's throughput is its successful requests per second over the last ``window_s`` seconds;
* a model is active when its throughput is at least ``active_rps``;
* while exactly one model is active, its throughput updates its *solo* figure (the best seen alone);
* while two or more models are active and each has a solo figure, the retention ratio is the sum of their
  throughputs divided by the sum of their solo figures (the seed measured 51%: 260.5 / 507.5 QPS).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Mapping


class ThroughputTracker:
    def __init__(self, window_s: float = 10.0, active_rps: float = 0.5) -> None:
        self.window_s = window_s
        self.active_rps = active_rps
        self._samples: collections.deque[tuple[float, dict[Hashable, int]]] = collections.deque()
        self.solo: dict[Hashable, float] = {}

    def tick(self, now: float, counts: Mapping[Hashable, int]) -> tuple[dict[Hashable, float], float | None]:
        """Record cumulative success counts at ``now`` (seconds, monotonic).

        Returns:
            throughput per model (requests/s over the window; models seen for the first time count from now)
            and the retention ratio, or None when fewer than two models are active or one lacks a solo figure.
        """
        self._samples.append((now, dict(counts)))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        t0, first = self._samples[0]
        span = now - t0
        rps = {k: ((c - first.get(k, c)) / span if span > 0 else 0.0) for k, c in counts.items()}
        active = [k for k, r in rps.items() if r >= self.active_rps]
        if len(active) == 1:
            k = active[0]
            self.solo[k] = max(self.solo.get(k, 0.0), rps[k])
        ratio = None
        if len(active) >= 2 and all(self.solo.get(k) for k in active):
            ratio = sum(rps[k] for k in active) / sum(self.solo[k] for k in active)
        return rps, ratio
