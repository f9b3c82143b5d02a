"""Stand-in for ``cuda.bindings.runtime`` on machines without a GPU, and the fake device behind it.

``FakeCuda()`` gives ``.cudart``, a module with the functions, enums and constants the CUDA layer (``engines/cuda``)
uses, with the same names and parameter names as the real bindings and returning ``(cudaError_t, *values)``
tuples like them (``tests/test_cuda_api.py`` checks it is a subset of the real ``cuda.bindings.runtime``), and
``.gpu``, the fake device's state and the test controls (never part of a real API).

The fake device:

* device memory is a dict ``pointer -> memory`` (``len()`` gives its size); it is real host memory at a 256-byte
  aligned address, so a CPU library (ONNX Runtime's CPU build, bound with IOBinding) can read and write a "device"
  buffer by its address, as a GPU library does on a GPU;
* pinned host memory (``cudaMallocHost``) is real host memory (ctypes buffers), so numpy can view it and
  ``cudaMemcpyAsync`` reads/writes it by address; ``cudaHostRegister`` page-locks any host range the same way.
  Host pointers passed to a copy must lie inside a pinned or registered range, device pointers inside a device
  allocation, else ``cudaErrorInvalidValue``;
* streams are ints; ``cudaMemcpyAsync``, ``cudaEventRecord``, ``cudaGraphLaunch`` (and TensorRT's
  ``execute_async_v3``) only QUEUE work on the stream and ``cudaStreamSynchronize`` runs it, so code that reads
  outputs before synchronizing, or overwrites a staging buffer while a copy is queued, sees wrong data exactly as
  on a GPU;
* a fake clock (``gpu.clock_ms``) advances by ``gpu.op_ms`` for every queued operation that runs; an event
  records the clock when it runs, so ``cudaEventElapsedTime`` is ``op_ms`` times the operations between two events;
* stream capture (``cudaStreamBeginCapture``) diverts queued operations into a graph instead of running them; a
  launched graph queues them again. During a ThreadLocal or Global capture, ``cudaMalloc``, ``cudaMallocHost`` and
  synchronizing the capturing stream fail with ``cudaErrorStreamCaptureUnsupported`` and invalidate the capture,
  as CUDA does;
* ``gpu.export_ipc(ptr)`` plays the other process of CUDA IPC: it returns the 64 handle bytes that
  ``cudaIpcOpenMemHandle`` then maps (at the same address: the fake has one address space).
"""

from __future__ import annotations

import ctypes
import enum
import itertools
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

IPC_MAGIC = b"FAKEIPC\0"


class _DeviceMemory:
    """One fake device allocation: ``nbytes`` of real host memory at a 256-byte aligned address ``ptr``."""

    def __init__(self, nbytes: int) -> None:
        self._buf = (ctypes.c_uint8 * (max(nbytes, 1) + 256))()
        self.ptr = (ctypes.addressof(self._buf) + 255) // 256 * 256
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes


