"""Triton's model-config JSON both ways: the generator, and the mapping back that a repository load with
``parameters.config`` applies (round trip, each supported field, what is refused and how it is named)."""

from __future__ import annotations

import json

import pytest

from batcher.config import parse_config
from batcher.errors import InvalidInput
from batcher.signature import ModelSignature
from batcher.triton_config import apply_model_config, model_config_json
from engines.base import TensorSpec


def _cfg(**kw):
    return parse_config({"models": [{"name": "m", "path": "p.onnx", **kw}]}).models[0]


def _sig(max_batch_size: int = 8) -> ModelSignature:
    batched = max_batch_size > 0
    x = TensorSpec("x", "FP32", (-1, 3, -1) if batched else (3, -1))
    y = TensorSpec("y", "INT64", (-1, 10) if batched else (10,))
    return ModelSignature((x,), (y,), max_batch_size)


CONFIGS = [
    ({}, 8),
    ({"max_batch_size": 16, "intra_op_threads": 2, "instance_group": [{"count": 3}],
      "dynamic_batching": {"max_queue_delay_microseconds": 500, "preferred_batch_size": [4, 8], "priority_levels": 3,
                           "default_queue_policy": {"max_queue_size": 9, "default_timeout_microseconds": 7000}},
      "inputs": [{"name": "x", "dims": [3, 48], "warmup_dims": [3, 48]}]}, 16),
    ({"dynamic_batching": {"priority_levels": 4, "default_priority_level": 1}}, 8),
    ({"instance_group": [{"count": 2, "kind": "KIND_GPU", "gpus": [0, 1]}]}, 8),
    ({"max_batch_size": 0}, 0),
    ({"version_policy": {"latest": 1}}, 8),
    # instance_group[].weight (routing.strategy weighted; this server's key): GET showed it, a load refused it
    ({"instance_group": [{"count": 2, "weight": 3}]}, 8),
    ({"instance_group": [{"kind": "KIND_GPU", "gpus": [0], "weight": 3},
                         {"kind": "KIND_GPU", "gpus": [1], "weight": 0}]}, 8),
]


@pytest.mark.parametrize("kw,max_batch", CONFIGS)
def test_the_generators_output_fed_back_changes_nothing(kw, max_batch):
    cfg = _cfg(**kw)
    doc = json.loads(json.dumps(model_config_json(cfg, _sig(max_batch))))  # as it travels: a JSON string
    assert apply_model_config(cfg, _sig(max_batch), doc) == cfg


def test_instance_groups_given_replace_the_models_weights_included_and_get_shows_the_weight_in_effect():
    """A load's ``instance_group`` replaces the model's groups as a whole (Triton's groups have no ``weight``: a group
    without one has the default weight 1, not the weight the model had); a load without ``instance_group`` keeps
    them. GET shows every group's weight as in effect, the default included (it showed none, so a reload that
    reset a weight to 1 looked the same as before)."""
    cfg = _cfg(instance_group=[{"count": 2, "weight": 3}])
    assert model_config_json(cfg, _sig())["instance_group"] == [
        {"name": "m_0", "count": 2, "kind": "KIND_CPU", "weight": 3}]
    kept = apply_model_config(cfg, _sig(), {"max_batch_size": 4})
    assert kept.instance_group == cfg.instance_group
    triton = apply_model_config(cfg, _sig(), {"instance_group": [{"name": "m_0", "count": 1, "kind": "KIND_CPU"}]})
    assert model_config_json(triton, _sig())["instance_group"] == [
        {"name": "m_0", "count": 1, "kind": "KIND_CPU", "weight": 1}]
    assert model_config_json(_cfg(), _sig())["instance_group"] == [
        {"name": "m_0", "count": 1, "kind": "KIND_CPU", "weight": 1}]
    zero = apply_model_config(cfg, _sig(), {"instance_group": [{"count": 2, "weight": 0}]})
    assert zero.instance_group[0].weight == 0  # a weight of 0 (no weighted requests) is a value, not "left out"


def test_triton_spells_64_bit_integers_as_strings_and_those_are_taken():
    cfg = apply_model_config(_cfg(), _sig(), {"dynamic_batching": {
        "max_queue_delay_microseconds": "2500", "default_queue_policy": {"max_queue_size": "12"}}})
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 2500
    assert cfg.dynamic_batching.default_queue_policy.max_queue_size == 12


