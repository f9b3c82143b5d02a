"""GPU tests: the CUDA code paths on a real device (skipped without onnxruntime-gpu and a CUDA device).

Not part of CI (pytest's testpaths are tests/unit and tests/integration). On the GPU machine:
``python -m bench.gpu_bench --parts t`` runs them and keeps their output in ``bench/results/gpu/gpu_tests.txt``
(or ``python -m pytest tests/gpu -v``).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
if "CUDAExecutionProvider" not in ort.get_available_providers():
    pytest.skip("needs onnxruntime-gpu (CUDAExecutionProvider)", allow_module_level=True)
cuda = pytest.importorskip("engines.cuda")
try:
    cuda.require_device(0)
except cuda.CudaError as exc:
    pytest.skip(f"no usable CUDA device: {exc}", allow_module_level=True)

from engines.base import EngineError  # noqa: E402
from engines.multiproc import MultiprocEngine  # noqa: E402
from engines.onnxruntime import CudaGraphContext, CudaSessionsContext, OnnxRuntimeEngine  # noqa: E402
from engines.zoo import resolve  # noqa: E402

SIZES = (1, 2, 4, 8)
TF32 = 2e-2  # max |gpu - cpu| / max |cpu|


def images(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 3, 224, 224)).astype(np.float32)


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def cpu_reference():
    cache: dict[str, np.ndarray] = {}

    def ref(model: str) -> np.ndarray:
        if model not in cache:
            eng = OnnxRuntimeEngine(resolve(f"zoo:{model}"), device="cpu", intra_op_threads=0)
            ctx = eng.create_context()
            cache[model] = ctx.execute({"input": images(8)})["logits"].astype(np.float64)
            ctx.release()
            eng.release()
        return cache[model]

    return ref


@pytest.mark.parametrize("model", ["tiny_cnn", "mid_cnn", "resnet18"])
def test_graph_context_matches_cpu_at_every_size_and_padded(model, cpu_reference):
    want = cpu_reference(model)
    eng = OnnxRuntimeEngine(resolve(f"zoo:{model}"), device="cuda", batch_sizes=SIZES, gpu_execution="graphs")
    ctx = eng.create_context()
    try:
        assert isinstance(ctx, CudaGraphContext) and ctx.describe()["execution"] == "cuda_graphs"
        assert ctx.device_nbytes > 0
        x = images(8)
        for n in SIZES:
            assert relative(ctx.execute({"input": x[:n]})["logits"], want[:n]) < TF32
        padded = np.zeros((4, 3, 224, 224), np.float32)
        padded[:3] = x[:3]
        assert relative(ctx.execute({"input": padded})["logits"][:3], want[:3]) < TF32
        staged = ctx.host_buffer("input", (2, 3, 224, 224), np.float32)
        staged[...] = x[:2]
        assert relative(ctx.execute({"input": staged})["logits"], want[:2]) < TF32
        with pytest.raises(EngineError, match="batch sizes"):
            ctx.execute({"input": x[:3]})
    finally:
        ctx.release()
        eng.release()


@pytest.mark.parametrize("model", ["tiny_cnn", "resnet18"])
def test_two_batches_launched_before_either_is_collected_match_cpu(model, cpu_reference):
    """The device pipeline's order (batcher.device_pipeline.DevicePipeline): the next batch is launched behind the running
    one, on the same stream and device buffers, then both are collected; each reads its own outputs."""
    want = cpu_reference(model)
    eng = OnnxRuntimeEngine(resolve(f"zoo:{model}"), device="cuda", batch_sizes=SIZES, gpu_execution="graphs")
    ctx = eng.create_context()
    try:
        x = images(8)
        for a, b in ((8, 4), (1, 8), (2, 2)):
            first = ctx.launch({"input": x[:a]})
            second = ctx.launch({"input": x[8 - b:]})
            time.sleep(0.05)  # both long done on the device before the first is read
            assert relative(ctx.collect(first)["logits"], want[:a]) < TF32
            assert relative(ctx.collect(second)["logits"], want[8 - b:]) < TF32
    finally:
        ctx.release()
        eng.release()


def test_blocking_sync_waits_without_spinning_and_matches_cpu(monkeypatch, cpu_reference):
    """``server.cuda_blocking_sync``: the context's thread sleeps while its batch runs (``cudaEventBlockingSync``),
    so its CPU time over the waits is a small part of their wall time (spinning, it is about all of it), and the
    outputs are those of the CPU."""
    monkeypatch.setattr(CudaGraphContext, "blocking_sync", True)
    want = cpu_reference("resnet18")
    eng = OnnxRuntimeEngine(resolve("zoo:resnet18"), device="cuda", batch_sizes=(8, 32), gpu_execution="graphs")
    ctx = eng.create_context()
    try:
        x = ctx.host_buffer("input", (32, 3, 224, 224), np.float32)  # pinned: no host copy in the CPU time
        x[...] = np.concatenate([images(8)] * 4)
        ctx.execute({"input": x})  # warm

        def waits():  # on the context's own thread, whose CPU time is the wait's
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(30):
                out = ctx.collect(ctx.launch({"input": x}))["logits"]
            return time.perf_counter() - wall, time.thread_time() - cpu, out

        wall, cpu, out = ctx._thread.call(waits)
        assert relative(out[:8], want) < TF32 and relative(out[24:], want) < TF32
        assert cpu < 0.5 * wall, (cpu, wall)
    finally:
        ctx.release()
        eng.release()


def test_device_times_of_a_batch_queued_behind_another_show_no_idle_gap():
    """CUDA timing events around each batch (engines.base.DeviceTimes): a batch launched behind the running one
    starts as it ends (idle 0), one sent after a host pause of 20 ms shows that pause; busy is the batch's own
    copies and kernels, far less than the pause."""
    eng = OnnxRuntimeEngine(resolve("zoo:resnet18"), device="cuda", batch_sizes=SIZES, gpu_execution="graphs")
    ctx = eng.create_context()
    try:
        x = images(8)
        ctx.execute({"input": x})
        assert ctx.device_times().idle_s is None  # the context's first batch
        time.sleep(0.02)
        ctx.execute({"input": x})
        alone = ctx.device_times()
        assert 0.015 < alone.idle_s < 1.0 and 0.0 < alone.busy_s < 0.01
        staged = [ctx.host_buffer("input", x.shape, x.dtype, slot=k) for k in (0, 1)]  # pinned: no wait to copy
        for buf in staged:
            buf[...] = x
        first = ctx.launch({"input": staged[0]})
        second = ctx.launch({"input": staged[1]})
        ctx.collect(first)
        ctx.collect(second)
        behind = ctx.device_times()
        assert behind.idle_s < 0.0001 and 0.0 < behind.busy_s < 0.01
    finally:
        ctx.release()
        eng.release()


def test_rows_read_in_place_from_registered_memory_match_cpu(cpu_reference):
    """The multi-process path: each request's rows where a front end wrote them (a ``cudaHostRegister``-ed area,
    scattered and back to back), one DMA per run, padding zeroed on the device, ``pipeline_depth`` batches on the
    device at once."""
    from multiprocessing.shared_memory import SharedMemory

    from engines.cuda import HostRegistration

    want = cpu_reference("resnet18")
    x = images(8)
    row = x[0].nbytes
    shm = SharedMemory(create=True, size=32 * row)
    base = np.frombuffer(shm.buf, np.uint8)
    registration = HostRegistration(base.ctypes.data, shm.size)
    eng = OnnxRuntimeEngine(resolve("zoo:resnet18"), device="cuda", batch_sizes=SIZES, gpu_execution="graphs")
    ctx = eng.create_context()
    try:
        def parts(offsets: list[int], first: int) -> list[np.ndarray]:
            views = [np.ndarray((1, 3, 224, 224), np.float32, buffer=shm.buf, offset=k * row) for k in offsets]
            for j, v in enumerate(views):
                v[...] = x[first + j:first + j + 1]
            return views

        cases = [(parts([0, 1, 2], 0), 4, 0), (parts([20, 9, 10, 11, 5], 3), 8, 3), (parts([30], 7), 1, 7)]
        launched = []
        for views, rows, first in cases:
            gathered = ctx.gather_rows("input", views, rows)
            assert gathered is not None  # page-locked in place: no host stacking
            launched.append((ctx.launch({"input": gathered}), len(views), first))
            if len(launched) == ctx.pipeline_depth:
                handle, n, at = launched.pop(0)
                assert relative(ctx.collect(handle)["logits"][:n], want[at:at + n]) < TF32
        for handle, n, at in launched:
            logits = ctx.collect(handle)["logits"]
            assert relative(logits[:n], want[at:at + n]) < TF32
    finally:
        ctx.release()
        eng.release()
        registration.unregister()
        del base
        shm.close()
        shm.unlink()


def test_fp32_graphs_match_the_cpu_closely(cpu_reference):
    eng = OnnxRuntimeEngine(resolve("zoo:resnet18"), device="cuda", batch_sizes=[8], precision="fp32")
    ctx = eng.create_context()
    try:
        assert relative(ctx.execute({"input": images(8)})["logits"], cpu_reference("resnet18")) < 1e-4
    finally:
        ctx.release()
        eng.release()


def test_sessions_per_size_match_the_cpu(cpu_reference):
    eng = OnnxRuntimeEngine(resolve("zoo:mid_cnn"), device="cuda", batch_sizes=[2, 8], gpu_execution="sessions")
    ctx = eng.create_context()
    try:
        assert isinstance(ctx, CudaSessionsContext)
        assert relative(ctx.execute({"input": images(8)[:2]})["logits"], cpu_reference("mid_cnn")[:2]) < TF32
    finally:
        ctx.release()
        eng.release()


@pytest.mark.parametrize("count", [2, 4])
def test_graph_contexts_on_threads_run_together_while_another_model_captures(count, cpu_reference):
    """The H200 probe's failure: graph contexts as threads of one process, one loading (capturing) while the
    others serve. Every batch must succeed and be right."""
    want = cpu_reference("resnet18")
    eng = OnnxRuntimeEngine(resolve("zoo:resnet18"), device="cuda", batch_sizes=SIZES)
    contexts = [eng.create_context() for _ in range(count)]
    x = images(8)
    errors: list[BaseException] = []
    done = [0] * count
    stop = threading.Event()

    def serve(i: int) -> None:
        try:
            k = 0
            while not stop.is_set():
                n = SIZES[k % len(SIZES)]
                assert relative(contexts[i].execute({"input": x[:n]})["logits"], want[:n]) < TF32
                done[i] += 1
                k += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    try:
        other = OnnxRuntimeEngine(resolve("zoo:mid_cnn"), device="cuda", batch_sizes=SIZES)
        loaded = other.create_context()  # captures 4 graphs while the threads above execute
        assert loaded.describe()["execution"] == "cuda_graphs"
        loaded.release()
        other.release()
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join()
        for c in contexts:
            c.release()
        eng.release()
    assert errors == []
    assert all(d > 0 for d in done)


def test_graph_contexts_in_worker_processes_read_registered_shared_memory(cpu_reference):
    want = cpu_reference("resnet18")
    eng = MultiprocEngine(resolve("zoo:resnet18"), device="cuda", batch_sizes=SIZES)
    ctx = eng.create_context()
    try:
        assert ctx.describe()["execution"] == "cuda_graphs" and ctx.describe()["process"] == "worker"
        assert ctx.batch_sizes == SIZES and ctx.device_nbytes > 0
        staged = ctx.host_buffer("input", (8, 3, 224, 224), np.float32)
        staged[...] = images(8)
        assert relative(ctx.execute({"input": staged})["logits"], want) < TF32
        assert relative(ctx.execute({"input": images(8)[:4]})["logits"], want[:4]) < TF32
    finally:
        ctx.release()
        eng.release()


def test_device_memory_is_returned_on_release():
    free0, _ = cuda.mem_get_info(0)
    eng = OnnxRuntimeEngine(resolve("zoo:resnet18"), device="cuda", batch_sizes=(1, 2, 4, 8, 16, 32))
    ctx = eng.create_context()
    held = ctx.device_nbytes
    free1, _ = cuda.mem_get_info(0)
    ctx.release()
    eng.release()
    free2, _ = cuda.mem_get_info(0)
    assert held > 0 and free0 - free1 >= held * 0.9
    assert free2 - free1 >= held * 0.5  # most of it comes back (ONNX Runtime keeps some process-wide state)


def test_held_calls_are_used_on_this_driver_and_move_the_bytes():
    """engines.cuda.held on the real driver: the layer's locked copies, batch, memset, D2D and events keep the GIL
    and give what the bindings give (the stand-in version: tests/unit/test_cuda_held.py)."""
    from engines.cuda.held import held

    cuda.set_device(0)
    calls = held()
    assert calls is not None, "a CUDA 13 driver: the held calls should be found"
    data = np.random.default_rng(0).integers(0, 255, 4096, dtype=np.uint8)
    src, back = cuda.PinnedBuffer(4096), cuda.PinnedBuffer(4096)
    src.array[:] = data
    dev, dev2 = cuda.DeviceBuffer(4096), cuda.DeviceBuffer(4096)
    stream, start, end = cuda.Stream(), cuda.Event(), cuda.Event()
    start.record(stream)
    cuda.memcpy_batch_async([(dev.ptr + 1024 * i, src.ptr + 1024 * i, 1024) for i in range(3)], stream, locked=True)
    cuda.memset_async(dev.ptr + 3072, 9, 1024, stream)
    cuda.memcpy_async(dev2.ptr, dev.ptr, 4096, "D2D", stream)
    dev2.copy_to_host_async(back.ptr, 4096, stream, locked=True)
    end.record(stream)
    stream.synchronize()
    assert bytes(back.array[:3072]) == bytes(data[:3072]) and set(back.array[3072:].tolist()) == {9}
    assert end.elapsed_ms(start) > 0
    assert calls.event_record(int(end.handle), int(stream.handle)) == 0
    for obj in (src, back, dev, dev2):
        obj.free()
    for obj in (start, end, stream):
        obj.destroy()
