"""Every configured model version (:class:`ModelSlot`), by name and version (:class:`ModelSlots`): Triton's model
states, the version a request goes to (``version_policy``, ``routing.version_mismatch``), the repository index, and
what a model counts against the memory budget before and after its load. :class:`batcher.repository.ModelRepository`
loads and unloads them; a front end of multi-process mode uses :class:`ModelSlots` alone, for its 404s."""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from engines.zoo import ZooError, resolve

from .config import Config, ModelConfig
from .errors import ModelNotFound
from .stats import Stats
from .topology import selected_versions

if TYPE_CHECKING:
    from .loader import Loaded
    from .scheduler import ModelRunner

MiB = 1 << 20

#: Seconds after a failed load before a request may start another one (lazy/lru; the repository API's load always
#: tries): a client cannot make the server retry a broken model, and log its failure, once per request.
LOAD_RETRY_S = 5.0

#: ``Retry-After`` of the answers for a model that is not loaded and that no request can load now: unloaded through
#: the repository API, failed under ``eager``, or larger than the whole memory budget.
NOT_LOADED_RETRY_S = math.ceil(LOAD_RETRY_S)

#: Triton's model states (repository extension).
READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"
#: the reason of a version the version policy serves and that has not been loaded yet
NOT_LOADED = "not loaded"


class ModelSlot:
    """One configured model version: its state, what serves it while loaded, its statistics and memory figures."""

    def __init__(self, cfg: ModelConfig, where: str, selected: bool) -> None:
        self.cfg = cfg
        self.where = where  # its place in the config, for messages
        self.name = cfg.name
        self.version = str(cfg.version)
        self.selected = selected  # chosen by the name's version policy
        self.state = UNAVAILABLE
        self.reason = NOT_LOADED if selected else "not selected by the version policy"
        self.failed: str | None = None  # why the last load failed, while that stands
        self.failed_at: float | None = None  # event-loop time of that failure
        self.loaded: Loaded | None = None
        self.runner: ModelRunner | None = None  # attached by a load hook
        self.stats = Stats()  # Triton's statistics over every load of this slot
        self.inflight = 0  # requests between acquire and release: a pinned model is never evicted
        self.waiting = 0  # requests waiting for this model's load: it is pinned for them too
        self.last_used = 0.0
        self.task: asyncio.Future | None = None  # the load or unload in progress
        self.measured_bytes: int | None = None  # growth measured at the first load (at least the weights)
        self.footprint_bytes: int | None = None  # engine + contexts as the backend reports them
        self.device_bytes = 0  # device memory of the loaded engine and contexts (graphs, workspaces); 0 on CPU
        self.sticky_unloaded = False  # unloaded through the repository API: only an explicit load brings it back
        self.last_signature = None  # what its last load served (kept after an unload)

    @property
    def signature(self):
        return self.loaded.signature if self.loaded is not None else None

    @property
    def loaded_or_unloading(self) -> bool:
        return self.state in (READY, UNLOADING)

    @property
    def pinned(self) -> bool:
        return bool(self.inflight or self.waiting or (self.runner is not None and self.runner.queue_depth))

    @property
    def budget_bytes(self) -> int:
        """What this model counts against the memory budget: measured at load, else the pre-load estimate."""
        if self.measured_bytes is not None:
            return self.measured_bytes
        return self.estimate(self.cfg)

    @staticmethod
    def estimate(cfg: ModelConfig) -> int:
        """Bytes a model of ``cfg`` counts before its load is measured: ``memory_mb``, else the seed's formula on
        its file, ``(1 + 2 x instances) x file size + 32 MB``."""
        if cfg.memory_mb is not None:
            return int(cfg.memory_mb * MiB)
        try:
            size = resolve(cfg.path).stat().st_size
        except (ZooError, OSError):
            size = 0
        return (1 + 2 * cfg.instances) * size + 32 * MiB


