"""Config validation messages, signature checks and the command line."""

from __future__ import annotations

import numpy as np
import pytest

from batcher.config import load_config, parse_config
from batcher.errors import ConfigError, InvalidInput
from batcher.signature import ModelSignature
from engines.base import Engine, TensorSpec


def test_default_config_serves_the_six_zoo_models():
    cfg = load_config()
    assert [m.name for m in cfg.models] == ["ppocr_det", "ppocr_cls", "ppocr_rec", "tiny_cnn", "mid_cnn", "resnet18"]
    assert all(m.path == f"zoo:{m.name}" for m in cfg.models)
    dims = {m.name: m.inputs[0].dims for m in cfg.models if m.inputs}
    assert dims == {"ppocr_det": [3, -1, -1], "ppocr_cls": [3, 48, 192], "ppocr_rec": [3, 48, -1]}


@pytest.mark.parametrize(
    "models,fragment",
    [
        ([{"name": "a", "path": "p", "max_batch_size": -1}], "models[0].max_batch_size: Input should be greater than"
                                                             " or equal to 0 (got -1)"),
        ([{"name": "a", "path": "p", "max_batch_size": 0, "dynamic_batching": {"max_queue_delay_microseconds": 100}}],
         "max_batch_size 0 (no batch dimension) runs each request alone"),
        ([{"name": "a", "path": "p", "max_batch_size": 0, "dynamic_batching": {"preferred_batch_size": [1]}}],
         "preferred_batch_size and max_queue_delay_microseconds need max_batch_size >= 1"),
        ([{"name": "a", "path": "p"}, {"name": "b", "path": "p", "instance_group": [{"count": "two"}]}],
         "models[1].instance_group[0].count:"),
        ([{"name": "a", "path": "p", "dynamic_batching": {"max_queue_delay_microseconds": -5}}],
         "models[0].dynamic_batching.max_queue_delay_microseconds"),
        ([{"name": "a", "path": "p", "instance_group": [{"kind": "KIND_CPU", "gpus": [0]}]}],
         "gpus apply to kind KIND_GPU only"),
        ([{"name": "a", "path": "p", "instance_group": [{"kind": "KIND_GPU"}, {"kind": "KIND_CPU"}]}],
         "every group of a model must have the same kind"),
        ([{"name": "a", "path": "p", "colour": "red"}], "models[0].colour: Extra inputs are not permitted"),
        ([{"name": "a b", "path": "p"}], "models[0].name: model name must match"),
        ([{"name": "a", "path": "p", "max_batch_size": 4, "dynamic_batching": {"preferred_batch_size": [8]}}],
         "exceeds max_batch_size 4"),
        ([{"name": "a", "path": "p"}, {"name": "a", "path": "q"}], "configured twice"),
        ([{"name": "a", "path": "p", "fallback": "zzz"}], "models[0].fallback: 'zzz' is not another configured model"),
        ([{"name": "a", "path": "p", "inputs": [{"name": "x", "dims": [0]}]}], "models[0].inputs[0].dims"),
        ([], "models: List should have at least 1 item"),
    ],
)
def test_bad_values_are_reported_with_path_and_value(models, fragment):
    with pytest.raises(ConfigError) as exc:
        parse_config({"models": models})
    assert fragment in str(exc.value)


@pytest.mark.parametrize("old,new", [
    ({"instances": 2}, "use instance_group[].count"),
    ({"device": "cuda"}, "use instance_group[].kind"),
    ({"max_queue_delay_us": 100}, "use dynamic_batching.max_queue_delay_microseconds"),
    ({"preferred_batch_sizes": [4]}, "use dynamic_batching.preferred_batch_size"),
    ({"max_queue_size": 4}, "use dynamic_batching.default_queue_policy.max_queue_size"),
    ({"timeout_ms": 5}, "use dynamic_batching.default_queue_policy.default_timeout_microseconds"),
    ({"priority_levels": 2}, "use dynamic_batching.priority_levels"),
    ({"max_priority_wait_ms": 2}, "use dynamic_batching.max_priority_wait_microseconds"),
    ({"dynamic_batching": {"max_queue_delay_us": 5}}, "use dynamic_batching.max_queue_delay_microseconds"),
])
def test_keys_of_the_old_format_name_their_new_place(old, new):
    with pytest.raises(ConfigError) as exc:
        parse_config({"models": [{"name": "a", "path": "p", **old}]})
    assert new in str(exc.value)


