"""``batcher serve --model-repository DIR``: a real server on zoo models written into Triton's repository layout (what
KServe mounts at /mnt/models), started with the KServe runtime's own arguments (deploy/kserve), serves every model
and version in it, with each model's config.yaml applied."""

from __future__ import annotations

import shutil
import sys
import urllib.request
from pathlib import Path

import numpy as np
import orjson
import tritonclient.http as httpclient
import yaml

from bench.server import Subprocess, free_port
from engines.zoo import resolve
from helpers import reference

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "deploy" / "kserve" / "cluster-serving-runtime.yaml"


def _get(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=10) as r:
        return orjson.loads(r.read())


def test_serve_every_model_of_a_repository_layout(tmp_path, cache_dir):
    repo = tmp_path / "models"
    for model, zoo, versions in (("tiny_cnn", "tiny_cnn", (1, 2)), ("classifier", "ppocr_cls", (3,))):
        for v in versions:
            (repo / model / str(v)).mkdir(parents=True)
            shutil.copy(resolve(f"zoo:{zoo}"), repo / model / str(v) / "model.onnx")
    (repo / "tiny_cnn" / "config.yaml").write_text(yaml.safe_dump({
        "max_batch_size": 8, "intra_op_threads": 1,
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        "dynamic_batching": {"max_queue_delay_microseconds": 1000, "preferred_batch_size": [4],
                             "default_queue_policy": {"max_queue_size": 32,
                                                      "default_timeout_microseconds": 10_000_000}}}))
    (repo / "classifier" / "config.yaml").write_text(yaml.safe_dump({
        "max_batch_size": 16, "inputs": [{"name": "x", "dims": [3, 48, 192]}]}))

    # the KServe runtime's arguments, on 127.0.0.1 and a free port instead of 0.0.0.0:8080
    args = yaml.safe_load(RUNTIME.read_text())["spec"]["containers"][0]["args"]
    args = [str(repo) if a == "/mnt/models" else a for a in args]
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    cmd = [sys.executable, "-m", "batcher", "serve", "--host", "127.0.0.1", *args]
    with Subprocess(cmd, tmp_path, "repo-server", port) as server:
        index = {(m["name"], m["version"]) for m in _get(server.base, "/v2/models/stats")["model_stats"]}
        assert index == {("tiny_cnn", "1"), ("tiny_cnn", "2"), ("classifier", "3")}
        for name, version in index:
            assert _get(server.base, f"/v2/models/{name}/versions/{version}/ready")["ready"] is True
        # config.yaml applies to every version; the model file is the version directory's
        for v in ("1", "2"):
            config = _get(server.base, f"/v2/models/tiny_cnn/versions/{v}/config")
            assert config["max_batch_size"] == 8
            assert config["dynamic_batching"]["preferred_batch_size"] == [4]
        assert _get(server.base, "/v2/models/classifier")["inputs"][0]["shape"] == [-1, 3, 48, 192]

        client = httpclient.InferenceServerClient(server.url)
        rng = np.random.default_rng(0)
        for name, zoo, version, input_name, shape in (("tiny_cnn", "tiny_cnn", "1", "input", (2, 3, 224, 224)),
                                                      ("tiny_cnn", "tiny_cnn", "2", "input", (1, 3, 224, 224)),
                                                      ("classifier", "ppocr_cls", "3", "x", (3, 3, 48, 192))):
            x = rng.standard_normal(shape, dtype=np.float32)
            inp = httpclient.InferInput(input_name, list(shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            result = client.infer(name, [inp], model_version=version)
            out = result.as_numpy(result.get_response()["outputs"][0]["name"])
            np.testing.assert_allclose(out, reference(zoo, x), rtol=1e-4, atol=1e-4)
            assert result.get_response()["model_version"] == version
        client.close()
        assert server.stop() == 0  # SIGTERM: drained and exited cleanly
