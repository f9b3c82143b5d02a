"""What a step's samples say and how benches write it down.

Statistics: nearest-rank percentiles, a step's row (:func:`summarize`), average batch sizes from the server's
Prometheus counters (ours or Triton's). Output: the sweep's ``sweep.csv``/``sweep.json`` (written after every
step) and ``sweep.png`` (skipped, with one line naming the extra to install, when matplotlib is missing), and the
CSV files and tables (plain text or Markdown) of every other bench.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.sweep.drivers import CLIENT_OVERLOAD, OUTCOME_NAMES

#: The CSV columns, in order (also the keys of :func:`summarize`'s row plus the step's settings).
COLUMNS = [
    "step", "mode", "offered_qps", "scheduled_qps", "concurrency", "achieved_qps", "requests", "ok", "errors",
    "p50_ms", "p90_ms", "p99_ms", "max_ms", "avg_batch_size", "errors_by_status", "client_overload",
    "peak_inflight", "send_lag_p99_ms", "duration_s", "avg_queue_depth", "device_busy_share",
]

COLUMN_DOCS = {
    "step": "0-based step index",
    "mode": "open or closed",
    "offered_qps": "offered rate (open loop); blank in closed loop",
    "scheduled_qps": "open loop: requests scheduled in the window / duration (differs from offered_qps with "
                     "Poisson arrivals); blank in closed loop",
    "concurrency": "clients (closed loop); blank in open loop",
    "achieved_qps": "200 answers / max(duration, last answer - window start)",
    "requests": "requests scheduled (open) or sent (closed) in the window",
    "ok": "200 answers",
    "errors": "requests - ok (HTTP errors, transport errors, client timeouts, client overload)",
    "p50_ms": "median latency of 200 answers, ms (open loop: from the scheduled send time)",
    "p90_ms": "90th percentile (nearest rank), ms",
    "p99_ms": "99th percentile (nearest rank), ms",
    "max_ms": "slowest 200 answer, ms",
    "avg_batch_size": "delta inference_count / delta execution_count from /metrics; blank if unavailable",
    "errors_by_status": "e.g. '503:12 504:3 client-overload:5' (space separated, by count)",
    "client_overload": "requests the client could not send in time (cap or lag): raise --processes",
    "peak_inflight": "most requests outstanding at once (open: summed over client processes; closed: clients; "
                     "h2load: from its log)",
    "send_lag_p99_ms": "p99 of (actual send - scheduled send) in open loop; blank in closed loop",
    "duration_s": "window length",
    "avg_queue_depth": "requests waiting in the model's queue, time average over the window (Little's law: delta "
                       "of the queue-time sum from /metrics / seconds between the scrapes); blank if unavailable",
    "device_busy_share": "device seconds of the model's batches over the window (delta of "
                         "batcher_device_busy_seconds_total / seconds between the scrapes; CUDA timing events): 1.0 "
                         "is one GPU context busy all the time; blank without it (CPU, other servers)",
}

#: What ``python -m bench sweep`` says when it cannot draw ``sweep.png``.
NO_MATPLOTLIB = ('sweep.png not drawn: matplotlib is not installed (pip install -e ".[bench]"); sweep.csv and '
                 'sweep.json are written')


# ------------------------------------------------------------------------------------------------ statistics


def percentile(values: np.ndarray, q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``q`` % of ``values`` at or below it (nan if
    empty). Always an observed value, so ``percentile(x, 100) == max(x)``."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return float("nan")
    return float(np.percentile(values, q, method="inverted_cdf"))


def measured_wall(duration: float, done_offsets: np.ndarray, window_start: float = 0.0) -> float:
    """The seconds a step's throughput is divided by: the window, or longer when answers came later."""
    done = np.asarray(done_offsets, dtype=np.float64)
    done = done[np.isfinite(done)]
    last = float(done.max()) - window_start if done.size else 0.0
    return max(duration, last)


