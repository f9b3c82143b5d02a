"""One run with successes and every failure kind on a real server (real models, real client disconnects): each
answer moves exactly one outcome, and Triton's statistics extension agrees with the Prometheus counters exactly
(the rule in batcher/dataplane.py's docstring)."""

from __future__ import annotations

import asyncio
import collections
import urllib.request

import aiohttp
import numpy as np
import orjson
from helpers import dispatched, infer_kwargs, queued, until

MID = {"name": "mid_cnn", "path": "zoo:mid_cnn", "intra_op_threads": 1, "max_batch_size": 8,
       "dynamic_batching": {"admission_control": False, "default_queue_policy": {"max_queue_size": 2}}}
REC = {"name": "rec_raw", "path": "zoo:ppocr_rec", "max_batch_size": 4}  # no declared dims: height 96 fails inside
REASONS = {400: "invalid", 503: "rejected", 504: "timeout", 500: "backend", "canceled": "canceled"}


def _binary(rows: int, timeout_us: int | None = None, dtype=np.float32) -> dict:
    return infer_kwargs(np.ones((rows, 3, 224, 224), dtype), timeout_us=timeout_us)


def _rec(height: int) -> dict:
    return {"json": {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3, height, 64],
                                 "data": [0.5] * (3 * height * 64)}]}}


def _outcomes(server, model: str) -> dict:
    labels = {"model": model, "version": "1"}
    out = {"success": server.metric("batcher_request_success_total", **labels)}
    for reason in ("invalid", "rejected", "timeout", "backend", "canceled", "other"):
        out[reason] = server.metric("batcher_request_failure_total", reason=reason, **labels)
    return out


async def test_statistics_and_prometheus_count_every_outcome_once_and_agree(start_server):
    server = start_server({"models": [MID, REC]})
    seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    async with aiohttp.ClientSession() as s:

        async def post(model: str, kwargs: dict):
            async with s.post(f"{server.base}/v2/models/{model}/infer", **kwargs) as r:
                await r.read()
                seen[model][r.status] += 1
                return r.status

        assert await post("mid_cnn", _binary(1)) == 200
        assert await post("mid_cnn", _binary(1, dtype=np.float16)) == 400  # wrong datatype
        assert await post("mid_cnn", {"data": b"{not json"}) == 400  # undecodable body
        assert await post("mid_cnn", _binary(9)) == 400  # more rows than max_batch_size
        assert await post("mid_cnn", _binary(1, timeout_us=1)) == 504  # its deadline passed on arrival
        assert await post("nope", _binary(1)) == 404  # unknown model: counted nowhere
        # a slow batch executes; behind it two requests fill the queue, three more find it full, one client leaves
        slow = asyncio.create_task(post("mid_cnn", _binary(8)))  # ~0.5 s on one thread
        await until(lambda: dispatched(server, "mid_cnn") == 2)  # executing
        leaving = asyncio.create_task(post("mid_cnn", _binary(1)))
        await until(lambda: queued(server, "mid_cnn") == 1)
        waiting = asyncio.create_task(post("mid_cnn", _binary(1)))
        await until(lambda: queued(server, "mid_cnn") == 2)
        assert await asyncio.gather(*(post("mid_cnn", _binary(1)) for _ in range(3))) == [503] * 3  # queue full
        leaving.cancel()  # closes the connection while its request is queued
        await asyncio.gather(leaving, return_exceptions=True)
        assert await slow == 200 and await waiting == 200
        # 100 ms deadline on a batch of ~0.5 s: 504 at the deadline (or dropped before running, as too late)
        assert await post("mid_cnn", _binary(8, timeout_us=100_000)) == 504
        # an engine error: 500 for its batch only
        statuses = await asyncio.gather(post("rec_raw", _rec(96)), post("rec_raw", _rec(48)))
        assert sorted(statuses) == [200, 500]
    seen["mid_cnn"]["canceled"] = 1
    await until(lambda: _outcomes(server, "mid_cnn")["canceled"] == 1)  # the cancel reaches the handler later
    with urllib.request.urlopen(f"{server.base}/v2/models/stats") as r:
        stats = {m["name"]: m for m in orjson.loads(r.read())["model_stats"]}
    assert seen.pop("nope") == {404: 1}
    for model, counter in seen.items():
        got = _outcomes(server, model)
        want = {"success": counter[200], "other": 0}
        want.update({reason: counter[key] for key, reason in REASONS.items()})
        assert got == want, (model, got, want)  # every answer moved exactly one counter, by its status
        inference = stats[model]["inference_stats"]
        assert inference["success"]["count"] == got["success"]
        assert inference["fail"]["count"] == sum(v for k, v in got.items() if k != "success")
    assert seen["mid_cnn"] == {200: 3, 400: 3, 504: 2, 503: 3, "canceled": 1}
    assert "Traceback" not in server.log()
