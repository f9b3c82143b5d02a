"""ONNX Runtime on CUDA: what every CUDA context shares (the plan of its sessions, its pinned and device buffers,
the device-memory measurement) and the contexts without CUDA graphs: one session per allowed batch size, or one
session for any size.

Every CUDA context computes on its own non-blocking stream (``user_compute_stream``); a batch is staged in pinned
memory (or read in place from page-locked memory: the caller's :meth:`host_buffer` view, a ``cudaHostRegister``-ed
shared-memory segment), copied host-to-device asynchronously on that stream and computed there, so one context's
copies overlap another context's compute. All CUDA work holds :data:`engines.cuda.CAPTURE_GATE` shared (see
:mod:`engines.cuda.gate`).

Memory accounting: a context's :attr:`device_nbytes` is the drop of the device's free memory (``cudaMemGetInfo``)
across its creation (sessions, weights, workspaces, warm-up and graph capture), measured under one process-wide
lock so that concurrent loads do not blur each other's figures.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnxruntime as ort

from ..base import DeviceContext, EngineError, RowParts, TensorSpec
from ..cuda import (CAPTURE_GATE, DeviceBuffer, PinnedBuffer, Stream, mem_get_info, memcpy_batch_async, memset_async,
                    page_locked, set_device)
from ..datatypes import NUMPY_DTYPES
from .cpu import run_failure
from .options import cuda_provider, session_options

#: IOBinding's device name for the context's device buffers. Tests that run the CUDA contexts on ONNX Runtime's CPU
#: build over the stand-in CUDA runtime (whose "device" memory is host memory) set it to ``"cpu"``.
ORT_DEVICE = "cuda"

#: Serialises the device-memory measurement around context creation.
_MEASURE_LOCK = threading.Lock()

T = TypeVar("T")


def measured(device_id: int, build: Callable[[], T]) -> tuple[T, int]:
    """``(build(), bytes)``: run ``build`` and measure how much the free memory of ``device_id`` dropped meanwhile
    (never negative), under the process-wide measurement lock."""
    with _MEASURE_LOCK:
        free_before, _ = mem_get_info(device_id)
        result = build()
        free_after, _ = mem_get_info(device_id)
    return result, max(0, free_before - free_after)


@dataclass(frozen=True)
class CudaPlan:
    """How a CUDA context's sessions are made: the model file (the fp16 copy for ``precision: fp16``), the device
    and the options, and the model's tensors."""

    path: Path
    device_id: int
    precision: str
    intra_op_threads: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    gpu_mem_limit: int | None = None
    arena_extend_strategy: str | None = None

    def providers(self, stream: Stream, *, graphs: bool) -> list[Any]:
        """The provider list: the CUDA provider on ``stream``; the CPU provider as the fallback for nodes CUDA has
        no kernel for, except with ``graphs`` (a CUDA graph must hold every node)."""
        cuda = cuda_provider(self.device_id, stream.ptr, self.precision, graphs=graphs,
                             gpu_mem_limit=self.gpu_mem_limit, arena_extend_strategy=self.arena_extend_strategy)
        return [cuda] if graphs else [cuda, "CPUExecutionProvider"]

    def session(self, stream: Stream, *, graphs: bool) -> ort.InferenceSession:
        """A new session computing on ``stream``.

        Raises:
            EngineError: ONNX Runtime refused (out of memory; with ``graphs``: "This session cannot use the graph
                capture feature as requested" - a compute node not on the CUDA provider, control-flow nodes), with
                its reason.
        """
        try:
            return ort.InferenceSession(str(self.path), session_options(self.intra_op_threads),
                                        providers=self.providers(stream, graphs=graphs))
        except Exception as exc:
            raise EngineError(f"onnxruntime cannot load {self.path} on CUDA device {self.device_id}: {exc}") from exc

    def static_shapes(self, rows: int) -> dict[str, tuple[int, ...]] | None:
        """Every input's and output's shape at ``rows`` rows, or ``None`` when a dim other than the batch dim is
        dynamic (fixed buffers and CUDA graphs need them all)."""
        shapes = {}
        for spec in self.inputs + self.outputs:
            if not spec.shape or spec.shape[0] != -1 or any(d < 0 for d in spec.shape[1:]):
                return None
            shapes[spec.name] = (rows, *spec.shape[1:])
        return shapes

    def dtype(self, name: str) -> np.dtype:
        spec = next(s for s in self.inputs + self.outputs if s.name == name)
        return np.dtype(NUMPY_DTYPES[spec.datatype])


