"""Thin KServe v2 HTTP handlers: read the body, decode, call the data plane, encode, build the response.

Everything else - routing to a model version, pinning it, validation, queueing, deadlines, accounting - is the
data plane's (:mod:`batcher.dataplane`). Errors are raised and mapped to responses in one place (:mod:`batcher.app`).
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.resources
import inspect
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import numpy as np
import orjson
import yaml
from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engines.datatypes import NUMPY_DTYPES

from . import __version__
from .bodies import UNCOUNTED_BYTES, decoded_reserver, json_cost, read_body, reserve_decoded
from .codec import HEADER_LENGTH, decode_request, decode_shm_register, encode_response, json_object
from .json_tensors import json_type
from .errors import InvalidInput, ModelNotFound, Unauthorized
from .ipc import INLINE_BYTES
from .keys import CONFIG, DATAPLANE, METRICS
from .loader import warmup_inputs
from .protocol import InferRequest, InferResponse
from .slots import ModelSlot
from .shm import require_enabled

#: JSON parts larger than this are decoded/encoded in a worker thread so the event loop keeps serving.
OFFLOAD_BYTES = 256 * 1024

routes = web.RouteTableDef()
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _model(request: web.Request) -> tuple[str, str | None]:
    return request.match_info["model"], request.match_info.get("version")


def _model_route(method: str, suffix: str = "") -> Callable[[Handler], Handler]:
    """Register a handler at both of KServe v2's paths of a model: ``/v2/models/{model}/versions/{version}<suffix>``
    and ``/v2/models/{model}<suffix>`` (in that order)."""

    def register(handler: Handler) -> Handler:
        for path in (f"/v2/models/{{model}}/versions/{{version}}{suffix}", f"/v2/models/{{model}}{suffix}"):
            routes.route(method, path)(handler)
        return handler

    return register


async def _answer(result: Any) -> Any:
    """A data-plane call's result: in-process methods answer at once, a front end's remote data plane
    (:mod:`batcher.remote`) through an awaitable."""
    return await result if inspect.isawaitable(result) else result


def _into(body_buffer: Callable[..., Any], model: str, version: str | None, json_part: int, declared: int) -> Any:
    return body_buffer(model, version, declared, json_part)


@_model_route("POST", "/infer")
async def infer(request: web.Request) -> web.Response:
    loop = asyncio.get_running_loop()
    app = request.app  # a property that looks the application up each time
    dataplane, config = app[DATAPLANE], app[CONFIG]
    server = config.server
    hash_header, hash_parameter = config.routing.hash_header, config.routing.hash_parameter

    async def read() -> InferRequest:
        lengths = request.headers.getall(HEADER_LENGTH, ())  # as cheap as .get (0.15 against 0.23 us)
        if len(lengths) > 1:  # which of them is the JSON part's length would be a guess (the first was taken)
            raise InvalidInput(f"{HEADER_LENGTH} is given {len(lengths)} times")
        header_length = lengths[0] if lengths else None
        # the JSON part's length where the header is plain ASCII digits; anything else (str.isdigit alone takes "²",
        # which int() refuses: a 500 a client could cause) is the codec's 400
        json_length = (int(header_length) if header_length is not None and header_length.isascii()
                       and header_length.isdigit() else None)
        into = None
        body_buffer = dataplane.body_buffer  # a front end's: binary tensors into shared memory
        if body_buffer is not None and json_length is not None:
            declared, json_part = request.content_length, json_length
            if declared is not None and declared - json_part >= INLINE_BYTES:
                model, version = _model(request)
                into = partial(_into, body_buffer, model, version, json_part)
        body = await read_body(request, server.max_body_bytes, server.read_timeout_s, into)
        json_bytes = len(body) if json_length is None else json_length
        if json_bytes > UNCOUNTED_BYTES:  # what parsing it makes counts against the body budget, before it is made
            reserve_decoded(request, json_cost(bytes(body[:json_bytes])))
        # binary tensors decode without copying (np.frombuffer); a large JSON part, or many BYTES elements (a Python
        # object each), are worth a thread, which the event loop keeps serving beside
        binary_bytes = len(body) - json_bytes
        if json_bytes > OFFLOAD_BYTES or (binary_bytes > OFFLOAD_BYTES and b'"BYTES"' in bytes(body[:json_bytes])):
            decoded = await loop.run_in_executor(None, decode_request, body, header_length, server.max_tensor_elements,
                                                 decoded_reserver(request, loop))
        else:
            decoded = decode_request(body, header_length, server.max_tensor_elements,
                                     partial(reserve_decoded, request))
        if hash_header is not None:
            decoded.routing_key = request.headers.get(hash_header)
        elif hash_parameter is not None and decoded.parameters.get(hash_parameter) is not None:
            decoded.routing_key = str(decoded.parameters[hash_parameter])
        return decoded

    async def deliver(response: InferResponse) -> web.Response:
        if sum(a.nbytes for a in response.outputs.values()) > OFFLOAD_BYTES:
            out, json_length = await loop.run_in_executor(None, encode_response, response)
        else:
            out, json_length = encode_response(response)
        if json_length is None:
            return web.Response(body=out, content_type="application/json")
        return web.Response(body=out, content_type="application/octet-stream", headers={HEADER_LENGTH: str(json_length)})

    return await dataplane.infer(*_model(request), loop.time(), read, deliver)


@routes.get("/v2/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    """This API's OpenAPI 3 description (``configs/openapi.yaml``)."""
    text = importlib.resources.files("configs").joinpath("openapi.yaml").read_text(encoding="utf-8")
    return _json(yaml.safe_load(text))


