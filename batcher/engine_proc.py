"""An engine process of multi-process mode: the queues, batchers, executors and contexts of one device (or of one
model on it: :class:`batcher.topology.Engine`), serving
front-end processes over Unix sockets (:mod:`batcher.ipc`).

Per front end (:class:`FrontendConnection`), each REQ message (:class:`_Request`) is queued at once where nothing
needs waiting for (:meth:`DataPlane.start_infer`: no task per request; its batch's end hands the outputs over),
else runs :meth:`DataPlane.infer` as a task, with ``read`` = the request of the message and ``deliver`` = send the
outputs. Either way the inputs are views of the shared area (no copy), the outputs go to the front end (RESULT),
and the front end's ACK - ok, too late, or failed - settles the outcome (:class:`batcher.outcomes.CountedLater`),
so it is counted once, here, after delivery, as in single-process mode. ABORT (the client went away) cancels the
request, or settles an answer sent but not yet acknowledged (counted ``canceled``; ``timeout`` when the front end
answered 504 itself, :data:`batcher.outcomes.OVERDUE`); a front end that dies cancels
every request it had and settles its answers not yet acknowledged (counted ``dropped``).

When the process closes its connections itself (:meth:`EngineServer.close`, after SIGTERM's drain:
:mod:`batcher.engine_main`), what it still holds its front ends answer 503 and count
(:class:`batcher.remote.EngineLost`), so it does not (:data:`batcher.outcomes.ENGINE_STOPPING`).

A request's input block is given back to its front end (the ``inputs_free`` flag of its outcome message, or a
RELEASE message later) only when nothing reads it any more (:class:`batcher.protocol.Lease`): a request answered
504 while its batch executes is still read by that batch.

The status area (one int64 per served model version, shared with every front end) holds the requests each
version has here - waiting, running or being delivered - which front ends read to route ``least_queue``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from typing import Any

import numpy as np

from .dataplane import DataPlane
from .outcomes import ENGINE_STOPPING, FRONTEND_LOST, CountedLater, cancel_reason
from .errors import BatcherError, RemoteError
from .ipc import (ABORT, ACK, CALL, CANCELED, DRAINING, ERROR, RELEASE, REPLY, REQ, RESULT, Allocator, Area, Channel,
                  area_view, error_tuple, pack_tensors, request_from, send_hello, unpack_tensors)
from .protocol import InferResponse, Lease
from .topology import DeviceOrder

log = logging.getLogger(__name__)


class _Request:
    """One REQ of a front end, from its message to its outcome message (RESULT or ERROR): its input lease (the
    input block goes back with the outcome, or in a RELEASE once nothing reads it), its count in the status area,
    and what runs it - a :class:`batcher.outcomes.Started` (``ticket``), or a task for the requests that must wait
    before they are queued (:meth:`FrontendConnection._infer`)."""

    __slots__ = ("conn", "rid", "lease", "slot", "concluded", "reading", "ticket", "task", "started", "aborted")

    def __init__(self, conn: FrontendConnection, rid: int, model: str, version: str) -> None:
        self.conn, self.rid = conn, rid
        self.concluded = False
        self.reading = True  # the request's handler may still read the inputs
        conn.leased += 1
        self.lease = Lease(self._inputs_free)
        self.ticket: Any = None
        self.task: asyncio.Task | None = None
        self.started = False  # its task has begun (a task cancelled before that never runs its body)
        self.aborted: tuple | None = None  # the cancel for a task not begun yet: raised where it reads the request
        self.slot = conn.server.slot_index.get((model, version), -1)
        if self.slot >= 0:
            conn.server.counts[self.slot] += 1

    def _inputs_free(self) -> None:
        conn = self.conn
        conn.leased -= 1
        if self.concluded:
            conn.channel.send((RELEASE, self.rid))
        conn.check_idle()

    def done_reading(self) -> None:
        """Nothing here reads the inputs any more (the scheduler's own hold lasts until its batch is done)."""
        if self.reading:
            self.reading = False
            self.lease.release()

    def uncount(self) -> None:
        """No more work here for it: waiting, running, done."""
        if self.slot >= 0:
            self.conn.server.counts[self.slot] -= 1
            self.slot = -1

    def deliver(self, response: InferResponse) -> CountedLater:
        """Send the outputs (RESULT); the front end's ACK (or ABORT, or its loss) settles the outcome."""
        conn = self.conn
        self.done_reading()  # before lease.free is read below
        entries, blocks = pack_tensors(response.outputs, conn.area, conn.outputs)
        if blocks:
            conn.out_blocks[self.rid] = blocks
        later = conn.acks[self.rid] = CountedLater()
        conn.channel.send((RESULT, self.rid, response.model_name, response.model_version, entries, response.deadline,
                           self.lease.free))
        self.concluded = True
        self.end()
        return later

    def fail(self, error: BaseException | None) -> None:
        """The outcome is ``error`` (None: cancelled, nobody waits for an answer): ERROR, unless one was sent."""
        self.end()
        if not self.concluded:
            self.concluded = True
            self.conn.channel.send((ERROR, self.rid, None if error is None else error_tuple(error), self.lease.free))

    def end(self) -> None:
        self.uncount()
        self.done_reading()
        self.ticket = self.task = None  # no reference cycle keeps the request's inputs alive
        self.conn.forget(self.rid)

    def cancel(self, reason: str | None = None) -> None:
        """The client (``reason`` FRONTEND_LOST: the front end) went away. A task not begun yet is not cancelled
        (its body, which counts and answers, would never run): it raises the cancel where it reads the request."""
        if self.ticket is not None:
            self.ticket.cancel(reason)
        elif self.task is not None:
            if self.started:
                self.task.cancel(reason)
            else:
                self.aborted = (reason,) if reason is not None else ()


class FrontendConnection:
    """One front end's connection: its shared area, its requests in progress and their acknowledgements."""

    def __init__(self, server: EngineServer, index: int, peer_pid: int | None = None) -> None:
        self.server = server
        self.index = index
        #: how the log names this front end: by its pid, as the supervisor's lines do (its own counter of
        #: connections would drift from the supervisor's front-end numbers after restarts)
        self.who = f"front end (pid {peer_pid})" if peer_pid else f"front end {index}"
        self.dataplane = server.dataplane
        half = server.buffer_bytes // 2
        self.area = Area(server.buffer_bytes)
        self.registration = server.register(self.area)
        self.outputs = Allocator(half, server.buffer_bytes - half)
        self.requests: dict[int, _Request] = {}  # REQ received, outcome not sent yet
        self.acks: dict[int, CountedLater] = {}  # answers sent (RESULT), not yet acknowledged
        self.out_blocks: dict[int, list[int]] = {}
        self.channel = Channel(self._on_message, self._on_lost)
        self.closed = asyncio.Event()
        #: requests whose inputs (views of ``area``) something may still read: a request cancelled while its batch
        #: executes is forgotten at once, and its lease ends with the batch (:class:`batcher.protocol.Lease`)
        self.leased = 0
        self._idle = asyncio.Event()  # set while no request is in progress and no batch reads ``area``
        self._idle.set()

    # ---------------------------------------------------------------- messages
    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == REQ:
            self._request(*msg[1:])
        elif kind == ACK:  # (ACK, rid, None or the error_tuple the front end answered instead, e.g. 504)
            self._free_outputs(msg[1])
            later = self.acks.pop(msg[1], None)
            if later is not None:
                later.settle(None if msg[2] is None else msg[2][1])
        elif kind == ABORT:  # (ABORT, rid) or (ABORT, rid, OVERDUE): its front end answered 504 itself
            reason = msg[2] if len(msg) > 2 else None
            req = self.requests.get(msg[1])
            if req is not None:
                req.cancel(reason)
            later = self.acks.pop(msg[1], None)
            if later is not None:
                later.settle(cancel_reason(reason))
            self._free_outputs(msg[1])
        elif kind == CALL:
            asyncio.get_running_loop().create_task(self._call(*msg[1:]))
        else:
            log.error("%s sent an unknown message kind %r", self.who, kind)

    def _request(self, rid: int, model: str, version: str, received: float, fields: tuple, inputs: list,
                 failure: Any) -> None:
        """A REQ: queued at once where nothing needs waiting for (:meth:`DataPlane.start_infer`), else run by a
        task (:meth:`_infer`)."""
        req = self.requests[rid] = _Request(self, rid, model, version)
        self._idle.clear()
        request = None
        if failure is None:
            try:
                request = request_from(fields, unpack_tensors(inputs, self.area), req.lease)
            except Exception as exc:  # a front end's bug (an entry outside the area): 500, counted by the task
                log.exception("request %d of %s: its tensors do not unpack", rid, self.who)
                failure = error_tuple(exc)
        if failure is None:
            try:
                req.ticket = self.dataplane.start_infer(model, version, received, request, req.deliver,
                                                        req.fail)
            except BatcherError as exc:
                req.fail(exc)
                return
            except Exception as exc:  # a bug: the front end answers 500
                log.exception("request %d of %s failed", rid, self.who)
                req.fail(exc)
                return
            if req.ticket is not None:
                req.done_reading()  # the scheduler holds the lease while it needs the inputs
                return
        req.task = asyncio.get_running_loop().create_task(self._infer(req, model, version, received, request,
                                                                      failure))

    def forget(self, rid: int) -> None:
        self.requests.pop(rid, None)
        self.check_idle()

    def check_idle(self) -> None:
        """Set ``_idle`` once no request is in progress and no batch reads ``area`` any more."""
        if not self.requests and not self.leased:
            self._idle.set()

    def _on_lost(self) -> None:
        """The front end is gone: drop its requests (counted ``dropped``); its area is unmapped once no request is
        in progress and no batch reads it (a request cancelled while its batch executes keeps its lease until that
        batch ends: unmapping under it crashed the process, and on a GPU the batch's copy may still read it).
        When this process closed the connection itself (:meth:`EngineServer.close`), the front end answers and
        counts its requests: they are dropped here uncounted."""
        stopping = self.server.stopping
        if self.requests or self.acks:  # both are counted ``dropped`` (requests: by the front end when stopping)
            if stopping:
                log.warning("closing the connection of %s with %d request(s) in progress (answered 503 there) and "
                            "%d answer(s) it had not acknowledged", self.who, len(self.requests), len(self.acks))
            else:
                log.warning("%s is gone: dropping its %d request(s) in progress and %d answer(s) it had not "
                            "acknowledged", self.who, len(self.requests), len(self.acks))
        for req in list(self.requests.values()):
            req.cancel(ENGINE_STOPPING if stopping else FRONTEND_LOST)
        acks, self.acks = self.acks, {}
        for later in acks.values():
            later.settle("dropped")
        asyncio.get_running_loop().create_task(self._close_when_idle())

    async def _close_when_idle(self) -> None:
        await self._idle.wait()
        self.server.unregister(self.registration)
        self.area.close()
        self.server.connections.discard(self)
        self.closed.set()

    def _free_outputs(self, rid: int) -> None:
        for off in self.out_blocks.pop(rid, ()):
            self.outputs.free(off)

    # ---------------------------------------------------------------- one request, with a task
    async def _infer(self, req: _Request, model: str, version: str, received: float, request: Any,
                     failure: Any) -> None:
        """A request that may wait before it is queued (a model loading, a fallback, a CUDA shared-memory
        region, a version chosen by weight or hash) or that could not be read: :meth:`DataPlane.infer`."""

        req.started = True

        async def read():
            if req.aborted is not None:  # ABORT (or the front end's loss) before this task began
                raise asyncio.CancelledError(*req.aborted)
            if failure == CANCELED:
                raise asyncio.CancelledError()
            if failure is not None:
                raise RemoteError(*failure)
            return request

        async def deliver(response: InferResponse) -> CountedLater:
            return req.deliver(response)

        error: BaseException | None = None
        try:
            await self.dataplane.infer(model, version, received, read, deliver)
        except BatcherError as exc:
            error = exc
        except asyncio.CancelledError:
            error = None  # nobody waits for an answer: the client or its front end is gone
        except Exception as exc:  # a bug: the front end answers 500
            log.exception("request %d of %s failed", req.rid, self.who)
            error = exc
        finally:
            req.fail(error)

    async def _call(self, cid: int, method: str, args: tuple, kwargs: dict) -> None:
        """A public data-plane method for the front end (metadata, statistics, repository, shared memory, ...)."""
        try:
            if method.startswith("_") or not callable(getattr(self.dataplane, method, None)):
                raise RemoteError(500, "other", f"the data plane has no method {method!r}")
            cuda_shm = method.startswith("shm_") and args[:1] == ("cuda",)
            if cuda_shm and "device_id" in kwargs:  # the client's device numbering -> this process's
                kwargs = {**kwargs, "device_id": self.server.devices.local(kwargs["device_id"])}
            value = getattr(self.dataplane, method)(*args, **kwargs)
            if asyncio.iscoroutine(value):
                value = await value
            if cuda_shm and isinstance(value, list):
                value = [{**v, "device_id": self.server.devices.client(v["device_id"])} if "device_id" in v else v
                         for v in value]
            self.channel.send((REPLY, cid, True, value), checked=True)  # an answer that cannot cross: 500
        except Exception as exc:
            if not isinstance(exc, BatcherError):
                log.exception("call %s%r from %s failed", method, args, self.who)
            self.channel.send((REPLY, cid, False, error_tuple(exc)))


class EngineServer:
    """Accepts front ends on a Unix socket and serves them from one :class:`DataPlane`.

    Args:
        dataplane: started (models loaded).
        device: the GPU this process serves, or None (CPU): on a GPU each connection's area is page-locked
            (``cudaHostRegister``), so host-to-device copies read it directly.
        path: the socket's path.
        buffer_bytes: size of each connection's shared area (``server.frontend_buffer_mb``).
        keys: (name, version) of the model versions served (:func:`batcher.topology.engine_slots`).
        devices: how this process numbers the GPUs (CUDA shared-memory regions name the client's numbering).
    """

    def __init__(self, dataplane: DataPlane, device: int | None, path: str, buffer_bytes: int,
                 keys: list[tuple[str, str]], devices: DeviceOrder | None = None) -> None:
        self.dataplane = dataplane
        self.device = device
        dataplane.shm.page_lock = device is not None  # this process's models: on this GPU, or on the CPU
        self.devices = devices or DeviceOrder(None, [0])
        self.path = path
        self.buffer_bytes = buffer_bytes
        self.slot_index = {k: i for i, k in enumerate(keys)}
        self.status = Area(8 * max(1, len(keys)))
        self.counts = area_view(self.status.buf, (max(1, len(keys)),), np.int64)
        self.connections: set[FrontendConnection] = set()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._next_index = 0
        self._cuda_ok = device is not None
        #: this process closes its connections itself (:meth:`close`); it drains (:meth:`drain`)
        self.stopping = self.draining = False

    async def start(self) -> None:
        """Listen (a stale socket file of an earlier engine process is replaced)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._accepting = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            try:
                await self._open(sock)
            except (OSError, ValueError) as exc:
                log.warning("a front end's connection failed during the handshake: %s", exc)
                sock.close()

    async def _open(self, sock: socket.socket) -> None:
        try:  # the peer's pid from the kernel (Linux SO_PEERCRED: pid, uid, gid)
            peer_pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        except (OSError, AttributeError):
            peer_pid = None
        conn = FrontendConnection(self, self._next_index, peer_pid)
        self._next_index += 1
        hello = {"pid": os.getpid(), "device": self.device, "area_bytes": self.buffer_bytes,
                 "slots": list(self.slot_index)}
        sock.setblocking(True)
        send_hello(sock, hello, [conn.area.fd, self.status.fd])
        conn.area.close_fd()
        sock.setblocking(False)
        self.connections.add(conn)
        await asyncio.get_running_loop().connect_accepted_socket(lambda: conn.channel, sock)
        if self.draining:
            conn.channel.send((DRAINING, 0))

    def drain(self) -> None:
        """SIGTERM's drain begins: every front end (and one connecting later) is told (:data:`DRAINING`), so that
        it routes nothing new here and reports not ready until the process that replaces this one is connected."""
        self.draining = True
        for conn in self.connections:
            conn.channel.send((DRAINING, 0))

    def register(self, area: Area) -> Any:
        """Page-lock ``area`` on this process's GPU (None on the CPU, or when CUDA refuses: then logged once)."""
        if not self._cuda_ok:
            return None
        try:
            from engines.cuda import HostRegistration

            return HostRegistration(np.frombuffer(area.buf, np.uint8).ctypes.data, area.size)
        except Exception as exc:  # no CUDA runtime, or it refused: the area works unregistered
            log.warning("cannot page-lock the front ends' shared memory (cudaHostRegister): %s", exc)
            self._cuda_ok = False
            return None

    def unregister(self, registration: Any) -> None:
        if registration is not None:
            try:
                registration.unregister()
            except Exception as exc:
                log.warning("cudaHostUnregister failed: %s", exc)

    async def acknowledged(self, timeout_s: float) -> bool:
        """Wait until every answer sent has been acknowledged (or aborted) by its front end, at most ``timeout_s``
        seconds; whether they all were."""
        end = asyncio.get_running_loop().time() + timeout_s
        while any(c.acks for c in self.connections):
            if asyncio.get_running_loop().time() >= end:
                return False
            await asyncio.sleep(0.005)
        return True

    async def close(self) -> None:
        """Stop accepting and close every connection (their requests are dropped, uncounted: their front ends
        answer and count them)."""
        self.stopping = True
        if self._accepting is not None:
            self._accepting.cancel()
            try:
                await self._accepting
            except asyncio.CancelledError:
                pass
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for conn in list(self.connections):
            conn.channel.close()
            await conn.closed.wait()
