"""Strings (BYTES) end to end on real string models (``onnx.helper``: identity of rank 1-3, Cast STRING->FLOAT,
Cast FLOAT->STRING), through tritonclient in JSON and binary, on eager and lazy servers (issue 11)."""

from __future__ import annotations

import asyncio
import struct

import aiohttp
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from helpers import string_models

from bench.server import ServerProcess

TEXT = ["abc", "é", "a\x00b", "", "日本語", "0"]


def _config(paths: dict[str, str], strategy: str = "eager") -> dict:
    models = [{"name": n, "path": p, "max_batch_size": 8} for n, p in paths.items()]
    # the same Cast model with a long window and a batch of 4: four concurrent requests always share one batch
    models.append({"name": "str2f_batched", "path": paths["str2f"], "max_batch_size": 4,
                   "dynamic_batching": {"max_queue_delay_microseconds": 5_000_000}})
    return {"server": {"load_strategy": strategy}, "models": models}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return string_models(tmp_path_factory.mktemp("string-models"))


@pytest.fixture(scope="module")
def eager(paths, tmp_path_factory, cache_dir):
    """An eager server whose models take and give only strings: it must start (the codec and engine warm-ups
    feed BYTES inputs that a string-parsing model accepts)."""
    with ServerProcess(_config(paths), tmp_path_factory.mktemp("eager-strings")) as server:
        yield server


@pytest.fixture(scope="module")
def client(eager):
    c = httpclient.InferenceServerClient(eager.url, concurrency=8)
    yield c
    c.close()


def _infer(client, model: str, name: str, arr: np.ndarray, datatype: str, binary: bool) -> np.ndarray:
    inp = httpclient.InferInput(name, list(arr.shape), datatype)
    inp.set_data_from_numpy(arr, binary_data=binary)
    return client.infer(model, [inp], outputs=[httpclient.InferRequestedOutput("o", binary_data=binary)]).as_numpy("o")


def _as_bytes(arr: np.ndarray) -> list:
    """tritonclient gives BYTES outputs as bytes (binary) or str (JSON): compare both as bytes."""
    return [x if isinstance(x, bytes) else x.encode() for x in arr.ravel()]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("model,shape", [("str_id1", (6,)), ("str_id2", (3, 2)), ("str_id3", (1, 2, 2))])
def test_text_goes_through_byte_exact_at_every_rank(client, model, shape, binary):
    """Issue 11: "abc" came back as "b'abc'", and a 1-D BYTES output gave a 500."""
    n = int(np.prod(shape))
    arr = np.array([t.encode() for t in (TEXT * 2)[:n]], dtype=object).reshape(shape)
    got = _infer(client, model, "s", arr, "BYTES", binary)
    assert got.shape == shape
    assert _as_bytes(got) == list(arr.ravel())


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_a_string_parsing_model_reads_the_text_sent(client, binary):
    arr = np.array([[b"1.5", b"-2"], [b"1e3", b" 7"]], dtype=object)
    got = _infer(client, "str2f", "s", arr, "BYTES", binary)
    np.testing.assert_array_equal(got, np.array([[1.5, -2.0], [1000.0, 7.0]], np.float32))


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_a_number_to_string_model_answers_text(client, binary):
    got = _infer(client, "f2str", "x", np.array([[1.5, -2.0]], np.float32), "FP32", binary)
    assert got.shape == (1, 2) and _as_bytes(got) == [b"1.5", b"-2"]


def _binary_bytes_request(name: str, elements: list[bytes], shape: list[int]) -> tuple[bytes, dict]:
    raw = b"".join(struct.pack("<I", len(e)) + e for e in elements)
    head = orjson.dumps({"inputs": [{"name": name, "datatype": "BYTES", "shape": shape,
                                     "parameters": {"binary_data_size": len(raw)}}]})
    return head + raw, {"Inference-Header-Content-Length": str(len(head))}


