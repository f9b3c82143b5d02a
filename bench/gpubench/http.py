"""Part (c): the same through HTTP. A real ``batcher serve`` per step; load from the toolkit's closed-loop driver
(:func:`bench.sweep.run.run_sweep`) in client processes, binary tensors, one row per request. Each row says where
the time goes: the server process's CPU per request (the front end: parsing 602 KB bodies, encoding, the event
loop), the executor's stack/execute/split times per batch, the queue time, and the ratio to the raw engine."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .common import finish, images, say
from .runner import model_config, qps_plot, steps, with_ratios


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_step(model: str, contexts: int, batching: bool, mode: str, kind: str, args, workdir: Path) -> dict:
    from bench.server import ServerProcess
    from bench.sweep.requests import build_request
    from bench.sweep.run import SweepConfig, run_sweep

    cfg = {"models": [model_config(model, contexts, batching, mode, kind, args.delay_us)]}
    name = f"{model}-{mode}-{contexts}-{'on' if batching else 'off'}"
    with ServerProcess(cfg, workdir, name=name) as server:
        lk = (("model", model), ("version", "1"))
        before = server.metrics()
        cpu0 = cpu_seconds(server.proc.pid)
        load = SweepConfig(url=server.base, model=model, mode="closed", concurrency=[args.clients],
                           duration=args.duration, warmup=args.warmup, processes=args.client_processes,
                           client_timeout_s=60, progress=False, metrics_url=server.base + "/metrics")
        res = run_sweep(load, *build_request([("input", "FP32", images(1, seed=2))]))[0]
        cpu = cpu_seconds(server.proc.pid) - cpu0
        m = server.metrics()

    def delta(sample: str) -> float:
        return m.get((sample, lk), 0.0) - before.get((sample, lk), 0.0)

    batches = max(delta("batcher_execution_count_total"), 1.0)
    answered = max(delta("batcher_request_success_total"), 1.0)
    return {
        "model": model, "mode": mode, "contexts": contexts, "batching": "on" if batching else "off",
        "qps": round(float(res["achieved_qps"]), 1), "p50_ms": round(float(res["p50_ms"]), 2),
        "p99_ms": round(float(res["p99_ms"]), 2), "avg_batch": round(float(res.get("avg_batch_size") or 0.0), 2),
        "errors": res["errors"], "server_cpu_ms_per_request": round(cpu / answered * 1e3, 3),
        "stack_ms_per_batch": round(delta("batcher_compute_input_seconds_total") / batches * 1e3, 3),
        "execute_ms_per_batch": round(delta("batcher_compute_infer_seconds_total") / batches * 1e3, 3),
        "split_ms_per_batch": round(delta("batcher_compute_output_seconds_total") / batches * 1e3, 3),
        "queue_ms_per_request": round(delta("batcher_queue_duration_seconds_sum")
                                      / max(delta("batcher_queue_duration_seconds_count"), 1.0) * 1e3, 3),
    }


def part_c(models: list[str], modes: list[str], contexts: list[int], kind: str, raw: list[dict], precision: str,
           args, out: Path) -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, mode, n, batching in steps(models, modes, contexts):
            rows.append(one_step(model, n, batching, mode, kind, args, Path(tmp)))
            say(f"  (c) {rows[-1]}")
    with_ratios(rows, raw, precision)
    finish(out, "gpu_c_http", "(c) through HTTP (batcher serve, closed loop, binary tensors, 1 row per request)",
           rows, qps_plot(rows, "(c) through HTTP, binary tensors"))
    return rows
