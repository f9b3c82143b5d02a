"""Open-loop send schedules: when each request of a step is due, as offsets in seconds from the step start."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

KINDS = ("constant", "poisson")


def arrival_times(rate: float, duration: float, kind: str = "constant", seed: int | Sequence[int] | None = 0
                  ) -> np.ndarray:
    """Send offsets (s, from the step start, ascending, all in ``[0, duration)``) for an offered ``rate``.

    ``constant``: exactly ``k / rate`` for ``k = 0, 1, ...`` (``ceil(rate * duration)`` of them); ``poisson``:
    a Poisson process of intensity ``rate`` (exponential gaps, the first one after 0), reproducible per ``seed``.
    """
    if rate <= 0 or duration <= 0:
        raise ValueError(f"rate and duration must be > 0 (got rate={rate}, duration={duration})")
    if kind == "constant":
        n = math.ceil(rate * duration - 1e-9)
        return np.arange(n, dtype=np.float64) / rate
    if kind == "poisson":
        rng = np.random.default_rng(seed)
        expected = rate * duration
        t = np.cumsum(rng.exponential(1.0 / rate, size=int(expected + 8 * math.sqrt(expected) + 16)))
        while t[-1] < duration:  # practically never: 8 standard deviations of slack
            t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(1.0 / rate, size=t.size))])
        return t[t < duration]
    raise ValueError(f"arrivals must be one of {', '.join(KINDS)} (got {kind!r})")
