"""The aiohttp application: routes, the one place errors become responses, and the data plane's lifetime.

The data plane (models, their threads and memory) lives in ``cleanup_ctx``: it is started before the server
accepts connections and closed, with every task cancelled and awaited, when the server stops.

SIGTERM drains (:func:`_drain_on_sigterm`), then closes the port without resetting a connection the kernel had
already accepted (:func:`close_the_door`).

A client that half-closes its connection (``shutdown(SHUT_WR)``) after sending a complete request gets no answer:
aiohttp's protocol takes the end of the client's stream for the client going away (``RequestHandler.eof_received``
lets the transport close; aio-libs/aiohttp#3659, open), so the handler is cancelled and the request counts as
``canceled``. Answering it would mean replacing aiohttp's protocol class and reading its private state; this server
does not. Clients should send ``Connection: close`` and keep their side open until the answer has come.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import logging
import os
import signal
import socket
import struct
import termios
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from .config import Config
from . import httplog
from .bodies import BUDGET, BodyBudget
from .bodies import release as release_body
from .errors import BatcherError
from .dataplane import DataPlane
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


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The application's one middleware, its edge: map every error to a JSON response, in one place; give back the
    request's share of the body budget when its handler is done (:func:`batcher.bodies.release`); and once SIGTERM's
    drain has begun, close each connection after its answer (``Connection: close``), so that a keep-alive client
    sends its next request on a new connection (503 while the port is open, refused after) instead of on one the
    server is about to close under it. A 408 says ``Connection: close`` too: the rest of that body may still come,
    so nothing after it on that connection could be read as a request (RFC 9110, 15.5.9); aiohttp closes it once
    its lingering time (10 s) has discarded what still comes, instead of keeping it alive."""
    try:
        resp = await handler(request)
    except BatcherError as exc:
        resp = error_response(exc.status, exc.message, exc.retry_after_s, exc.headers)
    except web.HTTPException as exc:  # aiohttp's own: unknown route 404, 405, 413 body over client_max_size
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
    if request.app[SHUTDOWN].draining or resp.status == 408:
        resp.force_close()  # 408: the body was not read to its end: the connection carries no other request
    return resp


def _drain_on_sigterm(dataplane: DataPlane, grace_s: float, shutdown: Shutdown) -> None:
    """SIGTERM: readiness turns false at once and new requests get 503 + Retry-After, while accepted requests
    finish (at most ``grace_s``); then SIGINT starts aiohttp's graceful exit, which releases the models.

    Replaces the SIGTERM handler aiohttp installed (before the app started); SIGINT keeps aiohttp's."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task] = []

    async def drain_then_exit() -> None:
        await dataplane.drain(grace_s)
        try:
            await close_the_door()
        except Exception:  # never keeps the process from exiting
            log.exception("closing the port without resetting connections failed; closing it anyway")
        os.kill(os.getpid(), signal.SIGINT)

    def on_sigterm() -> None:
        shutdown.draining = True
        if not tasks:
            log.info("SIGTERM: not ready any more; finishing accepted requests (grace %.0f s)", grace_s)
            tasks.append(loop.create_task(drain_then_exit()))

    try:
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    except (NotImplementedError, RuntimeError):  # no signals on this platform or thread
        pass


# ---------------------------------------------------------------------------- the end of the drain: the port
#: ``SO_ATTACH_FILTER`` (``asm-generic/socket.h``): a classic BPF program that filters what reaches a socket
SO_ATTACH_FILTER = 26
#: A socket filter that drops TCP segments with SYN set and ACK clear - new connection attempts - and keeps every
#: other (a TCP socket's filter sees the segment from its TCP header on): ``ldb [13]`` (the flags), ``and #0x12``,
#: ``jeq #0x02`` drop, else keep. Handshakes already under way complete (their ACK passes).
DROP_NEW_CONNECTIONS = ((0x30, 0, 0, 13), (0x54, 0, 0, 0x12), (0x15, 0, 1, 0x02), (0x06, 0, 0, 0),
                        (0x06, 0, 0, 0xFFFFFFFF))
#: the longest :func:`close_the_door` waits for what the kernel accepted to be taken and read, seconds
DOOR_WAIT_S = 2.0
_TCP_ESTABLISHED, _TCP_SYN_RECV = 1, "03"  # tcp_info's state; /proc/net/tcp's st column
_TCP_INFO_BYTES = 232


def _tcp_sockets() -> list[socket.socket]:
    """This process's TCP sockets, each through a duplicate of one of its descriptors (close them after use):
    Linux's ``/proc/self/fd``; none where it is missing."""
    out: list[socket.socket] = []
    seen: set[str] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            if not target.startswith("socket:") or target in seen:
                continue
            fd = os.dup(int(name))
        except (OSError, ValueError):  # closed meanwhile
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            seen.add(target)
            out.append(sock)
        else:
            sock.close()
    return out