def pick_version(name: str, version: str | None, served: list[str], mismatch: str) -> str:
    """The version a request for ``name``/``version`` goes to, of the ``served`` ones (lowest first): the one it
    names, else (none named, or ``routing.version_mismatch: fallback``) the highest.

    Raises:
        ModelNotFound: a version that is not served under ``version_mismatch: reject``, or none served.
    """
    if version is not None:
        if version in served:
            return version
        if mismatch == "reject" or not served:
            raise ModelNotFound(f"model '{name}' has no version '{version}'; versions: {served}")
    if not served:
        raise ModelNotFound(f"model '{name}' has no served version (version policy)")
    return served[-1]


class ModelSlots:
    """Every configured model version (:class:`ModelSlot`) by name and version, the lookup a request goes
    through, and the repository index."""

    def __init__(self, config: Config, serves: Callable[[ModelConfig], bool] | None = None) -> None:
        """``serves``: which selected versions this process serves (an engine process of multi-process mode: those
        placed on its device); the others are treated as not selected here."""
        self.config = config
        by_name: dict[str, list[ModelConfig]] = collections.defaultdict(list)
        for cfg in config.models:
            by_name[cfg.name].append(cfg)
        self.slots: dict[str, dict[str, ModelSlot]] = {}
        for i, cfg in enumerate(config.models):
            selected = cfg.version in selected_versions(by_name[cfg.name]) and (serves is None or serves(cfg))
            # every version's config carries the model's version_policy (read from its highest version): what its
            # GET config shows and what a load's config is checked against, as Triton's versions share one config
            policy = max(by_name[cfg.name], key=lambda c: c.version).version_policy
            if cfg.version_policy != policy:
                cfg = cfg.model_copy(update={"version_policy": policy})
            self.slots.setdefault(cfg.name, {})[str(cfg.version)] = ModelSlot(cfg, f"models[{i}]", selected)
        self._served = {name: sorted((v for v, s in versions.items() if s.selected), key=int)
                        for name, versions in self.slots.items()}

    def all(self) -> list[ModelSlot]:
        return [s for versions in self.slots.values() for s in versions.values()]

    # ---------------------------------------------------------------- lookup and routing
    def slot(self, name: str, version: str | None = None) -> ModelSlot:
        """The slot a request for ``name``/``version`` goes to (``routing.version_mismatch`` applies).

        Raises:
            ModelNotFound: unknown model (404), or a version that is not served under ``version_mismatch: reject``.
        """
        if not self.slots.get(name):
            raise ModelNotFound(f"unknown model '{name}'; models: {sorted(self.slots)}")
        return self.slots[name][pick_version(name, version, self.served_versions(name),
                                             self.config.routing.version_mismatch)]

    def served_versions(self, name: str) -> list[str]:
        """The versions of ``name`` its version policy serves, lowest first (fixed once configured)."""
        return self._served[name]

    def reason(self, slot: ModelSlot) -> str:
        """The reason the index gives for ``slot``'s state (its own; :class:`batcher.repository.ModelRepository`
        adds what it knows before any request)."""
        return slot.reason

    def index(self, ready: bool | None = None) -> list[dict]:
        """The repository index (Triton's form): every configured version with its state and reason; with
        ``ready`` true only the READY ones (Triton's ``ready`` filter), false only the others."""
        out = []
        for s in self.all():
            if ready is not None and (s.state == READY) != ready:
                continue
            entry = {"name": s.name, "version": s.version, "state": s.state, "reason": self.reason(s)}
            pids = [getattr(c, "pid", None) for c in (s.loaded.contexts if s.loaded else ())]
            if any(pids):
                entry["worker_pids"] = pids
            if s.measured_bytes is not None:
                entry["measured_bytes"] = s.measured_bytes
                entry["footprint_bytes"] = s.footprint_bytes
            if s.device_bytes:  # on GPU: engine and contexts' device memory, CUDA graphs and workspaces included
                entry["device_bytes"] = s.device_bytes
            out.append(entry)
        return out
