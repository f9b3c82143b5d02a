"""Goodput under overload: does the server keep doing useful work at twice its capacity?

    python -m bench.overload --out bench/results/overload

One ``batcher serve`` (tiny_cnn on CPU, one instance, one intra-op thread, dynamic batching), requests with a
deadline (``parameters.timeout``, default 200 ms), our load tool on 127.0.0.1:

1. capacity: closed loop with 32 clients, the achieved requests/s;
2. open loop (Poisson) at 1x and 2x that capacity: goodput = requests answered 200 within their deadline per
   second, the status counts, and the slowest 200 (no answer may come after its deadline: the server answers 504
   at the deadline, queued or executing, and admission control refuses at once what cannot make it).

Target (issue): goodput at 2x capacity >= 90% of goodput at capacity, and no response after its deadline.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench.scripts import script_parser
from bench.server import ServerProcess
from bench.sweep.cli import sweep_subprocess
from bench.sweep.report import markdown_table, write_csv

MODEL = {"name": "tiny_cnn", "path": "zoo:tiny_cnn", "intra_op_threads": 1, "max_batch_size": 16,
         "dynamic_batching": {"max_queue_delay_microseconds": 2000, "default_queue_policy": {"max_queue_size": 4096}}}


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.overload", __doc__)
    p.add_argument("--out", type=Path, default=Path("bench/results/overload"))
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--timeout-ms", type=float, default=200.0, help="each request's deadline")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    timeout_us = str(int(args.timeout_ms * 1000))
    with tempfile.TemporaryDirectory() as tmp, ServerProcess({"models": [MODEL]}, Path(tmp), name="overload") as server:
        common = ("--duration", str(args.duration), "--warmup", "2", "--timeout-us", timeout_us)
        cap = sweep_subprocess(server.url, "tiny_cnn", Path(tmp) / "capacity", "--mode", "closed", "--concurrency",
                               "32", *common)[0]
        capacity = float(cap["achieved_qps"])
        rates = f"{capacity:.0f},{2 * capacity:.0f}"
        rows = sweep_subprocess(server.url, "tiny_cnn", Path(tmp) / "open", "--rates", rates, "--arrivals", "poisson",
                                "--max-inflight", "100000", *common)
        log = server.log()
    out = []
    for load, r in zip(("1x", "2x"), rows):
        out.append({"load": load, "offered_qps": r["offered_qps"], "goodput_qps": r["achieved_qps"],
                    "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], "max_200_ms": r["max_ms"],
                    "errors_by_status": r["errors_by_status"], "avg_batch": r["avg_batch_size"]})
    ratio = float(out[1]["goodput_qps"]) / float(out[0]["goodput_qps"])
    late = [r for r in out if r["max_200_ms"] and float(r["max_200_ms"]) > args.timeout_ms]
    write_csv(args.out / "overload.csv", out)
    print(f"capacity (closed loop, 32 clients): {capacity:.1f} req/s, p99 {cap['p99_ms']} ms")
    print(markdown_table(out))
    print(f"goodput at 2x / at 1x = {ratio:.3f} (target >= 0.9: {'met' if ratio >= 0.9 else 'NOT met'}); "
          f"200s slower than the {args.timeout_ms:g} ms deadline (client-measured, from the scheduled send): "
          f"{'none' if not late else ', '.join(r['load'] for r in late)}")
    print(f"server log lines with Traceback: {log.count('Traceback')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