def test_instance_groups_place_count_contexts_on_each_gpu():
    m = parse_config({"models": [{"name": "a", "path": "p", "instance_group": [
        {"count": 2, "kind": "KIND_GPU", "gpus": [0, 1]}, {"count": 1, "kind": "KIND_GPU", "gpus": [1]}]}]}).models[0]
    assert m.placements == [0, 0, 1, 1, 1] and m.instances == 5 and m.device == "cuda"
    cpu = parse_config({"models": [{"name": "a", "path": "p"}]}).models[0]
    assert cpu.placements == [0] and cpu.device == "cpu" and cpu.default_timeout_s is None


def test_relative_model_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "c.yaml").write_text("models:\n  - {name: m, path: models/m.onnx}\n  - {name: z, path: 'zoo:tiny_cnn'}\n")
    monkeypatch.chdir("/")
    cfg = load_config(tmp_path / "conf" / "c.yaml")
    assert cfg.models[0].path == str(tmp_path / "conf" / "models" / "m.onnx")
    assert cfg.models[1].path == "zoo:tiny_cnn"


class ProfileEngine(Engine):
    """A pure-logic engine with an optimization-profile maximum (what TensorRT engines report)."""

    backend = "stub"

    def __init__(self, max_batch: int | None, shape=(-1, 3, -1, -1)) -> None:
        self._max = max_batch
        self._in = (TensorSpec("x", "FP32", shape),)

    inputs = property(lambda self: self._in)
    outputs = property(lambda self: (TensorSpec("y", "FP32", (-1, 10)),))
    max_batch_size = property(lambda self: self._max)
    nbytes = property(lambda self: 0)

    def create_context(self):
        raise NotImplementedError

    def release(self) -> None:
        pass


def _model(**kw):
    return parse_config({"models": [{"name": "m", "path": "p", **kw}]}).models[0]


def test_max_batch_above_the_profile_is_rejected_with_its_numbers():
    with pytest.raises(ConfigError, match=r"models\[1\].max_batch_size: 64 exceeds the engine profile maximum 32"):
        ModelSignature.build(ProfileEngine(32), _model(max_batch_size=64), "models[1]")
    assert ModelSignature.build(ProfileEngine(32), _model(), "models[1]").max_batch_size == 32
    assert ModelSignature.build(ProfileEngine(None), _model(), "models[1]").max_batch_size == 8


