"""The CUDA calls made with the GIL held (engines/cuda/held.py): their C signatures against the real bindings'
declarations, when they are used, and the layer's copies, memsets and event records through them on the stand-in
GPU (tests/fake_cuda.py, whose runtime calls a stand-in driver forwards to). The real driver runs them in
tests/gpu."""

from __future__ import annotations

import ctypes
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import engines.cuda as cuda
from engines.cuda import CudaError, held
from fake_cuda import FakeCuda

#: ctypes types of the C types in cuda.bindings' ``cydriver.pxd`` declarations
C_TYPES = {"CUdeviceptr": ctypes.c_uint64, "const void*": ctypes.c_void_p, "void*": ctypes.c_void_p,
           "size_t": ctypes.c_size_t, "CUstream": ctypes.c_void_p, "CUevent": ctypes.c_void_p,
           "unsigned char": ctypes.c_ubyte, "CUresult": ctypes.c_int, "const char**": ctypes.POINTER(ctypes.c_char_p)}


def test_prototypes_match_the_real_bindings_declarations():
    bindings = pytest.importorskip("cuda.bindings")
    pxd = (Path(bindings.__file__).parent / "cydriver.pxd").read_text()
    assert re.search(r"ctypedef unsigned long long CUdeviceptr_v2\b", pxd)  # CUdeviceptr is 64-bit
    for name, args in held.PROTOTYPES.items():
        c_name = name.removesuffix("_v2")  # cuda.h maps the name to its _v2 symbol (64-bit sizes), as the .pxd
        found = re.search(rf"cdef CUresult {c_name}\(([^)]*)\)", pxd)
        assert found, name
        params = [re.sub(r"\s+\w+$", "", p.strip()).replace(" *", "*") for p in found.group(1).split(",")]
        assert [C_TYPES[p] for p in params] == list(args), (name, params)


def test_no_held_calls_under_an_injected_runtime_or_when_turned_off(monkeypatch):
    with cuda.use_runtime(FakeCuda().cudart):
        assert held.driver() is None
    monkeypatch.setattr(held, "ENABLED", False)
    assert held.driver() is None


def test_no_driver_library_means_none(monkeypatch):
    monkeypatch.setattr(held, "LIBRARY", "libcuda-that-is-not-here.so.1")
    monkeypatch.setattr(held, "_loaded", [])
    assert held.driver() is None


class FakeDriver:
    """The driver calls of :data:`held.PROTOTYPES` over the stand-in runtime (the same handles, ints there)."""

    def __init__(self, cudart) -> None:
        self.cudart, self.calls = cudart, Counter()
        self.fail: dict[str, int] = {}

    def _call(self, name: str, result) -> int:
        self.calls[name] += 1
        if name in self.fail:
            return self.fail.pop(name)
        err = result[0] if isinstance(result, tuple) else result
        return int(err)

    def cuMemcpyHtoDAsync_v2(self, dst, src, n, stream):
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        return self._call("cuMemcpyHtoDAsync_v2", self.cudart.cudaMemcpyAsync(dst, src, n, kind, stream))

    def cuMemcpyDtoHAsync_v2(self, dst, src, n, stream):
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        return self._call("cuMemcpyDtoHAsync_v2", self.cudart.cudaMemcpyAsync(dst, src, n, kind, stream))

    def cuMemsetD8Async(self, dst, value, n, stream):
        return self._call("cuMemsetD8Async", self.cudart.cudaMemsetAsync(dst, value, n, stream))

    def cuEventRecord(self, event, stream):
        return self._call("cuEventRecord", self.cudart.cudaEventRecord(event, stream))

    def cuGetErrorName(self, code, out):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_char_p))[0] = b"CUDA_ERROR_INVALID_CONTEXT"
        return 0


@pytest.fixture
def fake_driver(monkeypatch):
    fake = FakeCuda()
    with cuda.use_runtime(fake.cudart):
        drv = FakeDriver(fake.cudart)
        monkeypatch.setattr(held, "driver", lambda: drv)
        yield fake, drv


def test_copies_between_page_locked_memory_and_the_device_go_held(fake_driver):
    fake, drv = fake_driver
    stream = cuda.Stream()
    src, out = cuda.PinnedBuffer(64), cuda.PinnedBuffer(64)
    src.array[:] = np.arange(64, dtype=np.uint8)
    dev = cuda.DeviceBuffer(64)
    before = fake.gpu.calls["cudaMemcpyAsync"]
    dev.copy_from_host_async(src.ptr, 64, stream)
    cuda.memset_async(dev.ptr + 48, 7, 16, stream)
    dev.copy_to_host_async(out.ptr, 64, stream)
    event = cuda.Event(timing=False)
    event.record(stream)
    assert not out.array.any()  # queued, not run
    event.synchronize()
    stream.synchronize()
    assert list(out.array) == list(range(48)) + [7] * 16
    assert drv.calls == Counter(cuMemcpyHtoDAsync_v2=1, cuMemsetD8Async=1, cuMemcpyDtoHAsync_v2=1, cuEventRecord=1)
    assert fake.gpu.calls["cudaMemcpyAsync"] - before == 2  # the stand-in driver's own forwards, nothing else
    for buf in (src, out, dev):
        buf.free()
    event.destroy()
    stream.destroy()


def test_pageable_host_memory_and_device_to_device_copies_stay_with_cuda_python(fake_driver):
    fake, drv = fake_driver
    stream, dev, dev2 = cuda.Stream(), cuda.DeviceBuffer(16), cuda.DeviceBuffer(16)
    pageable = np.zeros(16, np.uint8)
    with pytest.raises(CudaError, match=r"cudaMemcpyAsync H2D 'x' 16 B failed: cudaErrorInvalidValue"):
        dev.copy_from_host_async(pageable.ctypes.data, 16, stream, "'x'")  # the fake refuses pageable DMA
    cuda.memcpy_async(dev2.ptr, dev.ptr, 16, "D2D", stream)
    assert drv.calls == Counter()
    stream.synchronize()


def test_batched_copies_from_page_locked_memory_go_one_held_call_each(fake_driver):
    fake, drv = fake_driver
    stream, src, dev, out = cuda.Stream(), cuda.PinnedBuffer(96), cuda.DeviceBuffer(96), cuda.PinnedBuffer(96)
    src.array[:] = np.arange(96, dtype=np.uint8)
    cuda.memcpy_batch_async([(dev.ptr + 64, src.ptr, 32), (dev.ptr, src.ptr + 32, 64)], stream, "'x'")
    dev.copy_to_host_async(out.ptr, 96, stream)
    stream.synchronize()
    assert list(out.array) == list(range(32, 96)) + list(range(32))
    assert drv.calls["cuMemcpyHtoDAsync_v2"] == 2 and fake.gpu.calls["cudaMemcpyBatchAsync"] == 0


def test_a_failed_held_call_raises_naming_the_call_and_the_driver_error(fake_driver):
    fake, drv = fake_driver
    stream, src, dev = cuda.Stream(), cuda.PinnedBuffer(16), cuda.DeviceBuffer(16)
    drv.fail["cuMemcpyHtoDAsync_v2"] = 201
    with pytest.raises(CudaError, match=r"cuMemcpyHtoDAsync 'in' 16 B failed: CUDA_ERROR_INVALID_CONTEXT \(201\)"):
        dev.copy_from_host_async(src.ptr, 16, stream, "'in'")
    drv.fail["cuEventRecord"] = 400
    with pytest.raises(CudaError, match=r"cuEventRecord failed: CUDA_ERROR_INVALID_CONTEXT \(400\)"):
        cuda.Event().record(stream)

