"""ONNX Runtime's CUDA contexts (engines/onnxruntime) on ONNX Runtime's CPU build over the stand-in CUDA runtime.

What stands in for the GPU: tests/fake_cuda.py (checked against cuda.bindings by test_cuda_api.py), whose "device"
memory is real host memory, so a real CPU ``InferenceSession`` bound with IOBinding (device ``"cpu"``) reads and
writes the context's device buffers by address. Copies queue on the fake stream and run at its synchronize; a
session run first runs what is queued on the streams (ONNX Runtime's kernels come after the H2D on the same
stream), so a context that reads outputs before synchronizing, copies in the wrong order, or skips a copy gets
wrong numbers here as on a GPU. ``gpu_graph_id`` means nothing to the CPU provider: what is checked is the
context's side - fixed buffers and bindings per size, one synchronize per batch, the thread that owns the graphs,
the capture gate - not ONNX Runtime's capture itself (tests/gpu/ does that on the device).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import engines.cuda as cuda
from engines.base import DeviceTimes, EngineError
from engines.cuda import CAPTURE_GATE, CaptureGate
from engines.onnxruntime import CudaGraphContext, CudaSessionsContext, OnnxRuntimeEngine, cuda as ort_cuda
from engines.onnxruntime.options import cuda_provider, fp16_path, resolve_precision
from fake_cuda import FakeCuda

W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
B = np.array([1.0, -2.0, 0.5], np.float32)


def _affine(path, dynamic: bool = False) -> str:
    """y = x @ W + b, x float32 [N, 4] (``dynamic``: [N, D], y = relu(x))."""
    if dynamic:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "D"])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "D"])
        graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    else:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])
        nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])]
        inits = [helper.make_tensor("W", TensorProto.FLOAT, [4, 3], W.ravel()),
                 helper.make_tensor("b", TensorProto.FLOAT, [3], B)]
        graph = helper.make_graph(nodes, "affine", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


class Device:
    """The fake GPU plus a record of every session run: the thread it ran on, and whether the capture gate was held
    exclusively (a capture) or shared at that moment."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake, self.gpu = fake, fake.gpu
        self.runs: list[tuple[int, bool, int]] = []  # (thread, exclusive, readers)

    def drain(self) -> None:
        """Run what the streams queued (the H2D copies a kernel on the same stream would wait for)."""
        for sid in list(self.gpu.streams):
            ops, self.gpu.streams[sid] = self.gpu.streams[sid], []
            for op in ops:  # as the fake's own stream synchronize runs them: the clock first
                self.gpu.clock_ms += getattr(op, "cost_ms", self.gpu.op_ms)
                op()

    def syncs(self) -> int:
        """Waits for the device: a stream's whole queue, or an event (a graph context waits for its batch's)."""
        return self.gpu.calls["cudaStreamSynchronize"] + self.gpu.calls["cudaEventSynchronize"]


@pytest.fixture
def device(monkeypatch):
    fake = FakeCuda()
    dev = Device(fake)
    real_run = ort.InferenceSession.run_with_iobinding

    def run(session, binding, run_options=None):
        dev.runs.append((threading.get_ident(), CAPTURE_GATE._writer, CAPTURE_GATE._readers))
        dev.drain()
        return real_run(session, binding, run_options)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", run)
    monkeypatch.setattr(ort_cuda, "ORT_DEVICE", "cpu")
    monkeypatch.setattr(ort_cuda.CudaPlan, "providers", lambda self, stream, graphs: ["CPUExecutionProvider"])
    monkeypatch.setattr(OnnxRuntimeEngine, "_require_cuda_provider", staticmethod(lambda: None))
    with cuda.use_runtime(fake.cudart):
        yield dev


def _engine(tmp_path, sizes=(1, 2, 4, 8), dynamic=False, **kw) -> OnnxRuntimeEngine:
    return OnnxRuntimeEngine(_affine(tmp_path / "m.onnx", dynamic), device="cuda", batch_sizes=sizes,
                             cache=tmp_path / "cache", **kw)


def _want(x: np.ndarray) -> np.ndarray:
    return x @ W + B


def _copies(device) -> list[tuple[int, int, int]]:
    """From now on, every copy the stand-in takes recorded as (source address, bytes, kind: 1 = H2D), one by one
    (``cudaMemcpyAsync``) or in a batch (``cudaMemcpyBatchAsync``, host-to-device)."""
    seen: list[tuple[int, int, int]] = []
    cudart = device.fake.cudart
    one, batch = cudart.cudaMemcpyAsync, cudart.cudaMemcpyBatchAsync

    def spy(dst, src, count, kind, stream):
        seen.append((int(src), int(count), int(kind)))
        return one(dst, src, count, kind, stream)

    def spy_batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream):
        result = batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)
        if result[0] == cudart.cudaError_t.cudaSuccess:
            seen.extend((int(src), int(n), 1) for src, n in zip(srcs, sizes))
        return result

    cudart.cudaMemcpyAsync, cudart.cudaMemcpyBatchAsync = spy, spy_batch
    return seen


