"""Prometheus metrics, labelled ``model`` and ``version``.

Names are fixed (dashboards rely on them); each mirrors a Triton metric:

================================================  ===============================================
ours                                              Triton
================================================  ===============================================
``batcher_request_success_total``                 ``nv_inference_request_success``
``batcher_request_failure_total{reason}``         ``nv_inference_request_failure{reason}``
``batcher_inference_count_total`` (rows run)      ``nv_inference_count``
``batcher_execution_count_total`` (batches run)   ``nv_inference_exec_count``
``batcher_queue_duration_seconds`` (histogram)    ``nv_inference_queue_duration_us``
``batcher_compute_duration_seconds`` (histogram)  ``nv_inference_compute_infer_duration_us``
``batcher_compute_input_seconds_total``           ``nv_inference_compute_input_duration_us``
``batcher_compute_infer_seconds_total``           ``nv_inference_compute_infer_duration_us`` (sum)
``batcher_compute_output_seconds_total``          ``nv_inference_compute_output_duration_us``
``batcher_batch_size`` (histogram, rows)          (none; Triton only has the two counts above)
``batcher_queue_depth`` (gauge, requests)         ``nv_inference_pending_request_count``
``batcher_padded_rows_total``                     (none; zero rows padding batches to allowed sizes)
``batcher_device_busy_seconds_total``             (none; device time of the batches, CUDA events)
``batcher_device_idle_seconds`` (histogram)       (none; the device's idle gap before each batch)
================================================  ===============================================

The two device families come from CUDA timing events recorded on each CUDA-graph context's stream before a
batch's first copy and after its last (:class:`engines.base.DeviceTimes`): busy is the batch's copies and
kernels, idle the time the stream sat empty between the previous batch of that context and this one (0 when
the batch was queued behind it). Under load, ``rate(batcher_device_busy_seconds_total)`` is the share of one
device the model keeps busy (per context: divide by the contexts), and idle gaps show the host being late;
``batcher_compute_infer_seconds_total`` is the host's view of the same batches (waits included).

Failure reasons: ``invalid`` (400/413), ``rejected`` (503: queue full, not ready), ``timeout`` (504: deadline
passed before execution), ``backend`` (500: engine error), ``canceled`` (client went away), ``other``.

Average batch size = ``rate(batcher_inference_count_total) / rate(batcher_execution_count_total)``.

Per-request counts go through :class:`Tally` (written once per pass of the event loop) and a batch's queue times
through :func:`observe_many` (one write per bucket): see the README's "Metrics".

Multi-process mode (``server.frontends`` >= 1): every process of the server writes its samples into the folder of
``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode; the supervisor sets it before any process
imports prometheus-client and wipes it at start), and ``/metrics`` on any front end reads them all: counters and
histograms add up over processes, gauges as their ``multiprocess_mode`` says (queue depths, memory and throughput
add up over the live engine processes; ``batcher_model_loaded`` is the maximum; the retention ratio the latest).
"""

from __future__ import annotations

import asyncio
import bisect
import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

if TYPE_CHECKING:
    from engines.base import DeviceTimes

LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: the device's idle gaps before batches: 0 (queued behind the last batch) to the 1-10 ms of a host that is late
#: for a batch of a few milliseconds, and the seconds of a model without load
IDLE_BUCKETS_S = (
    0.000001, 0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.1, 1.0, 10.0,
)