def status_name(code: int) -> str:
    return OUTCOME_NAMES.get(int(code), str(int(code)))


def summarize(latencies: np.ndarray, statuses: np.ndarray, wall_s: float, offered: float | None, *,
              send_lags: np.ndarray | None = None) -> dict:
    """One step's statistics from per-request latencies (s; nan for requests never sent) and statuses (HTTP
    codes or the negative client-side codes), ``wall_s`` from :func:`measured_wall` and the offered rate.

    Returns:
        ``offered_qps, achieved_qps, requests, ok, errors, p50_ms, p90_ms, p99_ms, max_ms, errors_by_status,
        client_overload, send_lag_p99_ms``; latency percentiles are over the ``200`` answers only.
    """
    lat = np.asarray(latencies, dtype=np.float64)
    st = np.asarray(statuses, dtype=np.int64)
    if lat.shape != st.shape:
        raise ValueError(f"latencies and statuses differ in length ({lat.size} vs {st.size})")
    ok_mask = st == 200
    ok_lat = lat[ok_mask] * 1e3
    codes, counts = np.unique(st[~ok_mask], return_counts=True)
    # most frequent first, then by code
    errs = sorted(zip(codes.tolist(), counts.tolist()), key=lambda cc: (-cc[1], status_name(cc[0])))
    lags = np.asarray(send_lags, dtype=np.float64) if send_lags is not None else np.empty(0)
    lags = lags[np.isfinite(lags)]
    return {
        "offered_qps": offered,
        "achieved_qps": float(ok_mask.sum() / wall_s) if wall_s > 0 else float("nan"),
        "requests": int(st.size),
        "ok": int(ok_mask.sum()),
        "errors": int(st.size - ok_mask.sum()),
        "p50_ms": percentile(ok_lat, 50),
        "p90_ms": percentile(ok_lat, 90),
        "p99_ms": percentile(ok_lat, 99),
        "max_ms": float(ok_lat.max()) if ok_lat.size else float("nan"),
        "errors_by_status": " ".join(f"{status_name(c)}:{n}" for c, n in errs),
        "client_overload": int((st == CLIENT_OVERLOAD).sum()),
        "send_lag_p99_ms": percentile(lags * 1e3, 99) if send_lags is not None else None,
    }


_COUNTERS = [
    ({"batcher_inference_count_total", "batcher_inference_count"},
     {"batcher_execution_count_total", "batcher_execution_count"}),
    # Triton (prometheus_client's parser names counter samples ..._total whether or not the text does)
    ({"nv_inference_count", "nv_inference_count_total"},
     {"nv_inference_exec_count", "nv_inference_exec_count_total"}),
]


def _samples(metrics_text: str | None) -> list | None:
    """Every sample of Prometheus text; None without text or when it does not parse (blank columns then)."""
    if not metrics_text:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [s for fam in text_string_to_metric_families(metrics_text) for s in fam.samples]
    except Exception:  # noqa: BLE001 - an unparsable endpoint just means no batch sizes or queue depths
        return None


def _of_model(sample, model: str, version: str | None) -> bool:
    return sample.labels.get("model") == model and (version is None or sample.labels.get("version") == version)


def batch_counters(metrics_text: str | None, model: str, version: str | None = None
                   ) -> tuple[float, float] | None:
    """(rows executed, batches executed) of ``model`` (summed over versions unless ``version``) from Prometheus
    text; (0, 0) if the counters exist but not yet for the model; None if the server has neither ours nor
    Triton's counters (or no text)."""
    samples = _samples(metrics_text)
    if samples is None:
        return None
    names = {s.name for s in samples}
    for inf_names, exe_names in _COUNTERS:
        if not (names & inf_names and names & exe_names):
            continue
        inf = exe = 0.0
        for s in samples:
            if not _of_model(s, model, version):
                continue
            if s.name in inf_names:
                inf += s.value
            elif s.name in exe_names:
                exe += s.value
        return inf, exe
    return None


