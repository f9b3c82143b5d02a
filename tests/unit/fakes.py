"""Stand-ins for the unit tier: an engine and contexts that compute ``y = 2 * x`` row by row, an executor that runs
a batch on the event loop and lets it "take" virtual time, and a loader that needs no model file.

With ``@pytest.mark.looptime`` the event loop's clock is virtual (the ``looptime`` plugin): ``asyncio.sleep``,
timers and ``wait_for`` timeouts advance it exactly, so tests assert exact times with no wall-clock windows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np

from batcher.config import ModelConfig, parse_config
from batcher.batch_steps import BatchResult
from batcher.loader import Loaded
from batcher.signature import ModelSignature
from engines.base import DeviceTimes, Engine, EngineError, ExecutionContext, TensorSpec

MiB = 1 << 20


class FakeContext(ExecutionContext):
    """``y = 2 * x`` over input ``x`` (FP32 ``[N, 4]``); records every batch's row count and its input; ``fail``
    makes the next execute raise ``fail``.

    Like a GPU context (``engines/base.py``): ``batch_sizes`` set, it refuses any other first dimension (EngineError)
    and stages inputs in one reused host buffer (:meth:`host_buffer`, left dirty between batches);
    ``description`` is what :meth:`describe` says, ``device_nbytes`` its device memory; ``device_times``, when set,
    is what :meth:`device_times` reports after each batch (a GPU context's timing events)."""

    def __init__(self, nbytes: int = 0, batch_sizes: tuple[int, ...] | None = None,
                 description: dict | None = None, device_nbytes: int = 0) -> None:
        self.batches: list[int] = []
        self.inputs: list[np.ndarray] = []
        self.fail: Exception | None = None
        self.released = False
        self.timed: DeviceTimes | None = None
        self._nbytes = nbytes
        self._batch_sizes = batch_sizes
        self._description = description or {}
        self._device_nbytes = device_nbytes
        # two staging buffers, like a GPU context (staging_slots 2); left dirty (NaN) between batches
        self._staging = [np.full((max(batch_sizes), 4), np.nan, np.float32) for _ in range(2)] if batch_sizes else None
        self.staging_slots = 2 if batch_sizes else 1

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        x = inputs["x"]
        if self._batch_sizes is not None and x.shape[0] not in self._batch_sizes:
            raise EngineError(f"batch of {x.shape[0]} rows; prepared sizes {self._batch_sizes}")
        self.batches.append(x.shape[0])
        self.inputs.append(x.copy())
        return {"y": x * 2}

    def device_times(self) -> DeviceTimes | None:
        return self.timed

    def host_buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype, slot: int = 0) -> np.ndarray | None:
        return None if self._staging is None else self._staging[slot][: shape[0]]

    @property
    def batch_sizes(self) -> tuple[int, ...] | None:
        return self._batch_sizes

    def describe(self) -> dict:
        return dict(self._description)

    @property
    def device_nbytes(self) -> int:
        return self._device_nbytes

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def release(self) -> None:
        self.released = True


class FakeEngine(Engine):
    backend = "fake"

    def __init__(self, nbytes: int = 0, engine_device_nbytes: int = 0, **context: Any) -> None:
        """``context``: keyword arguments of every :class:`FakeContext` it creates."""
        self._inputs = (TensorSpec("x", "FP32", (-1, 4)),)
        self._outputs = (TensorSpec("y", "FP32", (-1, 4)),)
        self._nbytes = nbytes
        self._device_nbytes = engine_device_nbytes
        self._context = context
        self.released = False

    @property
    def device_nbytes(self) -> int:
        return self._device_nbytes

    @property
    def max_batch_size(self) -> int | None:
        return None

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def create_context(self) -> FakeContext:
        return FakeContext(**self._context)

    def release(self) -> None:
        self.released = True


class SleepExecutor:
    """Runs a batch on the event loop at once (deadline checks, stacking, splitting: the real
    :func:`~batcher.batch_steps.execute_batch`), then holds its result for ``seconds_per_row`` x rows of loop time,
    as if the engine took that long; the batch's compute time is reported as that duration."""

    def __init__(self, context: ExecutionContext, name: str = "fake", seconds_per_row: float = 0.001) -> None:
        self.context = context
        self.seconds_per_row = seconds_per_row
        self.closed = False

    async def _run(self, fn, args) -> BatchResult:
        result: BatchResult = fn(self.context, *args)
        took = result.rows * self.seconds_per_row
        await asyncio.sleep(took)
        result.times = (0.0, took, 0.0)
        return result

    def submit(self, fn, *args: Any, key: Any = None):
        return asyncio.ensure_future(self._run(fn, args))

    def close(self) -> None:
        self.closed = True
        self.context.release()


