"""The load toolkit's parts (bench/sweep/): schedules, statistics, requests, the open- and closed-loop drivers
against fake servers, the report without matplotlib, and the command line; in-process. Sweeps against a real server
are in tests/integration/test_sweep.py."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.error

import numpy as np
import orjson
import pytest

from bench.sweep import cli, report
from bench.sweep.arrivals import arrival_times
from bench.sweep.drivers import CLIENT_OVERLOAD, CLIENT_TIMEOUT, TRANSPORT_ERROR, drive_closed, drive_open
from bench.sweep.report import batch_counters, measured_wall, percentile, summarize
from bench.sweep.requests import build_request, decode_response, parse_shape, resolve_inputs

CSV_COLUMNS = [
    "step", "mode", "offered_qps", "scheduled_qps", "concurrency", "achieved_qps", "requests", "ok", "errors",
    "p50_ms", "p90_ms", "p99_ms", "max_ms", "avg_batch_size", "errors_by_status", "client_overload",
    "peak_inflight", "send_lag_p99_ms", "duration_s", "avg_queue_depth", "device_busy_share",
]


# ------------------------------------------------------------------------------------------------ schedules


def test_constant_schedule_is_exact():
    t = arrival_times(20, 1.5, "constant")
    assert t.size == 30
    np.testing.assert_array_equal(t, np.arange(30) / 20)
    np.testing.assert_allclose(arrival_times(3, 1.0, "constant"), [0, 1 / 3, 2 / 3])
    assert arrival_times(0.5, 10, "constant").tolist() == [0, 2, 4, 6, 8]


def test_poisson_schedule_mean_rate_and_exponential_gaps_for_a_fixed_seed():
    rate, duration = 200.0, 50.0
    t = arrival_times(rate, duration, "poisson", seed=7)
    assert t.size == pytest.approx(rate * duration, rel=0.03)  # sd is 1 % of 10,000 arrivals
    assert np.all(np.diff(t) > 0) and t[0] > 0 and t[-1] < duration
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: coefficient of variation 1
    np.testing.assert_array_equal(t, arrival_times(rate, duration, "poisson", seed=7))  # reproducible
    assert not np.array_equal(t[:100], arrival_times(rate, duration, "poisson", seed=8)[:100])
    with pytest.raises(ValueError):
        arrival_times(10, 1, "bursty")
    with pytest.raises(ValueError):
        arrival_times(0, 1)


def test_parse_rates_and_shapes():
    assert cli.parse_list("20,40, 80") == [20.0, 40.0, 80.0]
    assert cli.parse_list("10:50:20") == [10.0, 30.0, 50.0]
    assert cli.parse_list("1,4,16", int) == [1, 4, 16]
    with pytest.raises(ValueError):
        cli.parse_list("0,10")
    assert parse_shape("1x3x48x320") == (None, [1, 3, 48, 320])
    assert parse_shape("x:1,3,48,320") == ("x", [1, 3, 48, 320])
    for typo in ("1,3,x,224,224", "1,,3", "a,b", "1,-3", ""):  # a stray part was dropped silently before
        with pytest.raises(ValueError, match="--shape: a shape is non-negative integers"):
            parse_shape(typo)


def test_a_rate_that_is_not_a_number_names_its_option(capsys):
    from bench.__main__ import main

    assert main(["sweep", "--url", "127.0.0.1:9", "--model", "m", "--rates", "abc", "--out", "/tmp/never"]) == 2
    assert "--rates 'abc': could not convert string to float: 'abc'" in capsys.readouterr().err


def test_comma_list_is_the_bench_scripts_list_option():
    import argparse

    from bench.scripts import comma_list

    assert comma_list(int)("1, 4,16,") == [1, 4, 16]
    assert comma_list(float)("") == []
    assert comma_list(str)("ours,bare") == ["ours", "bare"]
    p = argparse.ArgumentParser()
    p.add_argument("--clients", type=comma_list(int))
    with pytest.raises(SystemExit):
        p.parse_args(["--clients", "1,x"])
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected a comma-separated list \(got '1,x'\)"):
        comma_list(int)("1,x")


# ----------------------------------------------------------------------------------------------- statistics


def test_percentiles_are_nearest_rank():
    v = np.arange(1, 101, dtype=float)
    assert [percentile(v, q) for q in (50, 90, 99, 100)] == [50, 90, 99, 100]
    assert percentile(np.array([5.0]), 99) == 5.0
    assert percentile(np.array([1.0, 2.0, 3.0, 1000.0]), 50) == 2.0  # an observed value, not interpolated
    assert np.isnan(percentile(np.array([]), 50))


def test_summarize_counts_errors_by_status_and_uses_only_ok_latencies():
    lat = np.array([0.010, 0.020, 0.030, 0.040, 5.0, 0.001, np.nan, np.nan])
    st = np.array([200, 200, 200, 200, 504, 503, CLIENT_OVERLOAD, CLIENT_OVERLOAD])
    row = summarize(lat, st, wall_s=2.0, offered=4.0, send_lags=np.array([0.001] * 6 + [0.5, 0.5]))
    assert row["requests"] == 8 and row["ok"] == 4 and row["errors"] == 4
    assert row["achieved_qps"] == 2.0 and row["offered_qps"] == 4.0
    assert (row["p50_ms"], row["p90_ms"], row["p99_ms"], row["max_ms"]) == pytest.approx((20, 40, 40, 40))
    assert row["errors_by_status"] == "client-overload:2 503:1 504:1"
    assert row["client_overload"] == 2
    assert row["send_lag_p99_ms"] == pytest.approx(500)
    empty = summarize(np.array([np.nan]), np.array([TRANSPORT_ERROR]), 1.0, 10.0)
    assert empty["ok"] == 0 and np.isnan(empty["p99_ms"]) and empty["errors_by_status"] == "transport:1"
    assert empty["send_lag_p99_ms"] is None


def test_measured_wall_extends_past_the_window_when_answers_come_late():
    assert measured_wall(1.5, np.array([0.1, 1.2, 1.46])) == 1.5
    assert measured_wall(1.0, np.array([1.2, 3.5, np.nan]), window_start=0.5) == 3.0
    assert measured_wall(1.0, np.array([np.nan])) == 1.0


def test_batch_counters_from_ours_and_tritons_metrics():
    ours = """# HELP batcher_inference_count_total Rows
