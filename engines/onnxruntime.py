"""ONNX Runtime backend: the portable engine (CPU execution provider; CUDA provider with onnxruntime-gpu).

Each execution context is its own ``InferenceSession`` with its own intra-op thread pool, like one Triton
ONNX Runtime model instance, so contexts run side by side without sharing a thread pool. A session's ``run`` is
thread-safe in ONNX Runtime, but the contract does not rely on it: one thread per context.

Memory accounting (bytes): the engine counts the model file (its weights); a context counts the growth of the
process's resident memory measured while its session was created (CPU) - ONNX Runtime reports no figure itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .base import Engine, EngineError, ExecutionContext, TensorSpec
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


class OnnxRuntimeContext(ExecutionContext):
    """An ``InferenceSession`` owned by one thread at a time."""

    def __init__(self, session: ort.InferenceSession, output_names: Sequence[str], nbytes: int) -> None:
        self._session: ort.InferenceSession | None = session
        self._output_names = list(output_names)
        self._nbytes = nbytes

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._session is None:
            raise EngineError("execution context was released")
        try:
            results = self._session.run(self._output_names, dict(inputs))
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidArgument/RuntimeException types
            raise EngineError(f"onnxruntime: {exc}") from exc
        return dict(zip(self._output_names, results))

    def release(self) -> None:
        self._session = None


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

    def __init__(self, path: str | os.PathLike[str], *, device: str = "cpu", intra_op_threads: int = 1) -> None:
        self.path = Path(path)
        if device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise EngineError(
                    "device cuda needs onnxruntime-gpu (CUDAExecutionProvider); available providers: "
                    + ", ".join(ort.get_available_providers())
                )
            self._providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        elif device == "cpu":
            self._providers = ["CPUExecutionProvider"]
        else:
            raise EngineError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.device = device
        self.intra_op_threads = intra_op_threads
        try:
            self._model_bytes = self.path.read_bytes()
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
        with _MEASURE_LOCK:
            before = rss_bytes()
            try:
                session = ort.InferenceSession(self._model_bytes, self._options(), providers=self._providers)
            except Exception as exc:
                raise EngineError(f"onnxruntime cannot load {self.path}: {exc}") from exc
            grown = max(0, rss_bytes() - before)
        return OnnxRuntimeContext(session, [o.name for o in session.get_outputs()], grown), session

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._outputs

    @property
    def max_batch_size(self) -> int | None:
        # ONNX has no optimization profile: a dynamic first dim on every input leaves the limit to the config;
        # a fixed first dim means the model cannot batch (0, Triton's "max_batch_size: 0").
        firsts = {spec.shape[0] if spec.shape else 0 for spec in self._inputs}
        return None if firsts == {-1} else 0

    @property
    def nbytes(self) -> int:
        return len(self._model_bytes)

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
        self._model_bytes = b""
        self._released = True
