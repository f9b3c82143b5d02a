"""One TensorRT execution context: its ``IExecutionContext``, CUDA stream, device buffers and pinned staging
buffers, and the batch sequence (see the package docstring)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..base import EngineError, ExecutionContext
from ..cuda import CudaError, DeviceBuffer, PinnedBuffer, Stream, set_device
from ..datatypes import NUMPY_DTYPES
from .api import TensorRTError, dims
from .profiles import ProfileBounds, Shape, buffer_nbytes, slice_rows

if TYPE_CHECKING:
    from .engine import TensorRTEngine


class TensorRTContext(ExecutionContext):
    """One ``IExecutionContext`` with its stream, device buffers and pinned staging buffers. Not thread-safe.

    Created by :meth:`TensorRTEngine.create_context` on optimization profile ``profile``.

    Raises (constructor):
        TensorRTError: TensorRT refused the profile or a shape, or an output's shape depends on the data (needs an
            IOutputAllocator; not supported). CudaError: a CUDA call failed (message names it and the CUDA error).
            Everything allocated so far is freed.
    """

    def __init__(self, owner: TensorRTEngine, profile: int) -> None:
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
        try:
            self._setup()
        except BaseException:
            self._free_all()
            raise

    def _setup(self) -> None:
        cuda_engine = self._cuda_engine
        set_device(self._owner.device_id)
        stream = self._stream = Stream()
        self._activation_nbytes = int(cuda_engine.device_memory_size_v2)
        trt_context = cuda_engine.create_execution_context()
        if trt_context is None:
            raise TensorRTError("create_execution_context() returned None (out of device memory?)")
        self._trt_context = trt_context
        if not trt_context.set_optimization_profile_async(self.profile_index, stream.ptr):
            raise TensorRTError(f"set_optimization_profile_async({self.profile_index}) was refused")
        stream.synchronize()
        # Size every buffer for the profile's largest shapes: inputs at their max, outputs as TensorRT infers them.
        shapes: dict[str, Shape] = {}
        for name, (_lo, hi) in self._bounds.shapes.items():
            if not trt_context.set_input_shape(name, hi):
                raise TensorRTError(f"set_input_shape({name!r}, {list(hi)}) refused for profile {self.profile_index}")
            shapes[name] = hi
        for spec in self._owner.outputs:
            shape = dims(trt_context.get_tensor_shape(spec.name))
            if any(d < 0 for d in shape):
                raise TensorRTError(
                    f"output {spec.name!r} has data-dependent shape {list(shape)}; not supported (needs an "
                    "IOutputAllocator)"
                )
            shapes[spec.name] = shape
        for name, shape in shapes.items():
            nbytes = buffer_nbytes(shape, self._dtypes[name])
            self._device[name] = device = DeviceBuffer(nbytes)
            self._pinned[name] = PinnedBuffer(nbytes)
            if not trt_context.set_tensor_address(name, device.ptr):
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
        out_shapes = self._set_shapes(shapes)
        stream = self._stream
        assert stream is not None
        try:
            for name, shape in shapes.items():
                nbytes = buffer_nbytes(shape, self._dtypes[name])
                self._stage(name, arrays[name], nbytes)
                self._device[name].copy_from_host_async(self._pinned[name].ptr, nbytes, stream, repr(name))
            if not self._trt_context.execute_async_v3(stream.ptr):
                raise TensorRTError(f"execute_async_v3 returned False for input shapes {shapes}")
            for name, shape in out_shapes.items():
                nbytes = buffer_nbytes(shape, self._dtypes[name])
                self._device[name].copy_to_host_async(self._pinned[name].ptr, nbytes, stream, repr(name))
            stream.synchronize()
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

    def _set_shapes(self, shapes: Mapping[str, Shape]) -> dict[str, Shape]:
        """``set_input_shape`` for every input, then every output's shape as TensorRT infers it.

        Raises:
            TensorRTError: TensorRT refused an input shape, or an output does not fit its buffer.
        """
        trt_context = self._trt_context
        for name, shape in shapes.items():
            if not trt_context.set_input_shape(name, shape):
                lo, hi = self._bounds.shapes[name]
                raise TensorRTError(
                    f"TensorRT refused set_input_shape({name!r}, {list(shape)}) "
                    f"(profile {self.profile_index}: min {list(lo)}, max {list(hi)})"
                )
        out_shapes: dict[str, Shape] = {}
        for spec in self._owner.outputs:
            shape = dims(trt_context.get_tensor_shape(spec.name))
            need = buffer_nbytes(shape, self._dtypes[spec.name]) if min(shape, default=0) >= 0 else -1
            if need < 0 or need > self._device[spec.name].nbytes:
                raise TensorRTError(
                    f"output {spec.name!r} shape {list(shape)} for inputs {dict(shapes)} does not fit its buffer"
                )
            out_shapes[spec.name] = shape
        return out_shapes

    def _stage(self, name: str, arr: np.ndarray, nbytes: int) -> None:
        """Put ``arr`` into input ``name``'s pinned buffer (unless it is already there: :meth:`host_buffer`) and
        zero the padding rows up to ``nbytes`` (the size of the launch shape)."""
        view = self._pinned[name].array
        if arr.ctypes.data != self._pinned[name].ptr:
            view[: arr.nbytes] = arr.reshape(-1).view(np.uint8)
        if nbytes > arr.nbytes:
            view[arr.nbytes : nbytes] = 0  # padding rows up to the profile's minimum batch, not stale data

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
        self._trt_context = None  # destroys the IExecutionContext (and its activation memory) first
        self._cuda_engine = None  # a released context must not keep the ICudaEngine alive
        for buf in [*self._device.values(), *self._pinned.values()]:
            attempt(buf.free)
        self._device, self._pinned = {}, {}
        if self._stream is not None:
            attempt(self._stream.destroy)
            self._stream = None
        return errors
