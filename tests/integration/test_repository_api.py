"""The repository extension against a real server: the index's ``ready`` filter, a load's Triton model config
(tritonclient's ``load_model(config=...)``) applied to the served model with requests in flight, and every
malformed or wrongly typed body answered 400 with a JSON error (raw aiohttp bodies)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import orjson
import pytest
import tritonclient.http as http
from helpers import infer_kwargs, queued, until
from tritonclient.utils import InferenceServerException

MID = {"name": "mid_cnn", "path": "zoo:mid_cnn", "intra_op_threads": 1, "max_batch_size": 8}


def _binary(rows: int) -> dict:
    return infer_kwargs(np.ones((rows, 3, 224, 224), np.float32))


async def _post(s: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, dict | list]:
    async with s.post(url, data=body) as r:
        return r.status, await r.json()


async def test_index_filters_on_ready_and_bad_bodies_are_400(start_server):
    server = start_server({"server": {"load_strategy": "lazy", "repository_api": True},
                           "models": [{"name": "tiny_cnn", "path": "zoo:tiny_cnn"}, {**MID}]})
    index = f"{server.base}/v2/repository/index"
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{server.base}/v2/models/tiny_cnn/infer", **_binary(1)) as r:
            assert r.status == 200  # tiny_cnn loaded, mid_cnn not
        names = {}
        for body in (b"", b"{}", b'{"ready": true}', b'{"ready": false}', b'{"ready": null}'):
            status, listed = await _post(s, index, body)
            assert status == 200, listed
            names[body] = [(e["name"], e["state"]) for e in listed]
        both = [("tiny_cnn", "READY"), ("mid_cnn", "UNAVAILABLE")]
        assert names == {b"": both, b"{}": both, b'{"ready": true}': both[:1], b'{"ready": false}': both[1:],
                         b'{"ready": null}': both}
        for body, fragment in ((b'{"ready": "yes"}', "ready: expected true or false, got 'yes'"),
                               (b'{"ready": 1}', "ready: expected true or false, got 1"),
                               (b"{", "the body is not valid JSON"), (b"[true]", "the body: expected a JSON object, got array"),
                               (b'{"parameters": 3}', "parameters: expected an object, got number")):
            status, error = await _post(s, index, body)
            assert status == 400 and fragment in error["error"], (body, error)
    client = http.InferenceServerClient(server.url)
    assert [m["name"] for m in client.get_model_repository_index()] == ["tiny_cnn", "mid_cnn"]


async def test_bad_load_and_unload_bodies_are_400_and_change_nothing(start_server):
    server = start_server({"server": {"repository_api": True}, "models": [{**MID}]})
    client = http.InferenceServerClient(server.url)
    before = client.get_model_config("mid_cnn")
    load = f"{server.base}/v2/repository/models/mid_cnn/load"
    cases = [
        (b"not json", "load: the body is not valid JSON"),
        (b'{"parameters": []}', "load: parameters: expected an object, got array"),
        (orjson.dumps({"parameters": {"config": {"max_batch_size": 4}}}),
         "parameters.config: expected a string holding the model-config JSON, got object"),
        (orjson.dumps({"parameters": {"config": "{"}}), "parameters.config is not valid JSON"),
        (orjson.dumps({"parameters": {"config": "[4]"}}), "parameters.config: expected a JSON object, got array"),
        (orjson.dumps({"parameters": {"file:1/model.onnx": "AAAA"}}), "does not take model files"),
        (orjson.dumps({"parameters": {"config": "{}", "colour": "red"}}), "parameters.colour: unknown parameter"),
        (orjson.dumps({"parameters": {"config": json.dumps({"max_batch_size": "four"})}}),
         "parameters.config.max_batch_size: expected an integer, got 'four'"),
        (orjson.dumps({"parameters": {"config": json.dumps({"optimization": {"priority": "PRIORITY_MAX"},
                                                             "model_warmup": [{"name": "w"}]})}}),
         "fields this server does not support: optimization, model_warmup"),
    ]
    async with aiohttp.ClientSession() as s:
        for body, fragment in cases:
            status, error = await _post(s, load, body)
            assert status == 400 and fragment in error["error"], (body, error)
        status, error = await _post(s, f"{server.base}/v2/repository/models/mid_cnn/unload",
                                    orjson.dumps({"parameters": {"unload_dependents": "no"}}))
        assert status == 400 and "unload_dependents: expected true or false, got 'no'" in error["error"]
    assert client.get_model_config("mid_cnn") == before
    assert server.metric("batcher_model_load_total", model="mid_cnn", version="1") == 1  # never reloaded
    with pytest.raises(InferenceServerException, match="instance_group.0.kind: Input should be") as exc:
        client.load_model("mid_cnn", config=json.dumps({"instance_group": [{"count": 1, "kind": "KIND_AUTO"}]}))
    assert exc.value.status() == "400"
    client.unload_model("mid_cnn", unload_dependents=False)  # tritonclient's own body is accepted
    assert "Traceback" not in server.log() and " ERROR " not in server.log()


async def test_a_load_with_a_triton_config_applies_it_without_dropping_requests_in_flight(start_server):
    server = start_server({"server": {"repository_api": True}, "models": [{**MID}]})
    client = http.InferenceServerClient(server.url)
    labels = {"model": "mid_cnn", "version": "1"}
    config = client.get_model_config("mid_cnn")
    client.load_model("mid_cnn", config=json.dumps(config))  # the server's own config back: nothing changes
    assert client.get_model_config("mid_cnn") == config
    assert server.metric("batcher_model_load_total", **labels) == 1
    async with aiohttp.ClientSession() as s:

        async def infer(rows):
            async with s.post(f"{server.base}/v2/models/mid_cnn/infer", **_binary(rows)) as r:
                await r.read()
                return r.status

        # 4 batches of 8 rows queue up (~2 s of work on one thread), then the reload comes
        in_flight = [asyncio.create_task(infer(8)) for _ in range(4)]
        await until(lambda: queued(server, "mid_cnn") == 3)
        new = {**config, "max_batch_size": 4, "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
               "dynamic_batching": {**config["dynamic_batching"], "max_queue_delay_microseconds": 20_000,
                                    "default_queue_policy": {"max_queue_size": 7}},
               "parameters": {"intra_op_thread_count": {"string_value": "2"}}}
        # tritonclient's http client runs on gevent: one client per thread
        await asyncio.to_thread(lambda: http.InferenceServerClient(server.url).load_model(
            "mid_cnn", config=json.dumps(new)))
        after = [asyncio.create_task(infer(4)) for _ in range(2)]  # on the new load
        assert await asyncio.gather(*in_flight, *after) == [200] * 6  # none dropped by the reload
        assert await infer(5) == 400  # more than the new max_batch_size 4
    got = client.get_model_config("mid_cnn")
    assert got["max_batch_size"] == 4
    assert [(g["count"], g["kind"]) for g in got["instance_group"]] == [(2, "KIND_CPU")]
    assert got["dynamic_batching"]["max_queue_delay_microseconds"] == 20_000
    assert got["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 7
    assert got["dynamic_batching"]["default_queue_policy"]["default_timeout_microseconds"] == \
        config["dynamic_batching"]["default_queue_policy"]["default_timeout_microseconds"]  # not given: kept
    assert got["parameters"] == {"intra_op_thread_count": {"string_value": "2"}}
    assert server.metric("batcher_model_load_total", **labels) == 2
    assert server.metric("batcher_request_success_total", **labels) == 6
    assert server.metric("batcher_request_failure_total", reason="invalid", **labels) == 1
    index = {e["name"]: e for e in client.get_model_repository_index()}
    assert index["mid_cnn"]["state"] == "READY"


async def test_the_config_of_a_weighted_model_with_versions_loads_back_and_triton_groups_reset_the_weight(
        start_server):
    """GET config -> load with it -> GET config is identical for the model and each version (instance group weights
    and a version policy included; before, ``weight`` was refused with 400 and version 2's config showed the policy
    ``all`` while the model's showed ``latest: 2``), and nothing reloads. A Triton config's instance groups (no
    ``weight``) replace the model's: its groups then have weight 1, and GET shows it."""
    tiny = [{"name": "tiny_cnn", "path": "zoo:tiny_cnn", "version": v, "max_batch_size": 4,
             "instance_group": [{"count": 1, "weight": 3}, {"count": 1, "weight": 0}]} for v in (1, 2, 3)]
    tiny[-1]["version_policy"] = {"latest": 2}
    server = start_server({"server": {"repository_api": True}, "routing": {"strategy": "weighted"}, "models": tiny})
    client = http.InferenceServerClient(server.url)
    model = client.get_model_config("tiny_cnn")
    assert (model["version_policy"], model["instance_group"]) == (
        {"latest": {"num_versions": 2}},
        [{"name": "tiny_cnn_0", "count": 1, "kind": "KIND_CPU", "weight": 3},
         {"name": "tiny_cnn_1", "count": 1, "kind": "KIND_CPU", "weight": 0}])
    versions = {v: client.get_model_config("tiny_cnn", v) for v in ("2", "3")}
    assert versions == {"2": model, "3": model}
    client.load_model("tiny_cnn", config=json.dumps(model))
    assert client.get_model_config("tiny_cnn") == model
    assert {v: client.get_model_config("tiny_cnn", v) for v in ("2", "3")} == versions
    loads = {v: server.metric("batcher_model_load_total", model="tiny_cnn", version=v) for v in ("2", "3")}
    assert loads == {"2": 1, "3": 1}  # the same config: nothing reloaded
    client.load_model("tiny_cnn", config=json.dumps({"instance_group": [{"count": 2, "kind": "KIND_CPU"}]}))
    assert client.get_model_config("tiny_cnn")["instance_group"] == [
        {"name": "tiny_cnn_0", "count": 2, "kind": "KIND_CPU", "weight": 1}]
    assert {v: server.metric("batcher_model_load_total", model="tiny_cnn", version=v) for v in ("2", "3")} == \
        {"2": 2, "3": 2}
    assert " ERROR " not in server.log() and "Traceback" not in server.log()
