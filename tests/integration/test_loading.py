"""Load strategies, the LRU memory budget, the repository API, versions and fallback, on real servers."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import aiohttp
import numpy as np
import orjson
import pytest
from helpers import dispatched, infer_kwargs, until

from bench.sweep.requests import decode_response

SEEDS = ("tiny_cnn", "mid_cnn", "resnet18")
MiB = 1 << 20


def _models(*names, **extra):
    return [{"name": n, "path": f"zoo:{n}", "intra_op_threads": 1, **extra} for n in names]


def _body(rows: int = 1) -> dict:
    return infer_kwargs(np.ones((rows, 3, 224, 224), np.float32))


def _post(server, path: str, token: str | None = None, *, scheme: str = "Bearer", with_headers: bool = False):
    """``(status, body)`` of a POST of ``{}``, ``(status, body, headers)`` with ``with_headers``."""
    headers = {"Authorization": f"{scheme} {token}"} if token else {}
    req = urllib.request.Request(server.base + path, data=b"{}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        answer = e.code, e.read(), e.headers
    return answer if with_headers else answer[:2]


def _loaded(server) -> dict[str, float]:
    m = server.metrics()
    return {dict(k)["model"]: v for (n, k), v in m.items() if n == "batcher_model_loaded"}


async def _infer(session, server, model, **kw):
    async with session.post(f"{server.base}/v2/models/{model}/infer", **_body(**kw)) as r:
        return r.status, decode_response(await r.read(), r.headers)[0], r.headers


def test_eager_is_ready_only_with_every_model_loaded(start_server):
    server = start_server({"server": {"load_strategy": "eager", "repository_api": True}, "models": _models(*SEEDS)})
    assert _loaded(server) == {n: 1.0 for n in SEEDS}  # at the first moment it reports ready
    index = orjson.loads(_post(server, "/v2/repository/index")[1])
    assert [(e["name"], e["state"]) for e in index] == [(n, "READY") for n in SEEDS]
    assert all(e["measured_bytes"] > 0 and e["footprint_bytes"] > 0 for e in index)
    assert server.metric("batcher_model_load_total", model="resnet18", version="1") == 1


async def test_lazy_loads_on_first_use_only(start_server):
    server = start_server({"server": {"load_strategy": "lazy", "repository_api": True}, "models": _models(*SEEDS)})
    assert _loaded(server) == {n: 0.0 for n in SEEDS}
    async with aiohttp.ClientSession() as s:
        status, head, _ = await _infer(s, server, "tiny_cnn")
    assert status == 200 and head["model_name"] == "tiny_cnn"
    assert _loaded(server) == {"tiny_cnn": 1.0, "mid_cnn": 0.0, "resnet18": 0.0}
    index = {e["name"]: e["state"] for e in orjson.loads(_post(server, "/v2/repository/index")[1])}
    assert index == {"tiny_cnn": "READY", "mid_cnn": "UNAVAILABLE", "resnet18": "UNAVAILABLE"}


async def test_concurrent_first_requests_share_one_load(start_server):
    server = start_server({"server": {"load_strategy": "lazy"}, "models": _models("resnet18")})
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(_infer(s, server, "resnet18") for _ in range(8)))
    assert [st for st, _, _ in results] == [200] * 8
    assert server.metric("batcher_model_load_total", model="resnet18", version="1") == 1


async def test_lru_never_exceeds_its_budget_on_a_mixed_workload(start_server):
    """Budget 200 MB: tiny+mid or tiny+resnet fit (measured here: ~20, ~75, ~110 MB of resident growth), all
    three do not; after every request the memory counted against the budget is within it."""
    budget_mb = 200
    server = start_server({"server": {"load_strategy": "lru", "memory_budget_mb": budget_mb, "repository_api": True},
                           "models": _models(*SEEDS)})
    order = ["tiny_cnn", "mid_cnn", "resnet18", "tiny_cnn", "resnet18", "mid_cnn", "mid_cnn", "tiny_cnn",
             "resnet18", "tiny_cnn", "mid_cnn", "resnet18"]
    async with aiohttp.ClientSession() as s:
        for model in order:
            status, head, _ = await _infer(s, server, model)
            assert status == 200, head
            used = server.metric("batcher_memory_used_bytes")
            assert 0 < used <= budget_mb * MiB, (model, used / MiB)
    assert server.metric("batcher_memory_budget_bytes") == budget_mb * MiB
    evictions = sum(server.metric("batcher_model_unload_total", model=m, version="1", reason="evict") for m in SEEDS)
    assert evictions >= 3
    events = orjson.loads(urllib.request.urlopen(server.base + "/v2/repository/events").read())["events"]
    assert {e["event"] for e in events} == {"load", "evict"}
    for e in events:  # each event carries its duration and the memory before and after
        assert e["duration_ms"] > 0 and e["rss_before_bytes"] > 0 and e["rss_after_bytes"] > 0
    evicts = [e for e in events if e["event"] == "evict"]
    assert all(e["used_bytes_after"] <= budget_mb * MiB for e in evicts)


async def test_lru_never_evicts_a_model_with_requests_in_flight(start_server):
    """Budget 200 MB holds one of mid_cnn (~75 MB measured) and resnet18 (160 MB assumed before its first load)
    at a time. While mid_cnn runs a slow batch, a request for resnet18 cannot evict it: it gets 503 naming the
    budget and the needs; mid_cnn's request completes."""
    server = start_server({"server": {"load_strategy": "lru", "memory_budget_mb": 200},
                           "models": [*_models("mid_cnn", max_batch_size=8), *_models("resnet18", memory_mb=160)]})
    async with aiohttp.ClientSession() as s:
        status, _, _ = await _infer(s, server, "mid_cnn")  # loaded (and idle)
        assert status == 200
        slow = asyncio.create_task(_infer(s, server, "mid_cnn", rows=8))  # ~0.5 s on one thread
        await until(lambda: dispatched(server, "mid_cnn") == 2)  # executing
        status, head, headers = await _infer(s, server, "resnet18")
        assert status == 503, head
        assert "memory budget 200 MB" in head["error"] and "resnet18" in head["error"] and "mid_cnn" in head["error"]
        assert headers["Retry-After"] == "1"
        assert (await slow)[0] == 200
        assert _loaded(server)["mid_cnn"] == 1.0
        status, _, _ = await _infer(s, server, "resnet18")  # now mid_cnn is idle: evicted for resnet18
        assert status == 200
    assert _loaded(server) == {"mid_cnn": 0.0, "resnet18": 1.0}


