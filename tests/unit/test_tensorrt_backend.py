"""The TensorRT backend end to end on the stand-in hardware (tests/fake_tensorrt.py), its pure helpers, and the
pure parts of the plan builder (engines/trt_build) including its CLI without TensorRT."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import engines.tensorrt as backend
import engines.trt_build as tb
from engines.base import EngineError, TensorSpec
from engines.cuda import CudaError, Graph, use_runtime
from engines.tensorrt import TensorRTEngine, TensorRTError
from engines.tensorrt import api as trt_api
from fake_tensorrt import FakeTensorRT, make_plan

ROOT = Path(__file__).resolve().parents[2]

IMAGE = [1, 3, 4, 4]


def image_spec(profiles=(((1, 3, 4, 4), (8, 3, 4, 4), (16, 3, 4, 4)),), activation=None, **extra):
    spec = {
        "inputs": [{"name": "x", "dtype": "FLOAT", "shape": [-1, 3, -1, 4], "profiles": [list(map(list, p)) for p in profiles]}],
        "outputs": [{"name": "y", "dtype": "FLOAT", "shape": [-1, 5]}],
        "activation_bytes": activation or [100_000 * (i + 1) for i in range(len(profiles))],
        "weights_bytes": 12_345,
    }
    spec.update(extra)
    return spec


def expected(*inputs: np.ndarray, per_row: int = 5, dtype=np.float32) -> np.ndarray:
    total = sum(x.reshape(x.shape[0], -1).astype(np.float64).sum(axis=1) for x in inputs)
    return (2 * total[:, None] + np.arange(per_row)[None, :]).astype(dtype)


@pytest.fixture
def fake(monkeypatch):
    f = FakeTensorRT()
    monkeypatch.setattr(trt_api, "_trt", f.trt)
    with use_runtime(f.cudart):
        yield f


@pytest.fixture
def load(fake, tmp_path):
    def _load(spec=None, **kwargs):
        path = tmp_path / "model.plan"
        path.write_bytes(make_plan(spec or image_spec()))
        return TensorRTEngine(path, **kwargs)

    return _load


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# =========================================================================== pure helpers


def test_buffer_nbytes():
    assert backend.buffer_nbytes((16, 3, 224, 224), np.float32) == 16 * 3 * 224 * 224 * 4
    assert backend.buffer_nbytes((32, 1000), "float16") == 64_000
    assert backend.buffer_nbytes((), np.int64) == 8
    assert backend.buffer_nbytes((0, 5), np.float32) == 0
    with pytest.raises(EngineError, match="unresolved"):
        backend.buffer_nbytes((-1, 3), np.float32)


def test_slice_rows_copies():
    arr = np.arange(12).reshape(4, 3)
    out = backend.slice_rows(arr, 2)
    assert out.tolist() == [[0, 1, 2], [3, 4, 5]]
    out[0, 0] = 99
    assert arr[0, 0] == 0  # an owned copy, never a view of the staging buffer
    with pytest.raises(EngineError, match="fewer than 5 rows"):
        backend.slice_rows(arr, 5)


def test_max_batch_from_profiles_is_smallest_profile_max():
    p = ((1, 3), (4, 3), (16, 3))
    q = ((2, 3), (4, 3), (8, 3))
    assert backend.max_batch_from_profiles({"x": [p]}) == 16
    assert backend.max_batch_from_profiles({"x": [p, q]}) == 8  # every context, whatever its profile
    assert backend.max_batch_from_profiles({"x": [p], "z": [((1,), (2,), (4,))]}) == 4
    with pytest.raises(EngineError, match="no inputs"):
        backend.max_batch_from_profiles({})
    with pytest.raises(EngineError, match="scalar"):
        backend.max_batch_from_profiles({"s": [((), (), ())]})


def test_check_profile_shape_names_tensor_shape_and_bounds():
    backend.check_profile_shape("x", (4, 3, 8), 0, (1, 3, 8), (16, 3, 8))
    with pytest.raises(EngineError) as err:
        backend.check_profile_shape("x", (4, 3, 9), 1, (1, 3, 8), (16, 3, 8))
    msg = str(err.value)
    assert "'x'" in msg and "[4, 3, 9]" in msg and "profile 1" in msg and "min [1, 3, 8]" in msg and "max [16, 3, 8]" in msg
    with pytest.raises(EngineError, match="outside"):
        backend.check_profile_shape("x", (4, 3), 0, (1, 3, 8), (16, 3, 8))  # rank


def test_launch_rows_pads_to_profile_minimum():
    assert backend.launch_rows(3, 1, 16) == 3
    assert backend.launch_rows(1, 4, 16) == 4
    with pytest.raises(EngineError, match="exceeds .* maximum batch 16"):
        backend.launch_rows(17, 1, 16)
    with pytest.raises(EngineError, match="at least 1"):
        backend.launch_rows(0, 1, 16)


def test_pick_profile_round_robin_then_least_used():
    assert [backend.pick_profile([0, 1, 2][:k], 2) for k in range(3)] == [0, 1, 0]
    assert backend.pick_profile([0, 0], 2) == 1  # profile 1 was freed
    assert backend.pick_profile([], 1) == 0
    with pytest.raises(EngineError):
        backend.pick_profile([], 0)


def test_kserve_datatypes():
    assert backend.kserve_datatype("FLOAT", "t") == "FP32"
    assert backend.kserve_datatype("HALF", "t") == "FP16"
    with pytest.raises(EngineError, match="'t' is BF16.*not a KServe"):
        backend.kserve_datatype("BF16", "t")
    with pytest.raises(EngineError, match="FP8"):
        backend.kserve_datatype("FP8", "t")


# =========================================================================== engine


def test_engine_specs_and_max_batch(load):
    eng = load()
    assert eng.backend == "tensorrt"
    assert eng.inputs == (TensorSpec("x", "FP32", (-1, 3, -1, 4)),)
    assert eng.outputs == (TensorSpec("y", "FP32", (-1, 5)),)
    assert eng.max_batch_size == 16
    assert eng.profile_shapes("x") == [((1, 3, 4, 4), (8, 3, 4, 4), (16, 3, 4, 4))]
    assert eng.nbytes == len(make_plan(image_spec()))
    assert eng.memory_report() == {
        "plan_bytes": eng.nbytes, "weights_bytes": 12_345, "context_bytes": 100_000, "profile_bytes": [100_000],
    }
    eng.release()


def test_engine_datatype_mapping(load):
    spec = {
        "inputs": [
            {"name": "a", "dtype": "HALF", "shape": [-1, 2], "profiles": [[[1, 2], [2, 2], [4, 2]]]},
            {"name": "b", "dtype": "INT32", "shape": [-1, 2], "profiles": [[[1, 2], [2, 2], [4, 2]]]},
        ],
        "outputs": [
            {"name": "o1", "dtype": "INT64", "shape": [-1, 3]},
            {"name": "o2", "dtype": "BOOL", "shape": [-1, 3]},
            {"name": "o3", "dtype": "UINT8", "shape": [-1, 3]},
            {"name": "o4", "dtype": "INT8", "shape": [-1, 3]},
        ],
    }
    eng = load(spec)
    assert [s.datatype for s in eng.inputs] == ["FP16", "INT32"]
    assert [s.datatype for s in eng.outputs] == ["INT64", "BOOL", "UINT8", "INT8"]
    ctx = eng.create_context()
    a = np.array([[1, 2], [3, 4]], np.float16)
    b = np.array([[10, 20], [30, 40]], np.int32)
    out = ctx.execute({"a": a, "b": b})
    assert out["o1"].dtype == np.int64 and out["o1"].tolist() == [[66, 67, 68], [154, 155, 156]]
    assert out["o2"].dtype == np.bool_ and out["o3"].dtype == np.uint8 and out["o4"].dtype == np.int8
    eng.release()


def test_bf16_io_is_rejected_naming_the_tensor(load):
    spec = image_spec()
    spec["outputs"][0]["dtype"] = "BF16"
    with pytest.raises(EngineError, match="'y' is BF16"):
        load(spec)


def test_host_shape_tensor_rejected(load):
    spec = image_spec()
    spec["inputs"][0]["location"] = "HOST"
    with pytest.raises(EngineError, match="host memory"):
        load(spec)


def test_not_a_plan(fake, tmp_path):
    path = tmp_path / "junk.plan"
    path.write_bytes(b"not a plan")
    with pytest.raises(EngineError, match="cannot deserialize"):
        TensorRTEngine(path)


def test_missing_file(fake, tmp_path):
    with pytest.raises(EngineError, match="cannot read TensorRT plan"):
        TensorRTEngine(tmp_path / "nope.plan")


def test_version_compatible_plan_needs_host_code_allowed(load):
    spec = image_spec(version_compatible=True)
    load(spec).release()  # allowed by default
    with pytest.raises(EngineError, match="cannot deserialize"):
        load(spec, allow_host_code=False)


def test_no_gpu_fails_before_tensorrt_is_touched(fake, tmp_path):
    fake.gpu.device_count = 0
    path = tmp_path / "m.plan"
    path.write_bytes(make_plan(image_spec()))
    with pytest.raises(CudaError, match="cudaGetDeviceCount.*cudaErrorNoDevice"):
        TensorRTEngine(path)
    assert "runtime created" not in fake.gpu.events  # the real Runtime(logger) segfaults without a driver


def test_device_out_of_range(load):
    with pytest.raises(CudaError, match="device 3 does not exist"):
        load(device_id=3)


def test_unknown_runtime():
    with pytest.raises(EngineError, match="runtime must be one of"):
        trt_api.load_trt("tensorrt")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="full TensorRT is installed here")
def test_missing_runtime_names_the_pip_package(tmp_path):
    with pytest.raises(EngineError, match=r'pip install "trt-batcher\[tensorrt\]"'):
        TensorRTEngine(tmp_path / "m.plan", runtime="full")


def test_missing_dispatch_runtime_names_the_pip_package(tmp_path):
    if importlib.util.find_spec("tensorrt_dispatch") is not None:
        pytest.skip("tensorrt_dispatch is installed here")
    with pytest.raises(EngineError, match="tensorrt-dispatch-cu13"):
        TensorRTEngine(tmp_path / "m.plan", runtime="dispatch")


def test_cuda_helpers_through_fake(fake):
    assert backend.compute_capability(0) == (9, 0)
    free, total = backend.device_memory_info(0)
    assert free == total == fake.gpu.total_memory


# =========================================================================== contexts


def test_buffer_sizing_and_memory_accounting(load, fake):
    eng = load()
    before = dict(fake.gpu.counts())
    ctx = eng.create_context()
    x_bytes = 16 * 3 * 4 * 4 * 4  # profile max of x, float32
    y_bytes = 16 * 5 * 4  # output at the profile max
    assert ctx.io_nbytes == x_bytes + y_bytes
    assert ctx.pinned_nbytes == x_bytes + y_bytes
    assert ctx.nbytes == 100_000 + x_bytes + y_bytes  # device_memory_size_v2 + I/O buffers
    assert ctx.max_batch_size == 16
    sizes = sorted(len(m) for p, m in fake.gpu.device.items() if fake.gpu.device_owner[p] == "cudaMalloc")
    assert sizes == sorted([x_bytes, y_bytes])
    assert fake.gpu.counts() == {**before, "cudaMalloc": 2, "activation": 1, "pinned": 2, "streams": 1}
    ctx.release()
    assert ctx.nbytes == 0
    eng.release()


@pytest.mark.parametrize("rows", [1, 2, 7, 16])
def test_execute_exact_for_several_batch_sizes(load, rows):
    eng = load()
    ctx = eng.create_context()
    x = rand(rows, 3, 4, 4, seed=rows)
    out = ctx.execute({"x": x})
    assert set(out) == {"y"}
    assert out["y"].shape == (rows, 5) and out["y"].dtype == np.float32
    np.testing.assert_allclose(out["y"], expected(x), rtol=1e-6)
    eng.release()


def test_results_are_owned_copies_and_dynamic_dims_work(load, fake):
    eng = load(image_spec(profiles=(((1, 3, 2, 4), (8, 3, 4, 4), (16, 3, 8, 4)),)))
    ctx = eng.create_context()
    x1, x2 = rand(3, 3, 8, 4, seed=1), rand(5, 3, 2, 4, seed=2)
    y1 = ctx.execute({"x": x1})["y"]
    y2 = ctx.execute({"x": x2})["y"]
    np.testing.assert_allclose(y1, expected(x1), rtol=1e-6)  # not overwritten by the second batch
    np.testing.assert_allclose(y2, expected(x2), rtol=1e-6)
    assert fake.gpu.executions == [{"x": (3, 3, 8, 4)}, {"x": (5, 3, 2, 4)}]
    assert fake.gpu.calls["cudaStreamSynchronize"] == 1 + 2  # once at creation (profile switch), once per batch
    eng.release()


def test_host_buffer_is_the_pinned_staging_buffer(load, fake):
    ctx = load().create_context()
    buf = ctx.host_buffer("x", (3, 3, 4, 4), np.float32)
    assert buf is not None and buf.shape == (3, 3, 4, 4)
    assert buf.ctypes.data in fake.gpu.host  # pinned memory, not a copy
    x = rand(3, 3, 4, 4)
    np.copyto(buf, x)
    np.testing.assert_allclose(ctx.execute({"x": buf})["y"], expected(x), rtol=1e-6)
    assert ctx.host_buffer("x", (17, 3, 4, 4), np.float32) is None  # larger than the profile allows
    assert ctx.host_buffer("x", (3, 3, 4, 4), np.float64) is None  # not the engine's dtype
    assert ctx.host_buffer("y", (3, 5), np.float32) is None  # an output
    ctx.release()
    assert ctx.host_buffer("x", (3, 3, 4, 4), np.float32) is None


def test_batch_below_profile_minimum_is_padded_and_sliced(load, fake):
    eng = load(image_spec(profiles=(((4, 3, 4, 4), (8, 3, 4, 4), (16, 3, 4, 4)),)))
    ctx = eng.create_context()
    ctx.execute({"x": rand(8, 3, 4, 4, seed=8)})  # leaves data in the staging buffer
    x = rand(1, 3, 4, 4)
    y = ctx.execute({"x": x})["y"]
    assert fake.gpu.executions[-1] == {"x": (4, 3, 4, 4)}
    np.testing.assert_array_equal(fake.gpu.last_inputs["x"][0], x[0])
    assert not fake.gpu.last_inputs["x"][1:].any()  # padding rows are zeros, not stale data
    assert y.shape == (1, 5)
    np.testing.assert_allclose(y, expected(x), rtol=1e-6)
    eng.release()


def test_rows_over_profile_max(load, fake):
    ctx = load().create_context()
    with pytest.raises(EngineError, match="17 rows exceeds .* maximum batch 16"):
        ctx.execute({"x": rand(17, 3, 4, 4)})
    assert fake.gpu.executions == []


def test_shape_outside_profile_names_tensor_shape_min_max(load):
    ctx = load().create_context()
    with pytest.raises(EngineError) as err:
        ctx.execute({"x": rand(2, 3, 5, 4)})
    assert "'x'" in str(err.value) and "[2, 3, 5, 4]" in str(err.value)
    assert "min [1, 3, 4, 4]" in str(err.value) and "max [16, 3, 4, 4]" in str(err.value)


def test_bad_inputs(load):
    ctx = load().create_context()
    with pytest.raises(EngineError, match="missing \\['x'\\]"):
        ctx.execute({"z": rand(1, 3, 4, 4)})
    with pytest.raises(EngineError, match="dtype float64"):
        ctx.execute({"x": np.zeros((1, 3, 4, 4))})


def test_set_input_shape_refused_is_typed_and_context_stays_usable(load, fake):
    ctx = load().create_context()
    fake.gpu.refuse_shapes.add(("x", (2, 3, 4, 4)))
    with pytest.raises(TensorRTError) as err:
        ctx.execute({"x": rand(2, 3, 4, 4)})
    assert "set_input_shape('x', [2, 3, 4, 4])" in str(err.value) and "max [16, 3, 4, 4]" in str(err.value)
    x = rand(3, 3, 4, 4)
    np.testing.assert_allclose(ctx.execute({"x": x})["y"], expected(x), rtol=1e-6)


def test_execute_false_is_typed_and_context_stays_usable(load, fake):
    ctx = load().create_context()
    fake.gpu.fail_execute = 1
    with pytest.raises(TensorRTError, match=r"execute_async_v3 returned False for input shapes \{'x': \(2, 3, 4, 4\)\}"):
        ctx.execute({"x": rand(2, 3, 4, 4)})
    assert all(not q for q in fake.gpu.streams.values())  # queued copies were drained
    x = rand(4, 3, 4, 4, seed=4)
    np.testing.assert_allclose(ctx.execute({"x": x})["y"], expected(x), rtol=1e-6)


def test_cuda_error_is_typed_with_function_and_error_name(load, fake):
    ctx = load().create_context()
    fake.gpu.inject["cudaMemcpyAsync"] = fake.cudart.cudaError_t.cudaErrorInvalidValue
    with pytest.raises(CudaError, match="cudaMemcpyAsync H2D 'x'.*cudaErrorInvalidValue"):
        ctx.execute({"x": rand(2, 3, 4, 4)})
    x = rand(2, 3, 4, 4)
    np.testing.assert_allclose(ctx.execute({"x": x})["y"], expected(x), rtol=1e-6)


def test_execute_async_v3_captured_into_a_cuda_graph_replays_on_new_data(load, fake):
    """The layer is enough for TensorRT's CUDA-graph recipe: one warm-up enqueue per input shape, then capture."""
    ctx = load().create_context()
    ctx.execute({"x": rand(4, 3, 4, 4)})  # warm-up: input shapes set, tensor addresses bound
    stream = ctx._stream
    graph = Graph.capture(stream, lambda: ctx._trt_context.execute_async_v3(stream.ptr))
    ran = len(fake.gpu.executions)
    x = rand(4, 3, 4, 4, seed=5)
    np.copyto(ctx.host_buffer("x", x.shape, x.dtype), x)
    ctx._device["x"].copy_from_host_async(ctx._pinned["x"].ptr, x.nbytes, stream)
    graph.launch(stream)
    ctx._device["y"].copy_to_host_async(ctx._pinned["y"].ptr, 4 * 5 * 4, stream)
    stream.synchronize()
    assert fake.gpu.executions[ran:] == [{"x": (4, 3, 4, 4)}]
    np.testing.assert_allclose(ctx._pinned["y"].view((4, 5), np.float32), expected(x), rtol=1e-6)
    graph.destroy()
    ctx.release()


