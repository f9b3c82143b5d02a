"""Models by name and version: loading (engine, contexts, warm-up) and lookup.

Every configured model is loaded when the server starts (eager); loading runs in a worker thread so the event
loop stays responsive. Lazy and memory-budgeted loading come later on top of the same :class:`ModelRunner`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from engines.base import Engine, EngineError, ExecutionContext
from engines.onnxruntime import OnnxRuntimeEngine
from engines.zoo import ZooError, cache_dir, resolve

from .config import Config, ModelConfig
from .errors import ConfigError, ModelNotFound
from .metrics import Metrics
from .scheduler import ModelRunner, warmup_inputs
from .signature import ModelSignature

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    engine: Engine
    contexts: list[ExecutionContext]
    signature: ModelSignature
    load_seconds: float


def load_model(cfg: ModelConfig, where: str) -> Loaded:
    """Load one model: resolve its path, open the engine, create ``instances`` contexts, warm each up once.

    Blocking; call it from a worker thread.

    Raises:
        ConfigError: bad path, engine limits contradicted by the config, or the model failing to load or to run
            its warm-up batch (the message names ``where``, e.g. ``models[2]``).
    """
    t0 = time.perf_counter()
    try:
        path = resolve(cfg.path)
    except ZooError as exc:
        raise ConfigError(f"{where}.path: {exc}") from None
    if not path.is_file():
        raise ConfigError(f"{where}.path: {str(path)!r} is not a file")
    contexts: list[ExecutionContext] = []
    engine: Engine | None = None
    try:
        engine = open_engine(cfg, path)
        signature = ModelSignature.build(engine, cfg, where)
        sizes = warmup_batch_sizes(cfg, signature.max_batch_size)
        for _ in range(cfg.instances):
            ctx = engine.create_context()
            contexts.append(ctx)
            for rows in sizes:
                ctx.execute(warmup_inputs(signature, cfg, rows))
    except EngineError as exc:
        _release(engine, contexts)
        raise ConfigError(f"{where}: model {cfg.name!r} failed to load: {exc}") from None
    except BaseException:
        _release(engine, contexts)
        raise
    return Loaded(engine, contexts, signature, time.perf_counter() - t0)


def open_engine(cfg: ModelConfig, path: Path) -> Engine:
    """Open ``path`` with the config's backend; an .onnx file for ``tensorrt`` is built into a cached plan first.

    Raises:
        EngineError: the backend is not installed, the file cannot be loaded, or the build fails.
    """
    if cfg.backend == "onnxruntime":
        return OnnxRuntimeEngine(path, device=cfg.device, intra_op_threads=cfg.intra_op_threads)
    from engines.tensorrt import TensorRTEngine

    if path.suffix == ".onnx":
        from engines.trt_build import BuildOptions, cached_build

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
        path = cached_build(path, options, cache_dir() / "plans")
    return TensorRTEngine(path, runtime=cfg.runtime)


def warmup_batch_sizes(cfg: ModelConfig, max_batch_size: int) -> list[int]:
    """The config's ``warmup_batch_sizes`` (capped at ``max_batch_size``), else 1..max on CUDA and [1] on CPU."""
    if cfg.warmup_batch_sizes is not None:
        sizes = sorted({min(b, max_batch_size) for b in cfg.warmup_batch_sizes})
    elif cfg.device == "cuda":
        sizes = list(range(1, max_batch_size + 1))
    else:
        sizes = [1]
    return sizes


def _release(engine: Engine | None, contexts: list[ExecutionContext]) -> None:
    for ctx in contexts:
        ctx.release()
    if engine is not None:
        engine.release()


class Registry:
    """Served models, ``name -> version -> ModelRunner``."""

    def __init__(self, config: Config, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.models: dict[str, dict[str, ModelRunner]] = {}
        self.ready = False

    async def start(self) -> None:
        """Load every configured model (eager), in a worker thread each; the server is ready afterwards.

        Raises:
            ConfigError: a model failed to load (models loaded before it are released).
        """
        try:
            for i, cfg in enumerate(self.config.models):
                loaded = await asyncio.to_thread(load_model, cfg, f"models[{i}]")
                runner = ModelRunner(
                    cfg, loaded.engine, loaded.contexts, loaded.signature,
                    self.metrics.for_model(cfg.name, str(cfg.version)),
                )
                self.models.setdefault(cfg.name, {})[str(cfg.version)] = runner
                log.info(
                    "loaded model %s version %s in %.0f ms: %d context(s), max_batch_size %d",
                    cfg.name, cfg.version, loaded.load_seconds * 1e3, cfg.instances, loaded.signature.max_batch_size,
                )
        except BaseException:
            await self.close()
            raise
        self.ready = True

    async def close(self) -> None:
        """Stop every model: queued requests get 503, running batches finish, memory is released."""
        self.ready = False
        runners = [r for versions in self.models.values() for r in versions.values()]
        self.models = {}
        await asyncio.gather(*(r.close() for r in runners))

    def get(self, name: str, version: str | None = None) -> ModelRunner:
        """The runner of ``name`` at ``version`` (default: the highest loaded version).

        Raises:
            ModelNotFound: unknown model, or no such version (404).
        """
        versions = self.models.get(name)
        if not versions:
            raise ModelNotFound(f"unknown model '{name}'; models: {sorted(self.models)}")
        if version is None:
            return versions[max(versions, key=int)]
        runner = versions.get(version)
        if runner is None:
            raise ModelNotFound(f"model '{name}' has no version '{version}'; versions: {sorted(versions, key=int)}")
        return runner
