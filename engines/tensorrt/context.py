"""One TensorRT execution context: its ``IExecutionContext``, CUDA stream, device buffers and pinned staging
buffers, and the batch sequence (see the package docstring)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..base import DeviceContext, EngineError
from ..cuda import CAPTURE_GATE, CudaError, DeviceBuffer, PinnedBuffer, Stream, set_device
from ..datatypes import NUMPY_DTYPES
from .api import TensorRTError, dims
from .graphs import ShapeGraph, bind_addresses, capture_graphs, graph_sizes, set_profile_and_shapes
from .profiles import ProfileBounds, Shape, buffer_nbytes, slice_rows

if TYPE_CHECKING:
    from .engine import TensorRTEngine

log = logging.getLogger("engines.tensorrt")


class TensorRTContext(DeviceContext):
    """One ``IExecutionContext`` with its stream, device buffers and pinned staging buffers. Not thread-safe.

    Created by :meth:`TensorRTEngine.create_context` on optimization profile ``profile``. Its :attr:`batch_sizes`
    are the sizes with a CUDA graph (``None``: any size in the profile, enqueued without graphs).

    Raises (constructor):
        TensorRTError: TensorRT refused the profile or a shape, or an output's shape depends on the data (needs an
            IOutputAllocator; not supported). CudaError: a CUDA call failed (message names it and the CUDA error).
            Everything allocated so far is freed.
    """

    def __init__(self, owner: TensorRTEngine, profile: int, batch_sizes: tuple[int, ...] | None = None) -> None:
        self._owner = owner
        self._cuda_engine = owner._cuda_engine
        self.profile_index = profile
        self._stream: Stream | None = None
        self._trt_context: Any = None
        self._device: dict[str, DeviceBuffer] = {}  # one per I/O tensor, sized for the profile's maximum
        self._pinned: dict[str, PinnedBuffer] = {}  # host staging, same sizes
        self._dtypes = {s.name: NUMPY_DTYPES[s.datatype] for s in owner.inputs + owner.outputs}
        self._released = False
        self._activation_nbytes = 0
        self._bounds = ProfileBounds.of(owner._profiles, profile)
        self._graphs: dict[int, ShapeGraph] = {}  # batch size -> its context and CUDA graph (with batch_sizes)
        self._activation: DeviceBuffer | None = None  # their shared activation memory
        self._fallback: str | None = graph_sizes(self._bounds, batch_sizes) if batch_sizes else None
        self._sizes = batch_sizes if batch_sizes and self._fallback is None else None
        if self._fallback:
            log.warning("%s: no CUDA graphs (%s); batches run by execute_async_v3", owner.path.name, self._fallback)
        try:
            with CAPTURE_GATE.shared():  # no ONNX Runtime capture of this process may run meanwhile
                self._setup()
        except BaseException:
            self._free_all()
            raise

    def _setup(self) -> None:
        cuda_engine = self._cuda_engine
        set_device(self._owner.device_id)
        stream = self._stream = Stream()
        self._activation_nbytes = int(cuda_engine.device_memory_size_v2)
        if self._sizes:  # a context and a CUDA graph per allowed size (.graphs); no context of the default strategy
            owner = self._owner
            trt = owner._trt
            try:
                self._activation, self._graphs = capture_graphs(
                    self._cuda_engine, trt, self._bounds, self._sizes, stream, [o.name for o in owner.outputs],
                    self._allocate, self._device)
            except BaseException as exc:
                self._activation, self._graphs = getattr(exc, "partial", (None, {}))
                raise
            return
        trt_context = cuda_engine.create_execution_context()
        if trt_context is None:
            raise TensorRTError("create_execution_context() returned None (out of device memory?)")
        self._trt_context = trt_context
        # Size every buffer for the profile's largest shapes: inputs at their max, outputs as TensorRT infers them.
        shapes: dict[str, Shape] = {name: hi for name, (_lo, hi) in self._bounds.shapes.items()}
        set_profile_and_shapes(trt_context, self.profile_index, stream, shapes)
        for spec in self._owner.outputs:
            shape = dims(trt_context.get_tensor_shape(spec.name))
            if any(d < 0 for d in shape):
                raise TensorRTError(
                    f"output {spec.name!r} has data-dependent shape {list(shape)}; not supported (needs an "
                    "IOutputAllocator)"
                )
            shapes[spec.name] = shape
        self._allocate(shapes)
        bind_addresses(trt_context, self._device)

    def _allocate(self, shapes: dict[str, Shape]) -> None:
        """One device and one pinned buffer per I/O tensor, sized for ``shapes`` (the profile's largest)."""
        for name, shape in shapes.items():
            nbytes = buffer_nbytes(shape, self._dtypes[name])
            self._device[name] = DeviceBuffer(nbytes)
            self._pinned[name] = PinnedBuffer(nbytes)

    # ---- contract

    def describe(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"execution": "tensorrt_graphs" if self._sizes else "tensorrt",
                                 "batch_sizes": self._sizes_fact,
                                 "profile": self.profile_index, "device_id": self._owner.device_id}
        if self._fallback:
            facts["fallback_reason"] = self._fallback
        return facts

    @property
    def nbytes(self) -> int:
        """Device bytes: the engine's ``device_memory_size_v2`` (this context's activation memory) plus the I/O
        buffers. 0 once released."""
        if self._released:
            return 0
        return self._activation_nbytes + self.io_nbytes

    @property
    def io_nbytes(self) -> int:
        """Bytes of this context's device I/O buffers (each at least 1)."""
        return sum(buf.nbytes for buf in self._device.values())

    @property
    def pinned_nbytes(self) -> int:
        """Bytes of pinned host staging memory (``cudaMallocHost``) this context holds (each buffer at least 1)."""
        return sum(buf.nbytes for buf in self._pinned.values())

    @property
    def max_batch_size(self) -> int:
        """Largest batch this context's profile accepts."""
        return self._bounds.max_batch

    def host_buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """A writable view of input ``name``'s pinned staging buffer, ``shape``/``dtype``, that :meth:`execute`
        sends to the device without a further host copy when it is passed back as that input. Valid until the next
        call on this context. ``None`` when ``name`` is not an input, ``dtype`` is not the engine's, or ``shape``
        does not fit the buffer (the profile's maximum).
        """
        if self._released or name not in self._pinned or name not in self._bounds.shapes:
            return None
        dtype = np.dtype(dtype)
        if dtype != self._dtypes[name] or any(int(d) < 0 for d in shape):
            return None
        if buffer_nbytes(shape, dtype) > self._pinned[name].array.size:
            return None
        return self._pinned[name].view(shape, dtype)

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch (see the package docstring for the sequence of calls).

        Args:
            inputs: every input by name, first dimension ``n`` rows (``1 <= n <=`` this profile's max batch),
                dtype exactly the engine's (e.g. float32 for FP32), other dims inside the profile.

        Returns:
            every output by name, owned numpy arrays with first dimension ``n``.

        Raises:
            EngineError: wrong/missing inputs, dtype, rows, or a shape outside the profile (names the tensor, the
                shape and the profile's min/max). TensorRTError: TensorRT refused a shape or the execution.
                CudaError: a CUDA call failed. The context stays usable after any of them.
        """
        if self._released:
            raise EngineError("execution context was released")
        arrays = {n: np.ascontiguousarray(a) for n, a in inputs.items()}
        rows, shapes = self._bounds.launch_shapes(arrays, self._dtypes)
        set_device(self._owner.device_id)
        stream = self._stream
        assert stream is not None
        graph = None
        if self._sizes:
            launch = next(iter(shapes.values()))[0]
            graph = self._graphs.get(launch)
            if graph is None:
                raise EngineError(f"batch of {rows} rows: this context runs only the batch sizes {list(self._sizes)}; "
                                  "pad the batch up to the next one")
            out_shapes = graph.outputs
        else:
            out_shapes = set_shapes(self._trt_context, shapes, self._bounds, self._dtypes, self._device)
        try:
            with CAPTURE_GATE.shared():
                self._run(shapes, out_shapes, arrays, graph, stream)
        except (CudaError, TensorRTError):
            try:  # let queued copies finish before the pinned buffers are reused
                stream.synchronize()
            except CudaError:
                pass
            raise
        return {
            name: slice_rows(self._pinned[name].view(shape, self._dtypes[name]), rows)
            for name, shape in out_shapes.items()
        }

    def _run(self, shapes: Mapping[str, Shape], out_shapes: Mapping[str, Shape], arrays: Mapping[str, np.ndarray],
             graph: ShapeGraph | None, stream: Stream) -> None:
        """Stage and copy the inputs, launch the graph or enqueue, copy the outputs back, synchronize once."""
        for name, shape in shapes.items():
            nbytes = buffer_nbytes(shape, self._dtypes[name])
            stage(self._pinned[name], arrays[name], nbytes)
            self._device[name].copy_from_host_async(self._pinned[name].ptr, nbytes, stream, repr(name), locked=True)
        if graph is not None:
            graph.graph.launch(stream)
        elif not self._trt_context.execute_async_v3(stream.ptr):
            raise TensorRTError(f"execute_async_v3 returned False for input shapes {shapes}")
        for name, shape in out_shapes.items():
            nbytes = buffer_nbytes(shape, self._dtypes[name])
            self._device[name].copy_to_host_async(self._pinned[name].ptr, nbytes, stream, repr(name), locked=True)
        stream.synchronize()

    def release(self) -> None:
        """Destroy the IExecutionContext, free device and pinned buffers, destroy the stream. Idempotent.

        Raises:
            CudaError: some CUDA free failed (everything else is still freed).
        """
        if self._released:
            return
        self._released = True
        try:
            errors = self._free_all()
        finally:
            self._owner._forget(self)
        if errors:
            raise CudaError("; ".join(errors))

    def _free_all(self) -> list[str]:
        """Free in order: wait for the stream, the TensorRT context (and its activation memory), device buffers,
        pinned buffers, the stream. Returns the error messages of the frees that failed."""
        errors: list[str] = []

        def attempt(free: Any) -> None:
            try:
                free()
            except CudaError as exc:
                errors.append(str(exc))

        if self._stream is not None:
            attempt(self._stream.synchronize)
        for shape_graph in self._graphs.values():
            attempt(shape_graph.graph.destroy)
        self._graphs = {}  # destroys the per-size IExecutionContexts, before their activation memory
        if self._activation is not None:
            attempt(self._activation.free)
            self._activation = None
        self._trt_context = None  # destroys the IExecutionContext (and its activation memory) first
        self._cuda_engine = None  # a released context must not keep the ICudaEngine alive
        for buf in [*self._device.values(), *self._pinned.values()]:
            attempt(buf.free)
        self._device, self._pinned = {}, {}
        if self._stream is not None:
            attempt(self._stream.destroy)
            self._stream = None
        return errors


def set_shapes(trt_context: Any, shapes: Mapping[str, Shape], bounds: ProfileBounds, dtypes: Mapping[str, np.dtype],
               device: Mapping[str, DeviceBuffer]) -> dict[str, Shape]:
    """``set_input_shape`` for every input, then every output's shape as TensorRT infers it (outputs are the
    tensors of ``device`` that are no inputs).

    Raises:
        TensorRTError: TensorRT refused an input shape, or an output does not fit its buffer.
    """
    for name, shape in shapes.items():
        if not trt_context.set_input_shape(name, shape):
            lo, hi = bounds.shapes[name]
            raise TensorRTError(
                f"TensorRT refused set_input_shape({name!r}, {list(shape)}) "
                f"(profile {bounds.index}: min {list(lo)}, max {list(hi)})"
            )
    out_shapes: dict[str, Shape] = {}
    for name in (n for n in device if n not in bounds.shapes):
        shape = dims(trt_context.get_tensor_shape(name))
        need = buffer_nbytes(shape, dtypes[name]) if min(shape, default=0) >= 0 else -1
        if need < 0 or need > device[name].nbytes:
            raise TensorRTError(f"output {name!r} shape {list(shape)} for inputs {dict(shapes)} does not fit its buffer")
        out_shapes[name] = shape
    return out_shapes


def stage(pinned: PinnedBuffer, arr: np.ndarray, nbytes: int) -> None:
    """Put ``arr`` into an input's pinned buffer (unless it is already there: :meth:`TensorRTContext.host_buffer`)
    and zero the padding rows up to ``nbytes`` (the size of the launch shape)."""
    view = pinned.array
    if arr.ctypes.data != pinned.ptr:
        view[: arr.nbytes] = arr.reshape(-1).view(np.uint8)
    if nbytes > arr.nbytes:
        view[arr.nbytes : nbytes] = 0  # padding rows up to the profile's minimum batch, not stale data
