"""Per-batch timelines, to find where a pipelined GPU context waits (a diagnostic: off unless
``BATCHER_BATCH_TRACE`` names a folder).

Each batch is followed from its dispatch on the event loop to its end there, one timestamp per step, all on
``time.perf_counter()`` (``CLOCK_MONOTONIC`` on Linux: one clock for every thread and process of the machine, so a
load generator's step windows can be laid over it):

=============  ====================================================================================
``dispatch``   the scheduler hands the batch to its executor (event loop)
``stage0/1``   the staging thread starts and ends :func:`batcher.batch_steps.stage_batch`
``put``        the staged batch is queued for the context's thread (:meth:`DevicePipeline.put`)
``launch0/1``  the context's thread starts and ends ``context.launch`` (copies, graph, event queued)
``collect0/1`` it starts waiting for the batch and has its outputs (``context.collect`` returned)
``post``       the result is handed to the event loop (``call_soon_threadsafe``)
``finish``     the scheduler settles the batch (event loop)
=============  ====================================================================================

plus the batch's rows, padded rows and, from the context's CUDA timing events, its device time and the device's
idle time before it (``device_s``, ``idle_s``). Every batch gets a row, but only a pipelined context (a CUDA-graph
context: ``pipeline_depth`` 2, a staging thread) has the steps between ``dispatch`` and ``finish``; on a CPU context
those columns stay empty. Each process of the server writes ``<folder>/batches-<pid>.csv`` when it exits (at most
:data:`MAX_ROWS` batches, the newest); those of the supervisor and the front ends hold only the header, the engine
processes' the rows. The folder is made when the process starts: one that cannot be made is logged (WARNING) and
nothing is traced. ``python -m bench.gpubench.trace`` reads them.

Cost when off: a call and a test per step (about ten per batch). When on: a dict write per step (the GIL makes
them safe from any thread); the rows kept are written only at exit.
"""

from __future__ import annotations

import atexit
import csv
import logging
import os
import time
from collections import deque
from typing import Any

log = logging.getLogger(__name__)

#: the environment variable naming the folder; unset or empty: no tracing
ENV = "BATCHER_BATCH_TRACE"
#: the steps of a batch, in order (the CSV's columns after ``batch``)
STEPS = ("dispatch", "stage0", "stage1", "put", "launch0", "launch1", "collect0", "collect1", "post", "finish")
COLUMNS = ("batch", *STEPS, "rows", "padded_rows", "device_s", "idle_s")
#: batches kept per process (the newest): about 3 minutes of an H200 at 350 batches/s
MAX_ROWS = 65536


class _Trace:
    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.open: dict[int, dict[str, Any]] = {}  # id(batch list) -> its row so far
        self.rows: deque[dict[str, Any]] = deque(maxlen=MAX_ROWS)
        self.count = 0
        atexit.register(self.write)

    def write(self) -> None:
        path = os.path.join(self.folder, f"batches-{os.getpid()}.csv")
        try:
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
                w.writeheader()
                w.writerows(self.rows)
        except OSError as exc:  # the folder went away meanwhile: said, not raised at exit
            log.warning("%s: cannot write the batch trace %s: %s", ENV, path, exc)


def _start(folder: str) -> _Trace | None:
    """The process's trace into ``folder`` (made now), or None when it is unset or cannot be made (logged)."""
    if not folder:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        log.warning("%s=%s: not tracing batches, the folder cannot be made: %s", ENV, folder, exc)
        return None
    return _Trace(folder)


#: the process's trace, or None (off)
TRACE: _Trace | None = _start(os.environ.get(ENV, ""))


def mark(batch: Any, step: str) -> None:
    """Stamp ``step`` of ``batch`` (the scheduler's list of requests) now; no-op when tracing is off."""
    if TRACE is not None:
        row = TRACE.open.get(id(batch))
        if row is None:
            if step != "dispatch":
                return  # a batch dispatched before tracing began (or run alone): not followed
            TRACE.count += 1
            row = TRACE.open[id(batch)] = {"batch": TRACE.count}
        row[step] = time.perf_counter()


def end(batch: Any, rows: int, padded_rows: int, device: Any) -> None:
    """Stamp ``finish`` and close ``batch``'s row with what it came to (``device``: its
    :class:`~engines.base.DeviceTimes` or None)."""
    if TRACE is not None:
        row = TRACE.open.pop(id(batch), None)
        if row is None:
            return
        row["finish"] = time.perf_counter()
        row["rows"], row["padded_rows"] = rows, padded_rows
        if device is not None:
            row["device_s"], row["idle_s"] = device.busy_s, device.idle_s
        TRACE.rows.append(row)
