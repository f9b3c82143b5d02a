"""Which process serves what: the serving mode, the engine processes and the queues a request may go to.

Pure functions of the config, the same in every process of a server (the supervisor, each engine process and each
front end compute the same answers).

* Single-process mode (``server.frontends: 0``): one process does HTTP and runs every model; each model version
  has one queue.
* Multi-process mode (``server.frontends: N``, N >= 1): N front-end processes do HTTP, decoding and encoding; one
  **engine process per GPU** that the config uses (``CUDA_VISIBLE_DEVICES`` pins it), plus one for the KIND_CPU
  models if any, owns the queues, batchers and execution contexts placed on its device. A model version placed
  on two GPUs (``instance_group: [{gpus: [0, 1]}]``, Triton's meaning: ``count`` contexts on each) has one queue
  per GPU, each in its own engine process.
* ``server.engine_processes: per_model``: one engine process per model name on each of its devices instead (an
  :class:`Engine` names a device and, here, a model), as Ray Serve runs a replica per deployment. Models then do
  not share a GIL, an event loop or a crash: two resnet18 served together on an H200 kept 0.73-0.82 of their
  throughput alone, 0.77-0.97 under MPS (``server.cuda_mps``), against 0.51-0.62 in one engine process
  (``bench.gpu_scale`` part t); each process costs its own CUDA context and its own shared areas with every
  front end.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import NamedTuple

from .config import Config, ModelConfig

#: front ends of the default (``frontends: null``) at most.
MAX_DEFAULT_FRONTENDS = 8


def cpu_quota_cores(root: str | os.PathLike = "/sys/fs/cgroup") -> float | None:
    """The CPU time this process's cgroup may use, in cores (its CFS quota over its period), or None without one.

    What a container's CPU limit sets (Kubernetes ``resources.limits.cpu``, ``docker run --cpus``): the CPU
    affinity still lists every core of the node. Read as a container sees its own cgroup: cgroup v2's
    ``cpu.max`` (``"200000 100000"``; ``"max ..."`` is none), else cgroup v1's ``cpu.cfs_quota_us`` and
    ``cpu.cfs_period_us`` (quota -1 is none) under ``cpu/`` or ``cpu,cpuacct/``."""
    root = Path(root)
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for folder in ("cpu", "cpu,cpuacct"):
        try:
            quota = int((root / folder / "cpu.cfs_quota_us").read_text())
            period = int((root / folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 or period <= 0 else quota / period
    return None


def usable_cores(cgroup_root: str | os.PathLike = "/sys/fs/cgroup") -> int:
    """Cores this process may use, at least 1: its CPU affinity (a cpuset, ``taskset``), and no more than its
    cgroup's CPU quota rounded up (:func:`cpu_quota_cores`: a container's CPU limit, which the affinity does not
    show: a pod limited to 2 CPUs on a 64-core node would otherwise start 8 front ends)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cpu_quota_cores(cgroup_root)
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def default_frontends(cores: int) -> int:
    """``server.frontends: null``: 0 (single-process mode) on 2 cores or fewer, where one process does better
    (README, "Serving modes": a second process only adds a hop on a busy machine), else the cores, at most
    :data:`MAX_DEFAULT_FRONTENDS`."""
    return 0 if cores <= 2 else min(cores, MAX_DEFAULT_FRONTENDS)


def frontends(config: Config, cores: int | None = None) -> int:
    """The number of front-end processes ``config`` asks for (0: single-process mode)."""
    n = config.server.frontends
    return default_frontends(usable_cores() if cores is None else cores) if n is None else n


def model_devices(cfg: ModelConfig) -> list[int | None]:
    """The devices of a model version's execution contexts, in order of first use: its GPUs, or ``[None]``."""
    if cfg.device != "cuda":
        return [None]
    return list(dict.fromkeys(cfg.placements))


def engine_devices(config: Config) -> list[int | None]:
    """The engine processes of multi-process mode, one per device: the GPUs in increasing order, then None (the
    CPU) if a model runs on the CPU."""
    devices = {d for m in config.models for d in model_devices(m)}
    return sorted(d for d in devices if d is not None) + ([None] if None in devices else [])


class Engine(NamedTuple):
    """An engine process of multi-process mode: its device (a GPU, or None: the CPU) and, under
    ``engine_processes: per_model``, the one model it serves (None: every model placed on the device)."""

    device: int | None
    model: str | None = None

    @property
    def name(self) -> str:
        """How logs, process names and routing targets call it: ``gpu0``, ``cpu``, ``gpu0:resnet18``."""
        return device_name(self.device) + (f":{self.model}" if self.model is not None else "")

    def serves(self, cfg: ModelConfig) -> bool:
        """Whether this engine process serves (some contexts of) the model version ``cfg``."""
        return self.device in model_devices(cfg) and self.model in (None, cfg.name)


def engines(config: Config) -> list[Engine]:
    """The engine processes of multi-process mode: per device (:func:`engine_devices` order); under
    ``engine_processes: per_model``, per device one for each model placed there, in config order."""
    if config.server.engine_processes == "per_device":
        return [Engine(d) for d in engine_devices(config)]
    return [Engine(d, name) for d in engine_devices(config)
            for name in dict.fromkeys(m.name for m in config.models if d in model_devices(m))]


def model_engines(config: Config, cfg: ModelConfig) -> list[Engine]:
    """The engine processes serving the model version ``cfg``, in :func:`engines` order (one per device)."""
    return [e for e in engines(config) if e.serves(cfg)]


