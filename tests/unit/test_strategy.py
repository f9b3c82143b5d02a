"""Routing strategies (``routing.strategy``): the distribution each one gives, exactly, and the config that
selects them."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from batcher.config import parse_config
from batcher.errors import ConfigError
from batcher.strategy import Strategy, Target, least_queue, rendezvous
from batcher.topology import (DeviceOrder, Engine, default_frontends, engine_config, engine_devices, engine_slots,
                              engines, model_devices, model_engines, weight)

KEYS = [f"user-{i}" for i in range(1000)]
ROOT = Path(__file__).resolve().parents[2]


def picks(strategy: Strategy, targets: list[Target], n: int, key=None) -> str:
    names = "".join(t.id for t in targets)
    return "".join(names[strategy.choose("m", targets, key)] for _ in range(n))


def test_least_queue_takes_the_least_loaded_target_and_the_first_of_equals():
    assert least_queue([Target("a", load=3), Target("b", load=1), Target("c", load=2)]) == 1
    assert least_queue([Target("a", load=0), Target("b", load=0)]) == 0  # at low load one GPU serves: batches fill
    s = Strategy("least_queue")
    assert picks(s, [Target("a", load=2), Target("b", load=5)], 4) == "aaaa"


def test_weighted_gives_each_target_exactly_its_weight_in_every_round_interleaved():
    s = Strategy("weighted")
    assert picks(s, [Target("a", 3), Target("b", 1)], 12) == "aabaaabaaaba"  # 3:1 in every run of 4
    assert picks(s, [Target("a", 5), Target("b", 1), Target("c", 1)], 14) == "aabacaaaabacaa"  # 5:1:1 per 7
    counts = Counter(picks(s, [Target("x", 9), Target("y", 1)], 1000))
    assert counts == {"x": 900, "y": 100}  # a 10 % canary: exactly 100 of 1000
    assert picks(s, [Target("p", 1), Target("q", 0)], 5) == "ppppp"  # weight 0 takes nothing


def test_weighted_remembers_its_position_per_model():
    s = Strategy("weighted")
    ab = [Target("a", 1), Target("b", 1)]
    assert [s.choose("m1", ab), s.choose("m2", ab), s.choose("m1", ab), s.choose("m2", ab)] == [0, 0, 1, 1]


def test_hash_is_sticky_and_its_distribution_over_a_fixed_key_set_is_exact():
    s = Strategy("hash")
    gpus = [Target("resnet18/1@gpu0"), Target("resnet18/1@gpu1")]
    first = [s.choose("resnet18", gpus, k) for k in KEYS]
    assert [s.choose("resnet18", gpus, k) for k in KEYS] == first  # sticky
    other = subprocess.run(  # another process (front ends are processes; Python's own hash() is salted per process)
        [sys.executable, "-c", "from batcher.strategy import Target, rendezvous; "
         "print(''.join(str(rendezvous(f'user-{i}', [Target('resnet18/1@gpu0'), Target('resnet18/1@gpu1')])) "
         "for i in range(1000)))"], capture_output=True, text=True, check=True, cwd=ROOT)
    assert other.stdout.strip() == "".join(map(str, first))
    assert Counter(first) == {0: 518, 1: 482}
    weighted = [Target("m/1", 3), Target("m/2", 1)]
    assert Counter(rendezvous(k, weighted) for k in KEYS) == {0: 731, 1: 269}  # weight 3:1 -> about 3/4
    assert s.choose("m", gpus, None) == 0  # no key: as least_queue (loads equal: the first)


def test_hash_moves_only_the_keys_of_a_removed_target():
    three = [Target("g0"), Target("g1"), Target("g2")]
    before = [rendezvous(k, three) for k in KEYS]
    after = [rendezvous(k, three[:2]) for k in KEYS]
    assert Counter(before) == {1: 356, 0: 326, 2: 318}
    assert all(a == b for a, b in zip(before, after) if b != 2 and a != 2)
    assert sum(a != b for a, b in zip(before, after)) == 318  # exactly the keys g2 had


def test_strategy_spreads_over_versions_only_when_it_should():
    assert not Strategy("least_queue").spreads("k")
    assert Strategy("weighted").spreads(None)
    assert Strategy("hash").spreads("k") and not Strategy("hash").spreads(None)


@pytest.mark.parametrize("routing,fragment", [
    ({"strategy": "hash"}, "strategy hash needs exactly one of hash_header and hash_parameter"),
    ({"strategy": "hash", "hash_header": "X-A", "hash_parameter": "a"}, "exactly one of"),
    ({"strategy": "weighted", "hash_header": "X-A"}, "apply to strategy hash only, not weighted"),
    ({"strategy": "round_robin"}, "routing.strategy"),
])
def test_bad_routing_configs_are_reported(routing, fragment):
    with pytest.raises(ConfigError) as exc:
        parse_config({"routing": routing, "models": [{"name": "a", "path": "p"}]})
    assert fragment in str(exc.value)


def test_placement_weights_and_engine_processes_follow_the_instance_groups():
    config = parse_config({"models": [
        {"name": "r", "path": "p", "instance_group": [{"count": 2, "kind": "KIND_GPU", "gpus": [0, 1], "weight": 3},
                                                      {"count": 1, "kind": "KIND_GPU", "gpus": [1]}]},
        {"name": "c", "path": "p", "instance_group": [{"count": 2, "weight": 5}]},
        {"name": "c", "version": 2, "path": "p", "version_policy": {"latest": 1}},
    ]})
    r, c1, c2 = config.models
    assert r.placements == [0, 0, 1, 1, 1] and model_devices(r) == [0, 1]
    assert (weight(r, 0), weight(r, 1), weight(r)) == (3, 4, 7)
    assert (weight(c1), model_devices(c1)) == (5, [None])
    assert engine_devices(config) == [0, 1, None]  # one engine process per GPU, then one for the CPU models
    assert engines(config) == [Engine(0), Engine(1), Engine(None)]
    assert engine_slots(config, Engine(1)) == [("r", "1")]
    assert engine_slots(config, Engine(None)) == [("c", "2")]  # version 1 is not served (latest: 1)



def test_engine_processes_per_model_give_each_model_its_own_process_on_each_of_its_devices():
    """``engine_processes: per_model``: an engine process per (device, model name), in device then config order;
    every version of a model goes to its model's processes, a fallback to another model is dropped (it would be
    in another process), and the engine names say which model each serves."""
    config = parse_config({"server": {"engine_processes": "per_model"}, "models": [
        {"name": "a", "path": "p", "instance_group": [{"kind": "KIND_GPU", "gpus": [0, 1]}], "fallback": "b"},
        {"name": "b", "path": "p", "instance_group": [{"kind": "KIND_GPU", "gpus": [0]}]},
        {"name": "c", "path": "p"},
        {"name": "c", "version": 2, "path": "p"},
        {"name": "d", "path": "p", "fallback": "c"},
    ]})
    a, b, c1, c2, d = config.models
    assert engines(config) == [Engine(0, "a"), Engine(0, "b"), Engine(1, "a"), Engine(None, "c"), Engine(None, "d")]
    assert [e.name for e in engines(config)] == ["gpu0:a", "gpu0:b", "gpu1:a", "cpu:c", "cpu:d"]
    assert model_engines(config, a) == [Engine(0, "a"), Engine(1, "a")] and model_engines(config, b) == [Engine(0, "b")]
    assert model_engines(config, c1) == model_engines(config, c2) == [Engine(None, "c")]
    assert engine_slots(config, Engine(0, "b")) == [("b", "1")]
    assert engine_slots(config, Engine(None, "c")) == [("c", "1"), ("c", "2")]  # both versions, one process
    only_a = engine_config(config, Engine(0, "a"))
    assert [m.name for m in only_a.models] == ["a"] and only_a.models[0].fallback is None
    assert [m.name for m in engine_config(config, Engine(None, "c")).models] == ["c", "c"]
    # the default: one engine process per device, every model placed there
    per_device = parse_config({"models": [{"name": "a", "path": "p"}, {"name": "b", "path": "p"}]})
    assert engines(per_device) == [Engine(None)] and Engine(None).name == "cpu"
    assert engine_slots(per_device, Engine(None)) == [("a", "1"), ("b", "1")]


def test_engine_processes_per_model_refuse_lru():
    with pytest.raises(ConfigError) as exc:
        parse_config({"server": {"engine_processes": "per_model", "load_strategy": "lru", "memory_budget_mb": 100},
                      "models": [{"name": "a", "path": "p"}]})
    assert "per_model cannot be used with load_strategy lru" in str(exc.value)


def test_default_frontends_by_cores():
    assert [default_frontends(n) for n in (1, 2, 3, 4, 16, 64)] == [0, 0, 3, 4, 8, 8]


def test_an_engine_process_sees_its_gpu_first_and_translates_client_device_ids():
    """CUDA_VISIBLE_DEVICES pins the engine process to its GPU (every backend's device 0) and keeps the others
    visible, in the server's numbering (a CUDA shared-memory region names the client's device id)."""
    second = DeviceOrder(1, [0, 1])
    assert (second.visible, second.pinned) == ("1,0", True)
    assert [second.local(d) for d in (0, 1)] == [1, 0] and [second.client(d) for d in (0, 1)] == [1, 0]
    restricted = DeviceOrder(1, [0, 1], parent="4,6,7")  # the server itself sees physical GPUs 4, 6, 7
    assert restricted.visible == "6,4,7" and [restricted.local(d) for d in (0, 1, 2)] == [1, 0, 2]
    cpu = DeviceOrder(None, [0])
    assert not cpu.pinned and cpu.local(3) == 3


def test_a_containers_cpu_quota_bounds_the_cores_front_ends_are_counted_from(tmp_path):
    """A new user's doubt: a pod limited to 2 CPUs on a big node has the node's every core in its affinity, so the
    default would start 8 front ends where the README advises one process. The cgroup's CFS quota now bounds the
    count (v2 cpu.max, v1 cpu.cfs_quota_us), rounded up; no quota, or none readable, leaves the affinity."""
    import os

    from batcher.topology import cpu_quota_cores, usable_cores

    affinity = len(os.sched_getaffinity(0))
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cpu_quota_cores(v2) == 1.5 and usable_cores(v2) == min(affinity, 2)
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpu_quota_cores(v2) is None and usable_cores(v2) == affinity
    v1 = tmp_path / "v1" / "cpu,cpuacct"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota_cores(v1.parent) == 1.0 and usable_cores(v1.parent) == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota_cores(v1.parent) is None
    assert cpu_quota_cores(tmp_path / "nowhere") is None and usable_cores(tmp_path / "nowhere") == affinity


def test_hash_takes_a_key_that_is_not_utf8():
    """A header's bytes that are not UTF-8 reach the strategy as surrogates (aiohttp's decoding): a 500 before (a new
    user's report); now they hash as those bytes, stickily."""
    targets = [Target("m/1", 1.0, 0), Target("m/2", 1.0, 0)]
    key = b"\xff\xfe".decode("utf-8", "surrogateescape")
    assert rendezvous(key, targets) == rendezvous(key, targets) in (0, 1)
