"""Log lines that a client or the machine could repeat without end, at most one per interval, each with the count
of those left out since the last (``accept()`` out of file descriptors; an engine failing on batches)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class EveryFewSeconds:
    """Whether a line is due: the first at once, then at most one per ``every_s`` seconds; thread-safe.

    ``clock``: seconds, injectable for tests."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._last: float | None = None
        self._suppressed = 0
        self._lock = threading.Lock()

    def due(self) -> int | None:
        """The number of lines left out since the last one when a line is due now (log it), else None (this one
        is left out and counted)."""
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last < self.every_s:
                self._suppressed += 1
                return None
            suppressed, self._last, self._suppressed = self._suppressed, now, 0
            return suppressed


#: one :class:`EveryFewSeconds` per kind of line and subject (:func:`due`)
_due: dict[tuple[str, str], EveryFewSeconds] = {}


def due(kind: str, subject: str) -> int | None:
    """:meth:`EveryFewSeconds.due` of lines of ``kind`` about ``subject`` (a model), 10 s apart."""
    return _due.setdefault((kind, subject), EveryFewSeconds()).due()
