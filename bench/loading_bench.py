"""Reproduce the seed article's loading-strategy table: eager vs lazy vs lru on tiny_cnn, mid_cnn, resnet18.

    python -m bench.loading_bench --out bench/results/loading

For each strategy it starts ``batcher serve`` (CPU, one instance per model) and reports, like the seed:

* startup time: process start until ``/v2/health/ready`` answers 200;
* resident memory of the server at start and after all three models are hot, and the memory counted against the
  budget (``batcher_memory_used_bytes``: the models' footprints as measured at load);
* each model's first-request latency (HTTP, one row, binary tensors; in this order: tiny, mid, resnet) and its
  steady-state p50 over 20 requests afterwards;
* for ``lru``: 6 rounds of one request per model (tiny, mid, resnet) with the latency of each, the eviction
  timeline (events from ``/v2/repository/events``: what was evicted or loaded, how long it took, memory after),
  and the reload latencies;
* per model, a reload (the load event of a model evicted before: ``load_model`` from resolving the file to the
  warm-up run) against what ONNX Runtime alone needs, measured in this process in the same run, right after each
  lru request (so both see the same machine): creating the session with the server's options and running the
  first batch (one row); ``reload / (session + first run)``, medians.

The lru budget (default 200 MB) holds resnet18 beside one of the two others, not all three (the seed: 400 MB for
701 MB); lru is given each model's measured footprint + 10% as ``memory_mb`` (what an operator would configure after
measuring), instead of the conservative pre-load estimate. The seed measured GPU memory of TensorRT engines; here it is resident memory of ONNX Runtime on CPU.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench.scripts import script_parser
from bench.server import ServerProcess
from bench.sweep.drivers import drive_closed, http_sender
from bench.sweep.report import markdown_table, percentile, write_csv
from bench.sweep.requests import build_request
from engines.onnxruntime.options import session_options
from engines.zoo import resolve

MODELS = ("tiny_cnn", "mid_cnn", "resnet18")
MiB = 1 << 20


def _latencies_ms(server: ServerProcess, model: str, body: bytes, headers: dict, n: int = 1) -> np.ndarray:
    """``n`` requests one after the other (one closed-loop client); their latencies in ms.

    Raises:
        RuntimeError: an answer was not a 200.
    """
    async def run():
        async with http_sender(f"{server.base}/v2/models/{model}/infer", body, headers, connections=1,
                               timeout_s=120) as send:
            return await drive_closed(1, send, count=n)

    s = asyncio.run(run())
    if (s.status != 200).any():
        raise RuntimeError(f"{model}: statuses {sorted(set(s.status.tolist()))} (see {server.log_path})")
    return s.latency * 1e3


def _infer_ms(server: ServerProcess, model: str, body: bytes, headers: dict) -> float:
    return float(_latencies_ms(server, model, body, headers)[0])


def _json(server: ServerProcess, path: str, post: bool = False):
    req = urllib.request.Request(server.base + path, data=b"{}" if post else None)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def run_strategy(strategy: str, budget_mb: float | None, workdir: Path, threads: int,
                 memory_mb: dict[str, float] | None = None) -> dict:
    server_cfg = {"load_strategy": strategy, "repository_api": True}
    if budget_mb is not None:
        server_cfg["memory_budget_mb"] = budget_mb
    cfg = {"server": server_cfg,
           "models": [{"name": m, "path": f"zoo:{m}", "intra_op_threads": threads,
                       **({"memory_mb": memory_mb[m]} if memory_mb else {})} for m in MODELS]}
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), np.float32)
    body, headers = build_request([("input", "FP32", x)])
    t0 = time.perf_counter()
    with ServerProcess(cfg, workdir, name=strategy) as server:
        startup_s = time.perf_counter() - t0
        row = {"strategy": strategy, "budget_mb": budget_mb or "", "startup_s": round(startup_s, 2),
               "rss_start_mb": round(server.rss_mb()),
               "counted_start_mb": round(server.metric("batcher_memory_used_bytes") / MiB)}
        for m in MODELS:
            row[f"{m}_first_ms"] = round(_infer_ms(server, m, body, headers), 1)
        if strategy != "lru":
            for m in MODELS:
                row[f"{m}_p50_ms"] = round(percentile(_latencies_ms(server, m, body, headers, 20), 50), 1)
        row["rss_hot_mb"] = round(server.rss_mb())
        row["counted_hot_mb"] = round(server.metric("batcher_memory_used_bytes") / MiB)
        rounds, events, ort_ms = [], [], {}
        if strategy == "lru":
            for r in range(6):
                lat = {"round": r + 1}
                for m in MODELS:
                    lat[m] = round(_infer_ms(server, m, body, headers), 1) if r else row[f"{m}_first_ms"]
                    ort_ms.setdefault(m, []).append(ort_alone_ms(m, threads))  # beside it, same conditions
                rounds.append(lat)
                if r == 0:  # round 1 is the first requests above
                    continue
            row["rss_hot_mb"] = round(server.rss_mb())
            events = _json(server, "/v2/repository/events")["events"]
        index = _json(server, "/v2/repository/index", post=True)
    return {"row": row, "rounds": rounds, "events": events, "index": index, "ort_ms": ort_ms}


def ort_alone_ms(model: str, threads: int) -> tuple[float, float]:
    """ONNX Runtime alone, in this process: ms to create the model's session (the server's options) and to run
    its first batch (one row)."""
    path, x = str(resolve(f"zoo:{model}")), np.zeros((1, 3, 224, 224), np.float32)
    t0 = time.perf_counter()
    session = ort.InferenceSession(path, session_options(threads), providers=["CPUExecutionProvider"])
    t1 = time.perf_counter()
    session.run(None, {session.get_inputs()[0].name: x})
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3


def reload_rows(events: list[dict], ort_ms: dict[str, list[tuple[float, float]]]) -> list[dict]:
    """Per model: the median of its reloads in the lru run (its loads after the first) against the medians of
    ONNX Runtime alone, measured in this process right after each of the run's requests for that model."""
    rows = []
    for m in MODELS:
        reloads = [e["duration_ms"] for e in events if e["event"] == "load" and e["model"] == m][1:]
        if not reloads:
            continue
        session_ms, first_ms = (float(np.median([t[i] for t in ort_ms[m]])) for i in (0, 1))
        reload_ms = float(np.median(reloads))
        rows.append({"model": m, "reloads": len(reloads), "reload_ms": round(reload_ms, 1),
                     "session_ms": round(session_ms, 1), "first_run_ms": round(first_ms, 1),
                     "reload / (session + first run)": round(reload_ms / (session_ms + first_ms), 2)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.loading_bench", __doc__)
    p.add_argument("--out", type=Path, default=Path("bench/results/loading"))
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per model")
    p.add_argument("--budget-mb", type=float, default=200,
                   help="lru memory budget (default 200: resnet18 fits beside one of the others, not both)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        eager = run_strategy("eager", None, Path(tmp), args.threads)
        measured = {e["name"]: e["measured_bytes"] / MiB for e in eager["index"]}
        budget = args.budget_mb
        lazy = run_strategy("lazy", None, Path(tmp), args.threads)
        # as an operator would: tell lru each model's footprint as measured, instead of its pre-load estimate
        lru = run_strategy("lru", budget, Path(tmp), args.threads, {m: round(v * 1.1, 1) for m, v in measured.items()})
    rows = [eager["row"], lazy["row"], lru["row"]]
    print("models' memory measured at load (eager), MB: " + ", ".join(f"{k} {v:.0f}" for k, v in measured.items()))
    print(f"\nstrategies (lru budget {budget:.0f} MB; the three models measured {sum(measured.values()):.0f} MB in eager)"
          "\n" + markdown_table(rows))
    print("\nlru rounds, latency ms (round 1 = first requests)\n" + markdown_table(lru["rounds"]))
    timeline = [{"t_s": e["time_s"], "event": e["event"], "model": e["model"], "ms": e["duration_ms"],
                 "counted_after_mb": round(e["used_bytes_after"] / MiB), "rss_after_mb": round(e["rss_after_bytes"] / MiB)}
                for e in lru["events"]]
    print("\nlru timeline\n" + markdown_table(timeline))
    reloads = [e["duration_ms"] for e in lru["events"] if e["event"] == "load"][len(MODELS):]
    if reloads:
        print(f"\nlru reload (load after an eviction) ms: min {min(reloads)}, max {max(reloads)}, n {len(reloads)}")
    reload = reload_rows(lru["events"], lru["ort_ms"])
    print("\nlru reload against ONNX Runtime alone in this process, beside each request (medians)\n"
          + markdown_table(reload))
    write_csv(args.out / "strategies.csv", rows)
    write_csv(args.out / "reload.csv", reload)
    (args.out / "lru.json").write_text(json.dumps({"budget_mb": budget, "measured_mb": measured,
                                                   "rounds": lru["rounds"], "events": lru["events"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