@pytest.mark.parametrize("on_cold", ["reject", "wait"])
async def test_a_model_larger_than_the_whole_budget_says_so_under_reject_and_wait(start_server, on_cold):
    """A new user's report: under ``on_cold: reject`` a model that can never fit the budget answered "is loading; try
    again shortly" with Retry-After 1 to every request, forever. Now both ``on_cold`` settings give one answer: 503
    naming the need and the budget, Retry-After 5 (the repository's for a model no request can load), no load
    tried; the per-model probe is 503 and the index says why."""
    server = start_server({"server": {"load_strategy": "lru", "memory_budget_mb": 100, "on_cold": on_cold,
                                      "repository_api": True},
                           "models": _models("tiny_cnn", memory_mb=500)})
    error = ("model 'tiny_cnn' version 1 needs 500 MB (its memory_mb), more than the whole memory budget (100 MB): "
             "no eviction can make room for it")
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(f"{server.base}/v2/models/tiny_cnn/infer", **_body()) as r:
                assert (r.status, r.headers["Retry-After"], await r.json()) == (503, "5", {"error": error})
        async with s.get(f"{server.base}/v2/models/tiny_cnn/ready") as r:
            assert (r.status, await r.json()) == (503, {"name": "tiny_cnn", "ready": False})
    index = orjson.loads(_post(server, "/v2/repository/index")[1])
    assert index == [{"name": "tiny_cnn", "version": "1", "state": "UNAVAILABLE",
                      "reason": error.removeprefix("model 'tiny_cnn' version 1 ")}]
    assert _post(server, "/v2/repository/models/tiny_cnn/load") == (503, orjson.dumps({"error": error}))
    assert server.metric("batcher_model_load_total", model="tiny_cnn", version="1") == 0
    assert " ERROR " not in server.log() and "Traceback" not in server.log()


def _slope(ys: list[float]) -> float:
    """Theil-Sen estimate of the trend of ``ys`` per step: the median of the slopes between every pair of points
    (robust to a few points pushed up or down by whatever else runs on the machine)."""
    return float(np.median([(ys[j] - ys[i]) / (j - i) for i in range(len(ys)) for j in range(i + 1, len(ys))]))


