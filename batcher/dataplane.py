"""The data plane: what the server does for each KServe v2 call, free of any transport.

After MLServer's ``handlers/dataplane.py``: the HTTP handlers (:mod:`batcher.routes`) only read bodies, decode,
encode and build responses; they call :class:`DataPlane`, which routes to a model version, pins it, validates,
queues, waits and accounts. A front end in another process can call the same methods across a process boundary.
Tensors in shared memory (Triton's extensions, :mod:`batcher.shm`) are read from their regions right after the
request is read and outputs written to theirs before the answer is delivered; the regions live here.

Accounting rule (one place, :meth:`DataPlane.infer`): every inference request that names a configured model
moves exactly one outcome - ``batcher_request_success_total`` and the statistics extension's ``success``, or
``batcher_request_failure_total{reason}`` and ``fail`` - counted on the model version that answered it (the
fallback model when routing went there), after its answer was delivered. Requests for unknown models (404) are
counted nowhere, as in Triton. Reasons: ``invalid`` (400, 401, 408, 413), ``rejected`` (503), ``timeout``
(504, also an answer ready after its deadline), ``backend`` (500 from the engine), ``canceled`` (the client
went away), ``dropped`` (multi-process mode: the front-end process holding it died), ``other`` (a server bug, 500).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from engines.base import ExecutionContext

from .config import Config
from .errors import BatcherError, ConfigError, DeadlineExceeded, InvalidInput, ModelNotFound, Unavailable
from .executor import Executor, ThreadExecutor, executor_for
from .metrics import Metrics
from .outcomes import NOT_COUNTED, CountedLater, Inflight, Started, cancel_reason
from .protocol import InferRequest, InferResponse
from .repository import ModelRepository
from .slots import READY, ModelSlot
from .retention import ThroughputTracker
from .routing import Router
from .scheduler import ModelRunner
from .shm import SharedMemoryRegistry, uses_shm
from .signature import ModelSignature
from .strategy import Strategy
from .topology import uses_gpu
from .triton_config import PLATFORMS, apply_model_config, config_changes, model_config_json, with_changes

T = TypeVar("T")

def late_answer(model: str) -> DeadlineExceeded:
    """The error of an answer that was ready after its request's deadline (no answer is sent after a deadline)."""
    return DeadlineExceeded(f"model '{model}': the answer was ready after the request's deadline")


def request_deadline(received: float, timeout_us: int | None, default_timeout_s: float | None) -> float | None:
    """A request's deadline (event-loop seconds): its ``parameters.timeout`` (microseconds), else the model's
    default timeout, counted from ``received``; None when neither is set."""
    if timeout_us:
        return received + timeout_us / 1e6
    if default_timeout_s:
        return received + default_timeout_s
    return None


async def load_versions(repository: ModelRepository, slots: list[ModelSlot], config: dict[str, Any] | None) -> None:
    """Load ``slots``, the served versions of one model; with ``config`` (Triton's model-config JSON, a repository
    load's ``parameters.config``) applied first, all or none: a version whose config changes is reloaded, its
    requests in flight finishing on the old load (:meth:`ModelRepository.reload`).

    ``config`` is read as the model's config as ``GET /v2/models/{m}/config`` shows it, its highest served
    version's (Triton's versions share one config; ours may differ, e.g. a canary's ``weight``): what it changes
    there (:func:`batcher.triton_config.apply_model_config`, then :func:`~batcher.triton_config.config_changes`)
    is written over every version's own config, the rest of each staying as it is. So what GET shows loads back
    changing nothing (a new user's report: loading it back gave every version the highest one's weight and batch
    settings, a 90/10 canary became 50/50), and a change made there applies to every version. Each version is
    checked against the config too (its identity, tensors and the result).

    Raises:
        InvalidInput: the config is refused. ConfigError: a version fails to load.
    """
    if config is not None:
        for slot in slots:
            if slot.last_signature is None:  # never loaded: its tensors are needed to apply the config
                await repository.load(slot)
        for slot in slots:
            apply_model_config(slot.cfg, slot.last_signature, config)  # refused for any version: nothing changes
        shown = max(slots, key=lambda s: int(s.version))
        changes = config_changes(shown.cfg, apply_model_config(shown.cfg, shown.last_signature, config))
        configs = [with_changes(slot.cfg, changes) if changes else slot.cfg for slot in slots]
    else:
        configs = [slot.cfg for slot in slots]
    for slot, cfg in zip(slots, configs):
        if cfg == slot.cfg:
            await repository.load(slot)
        else:
            await repository.reload(slot, cfg)


