"""Crash isolation: mode multiproc runs a model's contexts in worker processes (real processes, real kill -9)."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request

import aiohttp
import numpy as np
import orjson
from helpers import infer_kwargs


def _body(rows: int) -> dict:
    return infer_kwargs(np.ones((rows, 3, 224, 224), np.float32))


def _index(server) -> dict:
    req = urllib.request.Request(server.base + "/v2/repository/index", data=b"{}")
    return {e["name"]: e for e in orjson.loads(urllib.request.urlopen(req).read())}


async def test_killed_worker_fails_its_batch_with_503_is_restarted_and_others_keep_serving(start_server):
    server = start_server({"server": {"repository_api": True}, "models": [
        {"name": "mid_cnn", "path": "zoo:mid_cnn", "mode": "multiproc", "max_batch_size": 8, "intra_op_threads": 1},
        {"name": "tiny_cnn", "path": "zoo:tiny_cnn"},
    ]})
    (pid,) = _index(server)["mid_cnn"]["worker_pids"]
    async with aiohttp.ClientSession() as s:

        async def infer(model, rows):
            async with s.post(f"{server.base}/v2/models/{model}/infer", **_body(rows)) as r:
                body = await r.read()
                return r.status, r.headers.get("Retry-After"), body

        assert (await infer("mid_cnn", 1))[0] == 200  # served by the worker
        running = asyncio.create_task(infer("mid_cnn", 8))  # ~0.5 s in the worker
        await asyncio.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        status, retry_after, body = await running
        assert status == 503 and retry_after == "1", body
        assert "worker process" in orjson.loads(body)["error"] and "died" in orjson.loads(body)["error"]
        assert (await infer("tiny_cnn", 1))[0] == 200  # the other model never noticed
        status, _, _ = await infer("mid_cnn", 1)  # a new worker, after the backoff
        assert status == 200
    (new_pid,) = _index(server)["mid_cnn"]["worker_pids"]
    assert new_pid != pid
    assert server.metric("batcher_worker_restart_total", model="mid_cnn", version="1") == 1
    assert server.proc.poll() is None  # the server itself is fine


def test_multiproc_server_stops_cleanly_and_leaves_no_workers_or_segments(start_server):
    before = set(os.listdir("/dev/shm"))
    server = start_server({"server": {"repository_api": True},
                           "models": [{"name": "tiny_cnn", "path": "zoo:tiny_cnn", "mode": "multiproc", "instance_group": [{"count": 2}]}]})
    pids = _index(server)["tiny_cnn"]["worker_pids"]
    assert len(pids) == 2 and all(pids)
    req = urllib.request.Request(f"{server.base}/v2/models/tiny_cnn/infer", **_body(3))
    assert urllib.request.urlopen(req).status == 200
    assert server.stop() == 0
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert set(os.listdir("/dev/shm")) - before == set()
    log = server.log()
    assert "leaked" not in log and "Traceback" not in log and "stopped" in log


def test_worker_context_reads_batches_stacked_into_shared_memory(tmp_path):
    """The engine itself (no server): host_buffer is a view of the input's shared-memory segment, a batch stacked
    there reaches the worker without another copy, and the worker's context facts cross back."""
    from engines.multiproc import MultiprocEngine
    from engines.onnxruntime import OnnxRuntimeEngine
    from engines.zoo import resolve

    path = resolve("zoo:tiny_cnn")
    engine = MultiprocEngine(path, device="cpu", intra_op_threads=1, batch_sizes=[1, 2, 4])
    ctx = engine.create_context()
    try:
        assert ctx.describe() == {"execution": "cpu", "precision": "fp32", "process": "worker"}
        assert ctx.batch_sizes is None and ctx.device_nbytes == 0  # CPU runs any size, holds no device memory
        assert ctx.host_buffer("nope", (1,), np.float32) is None
        x = np.random.default_rng(5).standard_normal((3, 3, 224, 224)).astype(np.float32)
        staged = ctx.host_buffer("input", x.shape, x.dtype)
        staged[...] = x
        segment = ctx._segments["input"]
        assert np.shares_memory(staged, np.ndarray(x.shape, x.dtype, buffer=segment.buf))
        got = ctx.execute({"input": staged})["logits"]
        local = OnnxRuntimeEngine(path).create_context()
        np.testing.assert_allclose(got, local.execute({"input": x})["logits"], rtol=1e-5, atol=1e-5)
        bigger = np.ones((6, 3, 224, 224), np.float32)  # not staged, larger: a new segment, one copy into it
        assert ctx.execute({"input": bigger})["logits"].shape == (6, 1000)
        assert ctx._segments["input"].name != segment.name
    finally:
        ctx.release()
        engine.release()
