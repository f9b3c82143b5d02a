"""ResNet-18 on a GPU through ONNX Runtime's CUDA provider: raw engine versus the service, batching on and off.

Run on a machine with an NVIDIA GPU, onnxruntime-gpu and cuda-python::

    python -m bench.gpu_bench --out bench/results/gpu       # writes gpu_raw.csv, gpu_service.csv; prints tables

What it measures (each part in one run, so ratios compare like with like):

1. correctness: the CUDA engine's outputs against ONNX Runtime on CPU for the same batch (max abs diff);
2. raw engine throughput: one execution context called in a tight loop at batch 1, 8, 32, 128, host arrays in
   and out (pinned staging, async copies, IOBinding: what the service's executor does per batch);
3. the service at saturation: ``batcher serve`` with ``resnet18`` on CUDA, many closed-loop clients on loopback
   (binary tensors, one row per request), with dynamic batching on (max_batch_size 32) and off (max_batch_size 1,
   every request runs alone: the seeds' design), at 1, 2 and 4 instances; throughput, p50/p99 latency, average
   batch size (from the server's metrics) and the ratio service / raw engine throughput at the batch size formed.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.scripts import script_parser
from bench.server import ServerProcess
from bench.sweep.report import markdown_table, write_csv
from bench.sweep.requests import build_request, infer
from bench.sweep.run import SweepConfig, run_sweep


def _raw(batch_sizes: list[int], seconds: float) -> list[dict]:
    from engines.onnxruntime import OnnxRuntimeEngine
    from engines.zoo import resolve

    engine = OnnxRuntimeEngine(resolve("zoo:resnet18"), device="cuda")
    ctx = engine.create_context()
    rows = []
    rng = np.random.default_rng(0)
    for b in batch_sizes:
        x = rng.standard_normal((b, 3, 224, 224), dtype=np.float32)
        staging = ctx.host_buffer("input", x.shape, x.dtype)

        def once():  # what the executor does per batch: stack into the pinned buffer, execute
            np.copyto(staging, x)
            ctx.execute({"input": staging})

        for _ in range(5):
            once()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            once()
            n += 1
        dt = time.perf_counter() - t0
        rows.append({"batch": b, "ms_per_batch": round(dt / n * 1e3, 3), "rows_per_s": round(n * b / dt, 1)})
    ctx.release()
    engine.release()
    return rows


def _raw_parallel(batch: int, contexts: int, seconds: float, gil_hog: bool = False) -> dict:
    """``contexts`` contexts of one engine, each driven by its own thread in a tight loop (no HTTP);
    ``gil_hog`` adds a thread running pure Python all the time, as a saturated event loop does."""
    import threading

    from engines.onnxruntime import OnnxRuntimeEngine
    from engines.zoo import resolve

    engine = OnnxRuntimeEngine(resolve("zoo:resnet18"), device="cuda")
    ctxs = [engine.create_context() for _ in range(contexts)]
    x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224), dtype=np.float32)
    counts = [0] * contexts
    start = threading.Barrier(contexts + 1)
    stop = threading.Event()

    def drive(i):
        staging = ctxs[i].host_buffer("input", x.shape, x.dtype)
        for _ in range(5):
            np.copyto(staging, x)
            ctxs[i].execute({"input": staging})
        start.wait()
        while not stop.is_set():
            np.copyto(staging, x)
            ctxs[i].execute({"input": staging})
            counts[i] += 1

    def hog():
        n = 0
        start.wait()
        while not stop.is_set():
            n += 1

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(contexts)]
    if gil_hog:
        threads.append(threading.Thread(target=hog))
        start = threading.Barrier(contexts + 2)
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for c in ctxs:
        c.release()
    engine.release()
    return {"batch": batch, "contexts": contexts, "busy_python_thread": gil_hog,
            "rows_per_s": round(sum(counts) * batch / dt, 1)}


def _check(batch: int = 8) -> float:
    from engines.onnxruntime import OnnxRuntimeEngine
    from engines.zoo import resolve

    x = {"input": np.random.default_rng(1).standard_normal((batch, 3, 224, 224), dtype=np.float32)}
    outs = []
    for device in ("cuda", "cpu"):
        engine = OnnxRuntimeEngine(resolve("zoo:resnet18"), device=device, intra_op_threads=0)
        ctx = engine.create_context()
        outs.append(ctx.execute(x)["logits"])
        ctx.release()
        engine.release()
    return float(np.max(np.abs(outs[0] - outs[1])))


def _interp(raw: list[dict], batch: float) -> float:
    xs = [r["batch"] for r in raw]
    return float(np.interp(batch, xs, [r["rows_per_s"] for r in raw]))


def _service(instances: int, batching: bool, args, workdir: Path, check_x: np.ndarray, check_want: np.ndarray):
    cfg = {"models": [{
        "name": "resnet18", "path": "zoo:resnet18", "instance_group": [{"count": instances, "kind": "KIND_GPU"}],
        "max_batch_size": 32 if batching else 1, "mode": args.mode,
        "dynamic_batching": {"max_queue_delay_microseconds": args.delay_us if batching else 0,
                             "default_queue_policy": {"max_queue_size": 1024}},
    }]}
    with ServerProcess(cfg, workdir, name=f"i{instances}-{'on' if batching else 'off'}") as server:
        # correctness through the HTTP path as well
        got = infer(f"{server.base}/v2/models/resnet18/infer", [("input", "FP32", check_x)])["logits"]
        http_diff = float(np.max(np.abs(got - check_want)))
        labels = {"model": "resnet18", "version": "1"}
        inf0 = server.metric("batcher_inference_count_total", **labels)
        exe0 = server.metric("batcher_execution_count_total", **labels)
        x = np.random.default_rng(2).standard_normal((1, 3, 224, 224), dtype=np.float32)
        load = SweepConfig(url=server.base, model="resnet18", mode="closed", concurrency=[args.clients],
                           duration=args.duration, warmup=args.warmup, processes=args.client_processes,
                           client_timeout_s=60, progress=False)
        res = run_sweep(load, *build_request([("input", "FP32", x)]))[0]
        m = server.metrics()
        lk = tuple(sorted(labels.items()))
        inf = m[("batcher_inference_count_total", lk)] - inf0
        exe = m[("batcher_execution_count_total", lk)] - exe0
        compute_ms = m[("batcher_compute_duration_seconds_sum", lk)] / max(m[("batcher_execution_count_total", lk)], 1)
        phases = [m[(f"batcher_compute_{ph}_seconds_total", lk)] / max(m[("batcher_execution_count_total", lk)], 1)
                  for ph in ("input", "infer", "output")]
        queue_ms = m[("batcher_queue_duration_seconds_sum", lk)] / max(m[("batcher_queue_duration_seconds_count", lk)], 1)
    return {
        "instances": instances, "batching": "on" if batching else "off", "clients": args.clients,
        "qps": round(res["achieved_qps"], 1), "p50_ms": round(res["p50_ms"], 2), "p99_ms": round(res["p99_ms"], 2),
        "avg_batch": round(inf / exe, 2) if exe else 0.0, "compute_ms_per_batch": round(compute_ms * 1e3, 2),
        "input_ms": round(phases[0] * 1e3, 2), "infer_ms": round(phases[1] * 1e3, 2),
        "output_ms": round(phases[2] * 1e3, 2), "queue_ms": round(queue_ms * 1e3, 2), "errors": res["errors"],
        "http_max_abs_diff": http_diff,
    }


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.gpu_bench", __doc__)
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu"), help="folder for the CSV files")
    p.add_argument("--raw-seconds", type=float, default=3.0, help="tight-loop time per raw batch size")
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per service step")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each service step")
    p.add_argument("--clients", type=int, default=64, help="closed-loop clients")
    p.add_argument("--client-processes", type=int, default=4, help="processes the clients are spread over")
    p.add_argument("--delay-us", type=int, default=500, help="max_queue_delay_microseconds with batching on")
    p.add_argument("--instances", default="1,2,4", help="instance counts to sweep")
    p.add_argument("--raw-batches", default="1,8,32,128", help="batch sizes of the raw engine runs")
    p.add_argument("--mode", choices=["inprocess", "multiproc"], default="inprocess",
                   help="where the service runs its execution contexts (multiproc: worker processes, no shared GIL)")
    p.add_argument("--skip-raw", action="store_true", help="only the service part")
    args = p.parse_args(argv)

    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("CUDAExecutionProvider is not available: install onnxruntime-gpu on a machine with a GPU", file=sys.stderr)
        return 3
    args.out.mkdir(parents=True, exist_ok=True)
    if args.skip_raw:
        raw = [{"batch": 1, "rows_per_s": float("nan")}, {"batch": 32, "rows_per_s": float("nan")}]
    else:
        diff = _check()
        print(f"correctness: resnet18 batch 8, CUDA vs CPU max abs diff = {diff:.2e} (limit 1e-3)")
        raw = _raw([int(b) for b in args.raw_batches.split(",")], args.raw_seconds)
        write_csv(args.out / "gpu_raw.csv", raw)
        print("\nraw engine (one context, tight loop, host arrays in/out)\n" + markdown_table(raw))
        par = [_raw_parallel(32, n, args.raw_seconds, hog) for hog in (False, True) for n in (1, 2, 4)]
        write_csv(args.out / "gpu_raw_contexts.csv", par)
        print("\nraw engine, several contexts each in its own thread (batch 32)\n" + markdown_table(par))

    from engines.onnxruntime import OnnxRuntimeEngine
    from engines.zoo import resolve

    check_x = np.random.default_rng(3).standard_normal((1, 3, 224, 224), dtype=np.float32)
    cpu = OnnxRuntimeEngine(resolve("zoo:resnet18"), device="cpu", intra_op_threads=0)
    cctx = cpu.create_context()
    check_want = cctx.execute({"input": check_x})["logits"]
    cctx.release()
    cpu.release()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for inst in [int(i) for i in args.instances.split(",")]:
            for batching in (True, False):
                row = _service(inst, batching, args, Path(tmp), check_x, check_want)
                row["raw_rows_per_s_at_avg_batch"] = round(_interp(raw, max(row["avg_batch"], 1)), 1)
                row["service_over_raw"] = round(row["qps"] / row["raw_rows_per_s_at_avg_batch"], 3)
                rows.append(row)
                print(row, flush=True)
    write_csv(args.out / f"gpu_service{'' if args.mode == 'inprocess' else '_' + args.mode}.csv", rows)
    print("\nservice (closed loop, binary tensors, 1 row per request)\n" + markdown_table(rows))
    for inst in sorted({r["instances"] for r in rows}):
        on = next(r for r in rows if r["instances"] == inst and r["batching"] == "on")
        off = next(r for r in rows if r["instances"] == inst and r["batching"] == "off")
        print(f"instances {inst}: batching on/off throughput = {on['qps'] / off['qps']:.2f}x, "
              f"p99 {on['p99_ms']} vs {off['p99_ms']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