# TYPE batcher_inference_count_total counter
batcher_inference_count_total{model="m",version="1"} 30.0
batcher_inference_count_total{model="m",version="2"} 10.0
batcher_inference_count_total{model="other",version="1"} 99.0
# HELP batcher_execution_count_total Batches
# TYPE batcher_execution_count_total counter
batcher_execution_count_total{model="m",version="1"} 10.0
batcher_execution_count_total{model="m",version="2"} 10.0
"""
    assert batch_counters(ours, "m") == (40.0, 20.0)
    assert batch_counters(ours, "m", "1") == (30.0, 10.0)
    assert batch_counters(ours, "absent") == (0.0, 0.0)
    triton = """# TYPE nv_inference_count counter
nv_inference_count{model="m",version="1"} 64
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="m",version="1"} 8
"""
    assert batch_counters(triton, "m") == (64.0, 8.0)
    assert batch_counters(triton.replace("# TYPE", "# NOTYPE"), "m") == (64.0, 8.0)  # untyped samples
    assert batch_counters("# TYPE up gauge\nup 1\n", "m") is None
    assert batch_counters(None, "m") is None
    assert report.avg_batch((40, 20), (100, 30)) == 6.0
    assert report.avg_batch((40, 20), (40, 20)) is None and report.avg_batch(None, (1, 1)) is None


def test_queue_seconds_and_average_queue_depth():
    ours = """# TYPE batcher_queue_duration_seconds histogram