def events_doc(repo: ModelRepository) -> dict[str, Any]:
    """The lifecycle events (:mod:`batcher.events`) and the memory counted against the budget."""
    return {"events": list(repo.lifecycle.events), "memory_used_bytes": repo.used_bytes,
            "memory_budget_bytes": repo.budget.budget_bytes if repo.budget else None}


class DataPlane:
    """Inference, metadata, statistics and repository calls over one :class:`ModelRepository`."""

    #: where a transport may read a request body so that its tensors need no copy: none in one process (a front
    #: end's data plane has one, :meth:`batcher.frontend.RemoteDataPlane.body_buffer`)
    body_buffer = None

    def __init__(self, config: Config, metrics: Metrics, repository: ModelRepository | None = None,
                 executor: Callable[[ExecutionContext, str], Executor] = ThreadExecutor, *,
                 deliver_checks_deadline: bool = False) -> None:
        """``executor(context, name)``: the owner of one context (a thread; tests run batches on the event loop).
        ``deliver_checks_deadline``: ``deliver`` raises DeadlineExceeded for an answer too late (an engine process)."""
        self.config = config
        self._executor = executor
        self._deliver_checks_deadline = deliver_checks_deadline
        self.metrics = metrics
        self.repository = repository or ModelRepository(config, metrics)
        self.router = Router(self.repository, Strategy(config.routing.strategy))
        self.repository.on_load.insert(0, self._attach_runner)
        #: Triton's shared-memory extensions: the regions clients registered (:mod:`batcher.shm`).
        self.shm = SharedMemoryRegistry(config.server.shared_memory, page_lock=uses_gpu(config))
        self.ready = False  # until started, and again from the moment a drain begins: new requests get 503
        #: the 503's message from the moment a drain begins (an engine process names itself: the server is not
        #: shutting down when one engine process drains)
        self.stopping_message = "server is shutting down"
        self._inflight = Inflight()
        self._monitor: asyncio.Task | None = None

    def _attach_runner(self, slot: ModelSlot) -> None:
        """Load hook: the batcher and one executor thread per execution context."""
        executors = [executor_for(self._executor, slot.cfg, ctx, f"{slot.name}-ctx{i}",
                                  self.config.server.inline_execution_us) for i, ctx in enumerate(slot.loaded.contexts)]
        slot.runner = ModelRunner(slot.cfg, slot.loaded.signature, executors,
                                  self.metrics.for_model(slot.name, slot.version), slot.stats)

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Load what the strategy loads at start, then report ready.

        Raises:
            ConfigError: an eager model failed to load.
        """
        await self.repository.start()
        self._monitor = asyncio.create_task(self._watch_throughput(), name="throughput-monitor")
        self.ready = True

    async def drain(self, grace_s: float) -> None:
        """Stop taking requests (readiness false, new requests 503) and wait until every accepted request has been
        answered, at most ``grace_s`` seconds. A request is accepted once its handler started (its headers
        arrived), even if its body is still on the way."""
        self.ready = False
        await self._inflight.wait_quiet(grace_s)

    def shed(self) -> int:
        """SIGTERM's grace is over: every request still queued is answered 503 (:meth:`ModelRunner.shed`), so
        that it gets an answer before the exit closes its connection; how many."""
        return sum(s.runner.shed() for s in self.repository.all() if s.runner is not None)

    async def close(self) -> None:
        """Stop every model; queued requests get 503, running batches finish, memory is released."""
        self.ready = False
        if self._monitor is not None:
            self._monitor.cancel()
            try:
                await self._monitor
            except asyncio.CancelledError:
                pass
            self._monitor = None
        await self.repository.close()
        await self.shm.close()
        self.metrics.tally.flush()  # the last pass's counts (its flush may never run once the loop stops)

    async def _watch_throughput(self, tick_s: float = 1.0) -> None:
        """Every ``tick_s``: per-model throughput and the live retention ratio (:mod:`batcher.retention`)."""
        tracker = ThroughputTracker()
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(tick_s)
            counts = {(s.name, s.version): s.stats.success.count for s in self.repository.all()}
            rps, ratio = tracker.tick(loop.time(), counts)
            for (name, version), r in rps.items():
                self.metrics.throughput.labels(name, version).set(r)
            self.metrics.retention.set(float("nan") if ratio is None else ratio)

    # ---------------------------------------------------------------- inference
    async def infer(self, model: str, version: str | None, received: float,
                    read: Callable[[], Awaitable[InferRequest]],
                    deliver: Callable[[InferResponse], Awaitable[T]]) -> T:
        """One inference request, from routing to its delivered answer, counted once (module docstring).

        Args:
            received: event-loop time the request arrived (its deadline and batch window count from here).
            read: gives the decoded request (the transport reads and decodes its body); may raise
                InvalidInput/RequestTimeout/PayloadTooLarge.
            deliver: turns the answer into the transport's (encodes it); what it returns is returned. A
                :class:`CountedLater` it returns is settled by the transport, which then counts the outcome.

        Raises:
            ModelNotFound (404, before anything is read); every BatcherError of the request's outcome.
        """
        target = self.repository.slot(model, version)
        if not self.ready:
            self._count(target, "rejected", received)
            raise Unavailable("server is not ready" if self._monitor is None else self.stopping_message)
        owner = target
        self._inflight.enter()
        loop = asyncio.get_running_loop()
        try:
            request = await read()
            target = owner = self.router.choose_version(target, request.routing_key) if version is None else target
            held = self.shm.hold(request) if uses_shm(request) else None
            try:  # regions the request names stay mapped until it is done
                inputs = await held.inputs() if held is not None else request.inputs
                deadline = request_deadline(received, request.timeout_us, target.cfg.default_timeout_s)
                # a READY model is pinned without another coroutine (Router.acquire's own first step)
                owner = slot = target if self.router.pin_ready(target) else await self.router.acquire(target, deadline)
                try:
                    rows = slot.signature.check(slot.name, inputs)
                    if request.outputs:
                        slot.signature.check_outputs(slot.name, [o.name for o in request.outputs])
                    runner = slot.runner  # ModelRunner.infer, written out: one coroutine less per request
                    pending = runner.enqueue(inputs, rows=rows, received=received, deadline=deadline,
                                             priority=request.priority, lease=request.lease)
                    try:
                        outputs = await pending.future
                    except asyncio.CancelledError:
                        runner.withdraw(pending)
                        raise
                finally:
                    self.router.release(slot)
                if held is not None and held.writes:
                    await held.write(outputs)
                answer = await deliver(InferResponse(slot.name, slot.version, outputs, request, deadline))
            finally:
                if held is not None:
                    held.release()
            if not self._deliver_checks_deadline and deadline is not None and loop.time() > deadline:
                raise late_answer(slot.name)  # ready too late: no answer after a deadline
        except BatcherError as exc:
            self._count(owner, exc.reason, received)
            raise
        except asyncio.CancelledError as exc:
            self._count(owner, cancel_reason(exc.args[0] if exc.args else None), received)
            raise
        except Exception:
            self._count(owner, "other", received)
            raise
        finally:
            self._inflight.leave()
        if type(answer) is CountedLater:
            answer.bind(partial(self._count, owner, received=received))
        else:
            self._count(owner, None, received)
        return answer

    def start_infer(self, model: str, version: str | None, received: float, request: InferRequest,
                    deliver: Callable[[InferResponse], CountedLater], fail: Callable[[BaseException | None], None]
                    ) -> Started | None:
        """:meth:`infer` without a task per request, for a transport that learns each answer's fate later (an
        engine process, built with ``deliver_checks_deadline``): where nothing needs waiting for before the
        request is queued, it is routed, checked and queued now, and its outcome is handed over from the end of its
        batch, on the event loop - ``deliver(response)`` (which returns the :class:`CountedLater` the transport
        settles), or ``fail(error)`` (``None``: it was cancelled, nobody waits). Counted exactly as by
        :meth:`infer` (module docstring), on the version that answered.

        Nothing needs waiting for when: the server is ready, the version is READY with no ``fallback``, no
        version is to be chosen by ``routing.strategy`` (weighted, hash), and every shared-memory region the
        request names is a system one (:attr:`batcher.shm.Hold.immediate`). Otherwise nothing happened and
        None is returned: use :meth:`infer`. What it saves is measured by ``python -m bench.engine_ipc`` (the
        README's "Serving modes", engine process).

        Args:
            received: event-loop time the request arrived. request: decoded; its lease is held while queued.

        Returns:
            a :class:`Started` (its ``cancel()``: the client went away), or None.

        Raises:
            ModelNotFound (404, nothing counted); the BatcherError that refuses it before it is queued, counted:
            InvalidInput (400), Unavailable (503: queue full, admission control), DeadlineExceeded (504).
        """
        target = self.repository.slot(model, version)
        if (not self._deliver_checks_deadline or not self.ready or target.state != READY
                or target.cfg.fallback is not None or target.runner is None
                or (version is None and self.router.strategy.spreads(request.routing_key))):
            return None
        try:
            held = self.shm.hold(request) if uses_shm(request) else None
        except BatcherError as exc:  # a region not registered, a tensor outside its region: counted as infer does
            self._count(target, exc.reason, received)
            raise
        if held is not None and not held.immediate:
            held.release()
            return None
        self._inflight.enter()
        pinned = False
        try:
            inputs = held.read_now() if held is not None else request.inputs
            deadline = request_deadline(received, request.timeout_us, target.cfg.default_timeout_s)
            pinned = self.router.pin_ready(target)
            rows = target.signature.check(target.name, inputs)
            if request.outputs:
                target.signature.check_outputs(target.name, [o.name for o in request.outputs])
            runner = target.runner
            pending = runner.enqueue(inputs, rows=rows, received=received, deadline=deadline,
                                     priority=request.priority, lease=request.lease)
        except Exception as exc:
            if pinned:
                self.router.release(target)
            if held is not None:
                held.release()
            self._inflight.leave()
            self._count(target, exc.reason if isinstance(exc, BatcherError) else "other", received)
            raise
        started = Started(self, target, runner, received, deadline, request, held, pending, deliver, fail)
        pending.future.add_done_callback(started._done)
        return started

    def _count(self, slot: ModelSlot, reason: str | None, received: float) -> None:
        """The one place an inference outcome is counted: ``reason`` None is a success; :data:`NOT_COUNTED` (another
        process counts it) is not counted."""
        if reason == NOT_COUNTED:
            return
        elapsed = asyncio.get_running_loop().time() - received
        outcomes = self.metrics.outcomes(slot.name, slot.version)
        if reason is None:
            outcomes.succeeded(elapsed)
            slot.stats.success.add(elapsed)
            slot.stats.last_inference_ms = int(time.time() * 1e3)
        else:
            outcomes.failure(reason).inc()
            slot.stats.fail.add(elapsed)

    # ---------------------------------------------------------------- metadata
    def model_ready(self, model: str, version: str | None = None) -> bool:
        """Whether the model version is servable now (Kubernetes/KServe per-model probes).

        Rule: the server is ready, and the version is READY - or, under ``lazy``/``lru``, it would be loaded by
        its next request (not unloaded through the repository API, last load not failed, not larger than the whole
        memory budget).

        Raises:
            ModelNotFound: unknown model or version.
        """
        slot = self.repository.slot(model, version)
        if not self.ready:
            return False
        if slot.state == READY:
            return True
        return (self.repository.strategy != "eager" and not slot.sticky_unloaded and not slot.failed
                and self.repository.too_large(slot) is None)

    async def signature(self, model: str, version: str | None = None) -> tuple[ModelSlot, ModelSignature]:
        """The slot and its served signature; a model never loaded yet is loaded (lazy/lru) to learn it.

        Raises:
            ModelNotFound (404); Unavailable (503: it cannot be loaded now).
        """
        slot = self.repository.slot(model, version)
        if slot.signature is None:
            pinned = await self.router.acquire(slot, allow_fallback=False)
            self.router.release(pinned)
        if slot.signature is None:
            raise Unavailable(f"model '{slot.name}' is not loaded: {slot.reason}")
        return slot, slot.signature

    async def model_metadata(self, model: str, version: str | None = None) -> dict[str, Any]:
        """KServe v2 model metadata: name, versions, platform, inputs and outputs with their served shapes; and
        ``parameters`` (the Open Inference Protocol's optional field): ``allowed_batch_sizes`` (null: batches are
        not padded) and ``contexts``, how each execution context executes (its ``describe()``, e.g. CUDA graphs or
        one session per size, and the precision), in instance order."""
        slot, sig = await self.signature(model, version)

        def tensors(specs):
            return [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in specs]

        allowed = list(sig.allowed_batch_sizes) if sig.allowed_batch_sizes else None
        contexts = [c.describe() for c in slot.loaded.contexts] if slot.loaded is not None else []
        return {"name": slot.name, "versions": self.repository.served_versions(slot.name),
                "platform": PLATFORMS[slot.cfg.backend], "inputs": tensors(sig.inputs), "outputs": tensors(sig.outputs),
                "parameters": {"allowed_batch_sizes": allowed, "contexts": contexts}}

    async def model_config(self, model: str, version: str | None = None) -> dict[str, Any]:
        """The model's configuration as Triton's model-config JSON (:mod:`batcher.triton_config`)."""
        slot, sig = await self.signature(model, version)
        return model_config_json(slot.cfg, sig)

    def statistics(self, model: str | None = None, version: str | None = None) -> dict[str, Any]:
        """Triton's statistics extension for every served version, one model's, or one version's.

        Raises: ModelNotFound (404): unknown model or version.
        """
        repo = self.repository
        if model is None:
            slots = [s for s in repo.all() if s.selected]
        elif version is None:
            name = repo.slot(model).name  # ModelNotFound (404) before anything else looks the name up
            slots = [repo.slots[name][v] for v in repo.served_versions(name)]
        else:
            slots = [repo.slot(model, version)]
        return {"model_stats": [s.stats.json(s.name, s.version) for s in slots]}

    # ---------------------------------------------------------------- repository extension
    def repository_slots(self, model: str) -> list[ModelSlot]:
        """Every served version of ``model``. Raises ModelNotFound."""
        if model not in self.repository.slots:
            raise ModelNotFound(f"unknown model '{model}'; models: {sorted(self.repository.slots)}")
        return [s for s in self.repository.slots[model].values() if s.selected]

    def repository_index(self, ready: bool | None = None) -> list[dict[str, Any]]:
        """The repository index (:meth:`ModelSlots.index`; ``ready``: only the READY versions, or the others)."""
        return self.repository.index(ready)

    def repository_events(self) -> dict[str, Any]:
        """Load, evict and unload events with durations and memory before/after, and the memory counted."""
        return events_doc(self.repository)

    async def load(self, model: str, config: dict[str, Any] | None = None) -> None:
        """Load every served version of ``model``, with ``config`` applied first (:func:`load_versions`).

        Raises:
            ModelNotFound; InvalidInput: the config is refused (nothing changed), or a version fails to load.
        """
        try:
            await load_versions(self.repository, self.repository_slots(model), config)
        except ConfigError as exc:  # a loader's message names the model already; a refused config does not
            raise InvalidInput(str(exc) if "failed to load" in str(exc) else f"model '{model}': {exc}") from None

    async def unload(self, model: str) -> None:
        """Unload every served version of ``model`` (requests in flight finish first). Raises ModelNotFound."""
        for slot in self.repository_slots(model):
            await self.repository.unload(slot)

    # ---------------------------------------------------------------- shared-memory extensions (batcher.shm)
    async def shm_register(self, kind: str, name: str, **params: Any) -> None:
        """Register region ``name``: ``kind`` ``"system"`` (``key``, ``offset``, ``byte_size``) or ``"cuda"``
        (``raw_handle`` bytes, ``device_id``, ``byte_size``). Raises NotFound (extension off), InvalidInput."""
        await self.shm.register(kind, name, **params)

    async def shm_unregister(self, kind: str, name: str | None = None) -> None:
        """Unregister region ``name`` of ``kind`` (all of them when None). Raises NotFound (extension off)."""
        await self.shm.unregister(kind, name)

    def shm_status(self, kind: str, name: str | None = None) -> list[dict[str, Any]]:
        """Triton's status list of ``kind``'s regions (one when ``name`` is given). Raises NotFound."""
        return self.shm.status(kind, name)