@routes.get("/v2/health/live")
async def live(request: web.Request) -> web.Response:
    return _json({"live": True})


@routes.get("/v2/health/ready")
async def ready(request: web.Request) -> web.Response:
    ok = request.app[DATAPLANE].ready
    return _json({"ready": ok}, 200 if ok else 503)


@routes.get("/v2")
@routes.get("/v2/")  # the Open Inference Protocol's REST specification writes it with the slash
async def server_metadata(request: web.Request) -> web.Response:
    extensions = ["binary_tensor_data", "model_configuration", "statistics"]
    server = request.app[CONFIG].server
    if server.repository_api:
        extensions.append("model_repository")
    extensions += [f"{kind}_shared_memory" for kind in ("system", "cuda") if getattr(server.shared_memory, kind)]
    return _json({"name": "trt-batcher", "version": __version__, "extensions": extensions})


@routes.get("/v2/models/stats")
@_model_route("GET", "/stats")
async def model_statistics(request: web.Request) -> web.Response:
    """Triton's statistics extension (what perf_analyzer reads for its server-side breakdown)."""
    info = request.match_info
    return _json(await _answer(request.app[DATAPLANE].statistics(info.get("model"), info.get("version"))))


@_model_route("GET")
async def model_metadata(request: web.Request) -> web.Response:
    return _json(await request.app[DATAPLANE].model_metadata(*_model(request)))


@_model_route("GET", "/ready")
async def model_ready(request: web.Request) -> web.Response:
    name, version = _model(request)
    ok = await _answer(request.app[DATAPLANE].model_ready(name, version))
    return _json({"name": name, "ready": ok}, 200 if ok else 503)


@_model_route("GET", "/config")
async def model_config(request: web.Request) -> web.Response:
    """The model's configuration in Triton's model-config JSON form (what perf_analyzer and tritonclient read)."""
    return _json(await request.app[DATAPLANE].model_config(*_model(request)))


def warm_codec(slot: ModelSlot) -> None:
    """Load hook: run the HTTP path's decode and encode once on a one-row sample of this model (no execution, no
    metrics), so the first real request does not pay first-call costs in the codec."""
    sample = warmup_inputs(slot.signature, slot.cfg)
    specs = {s.name: s for s in slot.signature.inputs}
    parts = [a.tobytes() if a.dtype != object else b"".join(len(b).to_bytes(4, "little") + b for b in a.ravel())
             for a in sample.values()]
    header = orjson.dumps({"inputs": [
        {"name": n, "datatype": specs[n].datatype, "shape": list(a.shape), "parameters": {"binary_data_size": len(p)}}
        for (n, a), p in zip(sample.items(), parts)]})
    req = decode_request(header + b"".join(parts), str(len(header)))
    outs = {o.name: np.zeros((1,), dtype=NUMPY_DTYPES[o.datatype]) if o.datatype != "BYTES"
            else np.array([b""], dtype=object) for o in slot.signature.outputs}
    encode_response(InferResponse(slot.name, slot.version, outs, req))


async def expect_handler(request: web.Request) -> web.Response | None:
    """``Expect: 100-continue`` as aiohttp answers it, except that a declared ``Content-Length`` over
    ``server.max_body_bytes`` gets no ``100 Continue``: the route's handler runs at once and its body read refuses it
    unread (:func:`batcher.bodies.read_body`: 413, counted as any too-large request is, the connection closed after
    it), so the client never sends the body (RFC 9110, 10.1.1: the server may answer with the final status
    instead); any other expectation 417 with a JSON body (aiohttp's own 417 is plain text, sent before the route's
    handler, so before the application's edge could map it: :func:`batcher.app.edge`)."""
    declared, limit = request.content_length, request.app[CONFIG].server.max_body_bytes
    if declared is not None and declared > limit:
        return None
    try:
        await _default_expect_handler(request)
    except web.HTTPExpectationFailed as exc:
        return web.Response(body=orjson.dumps({"error": exc.text}), status=exc.status, content_type="application/json")
    return None


# ---------------------------------------------------------------------------- repository extension
def _repository(request: web.Request) -> None:
    server = request.app[CONFIG].server
    if not server.repository_api:
        raise ModelNotFound("the repository API is disabled (server.repository_api: false)")
    if server.repository_token is not None:
        scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
        # the scheme is case-insensitive (RFC 9110, 11.1), the token compared in constant time; surrogateescape: a
        # header's bytes that are not UTF-8 (aiohttp decodes them so) compare unequal, not 500
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"),
                                                                  server.repository_token.encode()):
            raise Unauthorized("the repository API needs Authorization: Bearer <server.repository_token>",
                               headers={"WWW-Authenticate": 'Bearer realm="repository"'})