batcher_queue_duration_seconds_sum{model="m",version="1"} 1.5
batcher_queue_duration_seconds_count{model="m",version="1"} 10.0
batcher_queue_duration_seconds_sum{model="m",version="2"} 0.5
batcher_queue_duration_seconds_count{model="m",version="2"} 2.0
"""
    assert report.queue_seconds(ours, "m") == 2.0
    assert report.queue_seconds(ours, "m", "2") == 0.5
    assert report.queue_seconds(ours, "absent") == 0.0
    triton = '# TYPE nv_inference_queue_duration_us counter\nnv_inference_queue_duration_us{model="m",version="1"} 3e6\n'
    assert report.queue_seconds(triton, "m") == pytest.approx(3.0)
    assert report.queue_seconds("# TYPE up gauge\nup 1\n", "m") is None and report.queue_seconds(None, "m") is None
    # 12 request-seconds of queueing over 4 seconds: 3 requests waiting on average (Little's law)
    assert report.avg_queue_depth((2.0, 100.0), (14.0, 104.0)) == 3.0
    assert report.avg_queue_depth((None, 100.0), (14.0, 104.0)) is None
    assert report.avg_queue_depth((2.0, 100.0), (14.0, 100.0)) is None


def test_device_busy_share_from_the_device_seconds_between_two_scrapes():
    def text(busy_m: float, busy_other: float) -> str:
        return ("# TYPE batcher_device_busy_seconds counter\n"
                f'batcher_device_busy_seconds_total{{model="m",version="1"}} {busy_m}\n'
                f'batcher_device_busy_seconds_total{{model="other",version="1"}} {busy_other}\n')

    assert report.device_busy_seconds(text(1.5, 9.0), "m") == 1.5
    assert report.device_busy_seconds("# TYPE up gauge\nup 1\n", "m") is None  # a CPU model, another server
    # 3.2 s of device time over a 4 s window: the device busy 80 % of it
    before = (report.device_busy_seconds(text(1.5, 9.0), "m"), 100.0)
    after = (report.device_busy_seconds(text(4.7, 20.0), "m"), 104.0)
    assert report.per_second(before, after) == pytest.approx(0.8)


# ------------------------------------------------------------------------------------------ inputs, requests


def test_resolve_inputs_from_metadata_and_command_line():
    meta = {"name": "rec", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3, 48, -1]}]}
    with pytest.raises(ValueError, match="dynamic dims"):
        resolve_inputs(meta)
    full = resolve_inputs(meta, shapes={None: [2, 3, 48, 320]})
    assert [(s.name, s.datatype, s.shape) for s in full] == [("x", "FP32", [2, 3, 48, 320])]
    assert resolve_inputs(meta, shapes={None: [1, 320]})[0].shape == [1, 3, 48, 320]  # just the -1 dims
    fixed = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 224, 224]}]}
    assert resolve_inputs(fixed, batch_size=4)[0].shape == [4, 3, 224, 224]
    with pytest.raises(ValueError, match="no input 'y'"):
        resolve_inputs(fixed, input_name="y")
    a = np.zeros((2, 5), np.int64)
    assert resolve_inputs(fixed, arrays={None: a})[0].datatype == "INT64"
    assert resolve_inputs(None, input_name="x", datatype="FP16", shapes={None: [1, 8]})[0].shape == [1, 8]
    with pytest.raises(ValueError, match="no model metadata"):
        resolve_inputs(None, shapes={None: [1, 8]})


def test_build_request_binary_and_json_with_deadline():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    body, headers = build_request([("input", "FP32", x)], binary=True, timeout_us=50_000)
    n = int(headers["Inference-Header-Content-Length"])
    head = orjson.loads(body[:n])
    assert head["parameters"] == {"timeout": 50_000, "binary_data_output": True}
    assert head["inputs"][0]["parameters"]["binary_data_size"] == 24
    np.testing.assert_array_equal(np.frombuffer(body[n:], np.float32), x.ravel())
    body, headers = build_request([("input", "FP32", x)], binary=False)
    assert headers["Content-Type"] == "application/json" and "parameters" not in orjson.loads(body)
    assert orjson.loads(body)["inputs"][0] == {"name": "input", "datatype": "FP32", "shape": [2, 3],
                                              "data": [0, 1, 2, 3, 4, 5]}
    sb, sh = build_request([("s", "BYTES", np.array([b"ab", b"c"], dtype=object))])
    n = int(sh["Inference-Header-Content-Length"])
    assert sb[n:] == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"


def test_build_request_priority_output_encoding_and_several_inputs():
    a, b = np.ones((1, 2), np.int64), np.array([[True, False]])
    body, headers = build_request([("a", "INT64", a), ("b", "BOOL", b)], priority=1, binary_output=False)
    n = int(headers["Inference-Header-Content-Length"])
    head = orjson.loads(body[:n])
    assert head["parameters"] == {"priority": 1}
    assert [i["parameters"]["binary_data_size"] for i in head["inputs"]] == [16, 2]
    assert body[n:] == a.tobytes() + b.tobytes()
    body, _ = build_request([("s", "BYTES", np.array(["héllo", b"x"], dtype=object))], binary=False,
                            binary_output=True, timeout_us=0)
    assert orjson.loads(body) == {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [2], "data": ["héllo", "x"]}],
                                  "parameters": {"timeout": 0, "binary_data_output": True}}


def test_decode_response_json_binary_and_bytes():
    y = np.arange(6, dtype=np.float32).reshape(2, 3)
    s = b"\x02\x00\x00\x00ab\x00\x00\x00\x00"
    head = orjson.dumps({"model_name": "m", "outputs": [
        {"name": "y", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": 24}},
        {"name": "s", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": len(s)}},
        {"name": "j", "datatype": "INT32", "shape": [1, 2], "data": [7, 8]}]})
    got_head, out = decode_response(head + y.tobytes() + s, {"Inference-Header-Content-Length": str(len(head))})
    assert got_head["model_name"] == "m"
    np.testing.assert_array_equal(out["y"], y)
    assert out["s"].tolist() == [b"ab", b""] and out["j"].dtype == np.int32 and out["j"].tolist() == [[7, 8]]
    assert decode_response(b'{"error": "no"}', {}) == ({"error": "no"}, {})


# -------------------------------------------------------------------------------------------------- drivers


def _serial_server(service_s: float, stall_at: int, stall_s: float):
    """A fake server answering one request at a time; its ``stall_at``-th request takes ``stall_s``."""
    lock = asyncio.Lock()
    seen = [0]

    async def send() -> int:
        async with lock:
            k = seen[0]
            seen[0] += 1
            await asyncio.sleep(stall_s if k == stall_at else service_s)
        return 200

    return send


async def test_open_loop_latency_counts_from_the_scheduled_time_so_a_stall_shows_up():
    """50 req/s against a one-at-a-time server that stalls 300 ms on request 5: every request scheduled during
    the stall waits it out, and its latency says so (a closed-loop client would see one slow request)."""
    offsets = arrival_times(50, 1.0)
    s = await drive_open(offsets, _serial_server(0.002, 5, 0.300), max_inflight=100, max_lag_s=0.1)
    assert (s.status == 200).all()
    lat_ms = s.latency * 1e3
    assert lat_ms[5] >= 290
    assert lat_ms[6] >= 240  # scheduled 20 ms after the stall began; answered after it ended
    assert (lat_ms >= 100).sum() >= 10  # ~15 requests fell into the 300 ms stall
    assert percentile(lat_ms, 90) >= 100
    assert np.median(lat_ms[25:]) < 50  # the queue drained afterwards
    assert s.peak_inflight >= 10
    # the same stall seen by a closed-loop client: coordinated omission hides it
    c = await drive_closed(1, _serial_server(0.002, 5, 0.300), until=1.0)
    assert (c.latency * 1e3 >= 100).sum() == 1


async def test_open_loop_latency_includes_the_clients_own_lateness():
    """Request 0 blocks the client for 60 ms: request 1 (scheduled at 20 ms) goes out ~40 ms late and its
    latency includes that, although the fake server answers at once."""
    calls = [0]

    async def send() -> int:
        calls[0] += 1
        if calls[0] == 1:
            time.sleep(0.060)  # noqa: ASYNC251 - blocks the event loop, as a busy client would
        return 200

    s = await drive_open(arrival_times(50, 0.2), send, max_lag_s=0.5)
    assert (s.status == 200).all()
    assert s.send_lag[1] >= 0.030
    assert s.latency[1] >= 0.030


async def test_open_loop_counts_requests_over_the_inflight_cap_as_client_overload():
    async def hang() -> int:
        await asyncio.sleep(0.4)
        return 200

    s = await drive_open(arrival_times(100, 0.3), hang, max_inflight=5, max_lag_s=0.2)
    assert (s.status == 200).sum() == 5 and s.peak_inflight == 5
    assert (s.status == CLIENT_OVERLOAD).sum() == 25
    assert np.isnan(s.latency[s.status == CLIENT_OVERLOAD]).all()


async def test_open_loop_does_not_send_requests_that_are_too_late():
    calls = [0]

    async def send() -> int:
        calls[0] += 1
        if calls[0] == 1:
            time.sleep(0.3)  # noqa: ASYNC251 - the client stalls: requests due meanwhile cannot be sent in time
        return 200

    s = await drive_open(arrival_times(100, 0.6), send, max_lag_s=0.05)
    over = s.status == CLIENT_OVERLOAD
    assert over.sum() >= 15  # due at 10..~250 ms, found more than 50 ms late
    assert (s.status[-20:] == 200).all()  # back on schedule afterwards


async def test_closed_loop_stops_after_count_requests_in_all():
    calls = [0]

    async def send() -> int:
        calls[0] += 1
        await asyncio.sleep(0.001)
        return 200

    s = await drive_closed(3, send, count=10)
    assert calls[0] == 10 and s.status.size == 10 and (s.status == 200).all() and s.peak_inflight == 3
    assert (s.latency > 0).all()
    with pytest.raises(ValueError):
        await drive_closed(1, send)


async def test_drivers_turn_exceptions_into_client_side_statuses():
    async def boom() -> int:
        raise ConnectionResetError

    async def slow() -> int:
        raise asyncio.TimeoutError

    assert (await drive_open(arrival_times(100, 0.05), boom)).status.tolist() == [TRANSPORT_ERROR] * 5
    assert set((await drive_closed(2, slow, until=0.05)).status.tolist()) == {CLIENT_TIMEOUT}


def _help(capsys, argv: list[str]) -> str:
    from bench.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_cli_help_describes_every_option(capsys):
    assert "sweep" in _help(capsys, ["--help"])
    text = _help(capsys, ["sweep", "--help"])
    for opt in ["--url", "--model", "--rates", "--duration", "--out", "--mode", "--arrivals", "--concurrency",
                "--processes", "--json", "--timeout-us", "--shape", "--input-file", "--warmup", "--seed",
                "--input-name", "--datatype", "--metrics-url", "--max-inflight", "--max-send-lag-ms"]:
        assert opt in text, opt
    for column in CSV_COLUMNS:
        assert column in text, column
    assert report.COLUMNS == CSV_COLUMNS


# ---------------------------------------------------------------------------------------------------- report


def _row(step: int, offered: float) -> dict:
    lat = np.array([0.010, 0.020, 0.030, np.nan])
    return {"step": step, "mode": "open", "concurrency": None, "scheduled_qps": offered, "duration_s": 1.0,
            **summarize(lat, np.array([200, 200, 200, CLIENT_OVERLOAD]), 1.0, offered, send_lags=np.zeros(4)),
            "peak_inflight": 2, "avg_batch_size": 1.5}


def test_tables_csv_and_json_of_the_benches(tmp_path):
    rows = [{"a": 1.23456, "b": "x"}, {"a": float("nan"), "c": None}]
    raw = report.write_csv(tmp_path / "raw.csv", rows)
    assert raw.read_text().splitlines() == ["a,b,c", "1.23456,x,", "nan,,"]  # as csv.DictWriter writes them
    assert (report.write_csv(tmp_path / "f.csv", rows, ["a", "b"], digits=2).read_text().splitlines()
            == ["a,b", "1.23,x", ","])
    assert report.markdown_table(rows) == "| a | b | c |\n|---|---|---|\n| 1.23456 | x |  |\n| nan |  | None |"
    assert report.text_table([("value", "a", 1), ("name", "b", 0)], rows) == (
        "value  name\n-----  ----\n  1.2     x\n")  # right-aligned, blank cells for nan and missing
    assert report.text_table([("value", "a", 1), ("name", "b", 0)], rows, last_left=True) == (
        "value  name\n-----  ----\n  1.2  x\n")
    assert report.json_safe({"x": [float("inf"), 1.0, {"y": float("nan")}], "p": tmp_path}) == {
        "x": [None, 1.0, {"y": None}], "p": str(tmp_path)}
    assert report.read_csv(raw) == [{"a": "1.23456", "b": "x", "c": ""}, {"a": "nan", "b": "", "c": ""}]


def test_report_without_matplotlib_writes_csv_and_json_and_names_the_extra(tmp_path, monkeypatch, capsys):
    """Issue 11: without matplotlib the sweep's CSV and JSON are written and one line says what to install."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    rows = [_row(0, 3.0), _row(1, 6.0)]
    written = report.save_sweep(tmp_path, rows, {"settings": {"model": "m"}})
    assert [p.name for p in written] == ["sweep.csv", "sweep.json"]
    assert report.plot_sweep(rows, tmp_path / "sweep.png", "title") is None
    assert not (tmp_path / "sweep.png").exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib" in err and 'pip install -e ".[bench]"' in err
    assert len(report.read_csv(tmp_path / "sweep.csv")) == 2
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc["settings"] == {"model": "m"} and doc["rows"][1]["offered_qps"] == 6.0


