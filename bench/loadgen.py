"""Closed-loop load generator for any KServe v2 HTTP server (binary tensor extension), on several processes.

``C`` clients in ``P`` processes each send one request, wait for its answer, and send the next, for a fixed
duration. Latency is measured per request from send to the last byte of the answer (``time.perf_counter``).
Only the standard library, numpy, aiohttp and orjson are used, so it runs where tritonclient is not installed.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import orjson


def binary_body(input_name: str, x: np.ndarray, datatype: str = "FP32") -> tuple[bytes, dict[str, str]]:
    """A KServe v2 binary-extension request body for one input, asking for binary outputs."""
    head = orjson.dumps({
        "inputs": [{"name": input_name, "datatype": datatype, "shape": list(x.shape),
                    "parameters": {"binary_data_size": x.nbytes}}],
        "parameters": {"binary_data_output": True},
    })
    headers = {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}
    return head + np.ascontiguousarray(x).tobytes(), headers


@dataclass
class Result:
    """Latencies (s) of answered requests by status, plus the measured wall time (s)."""

    latencies: np.ndarray
    statuses: np.ndarray
    wall_s: float

    @property
    def ok(self) -> np.ndarray:
        return self.latencies[self.statuses == 200]

    def qps(self) -> float:
        return float((self.statuses == 200).sum() / self.wall_s) if self.wall_s else 0.0

    def percentile_ms(self, q: float) -> float:
        ok = self.ok
        return float(np.percentile(ok, q) * 1e3) if ok.size else float("nan")


async def _clients(url: str, body: bytes, headers: dict, concurrency: int, warmup_s: float, duration_s: float):
    import aiohttp

    lat: list[float] = []
    st: list[int] = []
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        start = time.perf_counter()
        measure_from = start + warmup_s
        end = measure_from + duration_s

        async def one_client():
            while True:
                t0 = time.perf_counter()
                if t0 >= end:
                    return
                async with s.post(url, data=body, headers=headers) as r:
                    await r.read()
                    status = r.status
                t1 = time.perf_counter()
                if t0 >= measure_from:
                    lat.append(t1 - t0)
                    st.append(status)

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return lat, st


def _worker(args) -> tuple[list[float], list[int]]:
    return asyncio.run(_clients(*args))


def closed_loop(url: str, body: bytes, headers: dict, *, concurrency: int, processes: int = 1,
                warmup_s: float = 1.0, duration_s: float = 5.0) -> Result:
    """Run ``concurrency`` closed-loop clients spread over ``processes`` processes against ``url``.

    Returns:
        the latencies and statuses of requests sent after the warm-up, and the measured duration.
    """
    per = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    jobs = [(url, body, headers, n, warmup_s, duration_s) for n in per if n]
    if len(jobs) == 1:
        parts = [_worker(jobs[0])]
    else:
        with ProcessPoolExecutor(len(jobs), mp_context=mp.get_context("spawn")) as pool:
            parts = list(pool.map(_worker, jobs))
    lat = np.array([x for p in parts for x in p[0]])
    st = np.array([x for p in parts for x in p[1]], dtype=np.int32)
    return Result(lat, st, duration_s)
