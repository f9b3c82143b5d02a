"""Models without a batch dimension (Triton's ``max_batch_size: 0``) on a real server, with real ONNX models built
with onnx.helper: served with their full shapes, one request per execution, and described as Triton does."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import onnx
import pytest
import tritonclient.http as http
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

W = np.arange(8, dtype=np.float32).reshape(4, 2)  # small integers: float32 results are exact


def _matmul_model(path, first_dim: int | str) -> str:
    """``y = x @ W`` with x FP32 ``[first_dim, 4]`` (an int: fixed; a string: dynamic)."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [first_dim, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [first_dim, 2])],
        [numpy_helper.from_array(W, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


@pytest.fixture
def server(start_server, tmp_path):
    return start_server({"server": {"repository_api": True}, "models": [
        {"name": "fixed", "path": _matmul_model(tmp_path / "fixed.onnx", 3)},  # first dim fixed: no batch dim
        {"name": "whole", "path": _matmul_model(tmp_path / "whole.onnx", "n"), "max_batch_size": 0},
    ]})


def _infer(client, model: str, x: np.ndarray) -> np.ndarray:
    inp = http.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    return client.infer(model, [inp]).as_numpy("y")


def test_metadata_and_config_show_full_shapes_and_no_batching(server):
    client = http.InferenceServerClient(server.url)
    meta = client.get_model_metadata("fixed")
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [3, 4]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [3, 2]}]
    config = client.get_model_config("fixed")
    assert config["max_batch_size"] == 0 and "dynamic_batching" not in config
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [3, 4]}]
    assert config["output"] == [{"name": "y", "data_type": "TYPE_FP32", "dims": [3, 2]}]
    whole = client.get_model_config("whole")
    assert whole["max_batch_size"] == 0 and whole["input"][0]["dims"] == [-1, 4]
    assert client.get_model_metadata("whole")["inputs"][0]["shape"] == [-1, 4]


def test_requests_run_with_their_full_shape_one_per_execution(server):
    client = http.InferenceServerClient(server.url, concurrency=8)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(_infer(client, "fixed", x), x @ W)
    for bad in (x[None], x[:2]):  # a batch dim added, or another first dim: not the model's shape
        with pytest.raises(InferenceServerException, match=r"does not match the model's \[3, 4\]") as exc:
            _infer(client, "fixed", bad)
        assert exc.value.status() == "400"
    inputs = []
    for i in range(6):
        inp = http.InferInput("x", [3, 4], "FP32")
        inp.set_data_from_numpy(x + i, binary_data=True)
        inputs.append(inp)
    pending = [client.async_infer("fixed", [inp]) for inp in inputs]  # at once: they queue together
    for i, p in enumerate(pending):
        np.testing.assert_array_equal(p.get_result().as_numpy("y"), (x + i) @ W)
    labels = {"model": "fixed", "version": "1"}
    assert server.metric("batcher_execution_count_total", **labels) == 7  # never two requests in one execution
    assert server.metric("batcher_inference_count_total", **labels) == 7
    assert server.metric("batcher_batch_size_sum", **labels) == 7
    assert server.metric("batcher_request_failure_total", reason="invalid", **labels) == 2
    # max_batch_size 0 on a dynamic first dim: that dim is an ordinary one, each request its own size
    for n in (5, 2):
        x = np.arange(4 * n, dtype=np.float32).reshape(n, 4)
        np.testing.assert_array_equal(_infer(client, "whole", x), x @ W)


async def test_asking_a_fixed_first_dim_to_batch_fails_at_load_naming_the_fix(tmp_path, cache_dir):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"models:\n  - {{name: m, path: {_matmul_model(tmp_path / 'm.onnx', 3)}, max_batch_size: 4}}\n")
    r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "batcher", "check-config", "--load", str(cfg)],
                                capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert ("models[0].max_batch_size: 4, but the model's first dimension is fixed ([3, 4]): it has no batch "
            "dimension; set max_batch_size: 0") in r.stderr
