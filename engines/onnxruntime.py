"""ONNX Runtime backend: the portable engine (CPU execution provider; CUDA provider with onnxruntime-gpu).

Each execution context is its own ``InferenceSession`` with its own intra-op thread pool, like one Triton
ONNX Runtime model instance, so contexts run side by side without sharing a thread pool. A session's ``run`` is
thread-safe in ONNX Runtime, but the contract does not rely on it: one thread per context.

On CUDA (``device="cuda"``, needs onnxruntime-gpu and cuda-python) each context owns a CUDA stream that its
session computes on (``user_compute_stream``), pinned host staging buffers and device input buffers, bound with
IOBinding: a batch is copied into pinned memory, sent host-to-device asynchronously on the context's stream and
computed there, so one context's copies overlap another context's compute.

Strings: the engine contract's BYTES tensors hold ``bytes``; ONNX Runtime's Python binding takes ``str`` for a
string tensor (a ``bytes`` element would become the text ``"b'abc'"``) and gives ``str`` back. A context decodes
BYTES inputs as UTF-8 and encodes string outputs as UTF-8, so text goes through byte-exact. Bytes that are not
UTF-8 cannot be carried by an ONNX Runtime string tensor: :class:`EngineInputError` (the server checks this before
queueing, :attr:`OnnxRuntimeEngine.bytes_as_text`). A batch with string inputs that ONNX Runtime fails on at run
time (``RUNTIME_EXCEPTION``/``INVALID_ARGUMENT``: a string-parsing operator such as ``Cast`` meets text it cannot
parse) fails with :class:`EngineInputError` too: the data, not the model, is at fault. Run-time failures are not
logged by ONNX Runtime's own logger (the exception carries the message).

Memory accounting (bytes): the engine counts the model file (its weights); a context counts the growth of the
process's resident memory (CPU) or of used device memory (CUDA, ``cudaMemGetInfo``) measured while its session
was created - ONNX Runtime reports no figure itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .base import Engine, EngineError, EngineInputError, ExecutionContext, TensorSpec
from .cuda import set_device
from .datatypes import ONNX_TYPES
from .memory import rss_bytes

#: Serialises the memory measurement around session creation: concurrent loads would blur each other's deltas.
_MEASURE_LOCK = threading.Lock()


def _spec(arg: ort.NodeArg) -> TensorSpec:
    try:
        datatype = ONNX_TYPES[arg.type]
    except KeyError:
        raise EngineError(f"tensor {arg.name!r} has type {arg.type}, which the server does not support") from None
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or []))
    return TensorSpec(arg.name, datatype, shape)


#: ONNX Runtime's run-time errors that text input can cause (a string-parsing operator); the pybind error types.
_DATA_ERRORS = tuple(getattr(ort.capi.onnxruntime_pybind11_state, n) for n in ("RuntimeException", "InvalidArgument"))


def _quiet_run_options() -> ort.RunOptions:
    """Run options that keep ONNX Runtime's own logger quiet on a failed run (the exception says why)."""
    ro = ort.RunOptions()
    ro.log_severity_level = 4  # fatal only
    return ro


