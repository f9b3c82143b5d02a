"""SIGTERM while request bodies are still arriving (issue 11): every request whose headers reached the server before
SIGTERM is accepted, its body read and answered 200 within the grace period; a request sent after SIGTERM gets 503,
and on a keep-alive connection the server closes the connection after it (``Connection: close``), so the client's
next request goes to a new connection rather than one the server is about to close under it. Clients connecting
while the drain ends are answered or refused, never reset (``batcher.door.close_the_door``).
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter

import numpy as np
import orjson
import pytest
from helpers import string_models, until

from bench.server import ServerProcess

CLIENTS = 16
ROWS = 8


def _request(keep_alive: bool = False) -> bytes:
    x = np.random.default_rng(11).standard_normal((ROWS, 3, 224, 224), np.float32)
    head = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "parameters": {"binary_data_output": True}})
    body = head + x.tobytes()
    lines = ["POST /v2/models/mid_cnn/infer HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}",
             f"Inference-Header-Content-Length: {len(head)}", *([] if keep_alive else ["Connection: close"])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _status(reader: asyncio.StreamReader) -> int:
    data = await reader.read()
    return int(data.split(b" ", 2)[1])


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """One response of a keep-alive connection: its status and headers (lower-case names); its body is read."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in head[1:] if ":" in line)}
    await reader.readexactly(int(headers["content-length"]))
    return int(head[0].split(" ", 2)[1]), headers


async def test_sigterm_with_bodies_in_flight_answers_every_accepted_request(tmp_path, cache_dir):
    config = {"server": {"shutdown_grace_s": 60, "read_timeout_s": 60},
              "models": [{"name": "mid_cnn", "path": "zoo:mid_cnn", "max_batch_size": ROWS, "intra_op_threads": 2,
                          "dynamic_batching": {"max_queue_delay_microseconds": 1000}}]}  # no default timeout
    server = ServerProcess(config, tmp_path)
    try:
        raw = _request()
        half = len(raw) // 2
        ka_reader, ka_writer = await asyncio.open_connection("127.0.0.1", server.port)  # keep-alive, used before
        ka_writer.write(_request(keep_alive=True))
        status, headers = await asyncio.wait_for(_response(ka_reader), 30)
        assert status == 200 and headers.get("connection", "keep-alive").lower() == "keep-alive"
        conns = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(CLIENTS)]
        for _, writer in conns:  # headers and half of each body
            writer.write(raw[:half])
        await asyncio.gather(*(w.drain() for _, w in conns))
        await asyncio.sleep(0.2)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        # a request that arrives after SIGTERM: 503 (the server is draining)
        late_reader, late_writer = await asyncio.open_connection("127.0.0.1", server.port)
        late_writer.write(raw)
        await late_writer.drain()
        assert await asyncio.wait_for(_status(late_reader), 30) == 503
        late_writer.close()
        ka_writer.write(_request(keep_alive=True))  # the keep-alive connection's next request: 503, then closed
        status, headers = await asyncio.wait_for(_response(ka_reader), 30)
        assert status == 503 and headers["connection"].lower() == "close"
        assert await asyncio.wait_for(ka_reader.read(), 30) == b""  # the server closed it
        ka_writer.close()
        for _, writer in conns:  # the rest of the bodies
            writer.write(raw[half:])
        await asyncio.gather(*(w.drain() for _, w in conns))
        statuses = await asyncio.wait_for(asyncio.gather(*(_status(r) for r, _ in conns)), 60)
        assert statuses == [200] * CLIENTS
        for _, writer in conns:
            writer.close()
        assert await asyncio.to_thread(server.proc.wait, 60) == 0
        log = server.log()
        assert " ERROR " not in log and "Traceback" not in log, log[-3000:]
    finally:
        server.stop()


F2STR_BODY = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.5, -2]}]})
STORM_CLIENTS = 32


def _f2str_request(body: bytes = F2STR_BODY) -> bytes:
    return (b"POST /v2/models/f2str/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
            % len(body) + body)


def _outcome(data: bytes) -> str:
    """A whole answer read to the server's close: its status; a 503 only with Retry-After and Connection: close."""
    if not data:
        return "closed without an answer"
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip().lower() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
    status = lines[0].split(" ", 2)[1]
    if len(body) != int(headers.get("content-length", -1)):
        return f"{status} cut short"
    if status == "503" and not (headers.get("retry-after") and headers.get("connection") == "close"):
        return "503 without Retry-After and Connection: close"
    return status


