"""The TensorRT engine: a deserialized plan, its I/O tensors and profiles, its memory report, and the contexts it
hands out (see the package docstring for the memory accounting and the data types)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..base import Engine, EngineError, TensorSpec
from ..cuda import CudaError, require_device
from .api import TensorRTError, dims, kserve_datatype, load_trt, trt_type_name
from .context import TensorRTContext
from .profiles import ProfileShapes, max_batch_from_profiles, pick_profile, read_profile_shapes


class TensorRTEngine(Engine):
    """A serialized TensorRT plan loaded by the TensorRT runtime.

    Args:
        path: plan file (as written by ``engines.trt_build``/``trtexec --saveEngine``).
        runtime: ``"full"`` (``import tensorrt``), ``"lean"`` (``tensorrt_lean``), ``"dispatch"``
            (``tensorrt_dispatch``) or ``"auto"`` (the first of those that imports). The lean and dispatch
            runtimes run only version-compatible plans (``trt_build --version-compatible``).
        device_id: CUDA device the engine and its contexts live on.
        allow_host_code: set ``Runtime.engine_host_code_allowed``, needed to deserialize version-compatible plans
            that embed the lean runtime (executable host code). Load only plans you built or trust.
        batch_sizes: the allowed batch sizes: each context captures a CUDA graph per size (:mod:`.graphs`) and
            runs only those; they must lie in its profile's batch range. ``None``: any size, no graphs.

    Raises:
        EngineError: the runtime is not installed (message names the pip package), the file cannot be read,
            TensorRT cannot deserialize it (other TensorRT version or GPU, not a plan), or an I/O tensor is
            unsupported (BF16/FP8/INT4/FP4 type, host-located shape tensor, scalar input).
        CudaError: cuda-python is not installed (message names the pip package), or no usable CUDA device /
            ``device_id`` out of range; checked before any TensorRT object is created.
    """

    backend = "tensorrt"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        runtime: str = "auto",
        device_id: int = 0,
        allow_host_code: bool = True,
        batch_sizes: Sequence[int] | None = None,
    ) -> None:
        self.path = Path(path)
        self.batch_sizes = tuple(int(b) for b in batch_sizes) if batch_sizes else None
        if self.batch_sizes and list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise EngineError(f"batch_sizes must be increasing distinct sizes, got {list(self.batch_sizes)}")
        trt, self.runtime = load_trt(runtime)
        self._trt = trt
        self.device_id = device_id
        self._lock = threading.Lock()
        self._contexts: list[TensorRTContext] = []
        self._released = False
        try:
            plan = self.path.read_bytes()
        except OSError as exc:
            raise EngineError(f"cannot read TensorRT plan {self.path}: {exc.strerror}") from exc
        self._plan_nbytes = len(plan)
        require_device(device_id)
        # The logger and the runtime must outlive the engine: both are kept until release().
        self._logger = trt.Logger(trt.Logger.WARNING)
        runtime_obj = trt.Runtime(self._logger)
        if allow_host_code:
            runtime_obj.engine_host_code_allowed = True
        self._runtime = runtime_obj
        cuda_engine = runtime_obj.deserialize_cuda_engine(plan)
        if cuda_engine is None:
            raise EngineError(
                f"TensorRT {trt.__version__} ({self.runtime} runtime) cannot deserialize {self.path}: built by another "
                "TensorRT version or for another GPU, not version-compatible (lean/dispatch runtimes need "
                "--version-compatible plans), or not a plan; TensorRT's log above gives its reason"
            )
        self._cuda_engine = cuda_engine
        self._read_io()

    def _read_io(self) -> None:
        trt, cuda_engine = self._trt, self._cuda_engine
        inputs, outputs = [], []
        for i in range(cuda_engine.num_io_tensors):
            name = cuda_engine.get_tensor_name(i)
            mode = cuda_engine.get_tensor_mode(name)
            datatype = kserve_datatype(trt_type_name(trt, cuda_engine.get_tensor_dtype(name)), name)
            if cuda_engine.get_tensor_location(name) != trt.TensorLocation.DEVICE:
                raise EngineError(f"tensor {name!r} lives in host memory (a shape tensor); not supported")
            spec = TensorSpec(name, datatype, dims(cuda_engine.get_tensor_shape(name)))
            if mode == trt.TensorIOMode.INPUT:
                if not spec.shape:
                    raise EngineError(f"input {name!r} is a scalar; the server needs a batch dimension first")
                inputs.append(spec)
            elif mode == trt.TensorIOMode.OUTPUT:
                outputs.append(spec)
        self._inputs, self._outputs = tuple(inputs), tuple(outputs)
        self.num_profiles = int(cuda_engine.num_optimization_profiles)
        self._profiles: dict[str, list[ProfileShapes]] = {
            spec.name: [read_profile_shapes(cuda_engine, spec, p) for p in range(self.num_profiles)]
            for spec in self._inputs
        }
        self._max_batch = max_batch_from_profiles(self._profiles)

    # ---- Engine contract

    @property
    def max_batch_size(self) -> int:
        """Smallest profile maximum of the batch dimension over all inputs and profiles (never ``None``)."""
        return self._max_batch

    @property
    def nbytes(self) -> int:
        """Size of the serialized plan in bytes (weights + kernels the engine holds)."""
        return self._plan_nbytes

    @property
    def device_nbytes(self) -> int:
        """The plan's size: the weights and kernels the deserialized engine keeps on the device."""
        return self._plan_nbytes

    def profile_shapes(self, name: str) -> list[ProfileShapes]:
        """``(min, opt, max)`` shapes of input ``name``, one triple per optimization profile.

        Raises:
            KeyError: no such input.
        """
        return list(self._profiles[name])

    def memory_report(self) -> dict[str, Any]:
        """What TensorRT itself reports, in bytes: ``plan_bytes``; ``weights_bytes``
        (``get_engine_stat(TOTAL_WEIGHTS_SIZE)``, ``None`` before TensorRT 10.x added it); ``context_bytes``
        (``device_memory_size_v2``: activation memory of one STATIC context); ``profile_bytes`` (per profile,
        ``get_device_memory_size_for_profile_v2``).

        Raises:
            EngineError: the engine was released.
        """
        cuda_engine = self._require_engine()
        trt = self._trt
        weights = None
        if hasattr(cuda_engine, "get_engine_stat"):
            weights = int(cuda_engine.get_engine_stat(trt.EngineStat.TOTAL_WEIGHTS_SIZE))
        return {
            "plan_bytes": self._plan_nbytes,
            "weights_bytes": weights,
            "context_bytes": int(cuda_engine.device_memory_size_v2),
            "profile_bytes": [
                int(cuda_engine.get_device_memory_size_for_profile_v2(p)) for p in range(self.num_profiles)
            ],
        }

    def _require_engine(self) -> Any:
        if self._released:
            raise EngineError("engine was released")
        return self._cuda_engine

    def create_context(self) -> TensorRTContext:
        """Create a context on the least-used optimization profile (see :func:`.profiles.pick_profile`).

        Raises:
            EngineError: the engine was released. TensorRTError: TensorRT refused (profile, shape, out of device
                memory); CudaError: a CUDA call failed. Everything allocated so far is freed.
        """
        self._require_engine()
        with self._lock:
            profile = pick_profile([c.profile_index for c in self._contexts], self.num_profiles)
            ctx = TensorRTContext(self, profile, self.batch_sizes)
            self._contexts.append(ctx)
        return ctx

    def _forget(self, ctx: TensorRTContext) -> None:
        with self._lock:
            if ctx in self._contexts:
                self._contexts.remove(ctx)

    def release(self) -> None:
        """Release every live context, then the engine, then the runtime and logger. Idempotent.

        Raises:
            CudaError: a context's CUDA memory or stream could not be freed (the rest is still freed).
        """
        if self._released:
            return
        self._released = True
        errors = []
        for ctx in list(self._contexts):
            try:
                ctx.release()
            except (CudaError, TensorRTError) as exc:
                errors.append(str(exc))
        self._cuda_engine = None  # destroys the ICudaEngine (no context refers to it any more)
        self._runtime = None
        self._logger = None
        if errors:
            raise CudaError("; ".join(errors))
