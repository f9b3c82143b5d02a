"""The data plane in-process: one outcome per request, counted once and in the same way in Prometheus and in the
statistics extension; readiness rules; the drain waits for accepted requests, bodies still arriving included."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from fakes import FakeLoader, SleepExecutor, rows

from batcher.config import parse_config
from batcher.dataplane import DataPlane
from batcher.errors import DeadlineExceeded, InvalidInput, ModelNotFound, Unavailable
from batcher.metrics import Metrics
from batcher.protocol import InferRequest, InferResponse
from batcher.repository import ModelRepository

pytestmark = pytest.mark.looptime


async def plane(models: list[dict] | None = None, start: bool = True, **server) -> DataPlane:
    models = models or [{"name": "m", "max_batch_size": 8}]
    config = parse_config({"server": server, "models": [{"path": "unused.onnx", **m} for m in models]})
    metrics = Metrics()
    dp = DataPlane(config, metrics, ModelRepository(config, metrics, loader=FakeLoader()),
                   executor=lambda ctx, name: SleepExecutor(ctx, name, seconds_per_row=0.010))
    if start:
        await dp.start()
    return dp


def reader(request: InferRequest | Exception, delay: float = 0.0):
    async def read() -> InferRequest:
        await asyncio.sleep(delay)
        if isinstance(request, Exception):
            raise request
        return request

    return read


async def passthrough(response: InferResponse) -> InferResponse:
    return response


def counts(dp: DataPlane, model: str = "m") -> dict[str, float]:
    sample = dp.metrics.registry.get_sample_value
    labels = {"model": model, "version": "1"}
    out = {"success": sample("batcher_request_success_total", labels) or 0.0}
    for reason in ("invalid", "rejected", "timeout", "backend", "canceled", "other"):
        out[reason] = sample("batcher_request_failure_total", {**labels, "reason": reason}) or 0.0
    st = dp.repository.slot(model).stats
    out["stats_success"], out["stats_fail"] = st.success.count, st.fail.count
    return out


def now() -> float:
    return asyncio.get_running_loop().time()


async def test_a_success_is_counted_once_with_its_outputs():
    dp = await plane()
    resp = await dp.infer("m", None, now(), reader(InferRequest(rows(2, 3.0))), passthrough)
    np.testing.assert_array_equal(resp.outputs["y"], np.full((2, 4), 6.0, np.float32))
    assert (resp.model_name, resp.model_version) == ("m", "1")
    c = counts(dp)
    assert c["success"] == 1 and c["stats_success"] == 1 and c["stats_fail"] == 0
    await dp.close()


async def test_every_failure_moves_exactly_one_counter_and_stats_agree():
    dp = await plane([{"name": "m", "max_batch_size": 8, "dynamic_batching": {"default_queue_policy":
                                                                                {"max_queue_size": 1}}}])
    cases = [
        (reader(InvalidInput("bad body")), InvalidInput),  # decode failed
        (reader(InferRequest({"x": np.ones((1, 5), np.float32)})), InvalidInput),  # wrong shape
        (reader(InferRequest(rows(9))), InvalidInput),  # more rows than max_batch_size
        (reader(InferRequest(rows(1), timeout_us=5_000), delay=0.010), DeadlineExceeded),  # late already
    ]
    for read, error in cases:
        with pytest.raises(error):
            await dp.infer("m", None, now(), read, passthrough)
    with pytest.raises(ModelNotFound):  # unknown models are counted nowhere
        await dp.infer("nope", None, now(), reader(InferRequest(rows(1))), passthrough)
    c = counts(dp)
    assert c == {"success": 0, "invalid": 3, "rejected": 0, "timeout": 1, "backend": 0, "canceled": 0, "other": 0,
                 "stats_success": 0, "stats_fail": 4}
    await dp.close()


async def test_an_answer_ready_after_its_deadline_is_a_timeout_and_not_also_a_success():
    """Issue 11: encoding ran past the deadline: 504, counted as timeout only."""
    dp = await plane()

    async def slow_encode(response: InferResponse) -> InferResponse:
        await asyncio.sleep(0.100)
        return response

    with pytest.raises(DeadlineExceeded, match="ready after the request's deadline"):
        await dp.infer("m", None, now(), reader(InferRequest(rows(1), timeout_us=50_000)), slow_encode)
    c = counts(dp)
    assert (c["success"], c["timeout"], c["stats_success"], c["stats_fail"]) == (0, 1, 0, 1)
    await dp.close()


async def test_a_failing_encoder_is_a_failure_not_a_success():
    """Issue 11: a 500 after execution was counted as a success."""
    dp = await plane()

    async def broken(response: InferResponse):
        raise AttributeError("'str' object has no attribute 'size'")

    with pytest.raises(AttributeError):
        await dp.infer("m", None, now(), reader(InferRequest(rows(1))), broken)
    c = counts(dp)
    assert (c["success"], c["other"], c["stats_fail"]) == (0, 1, 1)
    await dp.close()


async def test_a_client_that_leaves_is_counted_canceled():
    dp = await plane()
    task = asyncio.ensure_future(dp.infer("m", None, now(), reader(InferRequest(rows(1)), delay=1.0), passthrough))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert counts(dp)["canceled"] == 1 and counts(dp)["stats_fail"] == 1
    await dp.close()


async def test_the_drain_waits_for_requests_whose_body_is_still_arriving():
    """Issue 11: a request accepted before SIGTERM (handler started) is answered even if its body arrives later;
    a request arriving after the drain began gets 503."""
    dp = await plane()
    accepted = asyncio.ensure_future(
        dp.infer("m", None, now(), reader(InferRequest(rows(1)), delay=2.0), passthrough))
    await asyncio.sleep(0.2)
    drain = asyncio.ensure_future(dp.drain(grace_s=30))
    await asyncio.sleep(0)
    with pytest.raises(Unavailable, match="shutting down"):
        await dp.infer("m", None, now(), reader(InferRequest(rows(1))), passthrough)
    t0 = now()
    await drain
    assert (await accepted).outputs["y"].shape == (1, 4)
    assert now() - t0 == pytest.approx(1.8 + 0.010)  # the rest of the body, then its batch
    await dp.close()


async def test_model_readiness_rules():
    eager = await plane(start=False)
    assert not eager.model_ready("m")  # not started
    await eager.start()
    assert eager.model_ready("m")
    await eager.close()
    lazy = await plane([{"name": "m"}, {"name": "bad"}], load_strategy="lazy")
    lazy.repository.slot("bad")  # exists
    lazy.repository._loader.fail.add("bad")
    assert lazy.model_ready("m")  # servable: its next request loads it
    with pytest.raises(Unavailable):
        await lazy.infer("bad", None, now(), reader(InferRequest(rows(1))), passthrough)
    assert not lazy.model_ready("bad")  # its load failed
    await lazy.repository.unload(lazy.repository.slot("m"))
    assert not lazy.model_ready("m")  # unloaded through the repository API
    with pytest.raises(ModelNotFound):
        lazy.model_ready("zz")
    await lazy.close()


async def test_metadata_config_and_statistics():
    dp = await plane()
    meta = await dp.model_metadata("m")
    assert meta == {"name": "m", "versions": ["1"], "platform": "onnxruntime_onnx",
                    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
                    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
                    "parameters": {"allowed_batch_sizes": None, "contexts": [{}]}}
    cfg = await dp.model_config("m")
    assert cfg["max_batch_size"] == 8 and cfg["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
    await dp.infer("m", None, now(), reader(InferRequest(rows(3))), passthrough)
    stats = dp.statistics("m")["model_stats"][0]
    assert stats["inference_count"] == 3 and stats["execution_count"] == 1
    assert stats["batch_stats"][0]["batch_size"] == 3
    for model, version in (("nope", None), ("nope", "1"), ("m", "9")):  # 404s, not a KeyError (a 500)
        with pytest.raises(ModelNotFound, match="unknown model 'nope'|version"):
            dp.statistics(model, version)
    await dp.close()


async def test_a_load_with_a_config_reloads_and_requests_in_flight_finish_on_the_old_load():
    """The new load takes new requests as soon as it is attached; the old one finishes what it had queued or
    executing (none dropped, none moved), then it is released."""
    dp = await plane([{"name": "m", "max_batch_size": 8}])
    slot = dp.repository.slot("m")
    old_ctx = slot.loaded.contexts[0]
    def submit(i):
        return asyncio.ensure_future(dp.infer("m", None, now(), reader(InferRequest(rows(2, float(i)))), passthrough))

    before = [submit(0)]
    await asyncio.sleep(0.005)  # its batch executes (20 ms); the next two queue behind it
    before += [submit(1), submit(2)]
    await asyncio.sleep(0.001)
    assert slot.runner.queue_depth == 2
    await dp.load("m", {"max_batch_size": 4, "dynamic_batching": {"default_queue_policy": {"max_queue_size": 3}}})
    assert slot.cfg.max_batch_size == 4 and slot.cfg.max_queue_size == 3 and slot.signature.max_batch_size == 4
    new_ctx = slot.loaded.contexts[0]
    after = await dp.infer("m", None, now(), reader(InferRequest(rows(1, 7.0))), passthrough)
    for i, task in enumerate(before):
        np.testing.assert_array_equal((await task).outputs["y"], np.full((2, 4), 2.0 * i, np.float32))
    np.testing.assert_array_equal(after.outputs["y"], np.full((1, 4), 14.0, np.float32))
    assert sum(old_ctx.batches) == 6 and old_ctx.released  # all of them ran on the old load, then it went
    assert new_ctx.batches == [1] and not new_ctx.released
    with pytest.raises(InvalidInput, match="exceeds max_batch_size 4"):
        await dp.infer("m", None, now(), reader(InferRequest(rows(5))), passthrough)
    assert counts(dp)["success"] == 4
    await dp.close()


async def test_a_config_that_does_not_load_leaves_the_model_as_it_was():
    dp = await plane([{"name": "m", "max_batch_size": 8}])
    slot = dp.repository.slot("m")
    cfg, runner = slot.cfg, slot.runner
    dp.repository._loader.fail.add("m")
    with pytest.raises(InvalidInput, match="model 'm' failed to load: .*broken on purpose"):
        await dp.load("m", {"max_batch_size": 2})
    assert slot.cfg is cfg and slot.runner is runner and slot.state == "READY"
    with pytest.raises(InvalidInput, match="fields this server does not support: optimization"):
        await dp.load("m", {"optimization": {"priority": "PRIORITY_MAX"}})
    assert (await dp.infer("m", None, now(), reader(InferRequest(rows(8))), passthrough)).outputs["y"].shape == (8, 4)
    await dp.close()
