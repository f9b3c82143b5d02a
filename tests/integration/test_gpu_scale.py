"""bench.gpu_scale's code on the CPU provider (``--device cpu``, tiny settings): the raw part and the shared-memory
part run end to end through a multi-process server and write their tables, so the GPU session spends its minutes
measuring. The numbers are not measurements."""

from __future__ import annotations

import pytest

from bench.gpu_scale import main
from bench.sweep.report import read_csv


def dry_run(out, parts: str, *extra: str, duration: str = "0.5", raw_seconds: str = "0.02") -> int:
    """``bench.gpu_scale`` on the CPU with tiny settings: tiny_cnn, one front end, 4 clients in one process."""
    return main(["--device", "cpu", "--out", str(out), "--parts", parts, "--model", "tiny_cnn", "--frontends", "1",
                 "--clients", "4", "--client-processes", "1", "--duration", duration, "--warmup", "0.2",
                 "--raw-seconds", raw_seconds, "--delay-us", "500", "--buffer-mb", "16", *extra])


def test_the_shared_memory_part_runs_on_the_cpu_and_writes_its_table(tmp_path):
    out = tmp_path / "scale"
    assert dry_run(out, "r,m") == 0
    rows = read_csv(out / "scale_m_shm.csv")
    assert [(r["frontends"], r["transport"]) for r in rows] == [("1", "binary"), ("1", "system shm")]
    assert all(float(r["qps"]) > 0 and r["errors"] == "0" and float(r["over_raw"]) > 0 for r in rows)
    assert (out / "gpu_a_raw.csv").is_file() and (out / "scale_m_shm.md").is_file()


def test_the_profile_part_names_every_process_and_its_threads(tmp_path):
    """Part p on the CPU: the per-thread table names the engine process and the front end by role (from the
    supervisor's log), and the engine's event loop did work; py-spy is not needed (none in CI: no functions table)."""
    out = tmp_path / "scale"
    assert dry_run(out, "r,p", "--profile-seconds", "0.5", "--py-spy", "/nonexistent/py-spy-is-not-run",
                   duration="2") == 0
    rows = read_csv(out / "scale_p_threads.csv")
    main_threads = {r["role"] for r in rows if r["thread"] == "main"}
    assert {"engine-cpu", "frontend-0"} <= main_threads
    assert float(next(r["cores"] for r in rows if r["role"] == "frontend-0" and r["thread"] == "main")) > 0


def test_the_switch_interval_part_sweeps_and_hands_the_best_value_to_later_parts(tmp_path, capsys):
    """Part s on the CPU: one step per --switch-sweep-us value, each with the engine's own account of its batches
    from /metrics; with --gil-switch-us best the later parts use the fastest value. Part d needs a GPU: skipped."""
    out = tmp_path / "scale"
    assert dry_run(out, "r,d,s,m", "--switch-sweep-us", "5000,200", "--gil-switch-us", "best") == 0
    rows = read_csv(out / "scale_s_switch.csv")
    assert [r["gil_switch_interval_us"] for r in rows] == ["5000", "200"]
    assert all(r["errors"] == "0" and float(r["execute_ms_per_batch"]) > 0 for r in rows)
    best = max(rows, key=lambda r: float(r["qps"]))["gil_switch_interval_us"]
    printed = capsys.readouterr().out
    assert f"the later parts use gil_switch_interval_us {best}" in printed and "(d) skipped" in printed
    assert not (out / "scale_d_dma.csv").exists() and (out / "scale_m_shm.csv").is_file()


