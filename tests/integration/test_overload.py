"""Deadlines, queue limits, body limits and engine failures against real servers (acceptance 4 and 5)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import orjson
from helpers import infer_kwargs

MID = {"name": "mid_cnn", "path": "zoo:mid_cnn", "intra_op_threads": 1, "max_batch_size": 8}


async def test_deadline_expires_in_queue_at_its_deadline_and_never_runs(start_server):
    """Acceptance 5: a 50 ms request queued behind a slow batch gets 504 within 50-100 ms and never executes."""
    server = start_server({"models": [{**MID}]})
    labels = {"model": "mid_cnn", "version": "1"}
    url = f"{server.base}/v2/models/mid_cnn/infer"
    big = np.ones((8, 3, 224, 224), np.float32)  # ~0.5 s on one thread
    small = np.ones((1, 3, 224, 224), np.float32)
    exe0 = server.metric("batcher_execution_count_total", **labels)
    async with aiohttp.ClientSession() as s:

        async def post(kwargs):
            t0 = time.monotonic()
            async with s.post(url, **kwargs) as r:
                return r.status, await r.read(), time.monotonic() - t0

        slow = asyncio.create_task(post(infer_kwargs(big)))
        await asyncio.sleep(0.15)  # the big batch is executing now
        status, body, elapsed = await post(infer_kwargs(small, timeout_us=50_000))
        assert status == 504, body
        assert "deadline expired" in orjson.loads(body)["error"]
        assert 0.050 <= elapsed <= 0.100, elapsed
        slow_status, _, slow_elapsed = await slow
    assert slow_status == 200
    assert slow_elapsed > 0.15  # the small request really waited behind it
    assert server.metric("batcher_execution_count_total", **labels) - exe0 == 1
    assert server.metric("batcher_inference_count_total", **labels) == 8
    assert server.metric("batcher_request_failure_total", reason="timeout", **labels) == 1


async def test_queue_full_answers_503_with_retry_after(start_server):
    """Acceptance 5: max_queue_size 4, 50 simultaneous requests: only 200s and 503s, adding up to 50."""
    server = start_server({"models": [{**MID, "dynamic_batching": {"default_queue_policy": {"max_queue_size": 4}}}]})
    url = f"{server.base}/v2/models/mid_cnn/infer"
    x = np.ones((1, 3, 224, 224), np.float32)
    depths: list[float] = []
    async with aiohttp.ClientSession() as s:

        async def post():
            async with s.post(url, **infer_kwargs(x)) as r:
                return r.status, r.headers.get("Retry-After"), await r.read()

        async def watch_depth(stop: asyncio.Event):
            while not stop.is_set():
                async with s.get(f"{server.base}/metrics") as r:
                    text = await r.text()
                depths.extend(float(line.split()[-1]) for line in text.splitlines()
                              if line.startswith("batcher_queue_depth{"))
                await asyncio.sleep(0.01)

        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_depth(stop))
        results = await asyncio.gather(*(post() for _ in range(50)))
        stop.set()
        await watcher
    statuses = [st for st, _, _ in results]
    ok, rejected = statuses.count(200), statuses.count(503)
    assert ok + rejected == 50, statuses
    assert ok >= 4 and rejected >= 1
    for st, retry_after, body in results:
        if st == 503:
            assert retry_after == "1"
            assert "queue is full" in orjson.loads(body)["error"]
    assert depths and max(depths) <= 4
    labels = {"model": "mid_cnn", "version": "1"}
    assert server.metric("batcher_request_failure_total", reason="rejected", **labels) == rejected
    assert server.metric("batcher_request_success_total", **labels) == ok


async def test_engine_error_fails_only_its_batch(start_server):
    """Without declared dims the recogniser accepts height 96 and fails inside ONNX Runtime: 500 with the
    engine's reason for that request only; the model keeps serving."""
    server = start_server({"models": [{"name": "rec_raw", "path": "zoo:ppocr_rec", "max_batch_size": 4}]})
    url = f"{server.base}/v2/models/rec_raw/infer"

    def body(h):
        return infer_kwargs(np.full((1, 3, h, 64), 0.5, np.float32), "x", binary=False)

    async with aiohttp.ClientSession() as s:

        async def post(b):
            async with s.post(url, **b) as r:
                return r.status, await r.json()

        results = await asyncio.gather(post(body(96)), post(body(48)))
        assert results[0][0] == 500
        assert "onnxruntime" in results[0][1]["error"] and "rec_raw" in results[0][1]["error"]
        assert results[1][0] == 200
        status, _ = await post(body(48))
        assert status == 200
    assert server.metric("batcher_request_failure_total", model="rec_raw", version="1", reason="backend") == 1


