"""Latency-against-throughput sweeps for any KServe v2 HTTP server (ours, Triton, PyTriton, MLServer).

``python -m bench sweep --url URL --model NAME --rates 50,100,200 --duration 10 --out DIR`` runs one step per
offered rate and writes ``DIR/sweep.csv``, ``DIR/sweep.png`` (latency percentiles against achieved QPS) and
``DIR/sweep.json`` (the settings and the rows), and prints the table.

Open loop (default): requests are sent at scheduled times (``constant`` or ``poisson`` arrivals) whatever the
server does, and each latency counts from the request's *scheduled* send time to the last byte of its answer, so
time spent waiting for the server (or for the client) is never left out (no coordinated omission). At most
``--max-inflight`` requests are outstanding; a request that finds the cap reached, or whose send would be more
than ``--max-send-lag-ms`` late, is not sent and is counted as ``client-overload``: the client, not the server,
could not keep up (use ``--processes``). Closed loop (``--mode closed``): ``N`` clients each send a request,
wait for its answer and send the next; the sweep goes over ``--concurrency N1,N2,...`` and latency counts from
the send.

A step's window is ``--duration`` seconds after ``--warmup`` seconds at the same load; requests scheduled (open)
or sent (closed) in the window are its requests, and the step ends when all of them are answered. Achieved QPS
is ``ok / max(duration, last answer - window start)``; percentiles are of the latencies of ``200`` answers
(nearest rank: the smallest latency with at least q % of them at or below it). Average batch size is the delta
of the server's ``batcher_inference_count_total`` / ``batcher_execution_count_total`` (or Triton's
``nv_inference_count`` / ``nv_inference_exec_count``) for the model between the window start and the step's end,
blank where the metrics endpoint does not have them.

The pure parts (:func:`arrival_times`, :func:`summarize`, :func:`percentile`, :func:`resolve_inputs`,
:func:`batch_counters`, ...) and the drivers (:func:`drive_open`, :func:`drive_closed`, which take any async
``send()``) are tested directly in ``tests/test_sweep.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import multiprocessing as mp
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

# Outcomes that are not HTTP statuses (the ``statuses`` arrays hold them as negative codes).
CLIENT_OVERLOAD = -1  #: not sent: in-flight cap reached or the send would have been too late
TRANSPORT_ERROR = -2  #: connection refused/reset, malformed answer
CLIENT_TIMEOUT = -3  #: no full answer within --client-timeout
OUTCOME_NAMES = {CLIENT_OVERLOAD: "client-overload", TRANSPORT_ERROR: "transport", CLIENT_TIMEOUT: "client-timeout"}

#: The CSV columns, in order (also the keys of :func:`summarize`'s row plus the step's settings).
COLUMNS = [
    "step", "mode", "offered_qps", "scheduled_qps", "concurrency", "achieved_qps", "requests", "ok", "errors",
    "p50_ms", "p90_ms", "p99_ms", "max_ms", "avg_batch_size", "errors_by_status", "client_overload",
    "peak_inflight", "send_lag_p99_ms", "duration_s", "avg_queue_depth",
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
    "peak_inflight": "most requests outstanding at once (open: summed over client processes; closed: clients)",
    "send_lag_p99_ms": "p99 of (actual send - scheduled send) in open loop; blank in closed loop",
    "duration_s": "window length",
    "avg_queue_depth": "requests waiting in the model's queue, time average over the window (Little's law: delta "
                       "of the queue-time sum from /metrics / seconds between the scrapes); blank if unavailable",
}

# KServe v2 datatype <-> numpy (little-endian where it matters); BYTES tensors are object arrays of bytes.
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"), "INT8": np.dtype(np.int8), "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"), "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"), "BYTES": np.dtype(object),
}


# ----------------------------------------------------------------------------------------------- pure parts


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
    raise ValueError(f"arrivals must be 'constant' or 'poisson' (got {kind!r})")


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


def parse_list(text: str, kind: type = float) -> list:
    """``"10,20,50"`` or a range ``"start:stop:step"`` (stop included) -> values; positive only."""
    values: list = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            a, b, s = (float(x) for x in part.split(":"))
            if s <= 0:
                raise ValueError(f"range step must be > 0 in {part!r}")
            values += [kind(a + i * s) for i in range(math.floor((b - a) / s + 1e-9) + 1)]
        else:
            values.append(kind(float(part)) if kind is int else kind(part))
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"expected positive values like 10,20,50 or 10:100:10 (got {text!r})")
    return values


def parse_shape(text: str) -> tuple[str | None, list[int]]:
    """``"1,3,224,224"``, ``"1x3x224x224"`` or ``"NAME:1,3,224,224"`` -> (name or None, dims)."""
    name = None
    if ":" in text:
        name, text = text.rsplit(":", 1)
    dims = [int(d) for d in text.replace("x", ",").split(",") if d.strip()]
    if not dims or any(d < 0 for d in dims):
        raise ValueError(f"a shape is non-negative integers like 1,3,224,224 (got {text!r})")
    return name, dims


@dataclass
class InputSpec:
    name: str
    datatype: str
    shape: list[int]
    data: np.ndarray | None = None  # from --input-file; generated otherwise


def _fill(name: str, meta_shape: list[int], given: list[int] | None, batch_size: int) -> list[int]:
    dyn = [i for i, d in enumerate(meta_shape) if d < 0]
    if given is None:
        shape = list(meta_shape)
        if dyn and dyn[0] == 0:
            shape[0] = batch_size
        rest = [i for i, d in enumerate(shape) if d < 0]
        if rest:
            raise ValueError(f"input '{name}' has dynamic dims {meta_shape}: give its full shape with --shape "
                             f"(e.g. --shape {','.join(str(batch_size if d < 0 else d) for d in meta_shape)})")
        return shape
    if len(given) == len(meta_shape):
        fixed_mismatch = [i for i, d in enumerate(meta_shape) if d >= 0 and given[i] != d]
        if fixed_mismatch:
            print(f"warning: --shape {given} differs from the metadata of input '{name}' {meta_shape} at "
                  f"dims {fixed_mismatch}; sending {given}", file=sys.stderr)
        return list(given)
    if dyn and len(given) == len(dyn):
        shape = list(meta_shape)
        for i, v in zip(dyn, given):
            shape[i] = v
        return shape
    raise ValueError(f"--shape {given} fits neither input '{name}' {meta_shape} (give all {len(meta_shape)} "
                     f"dims) nor its {len(dyn)} dynamic dims")


def resolve_inputs(meta: dict | None, *, input_name: str | None = None, datatype: str | None = None,
                   shapes: dict[str | None, list[int]] | None = None, arrays: dict[str | None, np.ndarray] | None
                   = None, batch_size: int = 1) -> list[InputSpec]:
    """The tensors to send, from the model metadata (``GET /v2/models/{m}``; None if unavailable) and the
    command line.

    ``shapes``: ``--shape`` values by input name (None: every input without a named one); a full shape or just
    the values of the ``-1`` dims; without one, a leading ``-1`` becomes ``batch_size``. ``arrays``: sample
    tensors (``--input-file``) by input name (None: ``input_name`` or the first input), sent as they are.
    """
    shapes = dict(shapes or {})
    arrays = dict(arrays or {})
    if datatype is not None and datatype not in DTYPES:
        raise ValueError(f"--datatype must be one of {', '.join(DTYPES)} (got {datatype!r})")
    if meta is None or not meta.get("inputs"):
        if None in arrays and len(arrays) == 1 and input_name:
            a = arrays[None]
            return [InputSpec(input_name, datatype or datatype_of(a), list(a.shape), a)]
        if named := [k for k in arrays if k is not None]:
            return [InputSpec(k, datatype_of(arrays[k]), list(arrays[k].shape), arrays[k]) for k in named]
        given = shapes.get(input_name, shapes.get(None))
        if not (input_name and datatype and given):
            raise ValueError("no model metadata: give --input-name, --datatype and --shape (or --input-file)")
        return [InputSpec(input_name, datatype, list(given))]
    metas = meta["inputs"]
    names = [m["name"] for m in metas]
    for k in [input_name, *shapes, *arrays]:
        if k is not None and k not in names:
            raise ValueError(f"model '{meta.get('name', '?')}' has no input '{k}' (inputs: {', '.join(names)})")
    if None in arrays:
        arrays[input_name or names[0]] = arrays.pop(None)
    specs = []
    for m in metas:
        name = m["name"]
        if name in arrays:
            a = arrays[name]
            specs.append(InputSpec(name, datatype_of(a), list(a.shape), a))
            continue
        given = shapes.get(name, shapes.get(None))
        dt = datatype if datatype is not None and (input_name in (None, name)) else m["datatype"]
        specs.append(InputSpec(name, dt, _fill(name, [int(d) for d in m["shape"]], given, batch_size)))
    return specs


def datatype_of(a: np.ndarray) -> str:
    if a.dtype.kind in "OSU":
        return "BYTES"
    for name, dt in DTYPES.items():
        if name != "BYTES" and dt.kind == a.dtype.kind and dt.itemsize == a.dtype.itemsize:
            return name
    raise ValueError(f"no KServe v2 datatype for numpy {a.dtype}")


def make_tensor(spec: InputSpec, rng: np.random.Generator) -> np.ndarray:
    """The sample tensor for ``spec``: its data if given, else random values of its datatype and shape."""
    if spec.data is not None:
        return spec.data
    dt = DTYPES[spec.datatype]
    if spec.datatype == "BYTES":
        a = np.empty(spec.shape, dtype=object)
        a.fill(b"sample")
        return a
    if spec.datatype == "BOOL":
        return rng.random(spec.shape) < 0.5
    if dt.kind == "f":
        return rng.random(spec.shape, dtype=np.float32).astype(dt)
    return rng.integers(0, 10, size=spec.shape).astype(dt)


def _bytes_elements(a: np.ndarray) -> list[bytes]:
    return [x if isinstance(x, bytes) else str(x).encode() for x in a.reshape(-1)]


def build_request(tensors: Sequence[tuple[str, str, np.ndarray]], *, binary: bool = True,
                  timeout_us: int | None = None) -> tuple[bytes, dict[str, str]]:
    """A KServe v2 infer request body and its headers for ``(name, datatype, array)`` inputs.

    Binary: the binary tensor extension (``Inference-Header-Content-Length``), binary outputs requested; JSON:
    flat ``data`` lists. ``timeout_us`` goes into the request's ``parameters.timeout`` (microseconds).
    """
    params: dict = {}
    if timeout_us is not None:
        params["timeout"] = int(timeout_us)
    inputs, blobs = [], []
    for name, datatype, a in tensors:
        entry: dict = {"name": name, "datatype": datatype, "shape": list(a.shape)}
        if binary:
            if datatype == "BYTES":
                blob = b"".join(len(b).to_bytes(4, "little") + b for b in _bytes_elements(a))
            else:
                blob = np.ascontiguousarray(a, dtype=DTYPES[datatype]).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif datatype == "BYTES":
            entry["data"] = [b.decode("utf-8", "replace") for b in _bytes_elements(a)]
        else:
            entry["data"] = np.asarray(a, dtype=DTYPES[datatype]).reshape(-1).tolist()
        inputs.append(entry)
    if binary:
        params["binary_data_output"] = True
    head: dict = {"inputs": inputs}
    if params:
        head["parameters"] = params
    head_bytes = orjson.dumps(head)
    if not binary:
        return head_bytes, {"Content-Type": "application/json"}
    return head_bytes + b"".join(blobs), {"Inference-Header-Content-Length": str(len(head_bytes)),
                                          "Content-Type": "application/octet-stream"}


_COUNTERS = [
    ({"batcher_inference_count_total", "batcher_inference_count"},
     {"batcher_execution_count_total", "batcher_execution_count"}),
    # Triton (prometheus_client's parser names counter samples ..._total whether or not the text does)
    ({"nv_inference_count", "nv_inference_count_total"},
     {"nv_inference_exec_count", "nv_inference_exec_count_total"}),
]


def batch_counters(metrics_text: str | None, model: str, version: str | None = None
                   ) -> tuple[float, float] | None:
    """(rows executed, batches executed) of ``model`` (summed over versions unless ``version``) from Prometheus
    text; (0, 0) if the counters exist but not yet for the model; None if the server has neither ours nor
    Triton's counters (or no text)."""
    if not metrics_text:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    try:
        samples = [s for fam in text_string_to_metric_families(metrics_text) for s in fam.samples]
    except Exception:  # noqa: BLE001 - an unparsable endpoint just means no batch sizes
        return None
    names = {s.name for s in samples}
    for inf_names, exe_names in _COUNTERS:
        if not (names & inf_names and names & exe_names):
            continue
        inf = exe = 0.0
        for s in samples:
            if s.labels.get("model") != model or (version is not None and s.labels.get("version") != version):
                continue
            if s.name in inf_names:
                inf += s.value
            elif s.name in exe_names:
                exe += s.value
        return inf, exe
    return None


