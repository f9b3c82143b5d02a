"""Thin CUDA runtime helpers over cuda-python (``cuda.bindings.runtime``): streams, pinned host and device buffers.

Every call's error code is checked; a failure raises :class:`CudaError` (an :class:`EngineError`) naming the
CUDA function and error. Imported lazily by the GPU backends: CPU-only installs never need cuda-python.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .base import EngineError


class CudaError(EngineError):
    """A CUDA runtime call failed; the message names the call and the CUDA error."""


def runtime() -> Any:
    """The ``cuda.bindings.runtime`` module.

    Raises:
        CudaError: cuda-python is not installed (``pip install cuda-python``).
    """
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as exc:
        raise CudaError(f"cuda-python is needed for GPU execution (pip install cuda-python): {exc}") from None
    return cudart


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-python result tuple ``(err, *values)``; raise CudaError unless ``err`` is success."""
    cudart = runtime()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        name = getattr(err, "name", str(err))
        raise CudaError(f"{what} failed: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def mem_get_info() -> tuple[int, int]:
    """``(free, total)`` device memory in bytes of the current device (``cudaMemGetInfo``)."""
    return check(runtime().cudaMemGetInfo(), "cudaMemGetInfo")


class Stream:
    """A non-blocking CUDA stream (``cudaStreamCreateWithFlags(cudaStreamNonBlocking)``)."""

    def __init__(self) -> None:
        cudart = runtime()
        self.handle = check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")

    @property
    def ptr(self) -> int:
        return int(self.handle)

    def synchronize(self) -> None:
        check(runtime().cudaStreamSynchronize(self.handle), "cudaStreamSynchronize")

    def destroy(self) -> None:
        if self.handle is not None:
            check(runtime().cudaStreamDestroy(self.handle), "cudaStreamDestroy")
            self.handle = None


class PinnedBuffer:
    """Page-locked host memory (``cudaMallocHost``) of ``nbytes``, viewable as numpy arrays without copies."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(1, nbytes)
        self.ptr = int(check(runtime().cudaMallocHost(self.nbytes), "cudaMallocHost"))

    def view(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A numpy array of ``shape``/``dtype`` over the buffer's start (must fit)."""
        count = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if count > self.nbytes:
            raise CudaError(f"pinned buffer of {self.nbytes} bytes cannot hold {count}")
        raw = (ctypes.c_byte * max(count, 1)).from_address(self.ptr)
        return np.frombuffer(raw, dtype=dtype, count=int(np.prod(shape))).reshape(shape)

    def free(self) -> None:
        if self.ptr:
            check(runtime().cudaFreeHost(self.ptr), "cudaFreeHost")
            self.ptr = 0


class DeviceBuffer:
    """Device memory (``cudaMalloc``) of ``nbytes``."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(1, nbytes)
        self.ptr = int(check(runtime().cudaMalloc(self.nbytes), "cudaMalloc"))

    def copy_from_host_async(self, host_ptr: int, nbytes: int, stream: Stream) -> None:
        cudart = runtime()
        check(cudart.cudaMemcpyAsync(self.ptr, host_ptr, nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice,
                                     stream.handle), "cudaMemcpyAsync(HostToDevice)")

    def copy_to_host_async(self, host_ptr: int, nbytes: int, stream: Stream) -> None:
        cudart = runtime()
        check(cudart.cudaMemcpyAsync(host_ptr, self.ptr, nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                                     stream.handle), "cudaMemcpyAsync(DeviceToHost)")

    def free(self) -> None:
        if self.ptr:
            check(runtime().cudaFree(self.ptr), "cudaFree")
            self.ptr = 0
