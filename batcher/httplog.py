"""Logging of malformed HTTP: client mistakes at INFO, without tracebacks, rate-limited.

aiohttp answers a request it cannot parse (bad request line or method, over-long line or header, too many headers,
broken chunked framing) with 400 itself, before any handler runs, and logs it on ``aiohttp.server`` at ERROR with a
full traceback: any client could flood the log. :class:`ClientErrorFilter` rewrites those records - the exception
is aiohttp's ``HttpProcessingError``, which the parser raises for the client's bytes only - to one INFO line without
traceback, and lets at most ``burst`` of them through per ``window_s`` (the next line then says how many were
left out). Every other record (a real server bug) passes unchanged, at ERROR with its traceback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiohttp.http_exceptions import HttpProcessingError

#: the logger aiohttp's request handler writes to
AIOHTTP_SERVER_LOGGER = "aiohttp.server"


class ClientErrorFilter(logging.Filter):
    """Rewrites aiohttp's records of malformed requests to rate-limited INFO lines (module docstring).

    Args:
        burst: lines let through per window.
        window_s: the window, seconds of ``clock``.
    """

    def __init__(self, burst: int = 10, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst, self.window_s, self._clock = burst, window_s, clock
        self._window_start = -float("inf")
        self._passed = 0
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True  # not the client's bytes: keep it as it is
        now = self._clock()
        if now - self._window_start >= self.window_s:
            self._window_start, self._passed = now, 0
        if self._passed >= self.burst:
            self._suppressed += 1
            return False
        self._passed += 1
        detail = " ".join(str(exc.message).split())[:200]
        record.msg = f"{record.msg} (status {exc.code}, answered by aiohttp): %s"
        record.args = (*(record.args or ()), detail)
        if self._suppressed:
            record.msg += f"; {self._suppressed} similar line(s) left out before this one"
            self._suppressed = 0
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.INFO)


def install(logger_name: str = AIOHTTP_SERVER_LOGGER) -> ClientErrorFilter:
    """Add the filter to aiohttp's server logger once (idempotent); returns the one installed."""
    logger = logging.getLogger(logger_name)
    for f in logger.filters:
        if isinstance(f, ClientErrorFilter):
            return f
    f = ClientErrorFilter()
    logger.addFilter(f)
    return f
