"""Triton's statistics extension (``GET /v2/models[/{m}[/versions/{v}]]/stats``): counts and nanoseconds.

Rule (Triton's, ``docs/protocol/extension_statistics.md``): every inference request that reaches a model version
ends in exactly one of ``success`` (answered with outputs) and ``fail`` (answered with an error), each timed from
its arrival to its answer. ``inference_count`` and ``batch_stats`` count the requests' rows; ``padded_rows`` (this
server's addition) counts the zero rows batches were padded with to reach an allowed batch size. ``queue`` times each executed request's wait for its batch; the compute phases are per
request (each request of a batch is charged its batch's phase time), and ``batch_stats`` holds per batch size the
executions and their phase times. A slot's statistics cover its whole life (every load of it); the Prometheus
counters of :mod:`batcher.metrics` are moved by the same calls (:meth:`batcher.dataplane.DataPlane` records each
outcome once), so ``fail.count`` equals the sum of ``batcher_request_failure_total`` over reasons.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Duration:
    """A count and a total duration, as the statistics extension reports them (``{"count", "ns"}``)."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, n: int = 1) -> None:
        self.count += n
        self.ns += int(seconds * 1e9)

    def json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class Stats:
    """Cumulative statistics of one model version. Updated on the event loop only."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    #: zero rows executed to pad batches up to allowed batch sizes (this server's addition)
    padded_rows: int = 0
    last_inference_ms: int = 0
    #: batch size -> executions and their phase times (input, infer, output)
    batches: dict[int, list[Duration]] = field(default_factory=dict)

    def batch(self, rows: int, requests: int, t_input: float, t_infer: float, t_output: float,
              padded_rows: int = 0) -> None:
        """One executed batch of ``rows`` rows from ``requests`` requests, padded with ``padded_rows`` zero rows,
        and its phase times (seconds)."""
        self.inference_count += rows
        self.execution_count += 1
        self.padded_rows += padded_rows
        self.compute_input.add(t_input * requests, requests)
        self.compute_infer.add(t_infer * requests, requests)
        self.compute_output.add(t_output * requests, requests)
        per = self.batches.setdefault(rows, [Duration(), Duration(), Duration()])
        for d, t in zip(per, (t_input, t_infer, t_output)):
            d.add(t)

    def json(self, name: str, version: str) -> dict[str, Any]:
        """The extension's ``model_stats`` entry for this model version."""
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "padded_rows": self.padded_rows,
            "inference_stats": {
                "success": self.success.json(), "fail": self.fail.json(), "queue": self.queue.json(),
                "compute_input": self.compute_input.json(), "compute_infer": self.compute_infer.json(),
                "compute_output": self.compute_output.json(),
                "cache_hit": {"count": 0, "ns": 0}, "cache_miss": {"count": 0, "ns": 0},
            },
            "batch_stats": [
                {"batch_size": size, "compute_input": d[0].json(), "compute_infer": d[1].json(),
                 "compute_output": d[2].json()}
                for size, d in sorted(self.batches.items())
            ],
        }
