"""Loading and unloading the configured model versions (:mod:`batcher.slots`): load strategies and the memory budget.

* ``eager``: every served version is loaded and warmed at start.
* ``lazy``: a model is loaded by the first request that needs it (concurrent requests share that load).
* ``lru``: lazy, and before a load idle models are unloaded until the newcomer fits ``memory_budget_mb``
  (:mod:`batcher.lru` says which). A model with requests in flight, queued or waiting for its load is pinned.

What a model counts against the budget is the seed's formula, engine + contexts, as measured while it first
loaded (resident memory on CPU; on CUDA device memory, at least the ``device_nbytes`` of its engine and contexts,
CUDA graphs and workspaces included; at least its weights once per instance); before its first
load ``(1 + 2 x instances) x`` its file size plus 32 MiB, or the config's ``memory_mb``. After each load the
measured figure replaces the estimate and the budget is enforced again.

Loads and unloads run one at a time (a lock), the blocking part in a worker thread, so the event loop keeps
serving and memory measurements do not blur into each other. What serves a loaded model is attached by load
hooks (:attr:`ModelRepository.on_load`, after MLServer's ``on_model_load``): the data plane attaches its batcher
(:class:`~batcher.scheduler.ModelRunner`), the HTTP side warms its codec. The repository itself knows no wire
format.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engines.memory import rss_bytes

from .config import Config, ModelConfig
from .errors import BatcherError, ConfigError, Unavailable
from .events import LifecycleEvents
from .loader import Loaded, load_model, trim_heap
from .lru import Candidate, MemoryBudget, NoRoom, TooLarge
from .metrics import Metrics
from .slots import (LOADING, NOT_LOADED, NOT_LOADED_RETRY_S, READY, UNAVAILABLE, UNLOADING, MiB, ModelSlot,
                    ModelSlots)

log = logging.getLogger(__name__)


class ModelRepository(ModelSlots):
    """The load strategy and the memory budget over every configured model version."""

    def __init__(self, config: Config, metrics: Metrics,
                 loader: Callable[[ModelConfig, str, Callable[[], None]], Loaded] = load_model,
                 serves: Callable[[ModelConfig], bool] | None = None) -> None:
        """``loader`` loads one model (blocking, in a worker thread): :func:`batcher.loader.load_model`; tests
        pass a stand-in. ``serves``: see :class:`ModelSlots`."""
        super().__init__(config, serves)
        self._loader = loader
        self.strategy = config.server.load_strategy
        mb = config.server.memory_budget_mb
        self.budget = MemoryBudget(int(mb * MiB)) if mb is not None else None
        #: called on the event loop after a model loaded, before it turns READY (may raise to fail the load).
        self.on_load: list[Callable[[ModelSlot], None]] = []
        self.lifecycle = LifecycleEvents(metrics)
        self._restarts = metrics.worker_restart
        self._lock = asyncio.Lock()  # one load or unload at a time
        # every load in one thread: glibc gives each thread its own heap arena, and a load reuses the heap that an
        # evicted model freed only in the arena that model was loaded in
        self._loading = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loader")
        self.closed = False  # set once close() began: no more loads
        if self.budget is not None:
            metrics.memory_budget.set(self.budget.budget_bytes)
        self._update_memory()

    @property
    def used_bytes(self) -> int:
        """Bytes counted against the budget by the loaded models (READY, or UNLOADING until freed); a model being
        loaded has its room reserved and counts once READY."""
        return sum(s.budget_bytes for s in self.all() if s.loaded_or_unloading)

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Eager: load every selected version (models loaded before a failure are released).

        Raises:
            ConfigError: an eager model failed to load.
        """
        if self.strategy != "eager":
            return
        try:
            for slot in self.all():
                if slot.selected:
                    await self.load(slot)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stop every model: queued requests get 503, running batches finish, memory is released."""
        self.closed = True
        slots = [s for s in self.all() if s.runner is not None or s.loaded is not None]
        await asyncio.gather(*(self._stop(s) for s in slots))
        self._loading.shutdown(wait=False)

    def start_load(self, slot: ModelSlot) -> None:
        """Start loading an UNAVAILABLE ``slot`` (state LOADING; ``slot.task`` is the load).

        Raises:
            Unavailable: it counts more than the whole memory budget (:meth:`too_large`): no load is started, the
                slot stays UNAVAILABLE with that reason.
        """
        self._refuse_too_large(slot)
        self._spawn_load(slot)

    def _spawn_load(self, slot: ModelSlot, need: int | None = None, given: bool = False) -> asyncio.Task:
        """State LOADING, and ``slot.task`` the load (:meth:`_load`'s arguments); returns the task."""
        slot.state, slot.reason = LOADING, "loading"
        slot.task = task = asyncio.create_task(self._load(slot, need, given), name=f"load-{slot.name}-{slot.version}")
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # consumed; callers read state
        return task

    async def load(self, slot: ModelSlot) -> None:
        """Load ``slot`` now (repository API, eager start); returns when it is READY.

        Raises:
            ConfigError: the model failed to load. Unavailable: it cannot fit the memory budget (now, or ever:
                :meth:`too_large`).
        """
        slot.sticky_unloaded = False
        while slot.state == UNLOADING and slot.task is not None:
            await asyncio.shield(slot.task)
        if slot.state == READY:
            return
        if slot.state == UNAVAILABLE:
            self.start_load(slot)
        if slot.task is not None:
            await asyncio.shield(slot.task)

    async def _load(self, slot: ModelSlot, need: int | None = None, given: bool = False) -> None:
        """The load task: room made for ``need`` bytes (default: the slot's :attr:`ModelSlot.budget_bytes`).
        ``given``: the config is a client's (a repository load's): its failure is the client's answer, not logged,
        and left to the caller to undo (:meth:`_load_anew`)."""
        try:
            async with self._lock:
                await self._make_room(slot, need)
                loaded, rss0 = await self._open(slot, slot.cfg)
                await self._attach(slot, loaded)
                slot.state, slot.reason, slot.failed = READY, "", None
                slot.last_used = asyncio.get_running_loop().time()
                self.lifecycle.record("load", slot, loaded.load_seconds, rss0, self.used_bytes)
                if self.budget is not None and self.used_bytes > self.budget.budget_bytes:
                    await self._refit(slot)  # measured above its estimate
        except ConfigError as exc:
            if given:
                slot.state = UNAVAILABLE
                raise
            again = slot.failed == str(exc)  # the same failure, retried by a request: not news (WARNING)
            slot.state, slot.reason, slot.failed = UNAVAILABLE, f"load failed: {exc}", str(exc)
            slot.failed_at = asyncio.get_running_loop().time()
            log.log(logging.WARNING if again else logging.ERROR, "%s%s", exc, " (again)" if again else "")
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
            self._update_memory()

    async def _open(self, slot: ModelSlot, cfg: ModelConfig) -> tuple[Loaded, int]:
        """Load ``cfg`` in a worker thread; returns it and the resident memory before (bytes)."""
        rss0 = rss_bytes()
        restarts = self._restarts.labels(slot.name, slot.version)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._loading, self._loader, cfg, slot.where, restarts.inc), rss0

    async def _attach(self, slot: ModelSlot, loaded: Loaded) -> None:
        """Make ``loaded`` what serves ``slot``: its memory figures, then the load hooks (which attach its runner).
        A failing hook releases it, leaves the slot without a load and raises."""
        if slot.measured_bytes is None:  # the first load's figure: later ones see recycled heap
            slot.measured_bytes = max(loaded.measured_bytes, loaded.engine.nbytes * slot.cfg.instances,
                                      loaded.device_bytes)
        slot.footprint_bytes, slot.device_bytes = loaded.footprint_bytes, loaded.device_bytes
        slot.loaded, slot.runner, slot.last_signature = loaded, None, loaded.signature
        try:
            for hook in self.on_load:
                hook(slot)
        except BaseException:
            runner, slot.runner, slot.loaded = slot.runner, None, None
            if runner is not None:
                await runner.close()
            await asyncio.to_thread(loaded.release)
            raise

    async def reload(self, slot: ModelSlot, cfg: ModelConfig) -> None:
        """Serve ``slot`` with ``cfg`` from now on (the repository API's load with a config).

        The new load is made beside the current one and takes new requests as soon as it is ready (a version not
        loaded is loaded once, with ``cfg``: :meth:`_load_anew`); requests queued or executing on the old one
        finish there, then the old one is released. The model counts once against the memory budget (both are
        resident for a moment): as measured by the new load, and at least what its first load measured when the
        file is the same (the new load's growth lands in memory the old one holds or left). Under a budget, room
        is made for the new load's estimate first (:meth:`_reload_estimate`; idle models are evicted as for any
        load), and a new load measured over the budget that no eviction can fit is given back: the old one serves
        on.

        Raises:
            ConfigError: ``cfg`` does not load; the model keeps its config and its load. Unavailable: no room in the
                memory budget, unloaded meanwhile, or the server is shutting down.
        """
        while slot.state == UNLOADING and slot.task is not None:
            await asyncio.shield(slot.task)
        if slot.state == UNAVAILABLE:
            await self._load_anew(slot, cfg)
            return
        await self.load(slot)
        async with self._lock:
            if slot.state != READY or self.closed:
                raise Unavailable(f"model '{slot.name}' was unloaded during its reload", retry_after_s=1)
            # room for the new load first, as for any load (a reload to 12 instances once went 2x past the budget,
            # and one to 64 intra-op threads on top of it had the kernel kill the server: a new user's report)
            await self._make_room(slot, self._reload_estimate(slot, cfg))
            kept = ("cfg", "loaded", "runner", "measured_bytes", "footprint_bytes", "device_bytes")
            old = {k: getattr(slot, k) for k in kept}

            def restore() -> None:  # the old load serves on
                for k, v in old.items():
                    setattr(slot, k, v)

            loaded, rss0 = await self._open(slot, cfg)
            slot.cfg, slot.measured_bytes = cfg, None
            try:
                await self._attach(slot, loaded)
            except BaseException:
                restore()
                raise
            if old["measured_bytes"] is not None and cfg.path == old["cfg"].path:
                # the same file: the new load grew into the heap the old one left or shares, so its own growth
                # undercounts it (tiny_cnn: 0.37 MB against 42.6 at its first load, a new user's report)
                slot.measured_bytes = max(slot.measured_bytes, old["measured_bytes"])
            if self.budget is not None and self.used_bytes > self.budget.budget_bytes:
                try:  # measured above its estimate: room beside it, or the old load serves on
                    await self._make_room(slot)
                except Unavailable as exc:
                    new_runner = slot.runner
                    restore()
                    if new_runner is not None:
                        await new_runner.close()
                    await asyncio.to_thread(loaded.release)
                    self._update_memory()
                    raise Unavailable(f"model '{slot.name}': its new load measured {loaded.measured_bytes / MiB:.0f} "
                                      f"MB and does not fit the memory budget; the old load serves on ({exc.message})",
                                      retry_after_s=5) from None
            self.lifecycle.record("load", slot, loaded.load_seconds, rss0, self.used_bytes)
        runner = old["runner"]
        if runner is not None:
            log.info("reloaded model %s version %s; %d queued request(s) finish on the old load", slot.name,
                     slot.version, runner.queue_depth)
            while runner.queue_depth:  # requests queued there run there (none can join: they go to the new one)
                await asyncio.sleep(0.005)
            await runner.close()  # which lets the batches executing there finish
        await asyncio.to_thread(old["loaded"].release)
        await asyncio.to_thread(trim_heap)
        self._update_memory()

    async def _refit(self, slot: ModelSlot) -> None:
        """After a load measured above its estimate: make room for it, or give it back."""
        try:
            await self._make_room(slot)
        except Unavailable:
            await self._unload(slot, "over the memory budget after loading")
            too_large = self.too_large(slot)  # then no later request loads it again (start_load)
            slot.state, slot.reason = UNAVAILABLE, too_large or (
                f"needs {slot.budget_bytes / MiB:.0f} MB as measured at load; the memory budget "
                f"{self.budget.budget_bytes / MiB:.0f} MB cannot hold it beside the models in use")
            raise Unavailable(f"model '{slot.name}' version {slot.version} {too_large}" if too_large else
                              f"model '{slot.name}': {slot.reason}", retry_after_s=5) from None

    async def _load_anew(self, slot: ModelSlot, cfg: ModelConfig) -> None:
        """:meth:`reload` of a version not loaded: one load, with ``cfg`` (a new user's report: it was loaded as
        configured, then again with ``cfg``, twice the time; under a budget the first load evicted other models for
        a config then refused as larger than the whole budget). Room is made for :meth:`_reload_estimate`'s figure;
        a load that fails (a 400, not logged) leaves the version as it was: unloaded, its old config, its reason
        (a fresh user's find: it said "load failed" with the refused config's error, and the next request loaded
        the old config, undoing an unload by request).

        Raises:
            Unavailable: ``cfg``'s estimate is more than the whole memory budget (nothing changes), or no room.
            ConfigError: ``cfg`` does not load.
        """
        need = self._reload_estimate(slot, cfg)
        if self.budget is not None and need > self.budget.budget_bytes:
            raise Unavailable(f"model '{slot.name}' version {slot.version} would need about {need / MiB:.0f} MB with "
                              f"this config, more than the whole memory budget ({self.budget.budget_bytes / MiB:.0f} "
                              "MB): nothing was changed", retry_after_s=NOT_LOADED_RETRY_S)
        old_cfg, old_measured = slot.cfg, slot.measured_bytes
        was = (slot.reason, slot.failed, slot.failed_at, slot.sticky_unloaded)
        slot.sticky_unloaded = False
        slot.cfg, slot.measured_bytes = cfg, None
        task = self._spawn_load(slot, need, given=True)
        try:
            await asyncio.shield(task)
        except BaseException:
            if task.done() and slot.state != READY:  # failed (not merely this caller cancelled): as it was
                slot.cfg, slot.measured_bytes = old_cfg, old_measured
                slot.reason, slot.failed, slot.failed_at, slot.sticky_unloaded = was
            raise
        if old_measured is not None and cfg.path == old_cfg.path and slot.measured_bytes is not None:
            slot.measured_bytes = max(slot.measured_bytes, old_measured)  # as :meth:`reload`: the heap it reused

    def _reload_estimate(self, slot: ModelSlot, cfg: ModelConfig) -> int:
        """What ``slot`` would count with ``cfg`` before that load is measured: ``cfg.memory_mb``; for the same
        file, what it counts now, scaled up by the instances added; else the pre-load formula."""
        if cfg.memory_mb is None and slot.measured_bytes is not None and cfg.path == slot.cfg.path:
            return slot.measured_bytes * max(cfg.instances, slot.cfg.instances) // max(1, slot.cfg.instances)
        return ModelSlot.estimate(cfg)

    def too_large(self, slot: ModelSlot) -> str | None:
        """Why ``slot`` can never load under the memory budget, as its index reason: it counts more than the whole
        budget (:attr:`ModelSlot.budget_bytes`: as measured at its first load, else its ``memory_mb``, else the
        pre-load estimate), so no eviction can make room for it; None when it fits or there is no budget. Only
        a new budget or a new config (a restart) changes that."""
        if self.budget is None or slot.budget_bytes <= self.budget.budget_bytes:
            return None
        how = ("as measured at its load" if slot.measured_bytes is not None else "its memory_mb"
               if slot.cfg.memory_mb is not None else
               "estimated before its first load as (1 + 2 x instances) x file size + 32 MB; memory_mb sets it")
        return (f"needs {slot.budget_bytes / MiB:.0f} MB ({how}), more than the whole memory budget "
                f"({self.budget.budget_bytes / MiB:.0f} MB): no eviction can make room for it")

    def reason(self, slot: ModelSlot) -> str:
        """The index's reason for ``slot``: a version never loaded that counts more than the whole budget says so
        (:meth:`too_large`) from the start, not only once a request has been refused for it (a new user's report:
        the index said "not loaded" until then)."""
        if slot.state == UNAVAILABLE and slot.reason == NOT_LOADED:
            return self.too_large(slot) or slot.reason
        return slot.reason

    def _refuse_too_large(self, slot: ModelSlot) -> None:
        """Raise :meth:`too_large`'s answer for ``slot`` (and make it the slot's reason), if it has one."""
        why = self.too_large(slot)
        if why is not None:
            slot.reason = why
            raise Unavailable(f"model '{slot.name}' version {slot.version} {why}", retry_after_s=NOT_LOADED_RETRY_S)

    def admit(self, slot: ModelSlot) -> None:
        """Whether the memory budget holds ``slot`` now, as its load would find it (``on_cold: reject``, which
        answers before the load runs: a load that cannot fit is answered as it would be, not as "loading").

        Raises:
            Unavailable: :meth:`too_large`, or the models that would have to go are pinned (the slot's reason
                becomes that answer; nothing is evicted).
        """
        self._refuse_too_large(slot)
        try:
            self._victims(slot, slot.budget_bytes)
        except Unavailable as exc:
            slot.reason = exc.message
            raise

    def _victims(self, newcomer: ModelSlot, need: int) -> list[ModelSlot]:
        """What :mod:`batcher.lru` says to evict so that ``newcomer`` fits counting ``need`` bytes ([] without a
        budget).

        Raises:
            Unavailable: the models that would have to go are pinned (Retry-After 1), or ``need`` alone exceeds the
                budget (Retry-After :data:`NOT_LOADED_RETRY_S`).
        """
        if self.budget is None:
            return []
        others = [s for s in self.all() if s is not newcomer and s.loaded_or_unloading]
        idle = [Candidate(s, s.budget_bytes, s.last_used) for s in others if s.state == READY and not s.pinned]
        try:
            return self.budget.victims(newcomer.name, need, sum(s.budget_bytes for s in others),
                                       idle, [f"{s.name} ({s.budget_bytes / MiB:.0f} MB)" for s in others if s.pinned])
        except TooLarge as exc:
            raise Unavailable(str(exc), retry_after_s=NOT_LOADED_RETRY_S) from None
        except NoRoom as exc:
            raise Unavailable(str(exc), retry_after_s=1) from None

    async def _make_room(self, newcomer: ModelSlot, need: int | None = None) -> None:
        """Evict what :mod:`batcher.lru` names so that ``newcomer`` fits, counting ``need`` bytes (default: its
        :attr:`ModelSlot.budget_bytes`) (the caller holds the lock).

        Raises:
            Unavailable: the models that would have to go are pinned, or the newcomer alone exceeds the budget.
        """
        if self.budget is None:
            return
        victims = self._victims(newcomer, newcomer.budget_bytes if need is None else need)
        # The heap an evicted model freed is kept for the newcomer (and later loads): giving it back to the OS
        # made a reload fault every page in again (1.4-1.8x ONNX Runtime's own time). Only a first load, whose
        # growth is what it counts, gets a trimmed heap.
        trim = newcomer.measured_bytes is None
        for victim in victims:
            await self._unload(victim, f"evicted (lru) to make room for {newcomer.name}", kind="evict", trim=trim)

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

    async def _unload(self, slot: ModelSlot, reason: str, kind: str = "unload", trim: bool = True) -> None:
        slot.state, slot.reason = UNLOADING, reason
        done = asyncio.get_running_loop().create_future()
        slot.task = done
        try:
            while slot.inflight > 0:  # requests already routed here finish first
                await asyncio.sleep(0.005)
            rss0, t0 = rss_bytes(), time.perf_counter()
            await self._stop(slot)
            if trim:
                await asyncio.to_thread(trim_heap)
            slot.state, slot.reason = UNAVAILABLE, reason
            self.lifecycle.record(kind, slot, time.perf_counter() - t0, rss0, self.used_bytes)
        finally:
            done.set_result(None)
            slot.task = None
            self._update_memory()

    async def _stop(self, slot: ModelSlot) -> None:
        """Close what serves ``slot`` and release its engine."""
        runner, loaded = slot.runner, slot.loaded
        slot.runner, slot.loaded = None, None
        if slot.state == READY:
            slot.state = UNAVAILABLE
        if runner is not None:
            await runner.close()
        if loaded is not None:
            await asyncio.to_thread(loaded.release)

    # ---------------------------------------------------------------- observability
    def _update_memory(self) -> None:
        self.lifecycle.update_memory(self.all(), self.used_bytes)