# --------------------------------------------------------------------------- graph contexts


def test_graph_context_runs_every_allowed_size_exactly(device, tmp_path):
    eng = _engine(tmp_path)
    ctx = eng.create_context()
    assert isinstance(ctx, CudaGraphContext)
    assert ctx.batch_sizes == (1, 2, 4, 8)
    assert ctx.describe() == {"execution": "cuda_graphs", "precision": "tf32", "batch_sizes": [1, 2, 4, 8],
                              "device_id": 0}
    rng = np.random.default_rng(0)
    for n in (1, 2, 4, 8, 4, 1):
        x = rng.standard_normal((n, 4)).astype(np.float32)
        before = device.syncs()
        y = ctx.execute({"x": x})["y"]
        assert device.syncs() - before == 1  # ONE wait per batch
        np.testing.assert_allclose(y, _want(x), rtol=1e-6, atol=1e-6)
    ctx.release()
    eng.release()


def test_outputs_are_owned_not_views_of_the_next_batch(device, tmp_path):
    eng = _engine(tmp_path)
    ctx = eng.create_context()
    first = ctx.execute({"x": np.ones((2, 4), np.float32)})["y"]
    kept = first.copy()
    ctx.execute({"x": np.full((2, 4), 5.0, np.float32)})
    np.testing.assert_array_equal(first, kept)
    assert first.flags.owndata
    ctx.release()


def test_two_batches_on_the_device_at_once_each_get_their_own_outputs(device, tmp_path):
    eng = _engine(tmp_path)
    ctx = eng.create_context()
    assert ctx.pipeline_depth == 2
    # staged as the executor stages them: in pinned staging buffers 0 and 1
    x1 = ctx.host_buffer("x", (2, 4), np.float32)
    x1[...] = 1.0
    x2 = ctx.host_buffer("x", (4, 4), np.float32, slot=1)
    x2[...] = -3.0
    before = device.syncs()
    first, second = ctx.launch({"x": x1}), ctx.launch({"x": x2})
    assert device.syncs() == before  # launching waits for nothing
    with pytest.raises(EngineError, match="2 batches launched and not collected"):
        ctx.launch({"x": x1})
    device.drain()  # the device finished both before the host collects the first
    np.testing.assert_allclose(ctx.collect(first)["y"], _want(x1), rtol=1e-6)
    np.testing.assert_allclose(ctx.collect(second)["y"], _want(x2), rtol=1e-6)
    assert device.syncs() - before == 2  # one wait per batch
    with pytest.raises(EngineError, match="holds no launched batch"):
        ctx.collect(first)
    third = ctx.launch({"x": x2[:1]})  # both slots free again
    np.testing.assert_allclose(ctx.collect(third)["y"], _want(x2[:1]), rtol=1e-6)
    # an input that is not page-locked is copied into staging buffer 0 first, which a batch launched before it may
    # still be reading: that launch waits for the device first, and both read what they were given
    x1_copy = x1.copy()
    staged = ctx.launch({"x": x1})
    waits = device.syncs()
    plain = ctx.launch({"x": np.full((2, 4), 5.0, np.float32)})
    assert device.syncs() == waits + 1
    np.testing.assert_allclose(ctx.collect(staged)["y"], _want(x1_copy), rtol=1e-6)
    np.testing.assert_allclose(ctx.collect(plain)["y"], _want(np.full((2, 4), 5.0)), rtol=1e-6)
    # a handle whose slot was collected and launched again is refused, not answered with the newer batch's outputs
    x1[...] = 1.0  # the plain input's copy went through staging buffer 0
    old = ctx.launch({"x": x1})
    ctx.collect(old)
    newer = ctx.launch({"x": x2[:1]})
    other = ctx.launch({"x": x1})
    with pytest.raises(EngineError, match="holds no launched batch"):
        ctx.collect(old)
    np.testing.assert_allclose(ctx.collect(newer)["y"], _want(x2[:1]), rtol=1e-6)
    np.testing.assert_allclose(ctx.collect(other)["y"], _want(x1_copy), rtol=1e-6)
    with pytest.raises(EngineError, match="allowed|prepared|batch"):
        ctx.launch({"x": np.ones((3, 4), np.float32)})  # not an allowed size: refused before anything is queued
    np.testing.assert_allclose(ctx.execute({"x": x1})["y"], _want(x1), rtol=1e-6)
    ctx.release()
    with pytest.raises(EngineError, match="released"):
        ctx.launch({"x": x1})
    eng.release()


