"""A model's configuration as Triton's model-config JSON, both ways: the one generator behind
``GET /v2/models/{m}/config`` (:func:`model_config_json`) and the one mapping back, for the repository API's
``load`` with ``parameters.config`` (:func:`apply_model_config`).

Field names and enum spellings are those of Triton's ``model_config.proto`` (as its HTTP endpoint prints them:
``max_batch_size``, ``input``/``output`` with ``data_type: TYPE_FP32`` and ``dims`` without the batch dim,
``instance_group: [{count, kind, gpus}]``, ``dynamic_batching: {preferred_batch_size,
max_queue_delay_microseconds, priority_levels, default_priority_level, default_queue_policy}``, the ONNX Runtime
backend's ``parameters: {intra_op_thread_count: {string_value}}``). perf_analyzer and tritonclient's
``get_model_config`` read it. Two fields are this server's own: ``allowed_batch_sizes`` at top level (the sizes
batches are padded to, TF Serving's name; null when they are not padded) and ``instance_group[].weight`` (the
group's share under ``routing.strategy: weighted``, shown as in effect, default 1). ``version_policy`` is the
model's (read from its highest version's entry), the same in every version's config, as in Triton where the
versions share one config. After PyTriton's ``model_config/generator.py``: one function of the config, nothing else
builds this document. The mapping back accepts what the generator writes (a round trip changes nothing).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from engines.datatypes import NUMPY_DTYPES

from .config import DynamicBatching, ModelConfig
from .errors import InvalidInput
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
    if cfg.backend == "onnxruntime":
        doc["parameters"] = {"intra_op_thread_count": {"string_value": str(cfg.intra_op_threads)}}
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
    """Triton's form: ``{"all": {}}``, ``{"latest": {"num_versions": N}}``, ``{"specific": {"versions": [...]}}``."""
    policy = cfg.version_policy
    if policy == "all":
        return {"all": {}}
    if hasattr(policy, "latest"):
        return {"latest": {"num_versions": policy.latest}}
    return {"specific": {"versions": list(policy.specific)}}


# ---------------------------------------------------------------------------- Triton's JSON -> our config
#: top-level fields of Triton's model config that a load may carry (the others: 400 naming them, unless empty).
LOADABLE_FIELDS = ("name", "platform", "backend", "version_policy", "max_batch_size", "input", "output",
                   "instance_group", "dynamic_batching", "parameters", "allowed_batch_sizes")
_INSTANCE_FIELDS = ("name", "count", "kind", "gpus", "weight")
_QUEUE_POLICY_FIELDS = ("max_queue_size", "default_timeout_microseconds", "allow_timeout_override",
                        "timeout_action")
_TENSOR_FIELDS = ("name", "data_type", "dims")
_INT_BATCHING_FIELDS = ("max_queue_delay_microseconds", "priority_levels", "default_priority_level",
                        "max_priority_wait_microseconds")


def _empty(value: Any) -> bool:
    """A field left at Triton's default (false, 0, "", [], {}, FORMAT_NONE) asks for nothing."""
    return value in (None, False, "", "FORMAT_NONE") or (isinstance(value, (list, dict)) and not value)


def _int(value: Any, where: str) -> int:
    """An integer field; Triton's JSON prints 64-bit integers as strings ("1000"), so digit strings count."""
    if isinstance(value, str) and value.isascii() and value.lstrip("-").isdigit():  # "²" is a digit to isdigit
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"parameters.config.{where}: expected an integer, got {value!r}")
    return value


def _ints(value: Any, where: str) -> list[int]:
    if not isinstance(value, list):
        raise InvalidInput(f"parameters.config.{where}: expected a list of integers, got {value!r}")
    return [_int(v, f"{where}[{i}]") for i, v in enumerate(value)]


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidInput(f"parameters.config.{where}: expected an object, got {value!r}")
    return value