def test_allowed_sizes_each_get_a_context_and_a_graph(load, fake):
    """batch_sizes: per size an IExecutionContext (USER_MANAGED, sharing one activation buffer), a warm-up
    enqueue, then a captured graph; a batch replays its size's graph with one synchronize."""
    eng = load(batch_sizes=[1, 4, 16])
    before = dict(fake.gpu.counts())
    ctx = eng.create_context()
    assert ctx.batch_sizes == (1, 4, 16)
    assert ctx.describe() == {"execution": "tensorrt_graphs", "batch_sizes": [1, 4, 16], "profile": 0,
                              "device_id": 0}
    assert fake.gpu.executions == [{"x": (16, 3, 4, 4)}, {"x": (4, 3, 4, 4)}, {"x": (1, 3, 4, 4)}]  # warm-ups only
    grown = {k: v - before.get(k, 0) for k, v in fake.gpu.counts().items() if v != before.get(k, 0)}
    assert grown == {"cudaMalloc": 3, "pinned": 2, "streams": 1, "graph_execs": 3}  # activation + x + y, no STATIC
    x_bytes, y_bytes = 16 * 3 * 4 * 4 * 4, 16 * 5 * 4
    assert ctx.device_nbytes == ctx.nbytes == 100_000 + x_bytes + y_bytes
    for rows in (4, 16, 1, 4):
        x = rand(rows, 3, 4, 4, seed=rows)
        syncs = fake.gpu.calls["cudaStreamSynchronize"]
        np.testing.assert_allclose(ctx.execute({"x": x})["y"], expected(x), rtol=1e-6)
        assert fake.gpu.calls["cudaStreamSynchronize"] - syncs == 1
        assert fake.gpu.executions[-1] == {"x": (rows, 3, 4, 4)}  # the graph of that size replayed
    with pytest.raises(EngineError, match=r"batch of 3 rows: this context runs only the batch sizes \[1, 4, 16\]"):
        ctx.execute({"x": rand(3, 3, 4, 4)})
    ctx.release()
    assert fake.gpu.counts() == before
    eng.release()