class IOBuffers:
    """Per tensor name, a pinned host buffer and a device buffer of the same size; grown on demand
    (:meth:`ensure`), or sized once for the largest batch and never moved (what a CUDA graph needs)."""

    def __init__(self) -> None:
        self.pinned: dict[str, PinnedBuffer] = {}
        self.device: dict[str, DeviceBuffer] = {}

    def ensure(self, name: str, nbytes: int) -> tuple[PinnedBuffer, DeviceBuffer]:
        """The buffers of ``name``, reallocated when smaller than ``nbytes``."""
        pinned, dev = self.pinned.get(name), self.device.get(name)
        if pinned is None or dev is None or pinned.nbytes < nbytes:
            if pinned is not None and dev is not None:
                pinned.free()
                dev.free()
            pinned, dev = PinnedBuffer(nbytes), DeviceBuffer(nbytes)
            self.pinned[name], self.device[name] = pinned, dev
        return pinned, dev

    def host_view(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A writable view of ``name``'s pinned buffer."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.ensure(name, nbytes)[0].view(shape, dtype)

    def needs_copy(self, name: str, arr: np.ndarray) -> bool:
        """Whether :meth:`upload` copies ``arr`` into ``name``'s pinned buffer first (it is not C-contiguous
        page-locked memory, nor that buffer itself)."""
        pinned = self.pinned.get(name)
        src = arr.ctypes.data
        return not (arr.flags.c_contiguous and ((pinned is not None and src == pinned.ptr)
                                                or page_locked(src, arr.nbytes)))

    def upload(self, name: str, arr: np.ndarray, stream: Stream) -> DeviceBuffer:
        """Queue ``arr`` host-to-device into ``name``'s device buffer on ``stream``: straight from ``arr`` when it is
        page-locked (the pinned buffer itself, or registered memory), else after ONE copy into the pinned buffer."""
        pinned, dev = self.ensure(name, arr.nbytes)
        src = arr.ctypes.data
        if self.needs_copy(name, arr):
            np.copyto(pinned.view(arr.shape, arr.dtype), arr)
            src = pinned.ptr
        dev.copy_from_host_async(src, arr.nbytes, stream, repr(name), locked=True)  # the pinned buffer or locked
        return dev

    def upload_parts(self, name: str, rows: RowParts, stream: Stream) -> DeviceBuffer:
        """Queue input ``name`` host-to-device part by part into ``name``'s device buffer on ``stream``: one DMA per
        run of requests that lie back to back in host memory (a front end's shared area hands out consecutive
        blocks, so a batch from one front end is often one run), straight from the page-locked arrays (no host
        copy), then the padding rows set to zero on the device. Every part must be page-locked
        (:meth:`CudaContext.gather_rows` checked it) and stay alive and unchanged until the stream has
        synchronized."""
        _, dev = self.ensure(name, rows.nbytes)
        copies, offset = [], 0
        for src, nbytes in contiguous_runs(rows.parts, page_locked, rows.ptrs):
            copies.append((dev.ptr + offset, src, nbytes))
            offset += nbytes
        memcpy_batch_async(copies, stream, repr(name), locked=True)  # one call for all the runs, keeping the GIL
        if offset < rows.nbytes:
            memset_async(dev.ptr + offset, 0, rows.nbytes - offset, stream, f"{name!r} padding")
        return dev

    @property
    def device_nbytes(self) -> int:
        return sum(buf.nbytes for buf in self.device.values())

    def free(self) -> None:
        for buf in [*self.pinned.values(), *self.device.values()]:
            buf.free()
        self.pinned.clear()
        self.device.clear()


def contiguous_runs(parts: list[np.ndarray], joinable: Callable[[int, int], bool],
                    ptrs: list[int] | None = None) -> list[tuple[int, int]]:
    """``(address, bytes)`` of each run of C-contiguous ``parts`` that follow each other in memory, in order: a part
    starting where the previous one ends joins its run if ``joinable(start, bytes)`` holds for the run with it
    (:func:`page_locked`: inside one page-locked range, as two mappings that happen to be adjacent are not).
    ``ptrs``: the parts' addresses where known (:attr:`RowParts.ptrs`)."""
    runs: list[list[int]] = []
    for part, ptr in zip(parts, ptrs if ptrs is not None else [p.ctypes.data for p in parts]):
        n = part.nbytes
        if runs and runs[-1][0] + runs[-1][1] == ptr and joinable(runs[-1][0], runs[-1][1] + n):
            runs[-1][1] += n
        else:
            runs.append([ptr, n])
    return [(ptr, n) for ptr, n in runs]


def check_rows(inputs: Mapping[str, np.ndarray], sizes: tuple[int, ...] | None) -> int:
    """The batch's rows (first dim, equal over the inputs), which must be one of ``sizes`` unless that is None.

    Raises:
        EngineError: no inputs, inputs that disagree, or rows that are no prepared size (names the sizes).
    """
    rows = {a.shape[0] if a.ndim else 0 for a in inputs.values()}
    if len(rows) != 1:
        raise EngineError(f"inputs disagree on the batch size: {sorted(rows)}" if rows else "no inputs")
    n = rows.pop()
    if sizes is not None and n not in sizes:
        raise EngineError(f"batch of {n} rows: this context runs only the batch sizes {list(sizes)}; pad the batch "
                          "up to the next one")
    return n


def _call(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)


class CudaContext(DeviceContext):
    """What the CUDA contexts share: their plan, allowed sizes and measured device memory, and their facts."""

    #: ``describe()["execution"]``
    execution = ""
    _device_nbytes = 0

    def __init__(self, plan: CudaPlan, batch_sizes: tuple[int, ...] | None) -> None:
        """What every CUDA context starts with; the subclass adds its own, then calls :meth:`_measure_build`."""
        self._plan = plan
        self._sizes = batch_sizes
        self._output_names = [o.name for o in plan.outputs]
        self._buffers = IOBuffers()
        self._stream: Stream | None = None

    def _build(self) -> None:
        """Create the context's stream, sessions and buffers (the subclass's)."""
        raise NotImplementedError

    def _measure_build(self, call: Callable[..., Any] | None = None) -> None:
        """Run :meth:`_build` through ``call`` (default: on this thread) and keep the device memory it took
        (:func:`measured`); on any failure, release what was made and re-raise."""
        try:
            _, self._device_nbytes = (call or _call)(measured, self._plan.device_id, self._build)
        except BaseException:
            self.release()
            raise

    @property
    def nbytes(self) -> int:
        return self._device_nbytes

    def describe(self) -> dict[str, Any]:
        return {"execution": self.execution, "precision": self._plan.precision, "batch_sizes": self._sizes_fact,
                "device_id": self._plan.device_id}


class CudaSessionsContext(CudaContext):
    """CUDA sessions without graphs: one per allowed batch size (ONNX Runtime rebuilds its cuDNN plans on every change
    of input shape, tens of ms per batch on the H200; a session that only ever sees one shape never does), or one
    session for any size when ``batch_sizes`` is ``None``.

    The fallback for models a CUDA graph cannot hold. Inputs are bound to the context's device buffers; outputs are
    allocated by ONNX Runtime and copied to the host by ``copy_outputs_to_cpu`` (which synchronizes).
    """

    execution = "cuda_sessions"

    def __init__(self, plan: CudaPlan, batch_sizes: tuple[int, ...] | None, fallback_reason: str | None = None) -> None:
        super().__init__(plan, batch_sizes)
        self._reason = fallback_reason
        self._sessions: dict[int | None, ort.InferenceSession] = {}
        self._bindings: dict[int | None, Any] = {}
        set_device(plan.device_id)
        self._measure_build()

    def _build(self) -> None:
        with CAPTURE_GATE.shared():
            self._stream = Stream()
            for size in self._sizes or (None,):
                session = self._plan.session(self._stream, graphs=False)
                self._sessions[size] = session
                self._bindings[size] = session.io_binding()
        for size in self._sizes or ():  # warm-up: cuDNN searches each session's algorithms once (dims permitting;
            if self._plan.static_shapes(size) is None:  # else the caller's warm-up with its dims does it)
                break
            self.execute({s.name: np.zeros((size, *s.shape[1:]), self._plan.dtype(s.name)) for s in self._plan.inputs})

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        if self._reason:
            facts["fallback_reason"] = self._reason
        return facts

    def host_buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        set_device(self._plan.device_id)
        with CAPTURE_GATE.shared():
            return self._buffers.host_view(name, shape, dtype)

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self._sessions or self._stream is None:
            raise EngineError("execution context was released")
        n = check_rows(inputs, self._sizes)
        key = n if self._sizes else None
        set_device(self._plan.device_id)  # the current device is per thread: allocate and copy on the session's
        binding = self._bindings[key]
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        try:
            with CAPTURE_GATE.shared():
                for name, arr in inputs.items():
                    dev = self._buffers.upload(name, arr, self._stream)
                    binding.bind_input(name, ORT_DEVICE, self._plan.device_id, arr.dtype, list(arr.shape), dev.ptr)
                for name in self._output_names:
                    binding.bind_output(name, ORT_DEVICE, self._plan.device_id)
                self._sessions[key].run_with_iobinding(binding)
                outs = binding.copy_outputs_to_cpu()
        except EngineError:
            raise
        except Exception as exc:
            raise run_failure(exc, inputs, "onnxruntime (cuda)") from exc
        return dict(zip(self._output_names, outs))

    def release(self) -> None:
        if self._stream is None and not self._sessions:
            return
        set_device(self._plan.device_id)
        with CAPTURE_GATE.shared():
            self._bindings.clear()
            self._sessions.clear()
            self._buffers.free()
            if self._stream is not None:
                self._stream.destroy()
                self._stream = None