def test_staging_buffer_is_read_in_place(device, tmp_path):
    eng = _engine(tmp_path)
    ctx = eng.create_context()
    staged = ctx.host_buffer("x", (4, 4), np.float32)
    assert staged.ctypes.data in device.gpu.host  # the pinned buffer itself, sized for the largest size
    assert ctx.host_buffer("x", (16, 4), np.float32) is None  # beyond the largest allowed size
    assert ctx.host_buffer("x", (4, 4), np.float64) is None
    staged[:] = np.arange(16, dtype=np.float32).reshape(4, 4)
    srcs = _copies(device)  # (source, bytes, kind) of every cudaMemcpyAsync from here on
    y = ctx.execute({"x": staged})["y"]
    np.testing.assert_allclose(y, _want(np.arange(16, dtype=np.float32).reshape(4, 4)), rtol=1e-6)
    h2d = [src for src, _, kind in srcs if kind == 1]
    assert h2d == [staged.ctypes.data]  # straight from the staging buffer, no further host copy
    ctx.release()


def test_four_staging_buffers_each_read_in_place(device, tmp_path):
    """A graph context offers four pinned staging buffers (the executor stacks the next batches into the others
    while the batch in one runs); each is sent straight to the device, and none disturbs another."""
    ctx = _engine(tmp_path).create_context()
    assert ctx.staging_slots == 4
    bufs = [ctx.host_buffer("x", (4, 4), np.float32, slot=k) for k in range(4)]
    assert len({b.ctypes.data for b in bufs}) == 4 and all(b.ctypes.data in device.gpu.host for b in bufs)
    for k, b in enumerate(bufs):
        b[:] = float(k + 1)
    srcs = _copies(device)  # (source, bytes, kind) of every cudaMemcpyAsync from here on
    order = (2, 0, 3, 1)
    ys = [ctx.execute({"x": bufs[k]})["y"] for k in order]
    for k, y in zip(order, ys):
        np.testing.assert_allclose(y, _want(np.full((4, 4), float(k + 1), np.float32)), rtol=1e-6)
    assert [src for src, _, kind in srcs if kind == 1] == [bufs[k].ctypes.data for k in order]
    ctx.release()


def test_registered_memory_is_sent_without_a_staging_copy(device, tmp_path):
    eng = _engine(tmp_path)
    ctx = eng.create_context()
    host = np.zeros((2, 4), np.float32)
    host[:] = [[1, 2, 3, 4], [5, 6, 7, 8]]
    reg = cuda.HostRegistration(host.ctypes.data, host.nbytes)
    assert cuda.page_locked(host.ctypes.data, host.nbytes) and not cuda.page_locked(host.ctypes.data, host.nbytes + 1)
    staged = ctx.host_buffer("x", (2, 4), np.float32)
    staged[:] = -1.0
    y = ctx.execute({"x": host})["y"]
    np.testing.assert_allclose(y, _want(host), rtol=1e-6)
    np.testing.assert_array_equal(staged, -1.0)  # the staging buffer was not used
    reg.unregister()
    assert not cuda.page_locked(host.ctypes.data, host.nbytes)
    ctx.release()


def test_batch_of_registered_requests_is_sent_part_by_part_without_stacking(device, tmp_path):
    """Requests whose inputs lie in registered memory (multi-process mode's shared areas) are not stacked on the
    host: the batch goes to the device as one DMA per run of requests lying back to back, from where they lie, the
    padding rows are zeroed on the device, and the outputs equal the stacked path's exactly; one pageable request
    sends the batch back to stacking into the staging buffer."""
    from batcher.batching import Pending, shape_key
    from batcher.batch_steps import run_batch, stage_batch
    from engines.base import RowParts

    ctx = _engine(tmp_path).create_context()
    area = np.zeros((8, 4), np.float32)  # stands in for a front end's shared area, registered as the engine does
    reg = cuda.HostRegistration(area.ctypes.data, area.nbytes)
    area[:] = np.arange(32, dtype=np.float32).reshape(8, 4) / 7
    views = [area[0:1], area[1:3], area[5:7]]  # 5 rows: padded to 8
    batch = [Pending({"x": v}, len(v), shape_key({"x": v}), arrival=0.0) for v in views]
    staging = ctx.host_buffer("x", (8, 4), np.float32)
    staging[:] = -1.0
    srcs = _copies(device)
    staged = stage_batch(ctx, batch, "m", None, allowed=(1, 2, 4, 8))
    assert isinstance(staged.inputs["x"], RowParts) and staged.inputs["x"].shape == (8, 4) and staged.pad == 3
    calls = device.fake.gpu.calls.copy()
    result = run_batch(ctx, staged, "m", (1, 2, 4, 8))
    # no host copy; rows 0-2 (two requests back to back) in one DMA, rows 5-6 in another, both in ONE call
    assert [(s, c) for s, c, k in srcs if k == 1] == [(area[0:1].ctypes.data, 3 * 16), (area[5:7].ctypes.data, 2 * 16)]
    assert device.fake.gpu.calls["cudaMemcpyBatchAsync"] - calls["cudaMemcpyBatchAsync"] == 1
    assert device.fake.gpu.calls["cudaMemcpyAsync"] - calls["cudaMemcpyAsync"] == 1  # the output, back
    np.testing.assert_array_equal(staging, -1.0)  # the staging buffer was not touched
    for v, got in zip(views, result.outcomes):
        np.testing.assert_allclose(got["y"], _want(v), rtol=1e-6, atol=1e-6)
    # the padding rows reached the device as zeros: the device buffer's rows 5..7 are 0
    dev = ctx._buffers.device["x"]
    np.testing.assert_array_equal(np.frombuffer(device.gpu.read(dev.ptr + 5 * 16, 3 * 16), np.float32), 0.0)

    pageable = np.full((1, 4), 3.0, np.float32)  # one request outside the registered memory: stacked as before
    mixed = batch[:1] + [Pending({"x": pageable}, 1, shape_key({"x": pageable}), arrival=0.0)]
    staged = stage_batch(ctx, mixed, "m", None, allowed=(1, 2, 4, 8))
    assert isinstance(staged.inputs["x"], np.ndarray) and staged.inputs["x"].ctypes.data == staging.ctypes.data
    out = run_batch(ctx, staged, "m", (1, 2, 4, 8)).outcomes
    np.testing.assert_allclose(out[1]["y"], _want(pageable), rtol=1e-6, atol=1e-6)
    reg.unregister()
    ctx.release()


