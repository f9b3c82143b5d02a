"""Models by name and version: loading strategies, memory budget, versions, routing and the repository state.

* ``eager``: every served version is loaded and warmed before the server reports ready.
* ``lazy``: a model is loaded by the first request that needs it (concurrent requests share that load).
* ``lru``: lazy, and before a load the least recently used idle models are unloaded until the newcomer fits
  ``memory_budget_mb``. A model with queued or executing requests is pinned and never evicted.

The footprint counted against the budget is the seed article's formula, engine bytes + context bytes x
instances, as the backend reports it (TensorRT: its device-memory sizes; ONNX Runtime: memory growth measured
while the model was first loaded - resident memory on CPU, device memory on CUDA). Before a model's first load
only an estimate exists: ``(1 + 2 x instances) x`` its file size plus 32 MiB (above what was measured for the
zoo models on CPU: weights once per session plus activations and allocator slack), or the config's ``memory_mb``.
After each load the measured figure replaces it and the budget is enforced again.

Loads and unloads run in worker threads, one at a time, so the event loop keeps serving and the memory
measurements do not blur into each other.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from engines.base import Engine, EngineError, ExecutionContext
from engines.datatypes import NUMPY_DTYPES
from engines.memory import rss_bytes
from engines.onnxruntime import OnnxRuntimeEngine
from engines.zoo import ZooError, cache_dir, resolve

from .config import Config, ModelConfig
from .errors import BatcherError, ConfigError, DeadlineExceeded, ModelNotFound, Unavailable
from .metrics import Metrics
from .retention import ThroughputTracker
from .scheduler import ModelRunner, warmup_inputs
from .signature import ModelSignature

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    engine: Engine
    contexts: list[ExecutionContext]
    signature: ModelSignature
    load_seconds: float
    #: memory growth measured across the load (resident memory on CPU, device memory on CUDA), bytes.
    measured_bytes: int = 0

    @property
    def footprint_bytes(self) -> int:
        """The seed's formula from the backend's report: engine bytes + context bytes x instances."""
        return self.engine.nbytes + sum(c.nbytes for c in self.contexts)

    def release(self) -> None:
        _release(self.engine, self.contexts)


def load_model(cfg: ModelConfig, where: str, on_restart: Callable[[], None] | None = None) -> Loaded:
    """Load one model: resolve its path, open the engine, create ``instances`` contexts, warm each up once.

    Blocking; call it from a worker thread.

    Raises:
        ConfigError: bad path, engine limits contradicted by the config, or the model failing to load or to run
            its warm-up batch (the message names ``where``, e.g. ``models[2]``).
    """
    t0 = time.perf_counter()
    before = _memory_now(cfg)
    try:
        path = resolve(cfg.path)
    except ZooError as exc:
        raise ConfigError(f"{where}.path: {exc}") from None
    if not path.is_file():
        raise ConfigError(f"{where}.path: {str(path)!r} is not a file")
    contexts: list[ExecutionContext] = []
    engine: Engine | None = None
    try:
        engine = open_engine(cfg, path, on_restart)
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
    return Loaded(engine, contexts, signature, time.perf_counter() - t0, max(0, _memory_now(cfg) - before))


def _memory_now(cfg: ModelConfig) -> int:
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


def open_engine(cfg: ModelConfig, path: Path, on_restart: Callable[[], None] | None = None) -> Engine:
    """Open ``path`` with the config's backend; an .onnx file for ``tensorrt`` is built into a cached plan first.

    Raises:
        EngineError: the backend is not installed, the file cannot be loaded, or the build fails.
    """
    if cfg.backend == "onnxruntime" and cfg.mode == "multiproc":
        from engines.multiproc import MultiprocEngine

        return MultiprocEngine(path, on_restart=on_restart, device=cfg.device, intra_op_threads=cfg.intra_op_threads)
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


MiB = 1 << 20

#: Triton's model states (repository extension).
READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"


class ModelSlot:
    """One configured model version: its state, its runner while loaded, and its memory figures."""

    def __init__(self, cfg: ModelConfig, where: str, selected: bool) -> None:
        self.cfg = cfg
        self.where = where
        self.name = cfg.name
        self.version = str(cfg.version)
        self.selected = selected  # chosen by the name's version policy
        self.state = UNAVAILABLE
        self.reason = "not loaded" if selected else "not selected by the version policy"
        self.runner: ModelRunner | None = None
        self.signature: ModelSignature | None = None
        self.loaded: Loaded | None = None
        self.inflight = 0  # requests between acquire and release: a pinned model is never evicted
        self.waiting = 0  # requests waiting for this model's load: it is pinned for them too
        self.last_used = 0.0
        self.task: asyncio.Task | None = None  # the load or unload in progress
        self.measured_bytes: int | None = None  # growth measured at the first load (at least the weights)
        self.footprint_bytes: int | None = None  # engine + contexts as the backend reports them
        self.sticky_unloaded = False  # unloaded through the repository API: only an explicit load brings it back
        self.success_before = 0  # successful requests answered by earlier loads of this slot

    @property
    def success_total(self) -> int:
        """Successful requests over the slot's lifetime (all its loads)."""
        return self.success_before + (self.runner.stats.success.count if self.runner is not None else 0)

    @property
    def budget_bytes(self) -> int:
        """What this model counts against the memory budget: measured at load, else the pre-load estimate."""
        if self.measured_bytes is not None:
            return self.measured_bytes
        if self.cfg.memory_mb is not None:
            return int(self.cfg.memory_mb * MiB)
        try:
            size = resolve(self.cfg.path).stat().st_size
        except (ZooError, OSError):
            size = 0
        return (1 + 2 * self.cfg.instances) * size + 32 * MiB


