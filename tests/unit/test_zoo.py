"""Tests for :mod:`engines.zoo` (the built-in ``zoo:`` models)."""

from __future__ import annotations

import importlib.util
import pathlib
import threading

import numpy as np
import pytest

import onnx
import onnxruntime as ort

from engines import zoo  # noqa: E402

EXPECTED_PARAMS = {"tiny_cnn": 90_000, "mid_cnn": 4_570_000, "resnet18": 11_689_512}


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHER_CACHE_DIR", str(tmp_path / "zoo-cache"))


@pytest.fixture(scope="module")
def seed_models() -> dict:
    return {name: zoo.build_seed_model(name) for name in zoo.SEED_NAMES}


def _session(model_bytes_or_path) -> "ort.InferenceSession":
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.inter_op_num_threads = 1
    return ort.InferenceSession(model_bytes_or_path, so, providers=["CPUExecutionProvider"])


def test_names_contract():
    assert zoo.ZOO_NAMES == ("ppocr_det", "ppocr_cls", "ppocr_rec", "tiny_cnn", "mid_cnn", "resnet18")
    assert set(zoo.SEED_NAMES) | set(zoo.PPOCR_FILES) == set(zoo.ZOO_NAMES)
    assert issubclass(zoo.ZooError, ValueError)


@pytest.mark.parametrize("name", zoo.SEED_NAMES)
def test_parameter_count(seed_models, name):
    n = zoo.count_parameters(seed_models[name])
    if name == "resnet18":
        assert n == EXPECTED_PARAMS[name]
    else:
        assert abs(n - EXPECTED_PARAMS[name]) <= 0.05 * EXPECTED_PARAMS[name], n


@pytest.mark.parametrize("name", zoo.SEED_NAMES)
def test_graph_contract(seed_models, name):
    m = seed_models[name]
    onnx.checker.check_model(m)
    assert [o.version for o in m.opset_import if o.domain in ("", "ai.onnx")] == [17]
    (inp,) = m.graph.input
    (out,) = m.graph.output
    assert inp.name == "input" and out.name == "logits"
    assert inp.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    in_dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    out_dims = [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim]
    assert in_dims == ["batch", 3, 224, 224]
    assert out_dims == ["batch", 1000]
    assert m.doc_string  # layer list travels with the model


def test_first_conv_is_128_channels_stride_2(seed_models):
    for name in ("tiny_cnn", "mid_cnn"):
        m = seed_models[name]
        first = m.graph.node[0]
        assert first.op_type == "Conv"
        w = next(i for i in m.graph.initializer if i.name == first.input[1])
        assert list(w.dims) == [128, 3, 3, 3]
        strides = next(a.ints for a in first.attribute if a.name == "strides")
        assert list(strides) == [2, 2]


def test_resnet18_keeps_batchnorm(seed_models):
    ops = [n.op_type for n in seed_models["resnet18"].graph.node]
    assert ops.count("BatchNormalization") == 20  # stem + 8 blocks x 2 + 3 downsamples
    assert ops.count("Conv") == 20


@pytest.mark.parametrize("name", zoo.SEED_NAMES)
def test_deterministic(seed_models, name):
    assert zoo.build_seed_model(name).SerializeToString() == seed_models[name].SerializeToString()


@pytest.mark.parametrize("name", zoo.SEED_NAMES)
def test_runs_and_batched_equals_single(name):
    path = zoo.resolve(f"zoo:{name}")
    sess = _session(str(path))
    x = np.random.default_rng(7).standard_normal((3, 3, 224, 224)).astype(np.float32)

    single = [sess.run(["logits"], {"input": x[i : i + 1]})[0] for i in range(3)]
    for y in single:
        assert y.shape == (1, 1000) and y.dtype == np.float32
        assert np.isfinite(y).all()
    batched = sess.run(["logits"], {"input": x})[0]
    assert batched.shape == (3, 1000) and batched.dtype == np.float32
    assert np.isfinite(batched).all()
    # numerically tame: logits of order 1-10, neither exploding nor vanishing
    scale = float(np.abs(batched).mean())
    assert 0.05 < scale < 100, scale
    np.testing.assert_allclose(batched, np.concatenate(single), rtol=0, atol=1e-4)


