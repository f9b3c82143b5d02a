"""Server configuration: YAML validated at load by pydantic; a bad value is reported with its path and value.

A model's entry (:class:`ModelConfig`, Triton's ``model_config.proto`` names, microseconds, old keys named) is
:mod:`batcher.model_config`'s; this module re-exports its names, holds the server-wide side (``server``,
``routing``) and loads a file. :mod:`batcher.triton_config` turns a model's config into Triton's model-config JSON.

Example (``configs/default.yaml`` is the full one)::

    server: {host: 127.0.0.1, port: 8000}
    models:
      - name: ppocr_rec
        path: zoo:ppocr_rec
        max_batch_size: 16
        instance_group: [{count: 1, kind: KIND_CPU}]
        inputs: [{name: x, dims: [3, 48, -1]}]
        dynamic_batching:
          max_queue_delay_microseconds: 2000
          default_queue_policy: {max_queue_size: 256, default_timeout_microseconds: 1000000}
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from .errors import ConfigError
from .model_config import (MOVED_KEYS, DynamicBatching, InputConfig, InstanceGroup, LatestPolicy, ModelConfig,
                           ProfileShapesConfig, QueuePolicy, SpecificPolicy, TensorRTBuildConfig, _Strict)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_INFLIGHT_BODY_BYTES", "MOVED_KEYS", "Config", "DynamicBatching",
    "InputConfig", "InstanceGroup", "LatestPolicy", "ModelConfig", "ProfileShapesConfig", "QueuePolicy",
    "RoutingConfig", "ServerConfig", "SharedMemoryConfig", "SpecificPolicy", "TensorRTBuildConfig",
    "default_config_text", "load_config", "parse_config", "with_paths_relative_to",
]

#: body limit default: a batch-32 224x224 FP32 request is 19.3 MB in binary and ~80-100 MB as JSON text.
DEFAULT_MAX_BODY_BYTES = 128 * 1024 * 1024
#: budget of request bodies in memory at once, per process: 8 bodies of the default limit (or max_body_bytes, if more)
DEFAULT_MAX_INFLIGHT_BODY_BYTES = 1024 * 1024 * 1024


class SharedMemoryConfig(_Strict):
    """Triton's shared-memory extensions for clients on the same host (Triton's ``--allow-client-shm``): off by
    default. A client that may register a region can read and write any POSIX shared-memory segment (system) or
    CUDA allocation it holds a handle to (cuda) that the server's user can open: enable them for trusted local
    clients only.

    Attributes:
        system: ``v2/systemsharedmemory/...`` and tensors in POSIX shared memory (``shm_open`` keys).
        cuda: ``v2/cudasharedmemory/...`` and tensors in another process's GPU memory (``cudaIpcOpenMemHandle``);
            registering needs a usable CUDA device.
    """

    system: bool = False
    cuda: bool = False


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    #: the listening socket's accept queue (``listen(2)``'s backlog; the kernel caps it at
    #: ``net.core.somaxconn``), per process that listens: each front end in multi-process mode. aiohttp's 128
    #: overflowed when 512 clients connected at once to one front end on the H200 (``bench.gpu_scale`` part n: 18-37
    #: transport errors a run; in a reproduction the kernel reset 103 connections, about 1 s after the start).
    listen_backlog: int = Field(1024, ge=1, le=65535)
    #: request bodies above this get 413.
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024)
    #: request bodies being read or held, summed over the process's requests, stay under this (batcher.bodies):
    #: a body that does not fit now gets 503 + Retry-After, unread. At least max_body_bytes; default 1 GiB, or
    #: max_body_bytes when that is more. Multi-process mode: per front-end process.
    max_inflight_body_bytes: int = Field(DEFAULT_MAX_INFLIGHT_BODY_BYTES, ge=1024)
    #: the most elements one input tensor may hold (400 beyond; 2**28 FP32 elements are 1 GiB).
    max_tensor_elements: int = Field(1 << 28, ge=1)
    #: a request body must arrive within this many seconds (slow or stalled uploads get 408).
    read_timeout_s: float = Field(30.0, gt=0)
    #: on SIGTERM/SIGINT the server stops accepting connections and lets accepted requests finish for at most
    #: this long before releasing the models.
    shutdown_grace_s: float = Field(30.0, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: eager: every model loaded and warmed before the server is ready; lazy: loaded on first use; lru: lazy, and
    #: least recently used idle models are unloaded so that the loaded ones fit memory_budget_mb.
    load_strategy: Literal["eager", "lazy", "lru"] = "eager"
    #: lru only: the memory the loaded models may take (MB = 2**20 bytes), counted per model as measured at load.
    memory_budget_mb: float | None = Field(None, gt=0)
    #: a request for a model that is not loaded: wait for the load within its deadline, or get 503 at once
    #: (the load starts either way).
    on_cold: Literal["wait", "reject"] = "wait"
    #: the KServe/Triton repository extension (/v2/repository/...): off unless enabled.
    repository_api: bool = False
    #: when set, repository requests need ``Authorization: Bearer <token>``.
    repository_token: str | None = None
    #: the token read from this file instead (its content, without surrounding whitespace; read once, when the
    #: config is loaded): a Kubernetes Secret mounted as a volume, rather than the token in a ConfigMap; relative
    #: to the config file.
    repository_token_file: str | None = None
    #: a directory in Triton's repository layout (``<model>/<version>/model.onnx``, KServe's /mnt/models): every
    #: model in it is served besides ``models`` (:mod:`batcher.model_repository`); relative to the config file.
    model_repository: str | None = None
    #: Triton's system and CUDA shared-memory extensions (:class:`SharedMemoryConfig`), off unless enabled.
    shared_memory: SharedMemoryConfig = SharedMemoryConfig()
    #: front-end processes before one engine process per GPU (batcher.topology); 0: single-process mode; null:
    #: the usable cores, at most 8, and 0 on 2 cores or fewer (README "Serving modes")
    frontends: int | None = Field(None, ge=0, le=64)
    #: per_device: one engine process per GPU (and one for KIND_CPU models); per_model: one per model name on each
    #: of its devices, so models share no GIL, event loop or crash (batcher.topology; README "Serving modes").
    #: Multi-process mode only.
    engine_processes: Literal["per_device", "per_model"] = "per_device"
    #: run the engine processes under NVIDIA MPS (a private control daemon the supervisor starts and stops, or the
    #: one CUDA_MPS_PIPE_DIRECTORY names), so engine processes sharing a GPU run side by side instead of taking
    #: turns (batcher.mps; with per_model, retention on an H200: 0.77-0.97 against 0.73-0.82 without MPS).
    #: Multi-process mode only.
    cuda_mps: bool = False
    #: MiB of shared memory per front end and engine process, for tensors of 64 KiB and more (batcher.ipc)
    frontend_buffer_mb: int = Field(64, ge=1, le=65536)
    #: a CPU context whose batches average at most this much CPU runs them on the event loop, not its thread
    #: (cheaper than the hand-off; batcher.executor); 0: always the thread
    inline_execution_us: int = Field(100, ge=0, le=10_000)
    #: every process's event loop; uvloop (extra "uvloop") costs less CPU, its timers tick in milliseconds
    event_loop: Literal["asyncio", "uvloop"] = "asyncio"
    #: ``sys.setswitchinterval`` of the processes that run executor threads (the single process, each engine
    #: process), in microseconds: how long a thread that wants the GIL back (an executor returning from CUDA or
    #: ONNX Runtime) waits before the busy event loop is made to drop it. 200 measured best on the H200
    #: (``bench.gpu_scale`` part s, 8 front ends: 0.76 and 0.87 of the raw engine at 200 against 0.70 at 5,000 and
    #: 0.81 at 1,000; README "Many front ends, shared memory, two GPUs"); null: Python's own (5,000)
    gil_switch_interval_us: int | None = Field(200, ge=10, le=100_000)
    #: GPU contexts (CUDA graphs) record a pair of CUDA timing events around every batch, the source of
    #: ``batcher_device_busy_seconds_total`` and ``batcher_device_idle_seconds`` (batcher.metrics); two event
    #: records and two elapsed-time reads per batch (``bench.gpu_scale`` part a measures batches with it off and on)
    device_timing: bool = True
    #: GPU contexts (CUDA graphs) wait for each batch by sleeping (``cudaEventBlockingSync``) instead of spinning a
    #: core until it ends, CUDA's default (``bench.gpu_scale --cuda-blocking-sync`` measures both; README "Many
    #: front ends, shared memory, two GPUs")
    cuda_blocking_sync: bool = False
    #: multi-process mode: front ends and engine processes keep freed memory for their next large request bodies
    #: (glibc's allocator: no fresh ``mmap`` per body, no trim after it; ``batcher.supervisor.keep_heap``). Measured
    #: by ``python -m bench.body_cpu`` on 2 cores: front-end CPU per 602 KB binary request 0.69 of what it is
    #: without (two runs), requests/s 1.20 and 1.08 times (bench/results/body_cpu)
    keep_heap: bool = True
    #: multi-process mode: a front end or engine process whose event loop has not run for this many seconds
    #: (SIGSTOP, a deadlock, a C call holding the GIL) is killed and restarted as if it had died
    #: (batcher.heartbeat), loading its models too; null: never. Raise it for models whose load holds the GIL
    #: longer. At least 3: processes beat every 0.5 s and the supervisor looks every 0.5-1 s.
    stall_timeout_s: float | None = Field(30.0, ge=3)

    @model_validator(mode="before")
    @classmethod
    def _inflight_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_inflight_body_bytes" not in data:
            limit = data.get("max_body_bytes")
            if isinstance(limit, int) and not isinstance(limit, bool) and limit > DEFAULT_MAX_INFLIGHT_BODY_BYTES:
                data = {**data, "max_inflight_body_bytes": limit}
        return data

    @model_validator(mode="before")
    @classmethod
    def _token_file(cls, data: Any) -> Any:
        """``repository_token_file``'s content becomes ``repository_token``."""
        path = data.get("repository_token_file") if isinstance(data, dict) else None
        if not isinstance(path, str):
            return data  # absent, or not a string: the field's own check says so
        if data.get("repository_token") is not None:
            raise ValueError("set repository_token or repository_token_file, not both")
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"repository_token_file {path!r} cannot be read: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
        if not token:
            raise ValueError(f"repository_token_file {path!r} is empty")
        return {**data, "repository_token": token}

    @field_validator("repository_token")
    @classmethod
    def _token(cls, v: str | None) -> str | None:
        """A bearer token a client can send: printable ASCII without spaces (RFC 6750's token characters and
        more), at least one character; an empty one locked the repository API for good."""
        if v is not None and (not v or any(not 0x21 <= ord(c) <= 0x7E for c in v)):
            raise ValueError("repository_token must be one or more printable ASCII characters without spaces "
                             "(a token a client can send in Authorization: Bearer <token>)")
        return v

    @model_validator(mode="after")
    def _budget(self) -> ServerConfig:
        if self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError(f"max_inflight_body_bytes ({self.max_inflight_body_bytes}) is below max_body_bytes "
                             f"({self.max_body_bytes}): a body under the limit could never be read")
        if self.load_strategy == "lru" and self.memory_budget_mb is None:
            raise ValueError("load_strategy lru needs memory_budget_mb")
        if self.load_strategy != "lru" and self.memory_budget_mb is not None:
            raise ValueError(f"memory_budget_mb applies to load_strategy lru only, not {self.load_strategy}")
        if self.engine_processes == "per_model" and self.load_strategy == "lru":
            raise ValueError("engine_processes per_model cannot be used with load_strategy lru: each engine process "
                             "would keep its own memory budget, and no process could unload one model for another")
        if self.repository_token is not None and not self.repository_api:
            raise ValueError("repository_token is set but repository_api is false")
        if self.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
            # here, at load, not in each child process of multi-process mode once it has started
            raise ValueError('event_loop uvloop: uvloop is not installed (pip install -e ".[uvloop]")')
        return self


