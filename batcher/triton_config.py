"""A model's configuration as Triton's model-config JSON: the one generator behind ``GET /v2/models/{m}/config``.

Field names and enum spellings are those of Triton's ``model_config.proto`` (as its HTTP endpoint prints them:
``max_batch_size``, ``input``/``output`` with ``data_type: TYPE_FP32`` and ``dims`` without the batch dim,
``instance_group: [{count, kind, gpus}]``, ``dynamic_batching: {preferred_batch_size,
max_queue_delay_microseconds, priority_levels, default_priority_level, default_queue_policy}``). perf_analyzer and
tritonclient's ``get_model_config`` read it. One field is this server's own, at top level: ``allowed_batch_sizes``
(the sizes batches are padded to, TF Serving's name; null when they are not padded). After PyTriton's ``model_config/generator.py``: one function of the
config, nothing else builds this document.
"""

from __future__ import annotations

from typing import Any

from engines.datatypes import NUMPY_DTYPES

from .config import ModelConfig
from .signature import ModelSignature

#: backend -> Triton's ``platform`` string.
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}

#: KServe v2 datatype -> Triton's ``DataType`` enum name (BYTES is TYPE_STRING in model configs).
TRITON_TYPES = {dt: ("TYPE_STRING" if dt == "BYTES" else f"TYPE_{dt}") for dt in NUMPY_DTYPES}


def _tensors(specs, batched: bool) -> list[dict[str, Any]]:
    return [{"name": s.name, "data_type": TRITON_TYPES[s.datatype], "dims": list(s.shape[1:] if batched else s.shape)}
            for s in specs]


def model_config_json(cfg: ModelConfig, signature: ModelSignature) -> dict[str, Any]:
    """Triton's model-config JSON for one served model version.

    Args:
        cfg: the model's configuration.
        signature: its served inputs, outputs and ``max_batch_size`` (0: no batch dimension, Triton's meaning).

    Returns:
        a JSON-ready dict.
    """
    db = cfg.dynamic_batching
    policy = db.default_queue_policy
    batched = signature.max_batch_size > 0
    doc: dict[str, Any] = {
        "name": cfg.name,
        "platform": PLATFORMS[cfg.backend],
        "backend": cfg.backend,
        "version_policy": _version_policy(cfg),
        "max_batch_size": signature.max_batch_size,
        "input": _tensors(signature.inputs, batched),
        "output": _tensors(signature.outputs, batched),
        "instance_group": [
            {"name": f"{cfg.name}_{i}", **g.model_dump(exclude_none=True)} for i, g in enumerate(cfg.instance_group)
        ],
        # this server's addition (TF Serving's name; Triton has no such field): null when batches are not padded
        "allowed_batch_sizes": list(signature.allowed_batch_sizes) if signature.allowed_batch_sizes else None,
    }
    if batched:
        doc["dynamic_batching"] = {
            "preferred_batch_size": list(db.preferred_batch_size),
            "max_queue_delay_microseconds": db.max_queue_delay_microseconds,
            "priority_levels": db.priority_levels,
            "default_priority_level": db.default_priority_level or (db.priority_levels + 1) // 2,
            "default_queue_policy": {
                "max_queue_size": policy.max_queue_size,
                "default_timeout_microseconds": policy.default_timeout_microseconds,
                "allow_timeout_override": True,
                "timeout_action": "REJECT",
            },
        }
    return doc


def _version_policy(cfg: ModelConfig) -> dict[str, Any]:
    policy = cfg.version_policy
    if policy == "all":
        return {"all": {}}
    return policy.model_dump()