def test_allowed_sizes_outside_the_profile_or_with_dynamic_dims(load, fake, caplog):
    with pytest.raises(TensorRTError, match=r"allowed batch sizes \[32\] are outside optimization profile 0"):
        load(batch_sizes=[1, 32]).create_context()
    eng = load(image_spec(profiles=(((1, 3, 2, 4), (8, 3, 4, 4), (16, 3, 8, 4)),)), batch_sizes=[1, 8])
    ctx = eng.create_context()  # H is dynamic in the profile: no graphs, any size runs, and it says why
    assert ctx.batch_sizes is None and "dynamic non-batch dims" in ctx.describe()["fallback_reason"]
    assert "no CUDA graphs" in caplog.text
    x = rand(3, 3, 8, 4)
    np.testing.assert_allclose(ctx.execute({"x": x})["y"], expected(x), rtol=1e-6)
    eng.release()


def test_failed_context_creation_frees_what_it_took(load, fake):
    eng = load()
    before = dict(fake.gpu.counts())
    fake.gpu.inject["cudaMallocHost"] = fake.cudart.cudaError_t.cudaErrorMemoryAllocation
    with pytest.raises(CudaError, match="cudaMallocHost.*cudaErrorMemoryAllocation"):
        eng.create_context()
    assert fake.gpu.counts() == before
    eng.create_context()  # and the engine still works
    eng.release()