def test_a_model_with_a_fixed_first_dim_is_served_without_a_batch_dim():
    """Triton's max_batch_size 0: by default for a fixed first dim, or when the config says so; shapes are full
    shapes, every request is one execution (1 "row"); asking such a model to batch is an error."""
    fixed = ProfileEngine(0, shape=(2, 3))
    for cfg in (_model(), _model(max_batch_size=0)):
        sig = ModelSignature.build(fixed, cfg, "m")
        assert (sig.max_batch_size, sig.batched) == (0, False)
        assert sig.inputs[0].shape == (2, 3) and sig.outputs[0].shape == (-1, 10)  # outputs as the model says
        assert sig.check("m", {"x": np.zeros((2, 3), np.float32)}) == 1
        with pytest.raises(InvalidInput, match=r"shape \[1, 2, 3\] does not match the model's \[2, 3\]"):
            sig.check("m", {"x": np.zeros((1, 2, 3), np.float32)})
        with pytest.raises(InvalidInput, match=r"shape \[4, 3\] does not match the model's \[2, 3\]"):
            sig.check("m", {"x": np.zeros((4, 3), np.float32)})
    with pytest.raises(ConfigError, match=r"m.max_batch_size: 4, but the model's first dimension is fixed \(\[2, 3\]\)"
                                          r".*set max_batch_size: 0"):
        ModelSignature.build(fixed, _model(max_batch_size=4), "m")
    with pytest.raises(ConfigError, match="has no batch dimension .* there is no window"):
        ModelSignature.build(fixed, _model(dynamic_batching={"max_queue_delay_microseconds": 100}), "m")
    # max_batch_size 0 on a model whose first dim is dynamic: that dim is an ordinary one, declared dims are full
    dynamic = ProfileEngine(None, shape=(-1, 3))
    sig = ModelSignature.build(dynamic, _model(max_batch_size=0, inputs=[{"name": "x", "dims": [-1, 3]}]), "m")
    assert sig.inputs[0].shape == (-1, 3) and sig.check("m", {"x": np.zeros((7, 3), np.float32)}) == 1
    with pytest.raises(ConfigError, match=r"inputs\[0\].dims: \[3\] has 1 dims, the model's input 'x' has 2 \(no batch"):
        ModelSignature.build(dynamic, _model(max_batch_size=0, inputs=[{"name": "x", "dims": [3]}]), "m")
    scalar = ProfileEngine(0, shape=())
    assert ModelSignature.build(scalar, _model(), "m").check("m", {"x": np.float32(1.0).reshape(())}) == 1
    with pytest.raises(ConfigError, match="is a scalar; batching needs a batch dimension"):
        ModelSignature.build(ProfileEngine(None, shape=()), _model(), "m")


def test_fixed_dims_are_checked_in_a_few_comparisons_and_every_refusal_keeps_its_message():
    """A model whose dims past the batch dim are all fixed takes check()'s short path; whatever it does not
    accept falls through to the full check, so the message is the one every other model gets."""
    sig = ModelSignature.build(ProfileEngine(None, shape=(-1, 3)), _model(max_batch_size=4), "m")
    assert sig._fixed_inputs == (("x", np.dtype(np.float32), (3,)),)
    assert [sig.check("m", {"x": np.zeros((n, 3), np.float32)}) for n in (1, 4)] == [1, 4]
    refusals = [
        ({"x": np.zeros((2, 3), np.float64)}, "datatype FP64 does not match the model's FP32"),
        ({"x": np.zeros((2, 4), np.float32)}, r"shape \[2, 4\] does not match the model's \[-1, 3\]"),
        ({"x": np.zeros((2, 3, 1), np.float32)}, r"shape \[2, 3, 1\] does not match"),
        ({"x": np.zeros((0, 3), np.float32)}, "the batch dimension must be at least 1, got 0"),
        ({"x": np.zeros((5, 3), np.float32)}, "request of 5 rows exceeds max_batch_size 4"),
        ({"z": np.zeros((1, 3), np.float32)}, "unknown input 'z'"),
        ({"x": np.zeros((1, 3), np.float32), "z": np.zeros((1, 3), np.float32)}, "unknown input 'z'"),
    ]
    for inputs, message in refusals:
        with pytest.raises(InvalidInput, match=message):
            sig.check("m", inputs)
    # a dim left open, or BYTES: the full check every time
    assert ModelSignature.build(ProfileEngine(None), _model(), "m")._fixed_inputs is None


def test_declared_dims_narrow_and_must_agree_with_the_model():
    sig = ModelSignature.build(ProfileEngine(None), _model(inputs=[{"name": "x", "dims": [3, 48, -1]}]), "m")
    assert sig.inputs[0].shape == (-1, 3, 48, -1)
    with pytest.raises(ConfigError, match=r"inputs\[0\].dims\[0\]: 4 contradicts the model's fixed size 3"):
        ModelSignature.build(ProfileEngine(None), _model(inputs=[{"name": "x", "dims": [4, 48, -1]}]), "m")
    with pytest.raises(ConfigError, match="has 2 dims"):
        ModelSignature.build(ProfileEngine(None), _model(inputs=[{"name": "x", "dims": [3, 48]}]), "m")
    with pytest.raises(ConfigError, match="model has no input 'z'"):
        ModelSignature.build(ProfileEngine(None), _model(inputs=[{"name": "z", "dims": [3]}]), "m")
    with pytest.raises(InvalidInput, match=r"shape \[1, 3, 32, 8\] does not match the model's \[-1, 3, 48, -1\]"):
        sig.check("m", {"x": np.zeros((1, 3, 32, 8), np.float32)})
    assert sig.check("m", {"x": np.zeros((5, 3, 48, 8), np.float32)}) == 5


