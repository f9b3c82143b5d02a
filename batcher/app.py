"""The aiohttp application: routes, the one place errors become responses, and the data plane's lifetime.

The data plane (models, their threads and memory) lives in ``cleanup_ctx``: it is started before the server
accepts connections and closed, with every task cancelled and awaited, when the server stops.

SIGTERM drains (:func:`_drain_on_sigterm`), then closes the port without resetting a connection the kernel had
already accepted (:func:`batcher.door.close_the_door`).

A client that half-closes its connection (``shutdown(SHUT_WR)``) after sending a complete request gets no answer:
aiohttp's protocol takes the end of the client's stream for the client going away (``RequestHandler.eof_received``
lets the transport close; aio-libs/aiohttp#3659, open), so the handler is cancelled and the request counts as
``canceled``. Answering it would mean replacing aiohttp's protocol class and reading its private state; this server
does not. Clients should send ``Connection: close`` and keep their side open until the answer has come.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from aiohttp import hdrs, web

from .config import Config
from . import httplog
from .bodies import BUDGET, BodyBudget
from .bodies import release as release_body
from .errors import BatcherError
from .dataplane import DataPlane
from .door import close_the_door
from .keys import CONFIG, DATAPLANE, METRICS
from .metrics import Metrics
from .routes import expect_handler, routes, warm_codec

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str, retry_after_s: int | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """``{"error": message}`` with ``status`` and ``headers``; 503 answers carry ``Retry-After``."""
    headers = dict(headers or {})
    if retry_after_s is not None or status == 503:
        headers["Retry-After"] = str(retry_after_s or 1)
    return web.Response(
        body=orjson.dumps({"error": message}), status=status, content_type="application/json", headers=headers
    )


class Shutdown:
    """Whether SIGTERM's drain has begun in this process (:func:`_drain_on_sigterm`)."""

    draining = False


#: the application's :class:`Shutdown`
SHUTDOWN = web.AppKey("shutdown", Shutdown)


def edge(handler: Handler, shutdown: Shutdown) -> Handler:
    """``handler`` as the application registers it (:func:`create_app`, every route's; the fallback's too,
    :func:`unrouted`, so an unknown path's 404 and a wrong method's 405 come here): the application's edge, the one
    place where every error becomes a JSON response. It maps every error to a JSON response; gives back the request's
    share of the body budget when its handler is done (:func:`batcher.bodies.release`); and once SIGTERM's drain has
    begun, closes each connection after its answer (``Connection: close``), so that a keep-alive client sends its next
    request on a new connection (503 while the port is open, refused after) instead of on one the server is about to
    close under it. A 408 says ``Connection: close`` too: the rest of that body may still come, so nothing after it
    on that connection could be read as a request (RFC 9110, 15.5.9); aiohttp closes it once its lingering time
    (10 s) has discarded what still comes, instead of keeping it alive. A 413 likewise.

    A wrapper made once at registration, one coroutine frame around the handler's, not a middleware: any middleware
    makes aiohttp 3.14 (``Application._handle``) add its own layer (``_fix_request_current_app``) and look the chain
    up (``_cached_build_middleware``) on every request. Measured with the middleware's code unchanged as this
    wrapper (h2load, 10 rounds of 20,000 small binary requests, ``bench/results/peers/frontend_day15/ab2.py``):
    97.5 against 103.3 us of CPU per request."""

    async def at_the_edge(request: web.Request) -> web.StreamResponse:
        try:
            resp = await handler(request)
        except BatcherError as exc:
            resp = error_response(exc.status, exc.message, exc.retry_after_s, exc.headers)
        except web.HTTPException as exc:  # aiohttp's own: 404 and 405 (unrouted), 413 body over client_max_size
            if exc.status < 400:
                raise
            resp = error_response(exc.status, exc.text or exc.reason)
            for k in ("Allow", "Retry-After"):
                if k in exc.headers:
                    resp.headers[k] = exc.headers[k]
        except ConnectionResetError:  # the client went away mid-request: nobody to answer, nothing to log loudly
            log.debug("client disconnected during %s %s", request.method, request.path)
            resp = error_response(400, "client disconnected before the request was complete")
        except Exception as exc:  # a bug: answer 500 and keep serving
            log.exception("unhandled error on %s %s", request.method, request.path)
            resp = error_response(500, f"internal error: {exc!r}")
        finally:
            release_body(request)
        if shutdown.draining or resp.status in (408, 413) or (
                resp.status in (404, 405) and hdrs.EXPECT in request.headers and not request.content.is_eof()):
            # 408, 413, and a 404/405 answered to an Expect instead of 100 Continue (:func:`no_continue`): the body
            # was not read to its end, so the connection carries no other request
            resp.force_close()
        return resp

    return functools.update_wrapper(at_the_edge, handler)


class Unrouted(web.DynamicResource):
    """The fallback resource (:func:`unrouted`, :func:`create_app` registers it last): any path, ``*`` too
    (``OPTIONS *``), which its pattern ``/{tail:.*}`` alone would miss: aiohttp's router tries a path's resources
    from its longest prefix down to ``/``, ``*`` at ``/`` too, where this one is indexed. ``_match`` is the hook
    aiohttp's own resources implement; were it renamed, ``OPTIONS *`` alone would get aiohttp's plain-text 404
    again (``tests/unit/test_app_edge.py`` says so)."""

    def __init__(self) -> None:
        super().__init__("/{tail:.*}")

    def _match(self, path: str) -> dict[str, str]:
        return {"tail": path}