def test_cli_writes_csv_and_json_after_every_step_and_exits_0_without_matplotlib(tmp_path, monkeypatch, capsys):
    """Issue 11 through the command line: each step's CSV/JSON are on disk before the next step runs, and a
    missing matplotlib costs the plot only (one line naming the extra), exit 0."""
    from bench.__main__ import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "out"
    seen_on_disk: list[int] = []

    def fake_run_sweep(cfg, body, headers, rows, on_step, sigterm_interrupts):
        assert sigterm_interrupts
        assert cfg.rates == [3.0, 6.0] and cfg.model == "m"
        for k, rate in enumerate(cfg.rates):
            rows.append(_row(k, rate))
            on_step(rows)
            seen_on_disk.append(len(report.read_csv(out / "sweep.csv")))
        return rows

    def no_metadata(url, timeout=10.0):  # a server without the metadata endpoint
        raise urllib.error.HTTPError(url, 501, "Not Implemented", None, None)

    monkeypatch.setattr(cli, "http_get", no_metadata)  # no model metadata: the input comes from the options
    monkeypatch.setattr(cli, "run_sweep", fake_run_sweep)
    code = main(["sweep", "--url", "127.0.0.1:9", "--model", "m", "--input-name", "x", "--datatype", "FP32",
                 "--shape", "1,4", "--rates", "3,6", "--duration", "1", "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert seen_on_disk == [1, 2]
    assert [r["offered_qps"] for r in report.read_csv(out / "sweep.csv")] == ["3.00", "6.00"]
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [1, 4]}] and len(doc["rows"]) == 2
    assert not (out / "sweep.png").exists()
    assert [line for line in captured.err.splitlines() if "matplotlib" in line] == [report.NO_MATPLOTLIB]
    assert "p99 ms" in captured.out  # the table is still printed


