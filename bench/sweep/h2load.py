"""A step of a sweep driven by nghttp2's ``h2load`` (a native load generator, ``apt install nghttp2-client``)
instead of this package's Python drivers: the same step, window and row, at a small part of the client's CPU per
request. On a machine with as few cores as the server needs, the Python client takes CPU the server would use
(``bench/results/peers``).

HTTP/1.1 (``--h1``), one request in flight per connection, each request POSTs the same body with the same
headers; ``--log-file`` gives every request's start (microseconds since the epoch), HTTP status and latency
(microseconds), from which :func:`samples` builds the step's :class:`~bench.sweep.drivers.Samples`.

* Closed loop, ``N`` clients: ``-c N -D SPAN`` (each connection sends again when answered); latency counts from
  the send.
* Open loop, ``R`` req/s, constant arrivals: ``c`` connections (:func:`open_connections`, so that each sends at
  most once per :data:`OPEN_SEND_INTERVAL_S`) each sending ``R / c`` req/s (``--rps``), ``-n R * SPAN`` requests
  in all. The connections start ``k`` every ``p`` ms (``-r k --rate-period p``, :func:`connection_stagger`:
  h2load's periods are whole milliseconds) with ``k / p`` near ``R / 1000``, so their sends interleave at about
  ``1 / R`` apart instead of landing together.

Open loop, h2load sends a request late rather than not at all when its connection is still waiting for an answer.
So that this waiting is measured, not hidden (coordinated omission), the step's requests are given the schedule
they were meant to keep: the ``i``-th send (in time order) was due ``i / R`` after the first. Latency counts from
that due time, and ``send_lag`` is how late the send was. A late send keeps the server's answer (unlike the Python
driver, which does not send a request more than ``--max-send-lag-ms`` late and counts it as ``client-overload``:
h2load did send it, and the row says what the server did). In both loops an answer later than
``client_timeout_s`` after its due time (closed loop: its send) counts as ``client-timeout``, and h2load itself
is stopped that long after the step should have ended. Requests it never
logged count as transport errors (open loop; closed loop: those in flight at its end, after the window). The
in-flight peak comes from the log.

Options of the Python drivers that do not apply: ``--processes`` and Poisson arrivals (refused),
``--max-send-lag-ms`` (``send_lag_p99_ms`` shows how late the sends went); ``--max-inflight`` caps the connections
of an open-loop step.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import signal
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.sweep.drivers import CLIENT_TIMEOUT, TRANSPORT_ERROR, Samples

OPEN_SEND_INTERVAL_S = 0.05  #: seconds between one open-loop connection's sends (the peers bench's p99 target)
CLOSED_TAIL_S = 1.0  #: a closed-loop step runs this much past its window: h2load drops what is in flight at -D
INSTALL_HINT = "h2load (nghttp2) is not installed: apt install nghttp2-client, or use the Python load generator"


def h2load_refuses(arrivals: str = "constant", processes: int = 1) -> str | None:
    """Why h2load cannot send this load, None if it can: it sends constant arrivals from one process (the one
    rule of ``python -m bench sweep``, :func:`bench.sweep.run.run_sweep` and ``python -m bench.peers``)."""
    if arrivals != "constant" or processes > 1:
        return "--generator h2load sends constant arrivals from one process (no --arrivals poisson, no --processes)"
    return None


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


def connection_stagger(rate: float) -> tuple[int, int]:
    """``(k, p)``: h2load starts ``k`` connections every ``p`` ms (``-r k --rate-period {p}ms``). The first ``p``
    from 1 to 50 whose ``k = round(rate * p / 1000)`` (at least 1) gives ``k / p`` within 5 % of ``rate / 1000``,
    else the closest of them: connections start about ``1 / rate`` apart, in bursts of ``k``."""
    per_ms = rate / 1000.0
    best = (1, 1)
    best_err = float("inf")
    for p in range(1, 51):
        k = max(1, round(per_ms * p))
        err = abs(k / p - per_ms) / per_ms
        if err <= 0.05:
            return k, p
        if err < best_err:
            best, best_err = (k, p), err
    return best


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
        k, period_ms = connection_stagger(level)
        cmd += ["-c", str(conns), "--rps", f"{level / conns:.6g}", "-r", str(k), "--rate-period", f"{period_ms}ms",
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
            rate: float | None = None, planned: int = 0, client_timeout_s: float = float("inf"),
            unanswered: int = 0, unanswered_at: float = 0.0, unanswered_status: int = TRANSPORT_ERROR) -> Samples:
    """The step's samples, offsets in seconds from ``t0_us`` (the step's start), in send order.

    Open loop (``rate`` req/s, ``planned`` requests): the ``i``-th send was due ``i / rate`` after the first
    (module docstring): ``scheduled`` is that due time, ``send_lag`` the send's delay after it, latency counts from
    it (a late send keeps the server's answer: h2load sent it), and the planned requests with no line (never
    answered) are ``unanswered_status`` at their due times. Closed loop (``rate`` None): ``scheduled`` is the send,
    ``send_lag`` nan, and ``unanswered`` requests count at offset ``unanswered_at``. Either way an answer later
    than ``client_timeout_s`` is ``client-timeout``, a transport error has no latency, and ``peak_inflight`` is the
    most requests in flight at once by the log."""
    order = np.argsort(start_us, kind="stable")
    sent = (start_us[order] - t0_us) / 1e6
    lat = latency_us[order] / 1e6
    st = status[order].astype(np.int32)
    done = sent + lat
    peak = _peak_inflight(sent, done)
    if rate is not None:
        first = float(sent[0]) if sent.size else 0.0
        due = first + np.arange(max(planned, sent.size)) / rate
        lag = np.full(due.size, np.nan)
        lag[:sent.size] = sent - due[:sent.size]
        lat = np.concatenate([done - due[:sent.size], np.full(due.size - sent.size, np.nan)])
        st = np.concatenate([st, np.full(due.size - sent.size, unanswered_status, np.int32)])
        sched = due
    else:
        sched, lag = sent, np.full(sent.size, np.nan)
        if unanswered:
            sched = np.concatenate([sched, np.full(unanswered, float(unanswered_at))])
            lat = np.concatenate([lat, np.full(unanswered, np.nan)])
            st = np.concatenate([st, np.full(unanswered, unanswered_status, np.int32)])
            lag = np.concatenate([lag, np.full(unanswered, np.nan)])
    st = np.where((st == 200) & (lat > client_timeout_s), CLIENT_TIMEOUT, st).astype(np.int32)
    lat = np.where(np.isin(st, (TRANSPORT_ERROR, CLIENT_TIMEOUT)), np.nan, lat)
    return Samples(sched, lat, st, sched + lat, lag, peak_inflight=peak)


def _peak_inflight(sent: np.ndarray, done: np.ndarray) -> int:
    """The most intervals ``[sent, done)`` open at once."""
    if not sent.size:
        return 0
    events = np.concatenate([np.stack([sent, np.ones(sent.size)], 1), np.stack([done, -np.ones(done.size)], 1)])
    events = events[np.lexsort((events[:, 1], events[:, 0]))]  # at a tie, an answer before a send
    return int(np.cumsum(events[:, 1]).max())


def request_counts(output: str) -> dict[str, int]:
    """The counts of h2load's summary line ``requests: T total, N started, D done, S succeeded, F failed, E
    errored, O timeout`` by name (``{"total": T, "started": N, ...}``); empty if there is none."""
    for line in output.splitlines():
        if line.startswith("requests:"):
            pairs = (part.split() for part in line.split(":", 1)[1].split(","))
            return {w[1]: int(w[0]) for w in pairs if len(w) == 2 and w[0].isdigit()}
    return {}


def _die_with_parent() -> None:
    """In h2load's process, before it runs: it is killed when this process dies (``PR_SET_PDEATHSIG``), so a
    sweep stopped by a signal leaves no load generator behind."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


