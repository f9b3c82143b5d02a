"""Opening one model: the backend factory, loading and warming up its contexts, and measuring its memory.

Blocking code, called from a worker thread by :mod:`batcher.repository`. The factory lives on the batcher side
because it reads the batcher's config; ``engines/`` never imports ``batcher/``.
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import Engine, EngineError, ExecutionContext
from engines.datatypes import NUMPY_DTYPES
from engines.memory import rss_bytes
from engines.zoo import ZooError, resolve

from .batch_sizes import allowed_batch_sizes, padded_size
from .config import ModelConfig
from .errors import ConfigError, InvalidInput
from .json_tensors import json_tensor
from .signature import DEFAULT_MAX_BATCH_SIZE, ModelSignature

#: dynamic dims of warm-up inputs where the config gives no ``warmup_dims``.
WARMUP_DIM = 32

MiB = 1 << 20


@dataclass
class Loaded:
    """A loaded model: its engine, one context per instance (in ``cfg.placements`` order) and what loading cost.

    Attributes:
        load_seconds: wall time of :func:`load_model`.
        measured_bytes: memory growth measured across the load (resident memory on CPU, device memory on CUDA).
    """

    engine: Engine
    contexts: list[ExecutionContext]
    signature: ModelSignature
    load_seconds: float
    measured_bytes: int = 0

    @property
    def footprint_bytes(self) -> int:
        """The seed's formula from the backend's report: engine bytes + context bytes x instances."""
        return self.engine.nbytes + sum(c.nbytes for c in self.contexts)

    @property
    def device_bytes(self) -> int:
        """Device memory of the engine and its contexts (``device_nbytes``: weights, sessions, CUDA graphs and
        workspaces), bytes; 0 on CPU."""
        return self.engine.device_nbytes + sum(c.device_nbytes for c in self.contexts)

    def release(self) -> None:
        """Release the contexts, then the engine (idempotent)."""
        _release(self.engine, self.contexts)


#: the default warm-up value of a BYTES element: text that most string-parsing models accept (a ``Cast`` from
#: string to a number, a tokenizer), unlike the empty string.
WARMUP_TEXT = b"0"


def warmup_inputs(signature: ModelSignature, cfg: ModelConfig, rows: int = 1) -> dict[str, np.ndarray]:
    """Warm-up inputs of ``rows`` rows: the config's ``inputs[].warmup_data`` repeated to fill each input, else
    zeros (BYTES: :data:`WARMUP_TEXT`); dynamic dims take ``warmup_dims`` from the config, else :data:`WARMUP_DIM`.
    A model without a batch dimension gets one input of its full shape (``rows`` ignored).

    Raises:
        ConfigError: ``warmup_data`` holds a value the input's datatype does not take (the codec's rules).
    """
    declared = {i.name: (j, i) for j, i in enumerate(cfg.inputs)}
    skip = 1 if signature.batched else 0
    out = {}
    for spec in signature.inputs:
        j, decl = declared.get(spec.name, (None, None))
        wd = decl.warmup_dims if decl else None
        dims = [d if d != -1 else (wd[k] if wd and k < len(wd) else WARMUP_DIM)
                for k, d in enumerate(spec.shape[skip:])]
        shape = (rows, *dims) if skip else tuple(dims)
        dtype = NUMPY_DTYPES[spec.datatype]
        if decl is not None and decl.warmup_data is not None:
            try:
                sample = json_tensor(decl.warmup_data, spec.datatype, len(decl.warmup_data),
                                     f"model {cfg.name!r}: inputs[{j}].warmup_data")
            except InvalidInput as exc:
                raise ConfigError(exc.message) from None
            out[spec.name] = np.resize(sample, shape)
        elif spec.datatype == "BYTES":
            out[spec.name] = np.full(shape, WARMUP_TEXT, dtype=object)
        else:
            out[spec.name] = np.zeros(shape, dtype=dtype)
    return out


def warmup_batch_sizes(cfg: ModelConfig, signature: ModelSignature) -> list[int]:
    """The batch sizes each context runs once at load.

    With allowed batch sizes in effect: every allowed size, or the config's ``warmup_batch_sizes`` each padded up
    to an allowed size (a context may only run those). Without: the config's ``warmup_batch_sizes`` (capped at
    ``max_batch_size``), else 1..max on CUDA and [1] on CPU. [1] (one run) for a model without a batch dimension
    (``max_batch_size`` 0).
    """
    top, allowed = signature.max_batch_size, signature.allowed_batch_sizes
    if top == 0:
        return [1]
    if cfg.warmup_batch_sizes is not None:
        return sorted({padded_size(min(b, top), allowed) for b in cfg.warmup_batch_sizes})
    if allowed is not None:
        return list(allowed)
    if cfg.device == "cuda":
        return list(range(1, top + 1))
    return [1]


def planned_batch_sizes(cfg: ModelConfig) -> tuple[int, ...] | None:
    """The allowed batch sizes as far as the config tells them before the engine is open (the engine prepares
    its contexts for them): its max_batch_size, else ONNX Runtime's default or a TensorRT build's profile
    maximum. None where the maximum comes from a plan file; the contexts then take any size."""
    top = cfg.max_batch_size
    if top is None and cfg.backend == "onnxruntime":
        top = DEFAULT_MAX_BATCH_SIZE
    if top is None and cfg.build is not None:
        top = min(shapes.max[0] for profile in cfg.build.profiles for shapes in profile.values())
    try:
        return allowed_batch_sizes(cfg, top) if top is not None else None
    except ValueError:
        return None  # ModelSignature.build reports it with the model's place in the config


def engine_options(cfg: ModelConfig, batch_sizes: tuple[int, ...] | None) -> dict[str, Any]:
    """Keyword arguments of the onnxruntime engine (``OnnxRuntimeEngine``, ``MultiprocEngine``) for ``cfg``; the
    GPU options only on KIND_GPU, and only those with a value (``gpu_memory_limit_mb`` becomes bytes, ONNX
    Runtime's ``gpu_mem_limit`` unit)."""
    options: dict[str, Any] = {"device": cfg.device, "intra_op_threads": cfg.intra_op_threads}
    if cfg.device != "cuda":
        return options
    mem_limit = int(cfg.gpu_memory_limit_mb * MiB) if cfg.gpu_memory_limit_mb is not None else None
    gpu = {"precision": cfg.effective_precision, "batch_sizes": batch_sizes, "gpu_mem_limit": mem_limit,
           "arena_extend_strategy": cfg.arena_extend_strategy, "gpu_execution": cfg.gpu_execution}
    return options | {k: v for k, v in gpu.items() if v is not None}


def load_model(cfg: ModelConfig, where: str, on_restart: Callable[[], None] | None = None,
               instances: int | None = None) -> Loaded:
    """Load one model: resolve its path, open the engine, create one context per instance, warm each up.

    Blocking; call it from a worker thread.

    Args:
        where: the model's place in the config (``models[2]``), for messages.
        on_restart: called when a worker process of the model (``mode: multiproc``) is replaced after a crash.
        instances: how many contexts to create (default ``cfg.instances``; an engine process of multi-process mode
            creates those placed on its GPU, :func:`batcher.topology.contexts_on`).

    Raises:
        ConfigError: bad path, engine limits contradicted by the config, or the model failing to load or to run
            its warm-up batches (the message names ``where``).
    """
    t0 = time.perf_counter()
    before = memory_now(cfg)
    try:
        path = resolve(cfg.path)
    except ZooError as exc:
        raise ConfigError(f"{where}.path: {exc}") from None
    if not path.is_file():
        raise ConfigError(f"{where}.path: {str(path)!r} is not a file")
    contexts: list[ExecutionContext] = []
    engine: Engine | None = None
    try:
        engine = open_engine(cfg, path, on_restart, planned_batch_sizes(cfg))
        signature = ModelSignature.build(engine, cfg, where)
        sizes = warmup_batch_sizes(cfg, signature)
        for _ in range(cfg.instances if instances is None else instances):
            ctx = engine.create_context()
            contexts.append(ctx)
            if ctx.batch_sizes not in (None, signature.allowed_batch_sizes):
                raise ConfigError(f"{where}: the engine prepared batch sizes {list(ctx.batch_sizes)}, the model "
                                  f"allows {signature.allowed_batch_sizes}")
            for rows in sizes:
                ctx.execute(warmup_inputs(signature, cfg, rows))
    except EngineError as exc:
        _release(engine, contexts)
        raise ConfigError(f"{where}: model {cfg.name!r} failed to load: {exc}") from None
    except BaseException:
        _release(engine, contexts)
        raise
    return Loaded(engine, contexts, signature, time.perf_counter() - t0, max(0, memory_now(cfg) - before))


def memory_now(cfg: ModelConfig) -> int:
    """Resident memory (CPU) or used device memory (CUDA) of this process now, bytes."""
    if cfg.device == "cuda":
        try:
            from engines.cuda import mem_get_info

            free, total = mem_get_info()
            return total - free
        except EngineError:
            return 0
    return rss_bytes()


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``), so unloads show in resident memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def open_engine(cfg: ModelConfig, path: Path, on_restart: Callable[[], None] | None = None,
                batch_sizes: tuple[int, ...] | None = None) -> Engine:
    """Open ``path`` with the config's backend; an .onnx file for ``tensorrt`` is built into a cached plan first.

    Args:
        batch_sizes: the allowed batch sizes its contexts prepare executables for (:func:`planned_batch_sizes`).

    Raises:
        EngineError: the backend is not installed, the file cannot be loaded, or the build fails.
    """
    if cfg.backend == "onnxruntime":
        options = engine_options(cfg, batch_sizes)
        if cfg.mode == "multiproc":
            from engines.multiproc import MultiprocEngine

            return MultiprocEngine(path, on_restart=on_restart, label=cfg.name, **options)
        from engines.onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(path, **options)
    from engines.tensorrt import TensorRTEngine

    if path.suffix == ".onnx":
        path = _build_plan(cfg, path)
    if batch_sizes is None:
        return TensorRTEngine(path, runtime=cfg.runtime)
    return TensorRTEngine(path, runtime=cfg.runtime, batch_sizes=batch_sizes)


def _build_plan(cfg: ModelConfig, path: Path) -> Path:
    from engines.trt_build import BuildOptions, cached_build
    from engines.zoo import cache_dir

    if cfg.build is None:
        raise EngineError("an .onnx path with backend tensorrt needs a build block (profiles, precision)")
    b = cfg.build
    options = BuildOptions(
        profiles=[{name: (tuple(p.min), tuple(p.opt), tuple(p.max)) for name, p in prof.items()}
                  for prof in b.profiles],
        precision=b.precision,
        workspace_mb=b.workspace_mb,
        version_compatible=b.version_compatible,
        hardware_compatibility=b.hardware_compatibility,
        calibration_dir=Path(b.calibration_dir) if b.calibration_dir else None,
    )
    return cached_build(path, options, cache_dir() / "plans")


def _release(engine: Engine | None, contexts: list[ExecutionContext]) -> None:
    for ctx in contexts:
        ctx.release()
    if engine is not None:
        engine.release()