def read_pid_once() -> None:
    """In a process of multi-process mode, before it makes any metric: prometheus-client's multiprocess values call
    ``os.getpid()`` (a system call) at every update, to notice a ``fork`` and move to a file of the child's own;
    this server's processes are spawned and never fork one that writes metrics, so the pid is read once here
    (``MultiProcessValue(process_identifier=...)``; the 2-core machine's engine process made 2.8 ``getpid`` calls
    per request). Does nothing outside multi-process mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import values

        pid = os.getpid()
        values.ValueClass = values.MultiProcessValue(process_identifier=lambda: pid)


class _EveryProcess(MultiProcessCollector):
    """prometheus-client's ``MultiProcessCollector``, less the files another process has created but not sized yet.

    A process's value file is created empty and then grown to its first size: read in between (a second engine
    process starting, or a scrape, while one starts), prometheus-client's reader fails on it (``struct.error``:
    an engine process died at start in CI; a scrape would answer 500). An empty file holds no sample yet, so it is
    left out; once it has its size, its header says how much of it is written."""

    def collect(self):
        files = [f for f in glob.glob(os.path.join(self._path, "*.db")) if _sized(f)]
        return self.merge(files, accumulate=True)


def _sized(path: str) -> bool:
    try:
        return os.path.getsize(path) >= 8  # the header: bytes used, and padding
    except OSError:  # removed meanwhile (a process that exited: its live gauges)
        return False


def observe_many(histogram: Any, values: Sequence[float]) -> None:
    """``histogram.observe(v)`` for every ``v`` of ``values`` (a labelled child), written once per bucket touched and
    once for the sum instead of twice per value: each write is a shared-file write in multi-process mode (0.8 us an
    increment, 1.7 us an observation on the 2-core machine). Uses the child's ``_upper_bounds``, ``_buckets`` and
    ``_sum`` (prometheus-client 0.17 to 0.26; ``tests/unit/test_metrics_tally.py`` checks the exposition equals
    observing one by one), else observes one by one."""
    bounds, buckets, total = (getattr(histogram, a, None) for a in ("_upper_bounds", "_buckets", "_sum"))
    if len(values) < 2 or bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            histogram.observe(v)
        return
    counts: dict[int, int] = {}
    for v in values:
        if v == v:  # a NaN falls in no bucket, as observe() has it
            i = bisect.bisect_left(bounds, v)  # the first bound >= v: observe()'s bucket
            counts[i] = counts.get(i, 0) + 1
    total.inc(sum(values))
    for i, k in counts.items():
        if i < len(buckets):
            buckets[i].inc(k)


class Tally:
    """The per-request increments and observations of one pass of the event loop, written at its end: once per
    counter and per histogram (:func:`observe_many`) instead of once per request. An engine process at saturation
    answers a batch's requests in the same pass, and each write of multi-process mode goes to a shared file.
    Anything that reads the metrics of this process (``/metrics``, ``registry.get_sample_value``) writes what is
    pending first (:class:`Metrics` registers :meth:`collect`), so a client that scrapes after its answer sees it
    counted; another process's scrape (multi-process mode) sees it once the pass has ended. Used on the event
    loop only."""

    def __init__(self) -> None:
        self._incs: dict[Any, float] = {}
        self._seen: dict[Any, list[float]] = {}
        self._due = False

    def inc(self, counter: Any, amount: float = 1.0) -> None:
        self._incs[counter] = self._incs.get(counter, 0.0) + amount
        self._schedule()

    def observe(self, histogram: Any, value: float) -> None:
        seen = self._seen.get(histogram)
        if seen is None:
            self._seen[histogram] = [value]
        else:
            seen.append(value)
        self._schedule()

    def _schedule(self) -> None:
        if self._due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a test, a script): written now
            self.flush()
            return
        self._due = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write everything pending (also called when the process's metrics are read, and at shutdown)."""
        self._due = False
        incs, self._incs = self._incs, {}
        seen, self._seen = self._seen, {}
        for counter, amount in incs.items():
            counter.inc(amount)
        for histogram, values in seen.items():
            observe_many(histogram, values)

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        """As a collector registered first in a registry: flushes before the registry's families are read."""
        self.flush()
        return []