async def run_step(url: str, body: bytes, headers: dict[str, str], mode: str, level: float, warmup_s: float,
                   duration_s: float, client_timeout_s: float, max_inflight: int = 512) -> tuple[Samples, float]:
    """One step by h2load, ``warmup_s`` then the ``duration_s`` window (closed loop: :data:`CLOSED_TAIL_S` more,
    so that what h2load drops in flight at its end was sent after the window); its samples (:func:`samples`,
    offsets from the step start) and the step start (``time.time()``). h2load is stopped ``client_timeout_s``
    after the step should have ended, or when this coroutine is cancelled.

    Raises:
        RuntimeError: h2load is not installed, or it failed before starting any request (its output's end).
    """
    binary = h2load_binary()
    with tempfile.TemporaryDirectory(prefix="h2load-") as tmp:
        body_path, log_path = Path(tmp) / "body", Path(tmp) / "log"
        body_path.write_bytes(body)
        span_s = warmup_s + duration_s + (CLOSED_TAIL_S if mode == "closed" else 0.0)
        cmd = command(binary, url, body_path, headers, mode, level, span_s, max_inflight, log_path)
        start_wall = time.time()
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT, preexec_fn=_die_with_parent)
        timed_out = False
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=span_s + client_timeout_s + 5.0)
        except asyncio.TimeoutError:
            timed_out = True
            proc.kill()
            out, _ = await proc.communicate()
        finally:
            if proc.returncode is None:  # cancelled: stop it before its folder goes
                proc.kill()
                await proc.wait()
        text = out.decode(errors="replace")
        logged = log_path.read_text() if log_path.exists() else ""
    start_us, status, latency_us = parse_log(logged)
    counts = request_counts(text)
    if not start_us.size and not counts and not timed_out:
        raise RuntimeError(f"h2load failed ({proc.returncode}): {text.strip()[-500:]}")
    unanswered_status = CLIENT_TIMEOUT if timed_out else TRANSPORT_ERROR
    if mode == "open":
        return samples(start_us, status, latency_us, round(start_wall * 1e6), rate=level,
                       planned=planned_requests(level, span_s, max_inflight), client_timeout_s=client_timeout_s,
                       unanswered_status=unanswered_status), start_wall
    if start_us.size:  # closed loop: those started and never logged were in flight at its end, after the window
        unanswered, at = max(0, counts.get("started", 0) - start_us.size), span_s
    else:  # not one answer in the whole step: each client's connection failed (h2load counts nothing then)
        unanswered, at = int(level), warmup_s
    return samples(start_us, status, latency_us, round(start_wall * 1e6), client_timeout_s=client_timeout_s,
                   unanswered=unanswered, unanswered_at=at, unanswered_status=unanswered_status), start_wall