def queue_seconds(metrics_text: str | None, model: str, version: str | None = None) -> float | None:
    """Seconds requests of ``model`` have spent queued so far (ours: ``batcher_queue_duration_seconds_sum``;
    Triton: ``nv_inference_queue_duration_us``), summed over versions unless ``version``; None if absent."""
    if not metrics_text:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    try:
        samples = [s for fam in text_string_to_metric_families(metrics_text) for s in fam.samples]
    except Exception:  # noqa: BLE001 - an unparsable endpoint just means no queue depth
        return None
    scale = {"batcher_queue_duration_seconds_sum": 1.0, "nv_inference_queue_duration_us": 1e-6,
             "nv_inference_queue_duration_us_total": 1e-6}
    found = [s for s in samples if s.name in scale]
    if not found:
        return None
    return sum(s.value * scale[s.name] for s in found
               if s.labels.get("model") == model and (version is None or s.labels.get("version") == version))


def avg_queue_depth(before: tuple[float | None, float], after: tuple[float | None, float]) -> float | None:
    """Time-average number of queued requests between two ``(queue_seconds, wall time)`` scrapes (Little's law:
    the queue time accumulated over the interval / its length)."""
    (q0, t0), (q1, t1) = before, after
    if q0 is None or q1 is None or t1 <= t0:
        return None
    return (q1 - q0) / (t1 - t0)


