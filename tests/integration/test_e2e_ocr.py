"""Acceptance 6: RapidOCR's own pipeline with det/cls/rec served by the real server over HTTP."""

from __future__ import annotations

import subprocess
import sys

import pytest
from rapidocr_onnxruntime import RapidOCR

import bench.ocr_e2e as e2e


@pytest.fixture(scope="module")
def samples():
    return e2e.render_samples(10)


@pytest.fixture(scope="module")
def in_process(samples):
    return e2e.run(RapidOCR(), [img for _, img in samples])


def test_remote_ocr_equals_in_process_and_reads_the_renders(default_server, samples, in_process):
    remote = e2e.run(e2e.make_remote_ocr(e2e.http_transport(default_server.url, binary=True)),
                     [img for _, img in samples])
    assert remote == in_process
    rendered = [text for text, _ in samples]
    assert sum(r.strip() == t.strip() for r, t in zip(remote, rendered)) >= 8, list(zip(rendered, remote))
    for model in ("ppocr_det", "ppocr_cls", "ppocr_rec"):
        assert default_server.metric("batcher_request_success_total", model=model, version="1") > 0, model


def test_ocr_example_command_against_the_server(default_server):
    """The runnable example, JSON tensors, 3 images: exits 0 and prints its summary line."""
    r = subprocess.run([sys.executable, "-m", "bench.ocr_e2e", "--url", default_server.url, "--json", "-n", "3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "remote==in-process: 3/3" in r.stdout


@pytest.mark.parametrize("height,width,status", [(720, 1280, 400), (736, 1280, 200)])
def test_the_detector_answers_a_size_it_cannot_run_with_400(default_server, height, width, status):
    """The user's report: ppocr_det of the default config failed with 500 on a 720p image (ONNX Runtime: its
    heights and widths must be multiples of 32); its dims_multiple_of now makes that a 400, counted invalid."""
    import numpy as np
    import orjson

    from bench.sweep.requests import build_request
    from helpers import http_post

    invalid = default_server.metric("batcher_request_failure_total", model="ppocr_det", version="1", reason="invalid")
    body, headers = build_request([("x", "FP32", np.zeros((1, 3, height, width), np.float32))], binary=True)
    got, data, _ = http_post(default_server, body, headers, path="/v2/models/ppocr_det/infer")
    assert got == status, data[:300]
    if status == 400:
        assert orjson.loads(data)["error"] == ("input 'x': shape [1, 3, 720, 1280]: the model's dims [3, -1, -1] must "
                                               "be multiples of [1, 32, 32] (its config's dims_multiple_of)")
    after = default_server.metric("batcher_request_failure_total", model="ppocr_det", version="1", reason="invalid")
    assert after - invalid == (status == 400)


@pytest.mark.parametrize("model,shape", [("ppocr_det", [1, 3, 0, 32]), ("ppocr_rec", [1, 3, 48, 0])])
def test_a_dimension_of_size_0_is_a_400_not_an_engine_failure(default_server, model, shape):
    """A fresh user's report: ONNX Runtime refused these ("Invalid input shape") and the server answered 500; an
    input with a dimension of size 0 is the request's fault: 400, counted invalid."""
    import orjson

    from helpers import http_post

    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": []}]})
    status, data, _ = http_post(default_server, body, {"Content-Type": "application/json"},
                                path=f"/v2/models/{model}/infer")
    assert status == 400, data
    error = orjson.loads(data)["error"]
    assert error.startswith(f"model '{model}' cannot run on this request's input: onnxruntime cannot run on an "
                            "input with a dimension of size 0: ") and "\n" not in error
