"""Model lifecycle observability: load, evict and unload events (``GET /v2/repository/events``), their log lines
and the lifecycle and memory metrics of :mod:`batcher.metrics`."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engines.memory import rss_bytes

from .metrics import Metrics

if TYPE_CHECKING:
    from .slots import ModelSlot

log = logging.getLogger("batcher.repository")

MiB = 1 << 20


class LifecycleEvents:
    """The last ``maxlen`` lifecycle events, newest last, with the metrics they move."""

    def __init__(self, metrics: Metrics, maxlen: int = 1000) -> None:
        self.metrics = metrics
        self.events: collections.deque[dict] = collections.deque(maxlen=maxlen)
        self._t0 = time.monotonic()

    def record(self, kind: str, slot: ModelSlot, seconds: float, rss_before: int, used_after: int) -> None:
        """One ``load``, ``evict`` or ``unload`` of ``slot`` that took ``seconds``; resident memory before it
        and the bytes counted against the budget after it (bytes)."""
        ev = {
            "time_s": round(time.monotonic() - self._t0, 4),
            "event": kind,
            "model": slot.name,
            "version": slot.version,
            "duration_ms": round(seconds * 1e3, 2),
            "rss_before_bytes": rss_before,
            "rss_after_bytes": rss_bytes(),
            "model_bytes": slot.budget_bytes,
            "used_bytes_after": used_after,
        }
        self.events.append(ev)
        m = self.metrics
        if kind == "load":
            m.model_load.labels(slot.name, slot.version).inc()
            m.model_load_duration.labels(slot.name, slot.version).observe(seconds)
        else:
            m.model_unload.labels(slot.name, slot.version, kind).inc()
        log.info(
            "%s model %s version %s in %.1f ms: resident %.0f -> %.0f MB; model counts %.0f MB, all loaded models "
            "%.0f MB (%s)",
            kind, slot.name, slot.version, seconds * 1e3, ev["rss_before_bytes"] / MiB, ev["rss_after_bytes"] / MiB,
            slot.budget_bytes / MiB, used_after / MiB, slot.reason or "ready",
        )

    def update_memory(self, slots: Iterable[ModelSlot], used_bytes: int) -> None:
        """Set the per-model loaded/memory gauges and the total counted against the budget."""
        m = self.metrics
        for s in slots:
            loaded = s.loaded_or_unloading
            m.model_loaded.labels(s.name, s.version).set(1 if s.state == "READY" else 0)
            m.model_memory.labels(s.name, s.version, "budgeted").set(s.budget_bytes if loaded else 0)
            m.model_memory.labels(s.name, s.version, "footprint").set((s.footprint_bytes or 0) if loaded else 0)
            m.model_memory.labels(s.name, s.version, "measured").set((s.measured_bytes or 0) if loaded else 0)
            m.model_memory.labels(s.name, s.version, "device").set(s.device_bytes if loaded else 0)
        m.memory_used.set(used_bytes)