def test_two_profiles_two_contexts(load, fake):
    profiles = (((1, 3, 4, 4), (8, 3, 4, 4), (16, 3, 4, 4)), ((2, 3, 4, 4), (4, 3, 4, 4), (8, 3, 4, 4)))
    eng = load(image_spec(profiles=profiles))
    assert eng.num_profiles == 2 and eng.max_batch_size == 8
    c0, c1 = eng.create_context(), eng.create_context()
    assert (c0.profile_index, c1.profile_index) == (0, 1)
    assert (c0._trt_context.active_optimization_profile, c1._trt_context.active_optimization_profile) == (0, 1)
    assert (c0.max_batch_size, c1.max_batch_size) == (16, 8)
    assert c0.io_nbytes == 16 * 48 * 4 + 16 * 5 * 4 and c1.io_nbytes == 8 * 48 * 4 + 8 * 5 * 4
    x = rand(1, 3, 4, 4)
    np.testing.assert_allclose(c1.execute({"x": x})["y"], expected(x), rtol=1e-6)  # padded to profile 1's min 2
    assert fake.gpu.executions[-1] == {"x": (2, 3, 4, 4)}
    with pytest.raises(EngineError, match="9 rows exceeds .* maximum batch 8"):
        c1.execute({"x": rand(9, 3, 4, 4)})  # fine for c0 (profile 0), too many for profile 1
    assert c0.execute({"x": rand(9, 3, 4, 4)})["y"].shape == (9, 5)
    c2 = eng.create_context()
    assert c2.profile_index == 0
    c1.release()
    assert eng.create_context().profile_index == 1
    eng.release()