async def _repository_body(request: web.Request, what: str) -> dict:
    """A repository request's body: a JSON object, or nothing (``{}``). Keys the extension does not define are
    ignored, as Triton does; ``parameters`` must be an object.

    Raises:
        InvalidInput: not JSON, not an object, or ``parameters`` not an object; what reading a body raises
            (:func:`batcher.bodies.read_body`: 408, 413, 415).
    """
    server = request.app[CONFIG].server
    raw = await read_body(request, server.max_body_bytes, server.read_timeout_s)
    if not raw.strip():
        return {}
    doc = json_object(raw, f"{what}: the body")
    if not isinstance(doc.get("parameters", {}), dict):
        raise InvalidInput(f"{what}: parameters: expected an object, got {json_type(doc['parameters'])}")
    return doc


@routes.post("/v2/repository/index")
async def repository_index(request: web.Request) -> web.Response:
    """Triton's repository index; ``{"ready": true}`` lists only the READY versions, ``false`` the others."""
    _repository(request)
    ready = (await _repository_body(request, "repository index")).get("ready")
    if ready is not None and not isinstance(ready, bool):
        raise InvalidInput(f"repository index: ready: expected true or false, got {ready!r}")
    return _json(await _answer(request.app[DATAPLANE].repository_index(ready)))


@routes.get("/v2/repository/events")
async def repository_events(request: web.Request) -> web.Response:
    """Load, evict and unload events with durations and memory before/after (this server's addition)."""
    _repository(request)
    return _json(await _answer(request.app[DATAPLANE].repository_events()))


@routes.post("/v2/repository/models/{model}/load")
async def repository_load(request: web.Request) -> web.Response:
    """Load a model; ``{"parameters": {"config": "<model-config JSON>"}}`` (Triton's form: a JSON *string*)
    applies a config first (:meth:`batcher.dataplane.DataPlane.load`). Model files (``file:...``) cannot be sent."""
    _repository(request)
    params = (await _repository_body(request, "load")).get("parameters", {})
    for key in params:
        if key.startswith("file:"):
            raise InvalidInput(f"load: parameters.{key}: this server does not take model files through the API "
                               "(serve them from the config or the model repository)")
        if key != "config":
            raise InvalidInput(f"load: parameters.{key}: unknown parameter (supported: config)")
    config = params.get("config")
    if config is not None:
        if not isinstance(config, str):
            raise InvalidInput("load: parameters.config: expected a string holding the model-config JSON, got "
                               f"{json_type(config)}")
        config = json_object(config, "load: parameters.config")
    await request.app[DATAPLANE].load(request.match_info["model"], config)
    return _json({})


@routes.post("/v2/repository/models/{model}/unload")
async def repository_unload(request: web.Request) -> web.Response:
    """Unload a model; Triton's ``parameters.unload_dependents`` is accepted (there are no dependents here)."""
    _repository(request)
    params = (await _repository_body(request, "unload")).get("parameters", {})
    for key, value in params.items():
        if key != "unload_dependents":
            raise InvalidInput(f"unload: parameters.{key}: unknown parameter (supported: unload_dependents)")
        if not isinstance(value, bool):
            raise InvalidInput(f"unload: parameters.unload_dependents: expected true or false, got {value!r}")
    await request.app[DATAPLANE].unload(request.match_info["model"])
    return _json({})


# ---------------------------------------------------------------------------- shared-memory extensions
_SHM = "/v2/{kind:systemsharedmemory|cudasharedmemory}"


def _shm_kind(request: web.Request) -> str:
    """``"system"`` or ``"cuda"``; NotFound (404) while that extension is off."""
    kind = "system" if request.match_info["kind"] == "systemsharedmemory" else "cuda"
    require_enabled(request.app[CONFIG].server.shared_memory, kind)
    return kind


@routes.get(_SHM + "/status")
@routes.get(_SHM + "/region/{name}/status")
async def shm_status(request: web.Request) -> web.Response:
    """Triton's shared-memory status: every region of the kind, or one (:mod:`batcher.shm`)."""
    return _json(await _answer(request.app[DATAPLANE].shm_status(_shm_kind(request), request.match_info.get("name"))))


@routes.post(_SHM + "/region/{name}/register")
async def shm_register(request: web.Request) -> web.Response:
    kind = _shm_kind(request)
    server = request.app[CONFIG].server
    params = decode_shm_register(kind, await read_body(request, server.max_body_bytes, server.read_timeout_s))
    await request.app[DATAPLANE].shm_register(kind, request.match_info["name"], **params)
    return _json({})


@routes.post(_SHM + "/unregister")
@routes.post(_SHM + "/region/{name}/unregister")
async def shm_unregister(request: web.Request) -> web.Response:
    await request.app[DATAPLANE].shm_unregister(_shm_kind(request), request.match_info.get("name"))
    return _json({})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


__all__ = ["expect_handler", "routes", "warm_codec"]