async def test_body_over_limit_is_413(start_server):
    server = start_server({"server": {"max_body_bytes": 4096},
                           "models": [{"name": "tiny_cnn", "path": "zoo:tiny_cnn"}]})
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{server.base}/v2/models/tiny_cnn/infer", data=b"x" * 5000) as r:
            assert r.status == 413
            assert "error" in await r.json()
        async with s.get(f"{server.base}/v2/health/live") as r:
            assert r.status == 200


async def test_client_that_goes_away_while_queued_is_never_executed(start_server):
    """A queued request whose client disconnects is dropped: it never runs and counts as canceled."""
    server = start_server({"models": [{**MID}]})
    labels = {"model": "mid_cnn", "version": "1"}
    url = f"{server.base}/v2/models/mid_cnn/infer"
    async with aiohttp.ClientSession() as s:

        async def post(x):
            async with s.post(url, **infer_kwargs(x)) as r:
                return r.status

        slow = asyncio.create_task(post(np.ones((8, 3, 224, 224), np.float32)))
        await asyncio.sleep(0.15)
        quitters = [asyncio.create_task(post(np.ones((1, 3, 224, 224), np.float32))) for _ in range(5)]
        await asyncio.sleep(0.1)
        for q in quitters:
            q.cancel()  # closes the connection while the request waits in the queue
        await asyncio.gather(*quitters, return_exceptions=True)
        assert await slow == 200
    for _ in range(50):
        if server.metric("batcher_request_failure_total", reason="canceled", **labels) == 5:
            break
        await asyncio.sleep(0.05)
    assert server.metric("batcher_request_failure_total", reason="canceled", **labels) == 5
    assert server.metric("batcher_execution_count_total", **labels) == 1
    assert server.metric("batcher_inference_count_total", **labels) == 8
    assert server.metric("batcher_queue_depth", **labels) == 0


async def test_stalled_upload_gets_408(start_server):
    server = start_server({"server": {"read_timeout_s": 0.3}, "models": [{"name": "tiny_cnn", "path": "zoo:tiny_cnn"}]})
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /v2/models/tiny_cnn/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"inp")
    await writer.drain()
    t0 = loop.time()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 408"), head
    assert 0.25 <= loop.time() - t0 <= 2.0
    writer.close()


async def test_higher_priority_is_served_first(start_server):
    """Two levels; while a blocker runs, three level-2 requests queue, then one level-1 request: it runs next."""
    server = start_server({"models": [{**MID, "max_batch_size": 1, "dynamic_batching": {
        "priority_levels": 2, "default_priority_level": 2, "max_priority_wait_microseconds": 60_000_000}}]})
    url = f"{server.base}/v2/models/mid_cnn/infer"
    done: list[str] = []
    async with aiohttp.ClientSession() as s:

        async def post(tag, priority=None):
            async with s.post(url, **infer_kwargs(np.ones((1, 3, 224, 224), np.float32), priority=priority)) as r:
                assert r.status == 200, await r.text()
            done.append(tag)

        blocker = asyncio.create_task(post("blocker"))
        await asyncio.sleep(0.02)
        lows = [asyncio.create_task(post(f"low{i}")) for i in range(3)]
        await asyncio.sleep(0.02)
        high = asyncio.create_task(post("high", priority=1))
        await asyncio.gather(blocker, *lows, high)
    assert done.index("high") < min(done.index(f"low{i}") for i in range(3)), done


