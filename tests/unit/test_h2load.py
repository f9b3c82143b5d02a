"""bench/sweep/h2load.py without h2load: the command of a step, the log's parsing and the samples a step makes of
it (offsets, unanswered requests, the window). The real h2load drives a real server in
tests/integration/test_sweep.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.sweep import h2load
from bench.sweep.drivers import CLIENT_TIMEOUT, TRANSPORT_ERROR
from bench.sweep.report import summarize

HEADERS = {"Inference-Header-Content-Length": "135", "Content-Type": "application/octet-stream"}


def test_a_closed_step_is_n_connections_for_the_span_in_milliseconds():
    cmd = h2load.command("h2load", "http://127.0.0.1:1/v2/models/m/infer", Path("/b"), HEADERS, "closed", 16, 3.25,
                         512, Path("/log"))
    assert cmd == ["h2load", "--h1", "-d", "/b", "--log-file", "/log",
                   "-H", "Inference-Header-Content-Length: 135", "-H", "Content-Type: application/octet-stream",
                   "-c", "16", "-D", "3250ms", "http://127.0.0.1:1/v2/models/m/infer"]


def test_an_open_step_spreads_the_rate_over_connections_each_sending_at_most_every_50_ms():
    cmd = h2load.command("h2load", "http://h/i", Path("/b"), {}, "open", 3000, 7.0, 512, Path("/log"))
    # 3000 req/s x 50 ms = 150 connections at 20 req/s each, started 3 per ms; 3000 x 7 s requests in all
    assert cmd[6:] == ["-c", "150", "--rps", "20", "-r", "3", "--rate-period", "1ms", "-n", "21000", "http://h/i"]
    assert h2load.open_connections(10, 512) == 1  # a slow rate: one connection, one send every 100 ms
    assert h2load.open_connections(20000, 512) == 512  # capped by --max-inflight
    with pytest.raises(ValueError, match="open or closed"):
        h2load.command("h2load", "http://h/i", Path("/b"), {}, "burst", 1, 1.0, 1, Path("/log"))


@pytest.mark.parametrize(("rate", "stagger"), [(100, (1, 10)), (300, (2, 7)), (500, (1, 2)), (1000, (1, 1)),
                                                 (1300, (4, 3)), (3000, (3, 1)), (1.0, (1, 50))])
def test_connections_start_about_one_over_the_rate_apart(rate, stagger):
    """k connections every p ms with k / p within 5 % of rate / 1000 where whole milliseconds allow it (at
    300 req/s: 2 every 7 ms, 286 a second; 1 every 3 ms would be 11 % fast); below 20 req/s, the slowest h2load
    takes."""
    assert h2load.connection_stagger(rate) == stagger
    k, p = stagger
    if rate >= 20:
        assert abs(k / p * 1000 - rate) <= 0.05 * rate


def test_the_log_gives_start_status_and_latency_and_a_missing_status_is_a_transport_error():
    start, status, lat = h2load.parse_log("1000000\t200\t1500\n1000400\t503\t90\n\n1000900\t0\t0\n")
    assert start.tolist() == [1000000, 1000400, 1000900]
    assert status.tolist() == [200, 503, TRANSPORT_ERROR]
    assert lat.tolist() == [1500, 90, 0]
    empty = h2load.parse_log("")
    assert [a.size for a in empty] == [0, 0, 0]


def test_closed_loop_samples_are_sends_in_order_and_unanswered_requests_land_where_asked():
    start = np.array([3_500_000, 1_250_000, 2_000_000])
    status = np.array([200, 200, 429])
    lat = np.array([2000, 1000, 500])
    s = h2load.samples(start, status, lat, 1_000_000, unanswered=2, unanswered_at=1.5,
                       unanswered_status=CLIENT_TIMEOUT)
    assert s.scheduled.tolist() == [0.25, 1.0, 2.5, 1.5, 1.5]
    assert s.status.tolist() == [200, 429, 200, CLIENT_TIMEOUT, CLIENT_TIMEOUT]
    assert s.latency[:3].tolist() == [0.001, 0.0005, 0.002] and np.isnan(s.latency[3:]).all()
    assert s.done[:3].tolist() == pytest.approx([0.251, 1.0005, 2.502])
    assert np.isnan(s.send_lag).all() and s.peak_inflight == 1
    # the window of [0.5, 2.0): the 429 and both unanswered requests
    w = s.window(0.5, 2.0)
    row = summarize(w.latency, w.status, 1.5, 2.0)
    assert (row["requests"], row["ok"], row["errors"]) == (3, 0, 3)
    assert row["errors_by_status"] == "client-timeout:2 429:1"


def test_open_loop_latency_counts_from_when_each_send_was_due():
    """10 req/s, 6 planned: sends due at 0.0, 0.1, ... after the first. The third went 50 ms late (its connection
    was still waiting), the fourth 90 ms late and was answered after the client timeout, the fifth 150 ms late
    with a 503 (kept: h2load sent it), and the sixth was never answered."""
    t0 = 5_000_000
    sent_ms = [10, 110, 260, 560, 400]  # offsets of the sends from t0, out of order as logged
    start = np.array([t0 + ms * 1000 for ms in sent_ms])
    status = np.array([200, 200, 200, 503, 200])
    lat = np.array([1000, 1000, 1000, 1000, 3_000_000])
    s = h2load.samples(start, status, lat, t0, rate=10.0, planned=6, client_timeout_s=2.0)
    assert s.scheduled.tolist() == pytest.approx([0.01, 0.11, 0.21, 0.31, 0.41, 0.51])
    assert s.send_lag[:5].tolist() == pytest.approx([0.0, 0.0, 0.05, 0.09, 0.15]) and np.isnan(s.send_lag[5])
    assert s.status.tolist() == [200, 200, 200, CLIENT_TIMEOUT, 503, TRANSPORT_ERROR]
    # the third answer came 51 ms after it was due, not 1 ms after it was sent; the 503's 151 ms after
    assert s.latency[:3].tolist() == pytest.approx([0.001, 0.001, 0.051]) and np.isnan(s.latency[3])
    assert s.latency[4] == pytest.approx(0.151) and np.isnan(s.latency[5])
    assert s.peak_inflight == 2  # the slow answer overlaps the next send
    row = summarize(s.latency, s.status, 0.6, 10.0, send_lags=s.send_lag)
    assert row["errors_by_status"] == "503:1 client-timeout:1 transport:1"
    assert row["client_overload"] == 0 and row["send_lag_p99_ms"] == pytest.approx(150.0)


def test_a_transport_error_has_no_latency_and_the_summary_line_gives_the_counts():
    start, status, lat = h2load.parse_log("2000000\t0\t123\n")
    s = h2load.samples(start, status, lat, 2_000_000)
    assert s.status.tolist() == [TRANSPORT_ERROR] and np.isnan(s.latency).all()
    out = ("finished in 2.00s, 2000.00 req/s, 662.11KB/s\n"
           "requests: 4000 total, 3990 started, 3980 done, 3970 succeeded, 10 failed, 10 errored, 0 timeout\n")
    assert h2load.request_counts(out) == {"total": 4000, "started": 3990, "done": 3980, "succeeded": 3970,
                                          "failed": 10, "errored": 10, "timeout": 0}
    assert h2load.request_counts("no summary") == {}