def test_the_retention_part_measures_the_device_pair_and_each_layout(tmp_path):
    """Part t on the CPU: the device alone (two contexts, no HTTP) at each size, then per layout and client count
    each model alone and together with its kept share and the seed's ratio; ``per_model`` runs an engine process
    per model; ``--retention-models`` serves two different zoo models under their own names."""
    out = tmp_path / "scale"
    assert dry_run(out, "r,t", "--retention-clients", "1,2", "--retention-layouts", "per_model",
                   "--retention-models", "tiny_cnn,resnet18", "--retention-instances", "2", "--retention-rounds", "3",
                   duration="0.3",
                   raw_seconds="0.01") == 0
    pair = read_csv(out / "scale_t_raw_pair.csv")
    assert [(r["context"], r["model"], r["batch"]) for r in pair] == [
        (c, m, b) for b in ("4", "8", "32") for c, m in (("a", "tiny_cnn"), ("b", "resnet18"), ("sum", ""))]
    rows = read_csv(out / "scale_t_retention.csv")
    assert [(r["layout"], r["clients"], r["model"]) for r in rows] == [
        ("per_model", c, m) for c in ("1", "2") for m in ("tiny_cnn", "resnet18", "sum (seed's ratio)")]
    assert {r["instances"] for r in rows} == {"2"} and {r["rounds"] for r in rows} == {"3"}
    for r in rows:
        assert float(r["alone_qps"]) > 0 and float(r["together_qps"]) > 0
        # the row is the median round: its kept (computed before the rates are rounded to 0.1 for the table) lies
        # between the lowest and the highest round's
        assert float(r["kept"]) == pytest.approx(float(r["together_qps"]) / float(r["alone_qps"]), rel=0.02, abs=0.002)
        assert float(r["kept_min"]) <= float(r["kept"]) <= float(r["kept_max"])


def _profile_with_stand_in_spy(tmp_path, script: str):
    """Part p's dry run with ``script`` (sh, after the shebang) standing in for py-spy; its out folder."""
    spy = tmp_path / "py-spy"
    spy.write_text("#!/bin/sh\n" + script)
    spy.chmod(0o755)
    out = tmp_path / "scale"
    assert dry_run(out, "r,p", "--profile-seconds", "0.5", "--py-spy", str(spy), duration="1") == 0
    return out


def test_the_profile_part_reads_a_py_spy_profile_whose_bytes_are_not_all_utf8(tmp_path):
    """py-spy's raw output can hold bytes that are not UTF-8 (on the H200 it did, in a native frame's name): part p
    still writes its functions table instead of stopping on a UnicodeDecodeError. The stand-in for py-spy writes one
    such profile (the real one is not installed in CI, and what it samples is not the point here)."""
    out = _profile_with_stand_in_spy(tmp_path, "while [ $# -gt 0 ]; do [ \"$1\" = --output ] && out=$2; shift; done\n"
                                     "printf 'process 1:\"python\";run (batcher/engine_proc.py:1);caf\\377 (lib.so) 7\\n'"
                                     " > \"$out\"\n")
    (row,) = read_csv(out / "scale_p_functions.csv")
    assert row["function"] == "run (batcher/engine_proc.py)" and row["samples"] == "7", row


def test_the_profile_part_records_its_two_py_spy_profiles_at_once_during_the_load(tmp_path):
    """Part p's two py-spy records (all threads, and ``--gil``) run at the same time, inside the load: run one after
    the other, the second sampled a server whose load had ended (an empty ``--gil`` profile on the H200). The
    stand-in py-spy writes its profile only once it has seen the other record start (waiting at most 30 s), so
    records run one after the other leave the functions table out and this test fails."""
    out = _profile_with_stand_in_spy(
        tmp_path, "gil=0; for a in \"$@\"; do [ \"$a\" = --gil ] && gil=1; done\n"
        "while [ $# -gt 0 ]; do [ \"$1\" = --output ] && out=$2; shift; done\n"
        "dir=$(dirname \"$out\"); touch \"$out.started\"\n"
        "if [ $gil = 1 ]; then other=$dir/scale_p_spy.txt.started; else other=$dir/scale_p_spy_gil.txt.started; fi\n"
        "i=0; while [ ! -e \"$other\" ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done\n"
        "[ -e \"$other\" ] || exit 1\n"
        "printf 'process 1:\"python\";run (batcher/engine_proc.py:1) 7\\n' > \"$out\"\n")
    (row,) = read_csv(out / "scale_p_functions.csv")
    assert row["function"] == "run (batcher/engine_proc.py)" and row["samples"] == "7", row
    gil = read_csv(out / "scale_p_gil.csv")
    assert gil and gil[0]["samples"] == "7", gil


def test_without_a_cuda_provider_it_says_so_instead_of_a_traceback(tmp_path, capsys):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has the CUDA provider: the bench would run")
    assert main(["--out", str(tmp_path / "scale"), "--parts", "r"]) == 3
    assert "CUDAExecutionProvider is not available" in capsys.readouterr().out
