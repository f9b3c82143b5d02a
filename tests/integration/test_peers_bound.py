"""``python -m bench.peers --sections bound``: ours and a bare aiohttp handler under h2load, each thread's CPU from
``/proc``; the table's columns hold real, consistent values (a thread holds at most one core, the busiest thread is
one of the server's, the machine has the cores it has)."""

from __future__ import annotations

import os

import pytest

from bench.peers import main
from bench.sweep.report import read_csv


def test_the_bound_section_measures_each_server_by_thread(h2load, tmp_path, cache_dir):
    out = tmp_path / "bound"
    assert main(["--out", str(out), "--sections", "bound", "--encodings", "binary", "--duration", "1",
                 "--warmup", "0.3", "--bound-clients", "4", "--models-dir", str(tmp_path / "models")]) == 0
    rows = read_csv(out / "bound.csv")
    assert [(r["server"], r["encoding"], r["clients"]) for r in rows] == [("ours", "binary", "4"),
                                                                          ("bare-uvloop", "binary", "4")]
    for r in rows:
        qps, busiest, threads = float(r["qps"]), float(r["busiest_thread_cores"]), float(r["server_threads_cores"])
        assert qps > 0 and r["errors"] == "0", r
        assert 0 < busiest <= 1.05 and busiest <= threads + 1e-9, r
        # the columns are rounded to 3 decimals: "0.381" cores is 0.3805-0.3815
        assert float(r["busiest_thread_us_per_req"]) == pytest.approx(busiest / qps * 1e6, abs=0.0006 / qps * 1e6)
        assert 0 < float(r["machine_busy_cores"]) <= os.cpu_count() + 0.05, r
        assert int(r["machine_cores"]) == os.cpu_count()
    ours, bare = rows
    # ours: the event loop, and the executor's thread unless the MLP's batches ran inline on the loop
    # (server.inline_execution_us, 100 us: this MLP's batches of a few rows lie near it, so either may happen)
    assert int(ours["threads"]) >= 1 and int(bare["threads"]) == 1
