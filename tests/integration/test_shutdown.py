"""SIGTERM while request bodies are still arriving (issue 11): every request whose headers reached the server before
SIGTERM is accepted, its body read and answered 200 within the grace period; a request sent after SIGTERM gets 503,
and on a keep-alive connection the server closes the connection after it (``Connection: close``), so the client's
next request goes to a new connection rather than one the server is about to close under it.
"""

from __future__ import annotations

import asyncio
import signal

import numpy as np
import orjson

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
