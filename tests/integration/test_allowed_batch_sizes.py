"""Allowed batch sizes on CPU through the real server (issue 9): every zoo model served twice, as ``<zoo>`` (no
padding, the CPU default) and as ``<zoo>_padded`` (``allowed_batch_sizes: [1, 2, 4, 8]``); real tritonclient
requests, real /metrics and statistics.

* padding gives exactly the unpadded outputs (bit for bit) for every zoo model;
* the padded-rows metric moves by exactly the rows padded;
* under concurrent load no batch exceeds the largest allowed size, and the padded rows are exactly what the
  executed batch sizes imply.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient

from bench.server import ServerProcess
from batcher.batch_sizes import padded_size

ALLOWED = [1, 2, 4, 8]

MODELS = {
    # zoo model: (input name, non-batch dims of a request, declared inputs as in configs/default.yaml)
    "ppocr_det": ("x", (3, 64, 96), [{"name": "x", "dims": [3, -1, -1], "warmup_dims": [3, 64, 96]}]),
    "ppocr_cls": ("x", (3, 48, 192), [{"name": "x", "dims": [3, 48, 192]}]),
    "ppocr_rec": ("x", (3, 48, 160), [{"name": "x", "dims": [3, 48, -1], "warmup_dims": [3, 48, 160]}]),
    "tiny_cnn": ("input", (3, 224, 224), []),
    "mid_cnn": ("input", (3, 224, 224), []),
    "resnet18": ("input", (3, 224, 224), []),
}


def _entry(name: str, zoo: str, inputs: list[dict], **extra) -> dict:
    return {"name": name, "path": f"zoo:{zoo}", "inputs": inputs, "max_batch_size": 8, "intra_op_threads": 1,
            "dynamic_batching": {"max_queue_delay_microseconds": 0}, **extra}


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache_dir):
    models = []
    for zoo, (_, _, inputs) in MODELS.items():
        models.append(_entry(zoo, zoo, inputs))
        models.append(_entry(f"{zoo}_padded", zoo, inputs, allowed_batch_sizes=ALLOWED))
    with ServerProcess({"models": models}, tmp_path_factory.mktemp("allowed")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.url, concurrency=32, network_timeout=120)
    yield c
    c.close()


def _request(model: str, x: np.ndarray):
    zoo = model.removesuffix("_padded")
    inp = httpclient.InferInput(MODELS[zoo][0], list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    return [inp]


def _infer(client, model: str, x: np.ndarray) -> np.ndarray:
    result = client.infer(model, _request(model, x))
    return result.as_numpy(result.get_response()["outputs"][0]["name"])


def _padded(server, model: str) -> float:
    return server.metric("batcher_padded_rows_total", model=model, version="1")


@pytest.mark.parametrize("zoo", list(MODELS))
def test_padding_gives_exactly_the_unpadded_outputs(server, client, zoo):
    x = np.random.default_rng(9).standard_normal((5, *MODELS[zoo][1]), dtype=np.float32)
    before = _padded(server, f"{zoo}_padded"), _padded(server, zoo)
    plain = _infer(client, zoo, x)
    padded = _infer(client, f"{zoo}_padded", x)  # 5 rows run as 8: three zero rows added, their outputs dropped
    assert padded.shape == plain.shape and plain.shape[0] == 5
    np.testing.assert_array_equal(padded, plain)
    assert (_padded(server, f"{zoo}_padded") - before[0], _padded(server, zoo) - before[1]) == (3, 0)


def test_config_and_metadata_show_the_allowed_sizes(client):
    assert client.get_model_config("tiny_cnn_padded")["allowed_batch_sizes"] == ALLOWED
    cfg = client.get_model_config("tiny_cnn")
    assert cfg["allowed_batch_sizes"] is None and cfg["max_batch_size"] == 8  # Triton's fields as before
    padded, plain = (client.get_model_metadata(m)["parameters"] for m in ("tiny_cnn_padded", "tiny_cnn"))
    assert padded["allowed_batch_sizes"] == ALLOWED and plain["allowed_batch_sizes"] is None
    assert len(padded["contexts"]) == len(plain["contexts"]) == 1  # one description per execution context


def test_the_padded_rows_metric_counts_exactly_what_was_padded(server, client):
    model = "tiny_cnn_padded"
    labels = {"model": model, "version": "1"}
    before = [_padded(server, model), server.metric("batcher_execution_count_total", **labels),
              server.metric("batcher_inference_count_total", **labels)]
    sizes = [1, 3, 5, 8, 2, 7, 6]
    rng = np.random.default_rng(1)
    for n in sizes:  # one at a time: each request is a batch of its own
        assert _infer(client, model, rng.random((n, 3, 224, 224), dtype=np.float32)).shape == (n, 1000)
    after = [_padded(server, model), server.metric("batcher_execution_count_total", **labels),
             server.metric("batcher_inference_count_total", **labels)]
    assert [a - b for a, b in zip(after, before)] == [0 + 1 + 3 + 0 + 0 + 1 + 2, len(sizes), sum(sizes)]


def _batch_counts(client, model: str) -> dict[int, int]:
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}


def test_under_concurrent_load_no_batch_exceeds_the_largest_allowed_size(server, client):
    model = "mid_cnn_padded"
    before, padded0 = _batch_counts(client, model), _padded(server, model)
    rng = np.random.default_rng(2)
    sizes = [1, 2, 3, 1, 4, 2, 1, 3, 2, 1, 4, 3, 2, 1, 1, 2]
    xs = [rng.random((n, 3, 224, 224), dtype=np.float32) for n in sizes]
    pending = [client.async_infer(model, _request(model, x)) for x in xs]
    outs = [p.get_result(timeout=120).as_numpy("logits") for p in pending]
    assert [o.shape for o in outs] == [(n, 1000) for n in sizes]
    after = _batch_counts(client, model)
    ran = {size: after[size] - before.get(size, 0) for size in after if after[size] != before.get(size, 0)}
    assert sum(size * count for size, count in ran.items()) == sum(sizes)  # every row ran once
    assert max(ran) <= ALLOWED[-1] and sum(ran.values()) < len(sizes)  # batched, never beyond 8 rows
    assert _padded(server, model) - padded0 == sum((padded_size(s, ALLOWED) - s) * c for s, c in ran.items())
    for x, out in zip(xs, outs):  # each request got its own rows (padding rows and neighbours excluded)
        np.testing.assert_allclose(out, _infer(client, "mid_cnn", x), rtol=0, atol=1e-5)