def uses_gpu(config: Config) -> bool:
    """Whether a model of ``config`` runs on a GPU."""
    return any(d is not None for m in config.models for d in model_devices(m))


def device_name(device: int | None) -> str:
    return "cpu" if device is None else f"gpu{device}"


def selected_versions(cfgs: list[ModelConfig]) -> set[int]:
    """The versions of one model name that its ``version_policy`` (read from its highest version) serves."""
    policy = max(cfgs, key=lambda c: c.version).version_policy
    versions = sorted(c.version for c in cfgs)
    if policy == "all":
        return set(versions)
    if hasattr(policy, "latest"):
        return set(versions[-policy.latest:])
    return set(policy.specific) & set(versions)


def engine_config(config: Config, engine: Engine) -> Config:
    """The config of the engine process ``engine``: every version of each model with a version it serves (so the
    version policy reads as configured), entries unchanged (metadata and ``/config`` show every
    instance group); it serves the versions :func:`placed_on` names and creates the contexts :func:`contexts_on`
    counts. A ``fallback`` to a model the engine process does not have is dropped (a fallback works within one
    engine process)."""
    names = {m.name for m in config.models if engine.serves(m)}
    models = [m if m.fallback is None or m.fallback in names else m.model_copy(
        update={"fallback": None, "fallback_queue_depth": None}) for m in config.models if m.name in names]
    return config.model_copy(update={"models": models})


def placed_on(engine: Engine):
    """Whether ``engine`` serves a model version (the repository's ``serves`` in an engine process)."""
    return engine.serves


def engine_slots(config: Config, engine: Engine) -> list[tuple[str, str]]:
    """(name, version) of the model versions the engine process ``engine`` serves (selected and placed there),
    in config order: the order of its status area, which front ends read."""
    by_name: dict[str, list[ModelConfig]] = {}
    for m in config.models:
        by_name.setdefault(m.name, []).append(m)
    return [(m.name, str(m.version)) for m in config.models
            if engine.serves(m) and m.version in selected_versions(by_name[m.name])]


def contexts_on(cfg: ModelConfig, device: int | None) -> int:
    """How many execution contexts of ``cfg`` run on ``device``."""
    if device is None:
        return cfg.instances if cfg.device != "cuda" else 0
    return sum(1 for d in cfg.placements if d == device) if cfg.device == "cuda" else 0


def weight(cfg: ModelConfig, device: int | None = None) -> float:
    """``routing.strategy: weighted``: the share of a model version on ``device`` (the sum of the ``weight`` of its
    instance groups there, default 1 each); ``device`` None on a GPU model: on all its GPUs."""
    total = 0.0
    for g in cfg.instance_group:
        w = g.weight
        if cfg.device != "cuda":
            total += w
        else:
            gpus = g.gpus or [0]
            total += w * (len(gpus) if device is None else gpus.count(device))
    return total


def single_process_problem(config: Config) -> str | None:
    """Why ``config`` cannot run in single-process mode, or None: a model placed on several GPUs needs one engine
    process per GPU; ``engine_processes: per_model`` and ``cuda_mps`` are about engine processes."""
    for i, m in enumerate(config.models):
        if len(model_devices(m)) > 1:
            return (f"models[{i}] ({m.name}) is placed on GPUs {model_devices(m)}: serving a model on several GPUs "
                    "needs multi-process mode (server.frontends >= 1: one engine process per GPU)")
    for key, value, default in (("engine_processes", config.server.engine_processes, "per_device"),
                                ("cuda_mps", config.server.cuda_mps, False)):
        if value != default:
            return (f"server.{key}: {str(value).lower()} applies to the engine processes of multi-process mode "
                    "(server.frontends >= 1); single-process mode has none")
    return None


class DeviceOrder:
    """How the engine process of GPU ``device`` sees the GPUs: ``CUDA_VISIBLE_DEVICES`` lists that GPU first (so
    every backend's device 0 is the one it serves: the process is pinned to it) and the others after it (so a
    client's CUDA shared-memory region on another GPU can still be opened). ``local``/``client`` translate device
    ids between the numbering clients and the config use (the server's, ``parent``: its own
    ``CUDA_VISIBLE_DEVICES`` or, unset, GPUs ``0..max(gpus)``) and the engine process's.

    Args:
        device: the engine's GPU, or None (the CPU engine: nothing changes).
        gpus: the GPUs the config uses.
        parent: the server's ``CUDA_VISIBLE_DEVICES``, if set.
    """

    def __init__(self, device: int | None, gpus: list[int], parent: str | None = None) -> None:
        self.entries = [e.strip() for e in parent.split(",")] if parent else [str(i) for i in range(max(gpus) + 1)]
        if device is None or device >= len(self.entries):
            self.order = list(self.entries)
        else:
            self.order = [self.entries[device]] + [e for i, e in enumerate(self.entries) if i != device]
        self.pinned = device is not None and device < len(self.entries)

    @property
    def visible(self) -> str:
        """This engine process's ``CUDA_VISIBLE_DEVICES``."""
        return ",".join(self.order)

    def local(self, client: int) -> int:
        """The engine process's id of the client's device ``client`` (unknown ids unchanged)."""
        return self.order.index(self.entries[client]) if 0 <= client < len(self.entries) else client

    def client(self, local: int) -> int:
        """The client's id of the engine process's device ``local``."""
        return self.entries.index(self.order[local]) if 0 <= local < len(self.order) else local
