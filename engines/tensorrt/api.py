"""TensorRT API helpers: which runtime module to load and how, every TensorRT name the backend uses, and the
mapping of TensorRT data types to KServe v2 datatypes.

Hardware seam: the TensorRT module is reached only through :func:`load_trt`, which returns the module attribute
:data:`_trt` when it is set (tests inject ``tests/fake_tensorrt.py``'s ``.trt``); the CUDA runtime is injected
separately, through :func:`engines.cuda.set_runtime`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from ..base import EngineError

#: Injected TensorRT module (a stand-in in tests); ``None``: import the runtime the engine asks for.
_trt: ModuleType | None = None

#: ``runtime=`` choice -> Python module of that TensorRT runtime.
RUNTIME_MODULES: dict[str, str] = {"full": "tensorrt", "lean": "tensorrt_lean", "dispatch": "tensorrt_dispatch"}

#: How to install each runtime (pip package names as published on PyPI for CUDA 13; ``-cu12`` for CUDA 12).
RUNTIME_INSTALL: dict[str, str] = {
    "full": 'pip install "trt-batcher[tensorrt]"  (tensorrt + cuda-python)',
    "lean": 'pip install "trt-batcher[tensorrt-lean]"  (tensorrt-lean-cu13 + cuda-python)',
    "dispatch": "pip install tensorrt-dispatch-cu13 cuda-python",
}

#: Every TensorRT name the backend touches, by owner ("module" = the tensorrt/tensorrt_lean module itself).
#: tests/test_tensorrt_api.py checks that the modules of this package use exactly these and that each exists in
#: the real bindings.
TRT_API: dict[str, tuple[str, ...]] = {
    "module": ("__version__", "Logger", "Runtime", "DataType", "TensorIOMode", "TensorLocation", "EngineStat",
               "ExecutionContextAllocationStrategy"),
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
        "set_device_memory",
    ),
    "DataType": ("FLOAT", "HALF", "BF16", "INT8", "INT32", "INT64", "BOOL", "UINT8"),
    "TensorIOMode": ("INPUT", "OUTPUT"),
    "TensorLocation": ("DEVICE",),
    "EngineStat": ("TOTAL_WEIGHTS_SIZE",),
    "ExecutionContextAllocationStrategy": ("USER_MANAGED",),
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
    """TensorRT refused a call (a shape, a profile, an execution); the message names the call and the tensor/shape
    involved. CUDA runtime failures are :class:`engines.cuda.CudaError`."""


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


def trt_type_name(trt: ModuleType, trt_type: Any) -> str:
    """The ``DataType`` member name of ``trt_type`` (``"FLOAT"``, ``"BF16"``, ...; another member's own name)."""
    names = {
        trt.DataType.FLOAT: "FLOAT",
        trt.DataType.HALF: "HALF",
        trt.DataType.BF16: "BF16",
        trt.DataType.INT8: "INT8",
        trt.DataType.INT32: "INT32",
        trt.DataType.INT64: "INT64",
        trt.DataType.BOOL: "BOOL",
        trt.DataType.UINT8: "UINT8",
    }
    return names.get(trt_type, getattr(trt_type, "name", str(trt_type)))


def dims(value: Any) -> tuple[int, ...]:
    """A TensorRT ``Dims`` (tuple-like) as a tuple of ints."""
    return tuple(int(d) for d in value)


def load_trt(runtime: str) -> tuple[ModuleType, str]:
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
