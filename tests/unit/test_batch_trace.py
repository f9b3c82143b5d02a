"""The per-batch trace (:mod:`batcher.batch_trace`): a real :class:`~batcher.scheduler.ModelRunner` over a real
:class:`~batcher.executor.ThreadExecutor` whose context takes two batches at once (``launch`` / ``collect``, as a
CUDA-graph context), the trace switched on for the test; then its CSV, and :mod:`bench.gpubench.trace` reading it.

Times here are real (threads), so nothing asserts a duration: only that every step of every batch is stamped, in
the order a batch passes them, and what the summary counts."""

from __future__ import annotations

import asyncio
import csv

import numpy as np
import pytest
from fakes import FakeContext, model_config, rows, signature

from batcher import batch_trace
from batcher.executor import ThreadExecutor
from batcher.metrics import Metrics
from batcher.scheduler import ModelRunner
from bench.gpubench import trace as trace_summary
from engines.base import DeviceTimes


class TwoDeep(FakeContext):
    """``y = 2 * x`` with launch / collect (depth 2), four staging slots, and device times (1 ms busy, idle 0.2 ms
    before every batch but the first)."""

    pipeline_depth = 2
    staging_slots = 4

    def __init__(self) -> None:
        super().__init__(batch_sizes=(1, 2, 4, 8))
        self._slots = [np.zeros((8, 4), np.float32) for _ in range(self.staging_slots)]
        self.launches = 0

    def host_buffer(self, name, shape, dtype, slot=0):
        return self._slots[slot][: shape[0]]

    def launch(self, inputs):
        self.launches += 1
        return inputs["x"] * 2, self.launches

    def collect(self, launched):
        y, n = launched
        self._times = DeviceTimes(0.001, None if n == 1 else 0.0002)
        return {"y": y}

    def device_times(self):
        return self._times


@pytest.fixture
def traced(tmp_path, monkeypatch):
    trace = batch_trace._Trace(str(tmp_path))
    monkeypatch.setattr(batch_trace, "TRACE", trace)
    return trace


async def test_every_step_of_every_batch_is_stamped_in_order(traced, tmp_path):
    ctx = TwoDeep()
    ex = ThreadExecutor(ctx, "trace-test")
    cfg = model_config(max_batch_size=8, dynamic_batching={"max_queue_delay_microseconds": 2000})
    r = ModelRunner(cfg, signature(8), [ex], Metrics().for_model("m", "1"))
    now = asyncio.get_running_loop().time()
    outs = await asyncio.gather(*(r.infer(rows(1, float(i)), rows=1, received=now, deadline=None) for i in range(40)))
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out["y"], np.full((1, 4), 2.0 * i, np.float32))
    await r.close()

    traced.write()
    with open(tmp_path / f"batches-{__import__('os').getpid()}.csv", newline="") as f:
        written = list(csv.DictReader(f))
    assert len(written) == ctx.launches >= 5  # 40 rows in batches of at most 8
    assert sum(int(w["rows"]) for w in written) == 40
    assert [int(w["batch"]) for w in written] == list(range(1, len(written) + 1))
    for w in written:
        stamps = [float(w[s]) for s in batch_trace.STEPS]
        assert stamps == sorted(stamps), w
        assert float(w["device_s"]) == 0.001
    assert not traced.open  # every batch closed

    batches, seen = trace_summary.read_batches(tmp_path)
    assert seen == len(batches) == len(written)
    row = trace_summary.summarize(batches, "all", batches[0]["dispatch"], batches[-1]["dispatch"], 50e-6)
    assert row["batches"] == len(written)
    assert row["mean_rows"] == pytest.approx(40 / len(written), abs=0.01)
    # every batch after the first had 0.2 ms idle before it: each is put in exactly one class
    assert row["idle_batches_share"] == pytest.approx((len(written) - 1) / len(written), abs=0.001)
    assert row["queued_in_time"] + row["dispatched_late"] + row["staged_late"] == len(written) - 1


def test_a_batch_not_dispatched_under_the_trace_is_not_followed(traced):
    batch = [object()]
    batch_trace.mark(batch, "stage0")  # its dispatch was not seen: no row
    batch_trace.end(batch, 1, 0, None)
    assert not traced.open and not traced.rows


def test_classes_of_a_device_wait():
    prev = {"dispatch": 0.0, "launch1": 1.0, "collect0": 2.0}
    assert trace_summary.classify(prev, {"dispatch": 0.5, "put": 1.5}) == "queued in time"
    assert trace_summary.classify(prev, {"dispatch": 1.5, "put": 2.5}) == "dispatched late"
    assert trace_summary.classify(prev, {"dispatch": 0.5, "put": 2.5}) == "staged late"


def test_a_trace_without_a_pipelined_context_is_said_so(tmp_path, capsys):
    """A CPU context's batches have only dispatch and finish: counted, not summarized, and the reason given; a file
    that is not a trace is skipped with its name."""
    with open(tmp_path / "batches-1.csv", "w", newline="") as f:
        w = csv.DictWriter(f, batch_trace.COLUMNS)
        w.writeheader()
        w.writerows([{"batch": i, "dispatch": i, "finish": i + 0.5, "rows": 1, "padded_rows": 0} for i in range(3)])
    (tmp_path / "batches-2.csv.gz").write_bytes(b"not gzip")
    assert trace_summary.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "skipping" in err and "batches-2.csv.gz" in err
    assert "3 batches traced" in err and "none with every step" in err
    assert trace_summary.main([str(tmp_path / "absent")]) == 1
    assert "no traced batches" in capsys.readouterr().err


def test_a_folder_that_cannot_be_made_turns_the_trace_off(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level("WARNING", logger="batcher.batch_trace"):
        assert batch_trace._start(str(blocker / "trace")) is None
    assert "not tracing batches" in caplog.text
    assert batch_trace._start("") is None
    assert batch_trace._start(str(tmp_path / "made")).folder == str(tmp_path / "made")
    assert (tmp_path / "made").is_dir()