def text_feeds(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs as ONNX Runtime takes them: BYTES (object arrays of ``bytes``) decoded to ``str`` as UTF-8.

    Raises:
        EngineInputError: a BYTES element is not UTF-8 (the message names the input and the element).
    """
    feeds = {}
    for name, arr in inputs.items():
        if arr.dtype == object:
            flat = arr.ravel()
            try:
                text = np.fromiter((b.decode("utf-8") if isinstance(b, bytes) else b for b in flat), object, flat.size)
            except UnicodeDecodeError as exc:
                raise EngineInputError(f"input {name!r}: a BYTES element is not UTF-8 text ({exc.reason} at byte "
                                       f"{exc.start}); ONNX Runtime string tensors carry UTF-8 text only") from None
            arr = text.reshape(arr.shape)
        feeds[name] = arr
    return feeds


def bytes_outputs(arr: np.ndarray) -> np.ndarray:
    """An ONNX Runtime output as the contract has it: string tensors (``str`` elements) as ``bytes`` (UTF-8)."""
    if arr.dtype != object:
        return arr
    flat = arr.ravel()
    return np.fromiter((s.encode("utf-8") if isinstance(s, str) else s for s in flat), object, flat.size).reshape(
        arr.shape)


class OnnxRuntimeContext(ExecutionContext):
    """An ``InferenceSession`` owned by one thread at a time."""

    def __init__(self, session: ort.InferenceSession, output_names: Sequence[str], nbytes: int) -> None:
        self._session: ort.InferenceSession | None = session
        self._output_names = list(output_names)
        self._nbytes = nbytes
        self._run_options = _quiet_run_options()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._session is None:
            raise EngineError("execution context was released")
        feeds = text_feeds(inputs)
        try:
            results = self._session.run(self._output_names, feeds, self._run_options)
        except _DATA_ERRORS as exc:
            if any(a.dtype == object for a in feeds.values()):  # text the model could not parse
                raise EngineInputError(f"onnxruntime could not run on this input: {exc}") from exc
            raise EngineError(f"onnxruntime: {exc}") from exc
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidArgument/RuntimeException types
            raise EngineError(f"onnxruntime: {exc}") from exc
        return {name: bytes_outputs(r) for name, r in zip(self._output_names, results)}

    def release(self) -> None:
        self._session = None


class OnnxRuntimeCudaContext(OnnxRuntimeContext):
    """A CUDA session on its own stream, fed through IOBinding from pinned host buffers."""

    def __init__(self, session: ort.InferenceSession, output_names: Sequence[str], nbytes: int, stream,
                 device_id: int) -> None:
        super().__init__(session, output_names, nbytes)
        self._stream = stream
        self._device_id = device_id
        self._binding = session.io_binding()
        self._pinned: dict[str, object] = {}
        self._device: dict[str, object] = {}
        #: string tensors have no device memory in ONNX Runtime: such a model runs through plain ``run``
        self._strings = any(a.type == "tensor(string)" for a in [*session.get_inputs(), *session.get_outputs()])

    def _buffers(self, name: str, nbytes: int):
        from .cuda import DeviceBuffer, PinnedBuffer

        pinned, dev = self._pinned.get(name), self._device.get(name)
        if pinned is None or pinned.nbytes < nbytes:  # grow to the largest batch seen, then reuse
            if pinned is not None:
                pinned.free()
                dev.free()
            pinned, dev = PinnedBuffer(nbytes), DeviceBuffer(nbytes)
            self._pinned[name], self._device[name] = pinned, dev
        return pinned, dev

    def host_buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        set_device(self._device_id)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self._buffers(name, nbytes)[0].view(shape, dtype)

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._session is None:
            raise EngineError("execution context was released")
        if self._strings:
            set_device(self._device_id)
            return super().execute(inputs)
        set_device(self._device_id)  # the current device is per thread: allocate and copy on the session's
        b = self._binding
        b.clear_binding_inputs()
        b.clear_binding_outputs()
        try:
            for name, arr in inputs.items():
                pinned, dev = self._buffers(name, arr.nbytes)
                if arr.ctypes.data != pinned.ptr:  # not stacked straight into the staging buffer
                    np.copyto(pinned.view(arr.shape, arr.dtype), arr)
                dev.copy_from_host_async(pinned.ptr, arr.nbytes, self._stream)
                b.bind_input(name, "cuda", self._device_id, arr.dtype, list(arr.shape), dev.ptr)
            for name in self._output_names:
                b.bind_output(name, "cuda", self._device_id)
            self._session.run_with_iobinding(b)
            outs = b.copy_outputs_to_cpu()
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"onnxruntime (cuda): {exc}") from exc
        return dict(zip(self._output_names, outs))

    def release(self) -> None:
        if self._session is None:
            return
        self._session = None
        self._binding = None
        for buf in [*self._pinned.values(), *self._device.values()]:
            buf.free()
        self._pinned.clear()
        self._device.clear()
        self._stream.destroy()


class OnnxRuntimeEngine(Engine):
    """An ONNX model served through ONNX Runtime.

    Args:
        path: ``.onnx`` file.
        device: ``"cpu"`` or ``"cuda"`` (CUDA execution provider, needs onnxruntime-gpu).
        intra_op_threads: threads of each context's intra-op pool (0: ONNX Runtime's default, all cores).

    Raises:
        EngineError: the file is missing or not a valid model, a tensor type is unsupported, or the CUDA
            provider was asked for and is not installed.
    """

    backend = "onnxruntime"
    bytes_as_text = True

    def __init__(
        self, path: str | os.PathLike[str], *, device: str = "cpu", intra_op_threads: int = 1, device_id: int = 0
    ) -> None:
        self.path = Path(path)
        self.device_id = device_id
        if device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise EngineError(
                    "device cuda needs onnxruntime-gpu (CUDAExecutionProvider); available providers: "
                    + ", ".join(ort.get_available_providers())
                )
            self._providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
            if hasattr(ort, "preload_dlls"):
                ort.preload_dlls()  # the CUDA/cuDNN libraries of the nvidia-* wheels
        elif device == "cpu":
            self._providers = ["CPUExecutionProvider"]
        else:
            raise EngineError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.device = device
        self.intra_op_threads = intra_op_threads
        try:
            self._model_nbytes = self.path.stat().st_size
        except OSError as exc:
            raise EngineError(f"cannot read model file {self.path}: {exc.strerror}") from exc
        # A probe session gives the I/O specs; it becomes the first context so no work is wasted.
        first, session = self._new_context()
        self._spare: OnnxRuntimeContext | None = first
        self._inputs = tuple(_spec(a) for a in session.get_inputs())
        self._outputs = tuple(_spec(a) for a in session.get_outputs())
        self._released = False

    def _options(self) -> ort.SessionOptions:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.intra_op_threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Spinning pool threads burn the cores that other contexts and the event loop need.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.log_severity_level = 3
        return opts

    def _new_context(self) -> tuple[OnnxRuntimeContext, ort.InferenceSession]:
        if self.device == "cuda":
            return self._new_cuda_context()
        with _MEASURE_LOCK:
            before = rss_bytes()
            session = self._session(self._providers)
            grown = max(0, rss_bytes() - before)
        return OnnxRuntimeContext(session, [o.name for o in session.get_outputs()], grown), session

    def _new_cuda_context(self) -> tuple[OnnxRuntimeContext, ort.InferenceSession]:
        from .cuda import Stream, mem_get_info

        with _MEASURE_LOCK:
            free_before, _ = mem_get_info(self.device_id)  # checks the device and makes it current
            stream = Stream()
            providers = [
                ("CUDAExecutionProvider", {
                    "device_id": str(self.device_id),
                    "user_compute_stream": str(stream.ptr),
                    "use_tf32": "0",  # exact fp32: TF32 convolutions differ from CPU results by ~1e-2
                    # ORT's own copies on this context's stream, not the legacy default stream that
                    # serialises with every other context.
                    "do_copy_in_default_stream": "0",
                }),
                "CPUExecutionProvider",
            ]
            try:
                session = self._session(providers)
            except BaseException:
                stream.destroy()
                raise
            grown = max(0, free_before - mem_get_info(self.device_id)[0])
        ctx = OnnxRuntimeCudaContext(session, [o.name for o in session.get_outputs()], grown, stream, self.device_id)
        return ctx, session

    def _session(self, providers) -> ort.InferenceSession:
        try:
            return ort.InferenceSession(str(self.path), self._options(), providers=providers)
        except Exception as exc:
            raise EngineError(f"onnxruntime cannot load {self.path}: {exc}") from exc

    @property
    def max_batch_size(self) -> int | None:
        # ONNX has no optimization profile: a dynamic first dim on every input leaves the limit to the config;
        # a fixed first dim means the model cannot batch (0, Triton's "max_batch_size: 0").
        firsts = {spec.shape[0] if spec.shape else 0 for spec in self._inputs}
        return None if firsts == {-1} else 0

    @property
    def nbytes(self) -> int:
        return self._model_nbytes

    def create_context(self) -> OnnxRuntimeContext:
        if self._released:
            raise EngineError("engine was released")
        if self._spare is not None:
            ctx, self._spare = self._spare, None
            return ctx
        return self._new_context()[0]

    def release(self) -> None:
        if self._spare is not None:
            self._spare.release()
            self._spare = None
        self._released = True
