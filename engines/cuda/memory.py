"""Host and device memory: pinned staging buffers, device buffers, registered host ranges, IPC-opened device
memory, and asynchronous copies between them.

Sizes are bytes; pointers are integer addresses. A copy from or to host memory is real asynchronous DMA only when
the host side is page-locked (:class:`PinnedBuffer` or a :class:`HostRegistration`); the host memory must then stay
untouched until the stream has been synchronized.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from .held import held
from .runtime import CudaError, check, runtime, take
from .stream import Stream

log = logging.getLogger("engines.cuda")

#: Bytes of a ``cudaIpcMemHandle_t`` (``CU_IPC_HANDLE_SIZE``), as Triton's CUDA shared-memory extension sends it.
IPC_HANDLE_BYTES = 64


#: Live page-locked host ranges of this process (pinned buffers and registrations): base address -> bytes.
_LOCKED: dict[int, int] = {}
_LOCKED_LOCK = threading.Lock()
#: ``(start, end)`` of the live range :func:`page_locked` found last (one tuple, read and replaced whole); ``(1, 0)``
#: holds no address.
_last: tuple[int, int] = (1, 0)


def _track(ptr: int, nbytes: int) -> None:
    with _LOCKED_LOCK:
        _LOCKED[ptr] = nbytes


def _untrack(ptr: int) -> None:
    global _last
    with _LOCKED_LOCK:
        _LOCKED.pop(ptr, None)
        if _last[0] == ptr:
            _last = (1, 0)


def page_locked(ptr: int, nbytes: int) -> bool:
    """Whether ``[ptr, ptr + nbytes)`` lies inside one live :class:`PinnedBuffer` or :class:`HostRegistration` of
    this process, so that a copy from it is real asynchronous DMA and needs no staging copy first.

    The range found last is tried first: a batch's parts mostly lie in one shared area or client region, and a
    scan of every range per part held the GIL 2.6 us on the 2-core machine with an engine process's 24 ranges, 0.1
    us with the shortcut (a batch of 32 parts is checked when gathered, and adjacent parts again when uploaded).
    What that took from the engine's event loop shows on the H200: README "Many front ends, shared memory, two
    GPUs", twelfth session."""
    global _last
    start, end = _last
    if start <= ptr and ptr + nbytes <= end:
        return True
    with _LOCKED_LOCK:
        for base, size in _LOCKED.items():
            if base <= ptr and ptr + nbytes <= base + size:
                _last = (base, base + size)
                return True
        return False


def host_array(ptr: int, nbytes: int) -> np.ndarray:
    """A writable ``uint8`` numpy view (no copy) of ``nbytes`` bytes of host memory at address ``ptr``; it does not
    keep the memory alive."""
    if nbytes <= 0:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def memcpy_async(dst: int, src: int, nbytes: int, direction: str, stream: Stream, label: str = "", *,
                 locked: bool = False) -> None:
    """Queue a copy of ``nbytes`` bytes from ``src`` to ``dst`` on ``stream`` (``cudaMemcpyAsync``).

    Args:
        direction: ``"H2D"`` (host to device), ``"D2H"`` or ``"D2D"``.
        label: what is copied (e.g. the tensor's name), for the error message.
        locked: the host side is page-locked (:func:`page_locked`), so the call only queues the DMA: it is then
            made keeping the GIL (:mod:`engines.cuda.held`), as every ``"D2D"`` copy is. From pageable memory the
            driver copies on the calling thread, which must not hold the GIL meanwhile.

    Raises:
        CudaError: CUDA refused (bad pointer or size, destroyed stream); the message reads
            ``"cudaMemcpyAsync <direction> <label> <nbytes> B failed: <error>"``.
        ValueError: unknown ``direction``.
    """
    if locked or direction == "D2D":
        calls = held()  # refused there: again through the bindings below, which raise with CUDA's message
        if calls is not None and calls.memcpy(direction, dst, src, nbytes, int(stream.handle)) == 0:
            return  # (an unknown direction raises there the ValueError the bindings' path raises)
    cudart = runtime()
    kinds = {
        "H2D": cudart.cudaMemcpyKind.cudaMemcpyHostToDevice,
        "D2H": cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost,
        "D2D": cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
    }
    if direction not in kinds:
        raise ValueError(f"direction must be one of {sorted(kinds)}, got {direction!r}")
    what = " ".join(part for part in ("cudaMemcpyAsync", direction, label, f"{nbytes} B") if part)
    check(cudart.cudaMemcpyAsync(dst, src, nbytes, kinds[direction], stream.handle), what)


