"""A step of a sweep driven by nghttp2's ``h2load`` (a native load generator, ``apt install nghttp2-client``)
instead of this package's Python drivers: the same step, the same window and the same row, at a small part of the
client's CPU per request. On a machine with as few cores as the server needs, the Python client takes about as
much CPU per request as the server it measures (``bench/results/peers``); ``h2load`` takes about 35 us.

HTTP/1.1 (``--h1``), one request in flight per connection, each request POSTs the same body with the same
headers; ``--log-file`` gives every request's start (microseconds since the epoch), HTTP status and latency
(microseconds), from which :func:`samples` builds the step's :class:`~bench.sweep.drivers.Samples`.

* Closed loop, ``N`` clients: ``-c N -D SPAN`` (each connection sends again when answered).
* Open loop, ``R`` req/s: ``c`` connections (:func:`open_connections`) each sending ``R / c`` req/s
  (``--rps``), ``-n R * SPAN`` requests in all. The connections are started 1 ms apart (``-r 1 --rate-period 1ms``,
  the finest period h2load takes), so their send times interleave instead of all landing at once; at 4,000 req/s
  the 200 connections take 0.2 s to start, which the warm-up should cover.

Latency counts from the actual send, as h2load measures it. A connection whose answer is later than its next send
time sends late (the catch-up is not counted as waiting: coordinated omission), so an open-loop step spaces each
connection's sends :data:`OPEN_SEND_INTERVAL_S` (50 ms, the peers bench's p99 target) apart: at a step whose p99
is under that, fewer than 1 % of sends can be delayed. A step whose server falls behind shows it as a p99 over the
target or as fewer requests started in the window than offered.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.sweep.drivers import CLIENT_TIMEOUT, TRANSPORT_ERROR, Samples

OPEN_SEND_INTERVAL_S = 0.05  #: seconds between one open-loop connection's sends (the peers bench's p99 target)
CLOSED_TAIL_S = 1.0  #: a closed-loop step runs this much past its window: h2load drops what is in flight at -D
INSTALL_HINT = "h2load (nghttp2) is not installed: apt install nghttp2-client, or use the Python load generator"


def h2load_binary() -> str:
    """The ``h2load`` on ``PATH``.

    Raises:
        RuntimeError: h2load is not installed (:data:`INSTALL_HINT`).
    """
    found = shutil.which("h2load")
    if found is None:
        raise RuntimeError(INSTALL_HINT)
    return found


def open_connections(rate: float, max_inflight: int) -> int:
    """Connections of an open-loop step at ``rate`` req/s: one per :data:`OPEN_SEND_INTERVAL_S` of sends, at
    least 1, at most ``max_inflight`` (h2load has one request in flight per HTTP/1.1 connection)."""
    return max(1, min(max_inflight, math.ceil(rate * OPEN_SEND_INTERVAL_S)))


def planned_requests(rate: float, span_s: float, max_inflight: int) -> int:
    """``-n`` of an open-loop step: ``rate * span_s`` requests, at least one per connection."""
    return max(open_connections(rate, max_inflight), round(rate * span_s))


def command(binary: str, url: str, body_path: Path, headers: dict[str, str], mode: str, level: float,
            span_s: float, max_inflight: int, log_path: Path) -> list[str]:
    """The h2load command of one step: ``mode`` "closed" (``level`` clients for ``span_s`` seconds) or "open"
    (``level`` req/s for ``span_s`` seconds); ``url`` is the full infer URL."""
    cmd = [binary, "--h1", "-d", str(body_path), "--log-file", str(log_path)]
    for k, v in headers.items():
        cmd += ["-H", f"{k}: {v}"]
    if mode == "closed":
        cmd += ["-c", str(int(level)), "-D", f"{max(1, round(span_s * 1e3))}ms"]
    elif mode == "open":
        conns = open_connections(level, max_inflight)
        cmd += ["-c", str(conns), "--rps", f"{level / conns:.6g}", "-r", "1", "--rate-period", "1ms",
                "-n", str(planned_requests(level, span_s, max_inflight))]
    else:
        raise ValueError(f"mode must be open or closed, got {mode!r}")
    return [*cmd, url]


def parse_log(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """h2load's ``--log-file`` lines (``start_us<TAB>status<TAB>latency_us``): the three columns as int64 arrays.
    A status of 0 or less (no answer) is :data:`~bench.sweep.drivers.TRANSPORT_ERROR`."""
    rows = [ln.split("\t") for ln in text.splitlines() if ln.strip()]
    arr = np.array([[int(c) for c in r[:3]] for r in rows], dtype=np.int64).reshape(-1, 3)
    status = np.where(arr[:, 1] > 0, arr[:, 1], TRANSPORT_ERROR)
    return arr[:, 0], status, arr[:, 2]


def samples(start_us: np.ndarray, status: np.ndarray, latency_us: np.ndarray, t0_us: int, *,
            unanswered: int = 0, unanswered_at: float = 0.0, unanswered_status: int = TRANSPORT_ERROR) -> Samples:
    """The step's samples, offsets in seconds from ``t0_us`` (the step's start); ``unanswered`` requests h2load
    started but never logged (no answer: transport errors, a step stopped at its time limit, or a closed-loop
    step's requests in flight when its duration ran out) count at offset ``unanswered_at`` with
    ``unanswered_status``. ``send_lag`` is unknown (nan)."""
    order = np.argsort(start_us, kind="stable")
    sched = (start_us[order] - t0_us) / 1e6
    lat = latency_us[order] / 1e6
    st = status[order].astype(np.int32)
    if unanswered:
        sched = np.concatenate([sched, np.full(unanswered, float(unanswered_at))])
        lat = np.concatenate([lat, np.full(unanswered, np.nan)])
        st = np.concatenate([st, np.full(unanswered, unanswered_status, np.int32)])
    lat = np.where(st == TRANSPORT_ERROR, np.nan, lat)
    return Samples(sched, lat, st, sched + lat, np.full(sched.size, np.nan), peak_inflight=0)


def request_counts(output: str) -> dict[str, int]:
    """The counts of h2load's summary line ``requests: T total, N started, D done, S succeeded, F failed, E
    errored, O timeout`` by name (``{"total": T, "started": N, ...}``); empty if there is none."""
    for line in output.splitlines():
        if line.startswith("requests:"):
            pairs = (part.split() for part in line.split(":", 1)[1].split(","))
            return {w[1]: int(w[0]) for w in pairs if len(w) == 2 and w[0].isdigit()}
    return {}


async def run_step(url: str, body: bytes, headers: dict[str, str], mode: str, level: float, warmup_s: float,
                   duration_s: float, client_timeout_s: float, max_inflight: int = 512) -> tuple[Samples, float]:
    """One step by h2load, ``warmup_s`` then the ``duration_s`` window (closed loop: :data:`CLOSED_TAIL_S` more,
    so that what h2load drops in flight at its end was sent after the window); its samples (offsets from the
    step start) and the step start (``time.time()``). h2load is stopped ``client_timeout_s`` after the step should
    have ended. Open loop: the requests it was to send and never logged (connection refused or reset) count in
    the window, as transport errors (as client timeouts if it was stopped).

    Raises:
        RuntimeError: h2load is not installed, or it exited with an error before starting any request.
    """
    binary = h2load_binary()
    with tempfile.TemporaryDirectory(prefix="h2load-") as tmp:
        body_path, log_path = Path(tmp) / "body", Path(tmp) / "log"
        body_path.write_bytes(body)
        span_s = warmup_s + duration_s + (CLOSED_TAIL_S if mode == "closed" else 0.0)
        cmd = command(binary, url, body_path, headers, mode, level, span_s, max_inflight, log_path)
        start_wall = time.time()
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        timed_out = False
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=span_s + client_timeout_s + 5.0)
        except asyncio.TimeoutError:
            timed_out = True
            proc.kill()
            out, _ = await proc.communicate()
        text = out.decode(errors="replace")
        logged = log_path.read_text() if log_path.exists() else ""
    start_us, status, latency_us = parse_log(logged)
    counts = request_counts(text)
    if not start_us.size and not counts and not timed_out:
        raise RuntimeError(f"h2load failed ({proc.returncode}): {text.strip()[-500:]}")
    # open loop: every request of -n that has no line (refused, reset, never sent); closed loop: those in flight
    # at the end, after the window
    expected = counts.get("total", planned_requests(level, span_s, max_inflight)) if mode == "open" \
        else counts.get("started", 0)
    unanswered = max(0, expected - start_us.size)
    return samples(start_us, status, latency_us, round(start_wall * 1e6), unanswered=unanswered,
                   unanswered_at=span_s if mode == "closed" else warmup_s,
                   unanswered_status=CLIENT_TIMEOUT if timed_out else TRANSPORT_ERROR), start_wall
