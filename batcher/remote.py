"""A front end's data plane in multi-process mode: the same methods as :class:`batcher.dataplane.DataPlane`,
answered by the engine processes (:mod:`batcher.engine_proc`) over :mod:`batcher.ipc`.

The HTTP routes and the codec run unchanged in front of it. For an inference request the front end looks the model
up (404 before reading, as in single-process mode), reads and decodes the body, picks the engine process
(``routing.strategy`` over the versions and GPUs the request may go to, :mod:`batcher.strategy`; ``least_queue``
reads each engine's status area), writes tensors of 64 KiB or more once into its shared area and sends the request;
the engine queues it (:meth:`DataPlane.start_infer`, or :meth:`DataPlane.infer`) and sends the outputs (RESULT) or
the error (ERROR); the front end encodes the answer, decides whether it is still in time, and acknowledges (ACK) so
the engine counts the outcome. A request that could not be read is sent too, with the error, so the engine counts
it like any other. A client that goes away sends ABORT. While an engine process is down (it died; the supervisor
restarts it), the requests it had get 503 + Retry-After, the versions it serves are routed to another engine
process that has them or answered 503 (counted here, in the shared metrics), and the front end reconnects once it
is back.

Other calls (metadata, config, readiness, statistics, the repository extension) go to the engine processes that
serve the model, and answers from several are merged (:func:`merge_statistics`, :func:`merge_index`); a method
this module does not know (e.g. the shared-memory extension's) is sent to every engine process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from .config import ModelConfig
from .errors import DeadlineExceeded, RemoteError, Unavailable
from .heartbeat import Heartbeat
from .outcomes import OVERDUE, SHED
from .ipc import (ABORT, ACK, ALIGN, CALL, DRAINING, ERROR, RELEASE, REPLY, REQ, RESULT, Allocator, Area, Channel,
                  area_view, pack_tensors, recv_hello, request_fields, unpack_tensors)
from .protocol import InferRequest
from .topology import Engine

log = logging.getLogger(__name__)

#: seconds between attempts to reach an engine process that is down, doubling up to the second figure.
RECONNECT_FIRST_S, RECONNECT_MAX_S = 0.05, 1.0
#: seconds a control call (metadata, config, readiness, statistics, the index, shared-memory registrations) waits
#: for its engine process before 503; loads and unloads wait as long as they take (:meth:`EngineLink.call`).
CALL_TIMEOUT_S = 10.0


class EngineLost(Unavailable):
    """503: the engine process serving a request died while the request was there; nothing of it will be counted
    there, so the front end counts it (:class:`batcher.frontend.RemoteDataPlane`)."""


class _Sent:
    """A request sent to an engine: the future of its outcome message, its model version's status index, its input
    blocks until released, and its deadline (event-loop seconds; None: none)."""

    __slots__ = ("future", "slot", "blocks", "deadline")

    def __init__(self, future: asyncio.Future, slot: int, blocks: list[int], deadline: float | None) -> None:
        self.future = future
        self.slot = slot
        self.blocks = blocks
        self.deadline = deadline


class BodyBuffer:
    """A request body read straight into a block of an engine link's shared area (:meth:`EngineLink.body_buffer`):
    its binary tensors then reach the engine process uncopied (:func:`batcher.ipc.pack_tensors` sends their
    offsets). The block is the request's until :meth:`EngineLink.submit` hands it to the request's blocks (freed as
    theirs are, when the engine process no longer reads them); one never handed over is freed by :meth:`release`
    when the request's handler ends (:func:`batcher.bodies.release`)."""

    __slots__ = ("link", "allocator", "offset", "end", "view", "handed")

    def __init__(self, link: EngineLink, allocator: Allocator, offset: int, end: int, view: memoryview) -> None:
        self.link, self.allocator, self.offset, self.end, self.view = link, allocator, offset, end, view
        self.handed = False

    def release(self) -> None:
        """Free the block unless it was handed over, or its area is gone (the engine process restarted); idempotent."""
        if not self.handed:
            self.handed = True
            if self.link._inputs is self.allocator:
                self.allocator.free(self.offset)
                self.link._bodies.pop(self.offset, None)