#: per binding of ``cudaMemcpyBatchAsync``: whether it works here (CUDA 12.8 and later, bindings and driver)
_BATCH_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def memcpy_batch_async(copies: Sequence[tuple[int, int, int]], stream: Stream, label: str = "", *,
                       locked: bool = False) -> None:
    """Queue host-to-device copies ``(dst, src, nbytes)`` on ``stream`` in ONE call (``cudaMemcpyBatchAsync``,
    sources read in stream order), where one ``cudaMemcpyAsync`` per copy would release and take back the GIL once
    per copy: beside a busy event loop each take-back waits, up to Python's switch interval (``bench.gpu_scale``
    part d on the H200: a batch of 32 copies took 187 ms beside a thread running Python, in one call 23 ms). The
    destinations must not overlap. Where the bindings or the driver lack the call, or it refuses the first batch
    (then decided once for the process), each copy goes by ``cudaMemcpyAsync``. ``locked``: every source is
    page-locked, so the call only queues the DMAs and is made keeping the GIL (:mod:`engines.cuda.held`).

    Raises:
        CudaError: CUDA refused a copy (the message of :func:`memcpy_async`, or ``"cudaMemcpyBatchAsync <label>
            <count> copies failed: <error>"`` once the batched call has worked in this process).
    """
    if not copies:
        return
    if locked and len(copies) > 1:  # (one copy: memcpy_async below, held too)
        calls = held()  # refused there: again through the bindings below
        if calls is not None and calls.memcpy_batch(copies, int(stream.handle)) == 0:
            return
    cudart = runtime()
    try:
        known = _BATCH_COPIES.get(cudart.cudaMemcpyBatchAsync)  # keyed by the binding: tests swap runtimes
    except AttributeError:  # bindings older than CUDA 12.8
        known = False
    if known is not False and len(copies) > 1:
        attrs = cudart.cudaMemcpyAttributes()
        attrs.srcAccessOrder = cudart.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        dsts, srcs, sizes = (list(column) for column in zip(*copies))
        result = cudart.cudaMemcpyBatchAsync(dsts, srcs, sizes, len(copies), [attrs], [0], 1, stream.handle)
        err = result[0] if isinstance(result, tuple) else result
        if err == cudart.cudaError_t.cudaSuccess:
            _BATCH_COPIES[cudart.cudaMemcpyBatchAsync] = True
            return
        if known:
            check(result, " ".join(part for part in ("cudaMemcpyBatchAsync", label, f"{len(copies)} copies") if part))
    for dst, src, nbytes in copies:  # one by one: raises on a copy CUDA refuses
        memcpy_async(dst, src, nbytes, "H2D", stream, label, locked=locked)
    if known is None and len(copies) > 1:
        log.info("cudaMemcpyBatchAsync refused copies that cudaMemcpyAsync took: one call per copy from now on")
        _BATCH_COPIES[cudart.cudaMemcpyBatchAsync] = False