def test_the_sweep_cli_refuses_a_url_that_is_not_http_before_sending_anything(tmp_path, monkeypatch, capsys):
    """An ``ftp://`` URL is refused with exit 2 and its scheme named, before any request (it used to be tried as
    FTP, and waited out its timeout against a real host); ``https://`` and ``host:port`` are taken."""
    from bench.__main__ import main
    from bench.sweep.requests import base_url

    sent = []
    monkeypatch.setattr(cli, "http_get", lambda url, timeout=10.0: sent.append(url))
    assert main(["sweep", "--url", "ftp://example.com:8000", "--model", "m", "--rates", "3", "--out",
                 str(tmp_path / "out"), "--no-progress"]) == 2
    assert "a ftp:// URL; the KServe v2 HTTP protocol needs http:// or https://" in capsys.readouterr().err
    assert sent == [] and not (tmp_path / "out").exists()
    assert base_url("https://h:1/") == "https://h:1" and base_url("h:1") == "http://h:1"
    assert base_url("HTTP://h:1") == "HTTP://h:1" and base_url("[::1]:8000") == "http://[::1]:8000"
    assert base_url("http://h:1/prefix/") == "http://h:1/prefix"  # a server behind a path prefix
    for bad, says in (("", "--url is empty"), ("  ", "--url is empty"), ("http:/h:1", "expected host:port"),
                      ("//h:1", "expected host:port"), ("http://", "no host"), ("http:///h:1", "no host"),
                      ("FILE:///etc/passwd", "a file:// URL"), ("127.0.0.1:notaport", "a port from 1 to 65535"),
                      (":8000", "a host"), ("http://:8000", "a host"), ("h:99999", "a port from 1"),
                      ("h:0", "a port from 1"), ("http://h:1?x", "no query"), ("http://h:1#f", "no query")):
        with pytest.raises(ValueError, match=says):
            base_url(bad)
    assert main(["sweep", "--url", "", "--model", "m", "--rates", "3", "--out", str(tmp_path / "out2"),
                 "--no-progress"]) == 2
    assert "--url is empty" in capsys.readouterr().err and sent == [] and not (tmp_path / "out2").exists()