def test_without_batched_copies_each_run_of_requests_goes_by_its_own_copy(device, tmp_path):
    """A driver without ``cudaMemcpyBatchAsync`` (before CUDA 12.8): the runs of a batch go one
    ``cudaMemcpyAsync`` each, the outputs are the same, and the batched call is not tried again."""
    from batcher.batching import Pending, shape_key
    from batcher.batch_steps import run_batch, stage_batch

    device.fake.gpu.batch_copies = False
    ctx = _engine(tmp_path).create_context()
    area = np.zeros((8, 4), np.float32)
    reg = cuda.HostRegistration(area.ctypes.data, area.nbytes)
    area[:] = np.arange(32, dtype=np.float32).reshape(8, 4) / 7
    views = [area[0:1], area[5:7]]
    batch = [Pending({"x": v}, len(v), shape_key({"x": v}), arrival=0.0) for v in views]
    srcs = _copies(device)
    for _ in range(2):
        calls = device.fake.gpu.calls.copy()
        result = run_batch(ctx, stage_batch(ctx, batch, "m", None, allowed=(1, 2, 4, 8)), "m", (1, 2, 4, 8))
        for v, got in zip(views, result.outcomes):
            np.testing.assert_allclose(got["y"], _want(v), rtol=1e-6, atol=1e-6)
        assert device.fake.gpu.calls["cudaMemcpyAsync"] - calls["cudaMemcpyAsync"] == 3  # two runs, one output
        tried = device.fake.gpu.calls["cudaMemcpyBatchAsync"] - calls["cudaMemcpyBatchAsync"]
        assert tried == (1 if _ == 0 else 0)  # refused once, then never asked again
    assert [(s, c) for s, c, k in srcs if k == 1][-2:] == [(area[0:1].ctypes.data, 16), (area[5:7].ctypes.data, 32)]
    reg.unregister()
    ctx.release()


def test_only_allowed_sizes_and_the_models_dims_run(device, tmp_path):
    eng = _engine(tmp_path)
    ctx = eng.create_context()
    with pytest.raises(EngineError, match=r"batch of 3 rows: this context runs only the batch sizes \[1, 2, 4, 8\]"):
        ctx.execute({"x": np.zeros((3, 4), np.float32)})
    with pytest.raises(EngineError, match="float64"):
        ctx.execute({"x": np.zeros((2, 4), np.float64)})
    with pytest.raises(EngineError, match="inputs must be exactly"):
        ctx.execute({"z": np.zeros((2, 4), np.float32)})
    np.testing.assert_allclose(ctx.execute({"x": np.ones((1, 4), np.float32)})["y"], _want(np.ones((1, 4))),
                               rtol=1e-6)  # still usable
    ctx.release()


def test_every_run_is_on_the_contexts_own_thread(device, tmp_path):
    eng = _engine(tmp_path)
    ctx = eng.create_context()
    owner = {t for t, _, _ in device.runs}
    assert len(owner) == 1 and threading.get_ident() not in owner  # creation and captures: the context's thread
    results = {}

    def worker(i):
        results[i] = ctx.execute({"x": np.full((2, 4), float(i), np.float32)})["y"]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {t for t, _, _ in device.runs} == owner  # batches from other threads were handed to it
    for i in range(3):
        np.testing.assert_allclose(results[i], _want(np.full((2, 4), float(i))), rtol=1e-6)
    assert ctx.executor.submit(threading.get_ident).result() in owner
    ctx.release()


