"""CUDA driver calls made WITHOUT releasing the GIL: the few enqueues that every batch makes.

cuda-python releases the GIL around every call (its bindings call CUDA ``with nogil``), and a thread that let the
GIL go has to take it back. Beside a thread that runs Python (an engine process's event loop), each take-back
waits: ``python -m bench.cuda_gil`` on the H200 measured one ``cudaEventRecord`` at 1.25 us on an idle process
and at 58.7 us beside a thread running Python without pause (2.4 us held; Python's switch interval, 200 us here,
bounds the wait; ``bench/results/cuda_gil/``). A batch of a CUDA-graph context makes about ten such calls. The calls of this module only queue work on a stream
(an event record, a copy from or to page-locked memory or within the device, a memset, a graph launch) or read
two completed events, so they return within microseconds, and they keep the GIL: each is a
``ctypes.PYFUNCTYPE`` over the driver's own entry point, looked up with ``cuGetProcAddress`` at the CUDA 13.0
ABI (:data:`ABI_VERSION`), whose C signatures :data:`SIGNATURES` spells out. Calls that wait (synchronizing a
stream or an event) or copy from pageable memory (the driver then copies on the calling thread) still go through
the bindings and release the GIL.

:func:`held` gives the calls, or None where they are not used, and then the layer calls the bindings as before:
a driver older than 13.0 or none at all (CPU machines), a runtime injected in place of the real bindings (tests),
or the environment variable ``BATCHER_CUDA_HELD_CALLS=0`` (or ``false``, ``off``, ``no``). Each call returns the driver's ``CUresult`` (0:
success); the layer makes a refused call again through the bindings, which raise
:class:`~engines.cuda.runtime.CudaError` with CUDA's own message. A driver call works on the calling thread's
current CUDA context: the runtime makes the device's primary context current on a thread at its first runtime
call, which every context of the layer makes before it queues work (a thread without one gets
``CUDA_ERROR_INVALID_CONTEXT``, and the repeat through the bindings sets it up).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from ctypes import POINTER, c_float, c_int, c_size_t, c_ubyte, c_uint64, c_void_p
from typing import Any

from . import runtime as _runtime

log = logging.getLogger("engines.cuda")

#: The CUDA version whose ABI :data:`SIGNATURES` follows (``cuGetProcAddress``'s ``cudaVersion``: 1000 * major +
#: 10 * minor). CUDA 13.0 changed ``cuMemcpyBatchAsync`` (no ``failIdx``); older drivers are not used.
ABI_VERSION = 13000

#: The environment variable that turns the held calls off (``0``, ``false``, ``off`` or ``no``), for a driver that
#: misbehaves with them.
ENV_SWITCH = "BATCHER_CUDA_HELD_CALLS"
_OFF = frozenset(("0", "false", "off", "no"))

_P = ctypes.PYFUNCTYPE  # a foreign function that keeps the GIL (ctypes.CFUNCTYPE would release it)
_CUdeviceptr = c_uint64
#: Driver entry point -> its prototype (CUDA 13.0's ``cuda.h``); handles (CUstream, CUevent, CUgraphExec) are
#: pointers, ``CUdeviceptr`` an unsigned 64-bit integer, the result a ``CUresult`` (int).
SIGNATURES: dict[str, Any] = {
    # CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
    "cuEventRecord": _P(c_int, c_void_p, c_void_p),
    # CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
    "cuEventElapsedTime": _P(c_int, POINTER(c_float), c_void_p, c_void_p),
    # CUresult cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream)
    "cuMemcpyHtoDAsync": _P(c_int, _CUdeviceptr, c_void_p, c_size_t, c_void_p),
    # CUresult cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)
    "cuMemcpyDtoHAsync": _P(c_int, c_void_p, _CUdeviceptr, c_size_t, c_void_p),
    # CUresult cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)
    "cuMemcpyDtoDAsync": _P(c_int, _CUdeviceptr, _CUdeviceptr, c_size_t, c_void_p),
    # CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream)
    "cuMemsetD8Async": _P(c_int, _CUdeviceptr, c_ubyte, c_size_t, c_void_p),
    # CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
    "cuGraphLaunch": _P(c_int, c_void_p, c_void_p),
    # CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
    #                             CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, CUstream hStream)
    "cuMemcpyBatchAsync": _P(c_int, c_void_p, c_void_p, c_void_p, c_size_t, c_void_p, c_void_p, c_size_t, c_void_p),
}


class HeldCalls:
    """The driver's enqueue calls of :data:`SIGNATURES`, bound to their entry points; every method returns the
    ``CUresult`` (0: success) and never raises for CUDA's refusal.

    Args:
        resolve: the address of a driver entry point by name (``cuGetProcAddress`` in :func:`held`).
        stream_order_attrs: the address of one ``CUmemcpyAttributes`` whose ``srcAccessOrder`` is
            ``CU_MEMCPY_SRC_ACCESS_ORDER_STREAM`` (sources read in stream order), for :meth:`memcpy_batch`;
            ``keep`` holds whatever owns that memory.

    Raises (constructor):
        whatever ``resolve`` raises for a name it cannot find.
    """

    def __init__(self, resolve: Callable[[str], int], stream_order_attrs: int, keep: Any = None) -> None:
        self._fn = {name: proto(resolve(name)) for name, proto in SIGNATURES.items()}
        self._record = self._fn["cuEventRecord"]
        self._h2d, self._d2h, self._d2d = (self._fn["cuMemcpyHtoDAsync"], self._fn["cuMemcpyDtoHAsync"],
                                           self._fn["cuMemcpyDtoDAsync"])
        self._attrs, self._keep = stream_order_attrs, keep
        self._index0 = (c_size_t * 1)(0)

    def event_record(self, event: int, stream: int) -> int:
        """``cuEventRecord(event, stream)``: mark the current end of ``stream``'s queue."""
        return self._record(event, stream)

    def event_elapsed_ms(self, start: int, end: int) -> tuple[int, float]:
        """``(CUresult, milliseconds)`` from ``start`` to ``end``, both recorded and completed
        (``cuEventElapsedTime``)."""
        ms = c_float()
        return self._fn["cuEventElapsedTime"](ctypes.byref(ms), start, end), ms.value

    def memcpy(self, direction: str, dst: int, src: int, nbytes: int, stream: int) -> int:
        """Queue one copy of ``nbytes`` bytes on ``stream``; ``direction`` ``"H2D"``, ``"D2H"`` or ``"D2D"``. The host
        side must be page-locked (the call then only queues the DMA). Raises ValueError: another direction."""
        if direction == "H2D":
            return self._h2d(dst, src, nbytes, stream)
        if direction == "D2H":
            return self._d2h(dst, src, nbytes, stream)
        if direction == "D2D":
            return self._d2d(dst, src, nbytes, stream)
        raise ValueError(f"direction must be one of ['D2D', 'D2H', 'H2D'], got {direction!r}")

    def memset(self, dst: int, value: int, nbytes: int, stream: int) -> int:
        """Queue setting ``nbytes`` bytes of device memory at ``dst`` to the byte ``value`` (``cuMemsetD8Async``)."""
        return self._fn["cuMemsetD8Async"](dst, value, nbytes, stream)

    def graph_launch(self, graph_exec: int, stream: int) -> int:
        """Queue an executable graph on ``stream`` (``cuGraphLaunch``)."""
        return self._fn["cuGraphLaunch"](graph_exec, stream)

    def memcpy_batch(self, copies: Sequence[tuple[int, int, int]], stream: int) -> int:
        """Queue the host-to-device copies ``(dst, src, nbytes)`` in one ``cuMemcpyBatchAsync``, sources read in
        stream order (page-locked sources: the call only queues the DMAs)."""
        n = len(copies)
        dsts, srcs, sizes = (c_uint64 * n)(), (c_uint64 * n)(), (c_size_t * n)()
        for i, (dst, src, nbytes) in enumerate(copies):
            dsts[i], srcs[i], sizes[i] = dst, src, nbytes
        return self._fn["cuMemcpyBatchAsync"](dsts, srcs, sizes, n, self._attrs, self._index0, 1, stream)