def test_the_largest_64_bit_values_are_taken_and_their_config_encodes():
    """uint64's largest value is a valid Triton config, and GET /v2/models/{m}/config's JSON (orjson) encodes it."""
    import orjson

    cfg = apply_model_config(_cfg(), _sig(), {"dynamic_batching": {"default_queue_policy": {
        "default_timeout_microseconds": str(2 ** 64 - 1), "max_queue_size": str(2 ** 64 - 1)}}})
    doc = orjson.loads(orjson.dumps(model_config_json(cfg, _sig())))
    assert int(doc["dynamic_batching"]["default_queue_policy"]["default_timeout_microseconds"]) == 2 ** 64 - 1


def test_each_supported_field_changes_the_config():
    cfg = _cfg(dynamic_batching={"max_queue_delay_microseconds": 100, "admission_control": True})
    doc = {"max_batch_size": 4, "instance_group": [{"name": "m_0", "count": 2, "kind": "KIND_CPU"}],
           "dynamic_batching": {"max_queue_delay_microseconds": 3000, "preferred_batch_size": [2, 4],
                                "priority_levels": 3, "default_priority_level": 1,
                                "default_queue_policy": {"default_timeout_microseconds": 9000,
                                                         "allow_timeout_override": True, "timeout_action": "REJECT"},
                                "admission_control": False, "adaptive_queue_delay": True,
                                "max_priority_wait_microseconds": 5000},
           "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3, 64]}],
           "output": [{"name": "y", "data_type": "TYPE_INT64", "dims": [10]}],
           "parameters": {"intra_op_thread_count": {"string_value": "3"}}}
    new = apply_model_config(cfg, _sig(), doc)
    assert new.max_batch_size == 4 and new.instances == 2 and new.intra_op_threads == 3
    db = new.dynamic_batching
    assert (db.max_queue_delay_microseconds, db.preferred_batch_size, db.priority_levels, db.default_priority_level,
            db.max_priority_wait_microseconds, db.admission_control, db.adaptive_queue_delay) == \
        (3000, [2, 4], 3, 1, 5000, False, True)
    assert db.default_queue_policy.default_timeout_microseconds == 9000
    assert db.default_queue_policy.max_queue_size == 256  # not given: kept
    assert [(i.name, i.dims) for i in new.inputs] == [("x", [3, 64])]
    assert new.name == "m" and new.path == cfg.path


def test_fields_left_out_keep_their_values_and_triton_defaults_ask_for_nothing():
    cfg = _cfg(max_batch_size=4, dynamic_batching={"max_queue_delay_microseconds": 100})
    doc = {"instance_group": [{"count": 2, "kind": "KIND_CPU", "profile": [], "passive": False}],
           "dynamic_batching": {"preserve_ordering": False, "priority_levels": 0, "default_priority_level": 0,
                                "default_queue_policy": {"max_queue_size": 0}},  # Triton's "no limit"
           "optimization": {}, "model_warmup": [], "sequence_batching": None,
           "input": [{"name": "x", "dims": [3, -1], "format": "FORMAT_NONE", "is_shape_tensor": False}]}
    new = apply_model_config(cfg, _sig(4), doc)
    assert new.max_batch_size == 4 and new.dynamic_batching.max_queue_delay_microseconds == 100
    assert new.dynamic_batching.priority_levels == 1 and new.dynamic_batching.default_priority_level is None
    assert new.instances == 2 and new.inputs == []  # [3, -1] is what it serves already
    assert new.dynamic_batching.default_queue_policy.max_queue_size == 256  # bounded here: the bound it had


def test_unsupported_fields_are_refused_all_named_at_once():
    doc = {"optimization": {"priority": "PRIORITY_MAX"}, "sequence_batching": {"max_sequence_idle_microseconds": 5},
           "instance_group": [{"count": 1, "kind": "KIND_CPU", "rate_limiter": {"priority": 2}}],
           "dynamic_batching": {"preserve_ordering": True, "default_queue_policy": {"timeout_action": "DELAY"}},
           "input": [{"name": "x", "reshape": {"shape": [3]}}],
           "parameters": {"execution_mode": {"string_value": "1"}}}
    with pytest.raises(InvalidInput) as exc:
        apply_model_config(_cfg(), _sig(), doc)
    assert exc.value.message == (
        "parameters.config: fields this server does not support: optimization, sequence_batching, "
        "instance_group[0].rate_limiter, dynamic_batching.preserve_ordering, "
        "dynamic_batching.default_queue_policy.timeout_action: DELAY, input[0].reshape, parameters.execution_mode")