def test_release_frees_everything_contexts_before_engine(load, fake):
    eng = load()
    c0, _c1 = eng.create_context(), eng.create_context()  # _c1: released by eng.release() below
    c0.execute({"x": rand(2, 3, 4, 4)})
    c0.release()
    c0.release()  # idempotent
    with pytest.raises(EngineError, match="released"):
        c0.execute({"x": rand(1, 3, 4, 4)})
    eng.release()  # releases c1 itself, then the engine
    eng.release()
    assert fake.gpu.device == {} and fake.gpu.host == {} and fake.gpu.streams == {}
    assert fake.gpu.calls["cudaMalloc"] == 4 and fake.gpu.calls["cudaFree"] == 4
    assert fake.gpu.calls["cudaMallocHost"] == 4 and fake.gpu.calls["cudaFreeHost"] == 4
    assert fake.gpu.calls["cudaStreamCreateWithFlags"] == 2 and fake.gpu.calls["cudaStreamDestroy"] == 2
    ev = fake.gpu.events
    assert ev.count("context destroyed") == 2
    last_ctx = max(i for i, e in enumerate(ev) if e in ("context destroyed", "device buffer freed", "stream destroyed"))
    assert last_ctx < ev.index("engine destroyed") < ev.index("runtime destroyed")
    # within one context: TensorRT context first, then its buffers, then its stream
    first = ev.index("context destroyed")
    assert ev[first + 1 : first + 6] == ["device buffer freed"] * 2 + ["pinned buffer freed"] * 2 + ["stream destroyed"]
    with pytest.raises(EngineError, match="released"):
        eng.create_context()


