"""Thin KServe v2 HTTP handlers: decode -> registry/runner -> encode. Errors are raised, mapped in :mod:`app`."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import __version__
from .codec import HEADER_LENGTH, decode_request, encode_response
from .errors import BatcherError, DeadlineExceeded, InvalidInput, ModelNotFound, RequestTimeout, Unauthorized, Unavailable
from .keys import CONFIG, METRICS, REGISTRY
from .registry import READY, ConfigError, ModelSlot
from .scheduler import request_deadline
from .signature import ModelSignature
from .triton_config import PLATFORMS, model_config_json

#: JSON parts larger than this are decoded/encoded in a worker thread so the event loop keeps serving.
OFFLOAD_BYTES = 256 * 1024


routes = web.RouteTableDef()


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _int_or(text: str, default: int) -> int:
    try:
        return int(text)
    except ValueError:
        return default  # decode_request reports the bad header


@contextlib.asynccontextmanager
async def _use(request: web.Request, deadline: float | None = None) -> AsyncIterator[ModelSlot]:
    """Route to a loaded model (loading it if the strategy allows) and keep it pinned while the request runs."""
    registry = request.app[REGISTRY]
    slot = await registry.acquire(request.match_info["model"], request.match_info.get("version"), deadline)
    try:
        yield slot
    finally:
        registry.release(slot)


@routes.get("/v2/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    """This API's OpenAPI 3 description (``configs/openapi.yaml``)."""
    import importlib.resources

    import yaml

    text = importlib.resources.files("configs").joinpath("openapi.yaml").read_text(encoding="utf-8")
    return _json(yaml.safe_load(text))


@routes.get("/v2/health/live")
async def live(request: web.Request) -> web.Response:
    return _json({"live": True})


@routes.get("/v2/health/ready")
async def ready(request: web.Request) -> web.Response:
    ok = request.app[REGISTRY].ready
    return _json({"ready": ok}, 200 if ok else 503)


@routes.get("/v2")
async def server_metadata(request: web.Request) -> web.Response:
    extensions = ["binary_tensor_data", "model_configuration", "statistics"]
    if request.app[CONFIG].server.repository_api:
        extensions.append("model_repository")
    return _json({"name": "trt-batcher", "version": __version__, "extensions": extensions})


def _tensors(specs) -> list[dict]:
    return [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in specs]


async def _signature(request: web.Request) -> tuple[ModelSlot, ModelSignature]:
    """The slot and its signature; a model never loaded yet is loaded (lazy/lru) to learn it."""
    slot = request.app[REGISTRY].slot(request.match_info["model"], request.match_info.get("version"))
    if slot.signature is None:
        async with _use(request):
            pass
    if slot.signature is None:
        raise Unavailable(f"model '{slot.name}' is not loaded: {slot.reason}")
    return slot, slot.signature


def _model_stats(slot: ModelSlot) -> dict:
    from .scheduler import Stats

    st = slot.runner.stats if slot.runner is not None else Stats()
    return {
        "name": slot.name,
        "version": slot.version,
        "last_inference": st.last_inference_ms,
        "inference_count": st.inference_count,
        "execution_count": st.execution_count,
        "inference_stats": {
            "success": st.success.json(), "fail": st.fail.json(), "queue": st.queue.json(),
            "compute_input": st.compute_input.json(), "compute_infer": st.compute_infer.json(),
            "compute_output": st.compute_output.json(),
            "cache_hit": {"count": 0, "ns": 0}, "cache_miss": {"count": 0, "ns": 0},
        },
        "batch_stats": [
            {"batch_size": size, "compute_input": d[0].json(), "compute_infer": d[1].json(),
             "compute_output": d[2].json()}
            for size, d in sorted(st.batches.items())
        ],
    }


@routes.get("/v2/models/stats")
@routes.get("/v2/models/{model}/stats")
@routes.get("/v2/models/{model}/versions/{version}/stats")
async def model_statistics(request: web.Request) -> web.Response:
    """Triton's statistics extension (what perf_analyzer reads for its server-side breakdown). Counts restart when
    a model is reloaded."""
    registry = request.app[REGISTRY]
    name = request.match_info.get("model")
    if name is None:
        slots = [s for versions in registry.slots.values() for s in versions.values() if s.selected]
    elif request.match_info.get("version") is None:
        registry.slot(name)  # 404 for unknown models
        slots = [s for s in registry.slots[name].values() if s.selected]
    else:
        slots = [registry.slot(name, request.match_info["version"])]
    return _json({"model_stats": [_model_stats(s) for s in slots]})


@routes.get("/v2/models/{model}")
@routes.get("/v2/models/{model}/versions/{version}")
async def model_metadata(request: web.Request) -> web.Response:
    slot, sig = await _signature(request)
    versions = sorted((v for v, s in request.app[REGISTRY].slots[slot.name].items() if s.selected), key=int)
    return _json({
        "name": slot.name,
        "versions": versions,
        "platform": PLATFORMS[slot.cfg.backend],
        "inputs": _tensors(sig.inputs),
        "outputs": _tensors(sig.outputs),
    })