def memset_async(dst: int, value: int, nbytes: int, stream: Stream, label: str = "") -> None:
    """Queue setting ``nbytes`` bytes of device memory at ``dst`` to the byte ``value`` on ``stream``
    (``cudaMemsetAsync``).

    Raises:
        CudaError: CUDA refused (bad pointer or size, destroyed stream); the message reads
            ``"cudaMemsetAsync <label> <nbytes> B failed: <error>"``.
    """
    calls = held()  # device memory only: queued keeping the GIL (engines.cuda.held); refused there: the bindings
    if calls is not None and calls.memset(dst, int(value), nbytes, int(stream.handle)) == 0:
        return
    what = " ".join(part for part in ("cudaMemsetAsync", label, f"{nbytes} B") if part)
    check(runtime().cudaMemsetAsync(dst, int(value), nbytes, stream.handle), what)


class PinnedBuffer:
    """Page-locked host memory (``cudaMallocHost``) of ``nbytes`` bytes (at least 1), viewable as numpy arrays
    without copies.

    Attributes:
        ptr: address of the first byte (0 once freed).
        nbytes: bytes allocated (``max(1, nbytes)``).
        array: ``uint8`` view of all of it (empty once freed).

    Raises (constructor):
        CudaError: out of pinned memory, or CUDA unusable.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(1, int(nbytes))
        self.ptr = int(check(runtime().cudaMallocHost(self.nbytes), f"cudaMallocHost({self.nbytes})"))
        self.array = host_array(self.ptr, self.nbytes)
        _track(self.ptr, self.nbytes)

    def view(self, shape: tuple[int, ...], dtype: np.dtype | type | str) -> np.ndarray:
        """A writable array of ``shape``/``dtype`` over the buffer's first bytes.

        Raises:
            CudaError: it does not fit (or the buffer was freed).
        """
        dtype = np.dtype(dtype)
        count = int(np.prod(shape)) * dtype.itemsize
        if count > self.array.size:
            raise CudaError(f"pinned buffer of {self.array.size} bytes cannot hold {count}")
        return self.array[:count].view(dtype).reshape(shape)

    def free(self) -> None:
        """Free the memory (``cudaFreeHost``; CudaError if refused); its views are invalid afterwards. Idempotent."""
        self.array = np.zeros(0, np.uint8)  # drop the view before its memory goes
        for ptr in take(self, "ptr", 0):
            _untrack(ptr)
            check(runtime().cudaFreeHost(ptr), f"cudaFreeHost({ptr:#x})")


class DeviceBuffer:
    """Device memory (``cudaMalloc``) of ``nbytes`` bytes (at least 1: ``cudaMalloc(0)`` gives no usable address)
    on the calling thread's current device.

    Attributes:
        ptr: device address (0 once freed).
        nbytes: bytes allocated (``max(1, nbytes)``).

    Raises (constructor):
        CudaError: out of device memory (``cudaErrorMemoryAllocation``), or CUDA unusable.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(1, int(nbytes))
        self.ptr = int(check(runtime().cudaMalloc(self.nbytes), f"cudaMalloc({self.nbytes})"))

    def copy_from_host_async(self, host_ptr: int, nbytes: int, stream: Stream, label: str = "", *,
                             locked: bool = False) -> None:
        """Queue ``nbytes`` from host address ``host_ptr`` to the start of this buffer (see :func:`memcpy_async`;
        ``locked``: the host side is page-locked)."""
        memcpy_async(self.ptr, host_ptr, nbytes, "H2D", stream, label, locked=locked)

    def copy_to_host_async(self, host_ptr: int, nbytes: int, stream: Stream, label: str = "", *,
                           locked: bool = False) -> None:
        """Queue ``nbytes`` from the start of this buffer to host address ``host_ptr`` (see :func:`memcpy_async`;
        ``locked``: the host side is page-locked)."""
        memcpy_async(host_ptr, self.ptr, nbytes, "D2H", stream, label, locked=locked)

    def free(self) -> None:
        """Free the memory (``cudaFree``, which synchronizes the device; CudaError if refused). Idempotent."""
        for ptr in take(self, "ptr", 0):
            check(runtime().cudaFree(ptr), f"cudaFree({ptr:#x})")