def test_the_sweep_cli_names_an_unreachable_server_a_missing_model_and_a_sweep_with_no_answer(tmp_path, monkeypatch,
                                                                                             capsys):
    """No server: exit 2 naming the URL (not a hint about --shape). A 404 for the metadata: exit 2 naming the
    model. Steps that all ran with not one 200: exit 1 with the errors (a misconfiguration, not a measurement)."""
    from bench.__main__ import main

    args = ["sweep", "--url", "127.0.0.1:9", "--model", "m", "--rates", "3", "--duration", "1", "--out",
            str(tmp_path / "out"), "--no-progress"]

    def refused(url, timeout=10.0):
        raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

    monkeypatch.setattr(cli, "http_get", refused)
    assert main(args) == 2
    assert "cannot reach a server at http://127.0.0.1:9" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # a sweep that could not start leaves no folder

    def not_found(url, timeout=10.0):
        raise urllib.error.HTTPError(url, 404, "Not Found", None, None)

    monkeypatch.setattr(cli, "http_get", not_found)
    assert main(args) == 2
    assert "the server at http://127.0.0.1:9 has no model 'm'" in capsys.readouterr().err

    def no_metadata(url, timeout=10.0):
        raise urllib.error.HTTPError(url, 501, "Not Implemented", None, None)

    def all_refused(cfg, body, headers, rows, on_step, sigterm_interrupts):
        rows.append({**_row(0, 3.0), "ok": 0, "errors": 3, "errors_by_status": "transport:3"})
        on_step(rows)
        return rows

    monkeypatch.setattr(cli, "http_get", no_metadata)
    monkeypatch.setattr(cli, "run_sweep", all_refused)
    assert main([*args, "--input-name", "x", "--datatype", "FP32", "--shape", "1,4"]) == 1
    assert "error: no request was answered 200 in any step (transport:3)" in capsys.readouterr().err


