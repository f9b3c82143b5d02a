"""A minimal KServe v2 server without batching (the seeds' design): every request runs alone through one ONNX
Runtime session, one at a time under a lock. The baseline of ``bench/peers.py``.

    python -m bench.nobatch_server --model-path mlp.onnx --model-name mlp --port 8000

aiohttp, the same routes the load tool needs: ``GET /v2/health/live``, ``/v2/health/ready``, ``/v2/models/{m}``
(metadata), ``/v2/models/{m}/ready`` and ``POST /v2/models/{m}/infer`` with JSON tensors or the binary tensor
extension (``Inference-Header-Content-Length``; binary outputs when ``parameters.binary_data_output`` or an
output's ``parameters.binary_data`` is true). The handler decodes the request on the event loop, then runs
``session.run`` in a worker thread while holding an ``asyncio.Lock`` (one execution at a time, as in the seeds),
and encodes the answer. Errors: 400 with ``{"error": ...}``; 404 for another model. Listens on 127.0.0.1 only;
prints ``READY http=PORT`` once listening.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

from bench.mlp import cpu_session
from bench.scripts import READY_BODY, add_health_routes, peer_server_parser, serve
from bench.server import free_port
from engines.datatypes import NUMPY_DTYPES, ONNX_TYPES


class BadRequest(Exception):
    pass


def decode(body: bytes, header_len: str | None) -> tuple[dict, dict[str, np.ndarray]]:
    """(request JSON, {input name: array}) from a JSON or binary-extension body."""
    import orjson

    try:
        if header_len is not None:
            n = int(header_len)
            head, blob = orjson.loads(body[:n]), memoryview(body)[n:]
        else:
            head, blob = orjson.loads(body), memoryview(b"")
    except ValueError as e:
        raise BadRequest(f"malformed request: {e}") from None
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for inp in head.get("inputs", []):
        try:
            name, dt, shape = inp["name"], NUMPY_DTYPES[inp["datatype"]], [int(d) for d in inp["shape"]]
            if dt.kind == "O":
                raise KeyError(inp["datatype"])  # BYTES: this server takes numeric tensors only
        except (KeyError, TypeError, ValueError):
            raise BadRequest(f"input needs name, a numeric datatype and shape (got {inp!r:.200})") from None
        size = (inp.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            a = np.frombuffer(blob[offset:offset + size], dtype=dt)
            offset += size
        elif "data" in inp:
            a = np.asarray(inp["data"], dtype=dt).reshape(-1)
        else:
            raise BadRequest(f"input '{name}' has neither data nor binary_data_size")
        try:
            arrays[name] = a.reshape(shape)
        except ValueError:
            raise BadRequest(f"input '{name}': {a.size} elements do not fit shape {shape}") from None
    return head, arrays


def encode(model: str, head: dict, outputs: dict[str, np.ndarray], types: dict[str, str]) -> tuple[bytes, dict]:
    import orjson

    wanted = {o["name"]: o for o in head.get("outputs") or []}
    default_binary = bool((head.get("parameters") or {}).get("binary_data_output", False))
    entries, blobs = [], []
    for name, a in outputs.items():
        if wanted and name not in wanted:
            continue
        e = {"name": name, "datatype": types[name], "shape": list(a.shape)}
        if (wanted.get(name, {}).get("parameters") or {}).get("binary_data", default_binary):
            b = np.ascontiguousarray(a).tobytes()
            e["parameters"] = {"binary_data_size": len(b)}
            blobs.append(b)
        else:
            e["data"] = a.reshape(-1).tolist()
        entries.append(e)
    resp = {"model_name": model, "model_version": "1", "outputs": entries}
    if "id" in head:
        resp["id"] = head["id"]
    js = orjson.dumps(resp, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return js, {"Content-Type": "application/json"}
    return js + b"".join(blobs), {"Content-Type": "application/octet-stream",
                                  "Inference-Header-Content-Length": str(len(js))}


def make_app(model_path: str, model_name: str, intra_op_threads: int):
    import orjson
    from aiohttp import web

    session = cpu_session(model_path, intra_op_threads)
    ins = {i.name: i for i in session.get_inputs()}
    outs = [o.name for o in session.get_outputs()]
    types = {o.name: ONNX_TYPES.get(o.type, "FP32") for o in session.get_outputs()}
    meta = orjson.dumps({
        "name": model_name, "versions": ["1"], "platform": "onnxruntime_onnx",
        "inputs": [{"name": i.name, "datatype": ONNX_TYPES.get(i.type, "FP32"),
                    "shape": [d if isinstance(d, int) else -1 for d in i.shape]} for i in session.get_inputs()],
        "outputs": [{"name": o.name, "datatype": types[o.name],
                     "shape": [d if isinstance(d, int) else -1 for d in o.shape]} for o in session.get_outputs()],
    })
    lock = asyncio.Lock()

    def err(status: int, msg: str) -> web.Response:
        return web.Response(status=status, body=orjson.dumps({"error": msg}), content_type="application/json")

    def check(request: web.Request) -> web.Response | None:
        if request.match_info["model"] != model_name:
            return err(404, f"unknown model '{request.match_info['model']}' (served: {model_name})")
        return None

    async def metadata(request: web.Request) -> web.Response:
        return check(request) or web.Response(body=meta, content_type="application/json")

    async def model_ready(request: web.Request) -> web.Response:
        return check(request) or web.Response(body=READY_BODY, content_type="application/json")

    async def infer(request: web.Request) -> web.Response:
        if (bad := check(request)) is not None:
            return bad
        body = await request.read()
        try:
            head, arrays = decode(body, request.headers.get("Inference-Header-Content-Length"))
            if set(arrays) != set(ins):
                raise BadRequest(f"inputs {sorted(arrays)} differ from the model's {sorted(ins)}")
        except BadRequest as e:
            return err(400, str(e))
        loop = asyncio.get_running_loop()
        async with lock:  # one execution at a time, one request per execution
            try:
                results = await loop.run_in_executor(None, session.run, outs, arrays)
            except Exception as e:  # noqa: BLE001 - ONNX Runtime rejects bad shapes/types
                return err(400, f"execution failed: {e}")
        data, headers = encode(model_name, head, dict(zip(outs, results)), types)
        return web.Response(body=data, headers=headers)

    app = web.Application(client_max_size=256 << 20)
    add_health_routes(app)
    app.router.add_get("/v2/models/{model}", metadata)
    app.router.add_get("/v2/models/{model}/ready", model_ready)
    app.router.add_post("/v2/models/{model}/infer", infer)
    return app


def main(argv: list[str] | None = None) -> int:
    args = peer_server_parser("bench.nobatch_server", __doc__).parse_args(argv)
    serve(make_app(args.model_path, args.model_name, args.intra_op_threads), args.port or free_port())
    return 0


if __name__ == "__main__":
    sys.exit(main())
