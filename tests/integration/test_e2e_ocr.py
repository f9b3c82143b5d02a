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