async def test_priority_zero_or_above_the_levels_means_the_default_level(start_server):
    """Triton's rule: clients that always send a priority are served; 0 and out-of-range levels take the default."""
    server = start_server({"models": [{**MID, "dynamic_batching": {"priority_levels": 2}}]})
    async with aiohttp.ClientSession() as s:
        for priority in (0, 1, 2, 3, 99):
            async with s.post(f"{server.base}/v2/models/mid_cnn/infer",
                              **infer_kwargs(np.ones((1, 3, 224, 224), np.float32), priority=priority)) as r:
                assert r.status == 200, (priority, await r.text())
    assert server.metric("batcher_request_success_total", model="mid_cnn", version="1") == 5


async def test_admission_control_answers_at_once_when_the_deadline_cannot_be_met(start_server):
    """Once the server has measured execution time, a request whose deadline falls before the rows ahead of it
    can drain gets 503 with a Retry-After from the estimated drain time at once, not a 504 after waiting."""
    server = start_server({"models": [{**MID}]})
    labels = {"model": "mid_cnn", "version": "1"}
    url = f"{server.base}/v2/models/mid_cnn/infer"
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:

        async def post(x, timeout_us=None):
            t0 = loop.time()
            async with s.post(url, **infer_kwargs(x, timeout_us=timeout_us)) as r:
                return r.status, r.headers.get("Retry-After"), await r.read(), loop.time() - t0

        assert (await post(np.ones((2, 3, 224, 224), np.float32)))[0] == 200  # measures seconds per row
        slow = asyncio.create_task(post(np.ones((8, 3, 224, 224), np.float32)))
        await asyncio.sleep(0.1)
        status, retry_after, body, elapsed = await post(np.ones((1, 3, 224, 224), np.float32), timeout_us=100_000)
        assert status == 503, body
        assert "rows ahead need about" in orjson.loads(body)["error"]
        assert int(retry_after) >= 1
        assert elapsed < 0.08  # answered at once, well before its 100 ms deadline
        assert (await slow)[0] == 200
    assert server.metric("batcher_execution_count_total", **labels) == 2  # the rejected request never ran


async def test_sigterm_finishes_accepted_requests_then_exits_0(start_server):
    server = start_server({"server": {"shutdown_grace_s": 20}, "models": [{**MID}]})
    url = f"{server.base}/v2/models/mid_cnn/infer"
    async with aiohttp.ClientSession() as s:

        async def post(rows):
            async with s.post(url, **infer_kwargs(np.ones((rows, 3, 224, 224), np.float32))) as r:
                return r.status

        tasks = [asyncio.create_task(post(8)), asyncio.create_task(post(1)), asyncio.create_task(post(1))]
        await asyncio.sleep(0.2)  # accepted: one batch executing, two requests queued
        server.proc.terminate()
        await asyncio.sleep(0.1)
        async with s.get(f"{server.base}/v2/health/ready") as r:
            assert r.status == 503  # readiness false at once
        async with s.post(url, **infer_kwargs(np.ones((1, 3, 224, 224), np.float32))) as r:
            assert r.status == 503 and r.headers["Retry-After"]  # new requests refused while draining
        assert await asyncio.gather(*tasks) == [200, 200, 200]
    assert await asyncio.to_thread(server.proc.wait, 30) == 0
    assert "stopped" in server.log()


async def test_no_answer_after_the_deadline_even_while_executing(start_server):
    """A request whose batch is still executing at its deadline gets 504 at the deadline, not its late result."""
    server = start_server({"models": [{**MID, "dynamic_batching": {"admission_control": False}}]})
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:
        t0 = loop.time()
        async with s.post(f"{server.base}/v2/models/mid_cnn/infer",
                          **infer_kwargs(np.ones((8, 3, 224, 224), np.float32), timeout_us=150_000)) as r:
            body = await r.json()
        elapsed = loop.time() - t0
    assert r.status == 504 and "while its batch was executing" in body["error"]
    assert 0.15 <= elapsed <= 0.25, elapsed  # the 8-row batch takes ~0.5 s
    labels = {"model": "mid_cnn", "version": "1"}
    assert server.metric("batcher_request_failure_total", reason="timeout", **labels) == 1


