"""Part (a): the raw engine. One context per model and precision (a CUDA graph per allowed size), rows/s at every
allowed size and over the mixed-size workload; each batch is copied once from numpy into the context's pinned
staging buffer first, as the service must do. A context that takes two batches on its device at once
(``pipeline_depth`` 2, a CUDA-graph context) is measured both ways: each batch executed and waited for
(``sequential_rows_per_s``), and each launched behind the one before, which is collected after it
(``rows_per_s``: what the service's executor does, :class:`batcher.device_pipeline.DevicePipeline`); every "over raw"
ratio of the other parts divides by ``rows_per_s``, the engine's best. At batch 32, each precision's max abs and relative error against
ONNX Runtime fp32 on CPU, the TF32/fp32 and fp16/TF32 throughput ratios, and the rows/s of a context made with
``device_timing`` off (``<precision>_untimed_rows_per_s``: what the CUDA timing events around each batch cost)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .common import SIZES, errors, finish, images, line_plot, mixed_sizes, on_thread, say, timed_loop


def cpu_reference(path: Path, x: np.ndarray) -> np.ndarray:
    """fp32 outputs of ONNX Runtime on CPU (every core) for ``x``."""
    from engines.onnxruntime import OnnxRuntimeEngine

    engine = OnnxRuntimeEngine(path, device="cpu", intra_op_threads=0)
    ctx = engine.create_context()
    try:
        return ctx.execute({"input": x})["logits"].astype(np.float64)
    finally:
        ctx.release()
        engine.release()


def measure_context(ctx, x: np.ndarray, seconds: float, sizes=SIZES, name: str = "input", mixed: bool = True
                    ) -> list[dict]:
    """rows/s of ``ctx`` at each size and (``mixed``) over mixed sizes; the loop runs on the context's own thread. With
    ``pipeline_depth`` >= 2 also launched one batch ahead: then ``rows_per_s`` is that, ``sequential_rows_per_s``
    the batch-by-batch figure (module docstring)."""
    top = max(sizes)
    ahead = getattr(ctx, "pipeline_depth", 1) >= 2
    slots = 2 if ahead else 1
    staging = [ctx.host_buffer(name, (top, *x.shape[1:]), x.dtype, **({"slot": s} if s else {}))
               for s in range(slots)]
    rows = []

    def stage(n: int, k: int) -> np.ndarray:
        buf = staging[k % slots]
        view = buf[:n] if buf is not None else np.empty((n, *x.shape[1:]), x.dtype)
        np.copyto(view, x[:n])  # the one copy into pinned memory that the service makes too
        return view

    def run(n: int, k: int) -> int:
        ctx.execute({name: stage(n, 0)})
        return n

    pending: list = []
    busy: list[float] = []  # the device seconds of each batch collected one batch ahead (its timing events)

    def run_ahead(n: int, k: int) -> int:
        """Batch k launched, then batch k - 1 collected (its staging slot is reused by batch k + 1)."""
        pending.append(ctx.launch({name: stage(n, k)}))
        if len(pending) > 1:
            ctx.collect(pending.pop(0))
            timed = ctx.device_times()
            if timed is not None:
                busy.append(timed.busy_s)
        return n

    def measure(size_of) -> tuple[float, float, float | None]:
        rps, ms, _ = on_thread(ctx, lambda: timed_loop(lambda k: run(size_of(k), k), seconds))
        if not ahead:
            return rps, ms, None
        try:
            fast, fast_ms, _ = on_thread(ctx, lambda: timed_loop(lambda k: run_ahead(size_of(k), k), seconds))
        finally:
            while pending:
                on_thread(ctx, lambda: ctx.collect(pending.pop(0)))
        return fast, fast_ms, rps

    plan = mixed_sizes(4096)
    for b, size_of in [*((b, lambda k, b=b: b) for b in sizes), *[("mixed", lambda k: plan[k % len(plan)])] * mixed]:
        busy.clear()
        rps, ms, sequential = measure(size_of)
        row = {"batch": b, "ms_per_batch": round(ms, 3), "rows_per_s": round(rps, 1)}
        if sequential is not None:
            row["sequential_rows_per_s"] = round(sequential, 1)
        if busy:  # the device's own time per batch, copies and kernels (bench.gpu_scale part m's device columns)
            row["device_ms_per_batch"] = round(sum(busy) / len(busy) * 1e3, 3)
        rows.append(row)
    return rows


def engine_of(path: Path, device: str, precision: str):
    from engines.onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(path, device=device, batch_sizes=SIZES, precision=precision)


def untimed_rows_per_s(engine, x: np.ndarray, seconds: float) -> float | None:
    """rows/s at the largest size of a context of ``engine`` made with ``device_timing`` off (None where the
    context has no timing: CPU); releases the engine."""
    from engines.base import ExecutionContext

    if engine.device == "cpu":
        engine.release()
        return None
    before = ExecutionContext.device_timing
    ExecutionContext.device_timing = False
    try:
        ctx = engine.create_context()
    finally:
        ExecutionContext.device_timing = before
    try:
        return next(r["rows_per_s"] for r in measure_context(ctx, x, seconds, (max(SIZES),), mixed=False))
    finally:
        ctx.release()
        engine.release()


def part_a(models: list[str], precisions: list[str], device: str, seconds: float, out: Path) -> list[dict]:
    from engines.zoo import resolve

    rows: list[dict] = []
    summary: list[dict] = []
    x = images(max(SIZES))
    for model in models:
        path = resolve(f"zoo:{model}")
        want = cpu_reference(path, x)
        per: dict[str, dict] = {}
        for precision in precisions:
            t0 = time.perf_counter()
            engine = engine_of(path, device, precision)
            ctx = engine.create_context()
            load_s = time.perf_counter() - t0
            try:
                facts = ctx.describe()
                err = errors(on_thread(ctx, lambda: ctx.execute({"input": x})["logits"]), want)
                measured = measure_context(ctx, x, seconds)
            finally:
                ctx.release()
                engine.release()
            for r in measured:
                rows.append({"model": model, "precision": precision, "execution": facts.get("execution"), **r})
            at32 = next(r["rows_per_s"] for r in measured if r["batch"] == max(SIZES))
            per[precision] = {"rows_per_s": at32, "max_abs_err": err[0], "rel_err": err[1],
                              "untimed_rows_per_s": untimed_rows_per_s(engine_of(path, device, precision), x, seconds)}
            say(f"  (a) {model} {precision}: {facts.get('execution')}, load {load_s:.1f} s, batch 32 {at32:,.0f} rows/s, "
                f"mixed {measured[-1]['rows_per_s']:,.0f} rows/s, error vs CPU fp32 {err[0]:.3g} abs / {err[1]:.3g} rel")
        entry: dict = {"model": model}
        for p, v in per.items():
            entry.update({f"{p}_rows_per_s": v["rows_per_s"], f"{p}_max_abs_err": round(v["max_abs_err"], 6),
                          f"{p}_rel_err": round(v["rel_err"], 6), f"{p}_untimed_rows_per_s": v["untimed_rows_per_s"]})
        if "tf32" in per and "fp32" in per:
            entry["tf32_over_fp32"] = round(per["tf32"]["rows_per_s"] / per["fp32"]["rows_per_s"], 2)
        if "fp16" in per and "tf32" in per:
            entry["fp16_over_tf32"] = round(per["fp16"]["rows_per_s"] / per["tf32"]["rows_per_s"], 2)
        summary.append(entry)

    def plot(png: Path) -> None:
        series = {f"{m} {p}": ([r["batch"] for r in rows if r["model"] == m and r["precision"] == p
                                and r["batch"] != "mixed"],
                               [r["rows_per_s"] for r in rows if r["model"] == m and r["precision"] == p
                                and r["batch"] != "mixed"])
                  for m in models for p in precisions}
        line_plot(png, "(a) raw engine, one context, CUDA graph per size", "batch size", "rows/s", series, logx=True)

    finish(out, "gpu_a_raw", "(a) raw engine: rows/s per batch size and mixed (1 context, numpy -> pinned once; "
                             "rows_per_s: one batch launched ahead where the context takes two)",
           rows, plot)
    finish(out, "gpu_a_precision", "(a) precision at batch 32: throughput ratios and errors against fp32 on CPU",
           summary)
    return rows


def part_pair(model: str, precision: str, device: str, seconds: float, out: Path, sizes=(4, 8, 32),
              models: list[str] | None = None) -> list[dict]:
    """Retention of the GPU itself: two contexts in this process (two engines, as two models served together:
    ``models``, default two of ``model``), each running batches back to back on its own thread, alone and then
    both at once; rows/s of each and what each keeps. No HTTP, no queue: the bound a server can reach when two
    models share one device."""
    from concurrent.futures import ThreadPoolExecutor

    from engines.onnxruntime import OnnxRuntimeEngine
    from engines.zoo import resolve

    models = models or [model, model]
    x = images(max(SIZES))
    engines = [OnnxRuntimeEngine(resolve(f"zoo:{m}"), device=device, batch_sizes=SIZES, precision=precision)
               for m in models]
    contexts = [e.create_context() for e in engines]
    rows: list[dict] = []
    try:
        def loop(ctx, b: int) -> float:
            staging = ctx.host_buffer("input", (max(SIZES), *x.shape[1:]), x.dtype)

            def run(k: int) -> int:
                view = staging[:b] if staging is not None else np.empty((b, *x.shape[1:]), x.dtype)
                np.copyto(view, x[:b])
                ctx.execute({"input": view})
                return b

            return on_thread(ctx, lambda: timed_loop(run, seconds))[0]

        for b in sizes:
            alone = [loop(ctx, b) for ctx in contexts]
            with ThreadPoolExecutor(2) as pool:
                together = list(pool.map(lambda c: loop(c, b), contexts))
            for i in range(2):
                rows.append({"context": "ab"[i], "model": models[i], "batch": b,
                             "alone_rows_per_s": round(alone[i], 1),
                             "together_rows_per_s": round(together[i], 1), "kept": round(together[i] / alone[i], 3)})
            rows.append({"context": "sum", "model": "", "batch": b, "alone_rows_per_s": round(sum(alone), 1),
                         "together_rows_per_s": round(sum(together), 1),
                         "kept": round(sum(together) / sum(alone), 3)})
            say(f"  (t) raw pair, batch {b}: alone {[round(a) for a in alone]}, together {[round(t) for t in together]}"
                f" rows/s: kept {rows[-1]['kept']}")
    finally:
        for ctx in contexts:
            ctx.release()
        for e in engines:
            e.release()
    finish(out, "scale_t_raw_pair", f"(t) the device alone: {' and '.join(models)} contexts, each on its own "
           "thread, batches back to back, alone then together", rows)
    return rows