def test_captures_hold_the_gate_alone_and_batches_share_it(device, tmp_path):
    eng = _engine(tmp_path)
    captures = CAPTURE_GATE.captures
    first = eng.create_context()
    assert CAPTURE_GATE.captures - captures == 4  # one exclusive section per allowed size
    stop = threading.Event()

    def serve():  # the first context keeps executing while the second is created
        while not stop.is_set():
            first.execute({"x": np.ones((8, 4), np.float32)})

    server = threading.Thread(target=serve)
    server.start()
    try:
        second = eng.create_context()
    finally:
        stop.set()
        server.join()
    creating = [(excl, readers) for t, excl, readers in device.runs if excl]
    assert len(creating) == 8  # both contexts' captures
    assert all(readers == 0 for _, readers in creating)  # nobody else inside the gate during a capture
    assert all(readers >= 1 for _, excl, readers in device.runs if not excl)  # batches hold it shared
    second.release()
    first.release()


def test_device_memory_is_measured_and_everything_is_freed(device, tmp_path):
    eng = _engine(tmp_path)
    before = dict(device.gpu.counts())
    ctx = eng.create_context()
    # the fake's device memory is the context's buffers (the CPU session uses none): x and y at the largest size
    assert ctx.device_nbytes == ctx.nbytes == 8 * 4 * 4 + 8 * 3 * 4
    # pinned: x and y, x's staging buffers 1, 2 and 3 and y's second output slot; an event per output slot, and
    # the ring of three timing pairs (device_times)
    assert device.gpu.counts() == {**before, "cudaMalloc": 2, "pinned": 6, "streams": before["streams"] + 1,
                                   "events": 2 + 3 * 2}
    ctx.release()
    ctx.release()  # idempotent
    assert device.gpu.counts() == before
    assert ctx.executor is None
    with pytest.raises(EngineError, match="released"):
        ctx.execute({"x": np.ones((1, 4), np.float32)})


# --------------------------------------------------------------------------- sessions and fallback


def test_auto_falls_back_to_a_session_per_size_and_says_why(device, tmp_path, caplog):
    eng = _engine(tmp_path, sizes=(1, 4), dynamic=True)
    ctx = eng.create_context()
    assert isinstance(ctx, CudaSessionsContext)
    facts = ctx.describe()
    assert facts["execution"] == "cuda_sessions" and facts["batch_sizes"] == [1, 4]
    assert "CUDA graphs need static non-batch dims" in facts["fallback_reason"]
    assert "no CUDA graphs" in caplog.text
    x = np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0], [0, 1, 0], [1, 1, -1]], np.float32)
    np.testing.assert_array_equal(ctx.execute({"x": x})["y"], np.maximum(x, 0))
    with pytest.raises(EngineError, match="batch sizes"):
        ctx.execute({"x": x[:2]})
    ctx.release()
    assert isinstance(eng.create_context(), CudaSessionsContext)  # decided once per engine


def test_graphs_mode_refuses_what_cannot_be_captured(device, tmp_path):
    eng = _engine(tmp_path, sizes=(1, 4), dynamic=True, gpu_execution="graphs")
    with pytest.raises(EngineError, match="static non-batch dims"):
        eng.create_context()


def test_sessions_mode_and_any_size_without_allowed_sizes(device, tmp_path):
    ctx = _engine(tmp_path, gpu_execution="sessions").create_context()
    assert isinstance(ctx, CudaSessionsContext) and ctx.batch_sizes == (1, 2, 4, 8)
    assert "fallback_reason" not in ctx.describe()
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(ctx.execute({"x": x})["y"], _want(x), rtol=1e-6)
    ctx.release()
    anysize = _engine(tmp_path, sizes=None).create_context()
    assert anysize.batch_sizes is None
    x = np.ones((3, 4), np.float32)
    np.testing.assert_allclose(anysize.execute({"x": x})["y"], _want(x), rtol=1e-6)
    anysize.release()
    assert device.gpu.counts() == {"pinned": 0, "streams": 0}


def test_a_session_failure_goes_through_run_failure_with_its_message_on_one_line(device, tmp_path, monkeypatch):
    """The CUDA sessions context maps ONNX Runtime's failures as the CPU one does (engines.onnxruntime.cpu
    .run_failure: an input with a dimension of size 0 is the request's fault, tested there); any other failure is
    the engine's, its message on one line."""
    from engines.base import EngineInputError

    ctx = _engine(tmp_path, sizes=None).create_context()

    def fails(session, binding, run_options=None):
        raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT :\nInvalid input shape")

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", fails)
    with pytest.raises(EngineError, match="^onnxruntime \\(cuda\\): \\[ONNXRuntimeError\\] : 2 : INVALID_ARGUMENT : "
                                          "Invalid input shape$") as failed:
        ctx.execute({"x": np.ones((2, 4), np.float32)})
    assert not isinstance(failed.value, EngineInputError)
    device.drain()  # the failed run's uploads, still queued (real CUDA's cudaFree waits for them; the stand-in not)
    ctx.release()


