"""Devices: how many there are, making one current, its free memory and its compute capability.

The current device is per host thread in CUDA: a thread that runs an execution context calls :func:`set_device`
before it allocates or enqueues anything, else the work lands on device 0.
"""

from __future__ import annotations

from .runtime import CudaError, check, runtime


def device_count() -> int:
    """Number of visible CUDA devices (``cudaGetDeviceCount``).

    Raises:
        CudaError: no usable driver or device (e.g. ``cudaErrorNoDevice``), or cuda-python missing.
    """
    return int(check(runtime().cudaGetDeviceCount(), "cudaGetDeviceCount()"))


def set_device(device: int) -> None:
    """Make ``device`` (index from 0) current for the calling thread (``cudaSetDevice``).

    Raises:
        CudaError: CUDA refused (``cudaErrorInvalidDevice`` for an index out of range).
    """
    check(runtime().cudaSetDevice(device), f"cudaSetDevice({device})")


def require_device(device: int) -> None:
    """Check that CUDA works and ``device`` exists, then make it current.

    TensorRT's ``Runtime(logger)`` crashes the process (segmentation fault, seen with tensorrt-lean 11.4) when no
    CUDA driver is usable, so the TensorRT backend calls this before it creates any TensorRT object.

    Raises:
        CudaError: no usable CUDA driver/device, or ``device`` out of range (the message gives the count).
    """
    count = device_count()
    if not 0 <= device < count:
        raise CudaError(f"CUDA device {device} does not exist ({count} device(s) visible)")
    set_device(device)


def mem_get_info(device: int | None = None) -> tuple[int, int]:
    """``(free, total)`` device memory in bytes (``cudaMemGetInfo``).

    Args:
        device: the device to ask about (checked and made current first, as :func:`require_device`); ``None``:
            the calling thread's current device.

    Raises:
        CudaError: no usable device, ``device`` out of range, or cuda-python missing.
    """
    if device is not None:
        require_device(device)
    free, total = check(runtime().cudaMemGetInfo(), "cudaMemGetInfo()")
    return int(free), int(total)


def compute_capability(device: int = 0) -> tuple[int, int]:
    """``(major, minor)`` compute capability of ``device`` (e.g. ``(9, 0)`` for an H100/H200); makes it current.

    Raises:
        CudaError: no usable device, ``device`` out of range, or cuda-python missing.
    """
    require_device(device)
    cudart = runtime()
    what = f"cudaDeviceGetAttribute(compute capability, {device})"
    major = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, device)
    minor = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor, device)
    return int(check(major, what)), int(check(minor, what))
