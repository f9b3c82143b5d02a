"""Allowed batch sizes and the GPU options, batcher side (issue 9): the config rules, the batch plan that prefers
exact allowed sizes, padding in the executor (padding rows never reach a client), the padded-rows metric, the
loader's engine options and warm-up sizes, metadata/config, and the lru budget counting device memory.

The contexts are :class:`fakes.FakeContext` made GPU-like: prepared for a tuple of batch sizes (any other first
dimension is an EngineError), staging inputs in one reused host buffer that starts as NaN and stays dirty between
batches, so a pad row that is not zeroed shows.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from fakes import MiB, FakeContext, FakeEngine, FakeLoader, SleepExecutor, model_config, rows, signature

from batcher.batch_sizes import allowed_batch_sizes, default_batch_sizes, padded_size
from batcher.batching import Pending, State, plan_batch, shape_key, stack_inputs
from batcher.config import parse_config
from batcher.dataplane import DataPlane
from batcher.errors import ConfigError
from batcher.batch_steps import execute_batch
from batcher.loader import engine_options, planned_batch_sizes, warmup_batch_sizes
from batcher.metrics import Metrics
from batcher.repository import READY, UNAVAILABLE, ModelRepository
from batcher.scheduler import ModelRunner
from batcher.signature import ModelSignature

GPU = [{"count": 1, "kind": "KIND_GPU"}]


# ---------------------------------------------------------------- config
def test_the_default_is_powers_of_two_plus_the_max_on_gpu_and_none_on_cpu():
    assert default_batch_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert default_batch_sizes(24) == (1, 2, 4, 8, 16, 24)
    assert default_batch_sizes(1) == (1,) and default_batch_sizes(2) == (1, 2)
    assert allowed_batch_sizes(model_config(max_batch_size=32, instance_group=GPU), 32) == (1, 2, 4, 8, 16, 32)
    assert allowed_batch_sizes(model_config(max_batch_size=32), 32) is None  # CPU: off unless configured
    assert allowed_batch_sizes(model_config(max_batch_size=8, allowed_batch_sizes=[2, 8]), 8) == (2, 8)


def test_a_model_without_a_batch_dimension_has_no_batch_sizes_on_gpu_either():
    """``max_batch_size: 0`` on KIND_GPU: each request runs alone at its own shape, so there is nothing to pad to
    (the sizes were ``(0,)``, which the engine refused: such a model could never load, a new user's report)."""
    cfg = model_config(max_batch_size=0, instance_group=GPU)
    assert allowed_batch_sizes(cfg, 0) is None and planned_batch_sizes(cfg) is None
    assert "batch_sizes" not in engine_options(cfg, planned_batch_sizes(cfg))  # the engine default: none


@pytest.mark.parametrize("sizes, max_batch, fragment", [
    ([4, 2, 8], 8, "must be sorted ascending without repeats, got [4, 2, 8]"),
    ([1, 1, 8], 8, "must be sorted ascending without repeats"),
    ([0, 8], 8, "must be >= 1, got [0, 8]"),
    ([1, 16], 8, "allowed_batch_sizes [1, 16] exceed max_batch_size 8"),
    ([1, 4], 8, "allowed_batch_sizes [1, 4] must contain max_batch_size 8"),
    ([], 8, "must not be empty"),
    # without max_batch_size the list's own rules still apply when the config is read (check-config without
    # --load passed [4, 2] and serve then refused it: a new user's report)
    ([4, 2], None, "must be sorted ascending without repeats, got [4, 2]"),
    ([0, 8], None, "must be >= 1, got [0, 8]"),
])
def test_an_explicit_list_is_checked_and_the_error_names_the_problem(sizes, max_batch, fragment):
    with pytest.raises(ConfigError) as err:
        model_config(allowed_batch_sizes=sizes, **({} if max_batch is None else {"max_batch_size": max_batch}))
    assert "models[0]" in str(err.value) and fragment in str(err.value)


def test_without_max_batch_size_the_list_is_checked_against_the_default_max_at_load():
    cfg = model_config(allowed_batch_sizes=[1, 2, 4, 16])  # valid on its own; the default max is 8
    with pytest.raises(ConfigError, match=r"models\[3\]\.allowed_batch_sizes: allowed_batch_sizes \[1, 2, 4, 16\] "
                                          r"exceed max_batch_size 8 \(max_batch_size is not set: 8 is its default\)"):
        ModelSignature.build(FakeEngine(), cfg, "models[3]")
    assert ModelSignature.build(FakeEngine(), model_config(allowed_batch_sizes=[2, 8]), "m").allowed_batch_sizes == (2, 8)


def test_precision_defaults_to_tf32_on_gpu_and_fp32_on_cpu():
    assert model_config(instance_group=GPU).effective_precision == "tf32"
    assert model_config().effective_precision == "fp32"
    assert model_config(instance_group=GPU, precision="fp16").effective_precision == "fp16"
    assert model_config(precision="fp32").effective_precision == "fp32"


@pytest.mark.parametrize("keys, fragment", [
    ({"precision": "tf32"}, "precision tf32 needs instance_group kind KIND_GPU"),
    ({"precision": "fp16"}, "precision fp16 needs instance_group kind KIND_GPU"),
    ({"precision": "bf16"}, "precision: Input should be 'fp32', 'tf32' or 'fp16'"),
    ({"gpu_memory_limit_mb": 512.0}, "gpu_memory_limit_mb applies to backend onnxruntime with instance_group kind "
                                     "KIND_GPU only"),
    ({"arena_extend_strategy": "kSameAsRequested"}, "arena_extend_strategy applies to backend onnxruntime"),
    ({"gpu_execution": "graphs"}, "gpu_execution applies to backend onnxruntime"),
    ({"instance_group": GPU, "arena_extend_strategy": "kNextPowerOf2"},
     "Input should be 'kNextPowerOfTwo' or 'kSameAsRequested'"),
    ({"instance_group": GPU, "gpu_memory_limit_mb": 0.0}, "gpu_memory_limit_mb: Input should be greater than 0"),
    ({"instance_group": GPU, "backend": "tensorrt", "precision": "fp16"},
     "precision applies to backend onnxruntime; for tensorrt set build.precision"),
])
def test_gpu_options_are_errors_where_they_cannot_apply(keys, fragment):
    with pytest.raises(ConfigError) as err:
        model_config(**keys)
    assert fragment in str(err.value)


# ---------------------------------------------------------------- loader
def test_engine_options_carry_the_gpu_options_only_on_gpu():
    assert engine_options(model_config(allowed_batch_sizes=[1, 8], max_batch_size=8), (1, 8)) == {
        "device": "cpu", "intra_op_threads": 1}
    gpu = model_config(instance_group=GPU, max_batch_size=4, gpu_memory_limit_mb=512.0,
                       arena_extend_strategy="kSameAsRequested", gpu_execution="sessions", intra_op_threads=2)
    assert engine_options(gpu, (1, 2, 4)) == {
        "device": "cuda", "intra_op_threads": 2, "precision": "tf32", "batch_sizes": (1, 2, 4),
        "gpu_mem_limit": 512 * MiB, "arena_extend_strategy": "kSameAsRequested", "gpu_execution": "sessions"}
    assert engine_options(model_config(instance_group=GPU), None) == {
        "device": "cuda", "intra_op_threads": 1, "precision": "tf32", "gpu_execution": "auto"}


def test_the_sizes_an_engine_prepares_are_known_before_it_opens_where_the_config_tells_them():
    assert planned_batch_sizes(model_config(instance_group=GPU)) == (1, 2, 4, 8)  # ONNX Runtime's default max 8
    assert planned_batch_sizes(model_config(instance_group=GPU, max_batch_size=6)) == (1, 2, 4, 6)
    assert planned_batch_sizes(model_config()) is None
    trt = {"backend": "tensorrt", "instance_group": GPU}
    profiles = [{"x": {"min": [1, 4], "opt": [8, 4], "max": [16, 4]}}, {"x": {"min": [1, 4], "opt": [8, 4],
                                                                            "max": [12, 4]}}]
    assert planned_batch_sizes(model_config(**trt, build={"profiles": profiles})) == (1, 2, 4, 8, 12)
    assert planned_batch_sizes(model_config(**trt)) is None  # a plan file: its profile tells, once open


def test_warm_up_runs_every_allowed_size_or_the_configured_sizes_padded():
    def sizes(**kw):
        cfg = model_config(**kw)
        return warmup_batch_sizes(cfg, ModelSignature.build(FakeEngine(), cfg, "m"))

    assert sizes(instance_group=GPU, max_batch_size=16) == [1, 2, 4, 8, 16]
    assert sizes(instance_group=GPU, max_batch_size=16, warmup_batch_sizes=[3, 100]) == [4, 16]
    assert sizes(max_batch_size=8, allowed_batch_sizes=[2, 8]) == [2, 8]
    assert sizes(max_batch_size=8) == [1]  # CPU without a list: as before
    assert sizes(max_batch_size=3, warmup_batch_sizes=[2, 9]) == [2, 3]


# ---------------------------------------------------------------- padding
def _p(n: int, value: float = 1.0, t: float = 0.0) -> Pending:
    inputs = rows(n, value)
    return Pending(inputs, n, shape_key(inputs), arrival=t)


def test_padded_size_is_the_smallest_allowed_size_that_holds_the_rows():
    assert [padded_size(n, (1, 2, 4, 8)) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert padded_size(5, None) == 5 and padded_size(5, ()) == 5
    with pytest.raises(ValueError, match="9 rows exceeds the largest allowed batch size 8"):
        padded_size(9, (1, 2, 4, 8))


def test_stacking_pads_with_zero_rows_into_a_dirty_buffer_or_a_new_array():
    batch = [_p(1, 3.0), _p(2, 5.0)]
    plain = stack_inputs(batch, padded_rows=4)["x"]
    assert plain[:, 0].tolist() == [3.0, 5.0, 5.0, 0.0] and plain.shape == (4, 4)
    dirty = np.full((8, 4), np.nan, np.float32)
    staged = stack_inputs(batch, lambda name, shape, dtype: dirty[: shape[0]], padded_rows=4)["x"]
    assert staged.base is dirty and staged[:, 0].tolist() == [3.0, 5.0, 5.0, 0.0] and np.isnan(dirty[4:]).all()
    lone = [_p(3, 7.0)]
    assert stack_inputs(lone, padded_rows=3)["x"] is lone[0].inputs["x"]  # nothing to pad: not copied
    words = [Pending({"s": np.array([b"a"], object)}, 1, None, 0.0)]
    assert stack_inputs(words, padded_rows=2)["s"].tolist() == [b"a", b""]  # BYTES pad with empty strings


def test_the_executor_pads_to_an_allowed_size_and_no_padding_row_reaches_a_request():
    ctx = FakeContext(batch_sizes=(1, 2, 4, 8))
    batch = [_p(1, 1.0), _p(2, 2.0), _p(2, 3.0)]
    result = execute_batch(ctx, batch, "m", None, allowed=(1, 2, 4, 8))
    assert ctx.batches == [8] and result.rows == 5 and result.padded_rows == 3
    assert ctx.inputs[0][:, 0].tolist() == [1.0, 2.0, 2.0, 3.0, 3.0, 0.0, 0.0, 0.0]  # NaN staging zeroed
    assert [o["y"].tolist() for o in result.outcomes] == [[[2.0] * 4], [[4.0] * 4] * 2, [[6.0] * 4] * 2]
    again = execute_batch(ctx, [_p(3, 9.0)], "m", None, allowed=(1, 2, 4, 8))  # row 3 held 3.0 from the last batch
    assert ctx.batches == [8, 4] and again.padded_rows == 1 and ctx.inputs[1][3].tolist() == [0.0] * 4
    assert again.outcomes[0]["y"].shape == (3, 4)
    full = execute_batch(ctx, [_p(8)], "m", None, allowed=(1, 2, 4, 8))
    assert ctx.batches == [8, 4, 8] and full.padded_rows == 0


# ---------------------------------------------------------------- the batch plan
def _queue(*sizes: int) -> list[Pending]:
    return [_p(n, float(i), t=float(i)) for i, n in enumerate(sizes)]


def _take(q: list[Pending], max_batch: int, allowed) -> list[int]:
    batch, n = plan_batch(q, max_batch, allowed=allowed)
    assert n == sum(p.rows for p in batch) <= max_batch
    for p in batch:
        p.state = State.DONE
    return [p.rows for p in batch]


POW2 = (1, 2, 4, 8, 16, 32)


def test_forty_queued_rows_go_as_32_then_8():
    q = _queue(*[1] * 40)
    assert sum(_take(q, 32, POW2)) == 32 and sum(_take(q, 32, POW2)) == 8


def test_an_overfull_queue_forms_a_batch_of_exactly_the_size_it_would_be_padded_to():
    q = _queue(20, 10, 12)  # greedy: 20 + 10 = 30, padded to 32, then 12 padded to 16
    assert _take(q, 32, POW2) == [20, 12] and _take(q, 32, POW2) == [10]
    q = _queue(20, 10, 12)
    assert _take(q, 32, None) == [20, 10]  # without allowed sizes: as before


def test_the_exact_batch_keeps_the_leader_and_the_most_urgent_requests():
    q = _queue(20, 10, 6, 12, 6)  # 32 = 20 + 12 (first reachable) or 20 + 6 + 6 (needs a later request)
    assert _take(q, 32, POW2) == [20, 12]
    q = _queue(3, 16, 16)  # 32 = 16 + 16 only without the leader: the greedy batch stands
    assert _take(q, 32, POW2) == [3, 16]


def test_no_exact_fill_or_a_queue_that_fits_one_batch_keeps_the_greedy_batch():
    q = _queue(*[5] * 8)  # multiples of 5 are never allowed: 30 rows, padded to 32
    assert _take(q, 32, POW2) == [5] * 6
    q = _queue(5, 6)  # 11 rows fit one batch: one execution padded to 16, not 8 + 2 + 1
    assert _take(q, 32, POW2) == [5, 6]


# ---------------------------------------------------------------- the runner, on a virtual clock
def _runner(allowed: list[int], max_batch: int = 8, seconds_per_row: float = 0.010):
    cfg = model_config(max_batch_size=max_batch, allowed_batch_sizes=allowed)
    sig = ModelSignature.build(FakeEngine(), cfg, "m")
    ctx = FakeContext(batch_sizes=sig.allowed_batch_sizes)
    metrics = Metrics()
    r = ModelRunner(cfg, sig, [SleepExecutor(ctx, seconds_per_row=seconds_per_row)], metrics.for_model("m", "1"))
    return r, ctx, metrics


def _submit(r: ModelRunner, n: int, value: float) -> asyncio.Task:
    now = asyncio.get_running_loop().time()
    return asyncio.ensure_future(r.infer(rows(n, value), rows=n, received=now))


def _padded_total(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("batcher_padded_rows_total", {"model": "m", "version": "1"})


@pytest.mark.looptime
async def test_the_runner_pads_counts_padded_rows_exactly_and_answers_only_real_rows():
    r, ctx, metrics = _runner([1, 2, 4, 8])
    first = _submit(r, 1, 9.0)  # runs at once and keeps the context busy while the others queue
    await asyncio.sleep(0)
    sizes = [3, 2, 4, 1]
    queued = [_submit(r, n, float(i)) for i, n in enumerate(sizes)]
    outs = await asyncio.gather(first, *queued)
    # 10 rows queued behind the first: 3 + 4 + 1 = 8 exactly, then the 2 (greedy would run 3+2+1 padded to 8, then 4)
    assert ctx.batches == [1, 8, 2] and _padded_total(metrics) == 0
    for (n, value), out in zip([(1, 9.0), *((n, float(i)) for i, n in enumerate(sizes))], outs):
        np.testing.assert_array_equal(out["y"], np.full((n, 4), 2 * value, np.float32))
    lone = await _submit(r, 3, 5.0)  # 3 rows run as 4
    assert lone["y"].shape == (3, 4) and ctx.batches[-1] == 4 and ctx.inputs[-1][3].tolist() == [0.0] * 4
    assert _padded_total(metrics) == 1 and r.stats.padded_rows == 1
    assert r.stats.json("m", "1")["padded_rows"] == 1 and r.stats.inference_count == 14  # real rows only
    assert set(r.times.by_size) <= {1, 2, 4, 8}  # batch times are kept per executed (padded) size
    await r.close()


@pytest.mark.looptime
async def test_a_batch_never_exceeds_the_largest_allowed_size():
    r, ctx, metrics = _runner([1, 3, 6], max_batch=6, seconds_per_row=0.001)
    sizes = [1, 2, 3, 1, 5, 2, 6, 1, 1, 4, 2, 3] * 3
    await asyncio.gather(*(_submit(r, n, 1.0) for n in sizes))
    assert max(ctx.batches) <= 6 and set(ctx.batches) <= {1, 3, 6}  # FakeContext refuses any other size
    assert _padded_total(metrics) == sum(ctx.batches) - sum(sizes)
    await r.close()


# ---------------------------------------------------------------- data plane and repository
async def _plane(loader: FakeLoader, models: list[dict], **server) -> DataPlane:
    config = parse_config({"server": server, "models": [{"path": "unused.onnx", **m} for m in models]})
    metrics = Metrics()
    dp = DataPlane(config, metrics, ModelRepository(config, metrics, loader=loader),
                   executor=lambda ctx, name: SleepExecutor(ctx, name, seconds_per_row=0.010))
    await dp.start()
    return dp


@pytest.mark.looptime
async def test_config_shows_the_allowed_sizes_and_metadata_what_the_contexts_describe():
    facts = {"execution": "cuda_graphs", "batch_sizes": [1, 2, 4, 8, 16], "precision": "tf32"}
    dp = await _plane(FakeLoader(description=facts),
                      [{"name": "g", "max_batch_size": 16, "instance_group": [{"count": 2, "kind": "KIND_GPU"}]},
                       {"name": "c", "max_batch_size": 8}])
    cfg = await dp.model_config("g")
    assert cfg["allowed_batch_sizes"] == [1, 2, 4, 8, 16]
    assert cfg["max_batch_size"] == 16 and cfg["dynamic_batching"]["preferred_batch_size"] == []  # Triton's intact
    assert (await dp.model_config("c"))["allowed_batch_sizes"] is None
    meta = await dp.model_metadata("g")
    assert meta["parameters"] == {"allowed_batch_sizes": [1, 2, 4, 8, 16], "contexts": [facts, facts]}
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    await dp.close()


@pytest.mark.looptime
async def test_lru_on_gpu_counts_the_contexts_device_memory_and_exports_it():
    # the engine holds 20 MB of device memory, each context 35 MB (graphs and workspaces included); 10 MB measured
    loader = FakeLoader({"a": 10, "b": 10}, engine_device_nbytes=20 * MiB, device_nbytes=35 * MiB)
    dp = await _plane(loader, [{"name": n, "instance_group": [{"count": 2, "kind": "KIND_GPU"}]} for n in "ab"],
                      load_strategy="lru", memory_budget_mb=150)
    repo = dp.repository
    sample = dp.metrics.registry.get_sample_value
    r = dp.router
    r.release(await r.acquire(repo.slot("a")))
    assert repo.slot("a").budget_bytes == 90 * MiB and repo.used_bytes == 90 * MiB
    assert sample("batcher_model_memory_bytes", {"model": "a", "version": "1", "kind": "device"}) == 90 * MiB
    assert repo.index()[0]["device_bytes"] == 90 * MiB
    await asyncio.sleep(1)
    r.release(await r.acquire(repo.slot("b")))  # 90 + 90 > 150: a goes
    assert (repo.slot("a").state, repo.slot("b").state) == (UNAVAILABLE, READY)
    assert sample("batcher_model_memory_bytes", {"model": "a", "version": "1", "kind": "device"}) == 0
    assert sample("batcher_model_memory_bytes", {"model": "b", "version": "1", "kind": "device"}) == 90 * MiB
    await dp.close()


def test_a_context_prepared_for_other_sizes_than_the_model_allows_fails_the_load(tmp_path, monkeypatch):
    from batcher import loader as loader_mod

    (tmp_path / "m.onnx").write_bytes(b"unused")
    monkeypatch.setattr(loader_mod, "open_engine", lambda cfg, path, on_restart, sizes: FakeEngine(
        batch_sizes=(1, 2, 4)))
    cfg = model_config(path=str(tmp_path / "m.onnx"), max_batch_size=8, allowed_batch_sizes=[1, 2, 4, 8])
    with pytest.raises(ConfigError, match=r"models\[0\]: the engine prepared batch sizes \[1, 2, 4\], the model "
                                          r"allows \(1, 2, 4, 8\)"):
        loader_mod.load_model(cfg, "models[0]")
    monkeypatch.setattr(loader_mod, "open_engine", lambda cfg, path, on_restart, sizes: FakeEngine(
        batch_sizes=sizes))
    loaded = loader_mod.load_model(cfg, "models[0]")
    assert loaded.contexts[0].batches == [1, 2, 4, 8]  # warm-up ran every allowed size
    loaded.release()


def test_signature_default_keeps_older_constructions_working():
    assert signature(8).allowed_batch_sizes is None
