"""bench.gpu_bench's code on the CPU provider (``--device cpu``): every part runs end to end on tiny settings and
writes its tables, CSV files and ratios, so the GPU session spends its minutes measuring, not debugging. The
numbers are not measurements (CPU, fractions of a second per step); only their presence and consistency are."""

from __future__ import annotations

from bench.gpu_bench import main
from bench.sweep.report import read_csv


def test_every_part_runs_on_the_cpu_and_writes_its_tables(tmp_path):
    out = tmp_path / "gpu"
    common = ["--device", "cpu", "--out", str(out), "--duration", "0.4", "--warmup", "0.1", "--raw-seconds", "0.02",
              "--clients", "4", "--client-processes", "1", "--reloads", "1"]
    assert main([*common, "--parts", "a,b,c", "--models", "tiny_cnn", "--service-models", "tiny_cnn",
                 "--contexts", "1,2", "--modes", "inprocess", "--http-modes", "inprocess"]) == 0
    raw = read_csv(out / "gpu_a_raw.csv")
    assert [r["batch"] for r in raw] == ["1", "2", "4", "8", "16", "32", "mixed"]
    assert all(float(r["rows_per_s"]) > 0 for r in raw)
    precision = read_csv(out / "gpu_a_precision.csv")
    assert precision[0]["model"] == "tiny_cnn" and float(precision[0]["fp32_max_abs_err"]) < 1e-4
    for part in ("gpu_b_runner", "gpu_c_http"):
        rows = read_csv(out / f"{part}.csv")
        assert [(r["contexts"], r["batching"]) for r in rows] == [("1", "on"), ("1", "off"), ("2", "on"), ("2", "off")]
        assert all(float(r["qps"]) > 0 and float(r["over_raw"]) > 0 for r in rows)
        assert "picks" in rows[2]["rule_002"] and (out / f"{part}.md").is_file()
        assert rows[1]["avg_batch"] == "1.0"  # batching off: every request alone
    http = read_csv(out / "gpu_c_http.csv")
    assert all(float(r["server_cpu_ms_per_request"]) > 0 and r["errors"] == "0" for r in http)

    assert main([*common, "--parts", "d", "--models", "tiny_cnn,mid_cnn"]) == 0
    by_batch = read_csv(out / "gpu_d_memory_batch.csv")
    assert [(r["model"], r["max_batch"]) for r in by_batch] == [
        (m, b) for m in ("tiny_cnn", "mid_cnn") for b in ("1", "8", "16", "32")]
    assert [r["input"] for r in read_csv(out / "gpu_d_memory_input.csv")] == ["64", "112", "224"] * 2
    reload = read_csv(out / "gpu_d_reload.csv")
    assert [r["model"] for r in reload] == ["tiny_cnn", "mid_cnn"]
    # resident-memory figures on CPU are too noisy to force evictions reliably: the lru run's code ran (budget set);
    # on the GPU the device figures make every request a reload
    assert all(float(r["cold_load_ms"]) > 0 and float(r["bare_loop_ms"]) > 0 and float(r["lru_budget_mib"]) > 0
               for r in reload)