@pytest.mark.parametrize("frontends", [0, 2], ids=["single", "multi"])
async def test_connections_made_while_the_drain_ends_are_answered_or_refused_never_reset(start_server, tmp_path,
                                                                                          frontends):
    """The tester's report: clients connecting while the drain ended got connection resets - those whose handshake
    the kernel had completed into the listen backlog when the port closed (the server had not taken them yet), and
    those taken in its last moments whose request was never read - and some a close with no answer. Here clients
    connect one request after another without pause, through SIGTERM and the end of the drain (an upload held
    mid-body keeps the drain going until the clients have been answered 503): every connection gets a whole answer
    (200 before SIGTERM, 503 + Retry-After + Connection: close after it) or, once the port is closed, is refused;
    nothing is reset or left unanswered, and the server exits 0 without an error line."""
    (tmp_path / "models").mkdir()
    config = {"server": {"frontends": frontends, "shutdown_grace_s": 60, "read_timeout_s": 60},
              "models": [{"name": "f2str", "path": string_models(tmp_path / "models")["f2str"], "max_batch_size": 4}]}
    server = start_server(config)
    outcomes: Counter[str] = Counter()

    async def client() -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            except ConnectionRefusedError:
                outcomes["refused"] += 1  # the port is closed for good
                return
            except OSError as exc:
                outcomes[f"connect: {exc!r}"] += 1
                return
            try:
                if writer.get_extra_info("sockname")[1] == server.port:  # nothing listens: connected to itself
                    outcomes["refused"] += 1
                    return
                writer.write(_f2str_request())
                await writer.drain()
                outcomes[_outcome(await reader.read())] += 1
            except ConnectionResetError:
                outcomes["reset"] += 1
            finally:
                writer.close()

    held_body = F2STR_BODY + b" " * 100_000  # counted against the body budget, read in chunks: held mid-body
    held_raw = _f2str_request(held_body)
    clients = [asyncio.create_task(client()) for _ in range(STORM_CLIENTS)]
    try:
        await until(lambda: outcomes["200"] >= 50, timeout_s=60)
        held_reader, held_writer = await asyncio.open_connection("127.0.0.1", server.port)
        held_writer.write(held_raw[:len(held_raw) // 2])
        await held_writer.drain()
        await until(lambda: server.metric("batcher_inflight_body_bytes") == len(held_body), timeout_s=60)
        server.proc.send_signal(signal.SIGTERM)
        await until(lambda: outcomes["503 without Retry-After and Connection: close"] + outcomes["503"] >= 50,
                    timeout_s=60)
        held_writer.write(held_raw[len(held_raw) // 2:])  # the last accepted request: the drain ends with it
        await held_writer.drain()
        assert _outcome(await asyncio.wait_for(held_reader.read(), 60)) == "200"
        held_writer.close()
        await asyncio.wait_for(asyncio.gather(*clients), 60)
    finally:
        for task in clients:
            task.cancel()
    assert await asyncio.to_thread(server.proc.wait, 60) == 0
    assert set(outcomes) == {"200", "503", "refused"}, outcomes
    assert outcomes["refused"] == STORM_CLIENTS
    log = server.log()
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("frontends", [0, 1], ids=["single", "multi"])
async def test_a_body_still_arriving_when_the_grace_ends_is_answered_503(start_server, tmp_path, frontends):
    """The new-user report: a client still uploading its body when SIGTERM's grace ran out got no answer at all
    (its handler was cancelled when aiohttp closed, a second grace later), and multi-process mode logged an
    ERROR for a future nobody retrieved. Now the body read stops at the end of the grace and the request gets 503
    + Retry-After + Connection: close; the server exits 0 without an error line."""
    (tmp_path / "models").mkdir()
    config = {"server": {"frontends": frontends, "shutdown_grace_s": 1, "read_timeout_s": 600},
              "models": [{"name": "f2str", "path": string_models(tmp_path / "models")["f2str"], "max_batch_size": 4}]}
    server = start_server(config)
    body = F2STR_BODY + b" " * 100_000
    raw = _f2str_request(body)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(raw[:len(raw) // 2])  # and never the rest
    await writer.drain()
    await until(lambda: server.metric("batcher_inflight_body_bytes") == len(body), timeout_s=60)
    server.proc.send_signal(signal.SIGTERM)
    answer = await asyncio.wait_for(reader.read(), 120)
    writer.close()
    assert _outcome(answer) == "503", answer[:300]
    assert b"shutting down" in answer
    assert await asyncio.to_thread(server.proc.wait, 60) == 0
    log = server.log()
    assert " ERROR " not in log and "Traceback" not in log and "never retrieved" not in log, log[-3000:]


@pytest.mark.parametrize("frontends", [0, 1])
async def test_requests_still_queued_when_the_grace_ends_are_answered_503(start_server, frontends):
    """A new user's report: 100 requests queued for a slow model, SIGTERM with a 1 s grace: 36 got no answer at all
    (the exit closed their connections). Now what is still queued when the grace ends is answered 503 + Retry-After
    (DataPlane.shed; a front end sheds its requests waiting for the engine process), and the server exits 0."""
    model = {"name": "mid_cnn", "path": "zoo:mid_cnn", "intra_op_threads": 1, "max_batch_size": 1,
             "dynamic_batching": {"default_queue_policy": {"max_queue_size": 200}, "admission_control": False}}
    server = start_server({"server": {"frontends": frontends, "shutdown_grace_s": 1}, "models": [model]})
    x = np.zeros((1, 3, 224, 224), np.float32)
    head = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                     "parameters": {"binary_data_size": x.nbytes}}]})
    n = 150  # about 3 s of work at 1 row per batch: far more than the 1 s grace

    async def post(session) -> tuple[int, bytes]:
        async with session.post(f"{server.base}/v2/models/mid_cnn/infer", data=head + x.tobytes(),
                                headers={"Inference-Header-Content-Length": str(len(head))}) as r:
            return r.status, await r.read()

    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n)) as s:
        tasks = [asyncio.create_task(post(s)) for _ in range(n)]
        await until(lambda: server.metric("batcher_queue_depth", model="mid_cnn", version="1") >= n // 2,
                    timeout_s=60)
        server.proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, tuple) for r in results), [r for r in results if not isinstance(r, tuple)][:3]
    statuses = Counter(status for status, _ in results)
    assert set(statuses) <= {200, 503} and statuses[503] > 0, statuses
    assert all(b"drain's grace (server.shutdown_grace_s) is over" in body for status, body in results
               if status == 503)
    assert await asyncio.to_thread(server.proc.wait, 60) == 0
    log = server.log()
    assert "still queued after the grace; answered 503" in log
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]
