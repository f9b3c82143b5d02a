"""Part (b): the batcher and executors without HTTP. The server's own :class:`batcher.dataplane.DataPlane` is built
in this process from a config; closed-loop asyncio clients call ``DataPlane.infer`` with a decoded request
(``read``) and a no-op ``deliver``, so every request goes through routing, validation, the queue, the batcher,
padding to an allowed size, the executor and the engine, and nothing through HTTP. 1/2/4 contexts, batching on
(max_batch_size 32) and off (max_batch_size 1: every request alone), in-process contexts or worker processes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .common import finish, images, instance_rule, line_plot, raw_at, say


def model_config(model: str, contexts: int, batching: bool, mode: str, kind: str, delay_us: int) -> dict:
    """The model's config as ``batcher serve`` takes it (allowed sizes and precision: the GPU defaults)."""
    return {"name": model, "path": f"zoo:{model}", "instance_group": [{"count": contexts, "kind": kind}],
            "max_batch_size": 32 if batching else 1, "mode": mode,
            "dynamic_batching": {"max_queue_delay_microseconds": delay_us if batching else 0,
                                 "default_queue_policy": {"max_queue_size": 8192}}}


def request_io(x: np.ndarray) -> tuple[Callable, Callable]:
    """``(read, deliver)`` for ``DataPlane.infer``: a decoded one-input request of ``x``, and a no-op delivery."""
    from batcher.protocol import InferRequest

    async def read() -> InferRequest:
        return InferRequest(inputs={"input": x})

    async def deliver(response) -> None:
        return None

    return read, deliver


def steps(models: list[str], modes: list[str], contexts: list[int]):
    """Every (model, mode, contexts, batching) of (b) and (c), batching on before off."""
    return ((m, mode, n, b) for m in models for mode in modes for n in contexts for b in (True, False))


def _counters(metrics, model: str) -> tuple[float, float]:
    labels = {"model": model, "version": "1"}
    get = metrics.registry.get_sample_value
    return (get("batcher_inference_count_total", labels) or 0.0, get("batcher_execution_count_total", labels) or 0.0)


async def closed_loop(dp, model: str, x: np.ndarray, clients: int, warmup_s: float, duration_s: float) -> dict:
    """``clients`` coroutines calling ``dp.infer`` back to back; QPS, p50/p99 and the formed batch size over the
    measured window (requests that started in it)."""
    from batcher.errors import BatcherError

    loop = asyncio.get_running_loop()
    start = loop.time() + warmup_s
    end = start + duration_s
    latencies: list[float] = []
    failed = 0
    read, deliver = request_io(x)

    async def client() -> None:
        nonlocal failed
        while (t := loop.time()) < end:
            try:
                await dp.infer(model, None, t, read, deliver)
            except BatcherError:
                failed += 1
                continue
            if t >= start:
                latencies.append(loop.time() - t)

    async def snapshot() -> tuple[tuple[float, float], tuple[float, float]]:
        await asyncio.sleep(max(0.0, start - loop.time()))
        first = _counters(dp.metrics, model)
        await asyncio.sleep(max(0.0, end - loop.time()))
        return first, _counters(dp.metrics, model)

    snap = asyncio.create_task(snapshot())
    await asyncio.gather(*(client() for _ in range(clients)))
    (inf0, exe0), (inf1, exe1) = await snap
    lat = np.sort(np.array(latencies)) * 1e3
    pick = (lambda q: float(lat[min(len(lat) - 1, int(np.ceil(q * len(lat))) - 1)])) if len(lat) else (lambda q: 0.0)
    return {"qps": round(len(lat) / duration_s, 1), "p50_ms": round(pick(0.50), 2), "p99_ms": round(pick(0.99), 2),
            "avg_batch": round((inf1 - inf0) / (exe1 - exe0), 2) if exe1 > exe0 else 0.0, "failed": failed}


async def one_step(model: str, contexts: int, batching: bool, mode: str, kind: str, args) -> dict:
    from batcher.config import parse_config
    from batcher.dataplane import DataPlane
    from batcher.metrics import Metrics

    cfg = parse_config({"models": [model_config(model, contexts, batching, mode, kind, args.delay_us)]})
    dp = DataPlane(cfg, Metrics())
    await dp.start()
    try:
        slot = dp.repository.slot(model)
        facts = slot.loaded.contexts[0].describe() if slot.loaded and slot.loaded.contexts else {}
        res = await closed_loop(dp, model, images(1, seed=2), args.clients, args.warmup, args.duration)
    finally:
        await dp.close()
    return {"model": model, "mode": mode, "contexts": contexts, "batching": "on" if batching else "off",
            "execution": facts.get("execution"), **res}


def with_ratios(rows: list[dict], raw: list[dict], precision: str) -> list[dict]:
    """Each row's ratio to the raw engine (part a) at the batch size it formed, and seed 002's rule per model and
    mode over the batching-on rows."""
    for r in rows:
        ref = raw_at(raw, r["model"], precision, r["avg_batch"])
        r["raw_rows_per_s_at_batch"] = round(ref, 1) if ref else None
        r["over_raw"] = round(r["qps"] / ref, 3) if ref else None
    for key in {(r["model"], r["mode"]) for r in rows}:
        on = [r for r in rows if (r["model"], r["mode"]) == key and r["batching"] == "on"]
        verdict = instance_rule(on)
        for r in on:
            r["rule_002"] = verdict.get(r["contexts"], "") + (f"; {verdict[0]}" if r is on[-1] else "")
    return rows


def qps_plot(rows: list[dict], title: str) -> Callable[[Path], None]:
    """The PNG of (b) or (c): requests/s against contexts, a line per model, mode and batching on/off."""
    keys = sorted({(r["model"], r["mode"], r["batching"]) for r in rows})

    def plot(png: Path) -> None:
        series = {" ".join(k): ([r["contexts"] for r in rows if (r["model"], r["mode"], r["batching"]) == k],
                                [r["qps"] for r in rows if (r["model"], r["mode"], r["batching"]) == k]) for k in keys}
        line_plot(png, title, "contexts", "requests/s (1 row each)", series)

    return plot


def part_b(models: list[str], modes: list[str], contexts: list[int], kind: str, raw: list[dict], precision: str,
           args, out: Path) -> list[dict]:
    rows: list[dict] = []
    for model, mode, n, batching in steps(models, modes, contexts):
        rows.append(asyncio.run(one_step(model, n, batching, mode, kind, args)))
        say(f"  (b) {rows[-1]}")
    with_ratios(rows, raw, precision)
    finish(out, "gpu_b_runner", "(b) batcher and executors without HTTP (DataPlane.infer, closed loop)", rows,
           qps_plot(rows, "(b) batcher + executors, no HTTP"))
    return rows