@routes.get("/v2/models/{model}/ready")
@routes.get("/v2/models/{model}/versions/{version}/ready")
async def model_ready(request: web.Request) -> web.Response:
    slot = request.app[REGISTRY].slot(request.match_info["model"], request.match_info.get("version"))
    ok = request.app[REGISTRY].ready and slot.state == READY
    return _json({"name": slot.name, "ready": ok}, 200 if ok else 503)


@routes.get("/v2/models/{model}/config")
@routes.get("/v2/models/{model}/versions/{version}/config")
async def model_config(request: web.Request) -> web.Response:
    """The model's configuration in Triton's model-config JSON form (what perf_analyzer and tritonclient read)."""
    slot, sig = await _signature(request)
    return _json(model_config_json(slot.cfg, sig))


@routes.post("/v2/models/{model}/infer")
@routes.post("/v2/models/{model}/versions/{version}/infer")
async def infer(request: web.Request) -> web.Response:
    loop = asyncio.get_running_loop()
    received = loop.time()
    registry = request.app[REGISTRY]
    if not registry.ready:
        raise Unavailable("server is not ready")
    target = registry.slot(request.match_info["model"], request.match_info.get("version"))  # 404 before the body
    try:
        body = await asyncio.wait_for(request.read(), request.app[CONFIG].server.read_timeout_s)
    except asyncio.TimeoutError:
        raise RequestTimeout(
            f"request body not received within server.read_timeout_s = {request.app[CONFIG].server.read_timeout_s} s"
        ) from None
    header_length = request.headers.get(HEADER_LENGTH)
    # Binary tensors decode without copying (np.frombuffer); only a large JSON part is worth a thread.
    json_bytes = len(body) if header_length is None else _int_or(header_length, len(body))
    try:
        limit = request.app[CONFIG].server.max_tensor_elements
        if json_bytes > OFFLOAD_BYTES:
            req = await loop.run_in_executor(None, decode_request, body, header_length, limit)
        else:
            req = decode_request(body, header_length, limit)
    except InvalidInput:
        request.app[METRICS].failure.labels(target.name, target.version, "invalid").inc()
        raise
    deadline = request_deadline(received, req.timeout_us, target.cfg.default_timeout_s)
    try:
        slot = await registry.acquire(target.name, request.match_info.get("version"), deadline)
    except BatcherError as exc:  # not loaded, no room in the budget, load outlasted the deadline
        request.app[METRICS].failure.labels(target.name, target.version, exc.reason).inc()
        raise
    try:
        runner = slot.runner
        try:
            rows = runner.validate(req.inputs, [o.name for o in req.outputs or ()])
        except InvalidInput:
            runner.metrics.fail("invalid")
            raise
        outputs = await runner.infer(req.inputs, rows=rows, received=received, deadline=deadline,
                                     priority=req.priority)
    finally:
        registry.release(slot)
    if rows * sum(a.itemsize * a[0].size for a in outputs.values()) > OFFLOAD_BYTES:
        out, json_length = await loop.run_in_executor(
            None, encode_response, runner.name, runner.version, outputs, req
        )
    else:
        out, json_length = encode_response(runner.name, runner.version, outputs, req)
    if deadline is not None and loop.time() > deadline:  # encoding ran past it: a late answer is not sent
        runner.metrics.fail("timeout")
        raise DeadlineExceeded(f"model '{runner.name}': the answer was ready after the request's deadline")
    if json_length is None:
        return web.Response(body=out, content_type="application/json")
    return web.Response(
        body=out, content_type="application/octet-stream", headers={HEADER_LENGTH: str(json_length)}
    )


# ---------------------------------------------------------------------------- repository extension
def _repository(request: web.Request) -> None:
    server = request.app[CONFIG].server
    if not server.repository_api:
        raise ModelNotFound("the repository API is disabled (server.repository_api: false)")
    if server.repository_token is not None:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {server.repository_token}".encode()):
            raise Unauthorized("the repository API needs Authorization: Bearer <server.repository_token>")


@routes.post("/v2/repository/index")
async def repository_index(request: web.Request) -> web.Response:
    _repository(request)
    return _json(request.app[REGISTRY].index())


@routes.get("/v2/repository/events")
async def repository_events(request: web.Request) -> web.Response:
    """Load, evict and unload events with durations and memory before/after (this server's addition)."""
    _repository(request)
    registry = request.app[REGISTRY]
    return _json({"events": list(registry.events), "memory_used_bytes": registry.used_bytes,
                  "memory_budget_bytes": registry.budget_bytes})


def _repository_slots(request: web.Request) -> list[ModelSlot]:
    registry = request.app[REGISTRY]
    name = request.match_info["model"]
    if name not in registry.slots:
        raise ModelNotFound(f"unknown model '{name}'; models: {sorted(registry.slots)}")
    return [s for s in registry.slots[name].values() if s.selected]


@routes.post("/v2/repository/models/{model}/load")
async def repository_load(request: web.Request) -> web.Response:
    _repository(request)
    for slot in _repository_slots(request):
        try:
            await request.app[REGISTRY].load(slot)
        except ConfigError as exc:
            raise InvalidInput(f"model '{slot.name}' failed to load: {exc}") from None
    return _json({})


@routes.post("/v2/repository/models/{model}/unload")
async def repository_unload(request: web.Request) -> web.Response:
    _repository(request)
    for slot in _repository_slots(request):
        await request.app[REGISTRY].unload(slot)
    return _json({})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


__all__ = ["routes"]
