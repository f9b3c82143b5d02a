"""Thin KServe v2 HTTP handlers: decode -> registry/runner -> encode. Errors are raised, mapped in :mod:`app`."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engines.datatypes import NUMPY_DTYPES

from . import __version__
from .codec import HEADER_LENGTH, decode_request, encode_response
from .errors import InvalidInput, RequestTimeout, Unavailable
from .keys import CONFIG, METRICS, REGISTRY
from .scheduler import ModelRunner

#: JSON parts larger than this are decoded/encoded in a worker thread so the event loop keeps serving.
OFFLOAD_BYTES = 256 * 1024

_TRITON_TYPES = {dt: ("TYPE_STRING" if dt == "BYTES" else f"TYPE_{dt}") for dt in NUMPY_DTYPES}

routes = web.RouteTableDef()


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _int_or(text: str, default: int) -> int:
    try:
        return int(text)
    except ValueError:
        return default  # decode_request reports the bad header


def _runner(request: web.Request) -> ModelRunner:
    return request.app[REGISTRY].get(request.match_info["model"], request.match_info.get("version"))


@routes.get("/v2/health/live")
async def live(request: web.Request) -> web.Response:
    return _json({"live": True})


@routes.get("/v2/health/ready")
async def ready(request: web.Request) -> web.Response:
    ok = request.app[REGISTRY].ready
    return _json({"ready": ok}, 200 if ok else 503)


@routes.get("/v2")
async def server_metadata(request: web.Request) -> web.Response:
    return _json({
        "name": "trt-batcher",
        "version": __version__,
        "extensions": ["binary_tensor_data", "model_configuration"],
    })


def _tensors(specs) -> list[dict]:
    return [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in specs]


@routes.get("/v2/models/{model}")
@routes.get("/v2/models/{model}/versions/{version}")
async def model_metadata(request: web.Request) -> web.Response:
    runner = _runner(request)
    versions = sorted(request.app[REGISTRY].models[runner.name], key=int)
    return _json({
        "name": runner.name,
        "versions": versions,
        "platform": "onnxruntime_onnx",
        "inputs": _tensors(runner.signature.inputs),
        "outputs": _tensors(runner.signature.outputs),
    })


@routes.get("/v2/models/{model}/ready")
@routes.get("/v2/models/{model}/versions/{version}/ready")
async def model_ready(request: web.Request) -> web.Response:
    runner = _runner(request)
    ok = request.app[REGISTRY].ready
    return _json({"name": runner.name, "ready": ok}, 200 if ok else 503)


@routes.get("/v2/models/{model}/config")
@routes.get("/v2/models/{model}/versions/{version}/config")
async def model_config(request: web.Request) -> web.Response:
    """The model's configuration in Triton's model-config JSON form (what perf_analyzer and tritonclient read)."""
    runner = _runner(request)
    cfg, sig = runner.cfg, runner.signature

    def tensors(specs):
        return [{"name": s.name, "data_type": _TRITON_TYPES[s.datatype], "dims": list(s.shape[1:])} for s in specs]

    dynamic = {
        "preferred_batch_size": list(cfg.preferred_batch_sizes),
        "max_queue_delay_microseconds": cfg.max_queue_delay_us,
        "default_queue_policy": {
            "max_queue_size": cfg.max_queue_size,
            "default_timeout_microseconds": (cfg.timeout_ms or 0) * 1000,
        },
    }
    return _json({
        "name": cfg.name,
        "platform": "onnxruntime_onnx",
        "backend": cfg.backend,
        "max_batch_size": sig.max_batch_size,
        "input": tensors(sig.inputs),
        "output": tensors(sig.outputs),
        "instance_group": [{"count": cfg.instances, "kind": "KIND_GPU" if cfg.device == "cuda" else "KIND_CPU"}],
        "dynamic_batching": dynamic,
    })


@routes.post("/v2/models/{model}/infer")
@routes.post("/v2/models/{model}/versions/{version}/infer")
async def infer(request: web.Request) -> web.Response:
    loop = asyncio.get_running_loop()
    received = loop.time()
    if not request.app[REGISTRY].ready:
        raise Unavailable("server is not ready")
    runner = _runner(request)
    try:
        body = await asyncio.wait_for(request.read(), request.app[CONFIG].server.read_timeout_s)
    except asyncio.TimeoutError:
        raise RequestTimeout(
            f"request body not received within server.read_timeout_s = {request.app[CONFIG].server.read_timeout_s} s"
        ) from None
    header_length = request.headers.get(HEADER_LENGTH)
    try:
        # Binary tensors decode without copying (np.frombuffer); only a large JSON part is worth a thread.
        json_bytes = len(body) if header_length is None else _int_or(header_length, len(body))
        if json_bytes > OFFLOAD_BYTES:
            req = await loop.run_in_executor(None, decode_request, body, header_length)
        else:
            req = decode_request(body, header_length)
        rows = runner.validate(req.inputs, [o.name for o in req.outputs or ()])
    except InvalidInput:
        runner.metrics.fail("invalid")
        raise
    outputs = await runner.infer(req.inputs, rows=rows, received=received, timeout_us=req.timeout_us)
    if rows * sum(a.itemsize * a[0].size for a in outputs.values()) > OFFLOAD_BYTES:
        out, json_length = await loop.run_in_executor(
            None, encode_response, runner.name, runner.version, outputs, req
        )
    else:
        out, json_length = encode_response(runner.name, runner.version, outputs, req)
    if json_length is None:
        return web.Response(body=out, content_type="application/json")
    return web.Response(
        body=out, content_type="application/octet-stream", headers={HEADER_LENGTH: str(json_length)}
    )


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


__all__ = ["routes"]
