"""bench.gpu_scale's code on the CPU provider (``--device cpu``, tiny settings): the raw part and the shared-memory
part run end to end through a multi-process server and write their tables, so the GPU session spends its minutes
measuring. The numbers are not measurements."""

from __future__ import annotations

from bench.gpu_scale import main
from bench.sweep.report import read_csv


def test_the_shared_memory_part_runs_on_the_cpu_and_writes_its_table(tmp_path):
    out = tmp_path / "scale"
    assert main(["--device", "cpu", "--out", str(out), "--parts", "r,m", "--model", "tiny_cnn", "--frontends", "1",
                 "--clients", "4", "--client-processes", "1", "--duration", "0.5", "--warmup", "0.2",
                 "--raw-seconds", "0.02", "--delay-us", "500", "--buffer-mb", "16"]) == 0
    rows = read_csv(out / "scale_m_shm.csv")
    assert [(r["frontends"], r["transport"]) for r in rows] == [("1", "binary"), ("1", "system shm")]
    assert all(float(r["qps"]) > 0 and r["errors"] == "0" and float(r["over_raw"]) > 0 for r in rows)
    assert (out / "gpu_a_raw.csv").is_file() and (out / "scale_m_shm.md").is_file()


def test_the_profile_part_names_every_process_and_its_threads(tmp_path):
    """Part p on the CPU: the per-thread table names the engine process and the front end by role (from the
    supervisor's log), and the engine's event loop did work; py-spy is not needed (none in CI: no functions table)."""
    out = tmp_path / "scale"
    assert main(["--device", "cpu", "--out", str(out), "--parts", "r,p", "--model", "tiny_cnn", "--frontends", "1",
                 "--clients", "4", "--client-processes", "1", "--duration", "2", "--warmup", "0.2",
                 "--raw-seconds", "0.02", "--delay-us", "500", "--buffer-mb", "16", "--profile-seconds", "0.5",
                 "--py-spy", "/nonexistent/py-spy-is-not-run"]) == 0
    rows = read_csv(out / "scale_p_threads.csv")
    main_threads = {r["role"] for r in rows if r["thread"] == "main"}
    assert {"engine-cpu", "frontend-0"} <= main_threads
    assert float(next(r["cores"] for r in rows if r["role"] == "frontend-0" and r["thread"] == "main")) > 0