_lock = threading.Lock()
_found: list[HeldCalls | None] = []  # [] until decided for the process (with the real bindings)
_injected: Any = None  # set_held(): what held() returns, whatever the runtime


def held() -> HeldCalls | None:
    """This process's :class:`HeldCalls`, or None where the layer calls the bindings instead (module docstring).
    Decided once for the process at the first call, which is made after the runtime has initialized CUDA (the
    layer calls it only to queue work); never raises."""
    if _injected is not None:
        return _injected
    if _runtime._injected is not None:  # a stand-in runtime: its objects are not the driver's
        return None
    if _found:
        return _found[0]
    with _lock:
        if not _found:
            _found.append(_load())
    return _found[0]


def _load() -> HeldCalls | None:
    switch = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if switch in _OFF:
        log.info("%s=%s: CUDA calls release the GIL", ENV_SWITCH, switch)
        return None
    try:
        from cuda.bindings import driver
    except ImportError:  # older cuda-python layouts: the bindings only
        return None
    try:
        err, version = driver.cuDriverGetVersion()
        if err != driver.CUresult.CUDA_SUCCESS or version < ABI_VERSION:
            log.info("CUDA driver %s is older than %d: CUDA calls release the GIL", version, ABI_VERSION)
            return None

        def resolve(name: str) -> int:
            err, pfn, status = driver.cuGetProcAddress(name.encode(), ABI_VERSION,
                                                       driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)
            if err != driver.CUresult.CUDA_SUCCESS or not int(pfn):
                raise LookupError(f"cuGetProcAddress({name!r}, {ABI_VERSION}): {err}, {status}")
            return int(pfn)

        attrs = driver.CUmemcpyAttributes()
        attrs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        calls = HeldCalls(resolve, int(attrs.getPtr()), keep=attrs)
        log.info("CUDA driver %d: the calls that only queue work keep the GIL (%s=0 turns that off)", version,
                 ENV_SWITCH)
        return calls
    except Exception as exc:  # no driver library (CPU machines), or an entry point missing: the bindings only
        log.debug("CUDA calls release the GIL: %r", exc)
        return None


def reset() -> None:
    """Forget the decision of :func:`held` (tests that change :data:`ENV_SWITCH`)."""
    with _lock:
        _found.clear()


def set_held(calls: Any) -> Any:
    """Make :func:`held` return ``calls`` (an object with :class:`HeldCalls`' methods; tests pair one with the
    stand-in runtime) until ``set_held(None)``. Returns what was set before."""
    global _injected
    previous, _injected = _injected, calls
    return previous
