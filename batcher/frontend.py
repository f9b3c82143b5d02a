"""A front-end process of multi-process mode: the aiohttp app of single-process mode (same routes, codec,
error mapping, SIGTERM drain) in front of :class:`RemoteDataPlane`, listening with ``SO_REUSEPORT`` on the port
every front end shares (the kernel spreads connections over them).

:class:`RemoteDataPlane` has the public methods of :class:`batcher.dataplane.DataPlane`; how it reaches the engine
processes is :mod:`batcher.remote`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from .config import Config, ModelConfig
from .dataplane import late_answer, request_deadline
from .outcomes import Inflight
from .errors import BatcherError, RemoteError, Unavailable
from .heartbeat import Heartbeat
from .ipc import CANCELED, RESULT, error_tuple
from .metrics import Metrics
from .protocol import InferRequest, InferResponse
from .remote import BodyBuffer, EngineLink, EngineLost
from .shm import RegistryLock
from .slots import ModelSlots
from .strategy import LEAST_QUEUE, Strategy, Target
from .topology import Engine, engine_slots, engines, model_engines, weight

log = logging.getLogger(__name__)

T = TypeVar("T")

#: an engine process whose heartbeat is older than a third of ``server.stall_timeout_s`` (this default when that
#: is null), and at least the first figure, is not routed to and makes readiness false (:meth:`EngineLink.up`)
STALE_MIN_S, STALE_DEFAULT_S = 3.0, 10.0

#: a request whose engine process has not answered this many seconds after its deadline (stopped, or stuck; it
#: answers 504 itself at the deadline otherwise) is answered 504 by its front end
#: (:meth:`batcher.remote.EngineLink.expire`, looked for every half of it: within 0.5-0.75 s of the deadline).
OVERDUE_S = 0.5


class RemoteDataPlane:
    """The data plane of one front end: inference and every other call, answered by the engine processes.

    Args:
        paths: the Unix socket of each engine process (:func:`batcher.topology.engines`).
        metrics: counts what no engine can (a request for a model whose engine processes are all down).
    """

    def __init__(self, config: Config, metrics: Metrics, paths: dict[Engine, str],
                 beats: dict[Engine, Heartbeat] | None = None) -> None:
        """``beats``: the engine processes' heartbeats (None: not watched)."""
        self.config = config
        self.metrics = metrics
        self.catalog = ModelSlots(config)  # the versions configured and served: 404s without asking an engine
        self.strategy = Strategy(config.routing.strategy)
        stall_s = config.server.stall_timeout_s
        stale_s = max(STALE_MIN_S, stall_s / 3) if stall_s else STALE_DEFAULT_S
        self.links = [EngineLink(e, paths[e], engine_slots(config, e), self._restore_regions, self._count_lost,
                                 (beats or {}).get(e), stale_s)
                      for e in engines(config)]
        by_engine = {link.engine: link for link in self.links}
        self._links_of = {(m.name, str(m.version)): [by_engine[e] for e in model_engines(config, m)]
                          for m in config.models}
        self._inflight = Inflight()
        self._rids = itertools.count()
        self._started = False
        self._draining = False
        self._expiring: asyncio.Task | None = None
        self._registered_here: set[tuple[str, str]] = set()  # (kind, name) of the regions registered through here
        #: one front end at a time changes the engine processes' shared-memory registries (the runtime folder's)
        self._registry_lock = RegistryLock(os.path.join(os.path.dirname(next(iter(paths.values()))),
                                                        "shm-registry.lock"))

    # ---------------------------------------------------------------- lifecycle
    @property
    def ready(self) -> bool:
        """Started, not draining, and every engine process connected and running (:meth:`EngineLink.up`)."""
        return self._started and not self._draining and all(link.up() for link in self.links)

    async def start(self) -> None:
        """Connect to every engine process (they are ready before front ends start; one being restarted when this
        front end starts again is connected to once it is back, :meth:`EngineLink.start`)."""
        await asyncio.gather(*(link.start() for link in self.links))
        self._expiring = asyncio.get_running_loop().create_task(self._expire())
        self._started = True

    async def _expire(self) -> None:
        """Every ``OVERDUE_S / 2``: answer 504 the requests whose engine process has not answered ``OVERDUE_S``
        after their deadline (:meth:`EngineLink.expire`). Runs until :meth:`close`."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(OVERDUE_S / 2)
            for link in self.links:
                link.expire(loop.time() - OVERDUE_S)

    async def _restore_regions(self, link: EngineLink) -> None:
        """An engine process that restarted has lost the shared-memory regions clients registered while its siblings
        kept theirs: register the siblings' system regions there again (several front ends may: "already
        registered" is expected). CUDA regions cannot be: their IPC handle is not kept; logged, to be registered
        again by the client (unregister, then register). With no sibling up (one engine process), every region is
        gone: logged, for the clients to register again."""
        shm = self.config.server.shared_memory
        if not (shm.system or shm.cuda):
            return
        sibling = next((other for other in self.links if other is not link and other.connected), None)
        if sibling is None:  # nowhere to take them from: each front end names those registered through it
            lost = sorted(name for _, name in self._registered_here)
            self._registered_here.clear()
            if lost:
                log.warning("the %s restarted without the shared memory regions registered there (%s, registered "
                            "through this front end); clients must register them again", link.name, ", ".join(lost))
            return
        async with self._registry_lock.held():  # no change through another front end in between
            await self._copy_regions(sibling, link)

    async def _copy_regions(self, sibling: EngineLink, link: EngineLink) -> None:
        shm = self.config.server.shared_memory
        try:
            regions = await sibling.call("shm_status", "system") if shm.system else []
            cuda = await sibling.call("shm_status", "cuda") if shm.cuda else []
        except BatcherError:
            return
        for r in regions:
            try:
                await link.call("shm_register", "system", r["name"], key=r["key"], offset=r["offset"],
                                byte_size=r["byte_size"])
            except BatcherError as exc:
                if "already registered" not in exc.message:
                    log.warning("system shared memory region '%s' could not be registered again in the %s: %s",
                                r["name"], link.name, exc.message)
        if cuda:
            log.warning("the %s restarted without the CUDA shared memory regions %s: clients must unregister and "
                        "register them again", link.name, ", ".join(repr(r["name"]) for r in cuda))

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: readiness false and new requests 503, until this front end's accepted requests are answered
        (at most ``grace_s``); the engine processes stay up until every front end is done."""
        self._draining = True
        await self._inflight.wait_quiet(grace_s)

    def shed(self) -> int:
        """SIGTERM's grace is over: every request of this front end still waiting for its engine process is
        answered 503 now (:meth:`EngineLink.shed`), before the exit closes its connection; how many."""
        error = Unavailable("the server is shutting down and its drain's grace (server.shutdown_grace_s) is over")
        return sum(link.shed(error) for link in self.links)

    async def close(self) -> None:
        self._draining = True
        if self._expiring is not None:
            self._expiring.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiring
        await asyncio.gather(*(link.close() for link in self.links))

    # ---------------------------------------------------------------- inference
    def body_buffer(self, model: str, version: str | None, nbytes: int, header_bytes: int) -> BodyBuffer | None:
        """Where to read a binary request body for ``model`` so that its tensors reach the engine uncopied: a block
        of the shared area of the one engine process that can serve it (:meth:`EngineLink.body_buffer`); None when
        there is no such one process (several could: the route is chosen after decoding), the model is unknown (its
        404 comes later), or the area has no room."""
        try:
            cfg = self.catalog.slot(model, version).cfg
        except BatcherError:
            return None
        if version is None and self.strategy.name != LEAST_QUEUE and len(self._served_cfgs(cfg.name)) > 1:
            return None  # weighted or hash may send it to another version
        links = self._links_of[(cfg.name, str(cfg.version))]
        return links[0].body_buffer(nbytes, header_bytes) if len(links) == 1 else None

    def _route(self, cfg: ModelConfig, named: bool, request: InferRequest | None
               ) -> tuple[EngineLink, ModelConfig] | None:
        """The engine process and model version for one request (:mod:`batcher.strategy`); None: every engine
        process that could serve it is down."""
        key = request.routing_key if request is not None else None
        cfgs = self._served_cfgs(cfg.name) if not named and self.strategy.spreads(key) else [cfg]
        options = [(link, c) for c in cfgs for link in self._links_of[(c.name, str(c.version))] if link.up()]
        if not options:
            return None
        if request is None or len(options) == 1:
            return options[0]
        targets = [Target(f"{c.name}/{c.version}@{link.engine.name}", weight(c, link.engine.device),
                          link.load((c.name, str(c.version)))) for link, c in options]
        return options[self.strategy.choose(cfg.name, targets, key)]

    async def infer(self, model: str, version: str | None, received: float,
                    read: Callable[[], Awaitable[InferRequest]],
                    deliver: Callable[[InferResponse], Awaitable[T]]) -> T:
        """:meth:`batcher.dataplane.DataPlane.infer` across the process boundary (module docstring); the same
        answers, each counted once: by the engine process that served it, or here when none can (refused before
        reaching one, or its engine process died: :meth:`_count_here`)."""
        cfg = self.catalog.slot(model, version).cfg  # 404 before reading, as in single-process mode
        if self._draining or not self._started:  # as in single-process mode: counted here, never in flight, so a
            self._count_here(cfg, "rejected", received)  # drain under a stream of new requests still ends
            raise Unavailable("server is shutting down" if self._draining else "server is not ready")
        request: InferRequest | None = None
        failure: Any = None
        error: BaseException | None = None
        self._inflight.enter()
        try:
            try:
                request = await read()
            except asyncio.CancelledError:
                failure = CANCELED
                self._send_failure(cfg, received, failure)
                raise
            except Exception as exc:
                error, failure = exc, error_tuple(exc)
            return await self._infer(cfg, version is not None, received, request, failure, error, deliver)
        finally:
            self._inflight.leave()

    def _send_failure(self, cfg: ModelConfig, received: float, failure: Any) -> None:
        """A request that was never read, sent only to be counted (its client is gone)."""
        route = self._route(cfg, True, None)
        if route is not None:
            route[0].submit(next(self._rids), route[1], received, None, failure)

    async def _infer(self, cfg: ModelConfig, named: bool, received: float, request: InferRequest | None,
                     failure: Any, error: BaseException | None, deliver: Callable[[InferResponse], Awaitable[T]]
                     ) -> T:
        route = self._route(cfg, named, request)
        if route is None:
            self._count_here(cfg, "rejected", received)
            links = self._links_of[(cfg.name, str(cfg.version))]
            if any(link.connected and link.draining for link in links):
                raise Unavailable(f"model '{cfg.name}': the engine process serving it is draining (SIGTERM); it is "
                                  "being restarted", retry_after_s=1)
            if any(link.connected for link in links):
                raise Unavailable(f"model '{cfg.name}': the engine process serving it has stopped running (stopped "
                                  "or stuck); it is restarted once server.stall_timeout_s passes", retry_after_s=1)
            raise Unavailable(f"model '{cfg.name}': the engine process serving it is not running; it is being "
                              "restarted", retry_after_s=1)
        link, cfg = route
        rid = next(self._rids)
        deadline = request_deadline(received, request.timeout_us, cfg.default_timeout_s) if request else None
        outcome = link.submit(rid, cfg, received, request, failure, deadline)
        try:
            msg = await outcome
        except asyncio.CancelledError:
            link.abort(rid)
            raise
        except EngineLost:  # the engine process that would count it died with it
            self._count_here(cfg, "rejected", received)
            raise
        if error is not None:  # the engine counted it; answer exactly what reading raised (e.g. aiohttp's 413)
            raise error
        if msg[0] != RESULT:
            raise RemoteError(*msg[2])
        _, _, name, version, entries, deadline, _ = msg
        try:
            answer = await deliver(InferResponse(name, version, link.outputs(entries), request, deadline))
            if deadline is not None and asyncio.get_running_loop().time() > deadline:
                raise late_answer(name)  # ready too late: no answer after a deadline
        except asyncio.CancelledError:
            link.abort(rid)
            raise
        except Exception as exc:
            if not link.ack(rid, error_tuple(exc)):
                self._count_here(cfg, exc.reason if isinstance(exc, BatcherError) else "other", received)
            raise
        if not link.ack(rid):  # the engine process died after answering: it will never count this one
            self._count_here(cfg, None, received)
        return answer

    def _count_here(self, cfg: ModelConfig, reason: str | None, received: float) -> None:
        """Count an outcome in this front end, for a request whose engine process is gone (the engine process
        counts all others, after delivery): ``reason`` None is a success."""
        outcomes = self.metrics.outcomes(cfg.name, str(cfg.version))
        if reason is None:
            outcomes.success.inc()
            outcomes.duration.observe(asyncio.get_running_loop().time() - received)
        else:
            outcomes.failure(reason).inc()

    def _count_lost(self, key: tuple[str, str], reason: str) -> None:
        """:meth:`_count_here` for an outcome of model version ``key`` that its engine process died without
        counting (:attr:`EngineLink.count_lost`)."""
        outcomes = self.metrics.outcomes(*key)
        outcomes.failure(reason).inc()

    def _served_cfgs(self, name: str) -> list[ModelConfig]:
        return [self.catalog.slots[name][v].cfg for v in self.catalog.served_versions(name)]

    # ---------------------------------------------------------------- other calls
    def _serving(self, model: str, version: str | None) -> tuple[ModelConfig, list[EngineLink]]:
        cfg = self.catalog.slot(model, version).cfg
        return cfg, self._links_of[(cfg.name, str(cfg.version))]

    async def _first(self, method: str, model: str, version: str | None) -> Any:
        cfg, links = self._serving(model, version)
        up = [link for link in links if link.connected] or links
        return await up[0].call(method, cfg.name, str(cfg.version))

    async def model_metadata(self, model: str, version: str | None = None) -> dict[str, Any]:
        return await self._first("model_metadata", model, version)

    async def model_config(self, model: str, version: str | None = None) -> dict[str, Any]:
        return await self._first("model_config", model, version)

    async def model_ready(self, model: str, version: str | None = None) -> bool:
        cfg, links = self._serving(model, version)
        if not self.ready:
            return False
        try:
            answers = await asyncio.gather(*(link.call("model_ready", cfg.name, str(cfg.version)) for link in links))
        except Unavailable:  # an engine process went away meanwhile
            return False
        return all(answers)

    async def statistics(self, model: str | None = None, version: str | None = None) -> dict[str, Any]:
        links = self.links
        if model is not None:
            cfg = self.catalog.slot(model, version).cfg
            cfgs = [cfg] if version is not None else self._served_cfgs(cfg.name)
            links = list(dict.fromkeys(link for c in cfgs for link in self._links_of[(c.name, str(c.version))]))
        else:  # every model: those of engine processes being restarted are left out meanwhile
            links = [link for link in links if link.connected]
        docs = await asyncio.gather(*(link.call("statistics", model, version) for link in links))
        return merge_statistics(docs)

    async def repository_index(self, ready: bool | None = None) -> list[dict[str, Any]]:
        docs = await asyncio.gather(*(self._index_of(link) for link in self.links))
        merged = merge_index(self.config.models, [(set(link.keys), doc) for link, doc in zip(self.links, docs)])
        return [e for e in merged if ready is None or (e["state"] == "READY") == ready]

    async def _index_of(self, link: EngineLink) -> list[dict[str, Any]]:
        if not link.connected:
            return [{"name": n, "version": v, "state": "UNAVAILABLE", "reason": f"the {link.name} is restarting"}
                    for n, v in link.keys]
        return await link.call("repository_index")

    async def repository_events(self) -> dict[str, Any]:
        docs = await asyncio.gather(*(link.call("repository_events") for link in self.links))
        budgets = [d["memory_budget_bytes"] for d in docs if d["memory_budget_bytes"] is not None]
        return {"events": sorted((e for d in docs for e in d["events"]), key=lambda e: e.get("time", 0)),
                "memory_used_bytes": sum(d["memory_used_bytes"] for d in docs),
                "memory_budget_bytes": sum(budgets) if budgets else None}

    async def load(self, model: str, config: dict[str, Any] | None = None) -> None:
        await self._on_all_serving("load", model, config)

    async def unload(self, model: str) -> None:
        await self._on_all_serving("unload", model)

    async def _on_all_serving(self, method: str, model: str, *args: Any) -> None:
        self.catalog.slot(model, None)
        links = {link for cfg in self.config.models if cfg.name == model
                 for link in self._links_of[(cfg.name, str(cfg.version))]}
        await asyncio.gather(*(link.call(method, model, *args, timeout_s=None) for link in links))

    async def shm_register(self, kind: str, name: str, **params: Any) -> None:
        """Register a region in every running engine process, one front end at a time (:class:`RegistryLock`),
        remembered as registered through this front end (what :meth:`_restore_regions` says a restart lost). All
        or nothing: where one engine process refuses, those that took it unregister it again, and the first
        refusal is raised (as :meth:`__getattr__`'s methods)."""
        async with self._registry_lock.held():
            up = self._up()
            answers = await asyncio.gather(*(link.call("shm_register", kind, name, **params) for link in up),
                                           return_exceptions=True)
            failed = [a for a in answers if isinstance(a, BaseException)]
            if failed:
                took = [link for link, a in zip(up, answers) if not isinstance(a, BaseException)]
                await asyncio.gather(*(link.call("shm_unregister", kind, name) for link in took),
                                     return_exceptions=True)
                raise failed[0]
        self._registered_here.add((kind, name))

    async def shm_unregister(self, kind: str, name: str | None = None) -> None:
        """Unregister ``name`` (every region of ``kind`` when None) in every running engine process, one front end
        at a time (:class:`RegistryLock`)."""
        async with self._registry_lock.held():
            await self._everywhere("shm_unregister", kind, name)
        self._registered_here = {(k, n) for k, n in self._registered_here if k != kind or name not in (None, n)}

    def _up(self) -> list[EngineLink]:
        """The engine processes running. Raises Unavailable: none is."""
        up = [link for link in self.links if link.connected]
        if not up:
            raise Unavailable("no engine process is running; they are being restarted", retry_after_s=1)
        return up

    async def _everywhere(self, method: str, *args: Any, **kwargs: Any) -> Any:
        answers = await asyncio.gather(*(link.call(method, *args, **kwargs) for link in self._up()))
        return answers[0]

    def __getattr__(self, method: str) -> Callable[..., Awaitable[Any]]:
        """Any other public data-plane method (e.g. the shared-memory extension's status): called in every engine
        process that is running (a request may go to any of them; one being restarted gets the regions of the
        others when it is back, :meth:`_restore_regions`); the first answer is returned.

        Raises:
            Unavailable: no engine process is running.
        """
        if method.startswith("_"):
            raise AttributeError(method)
        return partial(self._everywhere, method)


