"""The engine process's entry (multi-process mode): load the models of one :class:`batcher.topology.Engine`, serve
front ends (:class:`batcher.engine_proc.EngineServer`) until a signal, release the models.

SIGTERM to an engine process drains it as SIGTERM drains a server (``server.shutdown_grace_s``): its front ends
are told (:meth:`batcher.engine_proc.EngineServer.drain`: they route nothing new to it and report not ready), a
request that still arrives gets 503 (counted ``rejected`` here), accepted ones are answered, what is still queued when the grace is over gets 503,
and the answers sent are acknowledged before it closes its connections. What it still holds then (a batch
running past the grace) its front ends answer 503 and count (:class:`batcher.remote.EngineLost`), so it does not
(:data:`batcher.outcomes.ENGINE_STOPPING`). SIGINT closes at once. The supervisor starts it again (the whole
server's SIGTERM stops the front ends first, so its engine processes have nothing left to drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Any

from .config import Config
from .dataplane import DataPlane
from .engine_proc import EngineServer
from .heartbeat import beat
from .loader import load_model
from .metrics import Metrics
from .repository import ModelRepository
from .topology import DeviceOrder, Engine, contexts_on, engine_config, engine_devices, engine_slots, placed_on

log = logging.getLogger(__name__)

#: SIGTERM's drain waits at most this long, after its grace, for the front ends to acknowledge the answers sent
ACK_WAIT_S = 2.0


def engine_loader(device: int | None):
    """The repository's loader in the engine process of ``device``: only the contexts placed there."""

    def load(cfg, where, on_restart=None):
        return load_model(cfg, where, on_restart, instances=contexts_on(cfg, device))

    return load


async def run_engine(config: Config, engine: Engine, path: str, ready: Any, devices: DeviceOrder,
                     heartbeat: Any = None) -> int:
    """Load the models of ``engine``, serve front ends until SIGTERM/SIGINT, release the models. Returns the exit
    code (2: a model failed to load). ``ready`` (a ``multiprocessing`` connection) gets ``("ready", pid)`` or
    ``("error", message)``; ``heartbeat`` (a :class:`batcher.heartbeat.Heartbeat`) beats from before the
    models load until the end."""
    beating = asyncio.get_running_loop().create_task(beat(heartbeat)) if heartbeat is not None else None
    try:
        return await _serve(config, engine, path, ready, devices)
    finally:
        if beating is not None:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating


async def _serve(config: Config, engine: Engine, path: str, ready: Any, devices: DeviceOrder) -> int:
    from .errors import ConfigError
    from .supervisor import freeze_heap

    cfg = engine_config(config, engine)
    metrics = Metrics()
    repository = ModelRepository(cfg, metrics, loader=engine_loader(engine.device), serves=placed_on(engine))
    dataplane = DataPlane(cfg, metrics, repository, deliver_checks_deadline=True)
    dataplane.stopping_message = f"the engine process for {engine.name} is shutting down; it will be restarted"
    try:
        await dataplane.start()
    except ConfigError as exc:
        log.error("%s", exc)
        ready.send(("error", str(exc)))
        return 2
    server = EngineServer(dataplane, engine.device, path, config.server.frontend_buffer_mb << 20,
                          engine_slots(config, engine), devices)
    await server.start()
    freeze_heap()
    stop, now = asyncio.Event(), asyncio.Event()  # SIGTERM: drain first; SIGINT: close at once
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: (stop.set(), now.set()))
    log.info("engine process for %s: %d model version(s) ready", engine.name, len(server.slot_index))
    ready.send(("ready", os.getpid()))
    await stop.wait()
    if not now.is_set():  # the drain (module docstring), cut short by a SIGINT
        draining, interrupted = loop.create_task(_drain(dataplane, server, config.server.shutdown_grace_s)), \
            loop.create_task(now.wait())
        await asyncio.wait([draining, interrupted], return_when=asyncio.FIRST_COMPLETED)
        for task in (draining, interrupted):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    await server.close()
    await dataplane.close()
    return 0


async def _drain(dataplane: DataPlane, server: EngineServer, grace_s: float) -> None:
    """SIGTERM's drain: new requests 503, accepted ones answered within ``grace_s``; then what is still queued gets
    503 (counted here), and the answers sent are acknowledged (at most :data:`ACK_WAIT_S`), so that they are
    counted here before the connections close."""
    server.drain()
    await dataplane.drain(grace_s)
    if dataplane.shed():
        await asyncio.sleep(0)  # their ERROR messages go out with this loop iteration
    await server.acknowledged(ACK_WAIT_S)


def engine_main(config: Config, engine: Engine, path: str, log_level: str, heartbeat: Any, ready: Any) -> None:
    """The engine process (``multiprocessing`` spawn target): pins its device first (``CUDA_VISIBLE_DEVICES``
    lists it first, :class:`batcher.topology.DeviceOrder`)."""
    from .supervisor import child_setup, run, set_device_options, set_switch_interval

    gpus = [d for d in engine_devices(config) if d is not None]
    devices = DeviceOrder(engine.device, gpus or [0], os.environ.get("CUDA_VISIBLE_DEVICES"))
    if devices.pinned:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices.visible
    child_setup(f"engine {engine.name}", log_level, config.server.keep_heap)
    set_switch_interval(config.server.gil_switch_interval_us)
    set_device_options(config.server)
    sys.exit(run(run_engine(config, engine, path, ready, devices, heartbeat), config.server.event_loop))