def test_dims_multiple_of_refuses_other_sizes_with_400_and_is_checked_against_the_dims():
    """PP-OCR's detector runs only at heights and widths that are multiples of 32: dims_multiple_of says so, and a
    request of another size is a 400 naming the rule, not an engine failure (500)."""
    cfg = _model(inputs=[{"name": "x", "dims": [3, -1, -1], "dims_multiple_of": [1, 32, 32]}])
    sig = ModelSignature.build(ProfileEngine(None), cfg, "m")
    assert sig.multiples == {"x": (1, 1, 32, 32)}
    assert sig.check("m", {"x": np.zeros((2, 3, 736, 1280), np.float32)}) == 2
    with pytest.raises(InvalidInput, match=r"input 'x': shape \[1, 3, 720, 1280\]: the model's dims \[3, -1, -1\] "
                                           r"must be multiples of \[1, 32, 32\] \(its config's dims_multiple_of\)"):
        sig.check("m", {"x": np.zeros((1, 3, 720, 1280), np.float32)})
    with pytest.raises(ConfigError, match=r"inputs\[0\].dims_multiple_of: \[32, 32\] has 2 dims, the input has 3"):
        ModelSignature.build(ProfileEngine(None), _model(inputs=[{"name": "x", "dims_multiple_of": [32, 32]}]), "m")
    with pytest.raises(ConfigError, match=r"dims_multiple_of\[0\]: the input's fixed size 3 is not a multiple of 2"):
        ModelSignature.build(ProfileEngine(None), _model(inputs=[{"name": "x", "dims_multiple_of": [2, 1, 1]}]), "m")
    with pytest.raises(ConfigError, match="dims_multiple_of must be positive"):
        _model(inputs=[{"name": "x", "dims_multiple_of": [1, 0, 1]}])


def test_onnxruntime_models_reject_tensorrt_options():
    with pytest.raises(ConfigError, match="build and runtime apply to backend tensorrt only"):
        parse_config({"models": [{"name": "m", "path": "p", "runtime": "lean"}]})


@pytest.mark.parametrize(
    "doc,fragment",
    [
        ({"server": {"memory_budget_mb": 100}}, "memory_budget_mb applies to load_strategy lru only, not eager"),
        ({"server": {"load_strategy": "lru"}}, "load_strategy lru needs memory_budget_mb"),
        ({"server": {"repository_token": "x"}}, "repository_token is set but repository_api is false"),
        ({"models": [{"name": "m", "path": "p", "fallback_queue_depth": 3}]}, "fallback_queue_depth needs a fallback"),
        ({"models": [{"name": "m", "path": "p", "version_policy": {"specific": [7]}}]},
         "models[0].version_policy: versions [7] of 'm' are not configured"),
        ({"models": [{"name": "m", "path": "p", "version_policy": {"latest": 1}},
                     {"name": "m", "version": 2, "path": "p"}]}, "set it on the highest version of 'm'"),
    ],
)
def test_loading_and_routing_options_are_checked(doc, fragment):
    doc = {"models": [{"name": "m", "path": "p"}], **doc}
    with pytest.raises(ConfigError) as exc:
        parse_config(doc)
    assert fragment in str(exc.value)


