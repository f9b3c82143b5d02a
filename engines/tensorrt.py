"""TensorRT backend: serialized TensorRT plans run by the full, lean or dispatch TensorRT runtime.

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

Needs TensorRT >= 10.1 (name-based I/O, ``execute_async_v3``, ``device_memory_size_v2``) and cuda-python
(``cuda.bindings.runtime``; older ``cuda.cudart`` is accepted). Every TensorRT name this module uses is listed in
:data:`TRT_API`, every CUDA runtime name in :data:`CUDART_API`; ``tests/test_tensorrt_api.py`` checks both
against the real ``tensorrt_lean`` and ``cuda.bindings.runtime`` modules.

Hardware seams: the TensorRT module and the CUDA runtime module are reached only through the module attributes
:data:`_trt` and :data:`_cudart` (``None``: import the real ones) so tests can inject stand-ins
(``tests/fake_tensorrt.py``). All CUDA calls go through the small ``_cuda_*`` helpers and :func:`_check`.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from .base import Engine, EngineError, ExecutionContext, TensorSpec
from .datatypes import NUMPY_DTYPES

__all__ = [
    "TensorRTError",
    "TensorRTEngine",
    "TensorRTContext",
    "TRT_API",
    "CUDART_API",
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

#: Injected TensorRT module (a stand-in in tests); ``None``: import the runtime the engine asks for.
_trt: ModuleType | None = None
#: Injected CUDA runtime module (``cuda.bindings.runtime`` or a stand-in); ``None``: import the real one.
_cudart: ModuleType | None = None

#: ``runtime=`` choice -> Python module of that TensorRT runtime.
RUNTIME_MODULES: dict[str, str] = {"full": "tensorrt", "lean": "tensorrt_lean", "dispatch": "tensorrt_dispatch"}

#: How to install each runtime (pip package names as published on PyPI for CUDA 13; ``-cu12`` for CUDA 12).
RUNTIME_INSTALL: dict[str, str] = {
    "full": 'pip install "trt-batcher[tensorrt]"  (tensorrt + cuda-python)',
    "lean": 'pip install "trt-batcher[tensorrt-lean]"  (tensorrt-lean-cu13 + cuda-python)',
    "dispatch": "pip install tensorrt-dispatch-cu13 cuda-python",
}

#: Every TensorRT name this module touches, by owner ("module" = the tensorrt/tensorrt_lean module itself).
#: tests/test_tensorrt_api.py checks that the code uses exactly these and that each exists in the real bindings.
TRT_API: dict[str, tuple[str, ...]] = {
    "module": ("__version__", "Logger", "Runtime", "DataType", "TensorIOMode", "TensorLocation", "EngineStat"),
    "Logger": ("WARNING",),
    "Runtime": ("engine_host_code_allowed", "deserialize_cuda_engine"),
    "ICudaEngine": (
        "num_io_tensors",
        "get_tensor_name",
        "get_tensor_mode",
        "get_tensor_dtype",
        "get_tensor_shape",
        "get_tensor_location",
        "get_tensor_profile_shape",
        "num_optimization_profiles",
        "create_execution_context",
        "device_memory_size_v2",
        "get_device_memory_size_for_profile_v2",
        "get_engine_stat",
    ),
    "IExecutionContext": (
        "set_optimization_profile_async",
        "set_input_shape",
        "get_tensor_shape",
        "set_tensor_address",
        "execute_async_v3",
    ),
    "DataType": ("FLOAT", "HALF", "BF16", "INT8", "INT32", "INT64", "BOOL", "UINT8"),
    "TensorIOMode": ("INPUT", "OUTPUT"),
    "TensorLocation": ("DEVICE",),
    "EngineStat": ("TOTAL_WEIGHTS_SIZE",),
}

#: Every CUDA runtime name this module touches ("module" = cuda.bindings.runtime itself).
CUDART_API: dict[str, tuple[str, ...]] = {
    "module": (
        "cudaError_t",
        "cudaGetErrorName",
        "cudaGetErrorString",
        "cudaGetDeviceCount",
        "cudaSetDevice",
        "cudaStreamNonBlocking",
        "cudaStreamCreateWithFlags",
        "cudaStreamSynchronize",
        "cudaStreamDestroy",
        "cudaMalloc",
        "cudaFree",
        "cudaMallocHost",
        "cudaFreeHost",
        "cudaMemcpyKind",
        "cudaMemcpyAsync",
        "cudaMemGetInfo",
        "cudaDeviceAttr",
        "cudaDeviceGetAttribute",
    ),
    "cudaError_t": ("cudaSuccess",),
    "cudaMemcpyKind": ("cudaMemcpyHostToDevice", "cudaMemcpyDeviceToHost"),
    "cudaDeviceAttr": ("cudaDevAttrComputeCapabilityMajor", "cudaDevAttrComputeCapabilityMinor"),
}

#: TensorRT ``DataType`` member name -> KServe v2 datatype (the I/O types this backend serves).
KSERVE_BY_TRT_NAME: dict[str, str] = {
    "FLOAT": "FP32",
    "HALF": "FP16",
    "INT8": "INT8",
    "INT32": "INT32",
    "INT64": "INT64",
    "BOOL": "BOOL",
    "UINT8": "UINT8",
}


class TensorRTError(EngineError):
    """TensorRT or the CUDA runtime refused a call; the message names the call, the tensor/shape involved and the
    CUDA error name and text where there is one."""


Shape = tuple[int, ...]
ProfileShapes = tuple[Shape, Shape, Shape]  # (min, opt, max), as get_tensor_profile_shape returns them


# --------------------------------------------------------------------------- pure functions


def kserve_datatype(trt_name: str, tensor: str) -> str:
    """Map a TensorRT ``DataType`` member name (``"FLOAT"``, ``"HALF"``, ...) to its KServe v2 datatype.

    Raises:
        EngineError: the type has no KServe v2 equivalent (BF16, FP8, INT4, FP4, E8M0); the message names the
            tensor and says how to rebuild the plan.
    """
    try:
        return KSERVE_BY_TRT_NAME[trt_name]
    except KeyError:
        pass
    if trt_name == "BF16":
        raise EngineError(
            f"tensor {tensor!r} is BF16, which is not a KServe v2 datatype and is not staged through FP32 here; "
            "rebuild the plan with FP32 or FP16 inputs/outputs (engines.trt_build keeps the ONNX I/O types)"
        )
    raise EngineError(
        f"tensor {tensor!r} has TensorRT type {trt_name}, which the server cannot serve; supported: "
        + ", ".join(f"{k} ({v})" for k, v in KSERVE_BY_TRT_NAME.items())
    )


def buffer_nbytes(shape: Sequence[int], dtype: np.dtype | type | str) -> int:
    """Bytes of a dense tensor of ``shape`` (every dim >= 0) and numpy ``dtype``; ``()`` is one element.

    Raises:
        EngineError: a dimension is negative (a dynamic ``-1`` that was never resolved).
    """
    n = 1
    for d in shape:
        d = int(d)
        if d < 0:
            raise EngineError(f"cannot size a buffer for shape {tuple(shape)}: dimension {d} is unresolved")
        n *= d
    return n * np.dtype(dtype).itemsize


def slice_rows(arr: np.ndarray, rows: int) -> np.ndarray:
    """An owned copy of the first ``rows`` rows (first dimension) of ``arr``.

    Raises:
        EngineError: ``arr`` is 0-d or has fewer than ``rows`` rows.
    """
    if arr.ndim == 0 or arr.shape[0] < rows:
        raise EngineError(f"output of shape {arr.shape} has fewer than {rows} rows")
    return np.array(arr[:rows], copy=True)


def max_batch_from_profiles(profiles: Mapping[str, Sequence[ProfileShapes]]) -> int:
    """Largest batch every context accepts, whatever profile it got.

    Args:
        profiles: input name -> one ``(min, opt, max)`` shape triple per optimization profile, as
            ``ICudaEngine.get_tensor_profile_shape(name, p)`` returns them (batch dimension first).

    Returns:
        the smallest ``max[0]`` over all inputs and profiles (a context can run only its own profile, and every
        input of a batch has the same rows).

    Raises:
        EngineError: no inputs, an input with no profile, or a 0-d input (no batch dimension).
    """
    if not profiles:
        raise EngineError("engine has no inputs")
    maxima = []
    for name, triples in profiles.items():
        if not triples:
            raise EngineError(f"input {name!r} has no optimization profile")
        for _min, _opt, mx in triples:
            if len(mx) == 0:
                raise EngineError(f"input {name!r} is a scalar; the server needs a batch dimension first")
            maxima.append(int(mx[0]))
    return min(maxima)


def check_profile_shape(name: str, shape: Sequence[int], profile: int, lo: Sequence[int], hi: Sequence[int]) -> None:
    """Check that ``shape`` lies within ``[lo, hi]`` (per dimension) of optimization profile ``profile``.

    Raises:
        EngineError: rank differs or some dimension is outside the profile; the message names the tensor, the
            shape and the profile's min and max.
    """
    shape, lo, hi = tuple(int(d) for d in shape), tuple(int(d) for d in lo), tuple(int(d) for d in hi)
    if len(shape) != len(lo) or any(not (a <= s <= b) for s, a, b in zip(shape, lo, hi)):
        raise EngineError(
            f"input {name!r} shape {list(shape)} is outside optimization profile {profile}: "
            f"min {list(lo)}, max {list(hi)}"
        )


def launch_rows(rows: int, min_batch: int, max_batch: int) -> int:
    """Rows to run for a batch of ``rows``: ``rows`` itself, or the profile's ``min_batch`` when smaller (the
    batch is then padded with zero rows and the outputs cut back).

    Raises:
        EngineError: ``rows < 1`` or ``rows > max_batch`` (the profile's maximum batch).
    """
    if rows < 1:
        raise EngineError(f"batch has {rows} rows; at least 1 is needed")
    if rows > max_batch:
        raise EngineError(f"batch of {rows} rows exceeds the optimization profile's maximum batch {max_batch}")
    return max(rows, min_batch)


def pick_profile(in_use: Sequence[int], num_profiles: int) -> int:
    """Profile for a new context: the one used by the fewest live contexts (``in_use`` lists their profiles),
    lowest index on ties. With no releases, the k-th context (from 0) gets ``k % num_profiles``.

    Raises:
        EngineError: ``num_profiles < 1``.
    """
    if num_profiles < 1:
        raise EngineError(f"engine reports {num_profiles} optimization profiles")
    counts = [0] * num_profiles
    for p in in_use:
        if 0 <= p < num_profiles:
            counts[p] += 1
    return counts.index(min(counts))


def _host_view(ptr: int, nbytes: int) -> np.ndarray:
    """A uint8 numpy view (no copy) of ``nbytes`` bytes of host memory at address ``ptr``."""
    if nbytes == 0:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


# --------------------------------------------------------------------------- module loading


def _load_trt(runtime: str) -> tuple[ModuleType, str]:
    """Return (TensorRT module, runtime name) for ``runtime`` = ``auto|full|lean|dispatch``.

    Raises:
        EngineError: unknown ``runtime``, or no requested runtime is importable (the message names the pip
            packages).
    """
    if runtime != "auto" and runtime not in RUNTIME_MODULES:
        raise EngineError(f"runtime must be one of auto, {', '.join(RUNTIME_MODULES)}; got {runtime!r}")
    if _trt is not None:
        return _trt, runtime
    order = tuple(RUNTIME_MODULES) if runtime == "auto" else (runtime,)
    reasons = []
    for name in order:
        try:
            return importlib.import_module(RUNTIME_MODULES[name]), name
        except (ImportError, OSError) as exc:  # OSError: the wheel is there but its shared libraries are not
            reasons.append(f"{RUNTIME_MODULES[name]}: {exc}")
    hint = "; ".join(f"{name}: {RUNTIME_INSTALL[name]}" for name in order)
    raise EngineError(f"TensorRT runtime {runtime!r} is not installed ({'; '.join(reasons)}). Install it: {hint}")


def _load_cudart() -> ModuleType:
    """Return the CUDA runtime bindings (``cuda.bindings.runtime``, else the older ``cuda.cudart``).

    Raises:
        EngineError: cuda-python is not installed.
    """
    if _cudart is not None:
        return _cudart
    try:
        return importlib.import_module("cuda.bindings.runtime")
    except ImportError:
        pass
    try:
        return importlib.import_module("cuda.cudart")
    except ImportError as exc:
        raise EngineError(
            f"the TensorRT backend needs cuda-python (cuda.bindings.runtime): {exc}. Install it: pip install cuda-python"
        ) from exc


# --------------------------------------------------------------------------- CUDA helpers


def _error_text(cudart: Any, err: Any) -> str:
    """``"cudaErrorMemoryAllocation (out of memory)"`` for a cudaError_t; never raises."""
    try:
        name = cudart.cudaGetErrorName(err)[1]
        text = cudart.cudaGetErrorString(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        text = text.decode() if isinstance(text, bytes) else str(text)
        return f"{name} ({text})"
    except Exception:  # the error path must not hide the original error
        return repr(err)


def _check(cudart: Any, result: Any, what: str) -> Any:
    """Unpack a cuda-python result ``(cudaError_t, *values)``.

    Returns:
        ``None`` for no value, the value for one, a tuple for several.

    Raises:
        TensorRTError: the error code is not ``cudaSuccess``; the message names ``what`` (the call and its
            arguments) and the CUDA error.
    """
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != cudart.cudaError_t.cudaSuccess:
        raise TensorRTError(f"{what} failed: {_error_text(cudart, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _cuda_device_count(cudart: Any) -> int:
    return int(_check(cudart, cudart.cudaGetDeviceCount(), "cudaGetDeviceCount()"))


def _cuda_set_device(cudart: Any, device: int) -> None:
    _check(cudart, cudart.cudaSetDevice(device), f"cudaSetDevice({device})")


def _cuda_stream_create(cudart: Any) -> Any:
    return _check(
        cudart,
        cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking),
        "cudaStreamCreateWithFlags(cudaStreamNonBlocking)",
    )


def _cuda_stream_sync(cudart: Any, stream: Any) -> None:
    _check(cudart, cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")


def _cuda_stream_destroy(cudart: Any, stream: Any) -> None:
    _check(cudart, cudart.cudaStreamDestroy(stream), "cudaStreamDestroy")


def _cuda_malloc(cudart: Any, nbytes: int) -> int:
    return int(_check(cudart, cudart.cudaMalloc(nbytes), f"cudaMalloc({nbytes})"))


def _cuda_free(cudart: Any, ptr: int) -> None:
    _check(cudart, cudart.cudaFree(ptr), f"cudaFree({ptr:#x})")


def _cuda_malloc_host(cudart: Any, nbytes: int) -> int:
    return int(_check(cudart, cudart.cudaMallocHost(nbytes), f"cudaMallocHost({nbytes})"))


def _cuda_free_host(cudart: Any, ptr: int) -> None:
    _check(cudart, cudart.cudaFreeHost(ptr), f"cudaFreeHost({ptr:#x})")


def _cuda_h2d(cudart: Any, dst: int, src: int, nbytes: int, stream: Any, tensor: str) -> None:
    kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
    _check(cudart, cudart.cudaMemcpyAsync(dst, src, nbytes, kind, stream), f"cudaMemcpyAsync H2D {tensor!r} {nbytes} B")


def _cuda_d2h(cudart: Any, dst: int, src: int, nbytes: int, stream: Any, tensor: str) -> None:
    kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
    _check(cudart, cudart.cudaMemcpyAsync(dst, src, nbytes, kind, stream), f"cudaMemcpyAsync D2H {tensor!r} {nbytes} B")


def _cuda_mem_info(cudart: Any) -> tuple[int, int]:
    free, total = _check(cudart, cudart.cudaMemGetInfo(), "cudaMemGetInfo()")
    return int(free), int(total)


def _cuda_capability(cudart: Any, device: int) -> tuple[int, int]:
    major = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, device)
    minor = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor, device)
    what = f"cudaDeviceGetAttribute(compute capability, {device})"
    return int(_check(cudart, major, what)), int(_check(cudart, minor, what))


def _require_device(cudart: Any, device: int) -> None:
    """Check that CUDA works and ``device`` exists, then make it current.

    TensorRT's ``Runtime(logger)`` crashes the process (segmentation fault, seen with tensorrt-lean 11.4) when no
    CUDA driver is usable, so this runs before any TensorRT object is created.

    Raises:
        TensorRTError: no usable CUDA driver/device, or ``device`` out of range.
    """
    count = _cuda_device_count(cudart)
    if not 0 <= device < count:
        raise TensorRTError(f"CUDA device {device} does not exist ({count} device(s) visible)")
    _cuda_set_device(cudart, device)


def device_memory_info(device_id: int = 0) -> tuple[int, int]:
    """``(free, total)`` device memory of ``device_id`` in bytes (``cudaMemGetInfo``; makes the device current).

    Raises:
        EngineError: cuda-python missing; TensorRTError: no usable device.
    """
    cudart = _load_cudart()
    _require_device(cudart, device_id)
    return _cuda_mem_info(cudart)


def compute_capability(device_id: int = 0) -> tuple[int, int]:
    """``(major, minor)`` compute capability of ``device_id`` (e.g. ``(9, 0)`` for an H100/H200).

    Raises:
        EngineError: cuda-python missing; TensorRTError: no usable device.
    """
    cudart = _load_cudart()
    _require_device(cudart, device_id)
    return _cuda_capability(cudart, device_id)


# --------------------------------------------------------------------------- engine


def _dims(value: Any) -> Shape:
    """A TensorRT ``Dims`` (tuple-like) as a tuple of ints."""
    return tuple(int(d) for d in value)


class TensorRTEngine(Engine):
    """A serialized TensorRT plan loaded by the TensorRT runtime.

    Args:
        path: plan file (as written by ``engines.trt_build``/``trtexec --saveEngine``).
        runtime: ``"full"`` (``import tensorrt``), ``"lean"`` (``tensorrt_lean``), ``"dispatch"``
            (``tensorrt_dispatch``) or ``"auto"`` (the first of those that imports). The lean and dispatch
            runtimes run only version-compatible plans (``trt_build --version-compatible``).
        device_id: CUDA device the engine and its contexts live on.
        allow_host_code: set ``Runtime.engine_host_code_allowed``, needed to deserialize version-compatible plans
            that embed the lean runtime (executable host code). Load only plans you built or trust.

    Raises:
        EngineError: the runtime or cuda-python is not installed (message names the pip package), the file cannot
            be read, TensorRT cannot deserialize it (other TensorRT version or GPU, not a plan), or an I/O tensor
            is unsupported (BF16/FP8/INT4/FP4 type, host-located shape tensor, scalar input).
        TensorRTError: no usable CUDA device.
    """

    backend = "tensorrt"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        runtime: str = "auto",
        device_id: int = 0,
        allow_host_code: bool = True,
    ) -> None:
        self.path = Path(path)
        trt, self.runtime = _load_trt(runtime)
        cudart = _load_cudart()
        self._trt, self._cudart = trt, cudart
        self.device_id = device_id
        self._lock = threading.Lock()
        self._contexts: list[TensorRTContext] = []
        self._released = False
        try:
            plan = self.path.read_bytes()
        except OSError as exc:
            raise EngineError(f"cannot read TensorRT plan {self.path}: {exc.strerror}") from exc
        self._plan_nbytes = len(plan)
        _require_device(cudart, device_id)
        # The logger and the runtime must outlive the engine: both are kept until release().
        self._logger = trt.Logger(trt.Logger.WARNING)
        runtime_obj = trt.Runtime(self._logger)
        if allow_host_code:
            runtime_obj.engine_host_code_allowed = True
        self._runtime = runtime_obj
        cuda_engine = runtime_obj.deserialize_cuda_engine(plan)
        if cuda_engine is None:
            raise EngineError(
                f"TensorRT {trt.__version__} ({self.runtime} runtime) cannot deserialize {self.path}: built by another "
                "TensorRT version or for another GPU, not version-compatible (lean/dispatch runtimes need "
                "--version-compatible plans), or not a plan; TensorRT's log above gives its reason"
            )
        self._cuda_engine = cuda_engine
        self._read_io()

    def _read_io(self) -> None:
        trt, cuda_engine = self._trt, self._cuda_engine
        dtype_names = {
            trt.DataType.FLOAT: "FLOAT",
            trt.DataType.HALF: "HALF",
            trt.DataType.BF16: "BF16",
            trt.DataType.INT8: "INT8",
            trt.DataType.INT32: "INT32",
            trt.DataType.INT64: "INT64",
            trt.DataType.BOOL: "BOOL",
            trt.DataType.UINT8: "UINT8",
        }
        inputs, outputs = [], []
        for i in range(cuda_engine.num_io_tensors):
            name = cuda_engine.get_tensor_name(i)
            mode = cuda_engine.get_tensor_mode(name)
            trt_type = cuda_engine.get_tensor_dtype(name)
            datatype = kserve_datatype(dtype_names.get(trt_type, getattr(trt_type, "name", str(trt_type))), name)
            if cuda_engine.get_tensor_location(name) != trt.TensorLocation.DEVICE:
                raise EngineError(f"tensor {name!r} lives in host memory (a shape tensor); not supported")
            spec = TensorSpec(name, datatype, _dims(cuda_engine.get_tensor_shape(name)))
            if mode == trt.TensorIOMode.INPUT:
                if not spec.shape:
                    raise EngineError(f"input {name!r} is a scalar; the server needs a batch dimension first")
                inputs.append(spec)
            elif mode == trt.TensorIOMode.OUTPUT:
                outputs.append(spec)
        self._inputs, self._outputs = tuple(inputs), tuple(outputs)
        self.num_profiles = int(cuda_engine.num_optimization_profiles)
        self._profiles: dict[str, list[ProfileShapes]] = {
            spec.name: [self._profile_shapes(spec, p) for p in range(self.num_profiles)] for spec in self._inputs
        }
        self._max_batch = max_batch_from_profiles(self._profiles)

    def _profile_shapes(self, spec: TensorSpec, profile: int) -> ProfileShapes:
        triple = self._cuda_engine.get_tensor_profile_shape(spec.name, profile)
        shapes = tuple(_dims(s) for s in triple)
        if len(shapes) == 3 and all(len(s) == len(spec.shape) and min(s, default=0) >= 0 for s in shapes):
            return shapes  # type: ignore[return-value]
        if -1 not in spec.shape:  # a static input: its only shape is its profile
            return spec.shape, spec.shape, spec.shape
        raise TensorRTError(f"get_tensor_profile_shape({spec.name!r}, {profile}) returned {shapes}")

    # ---- Engine contract

    @property
    def max_batch_size(self) -> int:
        """Smallest profile maximum of the batch dimension over all inputs and profiles (never ``None``)."""
        return self._max_batch

    @property
    def nbytes(self) -> int:
        """Size of the serialized plan in bytes (weights + kernels the engine holds)."""
        return self._plan_nbytes

    def profile_shapes(self, name: str) -> list[ProfileShapes]:
        """``(min, opt, max)`` shapes of input ``name``, one triple per optimization profile.

        Raises:
            KeyError: no such input.
        """
        return list(self._profiles[name])

    def memory_report(self) -> dict[str, Any]:
        """What TensorRT itself reports, in bytes: ``plan_bytes``; ``weights_bytes``
        (``get_engine_stat(TOTAL_WEIGHTS_SIZE)``, ``None`` before TensorRT 10.x added it); ``context_bytes``
        (``device_memory_size_v2``: activation memory of one STATIC context); ``profile_bytes`` (per profile,
        ``get_device_memory_size_for_profile_v2``).

        Raises:
            EngineError: the engine was released.
        """
        cuda_engine = self._require_engine()
        trt = self._trt
        weights = None
        if hasattr(cuda_engine, "get_engine_stat"):
            weights = int(cuda_engine.get_engine_stat(trt.EngineStat.TOTAL_WEIGHTS_SIZE))
        return {
            "plan_bytes": self._plan_nbytes,
            "weights_bytes": weights,
            "context_bytes": int(cuda_engine.device_memory_size_v2),
            "profile_bytes": [
                int(cuda_engine.get_device_memory_size_for_profile_v2(p)) for p in range(self.num_profiles)
            ],
        }

    def _require_engine(self) -> Any:
        if self._released:
            raise EngineError("engine was released")
        return self._cuda_engine

    def create_context(self) -> TensorRTContext:
        """Create a context on the least-used optimization profile (see module docstring).

        Raises:
            EngineError: the engine was released; TensorRTError: TensorRT or CUDA refused (e.g. out of device
                memory); everything allocated so far is freed.
        """
        self._require_engine()
        with self._lock:
            profile = pick_profile([c.profile_index for c in self._contexts], self.num_profiles)
            ctx = TensorRTContext(self, profile)
            self._contexts.append(ctx)
        return ctx

    def _forget(self, ctx: TensorRTContext) -> None:
        with self._lock:
            if ctx in self._contexts:
                self._contexts.remove(ctx)

    def release(self) -> None:
        """Release every live context, then the engine, then the runtime and logger. Idempotent.

        Raises:
            TensorRTError: a context's CUDA memory or stream could not be freed (the rest is still freed).
        """
        if self._released:
            return
        self._released = True
        errors = []
        for ctx in list(self._contexts):
            try:
                ctx.release()
            except TensorRTError as exc:
                errors.append(str(exc))
        self._cuda_engine = None  # destroys the ICudaEngine (no context refers to it any more)
        self._runtime = None
        self._logger = None
        if errors:
            raise TensorRTError("; ".join(errors))


class TensorRTContext(ExecutionContext):
    """One ``IExecutionContext`` with its stream, device buffers and pinned staging buffers. Not thread-safe.

    Created by :meth:`TensorRTEngine.create_context`.

    Raises (constructor):
        TensorRTError: a CUDA call failed (message names it and the CUDA error), TensorRT refused the profile or
            a shape, or an output's shape depends on the data (needs an IOutputAllocator; not supported).
    """

    def __init__(self, owner: TensorRTEngine, profile: int) -> None:
        self._owner = owner
        self._trt, self._cudart = owner._trt, owner._cudart
        self._cuda_engine = owner._cuda_engine
        self.profile_index = profile
        self._stream: Any = None
        self._trt_context: Any = None
        self._device: dict[str, tuple[int, int]] = {}  # name -> (pointer, capacity in bytes)
        self._pinned: dict[str, tuple[int, np.ndarray]] = {}  # name -> (pointer, uint8 view of capacity bytes)
        self._dtypes = {s.name: NUMPY_DTYPES[s.datatype] for s in owner.inputs + owner.outputs}
        self._released = False
        self._activation_nbytes = 0
        # This profile's (min, max) per input and its batch range.
        self._bounds = {name: (shapes[profile][0], shapes[profile][2]) for name, shapes in owner._profiles.items()}
        self._min_batch = max(lo[0] for lo, _hi in self._bounds.values())
        self._max_batch = min(hi[0] for _lo, hi in self._bounds.values())
        try:
            self._setup()
        except BaseException:
            self._free_all()
            raise

    def _setup(self) -> None:
        cudart, cuda_engine = self._cudart, self._cuda_engine
        _cuda_set_device(cudart, self._owner.device_id)
        self._stream = _cuda_stream_create(cudart)
        self._activation_nbytes = int(cuda_engine.device_memory_size_v2)
        trt_context = cuda_engine.create_execution_context()
        if trt_context is None:
            raise TensorRTError("create_execution_context() returned None (out of device memory?)")
        self._trt_context = trt_context
        if not trt_context.set_optimization_profile_async(self.profile_index, int(self._stream)):
            raise TensorRTError(f"set_optimization_profile_async({self.profile_index}) was refused")
        _cuda_stream_sync(cudart, self._stream)
        # Size every buffer for the profile's largest shapes: inputs at their max, outputs as TensorRT infers them.
        shapes: dict[str, Shape] = {}
        for name, (_lo, hi) in self._bounds.items():
            if not trt_context.set_input_shape(name, hi):
                raise TensorRTError(f"set_input_shape({name!r}, {list(hi)}) refused for profile {self.profile_index}")
            shapes[name] = hi
        for spec in self._owner.outputs:
            shape = _dims(trt_context.get_tensor_shape(spec.name))
            if any(d < 0 for d in shape):
                raise TensorRTError(
                    f"output {spec.name!r} has data-dependent shape {list(shape)}; not supported (needs an "
                    "IOutputAllocator)"
                )
            shapes[spec.name] = shape
        for name, shape in shapes.items():
            nbytes = buffer_nbytes(shape, self._dtypes[name])
            size = max(nbytes, 1)  # cudaMalloc(0) returns no usable address
            dptr = _cuda_malloc(cudart, size)
            self._device[name] = (dptr, nbytes)
            hptr = _cuda_malloc_host(cudart, size)
            self._pinned[name] = (hptr, _host_view(hptr, nbytes))
            if not trt_context.set_tensor_address(name, dptr):
                raise TensorRTError(f"set_tensor_address({name!r}) refused")

    # ---- contract

    @property
    def nbytes(self) -> int:
        """Device bytes: the engine's ``device_memory_size_v2`` (this context's activation memory) plus the I/O
        buffers. 0 once released."""
        if self._released:
            return 0
        return self._activation_nbytes + self.io_nbytes

    @property
    def io_nbytes(self) -> int:
        """Bytes of this context's device I/O buffers."""
        return sum(max(cap, 1) for _ptr, cap in self._device.values())

    @property
    def pinned_nbytes(self) -> int:
        """Bytes of pinned host staging memory (``cudaMallocHost``) this context holds."""
        return sum(max(view.size, 1) for _ptr, view in self._pinned.values())

    @property
    def max_batch_size(self) -> int:
        """Largest batch this context's profile accepts."""
        return self._max_batch

    def host_buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """A writable view of input ``name``'s pinned staging buffer, ``shape``/``dtype``, that :meth:`execute`
        sends to the device without a further host copy when it is passed back as that input. Valid until the next
        call on this context. ``None`` when ``name`` is not an input, ``dtype`` is not the engine's, or ``shape``
        does not fit the buffer (the profile's maximum).
        """
        if self._released or name not in self._pinned or name not in self._bounds:
            return None
        dtype = np.dtype(dtype)
        if dtype != self._dtypes[name] or any(int(d) < 0 for d in shape):
            return None
        nbytes = buffer_nbytes(shape, dtype)
        view = self._pinned[name][1]
        if nbytes > view.size:
            return None
        return view[:nbytes].view(dtype).reshape(shape)

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch (see the module docstring for the sequence of calls).

        Args:
            inputs: every input by name, first dimension ``n`` rows (``1 <= n <=`` this profile's max batch),
                dtype exactly the engine's (e.g. float32 for FP32), other dims inside the profile.

        Returns:
            every output by name, owned numpy arrays with first dimension ``n``.

        Raises:
            EngineError: wrong/missing inputs, dtype, rows, or a shape outside the profile (names the tensor, the
                shape and the profile's min/max). TensorRTError: TensorRT refused a shape or the execution, or a
                CUDA call failed. The context stays usable after either.
        """
        if self._released:
            raise EngineError("execution context was released")
        trt_context, cudart, stream = self._trt_context, self._cudart, self._stream
        expected = [s.name for s in self._owner.inputs]
        missing = [n for n in expected if n not in inputs]
        extra = [n for n in inputs if n not in self._bounds]
        if missing or extra:
            raise EngineError(f"inputs must be exactly {expected}; missing {missing}, unexpected {extra}")
        arrays = {n: np.ascontiguousarray(inputs[n]) for n in expected}
        rows_seen = {n: (a.shape[0] if a.ndim else 0) for n, a in arrays.items()}
        rows = next(iter(rows_seen.values()))
        if len(set(rows_seen.values())) != 1:
            raise EngineError(f"inputs disagree on the batch size: {rows_seen}")
        launch = launch_rows(rows, self._min_batch, self._max_batch)
        _cuda_set_device(cudart, self._owner.device_id)
        shapes: dict[str, Shape] = {}
        for name, arr in arrays.items():
            if arr.dtype != self._dtypes[name]:
                raise EngineError(f"input {name!r} has dtype {arr.dtype}, the engine needs {self._dtypes[name]}")
            shape = (launch,) + tuple(arr.shape[1:])
            lo, hi = self._bounds[name]
            check_profile_shape(name, shape, self.profile_index, lo, hi)
            shapes[name] = shape
        for name, shape in shapes.items():
            if not trt_context.set_input_shape(name, shape):
                lo, hi = self._bounds[name]
                raise TensorRTError(
                    f"TensorRT refused set_input_shape({name!r}, {list(shape)}) "
                    f"(profile {self.profile_index}: min {list(lo)}, max {list(hi)})"
                )
        out_shapes: dict[str, Shape] = {}
        for spec in self._owner.outputs:
            shape = _dims(trt_context.get_tensor_shape(spec.name))
            need = buffer_nbytes(shape, self._dtypes[spec.name]) if min(shape, default=0) >= 0 else -1
            if need < 0 or need > self._device[spec.name][1]:
                raise TensorRTError(
                    f"output {spec.name!r} shape {list(shape)} for inputs {shapes} does not fit its buffer"
                )
            out_shapes[spec.name] = shape
        enqueued = False
        try:
            for name, arr in arrays.items():
                dptr, _cap = self._device[name]
                hptr, view = self._pinned[name]
                nbytes = buffer_nbytes(shapes[name], arr.dtype)
                if arr.ctypes.data != hptr:  # not stacked straight into the staging buffer (host_buffer)
                    view[: arr.nbytes] = arr.reshape(-1).view(np.uint8)
                if nbytes > arr.nbytes:
                    view[arr.nbytes : nbytes] = 0  # padding rows up to the profile's minimum batch
                enqueued = True
                _cuda_h2d(cudart, dptr, hptr, nbytes, stream, name)
            if not trt_context.execute_async_v3(int(stream)):
                raise TensorRTError(f"execute_async_v3 returned False for input shapes {shapes}")
            for name, shape in out_shapes.items():
                dptr, _cap = self._device[name]
                hptr, _view = self._pinned[name]
                _cuda_d2h(cudart, hptr, dptr, buffer_nbytes(shape, self._dtypes[name]), stream, name)
            _cuda_stream_sync(cudart, stream)
        except TensorRTError:
            if enqueued:  # let queued copies finish before the pinned buffers are reused
                try:
                    _cuda_stream_sync(cudart, stream)
                except TensorRTError:
                    pass
            raise
        results = {}
        for name, shape in out_shapes.items():
            view = self._pinned[name][1]
            dtype = self._dtypes[name]
            arr = view[: buffer_nbytes(shape, dtype)].view(dtype).reshape(shape)
            results[name] = slice_rows(arr, rows)
        return results

    def release(self) -> None:
        """Destroy the IExecutionContext, free device and pinned buffers, destroy the stream. Idempotent.

        Raises:
            TensorRTError: some CUDA free failed (everything else is still freed).
        """
        if self._released:
            return
        self._released = True
        try:
            errors = self._free_all()
        finally:
            self._owner._forget(self)
        if errors:
            raise TensorRTError("; ".join(errors))

    def _free_all(self) -> list[str]:
        cudart = self._cudart
        errors: list[str] = []

        def attempt(fn: Any, *args: Any) -> None:
            try:
                fn(cudart, *args)
            except TensorRTError as exc:
                errors.append(str(exc))

        if self._stream is not None:
            attempt(_cuda_stream_sync, self._stream)
        self._trt_context = None  # destroys the IExecutionContext (and its activation memory) first
        self._cuda_engine = None  # a released context must not keep the ICudaEngine alive
        for dptr, _cap in self._device.values():
            attempt(_cuda_free, dptr)
        self._device = {}
        pinned, self._pinned = self._pinned, {}  # drop the numpy views before their memory goes
        pointers = [hptr for hptr, _view in pinned.values()]
        del pinned
        for hptr in pointers:
            attempt(_cuda_free_host, hptr)
        if self._stream is not None:
            attempt(_cuda_stream_destroy, self._stream)
            self._stream = None
        return errors
