"""``python -m bench.body_cpu``: both servers (``server.keep_heap`` on and off) answer every request, and the CSV
has a row per server and round with the CPU split by process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.sweep.report import read_csv

ROOT = Path(__file__).resolve().parents[2]


def test_body_cpu_runs_both_servers_and_writes_its_rows(h2load, tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.body_cpu", "--out", str(tmp_path), "--requests", "200",
                        "--rounds", "1", "--clients", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_csv(tmp_path / "body_cpu.csv")
    assert [(row["keep_heap"], row["round"], row["ok"]) for row in rows] == [("True", "1", "200"),
                                                                             ("False", "1", "200")]
    for row in rows:
        assert float(row["req_per_s"]) > 0 and float(row["cpu_us_per_req_frontend"]) > 0, row
    assert "on / off: front-end CPU" in r.stdout