#: queue-time sums and their unit: ours (seconds), Triton's (microseconds, a counter with or without _total)
_QUEUE_SUMS = {"batcher_queue_duration_seconds_sum": 1.0, "nv_inference_queue_duration_us": 1e-6,
               "nv_inference_queue_duration_us_total": 1e-6}


def queue_seconds(metrics_text: str | None, model: str, version: str | None = None) -> float | None:
    """Seconds requests of ``model`` have spent queued so far (ours: ``batcher_queue_duration_seconds_sum``;
    Triton: ``nv_inference_queue_duration_us``), summed over versions unless ``version``; None if absent."""
    return _model_seconds(metrics_text, _QUEUE_SUMS, model, version)


def device_busy_seconds(metrics_text: str | None, model: str, version: str | None = None) -> float | None:
    """Seconds of device time of ``model``'s batches so far (``batcher_device_busy_seconds_total``, from CUDA
    timing events), summed over versions unless ``version``; None if absent (no timed context, other servers)."""
    return _model_seconds(metrics_text, {"batcher_device_busy_seconds_total": 1.0}, model, version)


def _model_seconds(metrics_text: str | None, scales: dict[str, float], model: str, version: str | None
                   ) -> float | None:
    found = [s for s in _samples(metrics_text) or [] if s.name in scales]
    if not found:
        return None
    return sum(s.value * scales[s.name] for s in found if _of_model(s, model, version))


def per_second(before: tuple[float | None, float], after: tuple[float | None, float]) -> float | None:
    """The growth per second of a total between two ``(total, wall time)`` scrapes; None when a total is absent
    or no time passed. Of the queue-time sum: the time-average number of queued requests (Little's law,
    ``avg_queue_depth``); of the device seconds: the share of the window a device was busy."""
    (q0, t0), (q1, t1) = before, after
    if q0 is None or q1 is None or t1 <= t0:
        return None
    return (q1 - q0) / (t1 - t0)


avg_queue_depth = per_second