def avg_batch(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None:
        return None
    d_inf, d_exe = after[0] - before[0], after[1] - before[1]
    return d_inf / d_exe if d_exe > 0 else None


# --------------------------------------------------------------------------------------------------- drivers


@dataclass
class Samples:
    """Per-request records of one step (one client process or merged): offsets are seconds from the step start.

    ``scheduled``: the scheduled send time (open) or the send time (closed); ``latency``/``done``: nan for
    requests never sent; ``send_lag``: actual - scheduled send (open loop).
    """

    scheduled: np.ndarray
    latency: np.ndarray
    status: np.ndarray
    done: np.ndarray
    send_lag: np.ndarray
    peak_inflight: int = 0

    @staticmethod
    def merge(parts: Sequence[Samples]) -> Samples:
        def cat(attr: str, dtype) -> np.ndarray:
            arrays = [getattr(p, attr) for p in parts]
            return np.concatenate(arrays).astype(dtype) if arrays else np.empty(0, dtype)

        return Samples(cat("scheduled", np.float64), cat("latency", np.float64), cat("status", np.int32),
                       cat("done", np.float64), cat("send_lag", np.float64),
                       sum(p.peak_inflight for p in parts))

    def window(self, start: float, end: float | None = None) -> Samples:
        m = self.scheduled >= start - 1e-9  # k / rate == warmup exactly belongs to the window
        if end is not None:
            m &= self.scheduled < end - 1e-9
        return Samples(self.scheduled[m], self.latency[m], self.status[m], self.done[m], self.send_lag[m],
                       self.peak_inflight)


Send = Callable[[], Awaitable[int]]


async def drive_open(offsets: np.ndarray, send: Send, *, max_inflight: int = 512, max_lag_s: float = 0.1,
                     start: float | None = None, clock: Callable[[], float] = time.perf_counter) -> Samples:
    """Call ``send()`` at ``start + offsets[i]`` (``clock`` seconds) whatever the earlier calls are doing.

    A request whose turn comes with ``max_inflight`` outstanding, or more than ``max_lag_s`` late, is not sent
    (status :data:`CLIENT_OVERLOAD`). Latency is from the scheduled time to ``send()``'s return; ``send``
    returns an HTTP status (an exception counts as :data:`TRANSPORT_ERROR`, a timeout as
    :data:`CLIENT_TIMEOUT`). Returns after every sent request is answered.
    """
    offsets = np.asarray(offsets, dtype=np.float64)
    n = offsets.size
    status = np.full(n, CLIENT_OVERLOAD, np.int32)
    latency = np.full(n, np.nan)
    done = np.full(n, np.nan)
    lag = np.full(n, np.nan)
    t0 = clock() if start is None else start
    inflight = peak = 0
    tasks: set[asyncio.Task] = set()  # only the outstanding ones: a long run does not keep every task

    async def one(i: int, target: float) -> None:
        nonlocal inflight
        try:
            st = await send()
        except asyncio.TimeoutError:
            st = CLIENT_TIMEOUT
        except Exception:  # noqa: BLE001 - any failure to get an answer is a transport error
            st = TRANSPORT_ERROR
        t = clock()
        status[i], latency[i], done[i] = st, t - target, t - t0
        inflight -= 1

    for i in range(n):
        target = t0 + offsets[i]
        delay = target - clock()
        await asyncio.sleep(max(0.0, delay))  # yield even when late so queued sends go out
        late = clock() - target
        lag[i] = max(late, 0.0)
        if inflight >= max_inflight or late > max_lag_s:
            continue
        inflight += 1
        peak = max(peak, inflight)
        task = asyncio.create_task(one(i, target))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while tasks:
        await asyncio.gather(*list(tasks))
    return Samples(offsets, latency, status, done, lag, peak)


async def drive_closed(concurrency: int, send: Send, *, until: float, start: float | None = None,
                       clock: Callable[[], float] = time.perf_counter) -> Samples:
    """``concurrency`` clients, each calling ``send()`` again as soon as the previous call returns, until
    ``start + until``; latency is from each send."""
    t0 = clock() if start is None else start
    rec: list[tuple[float, float, int, float]] = []

    async def client() -> None:
        while (s := clock()) < t0 + until:
            try:
                st = await send()
            except asyncio.TimeoutError:
                st = CLIENT_TIMEOUT
            except Exception:  # noqa: BLE001
                st = TRANSPORT_ERROR
            t = clock()
            rec.append((s - t0, t - s, st, t - t0))
            if st < 0:
                await asyncio.sleep(0.001)  # don't spin on a refused connection

    delay = t0 - clock()
    if delay > 0:
        await asyncio.sleep(delay)
    await asyncio.gather(*(client() for _ in range(concurrency)))
    a = np.array(rec, dtype=np.float64).reshape(-1, 4)
    return Samples(a[:, 0], a[:, 1], a[:, 2].astype(np.int32), a[:, 3], np.full(len(a), np.nan), concurrency)


def make_sender(session, url: str, body: bytes, headers: dict[str, str]) -> Send:
    """``send()`` for the drivers: POST ``body`` with aiohttp, read the whole answer, return the status."""
    import aiohttp

    async def send() -> int:
        try:
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                return r.status
        except asyncio.TimeoutError:
            return CLIENT_TIMEOUT
        except (aiohttp.ClientError, OSError):
            return TRANSPORT_ERROR

    return send


@dataclass
class Job:
    """One client process's share of a step (picklable: sent to worker processes)."""

    mode: str
    url: str
    body: bytes
    headers: dict[str, str]
    start_wall: float  # time.time() at which the step starts (shared by all client processes)
    client_timeout_s: float
    offsets: np.ndarray | None = None  # open
    max_inflight: int = 512  # open
    max_lag_s: float = 0.1  # open
    concurrency: int = 0  # closed
    until: float = 0.0  # closed: seconds after the start


async def run_job(job: Job) -> Samples:
    import aiohttp

    limit = job.max_inflight if job.mode == "open" else job.concurrency
    conn = aiohttp.TCPConnector(limit=max(limit, 1), limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=job.client_timeout_s)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        send = make_sender(session, job.url, job.body, job.headers)
        start = time.perf_counter() + (job.start_wall - time.time())
        if job.mode == "open":
            return await drive_open(job.offsets, send, max_inflight=job.max_inflight, max_lag_s=job.max_lag_s,
                                    start=start)
        return await drive_closed(job.concurrency, send, until=job.until, start=start)


def _run_job_sync(job: Job) -> Samples:
    return asyncio.run(run_job(job))


def _ping() -> float:
    import aiohttp  # noqa: F401 - import in the worker before the first timed step

    return time.time()


# ------------------------------------------------------------------------------------------------- the sweep


def base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def model_path(model: str, version: str | None) -> str:
    m = urllib.parse.quote(model, safe="")
    return f"/v2/models/{m}" + (f"/versions/{urllib.parse.quote(version, safe='')}" if version else "")


def split(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


@dataclass
class SweepConfig:
    url: str
    model: str
    mode: str = "open"
    rates: list[float] = field(default_factory=list)
    concurrency: list[int] = field(default_factory=list)
    duration: float = 10.0
    warmup: float = 1.0
    arrivals: str = "constant"
    processes: int = 1
    max_inflight: int = 512
    max_lag_s: float = 0.1
    client_timeout_s: float = 10.0
    metrics_url: str | None = None  # None: no batch sizes
    version: str | None = None
    seed: int = 0
    progress: bool = True


async def _scrape(session, url: str | None) -> str | None:
    if not url:
        return None
    try:
        async with session.get(url) as r:
            return await r.text() if r.status == 200 else None
    except Exception:  # noqa: BLE001 - no metrics means blank batch sizes
        return None


async def _sweep(cfg: SweepConfig, body: bytes, headers: dict[str, str], pool, bar, rows: list[dict]
                 ) -> list[dict]:
    import aiohttp

    infer_url = base_url(cfg.url) + model_path(cfg.model, cfg.version) + "/infer"
    steps = cfg.rates if cfg.mode == "open" else cfg.concurrency
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as meta_session:
        for k, level in enumerate(steps):
            lead = 0.3 if pool is not None else 0.02
            start_wall = time.time() + lead
            span = cfg.warmup + cfg.duration
            if cfg.mode == "open":
                offsets = arrival_times(level, span, cfg.arrivals, seed=[cfg.seed, k])
                jobs = [Job("open", infer_url, body, headers, start_wall, cfg.client_timeout_s,
                            offsets=offsets[p::cfg.processes], max_inflight=m, max_lag_s=cfg.max_lag_s)
                        for p, m in enumerate(split(cfg.max_inflight, cfg.processes))]
                desc = f"{level:g} req/s"
            else:
                jobs = [Job("closed", infer_url, body, headers, start_wall, cfg.client_timeout_s, concurrency=c,
                            until=span) for c in split(int(level), cfg.processes) if c]
                desc = f"{int(level)} clients"
            if bar is not None:
                bar.set_description(f"step {k + 1}/{len(steps)}: {desc}")

            async def scrape_at_window_start(at: float = start_wall + cfg.warmup) -> tuple[str | None, float]:
                await asyncio.sleep(max(0.0, at - time.time()))
                return await _scrape(meta_session, cfg.metrics_url), time.time()

            before_task = asyncio.create_task(scrape_at_window_start())
            if pool is None:
                parts = [await run_job(jobs[0])]
            else:
                parts = await asyncio.gather(*(loop.run_in_executor(pool, _run_job_sync, j) for j in jobs))
            before, before_t = await before_task
            after, after_t = await _scrape(meta_session, cfg.metrics_url), time.time()
            s = Samples.merge(parts).window(cfg.warmup, span)
            wall = measured_wall(cfg.duration, s.done, cfg.warmup)
            row = {"step": k, "mode": cfg.mode, "concurrency": int(level) if cfg.mode == "closed" else None,
                   "scheduled_qps": s.status.size / cfg.duration if cfg.mode == "open" else None,
                   "duration_s": cfg.duration,
                   **summarize(s.latency, s.status, wall, level if cfg.mode == "open" else None,
                               send_lags=s.send_lag if cfg.mode == "open" else None),
                   "peak_inflight": s.peak_inflight,
                   "avg_batch_size": avg_batch(batch_counters(before, cfg.model, cfg.version),
                                               batch_counters(after, cfg.model, cfg.version)),
                   "avg_queue_depth": avg_queue_depth((queue_seconds(before, cfg.model, cfg.version), before_t),
                                                      (queue_seconds(after, cfg.model, cfg.version), after_t))}
            rows.append(row)
            if bar is not None:
                bar.set_postfix_str(f"last: {row['achieved_qps']:.1f} req/s, p99 {row['p99_ms']:.1f} ms, "
                                    f"{row['errors']} errors")
    return rows


async def _ticker(bar, total: float) -> None:
    t0 = time.monotonic()
    while True:
        await asyncio.sleep(0.25)
        bar.n = round(min(time.monotonic() - t0, total), 1)
        bar.refresh()


async def _sweep_with_progress(cfg: SweepConfig, body: bytes, headers: dict[str, str], pool, rows: list[dict]
                               ) -> list[dict]:
    if not cfg.progress:
        return await _sweep(cfg, body, headers, pool, None, rows)
    from tqdm import tqdm

    n_steps = len(cfg.rates if cfg.mode == "open" else cfg.concurrency)
    total = n_steps * (cfg.warmup + cfg.duration)
    with tqdm(total=round(total, 1), unit="s", file=sys.stderr, dynamic_ncols=True,
              bar_format="{desc}{percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s "
                         "[{elapsed}<{remaining}]{postfix}") as bar:
        tick = asyncio.create_task(_ticker(bar, total))
        try:
            rows = await _sweep(cfg, body, headers, pool, bar, rows)
        finally:
            tick.cancel()
        bar.n = bar.total
        bar.refresh()
    return rows


def run_sweep(cfg: SweepConfig, body: bytes, headers: dict[str, str], rows: list[dict] | None = None
              ) -> list[dict]:
    """Run every step (rates in open loop, concurrencies in closed loop); one row per step (:data:`COLUMNS`),
    appended to ``rows`` as each step ends (so an interrupted sweep keeps the finished steps)."""
    rows = [] if rows is None else rows
    if cfg.processes <= 1:
        return asyncio.run(_sweep_with_progress(cfg, body, headers, None, rows))
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(cfg.processes, mp_context=ctx) as pool:
        list(pool.map(_ping_wait, [0.2] * cfg.processes))  # start every worker before the first timed step
        return asyncio.run(_sweep_with_progress(cfg, body, headers, pool, rows))


def _ping_wait(seconds: float) -> float:
    _ping()
    time.sleep(seconds)  # keeps this worker busy so the next ping starts another one
    return time.time()


# ---------------------------------------------------------------------------------------------------- output


def _fmt(v, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


_DIGITS = {"offered_qps": 2, "scheduled_qps": 2, "achieved_qps": 2, "avg_batch_size": 2, "duration_s": 3,
           "avg_queue_depth": 2}


def write_csv(rows: Sequence[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow([_fmt(r.get(c), _DIGITS.get(c, 3)) for c in COLUMNS])


_TABLE = [("offered", "offered_qps", 1), ("clients", "concurrency", 0), ("achieved", "achieved_qps", 1),
          ("ok", "ok", 0), ("errors", "errors", 0), ("p50 ms", "p50_ms", 2), ("p90 ms", "p90_ms", 2),
          ("p99 ms", "p99_ms", 2), ("max ms", "max_ms", 2), ("avg batch", "avg_batch_size", 2),
          ("avg queue", "avg_queue_depth", 2),
          ("errors by status", "errors_by_status", 0)]


def format_table(rows: Sequence[dict]) -> str:
    """The printed table (one line per step); closed-loop tables show clients instead of offered QPS."""
    mode = rows[0]["mode"] if rows else "open"
    cols = [c for c in _TABLE if c[1] != ("concurrency" if mode == "open" else "offered_qps")]
    cells = [[h for h, _, _ in cols]] + [[_fmt(r.get(k), d) for _, k, d in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) if i < len(cols) - 1 else c for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def plot(rows: Sequence[dict], path: Path, title: str) -> None:
    """Latency percentiles (log scale) against achieved QPS, and achieved against offered QPS (or clients)."""
    import matplotlib

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


# ------------------------------------------------------------------------------------------------------- CLI

DESCRIPTION = __doc__.split("\n\n")[0] + """

Open loop (default): requests go out at the offered rate whatever the server does; latency counts from each
request's scheduled send time (no coordinated omission). Closed loop: N clients, each sending its next request
when the previous one is answered. Writes OUT/sweep.csv, OUT/sweep.png, OUT/sweep.json and prints the table.
The input comes from the model metadata (GET /v2/models/NAME), from --input-name/--datatype/--shape, or from
--input-file."""

EPILOG = "CSV columns:\n" + "\n".join(f"  {c:<17} {d}" for c, d in COLUMN_DOCS.items() if d) + """

examples:
  python -m bench sweep --url 127.0.0.1:8000 --model resnet18 --rates 50,100,200 --duration 10 --out out/r18
  python -m bench sweep --url 127.0.0.1:8000 --model ppocr_rec --shape 1,3,48,320 --rates 10:50:10 --json \\
      --arrivals poisson --timeout-us 200000 --duration 5 --out out/rec
  python -m bench sweep --url 127.0.0.1:8000 --model tiny_cnn --mode closed --concurrency 1,4,16 \\
      --duration 5 --out out/closed
  Triton: --url 127.0.0.1:8000 --metrics-url http://127.0.0.1:8002/metrics"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 or 127.0.0.1:8000")
    g.add_argument("--model", required=True, help="model name")
    g.add_argument("--model-version", default=None, help="model version (default: the server's choice)")
    g.add_argument("--metrics-url", default=None,
                   help="Prometheus endpoint for average batch sizes (default: URL/metrics; Triton serves "
                        "them on port 8002)")
    g.add_argument("--no-metrics", action="store_true", help="do not read /metrics (avg_batch_size blank)")
    g = p.add_argument_group("load")
    g.add_argument("--mode", choices=["open", "closed"], default="open",
                   help="open: fixed offered rates (--rates); closed: N concurrent clients (--concurrency) "
                        "(default: open)")
    g.add_argument("--rates", default=None,
                   help="open loop: offered rates in req/s, comma separated or start:stop:step, e.g. 20,40,80 "
                        "or 10:100:10")
    g.add_argument("--concurrency", default=None,
                   help="closed loop: client counts to sweep, e.g. 1,4,16 (or start:stop:step)")
    g.add_argument("--arrivals", choices=["constant", "poisson"], default="constant",
                   help="open loop: evenly spaced sends or a Poisson process (default: constant)")
    g.add_argument("--duration", type=float, default=10.0, help="measured seconds per step (default: 10)")
    g.add_argument("--warmup", type=float, default=1.0,
                   help="seconds at the same load before each step's window, not measured (default: 1)")
    g.add_argument("--processes", type=int, default=1,
                   help="client processes sharing the load, so the client is not the bottleneck (default: 1)")
    g.add_argument("--max-inflight", type=int, default=512,
                   help="open loop: most outstanding requests (all processes together); beyond it a request "
                        "is not sent and counts as client-overload (default: 512)")
    g.add_argument("--max-send-lag-ms", type=float, default=100.0,
                   help="open loop: a request the client cannot send within this many ms of its scheduled "
                        "time is not sent and counts as client-overload (default: 100)")
    g.add_argument("--client-timeout", type=float, default=10.0,
                   help="seconds to wait for an answer before counting client-timeout (default: 10)")
    g.add_argument("--seed", type=int, default=0, help="seed of Poisson arrivals and random inputs (default: 0)")
    g = p.add_argument_group("request")
    g.add_argument("--json", action="store_true", help="JSON tensors (default: the binary tensor extension)")
    g.add_argument("--timeout-us", type=int, default=None,
                   help="per-request deadline sent as parameters.timeout (microseconds)")
    g.add_argument("--input-name", default=None,
                   help="input to send (default: every input in the model metadata)")
    g.add_argument("--datatype", default=None, choices=list(DTYPES),
                   help="input datatype (default: from the metadata)")
    g.add_argument("--shape", action="append", default=[], metavar="[NAME:]DIMS",
                   help="input shape, e.g. 1,3,224,224 or 1x3x48x320: all dims, or just the metadata's -1 dims "
                        "in order; NAME: for one input of several; repeatable (default: the metadata's, with a "
                        "leading -1 set to --batch-size)")
    g.add_argument("--batch-size", type=int, default=1,
                   help="rows per request where the metadata's leading dim is -1 and no --shape (default: 1)")
    g.add_argument("--input-file", action="append", default=[], metavar="[NAME=]FILE",
                   help="sample tensor(s) sent as they are (include the batch dim): .npy for one input "
                        "(--input-name or the first), .npz for inputs by name; repeatable")
    g = p.add_argument_group("output")
    g.add_argument("--out", required=True, type=Path, help="directory for sweep.csv, sweep.png and sweep.json")
    g.add_argument("--title", default=None, help="plot title (default: model, mode and arrivals)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _json_row(row: dict) -> dict:
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


def _load_arrays(items: Sequence[str]) -> dict[str | None, np.ndarray]:
    arrays: dict[str | None, np.ndarray] = {}
    for item in items:
        name, _, path = item.rpartition("=") if "=" in item else (None, "", item)
        loaded = np.load(path, allow_pickle=True)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            if name:
                raise ValueError(f"--input-file {item}: an .npz names its inputs itself")
            arrays.update({k: loaded[k] for k in loaded.files})
        else:
            arrays[name or None] = loaded
    return arrays


def main(args: argparse.Namespace) -> int:
    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    try:
        if args.mode == "open":
            if args.concurrency:
                return fail("--concurrency is for --mode closed (open loop sweeps --rates)")
            if not args.rates:
                return fail("--rates is required in open loop (e.g. --rates 20,40,80)")
            rates, conc = parse_list(args.rates, float), []
        else:
            if args.rates:
                return fail("--rates is for --mode open (closed loop sweeps --concurrency)")
            if not args.concurrency:
                return fail("--concurrency is required in closed loop (e.g. --concurrency 1,4,16)")
            rates, conc = [], parse_list(args.concurrency, int)
        if args.duration <= 0 or args.warmup < 0 or args.processes < 1 or args.max_inflight < 1:
            return fail("--duration must be > 0, --warmup >= 0, --processes >= 1, --max-inflight >= 1")
        if args.processes > args.max_inflight and args.mode == "open":
            return fail("--max-inflight must be at least --processes")
        shapes: dict[str | None, list[int]] = {}
        for s in args.shape:
            name, dims = parse_shape(s)
            shapes[name] = dims
        arrays = _load_arrays(args.input_file)
    except (ValueError, OSError) as e:
        return fail(str(e))

    base = base_url(args.url)
    meta = None
    meta_error = ""
    try:
        meta = json.loads(_get(base + model_path(args.model, args.model_version)))
    except (urllib.error.URLError, OSError, ValueError) as e:
        meta_error = f" (GET {model_path(args.model, args.model_version)}: {e})"
    try:
        specs = resolve_inputs(meta, input_name=args.input_name, datatype=args.datatype, shapes=shapes,
                               arrays=arrays, batch_size=args.batch_size)
    except ValueError as e:
        return fail(f"{e}{meta_error}")
    rng = np.random.default_rng(args.seed)
    tensors = [(s.name, s.datatype, make_tensor(s, rng)) for s in specs]
    body, headers = build_request(tensors, binary=not args.json, timeout_us=args.timeout_us)
    metrics_url = None if args.no_metrics else (args.metrics_url or base + "/metrics")
    cfg = SweepConfig(
        url=base, model=args.model, mode=args.mode, rates=rates, concurrency=conc, duration=args.duration,
        warmup=args.warmup, arrivals=args.arrivals, processes=args.processes, max_inflight=args.max_inflight,
        max_lag_s=args.max_send_lag_ms / 1e3, client_timeout_s=args.client_timeout, metrics_url=metrics_url,
        version=args.model_version, seed=args.seed, progress=not args.no_progress,
    )
    desc = ", ".join(f"{n} {d} {list(t.shape)}" for n, d, t in tensors)
    print(f"{args.model} at {base}: {desc}, {'JSON' if args.json else 'binary'}, {len(body)} B/request, "
          f"{args.mode} loop" + (f", {args.arrivals} arrivals" if args.mode == "open" else ""), file=sys.stderr)
    rows: list[dict] = []
    interrupted = False
    try:
        run_sweep(cfg, body, headers, rows)
    except KeyboardInterrupt:
        print(f"\ninterrupted: keeping the {len(rows)} finished step(s)", file=sys.stderr)
        interrupted = True
        if not rows:
            return 130

    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "sweep.csv")
    title = args.title or (f"{args.model}: {args.mode} loop" + (f", {args.arrivals}" if args.mode == "open" else "")
                           + f", {args.duration:g} s/step, {'JSON' if args.json else 'binary'}")
    plot(rows, args.out / "sweep.png", title)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    (args.out / "sweep.json").write_text(json.dumps(
        {"settings": settings, "inputs": [{"name": n, "datatype": d, "shape": list(t.shape)} for n, d, t in tensors],
         "request_bytes": len(body), "columns": COLUMN_DOCS, "rows": [_json_row(r) for r in rows]}, indent=1,
        default=str))
    print(format_table(rows))
    print(f"wrote {args.out / 'sweep.csv'}, {args.out / 'sweep.png'}, {args.out / 'sweep.json'}", file=sys.stderr)
    return 130 if interrupted else 0
