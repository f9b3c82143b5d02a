"""A bare aiohttp handler that reads the request body and returns a fixed body: the floor of the front-end CPU
test in ``bench/peers.py`` (what an aiohttp server costs per request before any protocol work).

    python -m bench.bare_server --port 8000

``POST /v2/models/{m}/infer`` reads the whole body and answers a fixed binary-extension response (the one a
KServe v2 server gives for the trivial model's one-row ``[1, 4]`` FP32 output, with its
``Inference-Header-Content-Length`` header), whatever was sent; ``GET /v2/health/live`` and ``/v2/health/ready``
answer ``{"ready":true}``. No decoding, validation, metrics or logging. Listens on 127.0.0.1 only; prints
``READY http=PORT`` once listening.
"""

from __future__ import annotations

import json
import struct
import sys

from bench.scripts import add_health_routes, script_parser, serve
from bench.server import free_port


def fixed_response(model: str = "trivial", width: int = 4) -> tuple[bytes, dict[str, str]]:
    """The fixed answer: a binary-extension response with one ``y`` FP32 ``[1, width]`` output of ones."""
    blob = struct.pack(f"<{width}f", *([1.0] * width))
    head = json.dumps({"model_name": model, "model_version": "1", "outputs": [
        {"name": "y", "datatype": "FP32", "shape": [1, width], "parameters": {"binary_data_size": len(blob)}}]},
        separators=(",", ":")).encode()
    return head + blob, {"Content-Type": "application/octet-stream",
                         "Inference-Header-Content-Length": str(len(head))}


def make_app(model: str = "trivial", width: int = 4):
    from aiohttp import web

    body, headers = fixed_response(model, width)

    async def infer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, headers=headers)

    app = web.Application()
    app.router.add_post("/v2/models/{model}/infer", infer)
    add_health_routes(app)
    return app


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.bare_server", __doc__)
    p.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1 (default: a free one)")
    p.add_argument("--model-name", default="trivial", help="model name in the fixed answer (default: trivial)")
    p.add_argument("--event-loop", choices=["asyncio", "uvloop"], default="asyncio",
                   help="asyncio's event loop (default) or uvloop's")
    args = p.parse_args(argv)
    serve(make_app(args.model_name), args.port or free_port(), args.event_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