class PipelineExecutor(SleepExecutor):
    """A two-stage executor (``depth`` 2, or 3 with a lookahead slot) on the event loop: staging (deadline checks,
    stacking) takes ``stage_s`` on one staging "thread", running takes ``seconds_per_row`` x rows on one
    "device"; a batch can be staged while another runs, as :class:`batcher.executor.ThreadExecutor` does for a
    GPU context."""

    def __init__(self, context: ExecutionContext, name: str = "fake", seconds_per_row: float = 0.001,
                 stage_s: float = 0.001, depth: int = 2) -> None:
        super().__init__(context, name, seconds_per_row)
        self.depth = depth
        self.stage_s = stage_s
        self.slots: list[int] = []  # the staging slot of each batch, in staging order
        self.staged_rows: list[int] = []  # and its rows
        self._stager: asyncio.Lock | None = None
        self._device: asyncio.Lock | None = None

    async def _stage(self, fn, args):
        self._stager = self._stager or asyncio.Lock()
        async with self._stager:
            staged = fn(self.context, *args)
            self.slots.append(staged.slot)
            self.staged_rows.append(staged.rows)
            await asyncio.sleep(self.stage_s)
            return staged

    async def _pipeline(self, args, slot):
        from batcher.batch_steps import run_batch, stage_batch

        staged = await self._stage(stage_batch, (*args, slot))
        return await self._run(run_batch, (staged, args[1], args[4]))

    def pipeline(self, args, slot: int, done=None):
        fut = asyncio.ensure_future(self._pipeline(args, slot))
        if done is not None:  # the real executor calls it in the callback that settles the future
            fut.add_done_callback(done)
        return fut

    async def _run(self, fn, args) -> BatchResult:
        self._device = self._device or asyncio.Lock()
        async with self._device:
            result = await super()._run(fn, args)
        result.times = (self.stage_s, result.times[1], 0.0)
        return result


def model_config(**kw: Any) -> ModelConfig:
    """A ModelConfig for model ``m`` (path unused by the fakes) with ``kw`` as its keys."""
    return parse_config({"models": [{"name": "m", "path": "unused.onnx", **kw}]}).models[0]


def signature(max_batch_size: int = 8) -> ModelSignature:
    spec_in, spec_out = TensorSpec("x", "FP32", (-1, 4)), TensorSpec("y", "FP32", (-1, 4))
    return ModelSignature((spec_in,), (spec_out,), max_batch_size)


def rows(n: int, value: float = 1.0) -> dict[str, np.ndarray]:
    return {"x": np.full((n, 4), value, np.float32)}


class FakeLoader:
    """``load_model`` without a model file: each model counts ``sizes_mb[name]`` MB; ``fail`` names models whose
    load raises ConfigError; ``loads`` records the names loaded, in order; ``context`` (keyword arguments of
    :class:`FakeContext`, and ``engine_device_nbytes``) makes the contexts GPU-like, each model's contexts prepared for
    its allowed sizes."""

    def __init__(self, sizes_mb: dict[str, float] | None = None, fail: set[str] = frozenset(),
                 **context: Any) -> None:
        self.sizes_mb = sizes_mb or {}
        self.fail = set(fail)
        self.loads: list[str] = []
        self.context = context

    def __call__(self, cfg: ModelConfig, where: str, on_restart=None) -> Loaded:
        from batcher.errors import ConfigError

        self.loads.append(cfg.name)
        if cfg.name in self.fail:
            raise ConfigError(f"{where}: model {cfg.name!r} failed to load: broken on purpose")
        nbytes = int(self.sizes_mb.get(cfg.name, 10) * MiB)
        sig = ModelSignature.build(FakeEngine(), cfg, where)
        engine = FakeEngine(**({"batch_sizes": sig.allowed_batch_sizes} | self.context if self.context else {}))
        contexts = [engine.create_context() for _ in range(cfg.instances)]
        return Loaded(engine, contexts, sig, load_seconds=0.0, measured_bytes=nbytes)


class BrokenEngineError(EngineError):
    pass