# ---------------------------------------------------------------------------------------------- merging answers
def _add(into: dict[str, Any], doc: dict[str, Any]) -> None:
    """Add the numbers of ``doc`` into ``into`` (nested dicts), in place."""
    for k, v in doc.items():
        if isinstance(v, dict):
            _add(into.setdefault(k, {}), v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            into[k] = into.get(k, 0) + v
        else:
            into.setdefault(k, v)


def merge_statistics(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Triton's statistics documents of several engine processes as one: counts and nanoseconds add up, per model
    version and per batch size; ``last_inference`` is the latest."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for doc in docs:
        for entry in doc["model_stats"]:
            key = (entry["name"], entry["version"])
            into = merged.get(key)
            if into is None:
                merged[key] = {**entry, "inference_stats": dict(entry["inference_stats"]),
                               "batch_stats": [dict(b) for b in entry["batch_stats"]]}
                continue
            last = max(into["last_inference"], entry["last_inference"])
            _add(into, {k: v for k, v in entry.items() if k not in ("batch_stats", "name", "version")})
            into["last_inference"] = last
            sizes = {b["batch_size"]: b for b in into["batch_stats"]}
            for b in entry["batch_stats"]:
                if b["batch_size"] in sizes:
                    _add(sizes[b["batch_size"]], {k: v for k, v in b.items() if k != "batch_size"})
                else:
                    into["batch_stats"].append(dict(b))
            into["batch_stats"].sort(key=lambda b: b["batch_size"])
    return {"model_stats": list(merged.values())}


def merge_index(models: list[ModelConfig], docs: list[tuple[set[tuple[str, str]], list[dict[str, Any]]]]
                ) -> list[dict[str, Any]]:
    """The repository index of several engine processes (each with the versions it serves) as one, in config
    order: a version is READY when every engine process serving it has it READY (else the first other state and
    its reason); memory figures add up and worker pids are listed together. A version no engine process serves
    (the version policy) shows as any engine process that has its model reports it."""
    out = []
    for m in models:
        key = (m.name, str(m.version))
        entries = [(key in served, e) for served, doc in docs for e in doc if (e["name"], e["version"]) == key]
        parts = [e for serving, e in entries if serving] or [e for _, e in entries[:1]]
        if not parts:
            continue
        entry = dict(next((e for e in parts if e["state"] != "READY"), parts[0]))
        for field in ("measured_bytes", "footprint_bytes"):
            if all(field in e for e in parts):
                entry[field] = sum(e[field] for e in parts)
        pids = [p for e in parts for p in e.get("worker_pids", ())]
        if pids:
            entry["worker_pids"] = pids
        out.append(entry)
    return out


# ---------------------------------------------------------------------------------------------- process entry
def frontend_main(config: Config, index: int, paths: dict[Engine, str], host: str, port: int, access_log: bool,
                  log_level: str, engine_beats: dict[Engine, Any], heartbeat: Any, ready: Any) -> None:
    """A front-end process (``multiprocessing`` spawn target): the HTTP app on ``host:port`` with
    ``SO_REUSEPORT``, until SIGTERM (drain, then exit) or SIGINT. ``ready`` gets ``("ready", pid)`` once it
    listens; ``heartbeat`` (:class:`batcher.heartbeat.Heartbeat`) beats while the app runs; ``engine_beats``: the
    engine processes' heartbeats (:meth:`EngineLink.responsive`)."""
    import os

    from aiohttp import web

    from .app import create_app
    from .heartbeat import beat_ctx
    from .supervisor import child_setup, freeze_on_startup, new_event_loop

    child_setup(f"frontend {index}", log_level, config.server.keep_heap)
    app = create_app(config, remote=lambda metrics: RemoteDataPlane(config, metrics, paths, engine_beats))
    app.on_startup.append(freeze_on_startup)
    app.cleanup_ctx.append(beat_ctx(heartbeat))
    web.run_app(
        app, host=host, port=port, reuse_port=True, backlog=config.server.listen_backlog,
        loop=new_event_loop(config.server.event_loop),
        access_log=logging.getLogger("aiohttp.access") if access_log else None,
        print=lambda _msg: ready.send(("ready", os.getpid())),
        handle_signals=True, handler_cancellation=True, shutdown_timeout=config.server.shutdown_grace_s,
    )