class EngineLink:
    """One front end's connection to one engine process (reconnected after the engine process restarts)."""

    def __init__(self, engine: Engine, path: str, keys: list[tuple[str, str]],
                 on_reconnect: Callable[[EngineLink], Awaitable[None]] | None = None,
                 count_lost: Callable[[tuple[str, str], str], None] | None = None,
                 heartbeat: Heartbeat | None = None, stale_s: float = 10.0) -> None:
        """``on_reconnect``: awaited each time the link is back after its engine process restarted.
        ``count_lost(key, reason)``: counts, in the front end, an outcome the engine process died without counting
        (a request answered by :meth:`expire`). ``heartbeat``: the engine process's (:mod:`batcher.heartbeat`), older
        than ``stale_s`` seconds: it is not :meth:`up`."""
        self.engine = engine
        self.on_reconnect = on_reconnect
        self.name = f"engine process for {engine.name}"
        self.path = path
        self.keys = keys
        self.index = {k: i for i, k in enumerate(keys)}
        self.connected = False
        #: its engine process said it drains (SIGTERM, :data:`batcher.ipc.DRAINING`): not up until replaced
        self.draining = False
        self.pid: int | None = None
        self._channel: Channel | None = None
        self._area: Area | None = None
        self._inputs: Allocator | None = None
        self._counts: np.ndarray | None = None
        self._sent: dict[int, _Sent] = {}
        self._bodies: dict[int, BodyBuffer] = {}  # bodies read into the area, not handed to a request yet
        self._outstanding = [0] * len(keys)  # this front end's requests without an outcome, per model version
        self._calls: dict[int, asyncio.Future] = {}
        self.count_lost = count_lost
        self.heartbeat, self.stale_s = heartbeat, stale_s
        self._overdue: dict[int, tuple[str, str]] = {}  # answered by expire(), not heard of from the engine yet
        self._cids = itertools.count()
        self._reconnecting: asyncio.Task | None = None
        self._closing = False

    # ---------------------------------------------------------------- connection
    async def start(self) -> None:
        """Connect; an engine process that is not listening (being restarted: this front end was started again
        meanwhile) is connected to in the background, its models answered 503 until then.

        Raises:
            ValueError: it serves other model versions.
        """
        try:
            await self.connect()
        except OSError as exc:
            log.warning("the %s is not running (%s); answering 503 for its models until it is back", self.name,
                        exc.strerror or exc)
            self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect())

    async def connect(self) -> None:
        """Connect and take the engine's shared areas.

        Raises:
            OSError: the engine process is not listening (yet); ValueError: it serves other model versions.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

        def handshake():
            sock.settimeout(30)
            sock.connect(self.path)
            return recv_hello(sock)

        try:
            hello, fds = await asyncio.to_thread(handshake)
        except BaseException:
            sock.close()
            raise
        area, status = Area(hello["area_bytes"], fds[0]), Area(8 * max(1, len(self.keys)), fds[1])
        area.close_fd()
        status.close_fd()
        if [tuple(k) for k in hello["slots"]] != self.keys:
            sock.close()
            raise ValueError(f"{self.name} serves {hello['slots']}, expected {self.keys}")
        sock.setblocking(False)
        channel = Channel(self._on_message, self._on_lost)
        await asyncio.get_running_loop().create_unix_connection(lambda: channel, sock=sock)
        self._channel, self._area, self.pid = channel, area, hello["pid"]
        self._inputs = Allocator(0, area.size // 2)
        self._counts = area_view(status.buf, (max(1, len(self.keys)),), np.int64)
        self.connected, self.draining = True, False

    def _on_lost(self) -> None:
        self.connected = False
        lost = EngineLost(f"the {self.name} stopped; it is being restarted", retry_after_s=1)
        for fut in [sent.future for sent in self._sent.values()] + list(self._calls.values()):
            if not fut.done():
                fut.set_exception(lost)
                # a waiter still there gets it when it awaits; one gone (a handler cancelled while the process is
                # stopping) is no "Future exception was never retrieved" ERROR line
                fut.exception()
        self._sent.clear()
        self._calls.clear()
        overdue, self._overdue = self._overdue, {}
        if self.count_lost is not None:
            for key in overdue.values():  # it died before it could count them
                self.count_lost(key, "timeout")
        self._outstanding = [0] * len(self.keys)
        if self._area is not None:
            self._area.close()  # unmapped once the last view of it goes
        self._area = self._inputs = self._counts = None
        self._bodies.clear()  # their release() sees the allocator gone and frees nothing
        if not self._closing:
            log.warning("lost the %s (pid %s); answering 503 for its models until it is back", self.name, self.pid)
            self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        delay = RECONNECT_FIRST_S
        while not self._closing:
            await asyncio.sleep(delay)
            try:
                await self.connect()
            except (OSError, ValueError):
                delay = min(RECONNECT_MAX_S, delay * 2)
                continue
            if self.on_reconnect is not None:
                await self.on_reconnect(self)
            log.info("reconnected to the %s (pid %s)", self.name, self.pid)  # after on_reconnect: tests wait for it
            return

    async def close(self) -> None:
        self._closing = True
        if self._reconnecting is not None:
            self._reconnecting.cancel()
        if self._channel is not None:
            self._channel.close()

    def up(self) -> bool:
        """Connected, and its engine process has run its event loop within ``stale_s`` (a stopped or stuck one,
        killed only after ``server.stall_timeout_s``, gets no new requests and makes readiness false meanwhile),
        and not draining (SIGTERM to it: the same until the process that replaces it is connected)."""
        return self.connected and not self.draining and (self.heartbeat is None
                                   or self.heartbeat.stalled(time.monotonic(), self.stale_s) is None)

    def load(self, key: tuple[str, str]) -> float:
        """Requests for model version ``key`` in the engine now (its status area), or this front end's requests
        sent there and not answered yet if more (the engine has not read them all yet, e.g. in a burst)."""
        if self._counts is None:
            return float("inf")
        i = self.index[key]
        return float(max(self._counts[i], self._outstanding[i]))

    # ---------------------------------------------------------------- messages
    def _on_message(self, msg: tuple) -> None:
        kind, rid = msg[0], msg[1]
        if kind == RESULT or kind == ERROR:
            sent = self._sent.get(rid)
            if sent is None:
                return
            if self._overdue:
                self._overdue.pop(rid, None)  # the engine counts it: an ERROR it sent, or RESULT settled by ABORT
            if sent.slot >= 0:
                self._outstanding[sent.slot] -= 1
                sent.slot = -1
            if msg[-1]:  # inputs free
                self._free(rid)
            if not sent.future.done():
                sent.future.set_result(msg)
        elif kind == RELEASE:
            self._free(rid)
        elif kind == DRAINING:
            self.draining = True
        elif kind == REPLY:
            fut = self._calls.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _free(self, rid: int) -> None:
        sent = self._sent.pop(rid, None)
        if sent is not None and self._inputs is not None:
            for off in sent.blocks:
                self._inputs.free(off)

    def body_buffer(self, nbytes: int, header_bytes: int) -> BodyBuffer | None:
        """A block of the shared area to read a request body of ``nbytes`` into, placed so that its binary part
        (after ``header_bytes`` of JSON) starts aligned (:data:`batcher.ipc.ALIGN`); None when the engine process
        is not connected, or the inputs' half of the area would be more than half full with it (the body is then
        read into memory of its own)."""
        if self._inputs is None or self._area is None:
            return None
        pad = -header_bytes % ALIGN
        if self._inputs.used_bytes + pad + nbytes > self._area.size // 4:  # half the inputs' half at most: bodies
            return None  # still arriving (slow clients) must not leave decoded tensors without room
        off = self._inputs.alloc(pad + nbytes)
        if off is None:
            return None
        body = BodyBuffer(self, self._inputs, off, off + pad + nbytes,
                          memoryview(self._area.buf)[off + pad:off + pad + nbytes])
        self._bodies[off] = body
        return body

    def _hand_over(self, entries: list[tuple], blocks: list[int]) -> None:
        """The block of each body that ``entries`` (:func:`batcher.ipc.pack_tensors`') send by offset becomes the
        request's: appended to its ``blocks``, freed as they are."""
        for e in entries:
            if len(e) == 4 and type(e[3]) is int:
                body = next((b for b in self._bodies.values() if b.offset <= e[3] < b.end), None)
                if body is not None:
                    del self._bodies[body.offset]
                    body.handed = True
                    blocks.append(body.offset)

    def submit(self, rid: int, cfg: ModelConfig, received: float, request: InferRequest | None,
               failure: Any, deadline: float | None = None) -> asyncio.Future:
        """Send one request (its tensors through the shared area); the future gets its RESULT/ERROR message, or
        DeadlineExceeded from :meth:`expire`."""
        entries, blocks, fields = [], [], None
        if request is not None:
            entries, blocks = pack_tensors(request.inputs, self._area, self._inputs)
            if self._bodies:
                self._hand_over(entries, blocks)
            fields = request_fields(request)
        fut = asyncio.get_running_loop().create_future()
        slot = self.index[(cfg.name, str(cfg.version))]
        self._outstanding[slot] += 1
        self._sent[rid] = _Sent(fut, slot, blocks, deadline)
        self._channel.send((REQ, rid, cfg.name, str(cfg.version), received, fields, entries, failure))
        return fut

    def outputs(self, entries: list) -> dict[str, Any]:
        """A RESULT's outputs, copied out of the shared area: encoding them (perhaps in a worker thread that
        outlives a client that went away) never reads a block the engine process may reuse after ABORT/ACK."""
        return unpack_tensors(entries, self._area, copy=True)

    def abort(self, rid: int) -> None:
        if self.connected:
            self._channel.send((ABORT, rid))

    def shed(self, error: BaseException) -> int:
        """Every request sent and not answered gets ``error`` now (SIGTERM's grace is over), and the engine process
        is sent ABORT with :data:`batcher.outcomes.SHED` for each (counted ``rejected`` there); how many."""
        shed = 0
        for rid, sent in self._sent.items():
            if not sent.future.done():
                self._answer_here(rid, sent, error, SHED)
                shed += 1
        return shed

    def _answer_here(self, rid: int, sent: _Sent, error: BaseException, reason: str) -> None:
        """Settle request ``rid``'s future with ``error`` here, and send the engine process ABORT with ``reason``
        (:func:`batcher.outcomes.cancel_reason` says how it counts it)."""
        sent.future.set_exception(error)
        sent.future.exception()  # retrieved: no "never retrieved" ERROR line if its waiter is gone
        if self.connected:
            self._channel.send((ABORT, rid, reason))

    def expire(self, before: float) -> None:
        """The requests whose deadline is before ``before`` (event-loop seconds; :data:`batcher.frontend.OVERDUE_S`
        ago) without an outcome from the engine process (stopped, or stuck: it answers 504 itself at the deadline
        otherwise): their futures get DeadlineExceeded now, and the engine process is sent ABORT with
        :data:`batcher.outcomes.OVERDUE`, to count them ``timeout`` when it reads it (or this front end counts them,
        :attr:`count_lost`, if the engine process dies first). Their input blocks stay the engine's until it
        releases them."""
        for rid, sent in self._sent.items():
            if sent.deadline is None or sent.deadline >= before or sent.future.done():
                continue
            key = self.keys[sent.slot]
            if self.connected:
                self._overdue[rid] = key
            self._answer_here(rid, sent, DeadlineExceeded(f"model '{key[0]}': no answer from the engine process by "
                                                          "the request's deadline"), OVERDUE)

    def ack(self, rid: int, error: Any = None) -> bool:
        """Tell the engine process how RESULT ``rid`` was delivered (``error`` None: answered with it), so that it
        counts the outcome; False when it is gone and will count nothing."""
        if self.connected:
            self._channel.send((ACK, rid, error))
            return True
        return False

    async def call(self, method: str, *args: Any, timeout_s: float | None = CALL_TIMEOUT_S, **kwargs: Any) -> Any:
        """A data-plane method in the engine process, answered within ``timeout_s`` (None: however long it takes,
        e.g. a model's load).

        Raises:
            the method's BatcherError (as :class:`RemoteError`); Unavailable: the engine process is down, or did
            not answer in time (stopped or stuck: a stalled engine process is killed after
            ``server.stall_timeout_s``, :mod:`batcher.heartbeat`; the call may still run when it resumes).
        """
        if not self.connected:
            raise Unavailable(f"the {self.name} is not running; it is being restarted", retry_after_s=1)
        cid = next(self._cids)
        fut = self._calls[cid] = asyncio.get_running_loop().create_future()
        self._channel.send((CALL, cid, method, args, kwargs))
        try:
            _, _, ok, value = await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            self._calls.pop(cid, None)
            raise Unavailable(f"the {self.name} did not answer within {timeout_s:g} s", retry_after_s=1) from None
        if not ok:
            raise RemoteError(*value)
        return value