class FakeGPU:
    """State of the fake device and the knobs tests turn. Not a mirror of any real API."""

    def __init__(self, total_memory: int = 80 << 30, device_count: int = 1, capability: tuple[int, int] = (9, 0)):
        self.total_memory = total_memory
        self.device_count = device_count
        self.capability = capability
        self.device: dict[int, _DeviceMemory] = {}  # base pointer -> memory
        self.device_owner: dict[int, str] = {}  # base pointer -> "cudaMalloc" | "weights" | "activation"
        self.host: dict[int, Any] = {}  # base pointer -> ctypes buffer (pinned)
        self.registered: dict[int, int] = {}  # cudaHostRegister: base pointer -> bytes
        self.host_register_read_only = True  # device supports cudaHostRegisterReadOnly
        self.batch_copies = True  # the driver has cudaMemcpyBatchAsync (CUDA 12.8+)
        self.streams: dict[int, list[Callable[[], int]]] = {}
        self.capturing: dict[int, dict[str, Any]] = {}  # stream -> {"mode", "ops", "invalid"}
        self.graphs: dict[int, list[Callable[[], int]]] = {}
        self.graph_execs: dict[int, list[Callable[[], int]]] = {}
        self.event_flags: dict[int, int] = {}  # live events -> flags
        self.event_times: dict[int, float | None] = {}  # recorded events -> clock when run (None: pending)
        self.event_stream: dict[int, int] = {}  # recorded events -> stream
        self.ipc_exports: dict[bytes, int] = {}
        self.ipc_open: Counter[int] = Counter()
        self.clock_ms = 0.0
        self.op_ms = 1.0
        self.events: list[str] = []
        self.calls: Counter[str] = Counter()
        self.inject: dict[str, int] = {}  # cudart function name -> cudaError_t value it returns once
        self.fail_execute = 0  # execute_async_v3 returns False this many times
        self.refuse_shapes: set[tuple[str, tuple[int, ...]]] = set()  # set_input_shape returns False for these
        self.executions: list[dict[str, tuple[int, ...]]] = []  # input shapes of each execute_async_v3 that RAN
        self.last_inputs: dict[str, Any] = {}  # input tensors as the last execution read them
        self._ids = itertools.count(1)

    # ---- device memory

    def alloc(self, nbytes: int, owner: str) -> int:
        mem = _DeviceMemory(nbytes)
        self.device[mem.ptr] = mem
        self.device_owner[mem.ptr] = owner
        return mem.ptr

    def free(self, ptr: int) -> bool:
        if ptr not in self.device:
            return False
        del self.device[ptr]
        del self.device_owner[ptr]
        return True

    def used(self) -> int:
        return sum(len(b) for b in self.device.values())

    def find_device(self, ptr: int, nbytes: int) -> tuple[_DeviceMemory, int] | None:
        for base, mem in self.device.items():
            if base <= ptr and ptr + nbytes <= base + len(mem):
                return mem, ptr - base
        return None

    def host_ok(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies in one page-locked range (pinned or registered)."""
        ranges = [(b, ctypes.sizeof(buf)) for b, buf in self.host.items()] + list(self.registered.items())
        return any(base <= ptr and ptr + nbytes <= base + size for base, size in ranges)

    def read(self, ptr: int, nbytes: int) -> bytes:
        found = self.find_device(ptr, nbytes)
        if found is None:
            raise IndexError(f"device read of {nbytes} B at {ptr:#x} outside any allocation")
        return ctypes.string_at(ptr, nbytes)

    def write(self, ptr: int, data: bytes) -> None:
        found = self.find_device(ptr, len(data))
        if found is None:
            raise IndexError(f"device write of {len(data)} B at {ptr:#x} outside any allocation")
        ctypes.memmove(ptr, data, len(data))

    # ---- streams, capture

    def new_id(self) -> int:
        return next(self._ids)

    def new_stream(self) -> int:
        sid = self.new_id()
        self.streams[sid] = []
        return sid

    def enqueue(self, stream: int, op: Callable[[], int]) -> None:
        """Queue ``op`` on ``stream``, or record it into the stream's capture."""
        if stream in self.capturing:
            self.capturing[stream]["ops"].append(op)
        else:
            self.streams[stream].append(op)

    def strict_capture(self) -> bool:
        """True (and every ThreadLocal/Global capture invalidated) while such a capture is under way: the call
        that asked is not allowed during capture."""
        strict = [c for c in self.capturing.values() if c["mode"] != 2]  # 2: cudaStreamCaptureModeRelaxed
        for c in strict:
            c["invalid"] = True
        return bool(strict)

    # ---- IPC (the exporting process's side)

    def export_ipc(self, ptr: int) -> bytes:
        """The 64 handle bytes another process's ``cudaIpcGetMemHandle(ptr)`` would give (``ptr``: a device
        allocation's base)."""
        if ptr not in self.device:
            raise ValueError(f"{ptr:#x} is not the base of a device allocation")
        handle = IPC_MAGIC + ptr.to_bytes(8, "little") + bytes(48)
        self.ipc_exports[handle] = ptr
        return handle

    def counts(self) -> dict[str, int]:
        """Live resources: device allocations by owner, pinned buffers, streams, events, graphs, registrations."""
        by_owner = Counter(self.device_owner.values())
        live = {
            "pinned": len(self.host),
            "streams": len(self.streams),
            "events": len(self.event_flags),
            "graphs": len(self.graphs),
            "graph_execs": len(self.graph_execs),
            "registered": len(self.registered),
            "ipc_open": sum(self.ipc_open.values()),
        }
        return {**by_owner, **{k: v for k, v in live.items() if v or k in ("pinned", "streams")}}


class FakeCuda:
    """``.cudart`` (``cuda.bindings.runtime`` stand-in) over ``.gpu`` (a :class:`FakeGPU`)."""

    def __init__(self, gpu: FakeGPU | None = None) -> None:
        self.gpu = gpu or FakeGPU()
        self.cudart = make_cudart(self.gpu)


def make_cudart(gpu: FakeGPU) -> ModuleType:
    m = ModuleType("fake_cudart")

    class cudaError_t(enum.IntEnum):
        cudaSuccess = 0
        cudaErrorInvalidValue = 1
        cudaErrorMemoryAllocation = 2
        cudaErrorInsufficientDriver = 35
        cudaErrorNoDevice = 100
        cudaErrorInvalidDevice = 101
        cudaErrorInvalidResourceHandle = 400
        cudaErrorIllegalState = 401
        cudaErrorNotReady = 600
        cudaErrorIllegalAddress = 700
        cudaErrorHostMemoryAlreadyRegistered = 712
        cudaErrorHostMemoryNotRegistered = 713
        cudaErrorNotSupported = 801
        cudaErrorStreamCaptureUnsupported = 900
        cudaErrorStreamCaptureInvalidated = 901

    class cudaMemcpyKind(enum.IntEnum):
        cudaMemcpyHostToHost = 0
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2
        cudaMemcpyDeviceToDevice = 3
        cudaMemcpyDefault = 4

    class cudaMemcpySrcAccessOrder(enum.IntEnum):
        cudaMemcpySrcAccessOrderInvalid = 0
        cudaMemcpySrcAccessOrderStream = 1
        cudaMemcpySrcAccessOrderDuringApiCall = 2
        cudaMemcpySrcAccessOrderAny = 3

    class cudaMemcpyAttributes:
        """The attributes of copies in a batch (only the source access order matters here)."""

        def __init__(self, _ptr=0):
            self.srcAccessOrder = cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderInvalid
            self.flags = 0

    class cudaDeviceAttr(enum.IntEnum):
        cudaDevAttrComputeCapabilityMajor = 75
        cudaDevAttrComputeCapabilityMinor = 76

    class cudaStreamCaptureMode(enum.IntEnum):
        cudaStreamCaptureModeGlobal = 0
        cudaStreamCaptureModeThreadLocal = 1
        cudaStreamCaptureModeRelaxed = 2

    class cudaIpcMemHandle_t:
        """64 opaque bytes at ``getPtr()``, as the real handle (``_ptr``: view those bytes at an address)."""

        def __init__(self, _ptr=0):
            self._raw = (ctypes.c_char * 64).from_address(_ptr) if _ptr else (ctypes.c_char * 64)()

        def getPtr(self):
            return ctypes.addressof(self._raw)

    ok = cudaError_t.cudaSuccess
    E = cudaError_t
    current = {"device": 0}

    def injected(name: str) -> cudaError_t | None:
        gpu.calls[name] += 1
        if gpu.device_count == 0:
            return E.cudaErrorNoDevice
        err = gpu.inject.pop(name, None)
        return None if err is None else E(err)

    def _run(stream: int) -> cudaError_t:
        ops, gpu.streams[stream] = gpu.streams[stream], []
        status = ok
        for op in ops:
            gpu.clock_ms += getattr(op, "cost_ms", gpu.op_ms)
            code = op()
            if code != ok and status == ok:
                status = E(code)
        return status

    # ---- errors, devices

    def cudaGetErrorName(error):
        return ok, E(error).name.encode()

    def cudaGetErrorString(error):
        return ok, f"fake error {int(error)}".encode()

    def cudaGetDeviceCount():
        err = injected("cudaGetDeviceCount")
        if err is not None:
            return err, 0
        return ok, gpu.device_count

    def cudaSetDevice(device):
        err = injected("cudaSetDevice")
        if err is not None:
            return (err,)
        if not 0 <= int(device) < gpu.device_count:
            return (E.cudaErrorInvalidDevice,)
        current["device"] = int(device)
        return (ok,)

    def cudaDeviceGetAttribute(attr, device):
        err = injected("cudaDeviceGetAttribute")
        if err is not None:
            return err, 0
        if attr == cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor:
            return ok, gpu.capability[0]
        if attr == cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor:
            return ok, gpu.capability[1]
        return E.cudaErrorInvalidValue, 0

    def cudaMemGetInfo():
        err = injected("cudaMemGetInfo")
        if err is not None:
            return err, 0, 0
        return ok, gpu.total_memory - gpu.used(), gpu.total_memory

    # ---- streams

    def cudaStreamCreateWithFlags(flags):
        err = injected("cudaStreamCreateWithFlags")
        if err is not None:
            return err, None
        if int(flags) not in (0, 1):
            return E.cudaErrorInvalidValue, None
        return ok, gpu.new_stream()

    def cudaStreamSynchronize(stream):
        err = injected("cudaStreamSynchronize")
        if err is not None:
            return (err,)
        if int(stream) not in gpu.streams:
            return (E.cudaErrorInvalidResourceHandle,)
        if int(stream) in gpu.capturing:  # illegal in every capture mode; the capture is lost
            gpu.capturing[int(stream)]["invalid"] = True
            return (E.cudaErrorStreamCaptureUnsupported,)
        return (_run(int(stream)),)

    def cudaStreamDestroy(stream):
        err = injected("cudaStreamDestroy")
        if err is not None:
            return (err,)
        if int(stream) not in gpu.streams:
            return (E.cudaErrorInvalidResourceHandle,)
        _run(int(stream))  # like CUDA: queued work completes, then the stream goes
        del gpu.streams[int(stream)]
        gpu.events.append("stream destroyed")
        return (ok,)

    # ---- events

    def cudaEventCreateWithFlags(flags):
        err = injected("cudaEventCreateWithFlags")
        if err is not None:
            return err, None
        if int(flags) & ~0b1111:
            return E.cudaErrorInvalidValue, None
        event = gpu.new_id()
        gpu.event_flags[event] = int(flags)
        return ok, event

    def cudaEventRecord(event, stream):
        err = injected("cudaEventRecord")
        if err is not None:
            return (err,)
        event, stream = int(event), int(stream)
        if event not in gpu.event_flags or stream not in gpu.streams:
            return (E.cudaErrorInvalidResourceHandle,)

        def op() -> int:
            gpu.event_times[event] = gpu.clock_ms
            return ok

        op.cost_ms = 0.0  # type: ignore[attr-defined]
        gpu.event_times[event] = None
        gpu.event_stream[event] = stream
        gpu.enqueue(stream, op)
        return (ok,)

    def cudaEventSynchronize(event):
        err = injected("cudaEventSynchronize")
        if err is not None:
            return (err,)
        event = int(event)
        if event not in gpu.event_flags:
            return (E.cudaErrorInvalidResourceHandle,)
        stream = gpu.event_stream.get(event)
        if gpu.event_times.get(event, 0.0) is None and stream in gpu.streams:
            return (_run(stream),)  # runs the whole queue: the event's point and whatever follows it
        return (ok,)

    def cudaEventElapsedTime(start, end):
        err = injected("cudaEventElapsedTime")
        if err is not None:
            return err, 0.0
        start, end = int(start), int(end)
        for event in (start, end):
            if event not in gpu.event_flags or event not in gpu.event_times or gpu.event_flags[event] & 2:
                return E.cudaErrorInvalidResourceHandle, 0.0  # unknown, never recorded, or cudaEventDisableTiming
        t0, t1 = gpu.event_times[start], gpu.event_times[end]
        if t0 is None or t1 is None:
            return E.cudaErrorNotReady, 0.0
        return ok, float(t1 - t0)

    def cudaEventDestroy(event):
        err = injected("cudaEventDestroy")
        if err is not None:
            return (err,)
        if gpu.event_flags.pop(int(event), None) is None:
            return (E.cudaErrorInvalidResourceHandle,)
        gpu.event_times.pop(int(event), None)
        return (ok,)

    # ---- graphs

    def cudaStreamBeginCapture(stream, mode):
        err = injected("cudaStreamBeginCapture")
        if err is not None:
            return (err,)
        stream = int(stream)
        if stream not in gpu.streams or stream in gpu.capturing or int(mode) not in (0, 1, 2):
            return (E.cudaErrorInvalidValue,)
        gpu.capturing[stream] = {"mode": int(mode), "ops": [], "invalid": False}
        return (ok,)

    def cudaStreamEndCapture(stream):
        err = injected("cudaStreamEndCapture")
        if err is not None:
            return err, None
        capture = gpu.capturing.pop(int(stream), None)
        if capture is None:
            return E.cudaErrorIllegalState, None
        if capture["invalid"]:
            return E.cudaErrorStreamCaptureInvalidated, None
        graph = gpu.new_id()
        gpu.graphs[graph] = capture["ops"]
        return ok, graph

    def cudaGraphInstantiate(graph, flags):
        err = injected("cudaGraphInstantiate")
        if err is not None:
            return err, None
        if int(graph) not in gpu.graphs:
            return E.cudaErrorInvalidValue, None
        graph_exec = gpu.new_id()
        gpu.graph_execs[graph_exec] = list(gpu.graphs[int(graph)])
        return ok, graph_exec

    def cudaGraphLaunch(graphExec, stream):
        err = injected("cudaGraphLaunch")
        if err is not None:
            return (err,)
        if int(graphExec) not in gpu.graph_execs or int(stream) not in gpu.streams:
            return (E.cudaErrorInvalidResourceHandle,)
        for op in gpu.graph_execs[int(graphExec)]:
            gpu.enqueue(int(stream), op)
        return (ok,)

    def cudaGraphExecDestroy(graphExec):
        err = injected("cudaGraphExecDestroy")
        if err is not None:
            return (err,)
        if gpu.graph_execs.pop(int(graphExec), None) is None:
            return (E.cudaErrorInvalidValue,)
        return (ok,)

    def cudaGraphDestroy(graph):
        err = injected("cudaGraphDestroy")
        if err is not None:
            return (err,)
        if gpu.graphs.pop(int(graph), None) is None:
            return (E.cudaErrorInvalidValue,)
        return (ok,)

    # ---- memory

    def cudaMalloc(size):
        err = injected("cudaMalloc")
        if err is not None:
            return err, 0
        if gpu.strict_capture():
            return E.cudaErrorStreamCaptureUnsupported, 0
        if gpu.used() + int(size) > gpu.total_memory:
            return E.cudaErrorMemoryAllocation, 0
        return ok, gpu.alloc(int(size), "cudaMalloc")

    def cudaFree(devPtr):
        err = injected("cudaFree")
        if err is not None:
            return (err,)
        if gpu.device_owner.get(int(devPtr)) != "cudaMalloc" or not gpu.free(int(devPtr)):
            return (E.cudaErrorInvalidValue,)
        gpu.events.append("device buffer freed")
        return (ok,)

    def cudaMallocHost(size):
        err = injected("cudaMallocHost")
        if err is not None:
            return err, 0
        if gpu.strict_capture():
            return E.cudaErrorStreamCaptureUnsupported, 0
        buf = (ctypes.c_uint8 * max(int(size), 1))()
        ptr = ctypes.addressof(buf)
        gpu.host[ptr] = buf
        return ok, ptr

    def cudaFreeHost(ptr):
        err = injected("cudaFreeHost")
        if err is not None:
            return (err,)
        if gpu.host.pop(int(ptr), None) is None:
            return (E.cudaErrorInvalidValue,)
        gpu.events.append("pinned buffer freed")
        return (ok,)

    def cudaHostRegister(ptr, size, flags):
        err = injected("cudaHostRegister")
        if err is not None:
            return (err,)
        ptr, size, flags = int(ptr), int(size), int(flags)
        if size <= 0 or ptr == 0 or flags & ~0b1111:
            return (E.cudaErrorInvalidValue,)
        if flags & 8 and not gpu.host_register_read_only:
            return (E.cudaErrorNotSupported,)
        if gpu.host_ok(ptr, 1) or any(base < ptr + size and ptr < base + n for base, n in gpu.registered.items()):
            return (E.cudaErrorHostMemoryAlreadyRegistered,)
        gpu.registered[ptr] = size
        return (ok,)

    def cudaHostUnregister(ptr):
        err = injected("cudaHostUnregister")
        if err is not None:
            return (err,)
        if gpu.registered.pop(int(ptr), None) is None:
            return (E.cudaErrorHostMemoryNotRegistered,)
        return (ok,)

    def cudaMemcpyAsync(dst, src, count, kind, stream):
        err = injected("cudaMemcpyAsync")
        if err is not None:
            return (err,)
        dst, src, count, stream = int(dst), int(src), int(count), int(stream)
        if stream not in gpu.streams:
            return (E.cudaErrorInvalidResourceHandle,)
        if kind == cudaMemcpyKind.cudaMemcpyHostToDevice:
            valid = gpu.host_ok(src, count) and gpu.find_device(dst, count) is not None

            def op() -> int:  # reads the host buffer when the copy RUNS, as DMA does
                gpu.write(dst, ctypes.string_at(src, count))
                return ok

        elif kind == cudaMemcpyKind.cudaMemcpyDeviceToHost:
            valid = gpu.host_ok(dst, count) and gpu.find_device(src, count) is not None

            def op() -> int:
                ctypes.memmove(dst, gpu.read(src, count), count)
                return ok

        elif kind == cudaMemcpyKind.cudaMemcpyDeviceToDevice:
            valid = gpu.find_device(src, count) is not None and gpu.find_device(dst, count) is not None

            def op() -> int:
                gpu.write(dst, gpu.read(src, count))
                return ok

        else:
            valid = False
        if not valid:
            return (E.cudaErrorInvalidValue,)
        gpu.enqueue(stream, op)
        return (ok,)

    def cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream):
        """Host-to-device copies only (what the layer batches); every copy needs an attribute with a valid source
        access order, as CUDA checks. ``gpu.batch_copies = False`` plays a driver without the call."""
        err = injected("cudaMemcpyBatchAsync")
        if err is not None:
            return (err,)
        if not gpu.batch_copies:
            return (E.cudaErrorNotSupported,)
        count, stream = int(count), int(stream)
        if stream not in gpu.streams:
            return (E.cudaErrorInvalidResourceHandle,)
        if (not (len(dsts) == len(srcs) == len(sizes) == count) or count == 0 or int(numAttrs) != len(attrs)
                or list(attrsIdxs)[:1] != [0] or any(a.srcAccessOrder == 0 for a in attrs)):
            return (E.cudaErrorInvalidValue,)
        copies = [(int(d), int(s), int(n)) for d, s, n in zip(dsts, srcs, sizes)]
        if not all(gpu.host_ok(s, n) and gpu.find_device(d, n) is not None for d, s, n in copies):
            return (E.cudaErrorInvalidValue,)
        for d, s, n in copies:  # each read when it RUNS, as DMA does
            gpu.enqueue(stream, lambda d=d, s=s, n=n: (gpu.write(d, ctypes.string_at(s, n)), ok)[1])
        return (ok,)

    def cudaMemsetAsync(devPtr, value, count, stream):
        err = injected("cudaMemsetAsync")
        if err is not None:
            return (err,)
        dst, count, stream = int(devPtr), int(count), int(stream)
        if stream not in gpu.streams:
            return (E.cudaErrorInvalidResourceHandle,)
        if gpu.find_device(dst, count) is None:
            return (E.cudaErrorInvalidValue,)
        gpu.enqueue(stream, lambda: (gpu.write(dst, bytes([int(value) & 0xFF]) * count), ok)[1])
        return (ok,)

    def cudaIpcOpenMemHandle(handle, flags):
        err = injected("cudaIpcOpenMemHandle")
        if err is not None:
            return err, 0
        if int(flags) != 1:  # must be cudaIpcMemLazyEnablePeerAccess
            return E.cudaErrorInvalidValue, 0
        ptr = gpu.ipc_exports.get(ctypes.string_at(handle.getPtr(), 64))
        if ptr is None or ptr not in gpu.device:
            return E.cudaErrorInvalidResourceHandle, 0
        gpu.ipc_open[ptr] += 1
        return ok, ptr

    def cudaIpcCloseMemHandle(devPtr):
        err = injected("cudaIpcCloseMemHandle")
        if err is not None:
            return (err,)
        if gpu.ipc_open[int(devPtr)] <= 0:
            return (E.cudaErrorInvalidValue,)
        gpu.ipc_open[int(devPtr)] -= 1
        gpu.ipc_open += Counter()  # drop zero counts
        return (ok,)

    for name, obj in list(locals().items()):
        if name.startswith("cuda"):
            setattr(m, name, obj)
    m.cudaStreamDefault = 0
    m.cudaStreamNonBlocking = 1
    m.cudaEventDefault = 0
    m.cudaEventDisableTiming = 2
    m.cudaEventBlockingSync = 1
    m.cudaHostRegisterDefault = 0
    m.cudaHostRegisterReadOnly = 8
    m.cudaHostRegisterPortable = 1
    m.cudaIpcMemLazyEnablePeerAccess = 1
    return m
