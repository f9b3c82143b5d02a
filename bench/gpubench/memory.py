"""Part (d): seed 000's context-memory tables on this path, and load times.

* Device memory of one context (session, weights, workspaces, a CUDA graph per allowed size: the figure the lru
  budget counts, ``ExecutionContext.device_nbytes``) against the maximum batch (1, 8, 16, 32 at 224x224; the
  allowed sizes are the powers of two up to it) and against the input size (64, 112, 224 at batch 32), for
  tiny_cnn, mid_cnn and resnet18 (the 64/112 variants: the same graph and weights, :func:`bench.trt_smoke
  .resized_variant`). Also the memory returned when the context is released and the load time (session creation +
  graph capture of every allowed size).
* Reloads through the server's lru strategy (a :class:`batcher.dataplane.DataPlane` in this process, a budget that
  holds one model at a time, requests cycling over the models): every request evicts one model and loads another.
  Each reload's time against the same steps in a bare loop (engine + context + release, nothing else).
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import tempfile
import time
from pathlib import Path

from .common import finish, images, say
from .runner import request_io

MB = 1e6
MAX_BATCHES = (1, 8, 16, 32)
INPUT_SIZES = (64, 112, 224)


def allowed(max_batch: int) -> list[int]:
    """The default allowed sizes for ``max_batch``: the powers of two below it, and it."""
    return sorted({1 << k for k in range(max_batch.bit_length()) if 1 << k < max_batch} | {max_batch})


def used_bytes(device: str) -> int:
    """Device memory in use (CUDA), or this process's resident memory (the CPU dry run)."""
    if device == "cuda":
        from engines.cuda import mem_get_info

        free, total = mem_get_info(0)
        return total - free
    from engines.memory import rss_bytes

    return rss_bytes()


def load_release(path: Path, device: str, max_batch: int) -> dict:
    """Create one context with graphs for ``allowed(max_batch)``, read its figures, release it."""
    from engines.onnxruntime import OnnxRuntimeEngine

    t0 = time.perf_counter()
    engine = OnnxRuntimeEngine(path, device=device, batch_sizes=allowed(max_batch))
    ctx = engine.create_context()
    load_s = time.perf_counter() - t0
    held = used_bytes(device)
    figure = ctx.device_nbytes if device == "cuda" else ctx.nbytes
    facts = ctx.describe()
    ctx.release()
    engine.release()
    gc.collect()
    return {"context_mb": round(figure / MB, 1), "returned_mb": round((held - used_bytes(device)) / MB, 1),
            "load_s": round(load_s, 3), "execution": facts.get("execution")}


def variant(model: str, size: int, folder: Path) -> Path:
    from engines.zoo import resolve

    if size == 224:
        return resolve(f"zoo:{model}")
    import onnx

    from bench.trt_smoke import resized_variant

    path = folder / f"{model}-{size}.onnx"
    onnx.save(resized_variant(onnx.load(str(resolve(f"zoo:{model}"))), size), str(path))
    return path


def _server(models: list[str], device: str, server: dict, memory_mb: dict[str, float] | None = None):
    from batcher.config import parse_config
    from batcher.dataplane import DataPlane
    from batcher.metrics import Metrics

    kind = "KIND_GPU" if device == "cuda" else "KIND_CPU"
    cfg = parse_config({"server": server, "models": [
        {"name": m, "path": f"zoo:{m}", "max_batch_size": 32, "instance_group": [{"count": 1, "kind": kind}],
         **({"memory_mb": memory_mb[m]} if memory_mb else {})} for m in models]})
    return DataPlane(cfg, Metrics())


async def counted_mb(models: list[str], device: str) -> dict[str, float]:
    """What the server counts against the budget for each model, as measured by an eager load."""
    dp = _server(models, device, {})
    await dp.start()
    try:
        return {m: max(1.0, dp.repository.slot(m).budget_bytes / (1 << 20)) for m in models}
    finally:
        await dp.close()


async def lru_reloads(models: list[str], device: str, rounds: int) -> tuple[list[dict], float]:
    """Load events of an lru server cycling over ``models``, each counting what an eager load measured and a
    budget that holds one at a time: ``([{model, duration_ms}], budget MiB)``."""
    from batcher.errors import BatcherError

    counted = await counted_mb(models, device)
    budget = max(counted.values()) + 0.75 * min(counted.values())  # one model fits, no two
    dp = _server(models, device, {"load_strategy": "lru", "memory_budget_mb": budget}, counted)
    await dp.start()
    read, deliver = request_io(images(1, seed=3))

    loop = asyncio.get_running_loop()
    try:
        for _ in range(rounds):
            for m in models:
                try:
                    await dp.infer(m, None, loop.time(), read, deliver)
                except BatcherError as exc:  # e.g. a figure measured at reload above the budget: reported
                    say(f"  (d) lru request for {m}: {exc}")
        events = list(dp.repository.lifecycle.events)
    finally:
        await dp.close()
    return [{"model": e["model"], "duration_ms": e["duration_ms"]} for e in events if e["event"] == "load"], budget


def part_d(models: list[str], device: str, rounds: int, out: Path) -> list[dict]:
    by_batch: list[dict] = []
    by_size: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for mb in MAX_BATCHES:
                row = {"model": model, "max_batch": mb, "input": 224, **load_release(variant(model, 224, Path(tmp)),
                                                                                     device, mb)}
                say(f"  (d) {row}")
                by_batch.append(row)
            for size in INPUT_SIZES:
                row = {"model": model, "max_batch": 32, "input": size,
                       **load_release(variant(model, size, Path(tmp)), device, 32)}
                say(f"  (d) {row}")
                by_size.append(row)
    finish(out, "gpu_d_memory_batch", "(d) device memory of one context (graphs included) against the maximum batch, "
           "224x224", by_batch)
    finish(out, "gpu_d_memory_input", "(d) device memory of one context against the input size, batch 32", by_size)

    # reloads: the same steps in a bare loop, then through the lru strategy
    from engines.zoo import resolve

    bare = {m: statistics.median(load_release(resolve(f"zoo:{m}"), device, 32)["load_s"] for _ in range(rounds))
            for m in models}
    loads, budget = asyncio.run(lru_reloads(models, device, rounds + 1)) if len(models) > 1 else ([], None)
    reload_rows = []
    for m in models:
        times = [e["duration_ms"] for e in loads if e["model"] == m]
        cold = next(r["load_s"] for r in by_batch if r["model"] == m)
        reload_ms = statistics.median(times[1:]) if len(times) > 1 else None
        reload_rows.append({
            "model": m, "cold_load_ms": round(cold * 1e3, 1), "bare_loop_ms": round(bare[m] * 1e3, 1),
            "lru_reload_ms": reload_ms, "lru_reloads": max(len(times) - 1, 0),
            "reload_over_bare": round(reload_ms / (bare[m] * 1e3), 2) if reload_ms else None,
            "returned_on_release_mb": next(r["returned_mb"] for r in by_batch if r["model"] == m and r["max_batch"] == 32),
            "lru_budget_mib": round(budget, 1) if budget else None})
    finish(out, "gpu_d_reload", "(d) load times: cold, bare loop (engine + context + release), lru reload "
           "(allowed sizes 1..32, graphs captured)", reload_rows)
    return by_batch + by_size + reload_rows