@pytest.mark.parametrize("doc,message", [
    ([], "parameters.config.: expected an object, got []"),
    ({"name": "other"}, "parameters.config.name: 'other' is not the model being loaded ('m')"),
    ({"platform": "tensorrt_plan"}, "parameters.config.platform: 'tensorrt_plan'; this model is served by "
                                    "'onnxruntime_onnx'"),
    ({"version_policy": {"latest": {"num_versions": 2}}}, "a load cannot change them"),
    ({"max_batch_size": "lots"}, "parameters.config.max_batch_size: expected an integer, got 'lots'"),
    ({"max_batch_size": True}, "parameters.config.max_batch_size: expected an integer, got True"),
    ({"max_batch_size": "1\u00b2"}, "parameters.config.max_batch_size: expected an integer, got '1\u00b2'"),
    ({"max_batch_size": -2}, "parameters.config: max_batch_size: Input should be greater than or equal to 0 "
                             "(got -2)"),
    ({"instance_group": {"count": 2}}, "parameters.config.instance_group: expected a list"),
    ({"instance_group": [{"count": 0}]}, "instance_group.0.count: Input should be greater than or equal to 1"),
    ({"instance_group": [{"kind": "KIND_AUTO"}]}, "instance_group.0.kind: Input should be 'KIND_CPU' or "
                                                  "'KIND_GPU'"),
    ({"instance_group": [{"weight": "heavy"}]}, "parameters.config.instance_group[0].weight: expected an integer, "
                                                "got 'heavy'"),
    ({"instance_group": [{"weight": -1}]}, "instance_group.0.weight: Input should be greater than or equal to 0"),
    ({"dynamic_batching": {"admission_control": "yes"}}, "dynamic_batching.admission_control: Input should be a "
                                                         "valid boolean"),
    ({"dynamic_batching": {"preferred_batch_size": [16]}}, "exceeds max_batch_size"),
    ({"max_batch_size": 0, "dynamic_batching": {"max_queue_delay_microseconds": 5}}, "max_batch_size 0 (no batch "
                                                                                     "dimension) runs each"),
    ({"input": [{"name": "z", "dims": [1]}]}, "parameters.config.input[0].name: the model has no input 'z' "
                                              "(inputs: ['x'])"),
    ({"input": [{"name": "x", "data_type": "TYPE_FP16"}]}, "input[0].data_type: 'TYPE_FP16'; the model's input "
                                                           "'x' is TYPE_FP32"),
    ({"input": [{"name": "x", "dims": "3x4"}]}, "parameters.config.input[0].dims: expected a list of integers"),
    ({"output": [{"name": "y", "dims": [11]}]}, "'y' dims [11] differ from the model's [10]"),
    ({"parameters": {"intra_op_thread_count": {"string_value": "many"}}}, "intra_op_thread_count.string_value: "
                                                                          "expected an integer"),
    # past 64 bits: accepted before, then every GET /v2/models/{m}/config was a 500 (orjson), a new user's report
    ({"dynamic_batching": {"default_queue_policy": {"default_timeout_microseconds": "99999999999999999999"}}},
     "default_timeout_microseconds: 99999999999999999999 does not fit in 64 bits"),
    ({"dynamic_batching": {"default_queue_policy": {"max_queue_size": 2 ** 64}}},
     "max_queue_size: 18446744073709551616 does not fit in 64 bits"),
])
def test_wrong_types_and_contradictions_are_400_naming_the_field(doc, message):
    with pytest.raises(InvalidInput) as exc:
        apply_model_config(_cfg(max_batch_size=8), _sig(), doc)
    assert message in exc.value.message


# ---------------------------------------------------------------------------------- round trip over the zoo models
def _zoo_models() -> list[dict]:
    """The zoo models of the embedded default config (``configs/default.yaml``) whose files this machine has (the
    PP-OCR ones come with ``rapidocr_onnxruntime``), and tiny_cnn again as three versions with a ``latest: 2``
    policy and instance group weights (``routing.strategy: weighted``)."""
    from batcher.config import load_config
    from engines.zoo import ZooError, resolve

    models = []
    for m in load_config().models:
        try:
            resolve(m.path)
        except ZooError:
            continue
        models.append(m.model_dump(exclude_defaults=True))
    versions = [{"name": "tiny_versions", "path": "zoo:tiny_cnn", "version": v, "max_batch_size": 4,
                 "instance_group": [{"count": 2, "weight": 3}, {"count": 1, "weight": 0}]} for v in (1, 2, 3)]
    versions[-1]["version_policy"] = {"latest": 2}
    # served versions that differ (a canary): loading the model's config back must not make them alike
    versions[1] |= {"max_batch_size": 8, "instance_group": [{"count": 1, "weight": 9}],
                    "dynamic_batching": {"max_queue_delay_microseconds": 300, "priority_levels": 2}}
    return [*models, *versions]


