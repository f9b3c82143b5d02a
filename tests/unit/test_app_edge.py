"""The application's edge (:func:`batcher.app.edge`, around every route's handler) and its fallback route
(:func:`batcher.app.unrouted`): every error a JSON answer, unknown paths and wrong methods too, as when the edge was
a middleware. In-process: the app of ``batcher serve`` (:func:`batcher.app.create_app`, lazy, so no model loads)
behind aiohttp's test server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from batcher.app import SHUTDOWN, Shutdown, create_app, edge
from batcher.bodies import BUDGET, UNCOUNTED_BYTES
from batcher.config import parse_config
from batcher.keys import DATAPLANE
from bench.mlp import write_trivial

NOT_FOUND = {"error": "404: Not Found"}  # aiohttp's HTTPNotFound().text, as the middleware answered it
NOT_ALLOWED = {"error": "405: Method Not Allowed"}


def _app(tmp_path) -> web.Application:
    model = write_trivial(tmp_path / "trivial.onnx")
    return create_app(parse_config({"server": {"load_strategy": "lazy", "repository_api": True},
                                    "models": [{"name": "trivial", "path": str(model), "max_batch_size": 8}]}))


@pytest.fixture
async def app_client(tmp_path):
    app = _app(tmp_path)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield app, client


async def _answer(client: TestClient, method: str, path: str, **kw) -> tuple[int, dict, object]:
    async with client.request(method, path, **kw) as r:
        body = await r.read()
        return r.status, r.headers, orjson.loads(body) if body else None


async def _raw(client: TestClient, request: bytes) -> bytes:
    """What the server answers ``request`` (sent as is; ``Connection: close``): a target the client cannot send."""
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(request)
    data = await reader.read()
    writer.close()
    return data


async def test_an_unknown_path_is_404_json_whatever_the_method(app_client):
    _, client = app_client
    for method, path in [("GET", "/nothing"), ("GET", "/v2/nothing"), ("POST", "/"), ("PUT", "/v2/health/live/"),
                         ("GET", "/metrics/")]:
        status, headers, body = await _answer(client, method, path)
        assert (status, body) == (404, NOT_FOUND), (method, path)
        assert headers["Content-Type"] == "application/json" and "Allow" not in headers
    status, headers, body = await _answer(client, "HEAD", "/nothing")
    assert (status, headers["Content-Type"], body) == (404, "application/json", None)
    # a target that is no path at all: the fallback takes it too (its pattern alone, /{tail:.*}, would not)
    data = await _raw(client, b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 404 ") and b"application/json" in data
    assert data.endswith(orjson.dumps(NOT_FOUND))
    # CONNECT's target has no path: aiohttp's router answers it before any route, in plain text (README's table)
    data = await _raw(client, b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 404 ") and data.endswith(b"404: Not Found")


async def test_a_wrong_method_on_a_known_path_is_405_json_with_allow_and_head_answers_a_get_route(app_client):
    _, client = app_client
    for method, path, allow in [("POST", "/v2/health/live", "GET,HEAD"), ("GET", "/v2/models/trivial/infer", "POST"),
                                ("DELETE", "/v2/models/trivial", "GET,HEAD"), ("PUT", "/v2/repository/index", "POST"),
                                # two resources match this path (/v2/models/stats, /v2/models/{model}): both GET
                                ("POST", "/v2/models/stats", "GET,HEAD"),
                                ("PATCH", "/v2/models/trivial/versions/1/infer", "POST")]:
        status, headers, body = await _answer(client, method, path)
        assert (status, body, headers.get("Allow")) == (405, NOT_ALLOWED, allow), (method, path)
        assert headers["Content-Type"] == "application/json"
    status, headers, body = await _answer(client, "HEAD", "/v2/health/live")
    assert (status, headers["Content-Type"], body) == (200, "application/json", None)
    assert (await _answer(client, "GET", "/v2/models/stats"))[0] == 200  # the plain resource, not {model}="stats"


async def test_a_method_one_resource_lacks_still_reaches_a_later_resource_whose_path_matches_too(tmp_path):
    """aiohttp's router goes on to the next resource whose path matches when one lacks the method; the fallback
    keeps that (a ``*`` route on each resource would answer 405 from the first). No two of this server's resources
    are such a pair today: two of them here."""
    app = _app(tmp_path)

    async def get(request: web.Request) -> web.Response:
        return web.json_response({"got": request.match_info["x"]})

    async def post(request: web.Request) -> web.Response:
        return web.json_response({"posted": True})

    app.router.add_get("/t/{x}", edge(get, app[SHUTDOWN]))  # tried first: its path matches /t/special too
    app.router.add_post("/t/{y:special}", edge(post, app[SHUTDOWN]))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        status, _, body = await _answer(client, "GET", "/t/special")
        assert (status, body) == (200, {"got": "special"})
        status, _, body = await _answer(client, "POST", "/t/special")
        assert (status, body) == (200, {"posted": True})
        status, headers, body = await _answer(client, "PUT", "/t/special")  # the union of both resources' methods
        assert (status, headers["Allow"], body) == (405, "GET,HEAD,POST", NOT_ALLOWED)
        status, headers, body = await _answer(client, "POST", "/t/other")
        assert (status, headers["Allow"], body) == (405, "GET,HEAD", NOT_ALLOWED)


async def test_a_batcher_error_gets_its_status_and_a_bug_500_and_the_server_keeps_serving(app_client, monkeypatch):
    app, client = app_client
    status, _, body = await _answer(client, "GET", "/v2/models/nope")
    assert status == 404 and body["error"].startswith("unknown model 'nope'")

    async def broken(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app[DATAPLANE], "model_metadata", broken)
    status, headers, body = await _answer(client, "GET", "/v2/models/trivial")
    assert (status, headers["Content-Type"], body) == (500, "application/json",
                                                        {"error": "internal error: RuntimeError('a bug')"})
    status, _, body = await _answer(client, "GET", "/v2/health/live")
    assert (status, body) == (200, {"live": True})


async def test_the_body_budget_is_held_while_the_handler_runs_and_given_back_after(app_client, monkeypatch):
    app, client = app_client
    budget, seen = app[BUDGET], []
    index = app[DATAPLANE].repository_index

    def watching(ready):
        seen.append(budget.used)  # inside the handler, after its body was read
        return index(ready)

    monkeypatch.setattr(app[DATAPLANE], "repository_index", watching)
    big = orjson.dumps({"ready": False, "pad": "x" * (2 * UNCOUNTED_BYTES)})  # counted against the budget
    status, _, body = await _answer(client, "POST", "/v2/repository/index", data=big)
    assert status == 200 and body[0]["name"] == "trivial"
    assert seen[0] >= len(big) and budget.used == 0
    status, _, body = await _answer(client, "POST", "/v2/repository/index", data=big[:-1])  # not JSON: 400
    assert status == 400 and budget.used == 0


async def test_while_draining_every_answer_closes_its_connection_unknown_paths_too(app_client):
    app, client = app_client
    assert (await _answer(client, "GET", "/v2/health/live"))[1].get("Connection") != "close"
    app[SHUTDOWN].draining = True
    for method, path, status in [("GET", "/v2/health/live", 200), ("GET", "/nothing", 404),
                                 ("POST", "/v2/health/live", 405)]:
        got, headers, _ = await _answer(client, method, path)
        assert (got, headers.get("Connection")) == (status, "close"), (method, path)


async def test_aiohttps_own_http_errors_raised_in_a_handler_are_mapped_as_before():
    """A 413 from aiohttp (``client_max_size``) becomes JSON and closes the connection; a redirect goes through."""

    async def too_large(request: web.Request) -> web.StreamResponse:
        raise web.HTTPRequestEntityTooLarge(max_size=10, actual_size=20)

    async def moved(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/v2")

    request = make_mocked_request("POST", "/x")
    resp = await edge(too_large, Shutdown())(request)
    assert resp.status == 413 and resp.content_type == "application/json" and resp.keep_alive is False
    assert orjson.loads(resp.body) == {"error": web.HTTPRequestEntityTooLarge(max_size=10, actual_size=20).text}
    with pytest.raises(web.HTTPFound):
        await edge(moved, Shutdown())(request)