# =========================================================================== builder: pure parts


def test_parse_shape():
    assert tb.parse_shape("1x3x224x224") == (1, 3, 224, 224)
    assert tb.parse_shape("32") == (32,)
    for bad in ("", "1x", "1x-3", "ax3", "1,3"):
        with pytest.raises(ValueError):
            tb.parse_shape(bad)


def test_parse_profile_args_and_profiles():
    assert tb.parse_profile_args(["input:1x3x224x224", "ns:x:2x5"]) == {"input": (1, 3, 224, 224), "ns:x": (2, 5)}
    for bad in (["1x3"], [":1x3"], ["a:1", "a:2"]):
        with pytest.raises(ValueError):
            tb.parse_profile_args(bad)
    profiles = tb.profiles_from_args(["x:1x3"], None, ["x:32x3"])
    assert profiles == [{"x": ((1, 3), (32, 3), (32, 3))}]  # --opt defaults to --max
    assert tb.profiles_from_args(None, None, None) == []
    with pytest.raises(ValueError, match="need both --min and --max"):
        tb.profiles_from_args(None, None, ["x:32x3"])


def test_build_options_validation():
    with pytest.raises(tb.BuildError, match="precision"):
        tb.BuildOptions(precision="fp8")
    with pytest.raises(tb.BuildError, match="hardware_compatibility"):
        tb.BuildOptions(hardware_compatibility="hopper")
    with pytest.raises(tb.BuildError, match="workspace"):
        tb.BuildOptions(workspace_mb=0)
    with pytest.raises(tb.BuildError, match="min <= opt <= max"):
        tb.BuildOptions(profiles=[{"x": ((8, 3), (4, 3), (16, 3))}])
    with pytest.raises(tb.BuildError, match="rank"):
        tb.BuildOptions(profiles=[{"x": ((1, 3), (4,), (16, 3))}])


PROFILE = [{"input": ((1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224))}]