def _selected_versions(cfgs: list[ModelConfig]) -> set[int]:
    policy = max(cfgs, key=lambda c: c.version).version_policy
    versions = sorted(c.version for c in cfgs)
    if policy == "all":
        return set(versions)
    if hasattr(policy, "latest"):
        return set(versions[-policy.latest :])
    return set(policy.specific) & set(versions)


class Registry:
    """Every configured model version (:class:`ModelSlot`), the load strategy and the memory budget."""

    def __init__(self, config: Config, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.strategy = config.server.load_strategy
        self.budget_bytes = (
            int(config.server.memory_budget_mb * MiB) if config.server.memory_budget_mb is not None else None
        )
        by_name: dict[str, list[ModelConfig]] = collections.defaultdict(list)
        for cfg in config.models:
            by_name[cfg.name].append(cfg)
        self.slots: dict[str, dict[str, ModelSlot]] = {}
        for i, cfg in enumerate(config.models):
            selected = cfg.version in _selected_versions(by_name[cfg.name])
            self.slots.setdefault(cfg.name, {})[str(cfg.version)] = ModelSlot(cfg, f"models[{i}]", selected)
        self.ready = False
        self._monitor: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._t0 = time.monotonic()
        #: load/evict/unload events, newest last (GET /v2/repository/events).
        self.events: collections.deque[dict] = collections.deque(maxlen=1000)
        if self.budget_bytes is not None:
            metrics.memory_budget.set(self.budget_bytes)
        for slot in self._all():
            metrics.model_loaded.labels(slot.name, slot.version).set(0)

    def _all(self) -> list[ModelSlot]:
        return [s for versions in self.slots.values() for s in versions.values()]

    @property
    def used_bytes(self) -> int:
        """Memory counted against the budget by the loaded models (READY, or UNLOADING until freed); a model being
        loaded has its room reserved by :meth:`_make_room` and counts once READY."""
        return sum(s.budget_bytes for s in self._all() if s.state in (READY, UNLOADING))

    @property
    def loaded_count(self) -> int:
        return sum(1 for s in self._all() if s.state in (READY, UNLOADING))

    def _used_by_others(self, slot: ModelSlot) -> int:
        return sum(s.budget_bytes for s in self._all() if s.state in (READY, UNLOADING) and s is not slot)

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Eager: load every selected version, then report ready. Lazy/lru: ready at once.

        Raises:
            ConfigError: an eager model failed to load (models loaded before it are released).
        """
        if self.strategy == "eager":
            try:
                for slot in self._all():
                    if slot.selected:
                        await self.load(slot)
            except BaseException:
                await self.close()
                raise
        self._monitor = asyncio.create_task(self._watch_throughput(), name="throughput-monitor")
        self.ready = True

    async def _watch_throughput(self, tick_s: float = 1.0) -> None:
        """Every ``tick_s``: per-model throughput and the live retention ratio (:mod:`batcher.retention`)."""
        tracker = ThroughputTracker()
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(tick_s)
            rps, ratio = tracker.tick(loop.time(), {(s.name, s.version): s.success_total for s in self._all()})
            for (name, version), r in rps.items():
                self.metrics.throughput.labels(name, version).set(r)
            self.metrics.retention.set(float("nan") if ratio is None else ratio)

    async def drain(self, grace_s: float) -> None:
        """Stop taking requests (readiness false, new requests 503) and wait until every accepted request has been
        answered, at most ``grace_s`` seconds."""
        self.ready = False
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        while loop.time() < end and any(s.inflight or s.waiting for s in self._all()):
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        """Stop every model: queued requests get 503, running batches finish, memory is released."""
        self.ready = False
        if self._monitor is not None:
            self._monitor.cancel()
            try:
                await self._monitor
            except asyncio.CancelledError:
                pass
            self._monitor = None
        runners = [s.runner for s in self._all() if s.runner is not None]
        for s in self._all():
            s.runner, s.state = None, UNAVAILABLE
        await asyncio.gather(*(r.close() for r in runners))

    # ---------------------------------------------------------------- lookup and routing
    def slot(self, name: str, version: str | None = None) -> ModelSlot:
        """The slot a request for ``name``/``version`` goes to (routing.version_mismatch applies).

        Raises:
            ModelNotFound: unknown model (404), or a version that is not served under ``version_mismatch: reject``.
        """
        versions = self.slots.get(name)
        if not versions:
            raise ModelNotFound(f"unknown model '{name}'; models: {sorted(self.slots)}")
        served = sorted((v for v, s in versions.items() if s.selected), key=int)
        if version is not None:
            s = versions.get(version)
            if s is not None and s.selected:
                return s
            if self.config.routing.version_mismatch == "reject" or not served:
                raise ModelNotFound(f"model '{name}' has no version '{version}'; versions: {served}")
        if not served:
            raise ModelNotFound(f"model '{name}' has no served version (version policy)")
        return versions[served[-1]]

    async def acquire(self, name: str, version: str | None = None, deadline: float | None = None,
                      *, allow_fallback: bool = True) -> ModelSlot:
        """Route a request and pin the model it will run on; pair every call with :meth:`release`.

        Loads the model if needed (lazy/lru; ``on_cold`` decides whether to wait for it within ``deadline``, a
        monotonic time), and goes to the config's ``fallback`` model when this one is unavailable or its queue
        is at ``fallback_queue_depth``.

        Raises:
            ModelNotFound (404); Unavailable (503 + Retry-After: loading under ``on_cold: reject``, no room in the
            memory budget, unloaded, load failed); DeadlineExceeded (504: the load outlasted the deadline).
        """
        slot = self.slot(name, version)
        cfg = slot.cfg
        if allow_fallback and cfg.fallback is not None:
            depth = slot.runner.queue_depth if slot.runner is not None else 0
            if cfg.fallback_queue_depth is not None and depth >= cfg.fallback_queue_depth:
                log.debug("model %s: queue depth %d, routing to fallback %s", name, depth, cfg.fallback)
                return await self.acquire(cfg.fallback, None, deadline, allow_fallback=False)
            try:
                return await self._ready(slot, deadline)
            except Unavailable as exc:
                log.debug("model %s unavailable (%s), routing to fallback %s", name, exc.message, cfg.fallback)
                return await self.acquire(cfg.fallback, None, deadline, allow_fallback=False)
        return await self._ready(slot, deadline)

    async def _ready(self, slot: ModelSlot, deadline: float | None) -> ModelSlot:
        loop = asyncio.get_running_loop()
        while True:
            if slot.state == READY:
                slot.inflight += 1
                slot.last_used = loop.time()
                return slot
            if not self.ready:
                raise Unavailable("server is not ready")
            if slot.state == UNLOADING and slot.task is not None:
                await asyncio.shield(slot.task)
                continue
            if slot.state == UNAVAILABLE:
                if self.strategy == "eager" or slot.sticky_unloaded:
                    raise Unavailable(f"model '{slot.name}' version {slot.version} is not loaded: {slot.reason}",
                                      retry_after_s=5)
                self._start_load(slot)
            task = slot.task
            if task is None:  # finished between the checks
                continue
            if self.config.server.on_cold == "reject":
                raise Unavailable(f"model '{slot.name}' is loading; try again shortly", retry_after_s=1)
            timeout = None if deadline is None else deadline - loop.time()
            slot.waiting += 1
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except asyncio.TimeoutError:
                raise DeadlineExceeded(f"model '{slot.name}': deadline expired while the model was loading") from None
            except ConfigError as exc:
                raise Unavailable(f"model '{slot.name}' failed to load: {exc}", retry_after_s=5) from None
            finally:
                slot.waiting -= 1
            if slot.state != READY:
                raise Unavailable(f"model '{slot.name}' version {slot.version} is not available: {slot.reason}",
                                  retry_after_s=5)

    def release(self, slot: ModelSlot) -> None:
        """Unpin a model acquired with :meth:`acquire`."""
        slot.inflight -= 1
        slot.last_used = asyncio.get_running_loop().time()

    # ---------------------------------------------------------------- load / unload
    def _start_load(self, slot: ModelSlot) -> None:
        slot.state, slot.reason = LOADING, "loading"
        slot.task = asyncio.create_task(self._load(slot), name=f"load-{slot.name}-{slot.version}")
        slot.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # consumed; callers read state

    async def load(self, slot: ModelSlot) -> None:
        """Load ``slot`` now (repository API, eager start); returns when it is READY.

        Raises:
            ConfigError: the model failed to load. Unavailable: it cannot fit the memory budget.
        """
        slot.sticky_unloaded = False
        while slot.state == UNLOADING and slot.task is not None:
            await asyncio.shield(slot.task)
        if slot.state == READY:
            return
        if slot.state == UNAVAILABLE:
            self._start_load(slot)
        if slot.task is not None:
            await asyncio.shield(slot.task)

    async def _load(self, slot: ModelSlot) -> None:
        try:
            async with self._lock:
                if self.budget_bytes is not None:
                    await self._make_room(slot, slot.budget_bytes)
                rss0 = rss_bytes()
                restarts = self.metrics.worker_restart.labels(slot.name, slot.version)
                loaded = await asyncio.to_thread(load_model, slot.cfg, slot.where, restarts.inc)
                if slot.measured_bytes is None:  # the first load's figure: later ones see recycled heap
                    slot.measured_bytes = max(loaded.measured_bytes, loaded.engine.nbytes * slot.cfg.instances)
                slot.footprint_bytes = loaded.footprint_bytes
                slot.loaded = loaded
                slot.signature = loaded.signature
                slot.runner = ModelRunner(slot.cfg, loaded.engine, loaded.contexts, loaded.signature,
                                          self.metrics.for_model(slot.name, slot.version))
                _warm_codec(slot.runner)
                slot.state, slot.reason = READY, ""
                slot.last_used = asyncio.get_running_loop().time()
                self._event("load", slot, loaded.load_seconds, rss0)
                if self.budget_bytes is not None and self.used_bytes > self.budget_bytes:
                    # measured above its estimate: make room afterwards, or give the model back
                    try:
                        await self._make_room(slot, slot.budget_bytes)
                    except Unavailable:
                        await self._unload(slot, "over the memory budget after loading")
                        slot.state, slot.reason = UNAVAILABLE, (
                            f"needs {slot.budget_bytes / MiB:.0f} MB as measured at load; the memory budget "
                            f"{self.budget_bytes / MiB:.0f} MB cannot hold it beside the models in use")
                        raise Unavailable(f"model '{slot.name}': {slot.reason}", retry_after_s=5) from None
        except ConfigError as exc:
            slot.state, slot.reason = UNAVAILABLE, f"load failed: {exc}"
            log.error("%s", exc)
            raise
        except Unavailable as exc:
            if slot.state == LOADING:
                slot.state, slot.reason = UNAVAILABLE, exc.message
            raise
        except BaseException:
            if slot.state == LOADING:
                slot.state, slot.reason = UNAVAILABLE, "load interrupted"
            raise
        finally:
            slot.task = None
            self._update_memory_metrics()

    async def _make_room(self, newcomer: ModelSlot, need: int) -> None:
        """Evict least recently used idle models until ``need`` more bytes fit the budget (caller holds the lock).

        Raises:
            Unavailable: what is left loaded is pinned (requests in flight) or the newcomer alone exceeds the budget.
        """
        budget = self.budget_bytes
        if budget is None:
            return
        if need > budget:
            raise Unavailable(
                f"model '{newcomer.name}' needs {need / MiB:.0f} MB, more than the whole memory budget "
                f"({budget / MiB:.0f} MB)", retry_after_s=30)
        while self._used_by_others(newcomer) + need > budget:
            idle = [s for s in self._all() if s.state == READY and s.inflight == 0 and s.waiting == 0
                    and s is not newcomer and (s.runner is None or s.runner.queue_depth == 0)]
            if not idle:
                pinned = [f"{s.name} ({s.budget_bytes / MiB:.0f} MB)" for s in self._all()
                          if s.state != UNAVAILABLE and s is not newcomer]
                raise Unavailable(
                    f"memory budget {budget / MiB:.0f} MB: model '{newcomer.name}' needs {need / MiB:.0f} MB, "
                    f"{self._used_by_others(newcomer) / MiB:.0f} MB are held by models with requests in flight: "
                    f"{pinned}",
                    retry_after_s=1)
            victim = min(idle, key=lambda s: s.last_used)
            await self._unload(victim, f"evicted (lru) to make room for {newcomer.name}", kind="evict")

    async def unload(self, slot: ModelSlot) -> None:
        """Unload through the repository API: new requests get 503, requests in flight finish first; the model
        stays unloaded until loaded again explicitly."""
        slot.sticky_unloaded = True
        if slot.state == LOADING and slot.task is not None:
            try:
                await asyncio.shield(slot.task)
            except (BatcherError, ConfigError):
                return
        if slot.state != READY:
            return
        async with self._lock:
            if slot.state == READY:
                await self._unload(slot, "unloaded by request", kind="unload")
        self._update_memory_metrics()

    async def _unload(self, slot: ModelSlot, reason: str, kind: str = "unload") -> None:
        runner = slot.runner
        slot.state, slot.reason = UNLOADING, reason
        done = asyncio.get_running_loop().create_future()
        slot.task = asyncio.ensure_future(done)
        try:
            while slot.inflight > 0:  # requests already routed here finish first
                await asyncio.sleep(0.005)
            rss0 = rss_bytes()
            t0 = time.perf_counter()
            slot.success_before = slot.success_total
            slot.runner = None
            if runner is not None:
                await runner.close()
            slot.loaded = None
            await asyncio.to_thread(trim_heap)
            slot.state, slot.reason = UNAVAILABLE, reason
            self._event(kind, slot, time.perf_counter() - t0, rss0)
        finally:
            done.set_result(None)
            slot.task = None
            self._update_memory_metrics()

    # ---------------------------------------------------------------- observability
    def _event(self, kind: str, slot: ModelSlot, seconds: float, rss_before: int) -> None:
        m = self.metrics
        ev = {
            "time_s": round(time.monotonic() - self._t0, 4),
            "event": kind,
            "model": slot.name,
            "version": slot.version,
            "duration_ms": round(seconds * 1e3, 2),
            "rss_before_bytes": rss_before,
            "rss_after_bytes": rss_bytes(),
            "model_bytes": slot.budget_bytes,
            "used_bytes_after": self.used_bytes,
        }
        self.events.append(ev)
        if kind == "load":
            m.model_load.labels(slot.name, slot.version).inc()
            m.model_load_duration.labels(slot.name, slot.version).observe(seconds)
        else:
            m.model_unload.labels(slot.name, slot.version, kind).inc()
        log.info(
            "%s model %s version %s in %.1f ms: resident %.0f -> %.0f MB; model counts %.0f MB, all loaded models "
            "%.0f MB (%s)",
            kind, slot.name, slot.version, seconds * 1e3, ev["rss_before_bytes"] / MiB, ev["rss_after_bytes"] / MiB,
            slot.budget_bytes / MiB, ev["used_bytes_after"] / MiB, slot.reason or "ready",
        )

    def _update_memory_metrics(self) -> None:
        m = self.metrics
        for s in self._all():
            loaded = s.state in (READY, UNLOADING)
            m.model_loaded.labels(s.name, s.version).set(1 if s.state == READY else 0)
            m.model_memory.labels(s.name, s.version, "budgeted").set(s.budget_bytes if loaded else 0)
            m.model_memory.labels(s.name, s.version, "footprint").set((s.footprint_bytes or 0) if loaded else 0)
            m.model_memory.labels(s.name, s.version, "measured").set((s.measured_bytes or 0) if loaded else 0)
        m.memory_used.set(self.used_bytes)

    def index(self) -> list[dict]:
        """The repository index (Triton's form): every configured version with its state and reason."""
        out = []
        for s in self._all():
            entry = {"name": s.name, "version": s.version, "state": s.state, "reason": s.reason}
            pids = [getattr(c, "pid", None) for c in (s.loaded.contexts if s.loaded else ())]
            if any(pids):
                entry["worker_pids"] = pids
            if s.measured_bytes is not None:
                entry["measured_bytes"] = s.measured_bytes
                entry["footprint_bytes"] = s.footprint_bytes
            out.append(entry)
        return out


def _warm_codec(runner: ModelRunner) -> None:
    """Run the HTTP path's decode and encode once on a sample of this model (no execution, no metrics), so the
    first real request does not pay for first-call costs in the codec."""
    from .codec import decode_request, encode_response

    sample = warmup_inputs(runner.signature, runner.cfg)
    body = orjson.dumps({"inputs": [
        {"name": n, "datatype": s.datatype, "shape": list(sample[n].shape), "data": sample[n].ravel().tolist()}
        for n, s in zip(sample, runner.signature.inputs) if s.datatype != "BYTES"
    ]})
    req = decode_request(body)
    outs = {o.name: np.zeros((1,), dtype=NUMPY_DTYPES[o.datatype]) for o in runner.signature.outputs
            if o.datatype != "BYTES"}
    encode_response(runner.name, runner.version, outs, req)