def test_unload_reload_cycles_return_memory(start_server):
    """20 load/unload cycles of resnet18 (each load adds ~110-200 MB of resident memory): each unload gives back
    what its load took, and resident memory after the unloads has no upward trend. The first three cycles are left
    out of the trend: ONNX Runtime's one-time global state and the allocator's cached free memory settle there
    (20-75 MB above the start). A trend, not a level: the level moves with the machine (a run beside other work
    ended 114.7 MB above the start), a leak shows as a slope (a leak of 2 MB per cycle or more fails)."""
    server = start_server({"server": {"load_strategy": "lazy", "repository_api": True}, "models": _models("resnet18")})
    base = server.rss_mb()
    after_load, after_unload = [], []
    for _ in range(20):
        assert _post(server, "/v2/repository/models/resnet18/load")[0] == 200
        after_load.append(server.rss_mb())
        assert _post(server, "/v2/repository/models/resnet18/unload")[0] == 200
        after_unload.append(server.rss_mb())
    assert min(after_load) - base > 80  # the model really took memory
    returned = [loaded - unloaded for loaded, unloaded in zip(after_load, after_unload)]
    assert np.median(returned) > 80, returned  # and each unload gave it back
    assert _slope(after_unload[3:]) < 2.0, (base, after_unload)
    assert server.metric("batcher_model_unload_total", model="resnet18", version="1", reason="unload") == 20


@pytest.mark.parametrize("token", ["in the config", "in a file"])
async def test_repository_api_states_auth_and_sticky_unload(start_server, tmp_path, token):
    """The bearer token given in the config, or in a file (``repository_token_file``: a mounted Kubernetes Secret,
    read with its newline)."""
    given = {"repository_token": "s3cret"}
    if token == "in a file":
        (tmp_path / "token").write_text("s3cret\n")
        given = {"repository_token_file": str(tmp_path / "token")}
    server = start_server({"server": {"load_strategy": "eager", "repository_api": True, **given},
                           "models": _models("tiny_cnn")})
    for token_given in (None, "wrong"):
        status, _, headers = _post(server, "/v2/repository/index", token_given, with_headers=True)
        assert status == 401 and headers["WWW-Authenticate"] == 'Bearer realm="repository"'  # RFC 9110, 15.5.2
    assert _post(server, "/v2/repository/index", "s3cret", scheme="Basic")[0] == 401
    assert _post(server, "/v2/repository/index", "s3cret", scheme="bearer")[0] == 200  # RFC 9110, 11.1
    # a header that is not UTF-8: 401 too (it was a 500 with an ERROR line and a traceback)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                 b"Authorization: Bearer \xff\r\nConnection: close\r\n\r\n{}")
    assert (await reader.read()).split(b"\r\n", 1)[0] == b"HTTP/1.1 401 Unauthorized"
    writer.close()
    assert " ERROR " not in server.log()
    status, body = _post(server, "/v2/repository/models/tiny_cnn/unload", "s3cret")
    assert status == 200
    index = orjson.loads(_post(server, "/v2/repository/index", "s3cret")[1])
    assert index == [{"name": "tiny_cnn", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded by request",
                      "measured_bytes": index[0]["measured_bytes"], "footprint_bytes": index[0]["footprint_bytes"]}]
    async with aiohttp.ClientSession() as s:
        status, head, headers = await _infer(s, server, "tiny_cnn")
        assert status == 503 and "not loaded" in head["error"] and headers["Retry-After"]
        async with s.get(f"{server.base}/v2/models/tiny_cnn/ready") as r:
            assert r.status == 503
        assert _post(server, "/v2/repository/models/tiny_cnn/load", "s3cret")[0] == 200
        assert (await _infer(s, server, "tiny_cnn"))[0] == 200
    assert _post(server, "/v2/repository/models/nope/load", "s3cret")[0] == 404


def test_repository_api_is_off_unless_enabled(start_server):
    server = start_server({"models": _models("tiny_cnn")})
    status, body = _post(server, "/v2/repository/index")
    assert status == 404 and b"disabled" in body
    assert "model_repository" not in orjson.loads(urllib.request.urlopen(server.base + "/v2").read())["extensions"]


