"""The CUDA layer (engines/cuda) on the stand-in runtime (tests/fake_cuda.py): the seam, the error type, devices,
streams, events, graphs, pinned/device/registered/IPC memory (ONNX Runtime's CUDA contexts on top of it:
test_onnxruntime_cuda.py)."""

from __future__ import annotations

import ctypes
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import pytest

import engines.cuda as cuda
from engines.base import EngineError
from engines.cuda import CudaError
from engines.tensorrt import TensorRTError
from fake_cuda import FakeCuda


@pytest.fixture
def fake():
    f = FakeCuda()
    with cuda.use_runtime(f.cudart):
        yield f


def pinned_with(data: bytes) -> cuda.PinnedBuffer:
    buf = cuda.PinnedBuffer(len(data))
    buf.array[:] = np.frombuffer(data, np.uint8)
    return buf


# =========================================================================== seam, errors


def test_use_runtime_injects_and_restores():
    first, second = FakeCuda().cudart, FakeCuda().cudart
    with cuda.use_runtime(first):
        assert cuda.runtime() is first
        with cuda.use_runtime(second):
            assert cuda.runtime() is second
        assert cuda.runtime() is first
    assert cuda.set_runtime(first) is None
    assert cuda.set_runtime(None) is first


def test_real_runtime_is_cuda_python_when_nothing_is_injected():
    real = pytest.importorskip("cuda.bindings.runtime")
    assert cuda.runtime() is real


def test_one_error_type():
    assert issubclass(CudaError, EngineError)
    assert issubclass(TensorRTError, EngineError) and not issubclass(TensorRTError, CudaError)


def test_check_unpacks_results_and_names_the_error(fake):
    E = fake.cudart.cudaError_t
    assert cuda.check((E.cudaSuccess,), "f") is None
    assert cuda.check(E.cudaSuccess, "f") is None
    assert cuda.check((E.cudaSuccess, 7), "f") == 7
    assert cuda.check((E.cudaSuccess, 1, 2), "f") == (1, 2)
    with pytest.raises(CudaError, match=r"^cudaMalloc\(64\) failed: cudaErrorMemoryAllocation \(fake error 2\)$"):
        cuda.check((E.cudaErrorMemoryAllocation, 0), "cudaMalloc(64)")


def test_injected_failure_is_a_cuda_error_naming_the_call(fake):
    fake.gpu.inject["cudaStreamCreateWithFlags"] = fake.cudart.cudaError_t.cudaErrorInvalidValue
    with pytest.raises(CudaError, match=r"cudaStreamCreateWithFlags\(cudaStreamNonBlocking\).*cudaErrorInvalidValue"):
        cuda.Stream()


# =========================================================================== devices


def test_devices(fake):
    fake.gpu.device_count = 2
    assert cuda.device_count() == 2
    cuda.set_device(1)
    with pytest.raises(CudaError, match=r"cudaSetDevice\(5\).*cudaErrorInvalidDevice"):
        cuda.set_device(5)
    with pytest.raises(CudaError, match="device 2 does not exist \\(2 device"):
        cuda.require_device(2)
    assert cuda.compute_capability(0) == (9, 0)
    assert cuda.mem_get_info() == (fake.gpu.total_memory, fake.gpu.total_memory)
    cuda.DeviceBuffer(1000)
    assert cuda.mem_get_info(1) == (fake.gpu.total_memory - 1000, fake.gpu.total_memory)


def test_no_device(fake):
    fake.gpu.device_count = 0
    with pytest.raises(CudaError, match="cudaGetDeviceCount.*cudaErrorNoDevice"):
        cuda.require_device(0)
    with pytest.raises(CudaError, match="cudaErrorNoDevice"):
        cuda.mem_get_info(0)


# =========================================================================== memory, copies


def test_pinned_buffer_views_and_free(fake):
    buf = cuda.PinnedBuffer(48)
    assert buf.ptr in fake.gpu.host and buf.nbytes == 48
    view = buf.view((3, 4), np.float32)
    view[:] = 1.5
    assert view.ctypes.data == buf.ptr and buf.array[:4].view(np.float32)[0] == 1.5
    with pytest.raises(CudaError, match="48 bytes cannot hold 52"):
        buf.view((13,), np.float32)
    buf.free()
    buf.free()  # idempotent
    assert buf.ptr == 0 and buf.array.size == 0 and fake.gpu.host == {}
    assert cuda.PinnedBuffer(0).nbytes == 1  # cudaMallocHost(0) gives no usable address


