"""What the bench scripts share: an argument parser whose help is the script's docstring, and, for the peer servers
written with aiohttp (``bench/nobatch_server.py``, ``bench/bare_server.py``), the health routes and serving on
127.0.0.1 with a ``READY`` line.

Only the standard library at import time: ``bench/pytriton_server.py`` imports it in PyTriton's own virtualenv.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

READY_BODY = b'{"ready":true}'


def script_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The parser of ``python -m PROG``: the docstring's first paragraph as the description, the rest (what is
    measured, units, how to run) as the epilog, line breaks kept."""
    head, _, rest = doc.strip().partition("\n\n")
    return argparse.ArgumentParser(prog=f"python -m {prog}", description=head, epilog=rest or None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def comma_list(kind: Callable[[str], Any]) -> Callable[[str], list]:
    """An argparse ``type``: ``"1,4,16"`` -> ``[kind("1"), kind("4"), kind("16")]`` (empty items skipped, so ``""``
    is ``[]``); a value ``kind`` refuses is argparse's usage error, naming the text."""

    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list (got {text!r})") from None

    return parse


def peer_server_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """:func:`script_parser` with the options every peer server takes from ``bench/peers.py``: ``--model-path``,
    ``--model-name``, ``--port``, ``--intra-op-threads``."""
    p = script_parser(prog, doc)
    p.add_argument("--model-path", required=True, help="ONNX model file (FP32 inputs with a leading batch dim)")
    p.add_argument("--model-name", default="mlp", help="served model name (default: mlp)")
    p.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1 (default: a free one)")
    p.add_argument("--intra-op-threads", type=int, default=1,
                   help="ONNX Runtime intra-op threads of each session (default: 1)")
    return p


def add_health_routes(app) -> None:
    """``GET /v2/health/live`` and ``/v2/health/ready`` on an aiohttp app, both answering ``{"ready":true}``."""
    from aiohttp import web

    async def ready(_: web.Request) -> web.Response:
        return web.Response(body=READY_BODY, content_type="application/json")

    app.router.add_get("/v2/health/live", ready)
    app.router.add_get("/v2/health/ready", ready)


def serve(app, port: int, event_loop: str = "asyncio") -> None:
    """Serve an aiohttp app on 127.0.0.1:``port`` without an access log, on asyncio's event loop or uvloop's;
    print ``READY http=PORT`` once listening."""
    import asyncio

    from aiohttp import web

    if event_loop == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, shutdown_timeout=1.0, loop=loop,
                print=lambda *_: print(f"READY http={port}", flush=True))
