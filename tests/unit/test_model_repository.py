"""batcher/model_repository.py: a Triton/KServe repository layout turned into config entries (in-process; the model
files are placeholders: scanning and validation do not open them; tests/integration/test_serve_repository.py serves
real ones)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from batcher.config import load_config
from batcher.errors import ConfigError
from batcher.model_repository import scan


def layout(root: Path, files: dict[str, str]) -> Path:
    """Create ``files`` ({relative path: text}) under ``root``; returns ``root``."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_one_entry_per_version_with_the_model_settings(tmp_path):
    repo = layout(tmp_path / "repo", {
        "resnet18/config.yaml": yaml.safe_dump({
            "max_batch_size": 16, "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
            "dynamic_batching": {"max_queue_delay_microseconds": 500, "preferred_batch_size": [8]}}),
        "resnet18/1/model.onnx": "x", "resnet18/2/model.onnx": "x", "resnet18/10/model.onnx": "x",
        "tiny_cnn/1/model.onnx": "x",
        "tiny_cnn/1/notes.txt": "ignored", "tiny_cnn/old/model.onnx": "not a version: ignored",
        "detector/1/model.plan": "x",
        ".hidden/1/model.onnx": "ignored", "README.md": "ignored",
    })
    entries = scan(repo)
    assert [(e["name"], e["version"]) for e in entries] == [
        ("detector", 1), ("resnet18", 1), ("resnet18", 2), ("resnet18", 10), ("tiny_cnn", 1)]
    by = {(e["name"], e["version"]): e for e in entries}
    assert by["resnet18", 10]["path"] == str(repo.resolve() / "resnet18/10/model.onnx")
    assert by["resnet18", 2]["max_batch_size"] == 16 and by["resnet18", 1]["instance_group"][0]["count"] == 2
    assert by["detector", 1]["backend"] == "tensorrt" and by["detector", 1]["path"].endswith("model.plan")
    assert "backend" not in by["tiny_cnn", 1] and set(by["tiny_cnn", 1]) == {"name", "version", "path"}


def test_serve_without_config_serves_only_the_repository(tmp_path):
    repo = layout(tmp_path / "repo", {
        "m/config.yaml": yaml.safe_dump({"max_batch_size": 4, "dynamic_batching": {
            "default_queue_policy": {"max_queue_size": 7, "default_timeout_microseconds": 1000}}}),
        "m/1/model.onnx": "x", "m/2/model.onnx": "x"})
    config = load_config(None, str(repo))
    assert [(m.name, m.version) for m in config.models] == [("m", 1), ("m", 2)]
    assert all(m.max_batch_size == 4 and m.dynamic_batching.default_queue_policy.max_queue_size == 7
               for m in config.models)
    assert config.server.model_repository == str(repo.resolve())
    assert config.server.host == "127.0.0.1"  # server defaults (the entrypoint's --host sets 0.0.0.0)


def test_config_file_models_plus_repository_relative_to_the_config(tmp_path):
    layout(tmp_path / "deploy/models", {"m/1/model.onnx": "x"})
    cfg = tmp_path / "deploy" / "server.yaml"
    cfg.write_text(yaml.safe_dump({"server": {"port": 9000, "model_repository": "models"},
                                   "models": [{"name": "tiny", "path": "zoo:tiny_cnn"}]}))
    config = load_config(cfg)
    assert [m.name for m in config.models] == ["tiny", "m"]
    assert config.models[1].path == str((tmp_path / "deploy/models/m/1/model.onnx").resolve())
    # --model-repository wins over server.model_repository
    other = layout(tmp_path / "other", {"n/3/model.onnx": "x"})
    assert [(m.name, m.version) for m in load_config(cfg, str(other)).models] == [("tiny", 1), ("n", 3)]
    # a model both in the file and in the repository is configured twice
    cfg.write_text(yaml.safe_dump({"server": {"model_repository": "models"},
                                   "models": [{"name": "m", "path": "zoo:tiny_cnn"}]}))
    with pytest.raises(ConfigError, match=r"model 'm' version 1 is configured twice"):
        load_config(cfg)


def test_tensorrt_builds_from_onnx_and_relative_paths_in_model_config(tmp_path):
    repo = layout(tmp_path / "repo", {
        "r18_trt/config.yaml": yaml.safe_dump({
            "backend": "tensorrt", "instance_group": [{"count": 1, "kind": "KIND_GPU"}],
            "build": {"precision": "int8", "calibration_dir": "calib",
                      "profiles": [{"input": {"min": [1, 3, 224, 224], "opt": [8, 3, 224, 224],
                                              "max": [16, 3, 224, 224]}}]}}),
        "r18_trt/1/model.onnx": "x", "r18_trt/2/model.plan": "x", "r18_trt/2/model.onnx": "x"})
    entries = scan(repo)
    assert [Path(e["path"]).name for e in entries] == ["model.onnx", "model.plan"]  # the plan first when there
    assert entries[0]["build"]["calibration_dir"] == str(repo.resolve() / "r18_trt" / "calib")


@pytest.mark.parametrize("files, message", [
    ({"m/1/model.onnx": "x", "empty/README": "x"}, r"model directory '.*/empty' has no version directory"),
    ({"m/1/model.onnx": "x", "n/1/weights.bin": "x"}, r"'.*/n/1' has no model\.onnx"),
    ({"m/config.yaml": "backend: tensorrt\n", "m/1/other.onnx": "x"}, r"'.*/m/1' has no model\.plan or model\.onnx"),
    ({"m/config.yaml": "name: other\npath: x.onnx\n", "m/1/model.onnx": "x"},
     r"name, path come\(s\) from the directory layout"),
    ({"m/config.yaml": "max_batch_size: [\n", "m/1/model.onnx": "x"}, r"config\.yaml' is not valid YAML"),
    ({"m/config.yaml": "max_batch_size: 4\nmax_batch_size: 8\n", "m/1/model.onnx": "x"},
     r"(?s)config\.yaml' is not valid YAML: .*found the key 'max_batch_size' twice"),
    ({"m/config.yaml": "- 1\n", "m/1/model.onnx": "x"}, r"expected a mapping of model settings"),
    ({"1/model.onnx": "x", "2/model.onnx": "x"}, r"it is one model's directory; pass the directory above it"),
    ({"README.md": "x"}, r"holds no model directory"),
])
def test_layout_errors_name_the_directory(tmp_path, files, message):
    repo = layout(tmp_path / "repo", files)
    with pytest.raises(ConfigError, match=message):
        load_config(None, str(repo))


def test_missing_repository_and_invalid_settings_are_reported(tmp_path):
    with pytest.raises(ConfigError, match=r"model repository '.*nowhere' is not a directory"):
        load_config(None, str(tmp_path / "nowhere"))
    repo = layout(tmp_path / "repo", {"a/1/model.onnx": "x", "b/config.yaml": "max_batch_size: -3\n",
                                      "b/1/model.onnx": "x"})
    with pytest.raises(ConfigError) as err:
        load_config(None, str(repo))
    text = str(err.value)
    # the validation error names models[i]; the message maps models[i] to the repository's directories
    assert "models[1].max_batch_size" in text and "(got -3)" in text
    assert "models[0] = a/1, models[1] = b/1" in text
