"""Multi-process mode's data plane across a real Unix socket and real shared memory, with the engine side in this
process (fake engines, tests/unit/fakes.py): what crosses the boundary, when input blocks are given back, what a
lost front end or engine does, routing across GPUs, merged statistics. The processes themselves are tested in
tests/integration/test_frontends.py."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from fake_cuda import FakeCuda
from fakes import FakeLoader, SleepExecutor

import engines.cuda as cuda
from batcher.config import parse_config
from batcher.dataplane import DataPlane
from batcher.engine_proc import EngineServer
from batcher.errors import BatcherError, InvalidInput, Unavailable
from batcher.frontend import RemoteDataPlane
from batcher.heartbeat import Heartbeat
from batcher.metrics import Metrics
from batcher.protocol import InferRequest, InferResponse
from batcher.repository import ModelRepository
from batcher.topology import engine_config, engine_slots, engines, placed_on

AREA_ROWS = 4096  # x FP32 [4096, 4] = 64 KiB: the smallest request that travels through the shared area


class Engine:
    """One engine process's parts, in this process: its data plane (fake model, batches 'take' 10 ms per row of
    real time unless gated) and its server on a Unix socket."""

    def __init__(self, config, engine, path: str, seconds_per_row: float) -> None:
        cfg = engine_config(config, engine)
        self.metrics = Metrics()
        self.loader = FakeLoader()
        self.gate = asyncio.Event()
        self.gate.set()
        self.executors: list[SleepExecutor] = []

        def executor(ctx, name):
            ex = GatedExecutor(ctx, name, seconds_per_row, self.gate)
            self.executors.append(ex)
            return ex

        repo = ModelRepository(cfg, self.metrics, loader=self.loader, serves=placed_on(engine))
        self.dataplane = DataPlane(cfg, self.metrics, repo, executor, deliver_checks_deadline=True)
        self.server = EngineServer(self.dataplane, engine.device, path, 1 << 20, engine_slots(config, engine))

    async def start(self) -> None:
        await self.dataplane.start()
        await self.server.start()

    async def stop(self) -> None:
        await self.server.close()
        await self.dataplane.close()

    def count(self, model: str = "m", version: str = "1", reason: str | None = None) -> float:
        labels = {"model": model, "version": version}
        if reason is None:
            return self.metrics.registry.get_sample_value("batcher_request_success_total", labels) or 0.0
        return self.metrics.registry.get_sample_value("batcher_request_failure_total",
                                                      {**labels, "reason": reason}) or 0.0

    @property
    def rows_run(self) -> int:
        return sum(sum(ex.context.batches) for ex in self.executors)


class GatedExecutor(SleepExecutor):
    """SleepExecutor that also waits for ``gate`` before finishing a batch (the batch has read its inputs)."""

    def __init__(self, context, name, seconds_per_row, gate: asyncio.Event) -> None:
        super().__init__(context, name, seconds_per_row)
        self.gate = gate

    async def _run(self, fn, args):
        result = await super()._run(fn, args)
        await self.gate.wait()
        return result


@contextlib.asynccontextmanager
async def served(models: list[dict], seconds_per_row: float = 0.0, server: dict | None = None, **routing):
    """Engine processes for ``models`` (one per device, or as ``server.engine_processes`` says) and a front end's
    RemoteDataPlane connected to them; the engines by device (under ``per_model``: by engine name)."""
    config = parse_config({"server": server or {}, "routing": routing,
                           "models": [{"path": "unused.onnx", **m} for m in models]})
    with tempfile.TemporaryDirectory() as tmp:
        keys = engines(config)
        parts = {e: Engine(config, e, str(Path(tmp) / f"engine-{i}.sock"), seconds_per_row)
                 for i, e in enumerate(keys)}
        for e in parts.values():
            await e.start()
        remote = RemoteDataPlane(config, Metrics(), {k: e.server.path for k, e in parts.items()})
        engines_by = {(k.device if k.model is None else k.name): e for k, e in parts.items()}
        await remote.start()
        try:
            yield remote, engines_by
        finally:
            await remote.close()
            for e in parts.values():
                e.gate.set()
                await e.stop()


def now() -> float:
    return asyncio.get_running_loop().time()


def request(n: int, value: float = 1.0, **kw) -> InferRequest:
    return InferRequest({"x": np.full((n, 4), value, np.float32)}, **kw)


def read(r: InferRequest | Exception):
    async def _read():
        if isinstance(r, Exception):
            raise r
        return r

    return _read


async def copy_out(response: InferResponse) -> tuple[str, str, np.ndarray]:
    return response.model_name, response.model_version, response.outputs["y"].copy()


def used(remote: RemoteDataPlane, i: int = 0) -> int:
    return remote.links[i]._inputs.used_bytes


async def eventually(condition, seconds: float = 3.0) -> bool:
    """Whether ``condition()`` holds within ``seconds`` (messages between the two sides are asynchronous: the
    engine counts an outcome when the front end's ACK arrives)."""
    for _ in range(int(seconds / 0.01)):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


async def test_a_request_crosses_through_the_shared_area_and_is_counted_once_by_the_engine():
    async with served([{"name": "m", "max_batch_size": AREA_ROWS}]) as (remote, engines):
        name, version, y = await remote.infer("m", None, now(), read(request(AREA_ROWS, 3.0)), copy_out)
        assert (name, version) == ("m", "1")
        np.testing.assert_array_equal(y, np.full((AREA_ROWS, 4), 6.0, np.float32))
        engine = engines[None]
        assert await eventually(lambda: engine.count() == 1)
        assert engine.dataplane.repository.slot("m").stats.success.count == 1
        assert used(remote) == 0  # its block went back with the answer
        with pytest.raises(InvalidInput):  # read failed in the front end: sent anyway, counted by the engine
            await remote.infer("m", None, now(), read(InvalidInput("bad body")), copy_out)
        assert engine.count(reason="invalid") == 1 and engine.rows_run == AREA_ROWS


async def test_the_engine_queues_a_ready_models_request_at_once_and_one_that_must_wait_in_a_task():
    """A READY model's request is queued from its message (no task of its own: DataPlane.start_infer); one that
    must wait first (a lazy model not loaded yet) runs in a task; both answer and count the same."""
    async with served([{"name": "m", "max_batch_size": 64}], server={"load_strategy": "lazy"}) as (remote, engines):
        engine = engines[None]
        engine.gate.clear()
        conn = next(iter(engine.server.connections))
        first = asyncio.create_task(remote.infer("m", None, now(), read(request(1, 1.0)), copy_out))
        assert await eventually(lambda: len(conn.requests) == 1)
        (req,) = conn.requests.values()
        assert req.task is not None and req.ticket is None  # the model loads first
        assert await eventually(lambda: engine.dataplane.repository.slot("m").state == "READY")
        second = asyncio.create_task(remote.infer("m", None, now(), read(request(1, 2.0)), copy_out))
        assert await eventually(lambda: len(conn.requests) == 2)
        req2 = next(r for r in conn.requests.values() if r is not req)
        assert req2.ticket is not None and req2.task is None
        engine.gate.set()
        outputs = [(await t)[2] for t in (first, second)]
        assert [o.tolist() for o in outputs] == [[[2.0] * 4], [[4.0] * 4]]
        assert await eventually(lambda: engine.count() == 2 and not conn.requests)


async def test_an_input_block_is_reused_only_after_the_batch_reading_it_is_done():
    """A request answered 504 while its batch executes: the batch still reads its inputs, so its block stays taken
    until the batch ends (then RELEASE gives it back) - the bug of vLLM #24655 cannot happen."""
    async with served([{"name": "m", "max_batch_size": AREA_ROWS,
                        "dynamic_batching": {"admission_control": False}}]) as (remote, engines):
        engine = engines[None]
        engine.gate.clear()
        with pytest.raises(BatcherError) as exc:
            await remote.infer("m", None, now(), read(request(AREA_ROWS, timeout_us=100_000)), copy_out)
        assert exc.value.status == 504 and "while its batch was executing" in exc.value.message
        assert used(remote) > 0  # answered, but the block is still the batch's
        await asyncio.sleep(0.1)
        assert used(remote) > 0
        engine.gate.set()
        assert await eventually(lambda: used(remote) == 0)
        assert engine.count(reason="timeout") == 1


async def test_a_client_that_goes_away_aborts_its_request_in_the_engine():
    async with served([{"name": "m", "max_batch_size": AREA_ROWS}]) as (remote, engines):
        engine = engines[None]
        engine.gate.clear()
        busy = asyncio.create_task(remote.infer("m", None, now(), read(request(1)), copy_out))
        await asyncio.sleep(0.05)  # executing, gated
        quitter = asyncio.create_task(remote.infer("m", None, now(), read(request(AREA_ROWS)), copy_out))
        await asyncio.sleep(0.05)  # queued behind it
        quitter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await quitter
        assert await eventually(lambda: engine.count(reason="canceled") == 1 and used(remote) == 0)
        engine.gate.set()
        await busy
        assert engine.rows_run == 1  # the aborted request never ran


async def test_a_request_its_engine_has_not_answered_past_its_deadline_gets_504_from_the_front_end():
    """EngineLink.expire (the front end's sweep, OVERDUE_S after a deadline; called here at once): the request's
    future gets 504, and the engine, sent ABORT with OVERDUE, withdraws it unrun and counts it ``timeout``, not
    ``canceled``; its input block goes back once the engine has let it go."""
    async with served([{"name": "m", "max_batch_size": AREA_ROWS,
                        "dynamic_batching": {"admission_control": False}}]) as (remote, engines):
        engine = engines[None]
        engine.gate.clear()
        busy = asyncio.create_task(remote.infer("m", None, now(), read(request(1)), copy_out))
        await asyncio.sleep(0.05)  # executing, gated
        late = asyncio.create_task(remote.infer("m", None, now(), read(request(AREA_ROWS, timeout_us=60_000_000)),
                                                copy_out))
        conn = next(iter(engine.server.connections))
        assert await eventually(lambda: len(conn.requests) == 2)  # queued behind it
        remote.links[0].expire(now() + 3600)  # as if its deadline had passed long ago
        with pytest.raises(BatcherError) as exc:
            await late
        assert exc.value.status == 504
        assert exc.value.message == "model 'm': no answer from the engine process by the request's deadline"
        assert await eventually(lambda: engine.count(reason="timeout") == 1 and used(remote) == 0)
        engine.gate.set()
        await busy
        assert engine.rows_run == 1 and engine.count(reason="canceled") == 0


async def test_a_control_call_its_engine_does_not_answer_in_time_is_503_and_the_link_serves_on():
    """EngineLink.call's timeout (a stopped engine process held model readiness, metadata and the index for as
    long as it was stopped); loads and unloads wait as long as they take (timeout_s None)."""
    async with served([{"name": "m", "max_batch_size": 8}]) as (remote, engines):
        dataplane = engines[None].dataplane
        gate = asyncio.Event()

        async def stuck(*args, **kwargs):
            await gate.wait()
            return {"model_stats": []}

        dataplane.statistics = stuck  # as an engine process that does not run
        with pytest.raises(Unavailable) as exc:
            await remote.links[0].call("statistics", None, None, timeout_s=0.05)
        assert exc.value.message == "the engine process for cpu did not answer within 0.05 s"
        assert exc.value.retry_after_s == 1 and remote.links[0]._calls == {}
        waiting = asyncio.create_task(remote.links[0].call("statistics", None, None, timeout_s=None))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        gate.set()
        assert await waiting == {"model_stats": []}
        del dataplane.statistics
        assert (await remote.model_config("m"))["name"] == "m"


async def test_an_engine_whose_heartbeat_is_stale_gets_no_new_requests_and_makes_readiness_false():
    """EngineLink.up: an engine process stopped or stuck (its heartbeat older than ``stale_s``) is not routed to
    (503 at once, counted ``rejected`` here, instead of waiting for the deadline or the kill) and readiness is
    false; once it beats again, both come back."""
    async with served([{"name": "m", "max_batch_size": 8}]) as (remote, engines):
        link = remote.links[0]
        link.heartbeat, link.stale_s = Heartbeat(), 3.0
        link.heartbeat.set(time.monotonic())
        assert remote.ready
        link.heartbeat.set(time.monotonic() - 4.0)
        assert not remote.ready
        with pytest.raises(Unavailable) as exc:
            await remote.infer("m", None, now(), read(request(1)), copy_out)
        assert exc.value.message == ("model 'm': the engine process serving it has stopped running (stopped or "
                                     "stuck); it is restarted once server.stall_timeout_s passes")
        rejected = remote.metrics.registry.get_sample_value(
            "batcher_request_failure_total", {"model": "m", "version": "1", "reason": "rejected"})
        assert rejected == 1 and engines[None].rows_run == 0
        link.heartbeat.set(time.monotonic())
        assert remote.ready
        assert (await remote.infer("m", None, now(), read(request(1)), copy_out))[2].tolist() == [[2.0] * 4]
        link.heartbeat.close()


async def test_a_lost_front_end_has_its_requests_dropped_and_counted():
    async with served([{"name": "m", "max_batch_size": 64}]) as (remote, engines):
        engine = engines[None]
        engine.gate.clear()
        tasks = [asyncio.create_task(remote.infer("m", None, now(), read(request(1)), copy_out)) for _ in range(3)]
        await asyncio.sleep(0.05)
        remote.links[0]._channel._transport.abort()  # the front end's end of the socket goes, as when it dies
        assert all(isinstance(r, Unavailable) for r in await asyncio.gather(*tasks, return_exceptions=True))
        assert await eventually(lambda: engine.count(reason="dropped") == 3)
        assert engine.count() == 0
        engine.gate.set()
        assert await eventually(lambda: remote.ready)  # the front end reconnects by itself
        assert (await remote.infer("m", None, now(), read(request(1)), copy_out))[2].tolist() == [[2.0] * 4]


async def test_an_answer_sent_but_not_acknowledged_is_settled_by_abort_or_by_the_front_ends_loss():
    """The engine's task for a request ends when its answer is sent; the ACK settles the outcome. Before an ACK:
    the client going away (ABORT) counts it ``canceled``, the front end dying counts it ``dropped``, each once
    and never as a success; an ACK carrying the front end's error counts that reason."""
    async with served([{"name": "m", "max_batch_size": 64}]) as (remote, engines):
        engine = engines[None]
        delivering, hold = asyncio.Event(), asyncio.Event()

        async def stuck(response: InferResponse):  # the front end has the answer, its client has not
            delivering.set()
            await hold.wait()

        quitter = asyncio.create_task(remote.infer("m", None, now(), read(request(1)), stuck))
        await delivering.wait()
        assert not engine.server.connections.copy().pop().requests  # the engine is done with it, the ACK is due
        quitter.cancel()  # the client goes away while its answer is being written: ABORT
        with pytest.raises(asyncio.CancelledError):
            await quitter
        assert await eventually(lambda: engine.count(reason="canceled") == 1)

        async def late(response: InferResponse):
            raise BatcherError("too late")  # what the front end answered instead (error_tuple: reason "other")

        with pytest.raises(BatcherError):
            await remote.infer("m", None, now(), read(request(1)), late)
        assert await eventually(lambda: engine.count(reason="other") == 1)

        delivering.clear()
        lost = asyncio.create_task(remote.infer("m", None, now(), read(request(1)), stuck))
        await delivering.wait()
        remote.links[0]._channel._transport.abort()  # the front end dies before acknowledging
        assert await eventually(lambda: engine.count(reason="dropped") == 1)
        lost.cancel()
        await asyncio.gather(lost, return_exceptions=True)
        assert (engine.count(), engine.count(reason="canceled"), engine.count(reason="other")) == (0, 1, 1)


async def test_a_stopped_engine_makes_its_models_503_until_it_is_back():
    async with served([{"name": "m"}]) as (remote, engines):
        engine = engines[None]
        await engine.server.close()  # the engine process is gone
        assert await eventually(lambda: not remote.ready)
        with pytest.raises(Unavailable) as exc:
            await remote.infer("m", None, now(), read(request(1)), copy_out)
        assert exc.value.retry_after_s == 1 and "not running" in exc.value.message
        sample = remote.metrics.registry.get_sample_value
        assert sample("batcher_request_failure_total", {"model": "m", "version": "1", "reason": "rejected"}) == 1
        await engine.server.start()  # back (a new engine process listens on the same socket)
        assert await eventually(lambda: remote.ready)
        assert (await remote.infer("m", None, now(), read(request(1)), copy_out))[2].tolist() == [[2.0] * 4]


async def test_a_front_end_that_starts_while_an_engine_is_down_serves_the_others_and_connects_it_later():
    """A front end restarted while an engine process is being restarted too (a fresh user's find: it died with
    ConnectionRefusedError): it starts, answers 503 for that engine's models, serves the others' models and
    all-model statistics, and connects to the engine once it listens again."""
    models = [{"name": "a", "max_batch_size": 8}, {"name": "b", "max_batch_size": 8}]
    async with served(models, server={"engine_processes": "per_model"}) as (remote, engines):
        await engines["cpu:a"].server.close()  # a's engine process is down
        late = RemoteDataPlane(remote.config, Metrics(), {link.engine: link.path for link in remote.links})
        await late.start()  # a new front end, now
        try:
            assert [link.connected for link in late.links] == [False, True] and not late.ready
            with pytest.raises(Unavailable):
                await late.infer("a", None, now(), read(request(1)), copy_out)
            assert (await late.infer("b", None, now(), read(request(1, 3.0)), copy_out))[2].tolist() == [[6.0] * 4]
            assert [s["name"] for s in (await late.statistics())["model_stats"]] == ["b"]
            await engines["cpu:a"].server.start()  # back
            assert await eventually(lambda: late.ready)
            assert (await late.infer("a", None, now(), read(request(1)), copy_out))[2].tolist() == [[2.0] * 4]
        finally:
            await late.close()


async def test_an_answer_whose_engine_died_before_its_ack_is_counted_by_the_front_end():
    """The engine process counts an outcome when the front end's ACK arrives; one that dies in between counts
    nothing, so the front end counts the answer it delivered."""
    async with served([{"name": "m"}]) as (remote, engines):
        engine = engines[None]

        async def deliver_as_the_engine_dies(response: InferResponse):
            out = await copy_out(response)
            await engine.server.close()
            assert await eventually(lambda: not remote.links[0].connected)
            return out

        answer = await remote.infer("m", None, now(), read(request(1)), deliver_as_the_engine_dies)
        assert answer[2].tolist() == [[2.0] * 4]
        sample = remote.metrics.registry.get_sample_value
        assert sample("batcher_request_success_total", {"model": "m", "version": "1"}) == 1
        await engine.server.start()


async def test_a_drain_waits_for_accepted_requests_only_not_for_the_ones_it_refuses():
    """SIGTERM in a front end: a request arriving during the drain gets 503 at once, counted by the front end and
    never in flight, so a stream of new requests cannot hold the drain open until its grace runs out."""
    async with served([{"name": "m"}]) as (remote, engines):
        engine = engines[None]
        engine.gate.clear()  # batches wait: the accepted request stays in flight
        accepted = asyncio.ensure_future(remote.infer("m", None, now(), read(request(1)), copy_out))
        assert await eventually(lambda: engine.rows_run == 1 or remote._inflight.count == 1)
        drain = asyncio.ensure_future(remote.drain(60.0))
        await asyncio.sleep(0)
        for _ in range(3):
            with pytest.raises(Unavailable, match="server is shutting down"):
                await remote.infer("m", None, now(), read(request(1)), copy_out)
        assert remote._inflight.count == 1 and not drain.done()
        sample = remote.metrics.registry.get_sample_value
        assert sample("batcher_request_failure_total", {"model": "m", "version": "1", "reason": "rejected"}) == 3
        assert engine.count(reason="rejected") == 0  # nothing of them reached the engine
        engine.gate.set()
        assert (await accepted)[2].tolist() == [[2.0] * 4]
        await asyncio.wait_for(drain, 5.0)


GPU_MODEL = {"name": "m", "instance_group": [{"kind": "KIND_GPU", "gpus": [0, 1]}], "max_batch_size": 8}


async def test_least_queue_sends_requests_to_the_gpu_with_less_work_waiting():
    with cuda.use_runtime(FakeCuda().cudart):
        async with served([GPU_MODEL]) as (remote, engines):
            engines[0].gate.clear()
            busy = [asyncio.create_task(remote.infer("m", None, now(), read(request(1)), copy_out))
                    for _ in range(2)]  # GPU 0 (the first of equals) takes the first, then GPU 1 is less busy
            await asyncio.sleep(0.05)
            assert [e.server.counts[0] for e in engines.values()] == [1, 0]
            for _ in range(4):  # GPU 0 holds one request that does not finish: everything else goes to GPU 1
                await remote.infer("m", None, now(), read(request(1)), copy_out)
            assert (engines[0].rows_run, engines[1].rows_run) == (1, 5)
            engines[0].gate.set()
            await asyncio.gather(*busy)


async def test_per_model_engine_processes_each_serve_one_model_and_the_front_end_routes_by_model():
    """``engine_processes: per_model``: a front end has a link per model's engine process; each request reaches the
    process of its model only, each process counts its own, and the merged statistics and index cover both."""
    models = [{"name": "a", "max_batch_size": 8}, {"name": "b", "max_batch_size": 8}]
    async with served(models, server={"engine_processes": "per_model"}) as (remote, engines):
        assert [link.name for link in remote.links] == ["engine process for cpu:a", "engine process for cpu:b"]
        for model, n in (("a", 3), ("b", 1), ("a", 2)):
            name, _, y = await remote.infer(model, None, now(), read(request(n, 2.0)), copy_out)
            assert name == model and y.tolist() == [[4.0] * 4] * n
        assert (engines["cpu:a"].rows_run, engines["cpu:b"].rows_run) == (5, 1)
        counts = lambda: [(e.count("a"), e.count("b")) for e in (engines["cpu:a"], engines["cpu:b"])]  # noqa: E731
        assert await eventually(lambda: counts() == [(2, 0), (0, 1)])  # each counted once, by its own process
        stats = {s["name"]: s["inference_count"] for s in (await remote.statistics())["model_stats"]}
        assert stats == {"a": 5, "b": 1}
        assert [(e["name"], e["state"]) for e in await remote.repository_index()] == [("a", "READY"), ("b", "READY")]


async def test_weighted_splits_requests_between_gpus_by_instance_group_weight():
    model = {**GPU_MODEL, "instance_group": [{"kind": "KIND_GPU", "gpus": [0], "weight": 3},
                                             {"kind": "KIND_GPU", "gpus": [1], "weight": 1}]}
    with cuda.use_runtime(FakeCuda().cudart):
        async with served([model], strategy="weighted") as (remote, engines):
            for _ in range(8):
                await remote.infer("m", None, now(), read(request(1)), copy_out)
            assert (engines[0].rows_run, engines[1].rows_run) == (6, 2)
            stats = (await remote.statistics("m"))["model_stats"]
            assert len(stats) == 1 and stats[0]["inference_stats"]["success"]["count"] == 8  # merged
            assert stats[0]["inference_count"] == 8 and [b["batch_size"] for b in stats[0]["batch_stats"]] == [1]
            index = await remote.repository_index()
            assert [(e["name"], e["version"], e["state"]) for e in index] == [("m", "1", "READY")]
            config = await remote.model_config("m")
            assert [g.get("gpus") for g in config["instance_group"]] == [[0], [1]]


async def test_each_gpu_engine_page_locks_each_front_ends_shared_area_and_unlocks_it_at_the_end():
    fake = FakeCuda()
    with cuda.use_runtime(fake.cudart):
        async with served([GPU_MODEL]) as (remote, engines):
            assert len(fake.gpu.registered) == 2  # one area per (front end, engine process), 1 MiB each
            assert sorted(fake.gpu.registered.values()) == [1 << 20, 1 << 20]
        assert fake.gpu.registered == {}


async def test_canary_versions_split_by_weight_and_hash_sticks_by_key():
    models = [{"name": "m", "instance_group": [{"weight": 3}]},
              {"name": "m", "version": 2, "instance_group": [{"weight": 1}]}]
    async with served(models, strategy="weighted") as (remote, _):
        got = [(await remote.infer("m", None, now(), read(request(1)), copy_out))[1] for _ in range(8)]
        assert got == ["1", "1", "2", "1", "1", "1", "2", "1"]
        assert (await remote.infer("m", "2", now(), read(request(1)), copy_out))[1] == "2"  # named: no spreading
    async with served(models, strategy="hash", hash_parameter="session") as (remote, _):
        keyed = [(await remote.infer("m", None, now(), read(request(1, routing_key=f"s{i % 4}")), copy_out))[1]
                 for i in range(12)]
        assert keyed[:4] * 3 == keyed  # each key always to the same version
        assert (await remote.infer("m", None, now(), read(request(1)), copy_out))[1] == "2"  # no key: default
