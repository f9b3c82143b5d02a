"""Crash isolation: mode multiproc runs a model's contexts in worker processes (real processes, real kill -9).

What a dead worker may leave behind is checked where it would be: shared-memory segments in /dev/shm (the
server's are named ``batcher_<server pid>_*``; other processes on the machine create theirs, so only these are
counted; that a worker never creates a segment is a unit test) and its socket directory in the server's temp dir
(``TMPDIR``, one per test).
"""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np
import orjson
from helpers import infer_kwargs, until

SHM = Path("/dev/shm")


def _body(rows: int) -> dict:
    return infer_kwargs(np.ones((rows, 3, 224, 224), np.float32))


def _index(server) -> dict:
    req = urllib.request.Request(server.base + "/v2/repository/index", data=b"{}")
    return {e["name"]: e for e in orjson.loads(urllib.request.urlopen(req).read())}


def _segments(server) -> set[str]:
    """This server's shared-memory segments."""
    return {n for n in os.listdir(SHM) if n.startswith(f"batcher_{server.proc.pid}_")}


def _sockdirs(tmp: Path) -> list[str]:
    """The workers' socket directories in the server's temp dir."""
    return [n for n in os.listdir(tmp) if n.startswith("batcher-worker-")]


def _cpu_ticks(pid: int) -> int:
    """CPU time a process has used, in clock ticks (utime + stime of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def test_killed_worker_fails_its_batch_with_503_is_restarted_and_others_keep_serving(start_server, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = start_server({"server": {"repository_api": True}, "models": [
        {"name": "mid_cnn", "path": "zoo:mid_cnn", "mode": "multiproc", "max_batch_size": 8, "intra_op_threads": 1},
        {"name": "tiny_cnn", "path": "zoo:tiny_cnn"},
    ]}, env={"TMPDIR": str(tmp)})
    (pid,) = _index(server)["mid_cnn"]["worker_pids"]
    async with aiohttp.ClientSession() as s:

        async def infer(model, rows):
            async with s.post(f"{server.base}/v2/models/{model}/infer", **_body(rows)) as r:
                body = await r.read()
                return r.status, r.headers.get("Retry-After"), body

        assert (await infer("mid_cnn", 1))[0] == 200  # served by the worker
        assert len(_segments(server)) == 2  # the context's input and output segments
        idle = _cpu_ticks(pid)
        running = asyncio.create_task(infer("mid_cnn", 8))  # ~0.5 s of CPU in the worker
        # the worker has taken the batch once it has burnt 50 ms of CPU on it
        await until(lambda: _cpu_ticks(pid) >= idle + 5)
        assert not running.done()
        os.kill(pid, signal.SIGKILL)
        status, retry_after, body = await running
        assert status == 503 and retry_after == "1", body
        error = orjson.loads(body)["error"]
        assert f"worker process {pid} of model mid_cnn died while running a batch (exit code -9, SIGKILL)" in error
        assert (await infer("tiny_cnn", 1))[0] == 200  # the other model never noticed
        status, _, _ = await infer("mid_cnn", 1)  # a new worker, after the backoff
        assert status == 200
    (new_pid,) = _index(server)["mid_cnn"]["worker_pids"]
    assert new_pid != pid
    assert server.metric("batcher_worker_restart_total", model="mid_cnn", version="1") == 1
    assert server.proc.poll() is None  # the server itself is fine
    # nothing of the dead worker is left: the context's two segments (the input one regrown for 8 rows), no more
    assert len(_segments(server)) == 2 and _sockdirs(tmp) == []
    assert server.log().count(f"WARNING engines.multiproc: worker process {pid} ") == 1


async def test_idle_deaths_are_logged_restarted_before_the_next_request_and_leak_nothing(start_server, tmp_path):
    """kill -9 of an idle worker, four times: each death is logged once with its exit code and the worker is
    restarted without a request (its sentinel is watched); a crash loop leaks no segment and no socket directory
    per restart; a request right after a death is answered 200, not 503."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = start_server({"server": {"repository_api": True}, "models": [
        {"name": "tiny_cnn", "path": "zoo:tiny_cnn", "mode": "multiproc", "intra_op_threads": 1}]},
        env={"TMPDIR": str(tmp)})
    async with aiohttp.ClientSession() as s:

        async def infer():
            async with s.post(f"{server.base}/v2/models/tiny_cnn/infer", **_body(2)) as r:
                return r.status, await r.read()

        assert (await infer())[0] == 200
        segments = _segments(server)
        assert len(segments) == 2 and _sockdirs(tmp) == []
        pids = []
        for n in range(1, 5):
            (pid,) = _index(server)["tiny_cnn"]["worker_pids"]
            pids.append(pid)
            os.kill(pid, signal.SIGKILL)
            line = f"worker process {pid} of model tiny_cnn died while idle (exit code -9, SIGKILL)"
            await until(lambda: line in server.log())
            if n < 4:  # no request: the watcher restarts it
                await until(lambda: server.metric("batcher_worker_restart_total", model="tiny_cnn", version="1") == n)
                assert _index(server)["tiny_cnn"]["worker_pids"] != [pid]
            else:  # a request at once, while the restart is pending: it waits for the new worker
                status, body = await infer()
                assert status == 200, body
        assert (await infer())[0] == 200
    assert server.metric("batcher_worker_restart_total", model="tiny_cnn", version="1") == 4
    log = server.log()
    for pid in pids:
        assert log.count(f"worker process {pid} ") == 1, log  # one WARNING per death
    assert _segments(server) == segments  # the same two segments throughout: none per restart
    assert _sockdirs(tmp) == []
    assert server.stop() == 0
    assert _segments(server) == set()
    assert "leaked" not in server.log() and "Traceback" not in server.log()


def test_multiproc_server_stops_cleanly_and_leaves_no_workers_or_segments(start_server, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = start_server({"server": {"repository_api": True},
                           "models": [{"name": "tiny_cnn", "path": "zoo:tiny_cnn", "mode": "multiproc",
                                       "instance_group": [{"count": 2}]}]}, env={"TMPDIR": str(tmp)})
    pids = _index(server)["tiny_cnn"]["worker_pids"]
    assert len(pids) == 2 and all(pids)
    req = urllib.request.Request(f"{server.base}/v2/models/tiny_cnn/infer", **_body(3))
    assert urllib.request.urlopen(req).status == 200
    assert _sockdirs(tmp) == []  # socket directories live only while a worker starts
    assert server.stop() == 0
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert _segments(server) == set()
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