class Metrics:
    """The service's metric families, in their own registry (one per app, so apps in one process don't clash)."""

    def __init__(self) -> None:
        #: what ``/metrics`` exposes: this object's families, or in multi-process mode every process's samples.
        self.registry = CollectorRegistry(auto_describe=True)
        #: the per-request counts, written once per pass of the event loop (:class:`Tally`)
        self.tally = Tally()
        self.registry.register(self.tally)  # first: a read writes what is pending, then reads the families
        self._outcomes: dict[tuple[str, str], Outcomes] = {}
        labels = ("model", "version")
        r = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            r = CollectorRegistry(auto_describe=True)  # the families write their files; they are read back from there
            _EveryProcess(self.registry)
        self.success = Counter(
            "batcher_request_success", "Inference requests answered with outputs", labels, registry=r
        )
        self.failure = Counter(
            "batcher_request_failure", "Inference requests answered with an error, by reason",
            (*labels, "reason"), registry=r,
        )
        self.inference_count = Counter(
            "batcher_inference_count", "Rows (inferences) executed; a batch of n rows adds n", labels, registry=r
        )
        self.execution_count = Counter(
            "batcher_execution_count", "Batches executed (engine executions)", labels, registry=r
        )
        self.queue_duration = Histogram(
            "batcher_queue_duration_seconds", "Time a request waited in the queue before its batch started",
            labels, buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.request_duration = Histogram(
            "batcher_request_duration_seconds",
            "Time from a request's arrival to its answer in the server, successful requests (queue + compute)",
            labels, buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.compute_duration = Histogram(
            "batcher_compute_duration_seconds", "Engine execution time of a batch (stack, run, split)",
            labels, buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.compute_input = Counter(
            "batcher_compute_input_seconds", "Time spent stacking batches' inputs (into pinned memory on GPU)",
            labels, registry=r,
        )
        self.compute_infer = Counter(
            "batcher_compute_infer_seconds", "Time spent in engine execution (copies, kernels, synchronisation)",
            labels, registry=r,
        )
        self.compute_output = Counter(
            "batcher_compute_output_seconds", "Time spent splitting batches' outputs back to requests",
            labels, registry=r,
        )
        self.batch_size = Histogram(
            "batcher_batch_size", "Rows per executed batch", labels, buckets=BATCH_BUCKETS, registry=r
        )
        self.queue_depth = Gauge(
            "batcher_queue_depth", "Requests waiting in the model's queue", labels, registry=r,
            multiprocess_mode="livesum",
        )
        self.padded_rows = Counter(
            "batcher_padded_rows", "Zero rows executed to pad batches up to an allowed batch size (never answered)",
            labels, registry=r,
        )
        self.device_busy = Counter(
            "batcher_device_busy_seconds", "Device time of executed batches, first copy to last (CUDA timing events)",
            labels, registry=r,
        )
        self.device_idle = Histogram(
            "batcher_device_idle_seconds", "Time a context's device stream sat empty before each batch (CUDA "
            "timing events; 0: queued behind the previous batch)", labels, buckets=IDLE_BUCKETS_S, registry=r,
        )

        # model lifecycle and memory (load strategies, LRU budget)
        self.model_loaded = Gauge("batcher_model_loaded", "1 while the model version is loaded and ready, else 0",
                                  labels, registry=r, multiprocess_mode="livemax")
        self.model_memory = Gauge(
            "batcher_model_memory_bytes",
            "Memory of a loaded model: kind=budgeted (counted against the budget), footprint (engine + contexts as "
            "the backend reports), measured (growth measured at load), device (GPU memory of its engine and "
            "contexts, CUDA graphs and workspaces included)", (*labels, "kind"), registry=r,
            multiprocess_mode="livesum",
        )
        self.memory_used = Gauge("batcher_memory_used_bytes", "Memory counted against the budget by loaded models",
                                 registry=r, multiprocess_mode="livesum")
        self.memory_budget = Gauge("batcher_memory_budget_bytes", "The lru memory budget (0: none)", registry=r,
                                   multiprocess_mode="livesum")
        self.model_load = Counter("batcher_model_load", "Model loads", labels, registry=r)
        self.model_unload = Counter("batcher_model_unload", "Model unloads by reason (evict: lru; unload: request)",
                                    (*labels, "reason"), registry=r)
        self.throughput = Gauge(
            "batcher_throughput_requests_per_second",
            "Successful requests per second over the last 10 s", labels, registry=r, multiprocess_mode="livesum",
        )
        self.retention = Gauge(
            "batcher_retention_ratio",
            "While two or more models are active: their total throughput over the sum of each one's best throughput "
            "when it was the only active model (the seed's retention ratio, live); NaN otherwise",
            registry=r, multiprocess_mode="livemostrecent",
        )
        self.retention.set(float("nan"))
        self.worker_restart = Counter(
            "batcher_worker_restart", "Worker processes (mode: multiproc) replaced after they died", labels, registry=r,
        )
        self.inflight_body_bytes = Gauge(
            "batcher_inflight_body_bytes", "Bytes of request bodies being read or held (reserved against "
            "server.max_inflight_body_bytes; multi-process mode: summed over the front ends)", registry=r,
            multiprocess_mode="livesum",
        )
        self.inflight_body_budget = Gauge(
            "batcher_inflight_body_budget_bytes", "server.max_inflight_body_bytes (multi-process mode: summed over the "
            "front ends, each has its own)", registry=r, multiprocess_mode="livesum",
        )
        self.model_load_duration = Histogram(
            "batcher_model_load_duration_seconds", "Time to load a model (engine, contexts, warm-up)", labels,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0), registry=r,
        )

    def outcomes(self, model: str, version: str) -> Outcomes:
        """The outcome counters of one model version (children looked up once, then cached: this is per request)."""
        key = (model, version)
        found = self._outcomes.get(key)
        if found is None:
            found = self._outcomes[key] = Outcomes(self.success.labels(model, version),
                                                   self.request_duration.labels(model, version),
                                                   self.failure, key, self.tally)
        return found

    def for_model(self, model: str, version: str) -> ModelMetrics:
        """The execution-side children bound to one model version (label lookups done once, off the hot path)."""
        lv = (model, version)
        return ModelMetrics(
            inference_count=self.inference_count.labels(*lv),
            execution_count=self.execution_count.labels(*lv),
            queue_duration=self.queue_duration.labels(*lv),
            compute_duration=self.compute_duration.labels(*lv),
            batch_size=self.batch_size.labels(*lv),
            compute_input=self.compute_input.labels(*lv),
            compute_infer=self.compute_infer.labels(*lv),
            compute_output=self.compute_output.labels(*lv),
            queue_depth=self.queue_depth.labels(*lv),
            padded_rows=self.padded_rows.labels(*lv),
            device_families=(self.device_busy, self.device_idle, lv),
        )


class Outcomes:
    """One model version's request outcome metrics: success, its duration, failure by reason."""

    def __init__(self, success: Counter, duration: Histogram, failure: Counter, labels: tuple[str, str],
                 tally: Tally | None = None) -> None:
        self.success, self.duration = success, duration
        self._failure, self._labels = failure, labels
        self._by_reason: dict[str, Counter] = {}
        self._tally = tally

    def succeeded(self, seconds: float) -> None:
        """One success that took ``seconds`` from arrival to answer (through the tally, where there is one)."""
        if self._tally is None:
            self.success.inc()
            self.duration.observe(seconds)
        else:
            self._tally.inc(self.success)
            self._tally.observe(self.duration, seconds)

    def failure(self, reason: str) -> Counter:
        child = self._by_reason.get(reason)
        if child is None:
            child = self._by_reason[reason] = self._failure.labels(*self._labels, reason)
        return child


class ProcessMetrics:
    """The supervisor's metric in multi-process mode (its samples reach ``/metrics`` through the shared folder)."""

    def __init__(self) -> None:
        self.restart = Counter(
            "batcher_process_restart", "Front-end and engine processes (multi-process mode) replaced after they died",
            ("process",), registry=CollectorRegistry(),
        )


@dataclass
class ModelMetrics:
    """The execution-side metrics of one model version (the scheduler's); request outcomes are counted by the
    data plane on :class:`Metrics` itself."""

    inference_count: Counter
    execution_count: Counter
    queue_duration: Histogram
    compute_duration: Histogram
    batch_size: Histogram
    queue_depth: Gauge
    compute_input: Counter
    compute_infer: Counter
    compute_output: Counter
    padded_rows: Counter
    #: (busy counter, idle histogram, labels): their children are made at the first batch timed on a device, so
    #: a model that never runs on one exports no device series
    device_families: tuple[Counter, Histogram, tuple[str, str]] | None = None
    _device: tuple[Any, Any] | None = None

    def batch(self, rows: int, padded_rows: int, times: tuple[float, float, float],
              device: DeviceTimes | None = None) -> None:
        """One executed batch: ``rows`` requests' rows plus ``padded_rows``; seconds stacking, executing, splitting;
        its device times where the context took them."""
        if device is not None and self.device_families is not None:
            if self._device is None:
                busy, idle, lv = self.device_families
                self._device = (busy.labels(*lv), idle.labels(*lv))
            self._device[0].inc(device.busy_s)
            if device.idle_s is not None:
                self._device[1].observe(device.idle_s)
        t_input, t_infer, t_output = times
        self.execution_count.inc()
        self.inference_count.inc(rows)
        self.batch_size.observe(rows)
        self.compute_duration.observe(t_input + t_infer + t_output)
        self.compute_input.inc(t_input)
        self.compute_infer.inc(t_infer)
        self.compute_output.inc(t_output)
        self.padded_rows.inc(padded_rows)