def test_copies_are_queued_until_the_stream_is_synchronized(fake):
    stream = cuda.Stream()
    src = pinned_with(bytes(range(32)))
    dev, dev2, out = cuda.DeviceBuffer(32), cuda.DeviceBuffer(32), cuda.PinnedBuffer(32)
    dev.copy_from_host_async(src.ptr, 32, stream)
    cuda.memcpy_async(dev2.ptr, dev.ptr, 32, "D2D", stream)
    dev2.copy_to_host_async(out.ptr, 32, stream)
    assert not out.array.any()  # nothing has run yet
    stream.synchronize()
    assert bytes(out.array) == bytes(range(32))
    with pytest.raises(ValueError, match="direction"):
        cuda.memcpy_async(dev.ptr, src.ptr, 32, "H2H", stream)
    for buf in (src, dev, dev2, out):
        buf.free()
    stream.destroy()
    stream.destroy()
    assert fake.gpu.counts() == {"pinned": 0, "streams": 0}


def test_copy_error_names_direction_label_and_size(fake):
    stream, dev = cuda.Stream(), cuda.DeviceBuffer(16)
    pageable = np.zeros(16, np.uint8)  # not page-locked: the fake refuses it as a DMA source
    with pytest.raises(CudaError, match=r"cudaMemcpyAsync H2D 'x' 16 B failed: cudaErrorInvalidValue"):
        dev.copy_from_host_async(pageable.ctypes.data, 16, stream, "'x'")


def test_free_failure_is_raised_once_and_never_retried(fake):
    dev = cuda.DeviceBuffer(8)
    fake.gpu.inject["cudaFree"] = fake.cudart.cudaError_t.cudaErrorInvalidValue
    with pytest.raises(CudaError, match=r"cudaFree\(0x7"):
        dev.free()
    dev.free()
    assert fake.gpu.calls["cudaFree"] == 1


def test_host_registration_of_a_shared_memory_slot(fake):
    shm = SharedMemory(create=True, size=64)
    try:
        slot = np.frombuffer(shm.buf, np.uint8)
        slot[:] = np.arange(64, dtype=np.uint8)
        ptr = slot.ctypes.data
        stream, dev, out = cuda.Stream(), cuda.DeviceBuffer(64), cuda.PinnedBuffer(64)
        with pytest.raises(CudaError, match="cudaErrorInvalidValue"):  # pageable until registered
            dev.copy_from_host_async(ptr, 64, stream)
        reg = cuda.HostRegistration(ptr, 64, read_only=True)
        with pytest.raises(CudaError, match="cudaHostRegister.*cudaErrorHostMemoryAlreadyRegistered"):
            cuda.HostRegistration(ptr + 8, 8)
        dev.copy_from_host_async(ptr, 64, stream)  # H2D reads the slot itself: no staging copy
        dev.copy_to_host_async(out.ptr, 64, stream)
        stream.synchronize()
        assert bytes(out.array) == bytes(range(64))
        reg.unregister()
        reg.unregister()  # idempotent
        assert fake.gpu.registered == {} and fake.gpu.calls["cudaHostUnregister"] == 1
        del slot
    finally:
        shm.close()
        shm.unlink()


def test_host_registration_flags(fake):
    buf = (ctypes.c_uint8 * 32)()
    fake.gpu.host_register_read_only = False
    with pytest.raises(CudaError, match=r"cudaHostRegister\(0x[0-9a-f]+, 32, 8\).*cudaErrorNotSupported"):
        cuda.HostRegistration(ctypes.addressof(buf), 32, read_only=True)
    with pytest.raises(CudaError, match="cudaErrorInvalidValue"):
        cuda.HostRegistration(ctypes.addressof(buf), 0)
    cuda.HostRegistration(ctypes.addressof(buf), 32).unregister()


def test_ipc_memory_opens_another_process_region(fake):
    exporter = cuda.DeviceBuffer(32)  # stands for the client's cudaMalloc
    stream, src = cuda.Stream(), pinned_with(bytes(range(100, 132)))
    exporter.copy_from_host_async(src.ptr, 32, stream)
    handle = fake.gpu.export_ipc(exporter.ptr)
    region = cuda.IpcMemory(handle, 32)
    assert region.ptr and region.nbytes == 32 and fake.gpu.counts()["ipc_open"] == 1
    dev, out = cuda.DeviceBuffer(32), cuda.PinnedBuffer(32)
    cuda.memcpy_async(dev.ptr, region.ptr, 32, "D2D", stream)
    dev.copy_to_host_async(out.ptr, 32, stream)
    stream.synchronize()
    assert bytes(out.array) == bytes(range(100, 132))
    region.close()
    region.close()  # idempotent
    assert "ipc_open" not in fake.gpu.counts() and exporter.ptr in fake.gpu.device  # the exporter keeps its memory
    with pytest.raises(CudaError, match="64 bytes, got 3"):
        cuda.IpcMemory(b"abc", 32)
    with pytest.raises(CudaError, match="cudaIpcOpenMemHandle.*cudaErrorInvalidResourceHandle"):
        cuda.IpcMemory(bytes(64), 32)


