"""The model side of the server configuration: one served model's YAML entry (:class:`ModelConfig`) and its parts,
validated by pydantic (strict: ``"8"`` is not an int, an unknown key is an error).

Keys follow Triton's ``model_config.proto`` (as PyTriton's ``DynamicBatcher``/``QueuePolicy`` mirror it):
``max_batch_size``, ``instance_group: [{count, kind, gpus}]``, ``dynamic_batching: {max_queue_delay_microseconds,
preferred_batch_size, priority_levels, default_priority_level, default_queue_policy: {max_queue_size,
default_timeout_microseconds}}``. Every time that a request or a batch is held to is in microseconds. Keys of the
earlier format (``instances``, ``max_queue_delay_us``, ``timeout_ms``, ...) are errors that name the new key
(:data:`MOVED_KEYS`). The server-wide side and loading a file are :mod:`batcher.config`'s, which re-exports these
names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator,
                      model_validator)

from .batch_sizes import check_allowed_batch_sizes


_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


#: every integer of a model's config fits 64 bits (Triton's model_config.proto is int64/uint64, and the JSON of
#: ``GET /v2/models/{m}/config`` takes no more: 2**64 there was a 500 on every GET, a new user's report)
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1


def _ints(value: Any) -> Iterator[int]:
    if type(value) is int:
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _ints(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _ints(v)


class _Strict(BaseModel):
    # strict: "8" is not an int and true is not 1; a typo in a key is an error, not ignored.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_validator(mode="after")
    def _fit_64_bits(self) -> _Strict:
        for name, value in self:
            for v in _ints(value):
                if not INT_MIN <= v <= INT_MAX:
                    raise ValueError(f"{name}: {v} does not fit in 64 bits (Triton's model configuration is int64 "
                                     "and uint64)")
        return self


class InputConfig(_Strict):
    """Declares or narrows a model input, like Triton's ``input { name dims }``.

    ``dims`` excludes the batch dimension (max_batch_size 0: the full shape); ``-1`` leaves a dimension dynamic.
    ``warmup_dims`` gives the sizes used for the warm-up run in place of dynamic dims (default: 32 for each ``-1``).
    ``warmup_data`` gives sample values for the warm-up run, repeated row-major to fill the input (JSON literals
    as a request's ``data`` takes them: strings for BYTES; default: zeros, and ``"0"`` for BYTES).
    ``dims_multiple_of`` (no Triton equivalent) gives, per dim of ``dims``, a number that dim of every request must
    be a multiple of (1: any): a model that only runs at such sizes (PP-OCR's detector: height and width multiples
    of 32, which ``-1`` cannot say) answers other shapes with 400 instead of failing in the engine with 500."""

    name: str
    dims: list[int] | None = None
    dims_multiple_of: list[int] | None = None
    warmup_dims: list[int] | None = None
    warmup_data: list[StrictBool | StrictInt | StrictFloat | StrictStr] | None = Field(None, min_length=1)

    @field_validator("dims")
    @classmethod
    def _dims(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(d == 0 or d < -1 for d in v):
            raise ValueError(f"dims must be positive or -1, got {v}")
        return v

    @field_validator("dims_multiple_of")
    @classmethod
    def _dims_multiple_of(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(d < 1 for d in v):
            raise ValueError(f"dims_multiple_of must be positive, got {v}")
        return v

    @field_validator("warmup_dims")
    @classmethod
    def _warmup_dims(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(d <= 0 for d in v):
            raise ValueError(f"warmup_dims must be positive, got {v}")
        return v


class ProfileShapesConfig(_Strict):
    """One input's shapes in a TensorRT optimization profile, batch dim included."""

    min: list[int]
    opt: list[int]
    max: list[int]


class TensorRTBuildConfig(_Strict):
    """How ``backend: tensorrt`` builds a plan from an .onnx path (see ``batcher build --help``)."""

    precision: Literal["fp32", "fp16", "bf16", "int8"] = "fp32"
    #: one entry per optimization profile: input name -> min/opt/max shapes.
    profiles: list[dict[str, ProfileShapesConfig]] = Field(min_length=1)
    workspace_mb: int | None = Field(None, ge=1)
    version_compatible: bool = False
    hardware_compatibility: Literal["none", "ampere_plus", "same_compute_capability"] = "none"
    calibration_dir: str | None = None


class LatestPolicy(_Strict):
    latest: int = Field(ge=1)


class SpecificPolicy(_Strict):
    specific: list[int] = Field(min_length=1)


class InstanceGroup(_Strict):
    """Triton's ``instance_group``: ``count`` execution contexts of ``kind``; on KIND_GPU, ``count`` contexts on
    each GPU in ``gpus`` (Triton's meaning; default: GPU 0)."""

    count: int = Field(1, ge=1, le=64)
    kind: Literal["KIND_CPU", "KIND_GPU"] = "KIND_CPU"
    gpus: list[int] | None = None
    #: routing.strategy weighted: the group's share of requests on each of its GPUs (this server's key; Triton's
    #: groups have none). 0: the group takes no weighted or hashed requests.
    weight: int = Field(1, ge=0, le=1_000_000)

    @model_validator(mode="after")
    def _gpus(self) -> InstanceGroup:
        if self.gpus is not None:
            if self.kind != "KIND_GPU":
                raise ValueError("gpus apply to kind KIND_GPU only")
            if not self.gpus or any(g < 0 for g in self.gpus) or len(set(self.gpus)) != len(self.gpus):
                raise ValueError(f"gpus must be distinct device ids >= 0, got {self.gpus}")
        return self


class QueuePolicy(_Strict):
    """Triton's ``default_queue_policy``: the queue's bound and the default deadline of a request."""

    #: requests waiting in the queue at most; beyond it requests get 503 + Retry-After (Triton: 0 = unbounded;
    #: here the queue is always bounded).
    max_queue_size: int = Field(256, ge=1)
    #: deadline of a request without ``parameters.timeout``, microseconds from its arrival; 0: none.
    default_timeout_microseconds: int = Field(0, ge=0)


class DynamicBatching(_Strict):
    """Triton's ``dynamic_batching`` (``model_config.proto`` names), plus this server's scheduling options."""

    #: how long a batch may wait for more rows, counted from its first queued request (microseconds).
    max_queue_delay_microseconds: int = Field(0, ge=0, le=10_000_000)
    #: batch sizes sent as soon as the queue's leading requests reach one: the largest reachable, the rest waiting
    #: (Triton's rule, :func:`batcher.batching.preferred_cut`). Any order; kept as written, as Triton keeps it.
    preferred_batch_size: list[int] = []
    #: priority levels: a request's ``parameters.priority`` 1..N, 1 served first; 0 or none means
    #: default_priority_level (default: the middle level).
    priority_levels: int = Field(1, ge=1, le=16)
    default_priority_level: int | None = Field(None, ge=1)
    default_queue_policy: QueuePolicy = QueuePolicy()
    # ---- this server's additions (not in Triton)
    #: a request waiting this long is served before every priority level: the bound on starvation (microseconds).
    max_priority_wait_microseconds: int = Field(1_000_000, ge=1)
    #: answer at once (503 + Retry-After from the estimated drain time) a request whose deadline cannot be met
    #: given the rows queued and executing ahead of it, instead of queueing it to time out.
    admission_control: bool = True
    #: off (Triton's rule): the first request of a batch always waits up to max_queue_delay_microseconds for
    #: others. On: when requests arrive on average more than two windows apart, a lone request runs at once
    #: (lower latency at low load; at a sudden burst after a quiet spell the first batch may run smaller).
    adaptive_queue_delay: bool = False

    @field_validator("preferred_batch_size")
    @classmethod
    def _preferred(cls, v: list[int]) -> list[int]:
        if any(p < 1 for p in v):
            raise ValueError(f"preferred batch sizes must be >= 1, got {v}")
        return v

    @model_validator(mode="after")
    def _levels(self) -> DynamicBatching:
        if self.default_priority_level is not None and self.default_priority_level > self.priority_levels:
            raise ValueError(f"default_priority_level {self.default_priority_level} exceeds priority_levels "
                             f"{self.priority_levels}")
        return self


#: keys of the earlier config format -> where they live now (an old key is an error naming its new place).
MOVED_KEYS = {
    "instances": "instance_group[].count",
    "device": "instance_group[].kind (KIND_CPU | KIND_GPU)",
    "max_queue_delay_us": "dynamic_batching.max_queue_delay_microseconds",
    "preferred_batch_sizes": "dynamic_batching.preferred_batch_size",
    "max_queue_size": "dynamic_batching.default_queue_policy.max_queue_size",
    "timeout_ms": "dynamic_batching.default_queue_policy.default_timeout_microseconds (microseconds)",
    "priority_levels": "dynamic_batching.priority_levels",
    "default_priority_level": "dynamic_batching.default_priority_level",
    "max_priority_wait_ms": "dynamic_batching.max_priority_wait_microseconds (microseconds)",
    "admission_control": "dynamic_batching.admission_control",
}
_MOVED_IN_BATCHING = {
    "max_queue_delay_us": "max_queue_delay_microseconds",
    "preferred_batch_sizes": "preferred_batch_size",
    "timeout_us": "default_queue_policy.default_timeout_microseconds",
    "max_queue_size": "default_queue_policy.max_queue_size",
}


class ModelConfig(_Strict):
    """One served model (one version of it). Scheduling keys follow Triton's ``model_config.proto``."""

    name: str
    version: int = Field(1, ge=1)
    backend: Literal["onnxruntime", "tensorrt"] = "onnxruntime"
    #: a model file (.onnx; .plan/.engine for tensorrt), or ``zoo:<name>`` for a built-in model (:mod:`engines.zoo`).
    #: A relative path is relative to the config file's folder.
    path: str
    #: tensorrt only: which TensorRT runtime deserializes the plan (lean/dispatch run version-compatible plans).
    runtime: Literal["auto", "full", "lean", "dispatch"] = "auto"
    #: tensorrt only, for an .onnx path: how to build the plan (cached by content, TensorRT version, GPU).
    build: TensorRTBuildConfig | None = None
    #: inprocess: contexts run in the server process; multiproc (onnxruntime): each context runs in a supervised
    #: worker process (Unix socket + shared memory), so a crash there fails only its batch (503) and the worker is
    #: restarted with backoff.
    mode: Literal["inprocess", "multiproc"] = "inprocess"
    #: execution contexts (each with its own executor thread) and where they run (Triton's instance_group).
    instance_group: list[InstanceGroup] = Field([InstanceGroup()], min_length=1)
    #: intra-op threads of each ONNX Runtime context; 0 lets ONNX Runtime use every core.
    intra_op_threads: int = Field(1, ge=0, le=256)
    #: rows per batch at most; default: the engine's profile maximum, else 8. 0 (Triton's meaning; the default for
    #: a fixed first dim): no batch dimension, inputs are full shapes, each request executes alone.
    max_batch_size: int | None = Field(None, ge=0, le=4096)
    dynamic_batching: DynamicBatching = DynamicBatching()
    inputs: list[InputConfig] = []
    #: batch sizes each context runs once at load, before the model is ready; default: every size from 1 to
    #: max_batch_size on CUDA (cuDNN picks and caches kernels per shape: an unwarmed size costs a search on the
    #: first real request), only 1 on CPU.
    warmup_batch_sizes: list[int] | None = None
    #: another model that takes this model's requests when this one is unavailable (not loadable, or no room in the
    #: memory budget) or its queue holds fallback_queue_depth requests or more; responses name the model that ran.
    fallback: str | None = None
    fallback_queue_depth: int | None = Field(None, ge=1)
    #: sizes every batch is padded up to (TF Serving's name), one prepared executable (CUDA graph) each on GPU:
    #: ascending, 1..max_batch_size, with max_batch_size. Default (:mod:`batcher.batch_sizes`): on KIND_GPU the
    #: powers of two below max_batch_size plus max_batch_size; on CPU none (no padding).
    allowed_batch_sizes: list[int] | None = None
    #: onnxruntime: fp32 (TF32 off), tf32, fp16 (model converted, fp32 inputs/outputs kept; tf32 and fp16 need
    #: KIND_GPU). Default: tf32 on KIND_GPU (PyTorch's cuDNN and ONNX Runtime's default), fp32 on CPU.
    precision: Literal["fp32", "tf32", "fp16"] | None = None
    #: onnxruntime on KIND_GPU: each context's device arena limit (ONNX Runtime's gpu_mem_limit), MB; default none.
    gpu_memory_limit_mb: float | None = Field(None, gt=0)
    #: onnxruntime on KIND_GPU: how the arena grows (ONNX Runtime's names; default ORT's, kNextPowerOfTwo).
    arena_extend_strategy: Literal["kNextPowerOfTwo", "kSameAsRequested"] | None = None
    #: onnxruntime on KIND_GPU: graphs (one session per context, a CUDA graph per allowed size), sessions (one
    #: session per allowed size), auto (graphs, falling back to sessions when capture fails; shown in metadata).
    gpu_execution: Literal["graphs", "sessions", "auto"] = "auto"
    #: lru: the footprint to assume before the model's first load (MB); default (1 + 2 x instances) x file size + 32.
    memory_mb: float | None = Field(None, gt=0)
    #: which of this name's configured versions are served (Triton's version_policy): {latest: N}, "all", or
    #: {specific: [...]}; Triton's own spellings too ({latest: {num_versions: N}}, {all: {}},
    #: {specific: {versions: [...]}}). Read from the entry with the highest version of the name.
    version_policy: Literal["all"] | LatestPolicy | SpecificPolicy = "all"

    @field_validator("version_policy", mode="before")
    @classmethod
    def _triton_policy(cls, v: Any) -> Any:
        """Triton's model-config spellings as ours (a new user's config.yaml used Triton's and got eight lines of
        validation internals)."""
        if isinstance(v, dict) and len(v) == 1:
            (key, value), = v.items()
            if key == "all" and value in ({}, None):
                return "all"
            if key == "latest" and isinstance(value, dict) and set(value) == {"num_versions"}:
                return {"latest": value["num_versions"]}
            if key == "specific" and isinstance(value, dict) and set(value) == {"versions"}:
                return {"specific": value["versions"]}
        return v

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in MOVED_KEYS.items():
                if old in data:
                    raise ValueError(f"{old!r} is no longer a model key: use {new}")
            batching = data.get("dynamic_batching")
            if isinstance(batching, dict):
                for old, new in _MOVED_IN_BATCHING.items():
                    if old in batching:
                        raise ValueError(f"dynamic_batching.{old}: use dynamic_batching.{new} (Triton's name)")
        return data

    @property
    def device(self) -> str:
        """``"cuda"`` when the instance groups are KIND_GPU, else ``"cpu"``."""
        return "cuda" if self.instance_group[0].kind == "KIND_GPU" else "cpu"

    @property
    def placements(self) -> list[int]:
        """The device id of every execution context, in order (CPU contexts: 0); Triton's rule: a KIND_GPU group
        puts ``count`` contexts on each of its ``gpus``."""
        out: list[int] = []
        for g in self.instance_group:
            for gpu in (g.gpus or [0]) if g.kind == "KIND_GPU" else [0]:
                out.extend([gpu] * g.count)
        return out

    @property
    def instances(self) -> int:
        """Execution contexts in all (:attr:`placements`)."""
        return len(self.placements)

    @property
    def effective_precision(self) -> str | None:
        """``precision``, or its default: ``tf32`` on KIND_GPU, ``fp32`` on CPU; None for backend tensorrt (its
        ``build.precision`` decides)."""
        if self.backend != "onnxruntime":
            return None
        return self.precision or ("tf32" if self.device == "cuda" else "fp32")

    @property
    def max_queue_size(self) -> int:
        return self.dynamic_batching.default_queue_policy.max_queue_size

    @property
    def default_timeout_s(self) -> float | None:
        """The default deadline of a request, seconds after arrival; None: no deadline."""
        us = self.dynamic_batching.default_queue_policy.default_timeout_microseconds
        return us / 1e6 if us else None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"model name must match {_NAME.pattern}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        preferred = self.dynamic_batching.preferred_batch_size
        if self.max_batch_size == 0 and (preferred or self.dynamic_batching.max_queue_delay_microseconds):
            raise ValueError("max_batch_size 0 (no batch dimension) runs each request alone: dynamic_batching."
                             "preferred_batch_size and max_queue_delay_microseconds need max_batch_size >= 1")
        if self.max_batch_size is not None and any(p > self.max_batch_size for p in preferred):
            raise ValueError(
                f"dynamic_batching.preferred_batch_size {preferred} exceeds max_batch_size {self.max_batch_size}"
            )
        if len({g.kind for g in self.instance_group}) > 1:
            raise ValueError("instance_group: every group of a model must have the same kind")
        if self.mode == "multiproc" and self.backend != "onnxruntime":
            raise ValueError("mode multiproc is available for backend onnxruntime only")
        if self.backend == "onnxruntime" and (self.build is not None or self.runtime != "auto"):
            raise ValueError("build and runtime apply to backend tensorrt only")
        if self.fallback_queue_depth is not None and self.fallback is None:
            raise ValueError("fallback_queue_depth needs a fallback model")
        if self.warmup_batch_sizes is not None and any(b < 1 for b in self.warmup_batch_sizes):
            raise ValueError(f"warmup_batch_sizes must be >= 1, got {self.warmup_batch_sizes}")
        if self.allowed_batch_sizes is not None:  # against max_batch_size where the config gives it
            check_allowed_batch_sizes(self.allowed_batch_sizes, self.max_batch_size)
        self._gpu_options()
        names = [i.name for i in self.inputs]
        if len(names) != len(set(names)):
            raise ValueError(f"inputs name an input twice: {names}")
        return self

    def _gpu_options(self) -> None:
        """The ONNX Runtime CUDA options need backend onnxruntime on KIND_GPU (fp32 is fine anywhere)."""
        if self.precision not in (None, "fp32") and self.backend == "onnxruntime" and self.device != "cuda":
            raise ValueError(f"precision {self.precision} needs instance_group kind KIND_GPU; the CPU runs fp32")
        if self.precision is not None and self.backend != "onnxruntime":
            raise ValueError("precision applies to backend onnxruntime; for tensorrt set build.precision")
        gpu_only = {"gpu_memory_limit_mb": self.gpu_memory_limit_mb is not None,
                    "arena_extend_strategy": self.arena_extend_strategy is not None,
                    "gpu_execution": self.gpu_execution != "auto"}
        for key, set_ in gpu_only.items():
            if set_ and (self.backend != "onnxruntime" or self.device != "cuda"):
                raise ValueError(f"{key} applies to backend onnxruntime with instance_group kind KIND_GPU only")