def test_busy_suite_reads_pytests_summary_line():
    from bench.busy_suite import summary_counts

    out = "....F\n=== short test summary info ===\nFAILED tests/x.py::t\n3 failed, 700 passed, 2 skipped, 1 error in 9.1s\n"
    assert summary_counts(out) == {"passed": 700, "failed": 3, "errors": 1, "skipped": 2}
    assert summary_counts("718 passed in 234.82s (0:03:54)\n") == {"passed": 718, "failed": 0, "errors": 0,
                                                                   "skipped": 0}
    assert summary_counts("no tests ran\n") == {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}


def test_gil_held_share_per_process_from_a_py_spy_gil_profile():
    """bench.gpu_scale part p: from ``py-spy record --gil --format raw`` lines (stack;...;frame count), the share of
    the expected samples in which each process held its GIL, then its functions of this project."""
    from bench.gpubench.profile import gil_held

    engine = 'process 10:"python -m batcher serve";process 11:"spawn_main"'
    front = 'process 10:"python -m batcher serve";process 12:"spawn_main"'
    raw = "\n".join([
        f"{engine};run (batcher/supervisor.py:84);plan_batch (batcher/batching.py:143) 300",
        f"{engine};Thread.run (threading.py:1010);run_batch (batcher/executor.py:132) 100",
        f"{front};infer (batcher/routes.py:98) 160",
        "a line that is no sample",
    ])
    rows = gil_held(raw, {11: "engine-gpu0", 12: "frontend-0"}, expected=800)
    held = {r["role"]: r["share"] for r in rows if r["function"] == "(GIL held)"}
    assert held == {"engine-gpu0": 0.5, "frontend-0": 0.2}
    plan = next(r for r in rows if r["function"] == "plan_batch (batcher/batching.py)")
    assert (plan["role"], plan["samples"], plan["share"]) == ("engine-gpu0", 300, 0.75)