def test_the_repository_token_may_come_from_a_file_and_never_from_both(tmp_path):
    server = {"repository_api": True, "repository_token_file": str(tmp_path / "token")}
    doc = {"server": server, "models": [{"name": "m", "path": "p"}]}
    with pytest.raises(ConfigError, match=r"repository_token_file '.*token' cannot be read: No such file"):
        parse_config(doc)
    (tmp_path / "token").write_text(" \n")
    with pytest.raises(ConfigError, match=r"repository_token_file '.*token' is empty"):
        parse_config(doc)
    (tmp_path / "token").write_text("s3cret\n")
    assert parse_config(doc).server.repository_token == "s3cret"
    with pytest.raises(ConfigError, match="set repository_token or repository_token_file, not both"):
        parse_config({**doc, "server": {**server, "repository_token": "x"}})
    (tmp_path / "token").write_text("ab\ncd\n")  # a token no header can carry
    with pytest.raises(ConfigError, match="repository_token must be one or more printable ASCII characters"):
        parse_config(doc)


@pytest.mark.parametrize("token", ["", "  ", "a b", "caf\u00e9"])
def test_a_repository_token_no_client_can_send_is_refused(token):
    doc = {"server": {"repository_api": True, "repository_token": token}, "models": [{"name": "m", "path": "p"}]}
    with pytest.raises(ConfigError, match="repository_token must be one or more printable ASCII characters") as exc:
        parse_config(doc)
    assert repr(token) not in str(exc.value)  # a secret: never in a message or a log


def test_a_relative_repository_token_file_is_taken_from_the_config_files_folder(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "token").write_text("s3cret\n")
    (tmp_path / "conf" / "server.yaml").write_text(
        "server: {repository_api: true, repository_token_file: token}\nmodels: [{name: m, path: p.onnx}]\n")
    monkeypatch.chdir(tmp_path)
    assert load_config(tmp_path / "conf" / "server.yaml").server.repository_token == "s3cret"


def test_uvloop_without_uvloop_installed_is_a_config_error_at_load(monkeypatch):
    """server.event_loop: uvloop on a machine without uvloop fails when the config loads (one message, exit 2),
    not inside each process multi-process mode has already started."""
    import importlib.util

    doc = {"server": {"event_loop": "uvloop"}, "models": [{"name": "m", "path": "zoo:tiny_cnn"}]}
    assert parse_config(doc).server.event_loop == "uvloop"  # installed here (extra "test")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a))
    with pytest.raises(ConfigError, match=r"event_loop uvloop: uvloop is not installed"):
        parse_config(doc)


def test_the_inflight_body_budget_is_1_gib_never_below_max_body_bytes():
    """server.max_inflight_body_bytes: 1 GiB by default, max_body_bytes when that is larger; set below it: an error
    (a body under the limit could never be read)."""
    M = [{"name": "a", "path": "p"}]
    assert parse_config({"models": M}).server.max_inflight_body_bytes == 1 << 30
    assert parse_config({"server": {"max_body_bytes": 3 << 30}, "models": M}).server.max_inflight_body_bytes == 3 << 30
    assert parse_config({"server": {"max_body_bytes": 2048, "max_inflight_body_bytes": 2048},
                         "models": M}).server.max_inflight_body_bytes == 2048
    with pytest.raises(ConfigError, match=r"max_inflight_body_bytes \(4096\) is below max_body_bytes \(8192\)"):
        parse_config({"server": {"max_body_bytes": 8192, "max_inflight_body_bytes": 4096}, "models": M})


def test_the_gil_switch_interval_is_200_us_by_default_and_applied_in_microseconds():
    """server.gil_switch_interval_us: 200 (measured on the H200, bench.gpu_scale part s), null keeps Python's own;
    the processes that run executors apply it with sys.setswitchinterval (seconds)."""
    import sys

    from batcher.supervisor import set_switch_interval

    M = [{"name": "a", "path": "p"}]
    assert parse_config({"models": M}).server.gil_switch_interval_us == 200
    assert parse_config({"server": {"gil_switch_interval_us": None}, "models": M}).server.gil_switch_interval_us is None
    with pytest.raises(ConfigError, match=r"gil_switch_interval_us"):
        parse_config({"server": {"gil_switch_interval_us": 5}, "models": M})
    before = sys.getswitchinterval()
    try:
        set_switch_interval(200)
        assert sys.getswitchinterval() == pytest.approx(200e-6)
        set_switch_interval(None)  # keeps what is set
        assert sys.getswitchinterval() == pytest.approx(200e-6)
    finally:
        sys.setswitchinterval(before)