# =========================================================================== events


def test_event_timing(fake):
    stream, start, end = cuda.Stream(), cuda.Event(), cuda.Event()
    src, dev = pinned_with(bytes(16)), cuda.DeviceBuffer(16)
    start.record(stream)
    for _ in range(3):
        dev.copy_from_host_async(src.ptr, 16, stream)
    end.record(stream)
    with pytest.raises(CudaError, match="cudaEventElapsedTime.*cudaErrorNotReady"):
        end.elapsed_ms(start)
    end.synchronize()
    assert end.elapsed_ms(start) == pytest.approx(3 * fake.gpu.op_ms)
    with pytest.raises(CudaError, match="cudaErrorInvalidResourceHandle"):
        end.elapsed_ms(cuda.Event())  # never recorded
    untimed = cuda.Event(timing=False)
    untimed.record(stream)
    untimed.synchronize()
    with pytest.raises(CudaError, match="cudaErrorInvalidResourceHandle"):
        untimed.elapsed_ms(start)
    for event in (start, end, untimed):
        event.destroy()
        event.destroy()
    assert fake.gpu.calls["cudaEventDestroy"] == 3


# =========================================================================== graphs


def test_graph_replays_the_captured_copies_reading_memory_at_launch(fake):
    stream, src, dev, out = cuda.Stream(), pinned_with(b"\x01" * 8), cuda.DeviceBuffer(8), cuda.PinnedBuffer(8)

    def enqueue() -> None:
        dev.copy_from_host_async(src.ptr, 8, stream)
        dev.copy_to_host_async(out.ptr, 8, stream)

    graph = cuda.Graph.capture(stream, enqueue)
    stream.synchronize()
    assert not out.array.any()  # capture records, it does not run
    assert fake.gpu.counts()["graph_execs"] == 1 and "graphs" not in fake.gpu.counts()  # the template is gone
    graph.launch(stream)
    stream.synchronize()
    assert bytes(out.array) == b"\x01" * 8
    src.array[:] = 7  # same addresses, new data: the graph reads it when it runs
    graph.launch(stream)
    stream.synchronize()
    assert bytes(out.array) == b"\x07" * 8
    graph.destroy()
    graph.destroy()
    assert "graph_execs" not in fake.gpu.counts()
    with pytest.raises(CudaError, match="destroyed graph"):
        graph.launch(stream)


def test_capture_uses_thread_local_mode(fake):
    modes = []
    cuda.Graph.capture(stream := cuda.Stream(), lambda: modes.append(fake.gpu.capturing[stream.handle]["mode"]))
    assert modes == [int(fake.cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)]


def test_failed_capture_leaves_the_stream_usable_and_leaks_nothing(fake):
    stream = cuda.Stream()

    def boom() -> None:
        raise RuntimeError("enqueue failed")

    with pytest.raises(RuntimeError, match="enqueue failed"):
        cuda.Graph.capture(stream, boom)
    with pytest.raises(CudaError, match=r"cudaMalloc\(8\).*cudaErrorStreamCaptureUnsupported"):
        cuda.Graph.capture(stream, lambda: cuda.DeviceBuffer(8))  # cudaMalloc is not allowed while capturing
    with pytest.raises(CudaError, match="cudaStreamSynchronize.*cudaErrorStreamCaptureUnsupported"):
        cuda.Graph.capture(stream, stream.synchronize)

    def swallowing_sync() -> None:
        try:
            stream.synchronize()
        except CudaError:
            pass

    with pytest.raises(CudaError, match="cudaStreamEndCapture.*cudaErrorStreamCaptureInvalidated"):
        cuda.Graph.capture(stream, swallowing_sync)  # the capture was lost all the same
    assert fake.gpu.capturing == {} and fake.gpu.graphs == {} and fake.gpu.graph_execs == {}
    stream.synchronize()  # out of capture mode