# --------------------------------------------------------------------------- options


def test_precision_defaults_and_errors():
    assert resolve_precision(None, "cuda") == "tf32" and resolve_precision(None, "cpu") == "fp32"
    assert resolve_precision("fp16", "cuda") == "fp16"
    with pytest.raises(EngineError, match="needs a GPU"):
        resolve_precision("tf32", "cpu")
    with pytest.raises(EngineError, match="precision must be one of fp32, tf32, fp16"):
        resolve_precision("int8", "cuda")


def test_cuda_provider_options():
    name, opts = cuda_provider(1, 1234, "fp32", graphs=True, gpu_mem_limit=2 << 30,
                               arena_extend_strategy="kSameAsRequested")
    assert name == "CUDAExecutionProvider"
    assert opts == {"device_id": "1", "user_compute_stream": "1234", "do_copy_in_default_stream": "0",
                    "use_tf32": "0", "cudnn_conv_algo_search": "EXHAUSTIVE", "enable_cuda_graph": "1",
                    "gpu_mem_limit": str(2 << 30), "arena_extend_strategy": "kSameAsRequested"}
    assert cuda_provider(0, 1, "tf32", graphs=False)[1]["use_tf32"] == "1"
    assert cuda_provider(0, 1, "fp16", graphs=False)[1]["enable_cuda_graph"] == "0"


def test_invalid_engine_options(tmp_path):
    path = _affine(tmp_path / "m.onnx")
    with pytest.raises(EngineError, match="arena_extend_strategy must be one of"):
        OnnxRuntimeEngine(path, arena_extend_strategy="kDouble")
    with pytest.raises(EngineError, match="gpu_execution must be one of graphs, sessions, auto"):
        OnnxRuntimeEngine(path, gpu_execution="eager")
    with pytest.raises(EngineError, match="increasing distinct positive"):
        OnnxRuntimeEngine(path, batch_sizes=[4, 2])
    with pytest.raises(EngineError, match="needs a GPU"):
        OnnxRuntimeEngine(path, precision="fp16")


def test_fp16_copy_keeps_fp32_io_and_is_cached(tmp_path):
    pytest.importorskip("onnxconverter_common")
    src = tmp_path / "m.onnx"
    _affine(src)
    out = fp16_path(src, tmp_path / "cache")
    model = onnx.load(str(out))
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert {t.data_type for t in model.graph.initializer} == {TensorProto.FLOAT16}
    stamp = out.stat().st_mtime_ns
    assert fp16_path(src, tmp_path / "cache") == out and out.stat().st_mtime_ns == stamp  # converted once


def test_fp16_engine_on_the_stand_in_uses_the_converted_file(device, tmp_path):
    pytest.importorskip("onnxconverter_common")
    eng = _engine(tmp_path, precision="fp16")
    assert eng._plan.path.name.endswith("-fp16.onnx") and eng._plan.precision == "fp16"
    assert [s.datatype for s in eng.inputs] == ["FP32"]  # the model's own I/O


# --------------------------------------------------------------------------- the gate


def test_gate_waits_for_readers_and_prefers_a_waiting_capture():
    gate = CaptureGate()
    order = []
    reader_in, release_reader = threading.Event(), threading.Event()

    def reader():
        with gate.shared():
            reader_in.set()
            release_reader.wait()
            order.append("first reader out")

    def writer():
        with gate.exclusive():
            order.append("capture")

    def late_reader():
        with gate.shared():
            order.append("late reader")

    r = threading.Thread(target=reader)
    r.start()
    reader_in.wait()
    w = threading.Thread(target=writer)
    w.start()
    while not gate._writers_waiting:  # the capture is queued behind the reader
        threading.Event().wait(0.001)
    late = threading.Thread(target=late_reader)
    late.start()
    while True:  # the late reader is blocked behind the waiting capture
        with gate._cond:
            if gate._readers == 1 and gate._writers_waiting == 1:
                break
    release_reader.set()
    for t in (r, w, late):
        t.join()
    assert order == ["first reader out", "capture", "late reader"]
    assert gate.captures == 1


# --------------------------------------------------------------------------- the GPU check's own code


