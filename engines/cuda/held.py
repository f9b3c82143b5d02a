"""Short CUDA calls that only queue work, made without releasing the GIL (the driver library via ``ctypes.PyDLL``).

Why. cuda-python releases the GIL around every call. A call that only queues work on a stream (an asynchronous
copy between page-locked host memory and the device, a memset, an event record) returns in microseconds, but
taking the GIL back behind a busy event loop waits up to Python's switch interval each time (the H200, ``python -m
bench.gpu_scale --parts d``: one batch of 32 took 2.27 ms alone and 2.92 ms beside a thread running Python at a
200 us interval; README "Many front ends, shared memory, two GPUs"). A CUDA-graph context queues four to six such
calls per batch; held, they cost their few microseconds and no wait. Calls that block (synchronizing, copies from
pageable memory, allocation) keep going through cuda-python, which releases the GIL while they wait.

What makes it valid. The runtime's handles are the driver's: ``cudaStream_t`` is ``CUstream``, ``cudaEvent_t`` is
``CUevent`` and a ``cudaMalloc`` address is a ``CUdeviceptr`` (CUDA Runtime API, "Interactions with the CUDA Driver
API"). A driver call works on the calling thread's current context; ``cudaSetDevice`` makes the device's primary
context current on the calling thread (CUDA 12 and later), and every thread that queues work here has called it
(:func:`engines.cuda.set_device`). Where no context is current the call fails with
``CUDA_ERROR_INVALID_CONTEXT`` and raises, as any failed call does.

When. Only with the real bindings (no runtime injected, :func:`engines.cuda.runtime.set_runtime`), where
``libcuda.so.1`` loads and exports the calls, and while :data:`ENABLED` (the environment variable
``BATCHER_CUDA_GIL_HELD=0`` turns it off for a process, to measure both ways). Otherwise :func:`driver` is None and
the callers use cuda-python.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from . import runtime as _runtime
from .runtime import CudaError

#: whether the held calls may be used in this process (``BATCHER_CUDA_GIL_HELD=0``: never)
ENABLED = os.environ.get("BATCHER_CUDA_GIL_HELD", "1") != "0"

#: the driver library's name on Linux (the NVIDIA driver installs it; no CUDA toolkit needed)
LIBRARY = "libcuda.so.1"

_u64, _size, _ptr, _int = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int

#: the driver calls used, with their C signatures (``cuda.h``): CUresult (int) name(args)
PROTOTYPES: dict[str, tuple[Any, ...]] = {
    "cuMemcpyHtoDAsync_v2": (_u64, _ptr, _size, _ptr),  # CUdeviceptr dst, const void *src, size_t, CUstream
    "cuMemcpyDtoHAsync_v2": (_ptr, _u64, _size, _ptr),  # void *dst, CUdeviceptr src, size_t, CUstream
    "cuMemsetD8Async": (_u64, ctypes.c_ubyte, _size, _ptr),  # CUdeviceptr dst, unsigned char, size_t N, CUstream
    "cuEventRecord": (_ptr, _ptr),  # CUevent, CUstream
    "cuGetErrorName": (_int, ctypes.POINTER(ctypes.c_char_p)),  # CUresult, const char **
}

_lock = threading.Lock()
_loaded: list[Any] = []  # [library or None] once tried


def _load() -> Any:
    try:
        lib = ctypes.PyDLL(LIBRARY)  # PyDLL: the GIL stays held during each call
        for name, args in PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(args), _int
    except (OSError, AttributeError):  # no driver here, or one without these calls
        return None
    return lib


def driver() -> Any:
    """The driver library whose calls keep the GIL, or None: a runtime is injected (tests), :data:`ENABLED` is
    off, or ``libcuda.so.1`` is missing or lacks a call of :data:`PROTOTYPES`. Loaded once per process."""
    if not ENABLED or _runtime._injected is not None:
        return None
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_load())
    return _loaded[0]


def checked(lib: Any, result: int, what: str) -> None:
    """Raise for a failed driver call.

    Raises:
        CudaError: ``result`` is not ``CUDA_SUCCESS`` (0); the message reads ``"<what> failed: <CUresult name>
            (<code>)"``.
    """
    if result:
        name = ctypes.c_char_p()
        known = lib.cuGetErrorName(result, ctypes.byref(name)) == 0 and name.value
        label = name.value.decode() if known else "CUDA_ERROR"
        raise CudaError(f"{what} failed: {label} ({result})")
