"""The engine process alone: how many requests per second one engine process of multi-process mode serves, and
its CPU per request, when driver processes speak its Unix-socket protocol directly (no HTTP, no codec).

Each driver process holds one connection (as a front end does: :class:`batcher.remote.EngineLink`) and keeps
``--concurrency`` requests outstanding, closed loop: submit, await the answer, acknowledge, submit again. Tensors
of 64 KiB or more go through the connection's shared area, as from a real front end. The engine process is the
real one (:func:`batcher.engine_main.engine_main`), started as the supervisor starts it, its metrics written to
files (prometheus-client's multiprocess mode; the results committed before 2026-12-03 had them in memory, which
costs less).

It prints, and saves as CSV (``--out``):

* ``req_per_s``: answered requests per second over the measured window, all drivers together;
* ``engine_cpu_us_per_req``: the engine process's CPU (user + system, every thread) per answered request;
* ``loop_cpu_us_per_req``: the engine's main thread (the event loop: IPC, the data plane, the batcher) per
  request: the part that bounds an engine process whose contexts are fast (:mod:`bench.gpu_scale` part p);
* ``loop_busy``: the main thread's CPU seconds per second (1.0: the event loop is saturated);
* ``answered_total`` and ``engine_counted``: the answers the drivers received over the whole run, warm-up
  included, and the successes the engine process counted (its statistics): equal when each outcome is counted
  once.

    python -m bench.engine_ipc                                  # trivial model, CPU, 2 drivers x 64
    python -m bench.engine_ipc --transport shm                  # the inputs in system shared memory
    python -m bench.engine_ipc --model resnet18 --kind gpu --drivers 8 --concurrency 64

The request is one row of the model's input (FP32 zeros; the trivial model's ``[1, 4]`` rides inline, resnet18's
``[1, 3, 224, 224]`` 602 KB through shared memory).
"""

from __future__ import annotations

import asyncio
import csv
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.scripts import script_parser