def test_a_serving_process_freezes_its_start_up_heap_and_collects_its_youngest_objects_less_often():
    """batcher.supervisor.freeze_heap (engine processes, front ends and the single process, once started): the
    objects alive then go to the permanent generation and the first threshold is GC_THRESHOLD0; run in a child
    process, not in this one."""
    import subprocess
    import sys

    code = ("import gc; from batcher.supervisor import freeze_heap, GC_THRESHOLD0; t = gc.get_threshold(); "
            "assert gc.get_freeze_count() == 0; freeze_heap(); "
            "print(gc.get_freeze_count() > 1000, gc.get_threshold() == (GC_THRESHOLD0, *t[1:]), GC_THRESHOLD0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "10000"]


def test_a_config_error_shows_the_value_once_and_never_a_whole_section():
    """A fresh user's find: ``got 'a/b' (got 'a/b')``, and a rule across server keys printing the whole section."""
    with pytest.raises(ConfigError) as exc:
        parse_config({"models": [{"name": "a/b", "path": "p"}]})
    assert str(exc.value).count("'a/b'") == 1
    with pytest.raises(ConfigError) as exc:
        parse_config({"server": {"engine_processes": "per_model", "load_strategy": "lru", "memory_budget_mb": 100},
                      "models": [{"name": "a", "path": "p"}]})
    assert str(exc.value).endswith("no process could unload one model for another")
    with pytest.raises(ConfigError) as exc:
        parse_config({"models": [{"name": "a", "path": "p", "max_batch_size": -3}]})
    assert "models[0].max_batch_size" in str(exc.value) and "(got -3)" in str(exc.value)
    # a value that is only part of a number in the message is still shown (10 in "... equal to 1024": a fresh
    # user's find)
    with pytest.raises(ConfigError) as exc:
        parse_config({"server": {"max_inflight_body_bytes": 10}, "models": [{"name": "a", "path": "p"}]})
    assert str(exc.value).endswith(
        "server.max_inflight_body_bytes: Input should be greater than or equal to 1024 (got 10)")


def test_a_key_given_twice_is_an_error_not_the_last_one_silently(tmp_path):
    """PyYAML keeps the last of two equal keys; a config whose second max_batch_size overrode the first ran with it
    unnoticed. Nested mappings and YAML merge keys (``<<``) are unaffected."""
    path = tmp_path / "c.yaml"
    path.write_text("models:\n  - {name: m, path: zoo:tiny_cnn, max_batch_size: 4, max_batch_size: 8}\n")
    with pytest.raises(ConfigError, match=r"(?s)is not valid YAML: .*found the key 'max_batch_size' twice"):
        load_config(path)
    path.write_text("base: &b {max_batch_size: 4}\nmodels:\n  - {<<: *b, name: m, path: zoo:tiny_cnn}\n")
    with pytest.raises(ConfigError, match="base"):  # merged fine; the unknown top-level key is what is refused
        load_config(path)


@pytest.mark.parametrize("triton,ours", [({"latest": {"num_versions": 2}}, {"latest": 2}), ({"all": {}}, "all"),
                                         ({"specific": {"versions": [1]}}, {"specific": [1]})])
def test_tritons_version_policy_spellings_are_taken_as_ours(triton, ours):
    models = [{"name": "m", "path": "p", "version": v} for v in (1, 2)]
    got = parse_config({"models": [models[0], {**models[1], "version_policy": triton}]}).models[1].version_policy
    assert got == parse_config({"models": [models[0], {**models[1], "version_policy": ours}]}).models[1].version_policy
