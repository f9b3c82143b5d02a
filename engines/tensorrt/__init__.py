"""TensorRT backend: serialized TensorRT plans run by the full, lean or dispatch TensorRT runtime.

Modules: :mod:`.api` (loading the runtime, the TensorRT names used, datatype mapping, :class:`TensorRTError`),
:mod:`.profiles` (profile shapes, max batch, profile choice, launch rows, shape checks), :mod:`.engine`
(:class:`TensorRTEngine`), :mod:`.context` (:class:`TensorRTContext`). CUDA is reached only through
:mod:`engines.cuda`.

A plan (``.plan``/``.engine`` file, see :mod:`engines.trt_build`) is deserialized once per
:class:`TensorRTEngine`. Each :class:`TensorRTContext` owns one ``IExecutionContext`` with

* its own CUDA stream (``cudaStreamCreateWithFlags(cudaStreamNonBlocking)``), so contexts never serialize on the
  legacy default stream;
* one device buffer per I/O tensor (``cudaMalloc``), sized for the largest shape its optimization profile allows,
  bound once with ``set_tensor_address`` (the buffers never move);
* one pinned host staging buffer per I/O tensor (``cudaMallocHost``), used through zero-copy numpy views, so the
  host<->device copies are real asynchronous DMA; :meth:`TensorRTContext.host_buffer` hands out the input views
  so a caller can stack a batch straight into pinned memory;
* one optimization profile, selected once at creation with ``set_optimization_profile_async``: context ``k``
  takes profile ``k % num_optimization_profiles`` (precisely: the profile used by the fewest live contexts,
  lowest index first, which is ``k % n`` while no context was released), so an engine built with several
  profiles lets several contexts run side by side, each with its own activation memory.

One batch (:meth:`TensorRTContext.execute`): check shapes against the context's profile -> ``set_input_shape``
per input -> copy into pinned buffers -> async H2D -> ``execute_async_v3(stream)`` -> async D2H of every output
(shapes read from ``get_tensor_shape`` after the input shapes are set) -> ONE ``cudaStreamSynchronize`` ->
numpy copies of the outputs cut to the batch's real rows. A batch smaller than the profile's minimum batch is
padded with zero rows and the outputs cut back.

Memory accounting (bytes): :attr:`TensorRTEngine.nbytes` is the size of the serialized plan (it holds the
weights and kernels that the deserialized engine keeps on the device; TensorRT reports no engine-only figure
before 10.x's ``get_engine_stat``, which :meth:`TensorRTEngine.memory_report` adds where present);
:attr:`TensorRTContext.nbytes` is the engine's ``device_memory_size_v2`` (the activation memory TensorRT
allocates for a context created with the default STATIC strategy: the maximum over all profiles) plus the
context's device I/O buffers. Pinned host staging memory is reported separately as
:attr:`TensorRTContext.pinned_nbytes`.

Data types: FLOAT, HALF, INT8, INT32, INT64, BOOL and UINT8 tensors map to the KServe v2 datatypes FP32, FP16,
INT8, INT32, INT64, BOOL, UINT8. BF16 is not a KServe v2 datatype: an engine with a BF16 I/O tensor is
REJECTED when loaded (EngineError naming the tensor), rather than silently staged through FP32 - rebuild it
with FP32/FP16 I/O (``engines.trt_build`` keeps I/O types). FP8, INT4, FP4 and E8M0 I/O are rejected likewise.

Errors: TensorRT's refusals raise :class:`TensorRTError`, CUDA runtime failures :class:`engines.cuda.CudaError`;
both are :class:`engines.base.EngineError`.

Needs TensorRT >= 10.1 (name-based I/O, ``execute_async_v3``, ``device_memory_size_v2``) and cuda-python
(``cuda.bindings.runtime``; older ``cuda.cudart`` is accepted). Every TensorRT name this package uses is listed in
:data:`TRT_API`; ``tests/test_tensorrt_api.py`` checks it against the real ``tensorrt_lean`` module, and
``tests/test_cuda_api.py`` checks the CUDA layer against ``cuda.bindings.runtime``.

Hardware seams: the TensorRT module is injected through :data:`engines.tensorrt.api._trt` (``None``: import the
real one), the CUDA runtime through :func:`engines.cuda.set_runtime`; tests inject the stand-ins of
``tests/fake_tensorrt.py``.
"""

from __future__ import annotations

from ..cuda import compute_capability, mem_get_info
from .api import KSERVE_BY_TRT_NAME, RUNTIME_MODULES, TRT_API, TensorRTError, kserve_datatype
from .context import TensorRTContext
from .engine import TensorRTEngine
from .profiles import buffer_nbytes, check_profile_shape, launch_rows, max_batch_from_profiles, pick_profile, slice_rows

__all__ = [
    "TensorRTError",
    "TensorRTEngine",
    "TensorRTContext",
    "TRT_API",
    "RUNTIME_MODULES",
    "KSERVE_BY_TRT_NAME",
    "kserve_datatype",
    "max_batch_from_profiles",
    "buffer_nbytes",
    "slice_rows",
    "check_profile_shape",
    "launch_rows",
    "pick_profile",
    "device_memory_info",
    "compute_capability",
]


def device_memory_info(device_id: int = 0) -> tuple[int, int]:
    """``(free, total)`` device memory of ``device_id`` in bytes (``cudaMemGetInfo``; makes the device current).

    Raises:
        CudaError: cuda-python missing, no usable device, or ``device_id`` out of range.
    """
    return mem_get_info(device_id)