def _half_open_handshakes(ports: set[int]) -> int:
    """Handshakes to ``ports`` the kernel is in the middle of (``SYN_RECV`` in ``/proc/net/tcp``, ``tcp6``)."""
    n = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == _TCP_SYN_RECV and int(fields[1].rsplit(":", 1)[1], 16) in ports:
                n += 1
    return n


def _waiting(ports: set[int]) -> int:
    """Connections to ``ports`` the server still owes a look: in an accept queue, in the middle of their handshake,
    or accepted with bytes not read yet or nothing sent yet."""
    n = _half_open_handshakes(ports)
    for sock in _tcp_sockets():
        try:
            if sock.getsockname()[1] not in ports:
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                n += struct.unpack_from("I", info, 24)[0]  # tcpi_unacked: a listener's accept queue
            elif info[0] == _TCP_ESTABLISHED:
                unread = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
                received = struct.unpack_from("Q", info, 128)[0] if len(info) >= 136 else 1  # tcpi_bytes_received
                n += unread > 0 or received == 0
        except OSError:
            pass
        finally:
            sock.close()
    return n


async def close_the_door(wait_s: float = DOOR_WAIT_S, poll_s: float = 0.005) -> None:
    """The end of SIGTERM's drain, before aiohttp closes the listening sockets (Linux; elsewhere nothing is done).

    Closing a listening socket resets every connection still in its accept queue (the kernel completed their
    handshake; the server had not taken them yet), and closing a connection whose bytes were never read resets it
    too: clients that connected in the last moments of the drain got a reset instead of an answer. So new
    connection attempts are dropped first (:data:`DROP_NEW_CONNECTIONS` on every listening socket of the process:
    the client sends its SYN again a second later and then finds the port closed, refused, which is safe to
    retry), and the event loop goes on taking and answering (503 + ``Retry-After``, ``Connection: close``) what the
    kernel accepted, until no connection is in an accept queue or half-way through its handshake, and every
    accepted one has sent something and had it read - at most ``wait_s`` (a client that connects and sends nothing
    is closed then, as an idle keep-alive connection is)."""
    sockets = _tcp_sockets()
    ports: set[int] = set()
    try:
        program = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in DROP_NEW_CONNECTIONS))
        fprog = struct.pack("@HP", len(DROP_NEW_CONNECTIONS), ctypes.addressof(program))
        for sock in sockets:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
                ports.add(sock.getsockname()[1])
    except OSError as exc:  # no socket filters here: close as before
        log.debug("cannot hold back new connections (%s); closing the port", exc)
        return
    finally:
        for sock in sockets:
            sock.close()
    if not ports:
        return
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s
    while (waiting := _waiting(ports)) and loop.time() < end:
        await asyncio.sleep(poll_s)
    if waiting:
        log.info("closing the port with %d connection(s) still unanswered after %.1f s", waiting, wait_s)


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
    app = web.Application(client_max_size=config.server.max_body_bytes,
                          middlewares=[errors_middleware], handler_args={"auto_decompress": False})
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
        _drain_on_sigterm(dataplane, config.server.shutdown_grace_s, shutdown)
        yield
        if remote is None:
            loaded = sum(1 for s in dataplane.repository.all() if s.loaded is not None)
            log.info("shutting down: releasing %d loaded model(s)", loaded)
        await dataplane.close()

    app.cleanup_ctx.append(dataplane_ctx)
    for route in routes:
        route.kwargs.setdefault("expect_handler", expect_handler)
    app.add_routes(routes)
    return app
