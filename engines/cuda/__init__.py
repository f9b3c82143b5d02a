"""The one CUDA runtime layer of the GPU backends (ONNX Runtime's CUDA contexts and TensorRT), over cuda-python's
``cuda.bindings.runtime``.

* :mod:`.runtime`: the injectable runtime (:func:`set_runtime`, :func:`use_runtime`, :func:`runtime`), the one
  error type :class:`CudaError` (an :class:`engines.base.EngineError`) and :func:`check`, which every call's
  ``(cudaError_t, *values)`` result goes through;
* :mod:`.device`: device count, current device, free/total memory, compute capability;
* :mod:`.stream`: :class:`Stream`, :class:`Event` (timing), :class:`Graph` (stream capture, launch);
* :mod:`.memory`: :class:`PinnedBuffer`, :class:`DeviceBuffer`, :class:`HostRegistration`
  (``cudaHostRegister`` of an existing range), :class:`IpcMemory` (``cudaIpcOpenMemHandle``),
  :func:`memcpy_async`, :func:`memcpy_batch_async`, :func:`memset_async`, :func:`page_locked`;
* :mod:`.gate`: :data:`CAPTURE_GATE`, the process-wide lock that keeps all CUDA work out of the way of ONNX
  Runtime's Global-mode graph captures.

Nothing here imports cuda-python until a call needs it: CPU-only installs import this package freely. No other
module of ``engines`` touches the CUDA runtime (``tests/test_cuda_api.py`` checks that, and every runtime name the
layer uses, against the real bindings).
"""

from .device import compute_capability, device_count, mem_get_info, require_device, set_device
from .gate import CAPTURE_GATE, CaptureGate
from .memory import (
    IPC_HANDLE_BYTES,
    DeviceBuffer,
    HostRegistration,
    IpcMemory,
    PinnedBuffer,
    host_array,
    memcpy_async,
    memcpy_batch_async,
    memset_async,
    page_locked,
)
from .runtime import CUDART_API, CudaError, check, runtime, set_runtime, use_runtime
from .stream import Event, Graph, Stream

__all__ = [
    "CUDART_API",
    "CudaError",
    "check",
    "runtime",
    "set_runtime",
    "use_runtime",
    "device_count",
    "set_device",
    "require_device",
    "mem_get_info",
    "compute_capability",
    "Stream",
    "Event",
    "Graph",
    "PinnedBuffer",
    "DeviceBuffer",
    "HostRegistration",
    "IpcMemory",
    "IPC_HANDLE_BYTES",
    "host_array",
    "memcpy_async",
    "memcpy_batch_async",
    "memset_async",
    "page_locked",
    "CAPTURE_GATE",
    "CaptureGate",
]
