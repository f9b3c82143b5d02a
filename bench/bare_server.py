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

import argparse
import json
import socket
import struct
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    async def ready(_: web.Request) -> web.Response:
        return web.Response(body=b'{"ready":true}', content_type="application/json")

    app = web.Application()
    app.router.add_post("/v2/models/{model}/infer", infer)
    app.router.add_get("/v2/health/live", ready)
    app.router.add_get("/v2/health/ready", ready)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bare_server", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1 (default: a free one)")
    p.add_argument("--model-name", default="trivial", help="model name in the fixed answer (default: trivial)")
    args = p.parse_args(argv)
    from aiohttp import web

    port = args.port or free_port()
    web.run_app(make_app(args.model_name), host="127.0.0.1", port=port, access_log=None, shutdown_timeout=1.0,
                print=lambda *_: print(f"READY http={port}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
