"""The filter that turns aiohttp's ERROR-with-traceback records of malformed HTTP into rate-limited INFO lines."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from batcher.httplog import ClientErrorFilter


def _record(exc: BaseException | None) -> logging.LogRecord:
    return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                             ("127.0.0.1",), (type(exc), exc, None) if exc else None)


def test_client_mistakes_become_info_lines_without_traceback_and_real_bugs_stay_errors(caplog):
    caplog.set_level(logging.INFO, logger="aiohttp.server")
    f = ClientErrorFilter(clock=lambda: 0.0)
    rec = _record(LineTooLong("request line", 8190, 10000))
    assert f.filter(rec) is True
    assert rec.levelno == logging.INFO and rec.levelname == "INFO" and rec.exc_info is None
    assert rec.getMessage().startswith("Error handling request from 127.0.0.1 (status 400, answered by aiohttp): ")
    bug = _record(RuntimeError("a bug"))
    assert f.filter(bug) is True and bug.levelno == logging.ERROR and bug.exc_info is not None


def test_at_most_burst_lines_per_window_then_one_says_how_many_were_left_out(caplog):
    caplog.set_level(logging.INFO, logger="aiohttp.server")
    now = [0.0]
    f = ClientErrorFilter(burst=3, window_s=60.0, clock=lambda: now[0])
    passed = [f.filter(_record(BadHttpMessage("bad"))) for _ in range(10)]
    assert passed == [True] * 3 + [False] * 7
    now[0] = 60.0
    rec = _record(BadHttpMessage("bad"))
    assert f.filter(rec) is True and rec.getMessage().endswith("; 7 similar line(s) left out before this one")


def test_no_line_where_the_logger_is_not_at_info(caplog):
    caplog.set_level(logging.WARNING, logger="aiohttp.server")
    assert ClientErrorFilter(clock=lambda: 0.0).filter(_record(BadHttpMessage("bad"))) is False