@pytest.mark.parametrize("mismatch", ["reject", "fallback"])
async def test_versions_policy_and_mismatch(start_server, mismatch):
    """Version 1 is tiny_cnn, 2 mid_cnn, 3 resnet18; policy latest: 2 serves 2 and 3."""
    models = [{"name": "m", "version": v, "path": f"zoo:{p}", "version_policy": {"latest": 2}}
              for v, p in ((1, "tiny_cnn"), (2, "mid_cnn"), (3, "resnet18"))]
    server = start_server({"server": {"repository_api": True}, "routing": {"version_mismatch": mismatch},
                           "models": models})
    index = {e["version"]: e for e in orjson.loads(_post(server, "/v2/repository/index")[1])}
    assert index["1"]["state"] == "UNAVAILABLE" and index["1"]["reason"] == "not selected by the version policy"
    assert index["2"]["state"] == index["3"]["state"] == "READY"
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{server.base}/v2/models/m/infer", **_body()) as r:
            assert r.status == 200
            assert decode_response(await r.read(), r.headers)[0]["model_version"] == "3"  # the highest served one
        async with s.post(f"{server.base}/v2/models/m/versions/2/infer", **_body()) as r:
            assert r.status == 200
        async with s.post(f"{server.base}/v2/models/m/versions/1/infer", **_body()) as r:
            if mismatch == "reject":
                assert r.status == 404
                assert "has no version '1'; versions: ['2', '3']" in (await r.json())["error"]
            else:
                assert r.status == 200
                assert decode_response(await r.read(), r.headers)[0]["model_version"] == "3"
        async with s.get(f"{server.base}/v2/models/m") as r:
            assert (await r.json())["versions"] == ["2", "3"]


async def test_fallback_model_when_unavailable_or_queue_is_deep(start_server):
    server = start_server({
        "server": {"repository_api": True},
        "models": [*_models("mid_cnn", fallback="tiny_cnn", fallback_queue_depth=2, max_batch_size=1),
                   *_models("tiny_cnn")],
    })
    async with aiohttp.ClientSession() as s:
        status, head, _ = await _infer(s, server, "mid_cnn")
        assert status == 200 and head["model_name"] == "mid_cnn"
        # queue depth: 1 executing + queued ones; from the third queued request on, tiny_cnn takes them
        results = await asyncio.gather(*(_infer(s, server, "mid_cnn") for _ in range(8)))
        names = [h["model_name"] for st, h, _ in results if st == 200]
        assert len(names) == 8 and "tiny_cnn" in names and "mid_cnn" in names
        assert _post(server, "/v2/repository/models/mid_cnn/unload")[0] == 200
        status, head, _ = await _infer(s, server, "mid_cnn")
        assert status == 200 and head["model_name"] == "tiny_cnn"


async def test_requests_waiting_for_a_cold_load_pin_the_model(start_server):
    """lru, 100 MB: tiny_cnn (~33 MB before its first load) and mid_cnn (~87 MB) cannot both be loaded. Requests
    for tiny_cnn on a cold server, then, once its load has started, for mid_cnn: tiny_cnn's waiters pin it, so it
    is never evicted before serving them; a request that finds no room gets 503 naming the budget. (The mid_cnn
    requests wait for the index to show tiny_cnn's load: sent all at once, on a busy machine a mid_cnn request
    reached the server first now and then, and its load took the budget.)"""
    server = start_server({"server": {"load_strategy": "lru", "memory_budget_mb": 100, "repository_api": True},
                           "models": _models("tiny_cnn", "mid_cnn")})

    def tiny_cnn_loading() -> bool:
        index = orjson.loads(_post(server, "/v2/repository/index")[1])
        return any(e["name"] == "tiny_cnn" and e["state"] in ("LOADING", "READY") for e in index)

    async with aiohttp.ClientSession() as s:
        tiny = [asyncio.ensure_future(_infer(s, server, "tiny_cnn")) for _ in range(10)]
        await until(tiny_cnn_loading)
        results = await asyncio.gather(*tiny, *(_infer(s, server, "mid_cnn") for _ in range(10)))
    assert [st for st, _, _ in results[:10]] == [200] * 10
    for status, head, _ in results[10:]:
        assert status == 200 or (status == 503 and "memory budget 100 MB" in head["error"]), head
        assert "evicted" not in head.get("error", "")
    rejected = sum(st == 503 for st, _, _ in results)
    assert server.metric("batcher_request_failure_total", model="mid_cnn", version="1", reason="rejected") == rejected


def test_sigterm_stops_cleanly_with_exit_code_0(start_server):
    server = start_server({"server": {"load_strategy": "lazy"}, "models": _models("tiny_cnn")})
    urllib.request.urlopen(urllib.request.Request(f"{server.base}/v2/models/tiny_cnn/infer", **_body())).read()
    assert server.stop() == 0
    log = server.log()
    assert "shutting down: releasing 1 loaded model(s)" in log and "stopped" in log
    assert "Traceback" not in log
