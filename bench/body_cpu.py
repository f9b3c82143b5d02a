"""Server CPU per large binary request, by process, with ``server.keep_heap`` on and off: the same requests, the
two servers in turn on the same machine.

    python -m bench.body_cpu --out bench/results/body_cpu                    # about a minute
    python -m bench.body_cpu --out /tmp/body --requests 400 --rounds 1       # a smoke run

The model is a ReduceMean over an ``[N, 3, 224, 224]`` FP32 input (602,112 bytes in, 4 out; written with
``onnx.helper``), so the engine's work is small beside the transport's, as with resnet18's input on a GPU. Each
server runs in multi-process mode with ``--frontends`` front ends on uvloop; one has ``server.keep_heap: true``
(the default), the other false. Load: h2load, ``--clients`` closed-loop connections, ``--requests`` requests per
round after a tenth as many to warm up, every request the same binary tensor (checked: all answered 200). Per
server and round: requests/s and the CPU time per request of the front-end processes and of the engine process
(utime + stime from ``/proc``, split by process name). The rounds alternate the servers, so the machine's drift
hits both; the table gives each server's median round (by front-end CPU) and the ratio of the two. Writes
``OUT/body_cpu.csv`` (every round) and prints the table. On few cores h2load competes with the servers: compare
rows of one run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.peers import cpu_by_role, tree_cpu_seconds
from bench.scripts import script_parser
from bench.server import ServerProcess
from bench.sweep.h2load import h2load_binary
from bench.sweep.report import text_table, write_csv
from bench.sweep.requests import build_request

COLUMNS = ["keep_heap", "round", "requests", "ok", "req_per_s", "cpu_us_per_req_frontend", "cpu_us_per_req_engine"]


def write_mean_model(path: Path) -> Path:
    """``y = mean(x)`` over each row of ``x`` ``[N, 3, 224, 224]`` FP32, as ``y`` ``[N, 1, 1, 1]``."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 224, 224])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1, 1, 1])
    graph = helper.make_graph([helper.make_node("ReduceMean", ["x"], ["y"], axes=[1, 2, 3], keepdims=1)],
                              "mean", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="bench.body_cpu")
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def server_config(model: Path, keep_heap: bool, frontends: int) -> dict:
    return {"server": {"host": "127.0.0.1", "log_level": "warning", "frontends": frontends, "event_loop": "uvloop",
                       "keep_heap": keep_heap},
            "models": [{"name": "mean", "path": str(model), "max_batch_size": 32, "intra_op_threads": 1,
                        "dynamic_batching": {"max_queue_delay_microseconds": 500}}]}


def h2load(binary: str, url: str, body: Path, headers: dict[str, str], clients: int, n: int) -> tuple[int, float]:
    """``n`` POSTs of ``body`` over ``clients`` connections; (requests answered 2xx, requests/s).

    Raises:
        RuntimeError: h2load printed no summary (its output's end in the message).
    """
    cmd = [binary, "--h1", f"-c{clients}", f"-n{n}", "-d", str(body), *sum((["-H", f"{k}: {v}"]
                                                                          for k, v in headers.items()), []), url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False).stdout
    ok = re.search(r"status codes: (\d+) 2xx", out)
    rate = re.search(r"finished in [\d.]+m?s, ([\d.]+) req/s", out)
    if ok is None or rate is None:
        raise RuntimeError(f"h2load gave no summary: {out[-500:]}")
    return int(ok.group(1)), float(rate.group(1))


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.body_cpu", __doc__)
    p.add_argument("--out", type=Path, required=True, help="folder for body_cpu.csv")
    p.add_argument("--frontends", type=int, default=1, help="server.frontends of both servers (default: 1)")
    p.add_argument("--clients", type=int, default=8, help="h2load connections (default: 8)")
    p.add_argument("--requests", type=int, default=3000, help="requests per server and round (default: 3000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each server once per round (default: 3)")
    args = p.parse_args(argv)
    if args.frontends < 1:
        p.error("--frontends: at least 1 (keep_heap applies to multi-process mode)")
    try:
        binary = h2load_binary()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="body_cpu-"))
    model = write_mean_model(work / "mean.onnx")
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    payload, headers = build_request([("x", "FP32", x)], binary=True)
    body = work / "body"
    body.write_bytes(payload)
    rows: list[dict] = []
    servers = {keep: ServerProcess(server_config(model, keep, args.frontends), work, name=f"keep_heap_{keep}")
               for keep in (True, False)}
    try:
        for r in range(args.rounds):
            for keep, server in servers.items():
                url = f"{server.base}/v2/models/mean/infer"
                h2load(binary, url, body, headers, args.clients, max(args.requests // 10, 50))
                before = tree_cpu_seconds(server.proc.pid)
                ok, rate = h2load(binary, url, body, headers, args.clients, args.requests)
                cpu = cpu_by_role(before, tree_cpu_seconds(server.proc.pid))
                rows.append({"keep_heap": keep, "round": r + 1, "requests": args.requests, "ok": ok,
                             "req_per_s": rate,
                             "cpu_us_per_req_frontend": cpu.get("frontend", 0.0) / args.requests * 1e6,
                             "cpu_us_per_req_engine": cpu.get("engine", 0.0) / args.requests * 1e6})
                print(f"  round {r + 1} keep_heap {str(keep).lower():<5}: {ok}/{args.requests} ok, {rate:8.1f} "
                      f"req/s, front ends {rows[-1]['cpu_us_per_req_frontend']:.0f} us/request, engine "
                      f"{rows[-1]['cpu_us_per_req_engine']:.0f}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    write_csv(args.out / "body_cpu.csv", rows, COLUMNS, digits=1)
    medians = []
    for keep in (True, False):
        mine = sorted((r for r in rows if r["keep_heap"] is keep), key=lambda r: r["cpu_us_per_req_frontend"])
        medians.append(mine[len(mine) // 2])
    on, off = medians
    cols = [("keep_heap", "keep_heap", 0), ("req/s", "req_per_s", 1),
            ("front ends us/req", "cpu_us_per_req_frontend", 1), ("engine us/req", "cpu_us_per_req_engine", 1)]
    print(f"\nmedian round of {args.rounds} ({args.requests} requests of {len(payload)} bytes, {args.clients} "
          f"clients, {args.frontends} front end(s))")
    print(text_table(cols, [{**on, "keep_heap": "true"}, {**off, "keep_heap": "false"}]))
    print(f"on / off: front-end CPU {on['cpu_us_per_req_frontend'] / off['cpu_us_per_req_frontend']:.2f}, "
          f"engine CPU {on['cpu_us_per_req_engine'] / off['cpu_us_per_req_engine']:.2f}, "
          f"req/s {on['req_per_s'] / off['req_per_s']:.2f}")
    print(f"wrote {args.out / 'body_cpu.csv'} (servers' logs in {work})", file=sys.stderr)
    if any(r["ok"] != r["requests"] for r in rows):
        print("error: not every request was answered 2xx", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