def test_cache_key_stable_and_sensitive():
    base = tb.BuildOptions(profiles=PROFILE)
    key = tb.cache_key(b"onnx", "10.13.0", (9, 0), base)
    assert len(key) == 64 and key == tb.cache_key(b"onnx", "10.13.0", "9.0", tb.BuildOptions(profiles=PROFILE))
    two = [{"a": ((1,), (2,), (3,)), "b": ((1,), (1,), (1,))}]
    assert tb.cache_key(b"o", "v", "9.0", tb.BuildOptions(profiles=two)) == tb.cache_key(
        b"o", "v", "9.0", tb.BuildOptions(profiles=[dict(reversed(two[0].items()))])
    )
    # the timing cache changes build time, not the plan
    assert tb.cache_key(b"onnx", "10.13.0", (9, 0), tb.BuildOptions(profiles=PROFILE, timing_cache=Path("t"))) == key
    variants = [
        tb.cache_key(b"onnx2", "10.13.0", (9, 0), base),
        tb.cache_key(b"onnx", "11.4.0", (9, 0), base),
        tb.cache_key(b"onnx", "10.13.0", (8, 9), base),
        tb.cache_key(b"onnx", "10.13.0", (9, 0), tb.BuildOptions(profiles=PROFILE, precision="fp16")),
        tb.cache_key(b"onnx", "10.13.0", (9, 0), tb.BuildOptions(profiles=[{"input": ((1, 3, 224, 224),) * 3}])),
        tb.cache_key(b"onnx", "10.13.0", (9, 0), tb.BuildOptions(profiles=PROFILE * 2)),
        tb.cache_key(b"onnx", "10.13.0", (9, 0), tb.BuildOptions(profiles=PROFILE, workspace_mb=512)),
        tb.cache_key(b"onnx", "10.13.0", (9, 0), tb.BuildOptions(profiles=PROFILE, version_compatible=True)),
        tb.cache_key(b"onnx", "10.13.0", (9, 0), tb.BuildOptions(profiles=PROFILE, hardware_compatibility="ampere_plus")),
    ]
    assert len({key, *variants}) == len(variants) + 1
    int8 = tb.BuildOptions(profiles=PROFILE, precision="int8", calibration_dir=Path("c"))
    assert tb.cache_key(b"o", "v", "9.0", int8, calibration="a") != tb.cache_key(b"o", "v", "9.0", int8, calibration="b")
    assert tb.cache_key(b"o", "v", "9.0", base, calibration="a") == tb.cache_key(b"o", "v", "9.0", base, calibration="b")


TRT10 = {
    "version": "10.13.0", "builder": True, "fp16_flag": True, "bf16_flag": True, "int8_flag": True,
    "int8_calibrator": True, "strongly_typed_only": False, "version_compatible": True, "exclude_lean_runtime": True,
    "hardware_compatibility": ["ampere_plus", "none", "same_compute_capability"], "timing_cache": True,
    "fp16_converter": False,
}
TRT11 = {**TRT10, "version": "11.4.0", "fp16_flag": False, "bf16_flag": False, "int8_flag": False,
         "int8_calibrator": False, "strongly_typed_only": True}


def test_unsupported_options_trt10():
    assert tb.unsupported_options(tb.BuildOptions(profiles=PROFILE), TRT10) == []
    for p in ("fp16", "bf16"):
        assert tb.unsupported_options(tb.BuildOptions(precision=p), TRT10) == []
    int8 = tb.BuildOptions(precision="int8", calibration_dir=Path("cal"))
    assert tb.unsupported_options(int8, TRT10) == []
    (reason,) = tb.unsupported_options(tb.BuildOptions(precision="int8"), TRT10)
    assert "calibration_dir" in reason
    (reason,) = tb.unsupported_options(tb.BuildOptions(calibration_dir=Path("cal")), TRT10)
    assert "only to precision int8" in reason
    every = tb.BuildOptions(version_compatible=True, hardware_compatibility="ampere_plus", timing_cache=Path("t"))
    assert tb.unsupported_options(every, TRT10) == []


def test_unsupported_options_trt11():
    assert tb.unsupported_options(tb.BuildOptions(), TRT11) == []
    (reason,) = tb.unsupported_options(tb.BuildOptions(precision="fp16"), TRT11)
    assert "11.4.0" in reason and "strongly typed" in reason and "onnxconverter-common" in reason
    assert tb.unsupported_options(tb.BuildOptions(precision="fp16"), {**TRT11, "fp16_converter": True}) == []
    (reason,) = tb.unsupported_options(tb.BuildOptions(precision="bf16"), TRT11)
    assert "BF16" in reason and "ModelOpt" in reason
    (reason,) = tb.unsupported_options(tb.BuildOptions(precision="int8", calibration_dir=Path("c")), TRT11)
    assert "Q/DQ" in reason
    old = {**TRT11, "version_compatible": False, "hardware_compatibility": ["none"], "timing_cache": False}
    opts = tb.BuildOptions(version_compatible=True, hardware_compatibility="ampere_plus", timing_cache=Path("t"))
    assert len(tb.unsupported_options(opts, old)) == 3
    lean = {**TRT11, "builder": False}
    (reason,) = tb.unsupported_options(tb.BuildOptions(), lean)
    assert "full" in reason and "trt-batcher[tensorrt]" in reason