def _items(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidInput(f"parameters.config.{where}: expected a list, got {value!r}")
    return [_obj(v, f"{where}[{i}]") for i, v in enumerate(value)]


def _unsupported(doc: dict[str, Any], allowed: tuple[str, ...], where: str, out: list[str]) -> None:
    out.extend(f"{where}{k}" for k, v in doc.items() if k not in allowed and not _empty(v))


def _policy(doc: Any) -> Any:
    """A version policy in Triton's form or this generator's older one, as our config spells it."""
    doc = _obj(doc, "version_policy")
    if set(doc) == {"all"}:
        return "all"
    if set(doc) == {"latest"}:
        n = doc["latest"]
        return {"latest": _int(n.get("num_versions") if isinstance(n, dict) else n, "version_policy.latest")}
    if set(doc) == {"specific"}:
        v = doc["specific"]
        return {"specific": _ints(v.get("versions") if isinstance(v, dict) else v, "version_policy.specific")}
    raise InvalidInput(f"parameters.config.version_policy: expected all, latest or specific, got {doc!r}")


def _check_identity(cfg: ModelConfig, doc: dict[str, Any]) -> None:
    """name, platform, backend and version_policy must be the model's own: a load cannot change them."""
    if doc.get("name", cfg.name) != cfg.name:
        raise InvalidInput(f"parameters.config.name: {doc['name']!r} is not the model being loaded ({cfg.name!r})")
    for key, ours in (("platform", PLATFORMS[cfg.backend]), ("backend", cfg.backend)):
        if key in doc and not _empty(doc[key]) and doc[key] != ours:
            raise InvalidInput(f"parameters.config.{key}: {doc[key]!r}; this model is served by {ours!r} "
                               "(a load cannot change the backend)")
    if "version_policy" in doc:
        policy = cfg.version_policy if cfg.version_policy == "all" else cfg.version_policy.model_dump()
        if _policy(doc["version_policy"]) != policy:
            raise InvalidInput("parameters.config.version_policy: the served versions are set in the server's "
                               f"config ({_version_policy(cfg)}); a load cannot change them")


def _instance_groups(doc: Any, unsupported: list[str]) -> list[dict[str, Any]]:
    """The groups given, each as given: a field left out of a group (``count``, ``kind``, ``gpus``, ``weight``)
    takes its default, not the value the model's group had (the groups given replace the model's)."""
    groups = []
    for i, g in enumerate(_items(doc, "instance_group")):
        _unsupported(g, _INSTANCE_FIELDS, f"instance_group[{i}].", unsupported)
        group = {k: g[k] for k in ("count", "kind") if k in g}
        for key in ("count", "weight"):  # weight 0 is a value (no weighted requests), not Triton's "left at default"
            if key in g:
                group[key] = _int(g[key], f"instance_group[{i}].{key}")
        if "gpus" in g and not _empty(g["gpus"]):
            group["gpus"] = _ints(g["gpus"], f"instance_group[{i}].gpus")
        groups.append(group)
    return groups


def _dynamic_batching(cfg: ModelConfig, doc: Any, unsupported: list[str]) -> dict[str, Any]:
    """``dynamic_batching`` merged over the model's: the fields given replace ours, the others stay."""
    doc = _obj(doc, "dynamic_batching")
    allowed = (*DynamicBatching.model_fields, "preserve_ordering", "priority_queue_policy")
    _unsupported(doc, allowed, "dynamic_batching.", unsupported)
    for k in ("preserve_ordering", "priority_queue_policy"):
        if k in doc and not _empty(doc[k]):
            unsupported.append(f"dynamic_batching.{k}")
    out = cfg.dynamic_batching.model_dump()
    for key in _INT_BATCHING_FIELDS:
        if key in doc:
            out[key] = _int(doc[key], f"dynamic_batching.{key}")
    for key in ("admission_control", "adaptive_queue_delay"):
        if key in doc:
            out[key] = doc[key]
    if "preferred_batch_size" in doc:
        out["preferred_batch_size"] = _ints(doc["preferred_batch_size"], "dynamic_batching.preferred_batch_size")
    if out["priority_levels"] == 0:  # Triton's "no priorities": one level here
        out["priority_levels"] = 1
    level = out["default_priority_level"]
    if level == 0 or (level == (out["priority_levels"] + 1) // 2 and cfg.dynamic_batching.default_priority_level
                      is None):
        out["default_priority_level"] = None  # Triton's 0, or the middle level this server defaults to anyway
    if "default_queue_policy" in doc:
        policy = _obj(doc["default_queue_policy"], "dynamic_batching.default_queue_policy")
        where = "dynamic_batching.default_queue_policy."
        _unsupported(policy, _QUEUE_POLICY_FIELDS, where, unsupported)
        if policy.get("allow_timeout_override", True) is not True:
            unsupported.append(f"{where}allow_timeout_override: false")
        if policy.get("timeout_action", "REJECT") != "REJECT":
            unsupported.append(f"{where}timeout_action: {policy['timeout_action']}")
        for key in ("max_queue_size", "default_timeout_microseconds"):
            if key in policy:
                value = _int(policy[key], where + key)
                if key == "max_queue_size" and value == 0:  # Triton's default, "no limit": the queue here is
                    continue  # always bounded, so it keeps its bound (a fresh user's Triton config got a 400)
                out["default_queue_policy"][key] = value
    return out


def _tensors_check(kind: str, doc: Any, served: tuple, unsupported: list[str]) -> list[tuple[str, list[int] | None]]:
    """Each ``input``/``output`` entry's name and dims, checked against the served tensors (names and types
    cannot change); dims None where the entry gives none."""
    by_name = {s.name: s for s in served}
    out = []
    for i, t in enumerate(_items(doc, kind)):
        _unsupported(t, _TENSOR_FIELDS, f"{kind}[{i}].", unsupported)
        name = t.get("name")
        if type(name) is not str or name not in by_name:  # a list or object: unhashable, not a 500
            raise InvalidInput(f"parameters.config.{kind}[{i}].name: the model has no {kind} {name!r} "
                               f"({kind}s: {sorted(by_name)})")
        spec = by_name[name]
        if "data_type" in t and t["data_type"] != TRITON_TYPES[spec.datatype]:  # compared, never looked up
            raise InvalidInput(f"parameters.config.{kind}[{i}].data_type: {t['data_type']!r}; the model's {kind} "
                               f"{name!r} is {TRITON_TYPES[spec.datatype]} (a load cannot change it)")
        out.append((name, _ints(t["dims"], f"{kind}[{i}].dims") if "dims" in t else None))
    return out


def _inputs(cfg: ModelConfig, signature: ModelSignature, doc: Any, same_batching: bool,
            unsupported: list[str]) -> list[dict[str, Any]]:
    """Input dims given become declared dims (``inputs[].dims``), unless they are the served dims already."""
    inputs = [i.model_dump() for i in cfg.inputs]
    served = {s.name: list(s.shape[1:] if signature.batched else s.shape) for s in signature.inputs}
    for name, dims in _tensors_check("input", doc, signature.inputs, unsupported):
        if dims is None or (same_batching and dims == served[name]):
            continue
        entry = next((i for i in inputs if i["name"] == name), None)
        if entry is None:
            inputs.append({"name": name, "dims": dims, "warmup_dims": None})
        else:
            entry["dims"] = dims
    return inputs


def apply_model_config(cfg: ModelConfig, signature: ModelSignature, doc: Any) -> ModelConfig:
    """The model's config with Triton's model-config JSON ``doc`` applied (a repository ``load``'s
    ``parameters.config``).

    Fields given replace ours, fields left out keep their values (Triton would reset them to its defaults):
    ``max_batch_size`` (0: no batch dimension), ``instance_group`` (``count``, ``kind`` KIND_CPU|KIND_GPU,
    ``gpus``, and this server's ``weight``), ``dynamic_batching`` (every field of our config, merged field by field;
    Triton's ``priority_levels: 0`` is one level), ``input[].dims`` (declared dims),
    ``parameters.intra_op_thread_count`` (ONNX Runtime), ``allowed_batch_sizes`` (this server's). An
    ``instance_group`` given replaces the model's groups as a whole, as Triton replaces a model's config: a group
    without ``weight`` (Triton's groups have none) has the default weight 1, whatever weight the model had, and
    GET shows that 1; a load without ``instance_group`` keeps the groups, weights included. ``name``,
    ``platform``, ``backend``, ``version_policy`` (the model's, as GET shows it for any version) and ``output``
    must match the model; input and output names and types are checked against it. Any other field with a
    non-default value is unsupported. What the generator writes maps back to the same config.

    Args:
        cfg: the model's config now. signature: what it serves (its last load).
        doc: the parsed ``parameters.config``.

    Raises:
        InvalidInput: not an object, a wrong type, a field that contradicts the model, unsupported fields (all
            named), or a resulting config our schema rejects (its path and value).
    """
    doc = _obj(doc, "")
    unsupported: list[str] = []
    _unsupported(doc, LOADABLE_FIELDS, "", unsupported)
    _check_identity(cfg, doc)
    update: dict[str, Any] = {}
    if "max_batch_size" in doc:
        mbs = _int(doc["max_batch_size"], "max_batch_size")
        if mbs != signature.max_batch_size:
            update["max_batch_size"] = mbs
    same_batching = (update.get("max_batch_size", signature.max_batch_size) > 0) == signature.batched
    if "instance_group" in doc:
        update["instance_group"] = _instance_groups(doc["instance_group"], unsupported)
    if doc.get("allowed_batch_sizes") is not None:  # null: not padded, as now or by default
        sizes = _ints(doc["allowed_batch_sizes"], "allowed_batch_sizes")
        if cfg.allowed_batch_sizes is not None or sizes != list(signature.allowed_batch_sizes or ()):
            update["allowed_batch_sizes"] = sizes
    if "dynamic_batching" in doc:
        update["dynamic_batching"] = _dynamic_batching(cfg, doc["dynamic_batching"], unsupported)
    if "input" in doc:
        update["inputs"] = _inputs(cfg, signature, doc["input"], same_batching, unsupported)
    if "output" in doc:
        served = {s.name: list(s.shape[1:] if signature.batched else s.shape) for s in signature.outputs}
        for name, dims in _tensors_check("output", doc["output"], signature.outputs, unsupported):
            if dims is not None and same_batching and dims != served[name]:
                raise InvalidInput(f"parameters.config.output: {name!r} dims {dims} differ from the model's "
                                   f"{served[name]} (outputs are what the model computes)")
    if "parameters" in doc:
        params = _obj(doc["parameters"], "parameters")
        _unsupported(params, ("intra_op_thread_count",) if cfg.backend == "onnxruntime" else (), "parameters.",
                     unsupported)
        if "intra_op_thread_count" in params and cfg.backend == "onnxruntime":
            value = params["intra_op_thread_count"]
            value = value.get("string_value") if isinstance(value, dict) else value
            update["intra_op_threads"] = _int(value, "parameters.intra_op_thread_count.string_value")
    if unsupported:
        raise InvalidInput("parameters.config: fields this server does not support: " + ", ".join(unsupported))
    return _validated({**cfg.model_dump(), **update})


def _validated(doc: dict[str, Any]) -> ModelConfig:
    """``doc`` (a model config's fields) as a ModelConfig.

    Raises:
        InvalidInput: each problem as ``path: message (got value)``; a rule across fields (no path) or a value the
            message names already is not repeated, as :func:`batcher.config.parse_config` does.
    """
    try:
        return ModelConfig.model_validate(doc)
    except ValidationError as exc:
        problems = []
        for e in exc.errors():
            where, msg, value = ".".join(str(p) for p in e["loc"]), e["msg"].removeprefix("Value error, "), e.get("input")
            shown = "" if isinstance(value, (dict, list)) or repr(value) in msg else f" (got {value!r})"
            problems.append(f"{where}: {msg}{shown}" if where else f"{msg}{shown}")
        raise InvalidInput("parameters.config: " + "; ".join(problems)) from None


def config_changes(before: ModelConfig, after: ModelConfig) -> dict[str, Any]:
    """The fields of ``after`` that differ from ``before``: nested objects field by field, anything else (lists,
    values) whole."""

    def changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in new.items():
            was = old.get(key)
            if isinstance(value, dict) and isinstance(was, dict):
                if sub := changes(was, value):
                    out[key] = sub
            elif value != was:
                out[key] = value
        return out

    return changes(before.model_dump(), after.model_dump())


def with_changes(cfg: ModelConfig, changes: dict[str, Any]) -> ModelConfig:
    """``cfg`` with :func:`config_changes`' ``changes`` written over it (the rest of ``cfg`` as it is).

    Raises:
        InvalidInput: the result is not a valid config for this model (e.g. another version's preferred batch
            sizes above the new max_batch_size).
    """

    def patched(doc: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
        out = dict(doc)
        for key, value in changes.items():
            out[key] = patched(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    return _validated(patched(cfg.model_dump(), changes))
