"""The ONNX Runtime engine: opens a model for the CPU or CUDA provider and hands out contexts of the right kind."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import onnxruntime as ort

from ..base import Engine, EngineError, ExecutionContext
from ..memory import rss_bytes
from .cpu import OnnxRuntimeContext, tensor_spec
from .cuda import _MEASURE_LOCK, CudaPlan, CudaSessionsContext
from .graphs import CudaGraphContext
from .options import check_cuda_options, fp16_path, resolve_precision, session_options

log = logging.getLogger("engines.onnxruntime")


def _check_sizes(batch_sizes: Sequence[int] | None) -> tuple[int, ...] | None:
    if batch_sizes is None:
        return None
    sizes = tuple(int(b) for b in batch_sizes)
    if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
        raise EngineError(f"batch_sizes must be increasing distinct positive integers, got {list(batch_sizes)}")
    return sizes


class OnnxRuntimeEngine(Engine):
    """An ONNX model served through ONNX Runtime.

    Args:
        path: ``.onnx`` file.
        device: ``"cpu"`` or ``"cuda"`` (CUDA execution provider, needs onnxruntime-gpu and cuda-python).
        intra_op_threads: threads of each context's intra-op pool (0: ONNX Runtime's default, all cores).
        device_id: the CUDA device.
        precision: ``fp32 | tf32 | fp16`` or ``None`` (tf32 on CUDA, fp32 on CPU); see :mod:`.options`.
        batch_sizes: the allowed batch sizes (increasing). On CUDA each context prepares one executable per size
            while it is created (a CUDA graph, or a session with ``gpu_execution: sessions``), warm-up included, and
            then runs only those sizes; ``None``: any size, one session. Ignored on CPU (any size runs).
        gpu_mem_limit: bytes, the cap of each context's arena (ONNX Runtime's ``gpu_mem_limit``).
        arena_extend_strategy: ``kNextPowerOfTwo`` or ``kSameAsRequested``.
        gpu_execution: ``graphs`` (fail when the model cannot be captured), ``sessions`` (one session per size),
            ``auto`` (graphs, else sessions - logged once as a warning and shown by the contexts' ``describe()``).
        cache: folder of the fp16 copies (default: the zoo's cache folder ``/fp16``).

    Raises:
        EngineError: the file is missing or not a valid model, a tensor type is unsupported, the CUDA provider was
            asked for and is not installed, or an option is invalid.
    """

    backend = "onnxruntime"
    bytes_as_text = True

    def __init__(self, path: str | os.PathLike[str], *, device: str = "cpu", intra_op_threads: int = 1,
                 device_id: int = 0, precision: str | None = None, batch_sizes: Sequence[int] | None = None,
                 gpu_mem_limit: int | None = None, arena_extend_strategy: str | None = None,
                 gpu_execution: str = "auto", cache: Path | None = None) -> None:
        self.path = Path(path)
        if device not in ("cpu", "cuda"):
            raise EngineError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.device, self.device_id, self.intra_op_threads = device, device_id, intra_op_threads
        self.precision = resolve_precision(precision, device)
        self.batch_sizes = _check_sizes(batch_sizes)
        check_cuda_options(gpu_mem_limit, arena_extend_strategy, gpu_execution)
        self.gpu_execution = gpu_execution
        try:
            self._model_nbytes = self.path.stat().st_size
        except OSError as exc:
            raise EngineError(f"cannot read model file {self.path}: {exc.strerror}") from exc
        self._released = False
        self._spare: OnnxRuntimeContext | None = None
        self.fallback_reason: str | None = None
        if device == "cpu":
            # A probe session gives the I/O specs; it becomes the first context so no work is wasted.
            self._spare = self._cpu_context()
            session = self._spare._session
        else:
            self._require_cuda_provider()
            session = self._session(self.path, ["CPUExecutionProvider"], optimize=False)  # specs only
        self._inputs = tuple(tensor_spec(a) for a in session.get_inputs())
        self._outputs = tuple(tensor_spec(a) for a in session.get_outputs())
        del session
        if device == "cuda":
            from ..zoo import cache_dir

            model = fp16_path(self.path, cache or cache_dir() / "fp16") if self.precision == "fp16" else self.path
            self._plan = CudaPlan(model, device_id, self.precision, intra_op_threads, self._inputs, self._outputs,
                                  gpu_mem_limit, arena_extend_strategy)

    @staticmethod
    def _require_cuda_provider() -> None:
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise EngineError("device cuda needs onnxruntime-gpu (CUDAExecutionProvider); available providers: "
                              + ", ".join(ort.get_available_providers()))
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # the CUDA/cuDNN libraries of the nvidia-* wheels

    def _session(self, path: Path, providers: list, *, optimize: bool = True) -> ort.InferenceSession:
        opts = session_options(self.intra_op_threads)
        if not optimize:
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        try:
            return ort.InferenceSession(str(path), opts, providers=providers)
        except Exception as exc:
            raise EngineError(f"onnxruntime cannot load {path}: {exc}") from exc

    def _cpu_context(self) -> OnnxRuntimeContext:
        with _MEASURE_LOCK:
            before = rss_bytes()
            session = self._session(self.path, ["CPUExecutionProvider"])
            grown = max(0, rss_bytes() - before)
        return OnnxRuntimeContext(session, [o.name for o in session.get_outputs()], grown)

    def _cuda_string_context(self) -> OnnxRuntimeContext:
        """A model with string tensors on CUDA: plain ``run`` on a CUDA session (ONNX Runtime keeps strings on the
        host, so IOBinding to device buffers and CUDA graphs cannot hold them); ONNX Runtime does the copies."""
        provider = {"device_id": str(self.device_id), "use_tf32": "1" if self.precision == "tf32" else "0"}
        session = self._session(self._plan.path, [("CUDAExecutionProvider", provider), "CPUExecutionProvider"])
        return OnnxRuntimeContext(session, [o.name for o in self._outputs], 0,
                                  {"execution": "cuda_run", "precision": self.precision, "device_id": self.device_id})

    def _cuda_context(self) -> ExecutionContext:
        if any(s.datatype == "BYTES" for s in (*self._inputs, *self._outputs)):
            return self._cuda_string_context()
        sizes = self.batch_sizes
        if sizes is None:
            return CudaSessionsContext(self._plan, None)
        if self.gpu_execution != "sessions" and self.fallback_reason is None:
            try:
                return CudaGraphContext(self._plan, sizes)
            except EngineError as exc:
                if self.gpu_execution == "graphs":
                    raise
                self.fallback_reason = str(exc)
                log.warning("%s: no CUDA graphs (%s); one session per batch size %s instead", self.path.name,
                            exc, list(sizes))
        return CudaSessionsContext(self._plan, sizes, self.fallback_reason)

    @property
    def max_batch_size(self) -> int | None:
        # ONNX has no optimization profile: a dynamic first dim on every input leaves the limit to the config;
        # a fixed first dim means the model cannot batch (0, Triton's "max_batch_size: 0").
        firsts = {spec.shape[0] if spec.shape else 0 for spec in self._inputs}
        return None if firsts == {-1} else 0

    @property
    def nbytes(self) -> int:
        return self._model_nbytes

    def create_context(self) -> ExecutionContext:
        """A new context: CPU session; on CUDA a CUDA-graph context (``batch_sizes`` given, ``gpu_execution``
        graphs/auto), else a sessions context. Blocking: on CUDA it captures or warms every allowed size.

        Raises:
            EngineError: released, or the backend could not create it (out of memory; with ``gpu_execution:
                graphs``, a model CUDA graphs cannot hold).
        """
        if self._released:
            raise EngineError("engine was released")
        if self._spare is not None:
            ctx, self._spare = self._spare, None
            return ctx
        return self._cpu_context() if self.device == "cpu" else self._cuda_context()

    def release(self) -> None:
        if self._spare is not None:
            self._spare.release()
            self._spare = None
        self._released = True