async def no_continue(request: web.Request) -> None:
    """The fallback route's ``Expect`` handler: no ``100 Continue`` for a request no route took, whose body
    :func:`unrouted` never reads. Its 404 or 405 is the answer instead (RFC 9110, 10.1.1: a server may send the final
    status code in place of 100), and :func:`edge` closes the connection after it, as the body may still come."""
    return None


async def unrouted(request: web.Request) -> web.StreamResponse:
    """The fallback route (:class:`Unrouted`, any method): the request no route took. Raises what aiohttp's
    router would have answered, for :func:`edge` to map as the middleware did: 405 with ``Allow`` when some
    resource's path matches (the methods of every such resource, united as ``UrlDispatcher.resolve`` unites them;
    HEAD wherever ``routes.get`` added it), else 404 (``"404: Not Found"``).

    Without a middleware aiohttp answers these itself, in plain text, before any handler (``MatchInfoError``). Its
    router tries a path's resources from the longest prefix down to ``/``, where this one is indexed, so a request
    that a route takes never comes here: a matched route costs nothing more; a 404 or 405 costs one ``resolve`` of
    each resource. And a request whose method one resource lacks still reaches a later resource whose path matches
    too and that has it, as before (a ``*`` route on each resource would have answered 405 from the first)."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        allowed |= (await resource.resolve(request))[1]
    allowed.discard(hdrs.METH_ANY)  # this route's own
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise web.HTTPNotFound()


#: seconds after SIGTERM's grace for the 503s of the requests shed then to be written (:meth:`DataPlane.shed`).
SHED_WAIT_S = 1.0


def _drain_on_sigterm(dataplane: DataPlane, grace_s: float, shutdown: Shutdown, bodies: BodyBudget) -> None:
    """SIGTERM: readiness turns false at once and new requests get 503 + Retry-After, while accepted requests
    finish (at most ``grace_s``); then SIGINT starts aiohttp's graceful exit, which releases the models.

    Replaces the SIGTERM handler aiohttp installed (before the app started); SIGINT keeps aiohttp's."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task] = []

    async def drain_then_exit() -> None:
        await dataplane.drain(grace_s)
        cut = bodies.cut()  # bodies still arriving at the end of the grace: 503, not a close with no answer
        if cut:
            log.info("SIGTERM: %d request body(ies) still arriving after the grace; answered 503", cut)
        shed = dataplane.shed()  # requests still queued: 503 too (the exit closed them without an answer)
        if shed:
            log.info("SIGTERM: %d accepted request(s) still queued after the grace; answered 503", shed)
            await dataplane.drain(SHED_WAIT_S)  # their answers written (batches executing may still end meanwhile)
        try:
            await close_the_door()
        except Exception:  # never keeps the process from exiting
            log.exception("closing the port without resetting connections failed; closing it anyway")
        os.kill(os.getpid(), signal.SIGINT)

    def on_sigterm() -> None:
        shutdown.draining = True
        if not tasks:
            log.info("SIGTERM: not ready any more; finishing accepted requests (grace %g s)", grace_s)
            tasks.append(loop.create_task(drain_then_exit()))

    try:
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    except (NotImplementedError, RuntimeError):  # no signals on this platform or thread
        pass


def create_app(config: Config, remote: Callable[[Metrics], Any] | None = None) -> web.Application:
    """Build the application for ``config``; models load when it starts (``cleanup_ctx``).

    Args:
        remote: multi-process mode's front end: makes the data plane that forwards to the engine processes
            (:class:`batcher.frontend.RemoteDataPlane`) from the metrics; None: the in-process :class:`DataPlane`.
    """
    httplog.install()  # malformed HTTP is the client's mistake: INFO, no traceback, rate-limited
    # bodies are read and decoded by batcher.bodies, within the limit: aiohttp's own decompression is off
    metrics = Metrics()
    # every request body in memory counts against this process's budget, held until the request's handler returns
    metrics.inflight_body_budget.set(config.server.max_inflight_body_bytes)
    bodies = BodyBudget(config.server.max_inflight_body_bytes, metrics.inflight_body_bytes)
    app = web.Application(client_max_size=config.server.max_body_bytes, handler_args={"auto_decompress": False})
    app[CONFIG] = config
    app[BUDGET] = bodies
    app[SHUTDOWN] = shutdown = Shutdown()
    app[METRICS] = metrics
    if remote is None:
        app[DATAPLANE] = dataplane = DataPlane(config, metrics)
        dataplane.repository.on_load.append(warm_codec)  # the HTTP side's load hook
    else:
        app[DATAPLANE] = dataplane = remote(metrics)

    async def dataplane_ctx(app: web.Application) -> AsyncIterator[None]:
        await dataplane.start()
        _drain_on_sigterm(dataplane, config.server.shutdown_grace_s, shutdown, bodies)
        yield
        if remote is None:
            loaded = sum(1 for s in dataplane.repository.all() if s.loaded is not None)
            log.info("shutting down: releasing %d loaded model(s)", loaded)
        await dataplane.close()

    app.cleanup_ctx.append(dataplane_ctx)
    # every handler behind the edge; the fallback last, so that aiohttp's router never answers a request itself
    for route in routes:
        route.kwargs.setdefault("expect_handler", expect_handler)
        web.RouteDef(route.method, route.path, edge(route.handler, shutdown), route.kwargs).register(app.router)
    app.router.register_resource(fallback := Unrouted())
    fallback.add_route(hdrs.METH_ANY, edge(unrouted, shutdown), expect_handler=no_continue)
    return app
