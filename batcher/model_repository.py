"""A model directory in Triton's repository layout (what KServe mounts at ``/mnt/models``) as config entries.

``batcher serve --model-repository DIR`` (or ``server.model_repository`` in the YAML) serves every model found::

    DIR/
      resnet18/
        config.yaml          # optional: model keys of the config schema (not name, version, path), for every version
        1/model.onnx
        2/model.onnx
      tiny_cnn/
        1/model.onnx
      detector_trt/
        config.yaml          # backend: tensorrt
        1/model.plan         # or model.onnx with a build block in config.yaml

Each ``<model>/<version>/`` (a directory named by a positive integer) becomes one model entry ``{name: <model>,
version: <version>, path: <the file>, **config.yaml}``; the model file is ``model.onnx`` for onnxruntime and
``model.plan`` (else ``model.onnx`` to be built) for tensorrt. Without a ``config.yaml`` a version holding only a
``model.plan`` is served by tensorrt. Every version found is served unless ``config.yaml`` sets a
``version_policy`` (Triton's default is the latest version only). Hidden entries and plain files at the top level
are ignored, and so are other directories inside a model directory, as Triton does. Relative paths inside a
model's ``config.yaml`` (``build.calibration_dir``) resolve against that model's directory. Triton's
``config.pbtxt`` is not read (a warning says so when one is present without a ``config.yaml``).

The entries are appended to the config's own ``models`` (the config may list more models, e.g. ``zoo:`` ones); the
combined config is then validated as usual.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import yaml

from .config import load_yaml
from .errors import ConfigError

log = logging.getLogger(__name__)

MODEL_CONFIG = "config.yaml"
_VERSION = re.compile(r"^[1-9][0-9]*$")
#: keys that the layout sets: a config.yaml may not set them.
_LAYOUT_KEYS = ("name", "version", "path")


def scan(directory: str | Path) -> list[dict[str, Any]]:
    """One config entry per ``<model>/<version>/`` of the repository ``directory`` (sorted by name, version).

    Raises:
        ConfigError: the directory is missing or holds no model; a model directory without any version; a version
            without its model file; an unreadable or invalid ``config.yaml``. The message names the path.
    """
    root = Path(directory).expanduser().resolve()
    if not root.is_dir():
        raise ConfigError(f"model repository {str(directory)!r} is not a directory")
    models = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not models:
        raise ConfigError(f"model repository {str(root)!r} holds no model directory (expected <model>/<version>/)")
    if all(_VERSION.match(p.name) for p in models):
        raise ConfigError(f"model repository {str(root)!r} holds version directories ({', '.join(p.name for p in models)})"
                          ": it is one model's directory; pass the directory above it")
    entries: list[dict[str, Any]] = []
    for model_dir in models:
        entries += _model_entries(model_dir)
    return entries


def _model_entries(model_dir: Path) -> list[dict[str, Any]]:
    settings = _model_settings(model_dir)
    versions = sorted((p for p in model_dir.iterdir() if p.is_dir() and _VERSION.match(p.name)),
                      key=lambda p: int(p.name))
    if not versions:
        raise ConfigError(f"model directory {str(model_dir)!r} has no version directory: expected "
                          f"{model_dir.name}/<version>/model.onnx with <version> a positive integer, e.g. 1")
    entries = []
    for version_dir in versions:
        backend = settings.get("backend")
        if backend is None and not (version_dir / "model.onnx").is_file() and (version_dir / "model.plan").is_file():
            backend = "tensorrt"
        names = ["model.plan", "model.onnx"] if backend == "tensorrt" else ["model.onnx"]
        found = [version_dir / n for n in names if (version_dir / n).is_file()]
        if not found:
            raise ConfigError(f"model version directory {str(version_dir)!r} has no {' or '.join(names)}")
        entry: dict[str, Any] = {"name": model_dir.name, "version": int(version_dir.name), "path": str(found[0])}
        if backend is not None:
            entry["backend"] = backend
        entries.append({**settings, **entry})
    return entries


def _model_settings(model_dir: Path) -> dict[str, Any]:
    path = model_dir / MODEL_CONFIG
    if not path.is_file():
        if (model_dir / "config.pbtxt").is_file():
            log.warning("%s: config.pbtxt is not read; put the model's settings in %s (defaults apply)",
                        model_dir, MODEL_CONFIG)
        return {}
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{str(path)!r} is not UTF-8 text: byte {exc.start} is {exc.object[exc.start]:#04x}"
                          ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{str(path)!r}: expected a mapping of model settings, got {type(data).__name__}")
    fixed = [k for k in _LAYOUT_KEYS if k in data]
    if fixed:
        raise ConfigError(f"{str(path)!r}: {', '.join(fixed)} come(s) from the directory layout and cannot be set here")
    build = data.get("build")
    if isinstance(build, dict) and isinstance(build.get("calibration_dir"), str):
        data = {**data, "build": {**build, "calibration_dir": str(model_dir / build["calibration_dir"])}}
    return data


def add_repository(data: Any, cli_directory: str | None, config_path: str | Path | None,
                   source: str) -> tuple[Any, str]:
    """``(data, source)`` with the models of the repository appended to the parsed config document ``data``.

    The repository is ``cli_directory`` (``--model-repository``, relative to the working directory) or else the
    document's ``server.model_repository`` (relative to the config file's directory). Without either, both are
    returned unchanged. ``server.model_repository`` is set to the absolute directory used, and ``source`` (the name
    validation errors cite) gets a legend mapping each added ``models[i]`` to its directory.

    Raises:
        ConfigError: see :func:`scan`.
    """
    server = data.get("server") if isinstance(data, dict) else None
    directory: Path | None = None
    if cli_directory is not None:
        directory = Path(cli_directory).expanduser().resolve()
    elif isinstance(server, dict) and isinstance(server.get("model_repository"), str):
        base = Path(config_path).resolve().parent if config_path is not None else Path.cwd()
        directory = (base / Path(server["model_repository"]).expanduser()).resolve()
    if directory is None:
        return data, source
    data = {} if data is None else data
    own = data.get("models", []) if isinstance(data, dict) else None
    if not isinstance(own, list) or not (server is None or isinstance(server, dict)):
        return data, source  # not the expected shape: the schema validation reports it
    entries = scan(directory)
    legend = ", ".join(f"models[{len(own) + i}] = {e['name']}/{e['version']}" for i, e in enumerate(entries))
    return ({**data, "server": {**(server or {}), "model_repository": str(directory)}, "models": own + entries},
            f"{source} + model repository {directory} ({legend})")
