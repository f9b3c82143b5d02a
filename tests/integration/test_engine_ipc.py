"""bench.engine_ipc end to end on the CPU: a real engine process of multi-process mode, driven over its Unix socket by
driver processes; every answer the drivers received is counted once by the engine, and the CSV has the measures."""

from __future__ import annotations

import os

import pytest

from bench.engine_ipc import main
from bench.sweep.report import read_csv


@pytest.mark.parametrize("transport", ["area", "shm"])
def test_the_engine_alone_answers_every_request_and_counts_each_once(tmp_path, transport):
    out = tmp_path / "engine_ipc.csv"
    before = {n for n in os.listdir("/dev/shm") if n.startswith("engine-ipc-")}
    assert main(["--drivers", "2", "--concurrency", "8", "--duration", "1", "--warmup", "0.5", "--out", str(out),
                 "--transport", transport]) == 0
    (row,) = read_csv(out)
    assert row["transport"] == transport
    assert row["errors"] == "0" and float(row["req_per_s"]) > 0
    assert {n for n in os.listdir("/dev/shm") if n.startswith("engine-ipc-")} == before  # the drivers' segments
    assert int(row["answered_total"]) > 0 and row["engine_counted"] == row["answered_total"]
    assert float(row["engine_cpu_us_per_req"]) >= float(row["loop_cpu_us_per_req"]) > 0
