"""The CUDA runtime seam, the one CUDA error type and the result check every call of the layer goes through.

Injection: :func:`set_runtime` / :func:`use_runtime` replace the ``cuda.bindings.runtime`` module for every call
of the layer (tests inject the stand-in of ``tests/fake_cuda.py``); with nothing injected, :func:`runtime` imports
the real bindings. The seam is process-wide: objects made under one runtime must be used and freed under it.

Naming convention (checked by ``tests/test_cuda_api.py``): code reaches the runtime module only as ``runtime()``
itself or the local name ``cudart`` (``cudart = runtime()``), and an IPC handle object only as ``ipc_handle``;
every attribute used on them is listed in :data:`CUDART_API`. Only the modules of this package do so.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from ..base import EngineError

#: Every CUDA runtime name the layer touches, by owner ("module" = ``cuda.bindings.runtime`` itself; a class name
#: for attributes of its instances or enum members). ``tests/test_cuda_api.py`` checks that the layer's modules
#: use exactly these and that each exists, with the parameters the code passes, in the real bindings.
CUDART_API: dict[str, tuple[str, ...]] = {
    "module": (
        "cudaError_t",
        "cudaGetErrorName",
        "cudaGetErrorString",
        # devices
        "cudaGetDeviceCount",
        "cudaSetDevice",
        "cudaDeviceAttr",
        "cudaDeviceGetAttribute",
        "cudaMemGetInfo",
        # streams, events, graphs
        "cudaStreamNonBlocking",
        "cudaStreamCreateWithFlags",
        "cudaStreamSynchronize",
        "cudaStreamDestroy",
        "cudaEventDefault",
        "cudaEventDisableTiming",
        "cudaEventBlockingSync",
        "cudaEventCreateWithFlags",
        "cudaEventRecord",
        "cudaEventSynchronize",
        "cudaEventElapsedTime",
        "cudaEventDestroy",
        "cudaStreamCaptureMode",
        "cudaStreamBeginCapture",
        "cudaStreamEndCapture",
        "cudaGraphInstantiate",
        "cudaGraphLaunch",
        "cudaGraphExecDestroy",
        "cudaGraphDestroy",
        # memory
        "cudaMalloc",
        "cudaFree",
        "cudaMallocHost",
        "cudaFreeHost",
        "cudaHostRegisterDefault",
        "cudaHostRegisterReadOnly",
        "cudaHostRegisterPortable",
        "cudaHostRegister",
        "cudaHostUnregister",
        "cudaMemcpyKind",
        "cudaMemcpyAsync",
        "cudaMemcpyBatchAsync",
        "cudaMemcpyAttributes",
        "cudaMemcpySrcAccessOrder",
        "cudaMemsetAsync",
        "cudaIpcMemHandle_t",
        "cudaIpcMemLazyEnablePeerAccess",
        "cudaIpcOpenMemHandle",
        "cudaIpcCloseMemHandle",
    ),
    "cudaError_t": ("cudaSuccess",),
    "cudaDeviceAttr": ("cudaDevAttrComputeCapabilityMajor", "cudaDevAttrComputeCapabilityMinor"),
    "cudaStreamCaptureMode": ("cudaStreamCaptureModeThreadLocal",),
    "cudaMemcpyKind": ("cudaMemcpyHostToDevice", "cudaMemcpyDeviceToHost", "cudaMemcpyDeviceToDevice"),
    "cudaMemcpySrcAccessOrder": ("cudaMemcpySrcAccessOrderStream",),
    "cudaIpcMemHandle_t": ("getPtr",),
}


class CudaError(EngineError):
    """A CUDA runtime call failed, or cuda-python is missing; the message names the call (with its arguments
    where they matter) and the CUDA error's name and text."""


#: The injected runtime module (a stand-in in tests); ``None``: import the real bindings.
_injected: ModuleType | None = None


def set_runtime(module: ModuleType | None) -> ModuleType | None:
    """Make ``module`` the CUDA runtime of every later call of the layer (``None``: the real bindings again).

    Returns:
        the module injected before (``None`` if none), so a caller can restore it.
    """
    global _injected
    previous, _injected = _injected, module
    return previous


@contextlib.contextmanager
def use_runtime(module: ModuleType) -> Iterator[ModuleType]:
    """``with use_runtime(fake.cudart): ...`` runs the block on ``module``, then restores the previous runtime."""
    previous = set_runtime(module)
    try:
        yield module
    finally:
        set_runtime(previous)


def runtime() -> ModuleType:
    """The CUDA runtime bindings: the injected module, else ``cuda.bindings.runtime`` (else the older
    ``cuda.cudart``).

    Raises:
        CudaError: cuda-python is not installed (the message says ``pip install cuda-python``).
    """
    if _injected is not None:
        return _injected
    reasons = []
    for name in ("cuda.bindings.runtime", "cuda.cudart"):  # cuda-python >= 12.6, then its older layout
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            reasons.append(f"{name}: {exc}")
    raise CudaError(f"GPU execution needs cuda-python ({'; '.join(reasons)}). Install it: pip install cuda-python")


def take(owner: object, attr: str, empty: Any = None) -> list[Any]:
    """``[value]`` of ``owner.<attr>`` after resetting it to ``empty``, or ``[]`` when it already was ``empty``, so
    that ``for ptr in take(self, "ptr", 0): <free ptr>`` frees a handle exactly once, even when the free fails."""
    value = getattr(owner, attr)
    if value is None or value is empty or (empty is not None and value == empty):
        return []
    setattr(owner, attr, empty)
    return [value]


def error_text(err: Any) -> str:
    """``"cudaErrorMemoryAllocation (out of memory)"`` for a ``cudaError_t``; never raises."""
    try:
        cudart = runtime()
        name = cudart.cudaGetErrorName(err)[1]
        text = cudart.cudaGetErrorString(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        text = text.decode() if isinstance(text, bytes) else str(text)
        return f"{name} ({text})"
    except Exception:  # the error path must not hide the original error
        return repr(err)


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-python result ``(cudaError_t, *values)`` (or a bare ``cudaError_t``).

    Args:
        result: what the binding returned.
        what: the call and its arguments, for the error message (e.g. ``"cudaMalloc(4096)"``).

    Returns:
        ``None`` for no value, the value for one, a tuple for several.

    Raises:
        CudaError: the error code is not ``cudaSuccess``; the message is ``"<what> failed: <name> (<text>)"``.
    """
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != runtime().cudaError_t.cudaSuccess:
        raise CudaError(f"{what} failed: {error_text(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values