def test_capabilities_of_fake_modules():
    flags10 = SimpleNamespace(FP16=1, BF16=2, INT8=3, VERSION_COMPATIBLE=4, EXCLUDE_LEAN_RUNTIME=5)
    levels = SimpleNamespace(NONE=0, AMPERE_PLUS=1, SAME_COMPUTE_CAPABILITY=2)
    trt10 = SimpleNamespace(__version__="10.13.0", Builder=object, OnnxParser=object, BuilderFlag=flags10,
                            HardwareCompatibilityLevel=levels, IInt8EntropyCalibrator2=object, ITimingCache=object)
    assert tb.capabilities(trt10, fp16_converter=False) == TRT10
    flags11 = SimpleNamespace(VERSION_COMPATIBLE=4, EXCLUDE_LEAN_RUNTIME=5)
    trt11 = SimpleNamespace(__version__="11.4.0", Builder=object, OnnxParser=object, BuilderFlag=flags11,
                            HardwareCompatibilityLevel=levels, ITimingCache=object)
    assert tb.capabilities(trt11, fp16_converter=False) == TRT11


def test_capabilities_of_real_lean_runtime():
    lean = pytest.importorskip("tensorrt_lean")
    caps = tb.capabilities(lean, fp16_converter=False)
    assert caps["builder"] is False  # lean cannot build
    assert caps["strongly_typed_only"] is True  # 11.x: BuilderFlag has no FP16/BF16/INT8
    assert caps["version_compatible"] and caps["exclude_lean_runtime"]
    assert caps["hardware_compatibility"] == ["ampere_plus", "none", "same_compute_capability"]


def test_calibration_batches_and_digest(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "a.npy", rng.standard_normal((3, 3, 8, 8)).astype(np.float32))  # a batch of 3
    np.save(tmp_path / "b.npy", rng.standard_normal((3, 8, 8)).astype(np.float32))  # one sample
    batches = tb.load_calibration_batches(tmp_path, (1, 3, 8, 8), (8, 3, 8, 8), batch_size=2)
    assert [b.shape for b in batches] == [(2, 3, 8, 8), (2, 3, 8, 8)]
    d = tb.calibration_digest(tmp_path)
    np.save(tmp_path / "b.npy", np.zeros((3, 8, 8), np.float32))
    assert tb.calibration_digest(tmp_path) != d
    with pytest.raises(tb.BuildError, match="need at least 8"):
        tb.load_calibration_batches(tmp_path, (1, 3, 8, 8), (8, 3, 8, 8), batch_size=8)
    with pytest.raises(tb.BuildError, match="no .npy"):
        tb.load_calibration_batches(tmp_path / "none", (1,), (2,), 1)


def test_cached_build_reuses_the_plan(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(tb.build, "_trt", SimpleNamespace(__version__="10.13.0"))
    built = []
    monkeypatch.setattr(tb.build, "build_plan", lambda data, options, onnx_path=None: built.append(data) or b"PLAN")
    onnx_path = tmp_path / "m.onnx"
    onnx_path.write_bytes(b"model")
    opts = tb.BuildOptions(profiles=PROFILE)
    first = tb.cached_build(onnx_path, opts, tmp_path / "cache")
    assert first.name == tb.cache_key(b"model", "10.13.0", (9, 0), opts) + ".plan" and first.read_bytes() == b"PLAN"
    assert tb.cached_build(onnx_path, opts, tmp_path / "cache") == first and len(built) == 1
    tb.cached_build(onnx_path, tb.BuildOptions(profiles=PROFILE, precision="fp16"), tmp_path / "cache")
    assert len(built) == 2
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")) == []  # no temp left


def _cli(*args: str) -> subprocess.CompletedProcess:
    code = f"import engines.trt_build as b; raise SystemExit(b.main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="full TensorRT is installed here")
def test_cli_exits_3_without_tensorrt(tmp_path):
    res = _cli("build", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.plan"), "--max", "input:8x3x224x224",
               "--min", "input:1x3x224x224")
    assert res.returncode == 3, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "full TensorRT" in lines[0] and 'pip install "trt-batcher[tensorrt]"' in lines[0]
    assert not (tmp_path / "m.plan").exists()


def test_cli_help_describes_every_option():
    res = _cli("build", "--help")
    assert res.returncode == 0
    for opt in ("--output", "--min", "--opt", "--max", "--precision", "--workspace-mb", "--timing-cache",
                "--version-compatible", "--hardware-compatibility", "--calibration-dir", "--cache-dir"):
        assert opt in res.stdout


def test_cli_bad_arguments_exit_2(tmp_path):
    res = _cli("build", "m.onnx", "-o", str(tmp_path / "m.plan"), "--max", "input:8xfoo")
    assert res.returncode == 2 and "8xfoo" in res.stderr
    res = _cli("build", "m.onnx")
    assert res.returncode == 2 and "--output or --cache-dir" in res.stderr