class RoutingConfig(_Strict):
    """Request routing (seed design)."""

    #: a request for a model that is not configured: 404.
    unknown_model: Literal["reject"] = "reject"
    #: a request naming a version that is not loadable (unknown or outside the version policy): serve it with the
    #: model's default version (fallback) or answer 404 (reject).
    version_mismatch: Literal["fallback", "reject"] = "reject"
    #: which queue (model version, GPU) a request goes to where there are several (batcher.strategy): least_queue,
    #: weighted (instance_group weights), hash (sticky by the header or request parameter named below)
    strategy: Literal["least_queue", "weighted", "hash"] = "least_queue"
    hash_header: str | None = Field(None, min_length=1)
    hash_parameter: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _hash_key(self) -> RoutingConfig:
        keys = (self.hash_header is not None) + (self.hash_parameter is not None)
        if self.strategy == "hash" and keys != 1:
            raise ValueError("strategy hash needs exactly one of hash_header and hash_parameter")
        if self.strategy != "hash" and keys:
            raise ValueError(f"hash_header and hash_parameter apply to strategy hash only, not {self.strategy}")
        return self


class Config(_Strict):
    server: ServerConfig = ServerConfig()
    routing: RoutingConfig = RoutingConfig()
    models: list[ModelConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Config:
        seen: set[tuple[str, int]] = set()
        names = {m.name for m in self.models}
        for i, m in enumerate(self.models):
            if (m.name, m.version) in seen:
                raise ValueError(f"models[{i}]: model {m.name!r} version {m.version} is configured twice")
            seen.add((m.name, m.version))
            if m.fallback is not None and (m.fallback not in names or m.fallback == m.name):
                raise ValueError(f"models[{i}].fallback: {m.fallback!r} is not another configured model")
        for name in names:
            entries = [(i, m) for i, m in enumerate(self.models) if m.name == name]
            top_i, top = max(entries, key=lambda e: e[1].version)
            for i, m in entries:
                if m is not top and m.version_policy != "all" and m.version_policy != top.version_policy:
                    raise ValueError(f"models[{i}].version_policy: set it on the highest version of {name!r} "
                                     f"(models[{top_i}]); the policy is read from there")
            policy = top.version_policy
            if hasattr(policy, "specific"):
                missing = sorted(set(policy.specific) - {m.version for _, m in entries})
                if missing:
                    raise ValueError(f"models[{top_i}].version_policy: versions {missing} of {name!r} are not "
                                     "configured")
        return self


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def parse_config(data: Any, source: str = "<config>") -> Config:
    """Validate a parsed YAML document.

    Raises:
        ConfigError: every problem, one per line, as ``path: message (got value)`` (the value left out when the
            message names it, or when it is a whole section).
    """
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = _path(err["loc"]) or "config"
            msg = err["msg"].removeprefix("Value error, ")
            value = err.get("input")
            # a whole section (a rule across its keys) or a value the message names already is not repeated
            # (as a whole token: 10 is not named by "greater than or equal to 1024")
            named = re.search(rf"(?<![\w.]){re.escape(repr(value))}(?![\w.])", msg) is not None
            shown = "" if isinstance(value, (dict, list)) or named else f" (got {value!r})"
            if where.endswith("repository_token"):  # a secret: never printed
                shown = ""
            lines.append(f"{where}: {msg}{shown}")
        raise ConfigError(f"invalid config {source}:\n  " + "\n  ".join(lines)) from None


def default_config_text() -> str:
    """The embedded ``configs/default.yaml``."""
    return importlib.resources.files("configs").joinpath("default.yaml").read_text(encoding="utf-8")


class _UniqueKeys(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last one
    silently: a config whose second ``max_batch_size`` overrode the first ran with it unnoticed). YAML 1.2 itself
    requires keys to be unique."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base``: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                        f"found the key {key!r} twice", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str):
    """``text`` as YAML (safe types only; a key given twice in one mapping is an error).

    Raises:
        yaml.YAMLError: not valid YAML, or a duplicate key.
    """
    return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader subclass


def load_config(path: str | Path | None = None, model_repository: str | None = None) -> Config:
    """Load and validate a YAML config; ``None`` loads the embedded ``configs/default.yaml`` (no config at all when
    ``model_repository`` is given). The models of ``model_repository`` or ``server.model_repository`` are added.

    A relative model ``path`` is taken relative to the config file's folder (not the current directory).

    Raises:
        ConfigError: unreadable file, bad YAML, or invalid values (message names the path and value).
    """
    if path is None and model_repository is not None:
        text, source = "{}", "<no config>"
    elif path is None:
        text, source = default_config_text(), "configs/default.yaml"
    else:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config {source}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config {source} is not UTF-8 text: byte {exc.start} is {exc.object[exc.start]:#04x}"
                              ) from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {source} is not valid YAML: {exc}") from None
    from .model_repository import add_repository

    data, source = add_repository(data, model_repository, path, source)
    server = data.get("server") if isinstance(data, dict) else None
    if path is not None and isinstance(server, dict) and isinstance(server.get("repository_token_file"), str):
        # relative to the config file, as model paths are (an absolute one stays as it is)
        folder = Path(path).resolve().parent
        data = {**data, "server": {**server, "repository_token_file": str(folder / server["repository_token_file"])}}
    config = parse_config(data, source)
    if path is None:
        return config
    return with_paths_relative_to(config, Path(path).resolve().parent)


def with_paths_relative_to(config: Config, folder: Path) -> Config:
    """``config`` with every relative model path (not ``zoo:``) made absolute against ``folder``."""
    models = [
        m if m.path.startswith("zoo:") or Path(m.path).is_absolute()
        else m.model_copy(update={"path": str(folder / m.path)})
        for m in config.models
    ]
    return config.model_copy(update={"models": models})
