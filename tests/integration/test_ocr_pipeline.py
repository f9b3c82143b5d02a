"""OCR pipeline plumbing (bench/ocr_e2e.py) without a server.

RapidOCR with its det/cls/rec sessions routed through ``local_transport()`` must give
exactly the texts of plain in-process RapidOCR. The HTTP end-to-end test against a
running server lives in tests/test_e2e_ocr.py.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

pytest.importorskip("rapidocr_onnxruntime")
pytest.importorskip("PIL")

import bench.ocr_e2e as e2e

from rapidocr_onnxruntime import RapidOCR

N = 10
MIN_RENDERED_MATCHES = 8


class RecordingTransport:
    """Forwards to another transport and records (model, input shape, dtype)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    def __call__(self, model_name, x):
        self.calls.append((model_name, tuple(x.shape), x.dtype))
        return self.inner(model_name, x)


class _RunForbidden:
    """Wraps an onnxruntime InferenceSession: metadata works, ``run`` fails the test."""

    def __init__(self, sess):
        self._sess = sess

    def run(self, *args, **kwargs):
        raise AssertionError("a model call bypassed the transport")

    def __getattr__(self, name):
        return getattr(self._sess, name)


@pytest.fixture(scope="module")
def samples():
    return e2e.render_samples(N)


@pytest.fixture(scope="module")
def plain_ocr():
    return RapidOCR()


@pytest.fixture(scope="module")
def inprocess_texts(plain_ocr, samples):
    return e2e.run(plain_ocr, [img for _, img in samples])


@pytest.fixture(scope="module")
def routed(samples):
    """Remote-wrapped RapidOCR over a recording local transport.

    The original sessions' onnxruntime ``run`` is disabled, so every model call has to
    go through the transport for the texts to come out at all.
    """
    recorder = RecordingTransport(e2e.local_transport())
    ocr = e2e.RemoteRapidOCR(recorder)
    for wrapped in (ocr.text_det.infer, ocr.text_cls.infer, ocr.text_rec.session):
        wrapped.original.session = _RunForbidden(wrapped.original.session)
    texts = e2e.run(ocr, [img for _, img in samples])
    return ocr, recorder, texts


def test_render_samples_deterministic(samples):
    assert len(samples) >= 10
    again = e2e.render_samples(N)
    assert [p for p, _ in again] == [p for p, _ in samples]
    for (phrase, img), (_, img2) in zip(samples, again):
        assert isinstance(phrase, str) and phrase.strip() == phrase and " " in phrase
        assert phrase.isascii()
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
        assert img.flags["C_CONTIGUOUS"]
        assert np.array_equal(img, img2)
        assert (img[0, 0] == 255).all() and (img[-1, -1] == 255).all()  # white margin
        assert img.min() < 64  # black text
    assert len({p for p, _ in samples}) == len(samples)  # distinct phrases
    shuffled = [p for p, _ in e2e.render_samples(N, seed=1)]
    assert shuffled == [p for p, _ in e2e.render_samples(N, seed=1)]
    assert shuffled != [p for p, _ in samples]  # a seed changes the order


def test_remote_wrapped_equals_inprocess(samples, inprocess_texts, routed):
    _, _, remote_texts = routed
    assert remote_texts == inprocess_texts


def test_rendered_phrases_read_back(samples, inprocess_texts, routed):
    phrases = [p for p, _ in samples]
    _, _, remote_texts = routed
    local_hits = sum(t.strip() == p for t, p in zip(inprocess_texts, phrases))
    remote_hits = sum(t.strip() == p for t, p in zip(remote_texts, phrases))
    assert local_hits >= MIN_RENDERED_MATCHES, list(zip(phrases, inprocess_texts))
    assert remote_hits >= MIN_RENDERED_MATCHES, list(zip(phrases, remote_texts))


def test_every_model_call_goes_through_transport(samples, routed):
    ocr, recorder, _ = routed
    for wrapped in (ocr.text_det.infer, ocr.text_cls.infer, ocr.text_rec.session):
        assert isinstance(wrapped, e2e.RemoteSession)
    per_model = Counter(model for model, _, _ in recorder.calls)
    assert set(per_model) == {e2e.DET_MODEL, e2e.CLS_MODEL, e2e.REC_MODEL}
    assert per_model[e2e.DET_MODEL] == len(samples)  # one det call per image
    for model, shape, dtype in recorder.calls:
        assert dtype == np.float32
        assert len(shape) == 4 and shape[1] == 3
        if model == e2e.DET_MODEL:
            assert shape[0] == 1 and shape[2] % 32 == 0 and shape[3] % 32 == 0
        elif model == e2e.CLS_MODEL:
            assert shape[2:] == (48, 192)
        else:
            assert shape[2] == 48


def test_metadata_delegated_to_original_session(plain_ocr, routed):
    ocr, _, _ = routed
    rec = ocr.text_rec.session
    assert rec.have_key()
    assert rec.get_character_list() == plain_ocr.text_rec.session.get_character_list()
    assert rec.get_input_names() == ["x"]
    assert ocr.text_rec.postprocess_op.character == plain_ocr.text_rec.postprocess_op.character


def test_local_transport_outputs():
    transport = e2e.local_transport()
    out = transport(e2e.CLS_MODEL, np.zeros((2, 3, 48, 192), np.float32))
    assert out.shape == (2, 2) and out.dtype == np.float32
    with pytest.raises(KeyError):
        transport("no_such_model", np.zeros((1, 3, 48, 192), np.float32))


class _FakeResult:
    def __init__(self, name, arr):
        self._name, self._arr = name, arr

    def as_numpy(self, name):
        return self._arr if name == self._name else None


class _FakeClient:
    def __init__(self):
        self.metadata_calls = 0
        self.requests = []

    def get_model_metadata(self, model_name):
        self.metadata_calls += 1
        return {
            "name": model_name,
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3, -1, -1]}],
            "outputs": [{"name": "out_" + model_name, "datatype": "FP32", "shape": [-1, 2]}],
        }

    def infer(self, model_name, inputs, outputs=None):
        self.requests.append((model_name, inputs, outputs))
        n = inputs[0].shape()[0]
        return _FakeResult(outputs[0].name(), np.full((n, 2), 0.5, np.float32))


@pytest.mark.parametrize("binary", [True, False])
def test_http_transport_request_shape(binary):
    pytest.importorskip("tritonclient.http")
    transport = e2e.http_transport("127.0.0.1:1", binary=binary)  # never connects
    fake = _FakeClient()
    transport.client = fake
    x = np.zeros((3, 3, 48, 192), np.float32)
    for _ in range(2):
        assert transport(e2e.CLS_MODEL, x).shape == (3, 2)
    assert fake.metadata_calls == 1  # output name cached
    model, inputs, outputs = fake.requests[-1]
    assert model == e2e.CLS_MODEL
    assert [i.name() for i in inputs] == ["x"]
    assert inputs[0].datatype() == "FP32" and list(inputs[0].shape()) == [3, 3, 48, 192]
    assert [o.name() for o in outputs] == ["out_" + e2e.CLS_MODEL]
    in_params = inputs[0]._get_tensor().get("parameters", {})
    out_params = outputs[0]._get_tensor().get("parameters", {})
    assert ("binary_data_size" in in_params) is binary
    assert out_params.get("binary_data", False) is binary


def test_cli_local(capsys):
    assert e2e.main(["--local", "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "remote==in-process: 2/2, remote==rendered (stripped): 2/2" in out