class EngineStartError(RuntimeError):
    """The engine process did not start (its model failed to load, e.g. ``--kind gpu`` without a GPU)."""


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process ``pid`` (``/proc/<pid>/task/*/stat``)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _driver(path: str, config_data: dict, model: str, name: str, shape: tuple, concurrency: int,
            warmup_s: float, duration_s: float, result, transport: str = "area") -> None:
    """One driver process: one connection, ``concurrency`` closed-loop requests; sends (answered, errors) of the
    measured window. ``transport`` shm: every request's input names one system shared-memory segment of this
    driver's (registered with the engine as a client's would be, Triton's extension), as ``bench.gpu_scale``'s
    part m does."""
    from multiprocessing.shared_memory import SharedMemory

    from batcher.config import parse_config
    from batcher.ipc import RESULT
    from batcher.protocol import InferRequest, ShmInput, ShmRef
    from batcher.remote import EngineLink
    from batcher.topology import engine_slots, engines

    config = parse_config(config_data)
    cfg = next(m for m in config.models if m.name == model)
    engine = engines(config)[0]
    x = np.zeros(shape, np.float32)
    segment = None
    if transport == "shm":  # the segment's name is the region's too
        segment = SharedMemory(name=f"engine-ipc-{os.getpid()}", create=True, size=x.nbytes)
        region = segment.name
        x = ShmInput("FP32", shape, ShmRef(region, 0, x.nbytes))

    async def main():
        link = EngineLink(engine, path, engine_slots(config, engine))
        await link.connect()
        if segment is not None:
            await link.call("shm_register", "system", region, key="/" + segment.name, offset=0,
                            byte_size=segment.size)
        loop = asyncio.get_running_loop()
        start = loop.time() + warmup_s
        end = start + duration_s
        counts = [0, 0, 0]  # answered in the window, failed in the window, answered in all
        rid = iter(range(1 << 62))

        async def client():
            while loop.time() < end:
                r = next(rid)
                t0 = loop.time()
                msg = await link.submit(r, cfg, t0, InferRequest(inputs={name: x}), None)
                if msg[0] == RESULT:
                    link.outputs(msg[4])  # copied out of the shared area, as a front end does before encoding
                    link.ack(r)
                    counts[2] += 1
                if t0 >= start and loop.time() < end:
                    counts[0 if msg[0] == RESULT else 1] += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
        if segment is not None:
            await link.call("shm_unregister", "system", region)
        await link.close()
        return counts

    try:
        result.send(asyncio.run(main()))
    finally:
        if segment is not None:
            segment.close()
            segment.unlink()


def _engine_count(path: str, config_data: dict, model: str, expect: int, wait_s: float = 10.0) -> int:
    """The successes the engine process counted (its statistics extension, over a new connection), once they reach
    ``expect`` or after ``wait_s`` (the drivers' last acknowledgements may still be on their way)."""
    from batcher.config import parse_config
    from batcher.remote import EngineLink
    from batcher.topology import engine_slots, engines

    config = parse_config(config_data)
    engine = engines(config)[0]

    async def main() -> int:
        link = EngineLink(engine, path, engine_slots(config, engine))
        await link.connect()
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_s
        while True:
            doc = await link.call("statistics", model, "1")
            n = doc["model_stats"][0]["inference_stats"]["success"]["count"]
            if n >= expect or loop.time() > end:
                await link.close()
                return n
            await asyncio.sleep(0.05)

    return asyncio.run(main())


def run(args) -> dict:
    from batcher.config import parse_config
    from batcher.engine_main import engine_main
    from batcher.heartbeat import Heartbeat
    from batcher.topology import engines

    models_dir = Path(tempfile.mkdtemp(prefix="engine-ipc-"))
    if args.model == "trivial":
        from bench.mlp import write_trivial

        path, shape, inp = str(write_trivial(models_dir / "trivial.onnx")), (1, 4), "x"
    else:
        path, shape, inp = f"zoo:{args.model}", (1, 3, 224, 224), "input"
    group = {"count": args.contexts, "kind": f"KIND_{args.kind.upper()}"}
    model = {"name": args.model, "path": path, "instance_group": [group],
             "max_batch_size": args.max_batch,
             "dynamic_batching": {"max_queue_delay_microseconds": args.delay_us,
                                  "default_queue_policy": {"max_queue_size": 8192}}}
    # every outstanding request's input in the shared area (its first half), none riding inline
    buffer_mb = args.buffer_mb or 2 * -(-args.concurrency * int(np.prod(shape)) * 4 // (1 << 20)) + 16
    data = {"server": {"frontends": 1, "event_loop": args.event_loop, "frontend_buffer_mb": buffer_mb,
                       "shared_memory": {"system": args.transport == "shm"},
                       "cuda_blocking_sync": args.cuda_blocking_sync},
            "models": [model]}
    config = parse_config(data)
    engine = engines(config)[0]
    sock = os.path.join(str(models_dir), "engine.sock")
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=engine_main, args=(config, engine, sock, "warning", Heartbeat(), w))
    # its metrics in files, as the supervisor starts it (prometheus-client's multiprocess mode: every write goes to a
    # shared file, the cost a real engine process pays per count)
    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(models_dir / "metrics")
    (models_dir / "metrics").mkdir()
    try:
        proc.start()
    finally:
        if before is None:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = before
    w.close()
    try:
        kind, what = r.recv() if r.poll(600) else ("error", "it did not report ready within 600 s")
        if kind != "ready":
            raise EngineStartError(f"the engine process failed: {what}")
        pipes, drivers = [], []
        for _ in range(args.drivers):
            pr, pw = ctx.Pipe(duplex=False)
            d = ctx.Process(target=_driver, args=(sock, data, args.model, inp, shape, args.concurrency, args.warmup,
                                                  args.duration, pw, args.transport), daemon=True)
            d.start()
            pipes.append(pr)
            drivers.append(d)
        time.sleep(args.warmup)  # the drivers connect and warm up; then the window they count
        cpu0, t0 = thread_cpu(proc.pid), time.monotonic()
        time.sleep(args.duration)
        cpu1, t1 = thread_cpu(proc.pid), time.monotonic()
        counts = [p.recv() for p in pipes]
        for d in drivers:
            d.join(30)
        counted = _engine_count(sock, data, args.model, sum(c[2] for c in counts))
    finally:
        if proc.is_alive():
            os.kill(proc.pid, 15)
        proc.join(60)
        shutil.rmtree(models_dir, ignore_errors=True)  # the model file and the socket
    answered = sum(c[0] for c in counts)
    errors = sum(c[1] for c in counts)
    main_tid = proc.pid
    total = sum(cpu1.get(t, 0.0) - cpu0.get(t, 0.0) for t in cpu1)
    loop_cpu = cpu1.get(main_tid, 0.0) - cpu0.get(main_tid, 0.0)
    span = t1 - t0
    return {"model": args.model, "kind": args.kind, "transport": args.transport, "event_loop": args.event_loop,
            "cuda_blocking_sync": args.cuda_blocking_sync, "drivers": args.drivers,
            "concurrency": args.concurrency,
            "req_per_s": round(answered / args.duration, 1), "errors": errors,
            "answered_total": sum(c[2] for c in counts), "engine_counted": counted,
            "engine_cpu_us_per_req": round(total / max(answered, 1) * 1e6, 1),
            "loop_cpu_us_per_req": round(loop_cpu / max(answered, 1) * 1e6, 1),
            "loop_busy": round(loop_cpu / span, 3)}


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.engine_ipc", __doc__)
    p.add_argument("--model", default="trivial", help="trivial (bench/mlp.py's y = x + 1) or a zoo model")
    p.add_argument("--kind", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--contexts", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--delay-us", type=int, default=200)
    p.add_argument("--event-loop", choices=["asyncio", "uvloop"], default="asyncio",
                   help="the engine's server.event_loop (the drivers run asyncio)")
    p.add_argument("--transport", choices=["area", "shm"], default="area",
                   help="area: inputs in the connection's shared area (or inline), as from a front end's HTTP body; "
                        "shm: in a system shared-memory segment each driver registered (Triton's extension)")
    p.add_argument("--cuda-blocking-sync", action="store_true",
                   help="server.cuda_blocking_sync: GPU contexts sleep while a batch runs instead of spinning")
    p.add_argument("--drivers", type=int, default=2)
    p.add_argument("--buffer-mb", type=int, default=None,
                   help="server.frontend_buffer_mb (default: room for every outstanding request's input)")
    p.add_argument("--concurrency", type=int, default=64, help="outstanding requests per driver")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="CSV file to write (default: print only)")
    args = p.parse_args(argv)
    rows = []
    for i in range(args.rounds):
        try:
            result = run(args)
        except EngineStartError as exc:  # e.g. --kind gpu without onnxruntime-gpu: one line, not a traceback
            print(f"bench.engine_ipc: {exc}", file=sys.stderr)
            return 2
        row = {"round": i + 1, **result}
        rows.append(row)
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