async def test_client_that_goes_away_during_execution_does_not_disturb_its_batch(start_server):
    """Two requests share one batch (100 ms window); one client hangs up while the batch executes: its rows are
    discarded, the other request gets its answer, and the model keeps serving."""
    server = start_server({"models": [{**MID, "dynamic_batching": {"max_queue_delay_microseconds": 100_000}}]})
    labels = {"model": "mid_cnn", "version": "1"}
    url = f"{server.base}/v2/models/mid_cnn/infer"
    async with aiohttp.ClientSession() as s:

        async def post(rows):
            async with s.post(url, **infer_kwargs(np.ones((rows, 3, 224, 224), np.float32))) as r:
                await r.read()
                return r.status

        stays = asyncio.create_task(post(4))
        leaves = asyncio.create_task(post(4))
        await asyncio.sleep(0.25)  # window closed at ~0.1 s; the 8-row batch runs for ~0.5 s
        leaves.cancel()
        assert await stays == 200
        assert await post(1) == 200
    assert server.metric("batcher_execution_count_total", **labels) == 2
    assert server.metric("batcher_inference_count_total", **labels) == 9
    assert server.metric("batcher_request_failure_total", reason="canceled", **labels) == 1
    assert "Traceback" not in server.log()


async def test_low_priority_waits_at_most_the_starvation_bound(start_server):
    """A steady stream of level-1 requests keeps the model busy for ~2 s; a level-2 request sent early is served
    once it has waited max_priority_wait_microseconds (300 ms), plus the batch running then, not after the stream."""
    server = start_server({"models": [{**MID, "max_batch_size": 1, "dynamic_batching": {
        "priority_levels": 2, "default_priority_level": 2, "max_priority_wait_microseconds": 300_000,
        "default_queue_policy": {"max_queue_size": 64}}}]})
    url = f"{server.base}/v2/models/mid_cnn/infer"
    loop = asyncio.get_running_loop()
    x = np.ones((1, 3, 224, 224), np.float32)
    async with aiohttp.ClientSession() as s:

        async def post(priority):
            t0 = loop.time()
            async with s.post(url, **infer_kwargs(x, priority=priority)) as r:
                await r.read()
                return r.status, loop.time() - t0

        stream_end = loop.time() + 2.0

        async def high_stream():
            while loop.time() < stream_end:
                assert (await post(1))[0] == 200

        streams = [asyncio.create_task(high_stream()) for _ in range(4)]  # 4 level-1 requests always waiting
        await asyncio.sleep(0.2)
        status, waited = await post(2)
        still_streaming = loop.time() < stream_end
        await asyncio.gather(*streams)
    assert status == 200
    assert still_streaming, "the level-2 request only ran after the level-1 stream ended"
    assert waited < 0.3 + 0.5, waited  # the bound plus the ~0.1 s batch in progress, with slack for a busy CI


async def test_deadline_already_past_is_504_and_oversized_header_is_400(start_server):
    server = start_server({"models": [{"name": "tiny_cnn", "path": "zoo:tiny_cnn"}]})
    x = np.ones((1, 3, 224, 224), np.float32)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{server.base}/v2/models/tiny_cnn/infer", **infer_kwargs(x, timeout_us=1)) as r:
            assert r.status == 504 and "deadline" in (await r.json())["error"]
        big = {"X-Padding": "a" * 9000}
        async with s.get(f"{server.base}/v2/health/live", headers=big) as r:
            assert r.status == 400  # aiohttp's header size limit (8190 bytes)
        async with s.get(f"{server.base}/v2/health/live") as r:
            assert r.status == 200