def avg_batch(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None:
        return None
    d_inf, d_exe = after[0] - before[0], after[1] - before[1]
    return d_inf / d_exe if d_exe > 0 else None


# ---------------------------------------------------------------------------------------- tables, CSV, JSON


def fmt(v, digits: int = 3) -> str:
    """A cell: blank for None and nan, floats with ``digits`` decimals, anything else as ``str``."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _keys(rows: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


def write_csv(path: Path, rows: Sequence[dict], columns: Sequence[str] | None = None,
              digits: int | dict[str, int] | None = None) -> Path:
    """``rows`` as CSV; ``columns`` default to every key in first-seen order. ``digits`` None: values as they
    are (``str``, None blank); a number: floats with that many decimals, nan blank (:func:`fmt`); a dict: per
    column, 3 for the others."""
    columns = list(columns) if columns is not None else _keys(rows)

    def cell(c: str, v) -> str:
        if digits is None:
            return "" if v is None else str(v)
        return fmt(v, digits if isinstance(digits, int) else digits.get(c, 3))

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([cell(c, r.get(c)) for c in columns])
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def text_table(columns: Sequence[tuple[str, str, int]], rows: Sequence[dict], *, last_left: bool = False) -> str:
    """A plain-text table: ``columns`` are (header, key, decimals); right-aligned under a dashed rule
    (``last_left``: the last column left-aligned, e.g. free text)."""
    cells = [[h for h, _, _ in columns]] + [[fmt(r.get(k), d) for _, k, d in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    last = len(columns) - 1 if last_left else len(columns)
    lines = ["  ".join(c.rjust(w) if i < last else c for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict]) -> str:
    """``rows`` as a Markdown table, every key a column (first-seen order), values as they are."""
    keys = _keys(rows)
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    out += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(out)


def json_safe(o):
    """JSON-safe: nan/inf -> None, recursively; Paths as strings."""
    if isinstance(o, float):
        return None if math.isnan(o) or math.isinf(o) else o
    if isinstance(o, dict):
        return {str(k): json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    if isinstance(o, Path):
        return str(o)
    return o


def write_json(path: Path, doc) -> Path:
    path.write_text(json.dumps(json_safe(doc), indent=1, default=str))
    return path


# ---------------------------------------------------------------------------------------------- the sweep


_DIGITS = {"offered_qps": 2, "scheduled_qps": 2, "achieved_qps": 2, "avg_batch_size": 2, "duration_s": 3,
           "avg_queue_depth": 2, "device_busy_share": 3}

_TABLE = [("offered", "offered_qps", 1), ("clients", "concurrency", 0), ("achieved", "achieved_qps", 1),
          ("ok", "ok", 0), ("errors", "errors", 0), ("p50 ms", "p50_ms", 2), ("p90 ms", "p90_ms", 2),
          ("p99 ms", "p99_ms", 2), ("max ms", "max_ms", 2), ("avg batch", "avg_batch_size", 2),
          ("avg queue", "avg_queue_depth", 2), ("errors by status", "errors_by_status", 0)]


def save_sweep(out: Path, rows: Sequence[dict], info: dict) -> list[Path]:
    """``out/sweep.csv`` (:data:`COLUMNS`) and ``out/sweep.json`` (``info``: settings, inputs, ...; the column
    docs; the rows) for the steps so far; called after every step, so an interrupted sweep keeps them."""
    return [write_csv(out / "sweep.csv", rows, COLUMNS, _DIGITS),
            write_json(out / "sweep.json", {**info, "columns": COLUMN_DOCS, "rows": list(rows)})]


def format_table(rows: Sequence[dict]) -> str:
    """The printed table (one line per step); closed-loop tables show clients instead of offered QPS."""
    mode = rows[0]["mode"] if rows else "open"
    return text_table([c for c in _TABLE if c[1] != ("concurrency" if mode == "open" else "offered_qps")], rows,
                      last_left=True)


def plot_sweep(rows: Sequence[dict], path: Path, title: str) -> Path | None:
    """Latency percentiles (log scale) against achieved QPS, and achieved against offered QPS (or clients).

    Returns the PNG's path; without matplotlib, prints :data:`NO_MATPLOTLIB` to stderr and returns None.
    """
    try:
        import matplotlib
    except ImportError:
        print(NO_MATPLOTLIB, file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["ok"] > 0]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    x = [r["achieved_qps"] for r in rows]
    for key, label, style in [("p50_ms", "p50", "o-"), ("p90_ms", "p90", "s-"), ("p99_ms", "p99", "^-"),
                              ("max_ms", "max", "x--")]:
        ax.plot(x, [r[key] for r in rows], style, label=label)
    ax.set_xlabel("achieved QPS (200 answers/s)")
    ax.set_ylabel("latency (ms)")
    if rows and max(r["max_ms"] for r in rows) > 20 * min(r["p50_ms"] for r in rows):
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=10)
    closed = bool(rows) and rows[0]["mode"] == "closed"
    level = [r["concurrency"] if closed else r["offered_qps"] for r in rows]
    ax2.plot(level, x, "o-", label="achieved")
    if not closed and level:
        ax2.plot([0, max(level)], [0, max(level)], ":", color="gray", label="achieved = offered")
    err = [r["errors"] / r["requests"] * 100 if r["requests"] else 0 for r in rows]
    if any(err):
        ax3 = ax2.twinx()
        ax3.plot(level, err, "r.--", label="errors %")
        ax3.set_ylabel("errors (% of requests)", color="r")
    ax2.set_xlabel("clients" if closed else "offered QPS")
    ax2.set_ylabel("achieved QPS")
    ax2.grid(True, alpha=0.3)
    ax2.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