async def test_a_change_to_the_models_config_applies_to_every_version_and_keeps_what_differs_between_them():
    """A load's config is the model's as GET shows it (its highest served version): what it changes there is
    written over each version's own config. Versions 2 (weight 9, max 8, 2 priority levels) and 3 (weight 3 and 0,
    max 4): a new max_queue_delay_microseconds reaches both, and each keeps its own groups and batch sizes; a new
    max_batch_size too. Before, every version got version 3's whole document (a 90/10 canary became 50/50)."""
    from batcher.dataplane import DataPlane
    from batcher.metrics import Metrics

    config = parse_config({"routing": {"strategy": "weighted"},
                           "models": [m for m in _zoo_models() if m["name"] == "tiny_versions"]})
    dp = DataPlane(config, Metrics())
    await dp.start()
    try:
        shown = await dp.model_config("tiny_versions")
        before = {v: dp.repository.slot("tiny_versions", v).cfg for v in ("2", "3")}
        shown["dynamic_batching"]["max_queue_delay_microseconds"] = 700
        shown["max_batch_size"] = 6
        await dp.load("tiny_versions", json.loads(json.dumps(shown)))
        after = {v: dp.repository.slot("tiny_versions", v).cfg for v in ("2", "3")}
        for v in ("2", "3"):
            assert after[v].dynamic_batching.max_queue_delay_microseconds == 700
            assert after[v].max_batch_size == 6
            assert after[v].instance_group == before[v].instance_group
            assert after[v].dynamic_batching.priority_levels == before[v].dynamic_batching.priority_levels
        assert [g.weight for g in after["2"].instance_group] == [9]
        assert [g.weight for g in after["3"].instance_group] == [3, 0]
    finally:
        await dp.close()


async def test_get_config_loads_back_unchanged_for_every_zoo_model():
    """For every model: GET config, load with that config (as tritonclient sends it, a JSON string's content), GET
    config again: the same document for the model and for each of its served versions, and nothing reloaded.
    Before, the weights were refused (400) and a lower version's config was refused for its version_policy."""
    from batcher.dataplane import DataPlane
    from batcher.metrics import Metrics

    config = parse_config({"routing": {"strategy": "weighted"}, "models": _zoo_models()})
    dp = DataPlane(config, Metrics())
    await dp.start()
    try:
        names = list(dict.fromkeys(m.name for m in config.models))
        assert {"tiny_cnn", "mid_cnn", "resnet18", "tiny_versions"} <= set(names)
        for name in names:
            versions = dp.repository.served_versions(name)
            before = {v: await dp.model_config(name, v) for v in (None, *versions)}
            assert all(doc["version_policy"] == before[None]["version_policy"] for doc in before.values())
            cfgs = [dp.repository.slot(name, v).cfg for v in versions]
            await dp.load(name, json.loads(json.dumps(before[None])))
            assert [dp.repository.slot(name, v).cfg for v in versions] == cfgs, name
            assert {v: await dp.model_config(name, v) for v in (None, *versions)} == before, name
        assert [e["event"] for e in dp.repository.lifecycle.events] == ["load"] * sum(
            len(dp.repository.served_versions(n)) for n in names)  # the start's loads only
    finally:
        await dp.close()


def test_a_config_refused_by_a_rule_across_fields_says_so_without_an_empty_path_or_the_whole_config():
    """A new user's report: the message was ``parameters.config: : ... (got {the whole config as a dict})``."""
    cfg = _cfg(max_batch_size=8, dynamic_batching={"preferred_batch_size": [8, 2]})
    with pytest.raises(InvalidInput) as exc:
        apply_model_config(cfg, _sig(), {"max_batch_size": 4})
    assert exc.value.message == ("parameters.config: dynamic_batching.preferred_batch_size [8, 2] exceeds "
                                 "max_batch_size 4")