class HostRegistration:
    """An existing host range page-locked in place (``cudaHostRegister``), so host-to-device copies read it by DMA
    without a staging copy: e.g. a shared-memory slot that clients write and the server sends to the device.

    Args:
        ptr: address of the first byte (for a ``SharedMemory`` ``shm``: ``np.frombuffer(shm.buf, np.uint8)
            .ctypes.data``); the memory must stay mapped until :meth:`unregister`.
        nbytes: length of the range in bytes (> 0).
        read_only: the device only reads it (``cudaHostRegisterReadOnly``; needs a device that supports it);
            default ``cudaHostRegisterDefault``.
        portable: page-locked for every CUDA context of the process (``cudaHostRegisterPortable``), not only the
            current device's: a range that batches for several GPUs read.

    Raises (constructor):
        CudaError: CUDA refused (already registered, ``nbytes`` 0, flag unsupported).
    """

    def __init__(self, ptr: int, nbytes: int, *, read_only: bool = False, portable: bool = False) -> None:
        cudart = runtime()
        flags = int(cudart.cudaHostRegisterReadOnly if read_only else cudart.cudaHostRegisterDefault)
        if portable:
            flags |= int(cudart.cudaHostRegisterPortable)
        check(cudart.cudaHostRegister(ptr, nbytes, flags), f"cudaHostRegister({ptr:#x}, {nbytes}, {int(flags)})")
        self.ptr, self.nbytes = int(ptr), int(nbytes)
        _track(self.ptr, self.nbytes)

    def unregister(self) -> None:
        """Undo the registration (``cudaHostUnregister``); the memory stays the caller's. Idempotent.

        Raises:
            CudaError: CUDA refused (``cudaErrorHostMemoryNotRegistered``: unregistered behind our back).
        """
        for ptr in take(self, "ptr", 0):
            _untrack(ptr)
            check(runtime().cudaHostUnregister(ptr), f"cudaHostUnregister({ptr:#x})")


class IpcMemory:
    """Device memory of another process, opened from its IPC handle (``cudaIpcOpenMemHandle`` with
    ``cudaIpcMemLazyEnablePeerAccess``), as Triton's CUDA shared-memory extension registers a client's region.

    Args:
        handle: the ``IPC_HANDLE_BYTES`` (64) raw bytes of the exporter's ``cudaIpcMemHandle_t``
            (``cudaIpcGetMemHandle``; Triton clients send them base64-encoded).
        nbytes: size of the region in bytes, as the client declares it (CUDA does not report it).

    Attributes:
        ptr: device address of the region in this process (0 once closed); a copy with ``direction="D2D"``
            (:func:`memcpy_async`) or a tensor address can use it directly.

    Raises (constructor):
        CudaError: ``handle`` is not 64 bytes, or CUDA refused (handle of this same process, exporter gone,
            ``cudaErrorInvalidResourceHandle``).
    """

    def __init__(self, handle: bytes, nbytes: int) -> None:
        if len(handle) != IPC_HANDLE_BYTES:
            raise CudaError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        cudart = runtime()
        ipc_handle = cudart.cudaIpcMemHandle_t()
        ctypes.memmove(ipc_handle.getPtr(), bytes(handle), IPC_HANDLE_BYTES)
        flags = cudart.cudaIpcMemLazyEnablePeerAccess
        self.ptr = int(check(cudart.cudaIpcOpenMemHandle(ipc_handle, flags), "cudaIpcOpenMemHandle"))
        self.nbytes = int(nbytes)

    def close(self) -> None:
        """Unmap the region (``cudaIpcCloseMemHandle``; CudaError if refused); the exporter keeps its memory."""
        for ptr in take(self, "ptr", 0):
            check(runtime().cudaIpcCloseMemHandle(ptr), f"cudaIpcCloseMemHandle({ptr:#x})")