def test_gpu_check_runs_its_thread_arrangement_on_the_stand_in(device, monkeypatch, capsys):
    """bench.gpu_check's code paths (creation, every size, padding, concurrency, the report) on the stand-in, so
    the device session spends its minutes on the GPU, not on typos; worker processes cannot carry the stand-in."""
    from bench import gpu_check

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert gpu_check.main(["--models", "tiny_cnn", "--arrangements", "threads", "--seconds", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out
    assert "'execution': 'cuda_graphs'" in out and "padded 3 -> 4 rows" in out
    assert out.count("rows/s") == 3  # 1, 2 and 4 contexts


async def test_the_batchers_executor_runs_batches_on_the_contexts_own_thread(device, tmp_path):
    from batcher.executor import ThreadExecutor

    ctx = _engine(tmp_path).create_context()
    owner = ctx.executor.submit(threading.get_ident).result()
    ex = ThreadExecutor(ctx, "t")
    seen = await ex.submit(lambda c, x: (threading.get_ident(), c.execute({"x": x})["y"]), np.ones((2, 4), np.float32))
    assert seen[0] == owner  # no hop: the batch ran on the thread that captured the graphs
    np.testing.assert_allclose(seen[1], _want(np.ones((2, 4))), rtol=1e-6)
    ex.close()
    assert ctx.executor is None and device.gpu.counts() == {"pinned": 0, "streams": 0}


async def test_the_batchers_pipeline_launches_and_collects_on_the_contexts_own_thread(device, tmp_path):
    from batcher.batching import Pending, shape_key
    from batcher.executor import ThreadExecutor

    ctx = _engine(tmp_path).create_context()
    owner = ctx.executor.submit(threading.get_ident).result()
    seen: list[tuple[str, int]] = []
    for name in ("launch", "collect"):
        real = getattr(ctx, name)
        setattr(ctx, name, lambda arg, real=real, name=name: (seen.append((name, threading.get_ident())), real(arg))[1])
    ex = ThreadExecutor(ctx, "t")
    xs = [np.full((n, 4), float(n), np.float32) for n in (3, 1, 8)]
    batches = [[Pending({"x": x}, len(x), shape_key({"x": x}), arrival=0.0)] for x in xs]
    results = await asyncio.gather(*(ex.pipeline((b, "m", None, lambda: 0.0, (1, 2, 4, 8), True), slot)
                                     for slot, b in enumerate(batches)))
    for x, r in zip(xs, results):
        np.testing.assert_allclose(r.outcomes[0]["y"], _want(x), rtol=1e-6)  # 3 rows ran padded to 4
    assert [r.padded_rows for r in results] == [1, 0, 0]
    assert [r.device.busy_s for r in results] == [pytest.approx(0.002)] * 3  # the contexts' timing events
    assert sorted(name for name, _ in seen) == ["collect"] * 3 + ["launch"] * 3
    assert {thread for _, thread in seen} == {owner}
    ex.close()
    ex.close()  # twice: the context's thread is gone by then
    assert ctx.executor is None and device.gpu.counts() == {"pinned": 0, "streams": 0}


def test_the_raw_bench_measures_a_graph_context_batch_by_batch_and_one_batch_ahead(device, tmp_path):
    from bench.gpubench.raw import measure_context

    ctx = _engine(tmp_path).create_context()
    outstanding: list[int] = []  # batches launched and not collected, at each launch
    real_launch, real_collect = ctx.launch, ctx.collect

    def launch(inputs):
        handle = real_launch(inputs)
        outstanding.append(ctx.pipeline_depth - len(ctx._free_slots))
        return handle

    ctx.launch, ctx.collect = launch, real_collect
    rows = measure_context(ctx, np.ones((8, 4), np.float32), 0.02, sizes=(1, 8), name="x")
    assert [r["batch"] for r in rows] == [1, 8, "mixed"]
    assert all(set(r) == {"batch", "ms_per_batch", "rows_per_s", "sequential_rows_per_s", "device_ms_per_batch"}
               for r in rows)
    # the device's time per batch from the context's timing events: its H2D and D2H copy, 1 ms each on the fake
    assert [r["device_ms_per_batch"] for r in rows] == [2.0, 2.0, 2.0]
    assert max(outstanding) == 2  # each batch launched while the one before it was still on the device
    assert sorted(ctx._free_slots) == [0, 1]  # every launched batch collected
    ctx.release()


def test_back_to_back_parts_join_only_inside_one_locked_range():
    from engines.onnxruntime.cuda import contiguous_runs

    a = np.zeros((6, 4), np.float32)
    parts = [a[0:1], a[1:3], a[3:4], a[5:6]]  # 0-3 back to back, then a gap
    base = a.ctypes.data
    assert contiguous_runs(parts, lambda ptr, n: True) == [(base, 64), (base + 80, 16)]
    # a range boundary after row 2 (two adjacent mappings, each registered on its own): rows 0-2 | 3 | 5
    assert contiguous_runs(parts, lambda ptr, n: ptr + n <= base + 48 or ptr >= base + 48) == [
        (base, 48), (base + 48, 16), (base + 80, 16)]


def test_parts_addresses_given_are_the_ones_joined():
    from engines.onnxruntime.cuda import contiguous_runs

    a = np.zeros((6, 4), np.float32)
    parts = [a[0:1], a[1:3], a[5:6]]
    base = a.ctypes.data
    assert contiguous_runs(parts, lambda ptr, n: True, [p.ctypes.data for p in parts]) == [(base, 48), (base + 80, 16)]


def test_the_range_found_last_is_tried_first_and_forgotten_when_it_goes(monkeypatch):
    """page_locked's last-range shortcut answers exactly as the scan: not past the range's end, not in a range next to
    it that is registered on its own, and not after the range is untracked."""
    from engines.cuda import memory

    monkeypatch.setattr(memory, "_LOCKED", {})
    monkeypatch.setattr(memory, "_last", (1, 0))
    assert not memory.page_locked(0, 0)  # nothing is page-locked
    memory._track(4096, 4096)
    memory._track(8192, 4096)  # adjacent, its own registration
    assert memory.page_locked(4096 + 100, 200) and memory._last == (4096, 8192)
    assert memory.page_locked(4096, 4096)
    assert not memory.page_locked(8000, 400)  # spans both ranges: neither holds it
    assert memory.page_locked(8192, 10) and memory._last == (8192, 12288)
    memory._untrack(8192)
    assert not memory.page_locked(8192, 10)
    assert memory.page_locked(5000, 10)


def test_device_times_come_from_timing_events_around_each_batch(device, tmp_path):
    """Busy: the fake clock's ops between a batch's start and end events (its H2D and D2H copy, 1 ms each);
    idle: the clock between the previous batch's end and this one's start (advanced by hand: the host late)."""
    ctx = _engine(tmp_path).create_context()
    assert ctx.device_times() is None  # nothing collected yet (the captures are not counted)
    x = ctx.host_buffer("x", (2, 4), np.float32)
    x[...] = 1.0
    ctx.execute({"x": x})
    # the H2D and the D2H copy, 1 ms each on the fake clock; no idle time before a context's first batch (the
    # time since it was created)
    assert ctx.device_times() == DeviceTimes(pytest.approx(0.002), None)
    device.gpu.clock_ms += 5.0  # the device sits idle 5 ms before the next batch is sent
    ctx.execute({"x": x})
    assert ctx.device_times() == DeviceTimes(pytest.approx(0.002), pytest.approx(0.005))
    # two batches launched one behind the other: the second is queued behind the first, no idle gap
    y = ctx.host_buffer("x", (4, 4), np.float32, slot=1)
    y[...] = 2.0
    device.gpu.clock_ms += 3.0  # the host 3 ms late for the first of them: its idle gap
    a, b = ctx.launch({"x": x}), ctx.launch({"x": y})
    device.drain()
    ctx.collect(a)
    assert ctx.device_times() == DeviceTimes(pytest.approx(0.002), pytest.approx(0.003))
    ctx.collect(b)
    assert ctx.device_times() == DeviceTimes(pytest.approx(0.002), 0.0)
    for _ in range(4):  # around the ring of event pairs more than once: every pair is the batch's own
        device.gpu.clock_ms += 1.0
        ctx.execute({"x": x})
        assert ctx.device_times() == DeviceTimes(pytest.approx(0.002), pytest.approx(0.001))
    ctx.release()
    assert device.gpu.counts() == {"pinned": 0, "streams": 0}


def test_device_timing_off_records_no_timing_events(device, tmp_path, monkeypatch):
    monkeypatch.setattr(CudaGraphContext, "device_timing", False)
    ctx = _engine(tmp_path).create_context()
    records = device.gpu.calls["cudaEventRecord"]
    ctx.execute({"x": np.ones((2, 4), np.float32)})
    assert device.gpu.calls["cudaEventRecord"] - records == 1  # only the batch's own end event
    assert ctx.device_times() is None
    ctx.release()


@pytest.mark.parametrize("blocking", [False, True])
def test_blocking_sync_sets_the_wait_events_flag(device, tmp_path, monkeypatch, blocking):
    monkeypatch.setattr(CudaGraphContext, "blocking_sync", blocking)
    before = set(device.gpu.event_flags)
    ctx = _engine(tmp_path).create_context()
    flags = [f for e, f in device.gpu.event_flags.items() if e not in before]
    waits = [f for f in flags if f & 2]  # cudaEventDisableTiming: the events waited for; timing pairs have 0 or 1
    assert len(waits) == ctx.pipeline_depth
    assert waits == [3 if blocking else 2] * ctx.pipeline_depth  # cudaEventBlockingSync = 1
    assert all(f == 0 for f in flags if not f & 2)  # the timing events never block
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_allclose(ctx.execute({"x": x})["y"], _want(x), rtol=1e-6)  # waited on the flagged event
    ctx.release()