async def _post(server, model: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(f"{server.base}/v2/models/{model}/infer", data=body,
                                                     headers=headers or {}) as r:
        return r.status, orjson.loads(await r.read())


async def test_bytes_that_are_not_utf8_get_a_400_naming_the_input(eager):
    """ONNX Runtime string tensors carry UTF-8 text only: the server says so before queueing (documented rule)."""
    before = eager.metric("batcher_execution_count_total", model="str_id1", version="1")
    body, headers = _binary_bytes_request("s", [b"ok", b"\xff\xfe"], [2])
    status, doc = await _post(eager, "str_id1", body, headers)
    assert status == 400
    assert doc["error"].startswith("input 's': BYTES element 1 is not UTF-8 text")
    assert eager.metric("batcher_execution_count_total", model="str_id1", version="1") == before  # never queued
    assert eager.metric("batcher_request_failure_total", model="str_id1", version="1", reason="invalid") >= 1


async def test_text_the_model_cannot_parse_is_a_400_and_its_batch_mates_succeed(eager):
    """One bad request in a batch of four: it alone gets 400; the other three get their exact outputs."""
    labels = {"model": "str2f_batched", "version": "1"}
    exe0 = eager.metric("batcher_execution_count_total", **labels)
    inf0 = eager.metric("batcher_inference_count_total", **labels)

    def body(a: str, b: str) -> bytes:
        return orjson.dumps({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [1, 2], "data": [a, b]}]})

    results = await asyncio.gather(*(_post(eager, "str2f_batched", b) for b in
                                     [body("1", "2"), body("x", "3"), body("4.5", "-1"), body("6", "7")]))
    assert [s for s, _ in results] == [200, 400, 200, 200]
    assert [r["outputs"][0]["data"] for s, r in results if s == 200] == [[1.0, 2.0], [4.5, -1.0], [6.0, 7.0]]
    assert "cannot run on this request's input" in results[1][1]["error"]
    assert eager.metric("batcher_execution_count_total", **labels) == exe0 + 1  # they did share one batch
    assert eager.metric("batcher_inference_count_total", **labels) == inf0 + 4
    log = eager.log()
    assert " ERROR " not in log and "Traceback" not in log and "[E:onnxruntime" not in log, log[-3000:]


async def test_string_models_load_on_first_use_under_lazy(paths, tmp_path):
    """Issue 11: with lazy loading a BYTES-only model could not be served; a string-parsing one failed its
    warm-up on empty strings."""
    with ServerProcess(_config(paths, "lazy"), tmp_path) as server:
        for model, value in (("str2f", "2.5"), ("str_id1", "é")):
            status, doc = await _post(server, model, orjson.dumps({"inputs": [
                {"name": "s", "datatype": "BYTES", "shape": [1, 2] if model == "str2f" else [1],
                 "data": [value, value] if model == "str2f" else [value]}]}))
            assert status == 200, doc
            expected = [2.5, 2.5] if model == "str2f" else [value]
            assert doc["outputs"][0]["data"] == expected


async def test_failed_requests_leave_no_asyncio_task_behind(paths, cache_dir):
    """Issue 11: each failed request to a lazy BYTES-only model left a pending task. In-process (the app of
    ``batcher serve``, a real aiohttp client on 127.0.0.1) so the event loop's tasks can be counted."""
    from aiohttp.test_utils import TestClient, TestServer

    from batcher.app import create_app
    from batcher.config import parse_config

    app = create_app(parse_config(_config(paths, "lazy")))
    async with TestClient(TestServer(app, host="127.0.0.1")) as http:

        async def post(body: bytes, headers: dict | None = None) -> int:
            async with http.post("/v2/models/str2f/infer", data=body, headers=headers or {}) as r:
                await r.read()
                return r.status

        ok = orjson.dumps({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [1, 2], "data": ["1", "2"]}]})
        assert await post(ok) == 200  # loads the model
        await asyncio.sleep(0.1)
        before = len(asyncio.all_tasks())
        bad = [orjson.dumps({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [1, 2], "data": ["x", "2"]}]}),
               _binary_bytes_request("s", [b"\xff", b"1"], [1, 2]),
               orjson.dumps({"inputs": []}), b"{"]
        for i in range(20):
            body = bad[i % len(bad)]
            status = await (post(*body) if isinstance(body, tuple) else post(body))
            assert status == 400
        await asyncio.sleep(0.1)
        assert len(asyncio.all_tasks()) <= before
