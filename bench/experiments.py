"""Experiments that reproduce and beat the seeds on this machine, with our own load tool (`python -m bench sweep`).

    python -m bench.experiments --out bench/results/experiments

All on CPU with the 512-2048-512 MLP of :mod:`bench.mlp` (ONNX Runtime, one intra-op thread per instance), binary
tensors, one row per request, everything on 127.0.0.1. Each part starts its own ``batcher serve``:

1. batching gain: dynamic batching on (max_batch_size 32, max_queue_delay_microseconds 500) versus off (max_batch_size 1:
   every request runs alone, the seeds' design) at the same p99 target: an open-loop sweep over offered rates,
   and the highest achieved QPS whose p99 stays within the target, for each; the ratio on / off.
2. instances: 1, 2 and 4 execution contexts, batching on, 32 closed-loop clients: QPS, p50, p99, batch size.
3. retention (the seed: 51%): two models served by one process; each alone at saturation (16 closed-loop
   clients), then both at once; QPS alone, together, and together / sum-alone; plus the server's live
   ``batcher_retention_ratio`` gauge at the end of the together phase.

Numbers depend on the machine and on anything else running on it: compare rows of one run with each other.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench.mlp import write_mlp
from bench.scripts import script_parser
from bench.server import ServerProcess
from bench.sweep.cli import start_sweep_subprocess, sweep_subprocess
from bench.sweep.report import markdown_table, read_csv, write_csv


def _model(name: str, path: Path, **kw) -> dict:
    return {"name": name, "path": str(path), "intra_op_threads": 1, "max_batch_size": 32,
            "dynamic_batching": {"max_queue_delay_microseconds": 500, "default_queue_policy": {"max_queue_size": 4096}},
            **kw}


def _best_within(rows: list[dict], p99_ms: float) -> dict | None:
    ok = [r for r in rows if float(r["p99_ms"] or "inf") <= p99_ms and int(r["errors"]) == 0]
    return max(ok, key=lambda r: float(r["achieved_qps"])) if ok else None


def _save(path: Path, title: str, rows: list[dict]) -> list[dict]:
    """Write ``rows`` to ``path`` (CSV) and print them under ``title`` as a Markdown table."""
    write_csv(path, rows)
    print(f"{title}\n{markdown_table(rows)}")
    return rows


def batching(tmp: Path, mlp: Path, args) -> list[dict]:
    rows = []
    for mode in ("on", "off"):
        extra = {} if mode == "on" else {"max_batch_size": 1, "dynamic_batching": {}}
        with ServerProcess({"models": [_model("mlp", mlp, **extra)]}, tmp, name=f"batching-{mode}") as server:
            steps = sweep_subprocess(server.url, "mlp", tmp / f"batching-{mode}", "--rates", args.rates,
                                     "--duration", str(args.duration), "--warmup", "1", "--arrivals", "poisson",
                                     "--max-inflight", "4096")
        for s in steps:
            rows.append({"batching": mode, "offered_qps": s["offered_qps"], "achieved_qps": s["achieved_qps"],
                         "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"], "avg_batch": s["avg_batch_size"],
                         "errors": s["errors"]})
    return rows


def instances(tmp: Path, mlp: Path, args) -> list[dict]:
    rows = []
    for n in (1, 2, 4):
        with ServerProcess({"models": [_model("mlp", mlp, instance_group=[{"count": n}])]}, tmp, name=f"instances-{n}") as server:
            s = sweep_subprocess(server.url, "mlp", tmp / f"instances-{n}", "--mode", "closed", "--concurrency",
                                 "32", "--duration", str(args.duration), "--warmup", "1")[0]
        rows.append({"instances": n, "qps": s["achieved_qps"], "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"],
                     "avg_batch": s["avg_batch_size"], "errors": s["errors"]})
    return rows


def retention(tmp: Path, mlp: Path, args) -> dict:
    cfg = {"models": [_model("mlp_a", mlp), _model("mlp_b", mlp)]}
    closed = ("--mode", "closed", "--concurrency", "16", "--duration", str(args.duration), "--warmup", "1")
    with ServerProcess(cfg, tmp, name="retention") as server:
        alone = {m: float(sweep_subprocess(server.url, m, tmp / f"alone-{m}", *closed)[0]["achieved_qps"])
                 for m in ("mlp_a", "mlp_b")}
        procs = {m: start_sweep_subprocess(server.url, m, tmp / f"together-{m}", *closed) for m in ("mlp_a", "mlp_b")}
        for p in procs.values():
            p.wait()
        together = {m: float(read_csv(tmp / f"together-{m}" / "sweep.csv")[0]["achieved_qps"])
                    for m in ("mlp_a", "mlp_b")}
        live = server.metric("batcher_retention_ratio")
    total_alone, total_together = sum(alone.values()), sum(together.values())
    return {"mlp_a_alone_qps": round(alone["mlp_a"], 1), "mlp_b_alone_qps": round(alone["mlp_b"], 1),
            "sum_alone_qps": round(total_alone, 1), "mlp_a_together_qps": round(together["mlp_a"], 1),
            "mlp_b_together_qps": round(together["mlp_b"], 1), "together_qps": round(total_together, 1),
            "retention": round(total_together / total_alone, 3), "live_gauge_at_end": round(live, 3)}


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.experiments", __doc__)
    p.add_argument("--out", type=Path, default=Path("bench/results/experiments"))
    p.add_argument("--duration", type=float, default=6.0, help="measured seconds per step")
    p.add_argument("--rates", default="400,800,1200,1600,2000,2400,2800", help="offered rates of the batching sweep")
    p.add_argument("--p99-ms", type=float, default=50.0, help="p99 target of the batching comparison")
    p.add_argument("--only", choices=["batching", "instances", "retention"], help="run one part")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        mlp = write_mlp(tmp / "mlp.onnx")
        if args.only in (None, "batching"):
            rows = _save(args.out / "batching.csv", "batching on vs off (open loop, Poisson)", batching(tmp, mlp, args))
            on = _best_within([r for r in rows if r["batching"] == "on"], args.p99_ms)
            off = _best_within([r for r in rows if r["batching"] == "off"], args.p99_ms)
            if on and off:
                print(f"\nat p99 <= {args.p99_ms:g} ms: on {on['achieved_qps']} req/s, off {off['achieved_qps']} "
                      f"req/s: gain {float(on['achieved_qps']) / float(off['achieved_qps']):.2f}x")
            else:
                print(f"\nat p99 <= {args.p99_ms:g} ms: on {on and on['achieved_qps']}, off {off and off['achieved_qps']}")
        if args.only in (None, "instances"):
            _save(args.out / "instances.csv", "\ninstances (batching on, 32 closed-loop clients)",
                  instances(tmp, mlp, args))
        if args.only in (None, "retention"):
            _save(args.out / "retention.csv", "\nretention (two models in one process, 16 closed-loop clients each)",
                  [retention(tmp, mlp, args)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
