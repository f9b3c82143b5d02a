"""The process-wide budget of request bodies in memory (``server.max_inflight_body_bytes``) and multi-member gzip.

A real server on 127.0.0.1 with a small real model (``Cast`` FLOAT -> STRING), real clients (raw asyncio sockets
for uploads held open mid-body, aiohttp, http.client). Every assertion waits for a state the server reports
(``batcher_inflight_body_bytes``, answers), never for a guessed time.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import os
import zlib

import aiohttp
import orjson
import pytest
from helpers import http_post as _post, string_models, until

from batcher.bodies import json_cost
from bench.server import ServerProcess

BODY = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.5, -2]}]})
ANSWER = ["1.5", "-2"]
LIMIT = 1_000_000  #: max_body_bytes
BUDGET = 2_500_000  #: max_inflight_body_bytes: two bodies of 1,000,000 bytes fit, a third does not
BIG = 1_000_000
GAUGE = "batcher_inflight_body_bytes"
INFER = "/v2/models/f2str/infer"
F2STR = {"model": "f2str", "version": "1"}


def _padded(n: int) -> bytes:
    """A valid infer request of exactly ``n`` bytes (JSON allows trailing whitespace)."""
    return BODY + b" " * (n - len(BODY))


def _config(folder, frontends: int = 0, **server) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    paths = string_models(folder)
    return {"server": {"max_body_bytes": LIMIT, "max_inflight_body_bytes": BUDGET, "frontends": frontends, **server},
            "models": [{"name": "f2str", "path": paths["f2str"], "max_batch_size": 4}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache_dir):
    with ServerProcess(_config(tmp_path_factory.mktemp("bodies-models")), tmp_path_factory.mktemp("bodies")) as s:
        yield s


def _gauge(server) -> float:
    return server.metric(GAUGE)


def _assert_answer(status: int, data: bytes) -> None:
    assert status == 200, data
    assert orjson.loads(data)["outputs"][0]["data"] == ANSWER


class Upload:
    """A request whose head and first bytes are sent, the rest held back (a slow client)."""

    def __init__(self, server, body: bytes, sent: int, headers: bytes = b"") -> None:
        self.server, self.body, self.sent, self.headers = server, body, sent, headers

    async def start(self, declared: int | None = None) -> Upload:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.server.port)
        length = len(self.body) if declared is None else declared
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n%s\r\n"
                          % (INFER.encode(), length, self.headers) + self.body[:self.sent])
        await self.writer.drain()
        return self

    async def finish(self) -> tuple[int, bytes]:
        """Send the rest; the answer's status and body."""
        self.writer.write(self.body[self.sent:])
        await self.writer.drain()
        return await self.answer()

    async def answer(self) -> tuple[int, bytes]:
        """The answer's status and body (read by its Content-Length: the server may keep the connection open for
        a while to drain a body it did not read)."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        body = await self.reader.readexactly(length)
        self.writer.close()
        return int(head.split()[1]), body

    def hang_up(self) -> None:
        self.writer.transport.abort()


async def _gauge_is(server, value: float) -> None:
    await until(lambda: _gauge(server) == value)


@pytest.mark.parametrize("frontends", [0, 1], ids=["single", "multi"])
async def test_bodies_past_the_budget_get_503_with_retry_after_until_the_held_ones_finish(
        start_server, tmp_path, frontends):
    """The user's report: N slow uploads of declared bodies under max_body_bytes held ~N x the body in memory, with
    nothing capping the total. Two uploads of 1,000,000 bytes hold 2,000,000 of the 2,500,000 budget: a third body
    of that size is refused unread (503, Retry-After, JSON), counted as reason rejected; a small one still fits. The
    held uploads complete with 200, their reservations are released by the time they are answered, and the third
    then succeeds. Multi-process mode: the front end's own budget, the same answers."""
    server = start_server(_config(tmp_path / "models", frontends))
    big = _padded(BIG)
    rejected0 = server.metric("batcher_request_failure_total", reason="rejected", **F2STR)
    assert server.metric("batcher_inflight_body_budget_bytes") == BUDGET
    held = [await Upload(server, big, BIG // 2).start() for _ in range(2)]
    await _gauge_is(server, 2 * BIG)  # both reserved their declared length before their bodies were read
    async with aiohttp.ClientSession() as s:
        async with s.post(server.base + INFER, data=big) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert r.content_type == "application/json"
            error = (await r.json())["error"]
        assert error == (f"the server is busy reading other request bodies ({2 * BIG} of server.max_inflight_body_bytes"
                         f" = {BUDGET} bytes held); this one needs {BIG} more: retry later")
        async with s.post(server.base + INFER, data=BODY) as r:  # fits beside them
            _assert_answer(r.status, await r.read())
        assert await asyncio.to_thread(_gauge, server) == 2 * BIG  # the small one released its bytes
        # the budget full to the byte: a small body with no coding (<= 64 KiB declared) is not counted, so it is
        # still served; anything counted is refused
        rest = await Upload(server, _padded(BUDGET - 2 * BIG), 10).start()
        await _gauge_is(server, BUDGET)
        status, data, _ = await asyncio.to_thread(_post, server, BODY)
        _assert_answer(status, data)
        status, _, headers = await asyncio.to_thread(_post, server, _padded(100_000))  # over UNCOUNTED_BYTES
        assert status == 503 and headers["Retry-After"] == "1"
        rest.hang_up()
        await _gauge_is(server, 2 * BIG)
        for upload in held:
            _assert_answer(*await upload.finish())
        assert await asyncio.to_thread(_gauge, server) == 0  # released before the answers were sent
        async with s.post(server.base + INFER, data=big) as r:
            _assert_answer(r.status, await r.read())
    assert server.metric("batcher_request_failure_total", reason="rejected", **F2STR) - rejected0 == 2
    assert server.metric(GAUGE) == 0


async def test_a_chunked_body_grows_its_reservation_and_gets_503_when_it_passes_the_budget(server):
    """No declared length: the reservation grows with each chunk; past the budget the request is refused then."""
    held = [await Upload(server, _padded(BIG), BIG // 2).start() for _ in range(2)]
    await _gauge_is(server, 2 * BIG)
    chunks = [b" " * 100_000] * 6  # 600,000 bytes: past the 500,000 left
    async with aiohttp.ClientSession() as s:

        async def body():
            for c in chunks:
                yield c

        async with s.post(server.base + INFER, data=body()) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert "server.max_inflight_body_bytes" in (await r.json())["error"]
    assert await asyncio.to_thread(_gauge, server) == 2 * BIG
    for upload in held:
        _assert_answer(*await upload.finish())
    assert await asyncio.to_thread(_gauge, server) == 0


async def test_a_client_hanging_up_mid_body_releases_its_reservation(server):
    uploads = [await Upload(server, _padded(BIG), BIG // 2).start() for _ in range(2)]
    await _gauge_is(server, 2 * BIG)
    uploads[0].hang_up()
    await _gauge_is(server, BIG)
    uploads[1].hang_up()
    await _gauge_is(server, 0)
    _assert_answer(*_post(server, _padded(BIG))[:2])
    assert server.metric(GAUGE) == 0
    log = server.log()
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("body,headers,status,fragment", [
    (b"{" + b" " * 1000, {}, 400, "request body"),
    (gzip.compress(BODY) + b"junk", {"Content-Encoding": "gzip"}, 400, "data after the end"),
    (b" " * (LIMIT + 1), {}, 413, f"is over server.max_body_bytes = {LIMIT}"),
    (gzip.compress(b" " * (LIMIT + 1)), {"Content-Encoding": "gzip"}, 413, "request body (decoded) is over"),
    ((b" " * 100_000 for _ in range(11)), {}, 413, "request body is over"),  # chunked, read up to the limit
    (b"{}", {"Content-Encoding": "zstd"}, 415, "is not supported"),
], ids=["400-json", "400-gzip", "413-declared", "413-decoded", "413-chunked", "415"])
def test_a_refused_body_releases_its_reservation(server, body, headers, status, fragment):
    code, data, answer_headers = _post(server, body, headers)
    assert code == status and fragment in orjson.loads(data)["error"], data
    if status == 413:  # the rest of the body is never read: the connection cannot carry another request
        assert {k.lower(): v for k, v in answer_headers.items()}.get("connection") == "close", answer_headers
    assert server.metric(GAUGE) == 0  # released before the answer was sent


@pytest.mark.parametrize("lines,body,status", [
    (["gzip", "zstd"], gzip.compress(BODY), 415),  # the second line's coding counts: zstd is not supported
    (["identity", "gzip"], gzip.compress(BODY), 200),
    (["gzip", "gzip"], gzip.compress(gzip.compress(BODY)), 200),
    (["gzip, gzip", "gzip, gzip, gzip"], b"x", 400),  # more than MAX_CODINGS (4): refused before any decoding
])
def test_content_encoding_on_several_lines_is_one_list(server, lines, body, status):
    """``Content-Encoding`` sent on several header lines is the list of them all, in order (RFC 9110, 5.3; a fresh
    user's find: only the first line was read, so gzip then zstd decoded as gzip alone: a 400 instead of 415)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.putrequest("POST", INFER)
        for coding in lines:
            conn.putheader("Content-Encoding", coding)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        code, data = r.status, r.read()
    finally:
        conn.close()
    if status == 200:
        _assert_answer(code, data)
    elif status == 415:
        assert code == status and "'zstd' is not supported" in orjson.loads(data)["error"], data
    else:
        assert (code, orjson.loads(data)["error"]) == (400, "Content-Encoding lists 5 codings; at most 4 are undone")


async def test_a_body_timing_out_releases_its_reservation(start_server, tmp_path):
    """408: the upload stops mid-body; read_timeout_s later the server answers and the bytes are free again."""
    server = start_server(_config(tmp_path / "models", read_timeout_s=0.5))
    upload = await Upload(server, _padded(BIG), BIG // 2).start()
    status, data = await upload.answer()  # the client sends nothing more
    assert status == 408 and b"server.read_timeout_s = 0.5 s" in data
    assert await asyncio.to_thread(_gauge, server) == 0


def test_a_coded_body_whose_decoded_form_passes_the_whole_budget_is_a_413(start_server, tmp_path):
    """A coded body counts its compressed and its decoded bytes: with a budget of max_body_bytes, random (so
    incompressible) 600,000 bytes gzip-compressed decode to 600,000 more and can never fit: 413, not 503."""
    server = start_server(_config(tmp_path / "models", max_inflight_body_bytes=LIMIT))
    packed = gzip.compress(os.urandom(600_000))
    status, data, _ = _post(server, packed, {"Content-Encoding": "gzip"})
    assert status == 413, data
    assert "is over server.max_inflight_body_bytes = 1000000" in orjson.loads(data)["error"]
    assert server.metric(GAUGE) == 0
    _assert_answer(*_post(server, gzip.compress(_padded(400_000)), {"Content-Encoding": "gzip"})[:2])


# ---------------------------------------------------------------------------- multi-member gzip (RFC 1952)
def _members(*parts: bytes) -> bytes:
    return b"".join(gzip.compress(p) for p in parts)


@pytest.mark.parametrize("body", [
    _members(BODY[:10], BODY[10:]),
    _members(BODY, b"  "),
    _members(b"", BODY[:1], BODY[1:40], b"", BODY[40:]),  # empty members too
    _members(_padded(300_000)[:150_000], _padded(300_000)[150_000:]),  # members across read chunks
], ids=["two", "body+whitespace", "five-with-empty", "large"])
def test_every_member_of_a_multi_member_gzip_body_is_decoded(server, body):
    """``cat a.gz b.gz`` is one valid gzip file (RFC 1952, 2.2); it got 400 "data after the end"."""
    _assert_answer(*_post(server, body, {"Content-Encoding": "gzip"})[:2])


@pytest.mark.parametrize("body,fragment", [
    (_members(BODY) + b"\x1f\x8bjunk", "unknown compression method"),  # a second member that is not gzip
    (_members(BODY) + gzip.compress(b" ")[:-4], "truncated"),
    (_members(BODY) + b"\0\0\0\0", "data after the end"),
    (_members(BODY, b"  ") + b"junk", "data after the end"),
], ids=["bad-member", "truncated-member", "zero-padding", "junk-after-members"])
def test_what_follows_a_gzip_member_must_be_a_whole_member(server, body, fragment):
    status, data, _ = _post(server, body, {"Content-Encoding": "gzip"})
    error = orjson.loads(data)["error"]
    assert status == 400 and error.startswith("request body does not decode as Content-Encoding gzip"), data
    assert fragment in error


def test_the_output_cap_counts_across_members(server):
    """Two members of 600,000 bytes each: 1,200,000 decoded bytes over the 1,000,000 limit: 413."""
    status, data, _ = _post(server, _members(b" " * 600_000, b" " * 600_000), {"Content-Encoding": "gzip"})
    assert status == 413 and "request body (decoded) is over server.max_body_bytes" in orjson.loads(data)["error"]
    assert server.metric(GAUGE) == 0


def test_deflate_has_no_members_data_after_its_stream_is_a_400(server):
    status, data, _ = _post(server, zlib.compress(BODY) + zlib.compress(b" "), {"Content-Encoding": "deflate"})
    assert status == 400 and "data after the end of the compressed stream" in orjson.loads(data)["error"]


async def test_expect_100_continue_over_the_body_limit_gets_413_at_once_and_within_it_100_continue(server):
    """An unknown path (or a wrong method: no route takes the request) gets its 404 or 405 at once, not 100
    Continue, and the connection closes after it, as the body may still come."""
    async def first_answer(length: int, path: str = INFER, method: str = "POST") -> tuple[bytes, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n"
                     "Expect: 100-continue\r\n\r\n".encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 30)
        rest = b""
        if not line.startswith(b"HTTP/1.1 100"):  # the head, then its body by Content-Length (the server keeps
            rest = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)  # reading what still comes for 10 s)
            length = next(int(h.split(b":")[1]) for h in rest.lower().split(b"\r\n") if h.startswith(b"content-length:"))
            rest += await asyncio.wait_for(reader.readexactly(length), 30)
        writer.close()
        return line, rest

    def too_large() -> float:
        return server.metric("batcher_request_failure_total", reason="invalid", **F2STR)

    before = too_large()
    line, rest = await first_answer(LIMIT + 1)  # the client is told before it sends a byte of the body
    assert line.startswith(b"HTTP/1.1 413") and b"connection: close" in rest.lower()
    assert rest.endswith(b'{"error":"request body of 1000001 bytes is over server.max_body_bytes = 1000000"}')
    assert too_large() - before == 1  # counted as a 413 without Expect is
    line, _ = await first_answer(LIMIT)
    assert line.startswith(b"HTTP/1.1 100")
    line, rest = await first_answer(10, "/v2/nowhere")
    assert line.startswith(b"HTTP/1.1 404") and b"connection: close" in rest.lower()
    assert rest.endswith(b'{"error":"404: Not Found"}')
    line, rest = await first_answer(10, "/v2/health/live", "PUT")
    assert line.startswith(b"HTTP/1.1 405") and b"connection: close" in rest.lower() and b"allow: " in rest.lower()


@pytest.mark.parametrize("frontends", [0, 1], ids=["single", "multi"])
def test_what_decoding_makes_counts_against_the_budget_before_it_is_made(start_server, tmp_path, frontends):
    """The user's report: one body under both limits made the server's memory grow by gigabytes (a JSON body of 30
    million numbers: 1.9 GB; 30 million BYTES elements: 7.2 GB), since the budget counted the body's bytes only.
    The values of a JSON part (one per comma, 64 bytes each) and the elements of a BYTES input (256 bytes each)
    now count too, before they are made, whether decoding runs on the event loop or (a large binary part) in a
    thread: a body whose decoded form can never fit is a 413, one that fits is served. Nothing stays held after."""
    folder = tmp_path / "models"
    folder.mkdir()
    paths = string_models(folder)
    server = start_server({"server": {"max_body_bytes": LIMIT, "max_inflight_body_bytes": BUDGET,
                                      "frontends": frontends},
                           "models": [{"name": "f2str", "path": paths["f2str"], "max_batch_size": 4},
                                      {"name": "str_id1", "path": paths["str_id1"], "max_batch_size": 0}]})
    # 100,000 JSON numbers (0.5 MB of body): 6.4 MB once parsed, over the 2.5 MB budget; 400 after parsing before
    values = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [0.5] * 100_000}]})
    status, data, _ = _post(server, values)
    assert status == 413, data
    need = len(values) + json_cost(values)
    assert orjson.loads(data)["error"] == (f"request body of at least {need} bytes (its decoded form counted too) is "
                                           f"over server.max_inflight_body_bytes = {BUDGET}")
    # nested objects cost far more than their commas (a second user's report: 100 MiB of {"a":{"a":{}}} took
    # 3.6 GB): 20,000 of them (300 KB) count about 13 MB; one per comma, 1.3 MB, let them be parsed
    nested = orjson.dumps({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [20_000],
                                       "data": [{"a": {"a": {}}}] * 20_000}]})
    status, data, _ = _post(server, nested, path="/v2/models/str_id1/infer")
    assert status == 413 and "(its decoded form counted too)" in orjson.loads(data)["error"], data

    def strings(n: int, length: int) -> tuple[bytes, dict[str, str]]:  # n BYTES elements of length bytes, binary
        element = len(b"s" * length).to_bytes(4, "little") + b"s" * length
        head = orjson.dumps({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [n],
                                         "parameters": {"binary_data_size": len(element) * n}}]})
        return head + element * n, {"Inference-Header-Content-Length": str(len(head))}

    for n, length, answer in [(10_000, 0, 413),  # 40 KB of body (not counted), 2.56 MB of elements: never fits
                              (100_000, 0, 413),  # 400 KB of binary part: decoded in a thread, counted from there
                              (1_000, 0, 200),  # 256,000 bytes of elements: fits
                              (2_000, 200, 200)]:  # 408 KB, in a thread: 512,000 bytes of elements beside it fit
        body, headers = strings(n, length)
        status, data, _ = _post(server, body, headers, path="/v2/models/str_id1/infer")
        assert status == answer, (n, length, data)
        if answer == 413:
            error = orjson.loads(data)["error"]
            assert "(its decoded form counted too) is over server.max_inflight_body_bytes" in error
        else:
            assert orjson.loads(data)["outputs"][0]["data"] == ["s" * length] * n
    assert server.metric(GAUGE) == 0
