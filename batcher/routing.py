"""Routing a request to the model version that will run it, and pinning that version while it runs.

:meth:`Router.acquire` finds the slot ready - loading it first under ``lazy``/``lru`` (``on_cold: wait`` waits
within the request's deadline, ``reject`` answers 503 while the load runs, and what the load would answer when the
memory budget cannot hold the model) - or goes to the model's ``fallback``
when the model is unavailable or its queue holds ``fallback_queue_depth`` requests. A pinned slot (requests
between :meth:`~Router.acquire` and :meth:`~Router.release`, or waiting for its load) is never evicted.
"""

from __future__ import annotations

import asyncio
import logging
import math

from .errors import ConfigError, DeadlineExceeded, Unavailable
from .repository import ModelRepository
from .slots import LOAD_RETRY_S, NOT_LOADED_RETRY_S, READY, UNAVAILABLE, UNLOADING, ModelSlot
from .strategy import Strategy, Target
from .topology import weight

log = logging.getLogger(__name__)


class Router:
    """Acquire and release model versions of one :class:`~batcher.repository.ModelRepository`."""

    def __init__(self, repository: ModelRepository, strategy: Strategy | None = None) -> None:
        self.repository = repository
        self.strategy = strategy or Strategy()

    def choose_version(self, target: ModelSlot, key: str | None) -> ModelSlot:
        """A request that named no version: ``routing.strategy`` weighted or hash may send it to any served version
        of the model (:mod:`batcher.strategy`, weights from :func:`batcher.topology.weight`), least_queue to the
        default one (``target``). ``key``: the request's hash key."""
        if not self.strategy.spreads(key):
            return target
        slots = [self.repository.slots[target.name][v] for v in self.repository.served_versions(target.name)]
        if len(slots) < 2:
            return target
        targets = [Target(f"{s.name}/{s.version}", weight(s.cfg), s.runner.queue_depth if s.runner else 0)
                   for s in slots]
        return slots[self.strategy.choose(target.name, targets, key)]

    async def acquire(self, slot: ModelSlot, deadline: float | None = None, *, allow_fallback: bool = True
                      ) -> ModelSlot:
        """Pin the model a request for ``slot`` will run on; pair every call with :meth:`release`.

        Args:
            deadline: event-loop time by which a load waited for must be done.

        Raises:
            Unavailable: 503 + Retry-After - loading under ``on_cold: reject``, no room in the memory budget (now:
                the same answer under ``reject`` as under ``wait``; or ever, larger than the whole budget: Retry-After
                :data:`~batcher.repository.NOT_LOADED_RETRY_S`, no load tried), unloaded, load failed, shutting
                down. DeadlineExceeded: 504 - the load outlasted the deadline.
        """
        cfg = slot.cfg
        if self.pin_ready(slot):  # the common case, without another coroutine
            return slot
        if allow_fallback and cfg.fallback is not None:
            fallback = self.repository.slot(cfg.fallback)
            depth = slot.runner.queue_depth if slot.runner is not None else 0
            if cfg.fallback_queue_depth is not None and depth >= cfg.fallback_queue_depth:
                return await self.acquire(fallback, deadline, allow_fallback=False)
            try:
                return await self._ready(slot, deadline)
            except Unavailable as exc:
                log.debug("model %s unavailable (%s), routing to fallback %s", slot.name, exc.message, cfg.fallback)
                try:
                    return await self.acquire(fallback, deadline, allow_fallback=False)
                except Unavailable as fallback_exc:  # the answer names the model asked for, then its fallback
                    retry = [s for s in (exc.retry_after_s, fallback_exc.retry_after_s) if s is not None]
                    raise Unavailable(f"{exc.message}; its fallback: {fallback_exc.message}",
                                      retry_after_s=min(retry) if retry else None) from None
        return await self._ready(slot, deadline)

    def pin_ready(self, slot: ModelSlot) -> bool:
        """:meth:`acquire` where it needs no wait: pins ``slot`` and returns True when it is READY and has no
        fallback (pair with :meth:`release`); False, and nothing pinned, otherwise."""
        if slot.state == READY and slot.cfg.fallback is None:
            slot.inflight += 1
            slot.last_used = asyncio.get_running_loop().time()
            return True
        return False

    async def _ready(self, slot: ModelSlot, deadline: float | None) -> ModelSlot:
        repo = self.repository
        loop = asyncio.get_running_loop()
        while True:
            if slot.state == READY:
                slot.inflight += 1
                slot.last_used = loop.time()
                return slot
            if repo.closed:
                raise Unavailable("server is shutting down")
            if slot.state == UNLOADING and slot.task is not None:
                await asyncio.shield(slot.task)
                continue
            if slot.state == UNAVAILABLE:
                if repo.strategy == "eager" or slot.sticky_unloaded:
                    raise Unavailable(f"model '{slot.name}' version {slot.version} is not loaded: {slot.reason}",
                                      retry_after_s=NOT_LOADED_RETRY_S)
                wait = slot.failed_at + LOAD_RETRY_S - loop.time() if slot.failed else 0.0
                if wait > 0:  # failed a moment ago: not retried for every request (LOAD_RETRY_S)
                    raise Unavailable(f"model '{slot.name}' version {slot.version} is not available: {slot.reason}",
                                      retry_after_s=math.ceil(wait))
                if repo.config.server.on_cold == "reject":
                    repo.admit(slot)  # a load that cannot fit the budget is answered as under wait, not "loading"
                repo.start_load(slot)  # Unavailable, no load, for a model larger than the whole budget
            task = slot.task
            if task is None:  # finished between the checks
                continue
            if repo.config.server.on_cold == "reject":
                raise Unavailable(f"model '{slot.name}' is loading; try again shortly", retry_after_s=1)
            slot.waiting += 1
            try:
                await asyncio.wait_for(asyncio.shield(task), None if deadline is None else deadline - loop.time())
            except asyncio.TimeoutError:
                raise DeadlineExceeded(f"model '{slot.name}': deadline expired while the model was loading") from None
            except ConfigError as exc:  # its message names the model: "models[i]: model 'm' failed to load: ..."
                raise Unavailable(str(exc), retry_after_s=5) from None
            finally:
                slot.waiting -= 1
            if slot.state != READY:
                raise Unavailable(f"model '{slot.name}' version {slot.version} is not available: {slot.reason}",
                                  retry_after_s=5)

    def release(self, slot: ModelSlot) -> None:
        """Unpin a model acquired with :meth:`acquire`."""
        slot.inflight -= 1
        slot.last_used = asyncio.get_running_loop().time()