def test_resolve_caches_atomically(seed_models, tmp_path):
    p1 = zoo.resolve("zoo:tiny_cnn")
    assert p1 == tmp_path / "zoo-cache" / f"tiny_cnn-v{zoo.GENERATOR_VERSION}.onnx"
    assert p1.read_bytes() == seed_models["tiny_cnn"].SerializeToString()
    mtime = p1.stat().st_mtime_ns
    assert zoo.resolve("zoo:tiny_cnn") == p1
    assert p1.stat().st_mtime_ns == mtime  # second call reuses the cached file
    assert sorted(f.name for f in p1.parent.iterdir()) == [p1.name]  # no temp files left


def test_resolve_concurrent_threads(seed_models):
    results, errors = [], []

    def work():
        try:
            results.append(zoo.resolve("zoo:tiny_cnn"))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    (p,) = set(results)
    assert p.read_bytes() == seed_models["tiny_cnn"].SerializeToString()
    assert [f.name for f in p.parent.iterdir()] == [p.name]


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHER_CACHE_DIR", str(tmp_path / "x"))
    assert zoo.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("BATCHER_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert zoo.cache_dir() == tmp_path / "home" / ".cache" / "trt-batcher" / "zoo"


needs_rapidocr = pytest.mark.skipif(
    importlib.util.find_spec("rapidocr_onnxruntime") is None, reason="rapidocr-onnxruntime not installed"
)


@needs_rapidocr
def test_resolve_ppocr():
    for name in ("ppocr_det", "ppocr_cls", "ppocr_rec"):
        p = zoo.resolve(f"zoo:{name}")
        assert p.is_file() and p.suffix == ".onnx"
    m = onnx.load(str(zoo.resolve("zoo:ppocr_rec")), load_external_data=False)
    assert [i.name for i in m.graph.input] == ["x"]


def test_ppocr_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        zoo.importlib.util, "find_spec", lambda n, *a, **k: None if n == "rapidocr_onnxruntime" else real(n, *a, **k)
    )
    with pytest.raises(zoo.ZooError, match=r"pip install rapidocr-onnxruntime==1\.4\.4"):
        zoo.resolve("zoo:ppocr_det")


def test_unknown_name():
    with pytest.raises(zoo.ZooError) as info:
        zoo.resolve("zoo:nope")
    msg = str(info.value)
    assert "nope" in msg
    for name in zoo.ZOO_NAMES:
        assert name in msg
    with pytest.raises(ValueError):
        zoo.resolve("zoo:")
    with pytest.raises(zoo.ZooError):
        zoo.build_seed_model("nope")
    with pytest.raises(zoo.ZooError):
        zoo.build_seed_model("ppocr_det")


def test_non_zoo_path_passes_through(tmp_path):
    assert not zoo.is_zoo_path("/models/a.onnx")
    assert zoo.is_zoo_path("zoo:resnet18")
    assert zoo.resolve("/does/not/exist.onnx") == pathlib.Path("/does/not/exist.onnx")
    assert zoo.resolve("relative/model.plan") == pathlib.Path("relative/model.plan")
    assert not (tmp_path / "zoo-cache").exists()  # nothing generated for plain paths


def test_count_parameters_skips_bn_buffers():
    from onnx import TensorProto, helper, numpy_helper

    c = 4
    inits = [
        numpy_helper.from_array(np.ones(c, np.float32), n) for n in ("scale", "bias", "mean", "var")
    ] + [numpy_helper.from_array(np.array([1, -1], np.int64), "shape")]
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c])],
        initializer=inits,
    )
    assert zoo.count_parameters(helper.make_model(graph)) == 2 * c
