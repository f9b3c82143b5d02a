"""Tensors in system shared memory against binary tensors in the HTTP body: the same requests, the same server.

    python -m bench.shm_bench --out bench/results/shm                    # about a minute
    python -m bench.shm_bench --out /tmp/shm --requests 200 --clients 1  # a smoke run

The model is ``bench/mlp.py``'s trivial ``y = x + 1`` at ``--width`` FP32 elements per row (default 150,528: one
3x224x224 image, 602,112 bytes in and out), so execution costs next to nothing and what differs between the modes
is the transport. One ``batcher serve`` with ``server.shared_memory.system: true``; per mode and per number of
closed-loop clients (``--clients``), ``--requests`` requests of one row (after 10 % as many to warm up):

* ``binary``: input and output as binary tensors in the HTTP body (``Inference-Header-Content-Length``);
* ``shm``: each client has its own POSIX segment (made with tritonclient's ``shared_memory`` utilities), holding
  its input and the place for its output; the HTTP body is a few hundred bytes of JSON either way.

Every answer is checked (``y == x + 1`` exactly, read from the body or the segment). Columns: requests/s, p50 and
p99 latency (ms), and the server's CPU time per request (us; utime + stime from ``/proc/PID/stat``). Writes
``OUT/shm.csv`` and prints the table (the model and the server's log go to a temporary folder, named at the end). The client is aiohttp on the same machine: on few cores it competes with
the server, so compare rows of one run.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson

from bench.mlp import write_trivial
from bench.peers import cpu_seconds
from bench.scripts import script_parser
from bench.server import ServerProcess
from bench.sweep.report import text_table, write_csv
from bench.sweep.requests import build_request, decode_response

class Client:
    """One closed-loop client: its request body and how to check its answer (binary, or in its own segment)."""

    def __init__(self, index: int, mode: str, width: int, base: str, session: aiohttp.ClientSession) -> None:
        self.x = np.random.default_rng(index).random((1, width), dtype=np.float32)
        self.mode, self.base, self.session = mode, base, session
        self.handle = None
        if mode == "binary":
            self.body, self.headers = build_request([("x", "FP32", self.x)])
        else:
            n = self.x.nbytes
            self.region = f"bench-{index}"
            self.body = orjson.dumps({
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, width], "parameters": {
                    "shared_memory_region": self.region, "shared_memory_byte_size": n}}],
                "outputs": [{"name": "y", "parameters": {"shared_memory_region": self.region,
                                                         "shared_memory_byte_size": n, "shared_memory_offset": n}}]})
            self.headers = {"Content-Type": "application/json"}

    async def open(self) -> None:
        """shm mode: create the segment, write the input, register it."""
        if self.mode != "shm":
            return
        import tritonclient.utils.shared_memory as shm

        key = f"/trtb-bench-{id(self)}"
        self.handle = shm.create_shared_memory_region(self.region, key, 2 * self.x.nbytes)
        shm.set_shared_memory_region(self.handle, [self.x])
        body = orjson.dumps({"key": key, "offset": 0, "byte_size": 2 * self.x.nbytes})
        async with self.session.post(f"{self.base}/v2/systemsharedmemory/region/{self.region}/register",
                                     data=body) as r:
            assert r.status == 200, await r.text()

    async def close(self) -> None:
        if self.handle is not None:
            import tritonclient.utils.shared_memory as shm

            async with self.session.post(f"{self.base}/v2/systemsharedmemory/region/{self.region}/unregister") as r:
                assert r.status == 200, await r.text()
            shm.destroy_shared_memory_region(self.handle)

    async def infer(self) -> float:
        t0 = time.perf_counter()
        async with self.session.post(f"{self.base}/v2/models/t/infer", data=self.body, headers=self.headers) as r:
            data = await r.read()
            if r.status != 200:
                raise RuntimeError(f"{r.status}: {data[:300]!r}")
            headers = dict(r.headers)
        took = time.perf_counter() - t0
        self.check(data, headers)
        return took

    def check(self, data: bytes, headers: dict[str, str]) -> None:
        if self.mode == "binary":
            y = decode_response(data, headers)[1]["y"]
        else:
            import tritonclient.utils.shared_memory as shm

            y = shm.get_contents_as_numpy(self.handle, np.float32, list(self.x.shape), offset=self.x.nbytes)
        if not np.array_equal(y, self.x + 1):
            raise RuntimeError(f"{self.mode}: wrong answer")


async def step(server: ServerProcess, mode: str, clients: int, requests: int, width: int) -> dict:
    """``requests`` requests over ``clients`` closed-loop clients; returns the row."""
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn) as session:
        members = [Client(i, mode, width, server.base, session) for i in range(clients)]
        for c in members:
            await c.open()
        latencies: list[float] = []

        async def run(c: Client, n: int, keep: bool) -> None:
            for _ in range(n):
                took = await c.infer()
                if keep:
                    latencies.append(took)

        await asyncio.gather(*(run(c, max(1, requests // 10 // clients), False) for c in members))
        cpu0, t0 = cpu_seconds(server.proc.pid), time.perf_counter()
        await asyncio.gather(*(run(c, requests // clients, True) for c in members))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(server.proc.pid) - cpu0
        for c in members:
            await c.close()
    n = len(latencies)
    ms = np.array(latencies) * 1e3
    return {"mode": mode, "clients": clients, "requests": n, "req_per_s": n / wall,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "server_cpu_us_per_request": cpu / n * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.shm_bench", __doc__)
    p.add_argument("--out", type=Path, required=True, help="directory for shm.csv")
    p.add_argument("--width", type=int, default=3 * 224 * 224, help="FP32 elements per row, in and out")
    p.add_argument("--clients", default="1,4", help="closed-loop clients per step, comma-separated")
    p.add_argument("--requests", type=int, default=2000, help="measured requests per step")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shm-bench-"))  # the model (its constant is a row wide) and the server log
    model = write_trivial(work / "trivial.onnx", args.width)
    config = {"server": {"shared_memory": {"system": True}, "max_body_bytes": 64 << 20},
              "models": [{"name": "t", "path": str(model), "max_batch_size": 8, "intra_op_threads": 1}]}
    rows = []
    with ServerProcess(config, work) as server:
        for clients in (int(c) for c in args.clients.split(",")):
            for mode in ("binary", "shm"):
                rows.append(asyncio.run(step(server, mode, clients, args.requests, args.width)))
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
                      flush=True)
    write_csv(args.out / "shm.csv", rows, digits=3)
    print(f"\nmodel and server log in {work}\n")
    print(text_table([("mode", "mode", -1), ("clients", "clients", -1), ("req/s", "req_per_s", 1), ("p50 ms", "p50_ms", 2),
                 ("p99 ms", "p99_ms", 2), ("server CPU us/request", "server_cpu_us_per_request", 0)], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