def test_a_sigterm_sent_from_inside_a_finalizer_still_stops_the_steps():
    """SIGTERM during the steps cancels them (their ``finally`` runs) and raises KeyboardInterrupt, even when the
    signal lands while a ``__del__`` runs: a Python handler raising there is "Exception ignored" and lost (the CI
    failure of test_sigterm_stops_an_h2load_sweep_with_its_h2load); the event loop's handler is not. The handler
    in place before is put back."""
    import gc
    import os
    import signal

    from bench.sweep.run import _interrupted_by_sigterm

    cleaned: list[str] = []

    class SignalsInItsFinalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))  # Python code after the signal: where a raising handler would run

    async def steps() -> list[dict]:
        try:
            SignalsInItsFinalizer()
            gc.collect()
            await asyncio.Event().wait()  # a step that would never end by itself
        finally:
            cleaned.append("finally")
        return []

    def before(signum, frame):
        raise AssertionError("the Python handler ran during the steps")

    previous = signal.signal(signal.SIGTERM, before)
    try:
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(_interrupted_by_sigterm(steps()))
        assert cleaned == ["finally"]
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_cpu_list_reads_numbers_and_ranges():
    from bench.gpubench.scale import cpu_list

    assert cpu_list("0-2,5") == {0, 1, 2, 5}
    assert cpu_list("3") == {3}


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs two CPUs to place apart")
def test_placed_pins_the_engine_threads_and_the_front_ends_apart_and_gives_this_process_its_cpus_back():
    """bench.gpu_scale --engine-cpus: processes named as the supervisor names them (``engine-...``,
    ``frontend-...``) under the server's pid are placed, every thread of the engine; this process runs the step on
    the other CPUs and has all of them back after it."""
    import os
    import subprocess
    import types

    from bench.gpubench.scale import placed

    every = os.sched_getaffinity(0)
    first = min(every)
    # a "server" with an engine child (two threads) and a front-end child, named through /proc/self/comm
    code = ("import sys, threading, time; open('/proc/self/comm', 'w').write(sys.argv[1]); "
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); print('up', flush=True); "
            "time.sleep(60)")
    server = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys, time; ps = [subprocess.Popen([sys.executable, '-c', {code!r}, n]) "
                               "for n in ('engine-gpu0', 'frontend-0')]; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        from bench.peers import descendants, role_of

        while time.monotonic() < deadline:
            roles = {role_of(p): p for p in descendants(server.pid)}
            engine = roles.get("engine")
            if "frontend" in roles and engine and len(os.listdir(f"/proc/{engine}/task")) >= 2:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the stand-in server's children did not start")
        args = types.SimpleNamespace(engine_cpus={first}, engine_nice=None)
        with placed(types.SimpleNamespace(proc=server), args):
            assert os.sched_getaffinity(0) == every - {first}
            for tid in os.listdir(f"/proc/{roles['engine']}/task"):
                assert os.sched_getaffinity(int(tid)) == {first}
            assert os.sched_getaffinity(roles["frontend"]) == every - {first}
        assert os.sched_getaffinity(0) == every
        with placed(types.SimpleNamespace(proc=server), types.SimpleNamespace(engine_cpus=None, engine_nice=None)):
            assert os.sched_getaffinity(0) == every  # neither option: nothing moves
    finally:
        for p in descendants(server.pid)[::-1]:
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(p, 9)
        server.wait()


def test_placed_refuses_cpus_outside_this_process_or_none_left_for_the_others():
    import os
    import types

    from bench.gpubench.scale import placed

    every = os.sched_getaffinity(0)
    server = types.SimpleNamespace(proc=types.SimpleNamespace(pid=os.getpid()))
    for cpus in ({max(every) + 1}, set(every)):
        with pytest.raises(ValueError, match="--engine-cpus"):
            with placed(server, types.SimpleNamespace(engine_cpus=cpus, engine_nice=None)):
                pass
    assert os.sched_getaffinity(0) == every
