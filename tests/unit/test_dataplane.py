"""The data plane in-process: one outcome per request, counted once and in the same way in Prometheus and in the
statistics extension; readiness rules; the drain waits for accepted requests, bodies still arriving included."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from fakes import FakeLoader, SleepExecutor, rows

from batcher.config import parse_config
from batcher.dataplane import DataPlane
from batcher.outcomes import FRONTEND_LOST, CountedLater
from batcher.errors import DeadlineExceeded, InvalidInput, ModelNotFound, Unavailable
from batcher.metrics import Metrics
from batcher.protocol import InferRequest, InferResponse
from batcher.repository import ModelRepository

pytestmark = pytest.mark.looptime


async def plane(models: list[dict] | None = None, start: bool = True, later: bool = False,
                seconds_per_row: float = 0.010, **server) -> DataPlane:
    """``later``: a data plane whose transport learns each answer's fate later (an engine process's)."""
    models = models or [{"name": "m", "max_batch_size": 8}]
    config = parse_config({"server": server, "models": [{"path": "unused.onnx", **m} for m in models]})
    metrics = Metrics()
    dp = DataPlane(config, metrics, ModelRepository(config, metrics, loader=FakeLoader()),
                   executor=lambda ctx, name: SleepExecutor(ctx, name, seconds_per_row=seconds_per_row),
                   deliver_checks_deadline=later)
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
    for reason in ("invalid", "rejected", "timeout", "backend", "canceled", "dropped", "other"):
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
    assert c == {"success": 0, "invalid": 3, "rejected": 0, "timeout": 1, "backend": 0, "canceled": 0, "dropped": 0,
                 "other": 0,
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


async def test_a_model_larger_than_the_whole_memory_budget_is_not_ready():
    """Its next request would not load it (it can never fit): the per-model probe says so, before any request and
    after one; a model that fits is ready to be loaded."""
    dp = await plane([{"name": "big", "memory_mb": 500}, {"name": "m", "memory_mb": 50}], load_strategy="lru",
                     memory_budget_mb=100)
    assert (dp.model_ready("big"), dp.model_ready("m")) == (False, True)
    with pytest.raises(Unavailable, match="more than the whole memory budget"):
        await dp.infer("big", None, now(), reader(InferRequest(rows(1))), passthrough)
    assert (dp.model_ready("big"), dp.model_ready("m")) == (False, True)
    await dp.close()


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


async def test_every_versions_config_shows_the_models_version_policy_and_loads_back():
    """The policy is read from the highest version's entry; a lower version's config showed its own entry's (the
    default, ``all``) while the model's showed ``latest: 2``, and that model config posted back to a load was
    refused (400: "a load cannot change them") for the lower version. As in Triton, a version's config shows the
    model's policy, and the model's config loads back onto every served version unchanged."""
    import json

    dp = await plane([{"name": "m", "version": 1}, {"name": "m", "version": 2},
                      {"name": "m", "version": 3, "version_policy": {"latest": 2}}])
    model = await dp.model_config("m")
    assert model["version_policy"] == {"latest": {"num_versions": 2}}
    assert [(await dp.model_config("m", v))["version_policy"] for v in ("2", "3")] == [model["version_policy"]] * 2
    cfgs = [dp.repository.slot("m", v).cfg for v in ("2", "3")]
    await dp.load("m", json.loads(json.dumps(model)))
    assert [dp.repository.slot("m", v).cfg for v in ("2", "3")] == cfgs  # nothing changed: no reload
    assert [e["event"] for e in dp.repository.lifecycle.events] == ["load", "load"]
    assert await dp.model_config("m") == model
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


# ---------------------------------------------------------------------------------------------- start_infer
class Outcome:
    """The two callbacks of :meth:`DataPlane.start_infer` and what they were called with."""

    def __init__(self) -> None:
        self.done = asyncio.get_running_loop().create_future()

    def deliver(self, response: InferResponse) -> CountedLater:
        later = CountedLater()
        self.done.set_result(("answer", response, later))
        return later

    def fail(self, error: BaseException | None) -> None:
        self.done.set_result(("error", error, None))


def start(dp: DataPlane, request: InferRequest, model: str = "m", version: str | None = None):
    out = Outcome()
    return dp.start_infer(model, version, now(), request, out.deliver, out.fail), out


async def test_start_infer_queues_without_a_task_and_counts_once_the_transport_settles():
    dp = await plane(later=True)
    tasks = len(asyncio.all_tasks())
    ticket, out = start(dp, InferRequest(rows(2, 3.0)))
    assert ticket is not None and len(asyncio.all_tasks()) == tasks  # queued; no task of its own
    kind, response, later = await out.done
    assert kind == "answer" and (response.model_name, response.model_version) == ("m", "1")
    np.testing.assert_array_equal(response.outputs["y"], np.full((2, 4), 6.0, np.float32))
    assert counts(dp)["success"] == 0  # not before the transport says it was delivered
    later.settle(None)
    later.settle("timeout")  # only the first settle counts
    c = counts(dp)
    assert (c["success"], c["timeout"], c["stats_success"], c["stats_fail"]) == (1, 0, 1, 0)
    _, out2 = start(dp, InferRequest(rows(1)))
    (await out2.done)[2].settle("timeout")  # the front end found it too late
    assert counts(dp)["timeout"] == 1
    await dp.close()


async def test_start_infer_counts_every_refusal_and_failure_as_infer_does():
    dp = await plane([{"name": "m", "max_batch_size": 8, "dynamic_batching": {"default_queue_policy":
                                                                                {"max_queue_size": 1}}}], later=True)
    with pytest.raises(InvalidInput, match="does not match"):
        start(dp, InferRequest({"x": np.ones((1, 5), np.float32)}))
    with pytest.raises(InvalidInput, match="exceeds max_batch_size"):
        start(dp, InferRequest(rows(9)))
    with pytest.raises(ModelNotFound):
        start(dp, InferRequest(rows(1)), model="nope")
    first, out1 = start(dp, InferRequest(rows(1)))
    with pytest.raises(Unavailable, match="queue is full"):
        start(dp, InferRequest(rows(1)))
    assert (await out1.done)[0] == "answer"
    # a deadline that passes in the queue: 504 handed to fail(), counted timeout
    blocker, _ = start(dp, InferRequest(rows(8)))  # 80 ms of batch ahead
    await asyncio.sleep(0.001)
    _, late = start(dp, InferRequest(rows(1), timeout_us=20_000))
    kind, error, _ = await late.done
    assert kind == "error" and isinstance(error, DeadlineExceeded)
    c = counts(dp)
    assert (c["invalid"], c["rejected"], c["timeout"], c["success"]) == (2, 1, 1, 0)
    assert c["stats_fail"] == 4
    assert dp.repository.slot("m").inflight == 1  # the blocker's pin only
    await dp.close()


async def test_a_started_request_whose_client_leaves_never_executes_and_is_counted_canceled_or_dropped():
    dp = await plane(later=True)
    blocker, _ = start(dp, InferRequest(rows(8)))
    await asyncio.sleep(0.001)  # the blocker's batch executes: the next ones wait in the queue
    left, out_left = start(dp, InferRequest(rows(1)))
    lost, out_lost = start(dp, InferRequest(rows(1)))
    left.cancel()
    lost.cancel(FRONTEND_LOST)
    assert [(await o.done)[:2] for o in (out_left, out_lost)] == [("error", None), ("error", None)]
    await asyncio.sleep(1.0)
    runner = dp.repository.slot("m").runner
    assert runner.stats.inference_count == 8  # the blocker's rows only: the two never executed
    sample = dp.metrics.registry.get_sample_value
    labels = {"model": "m", "version": "1"}
    assert sample("batcher_request_failure_total", {**labels, "reason": "canceled"}) == 1
    assert sample("batcher_request_failure_total", {**labels, "reason": "dropped"}) == 1
    assert dp._inflight.count == 0 and dp.repository.slot("m").inflight == 0
    await dp.close()


async def test_start_infer_declines_what_must_wait_and_infer_serves_it():
    """Not ready, a model still to load, a fallback, or a transport that does not check deadlines itself: None,
    nothing counted, and infer() serves the request as ever."""
    single = await plane()  # single-process mode: deliver does not check deadlines
    assert start(single, InferRequest(rows(1)))[0] is None
    await single.close()
    dp = await plane([{"name": "m", "max_batch_size": 8}, {"name": "f", "max_batch_size": 8, "fallback": "m"}],
                     later=True, load_strategy="lazy")
    assert start(dp, InferRequest(rows(1)))[0] is None  # not loaded yet: infer loads it
    assert start(dp, InferRequest(rows(1)), model="f")[0] is None  # a fallback is chosen by infer
    assert (await dp.infer("m", None, now(), reader(InferRequest(rows(1))), passthrough)).model_name == "m"
    assert start(dp, InferRequest(rows(1)))[0] is not None  # loaded now
    c = counts(dp)
    assert (c["success"], c["stats_fail"]) == (1, 0)
    await dp.close()
    stopped = await plane(later=True, start=False)
    assert start(stopped, InferRequest(rows(1)))[0] is None  # not started: infer answers 503 and counts it
    await stopped.close()


async def test_the_drain_waits_for_started_requests():
    dp = await plane(later=True)
    ticket, out = start(dp, InferRequest(rows(4)))
    drain = asyncio.ensure_future(dp.drain(grace_s=30))
    t0 = now()
    await drain
    assert now() - t0 == pytest.approx(0.040)  # its batch: 4 rows of 10 ms
    assert out.done.done() and out.done.result()[0] == "answer"
    assert start(dp, InferRequest(rows(1)))[0] is None  # draining: infer answers 503
    await dp.close()


async def test_nothing_keeps_a_started_requests_inputs_once_its_outcome_is_handed_over():
    """The inputs may be views of a client's shared-memory region, which it may unregister at once: no reference
    cycle (the transport's callbacks refer back to the request) may keep them until a garbage collection."""
    import gc
    import weakref

    dp = await plane(later=True)
    gc.disable()
    try:
        x = rows(2)["x"]
        alive = weakref.ref(x)
        ticket, out = start(dp, InferRequest({"x": x}))
        out.ticket = ticket  # as an engine's request refers to its ticket, whose callbacks refer to the request
        del x
        kind, response, later = await out.done
        later.settle(None)
        del response, later, ticket, out
        await asyncio.sleep(0)
        assert alive() is None
    finally:
        gc.enable()
    await dp.close()
