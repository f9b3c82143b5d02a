"""The wire between a front-end process and an engine process: framed messages over a Unix socket, and the
shared memory that request and response tensors travel through.

* **Messages** are tuples (small: ids, names, shapes, offsets; tensors under :data:`INLINE_BYTES` ride
  inline) over an asyncio Unix-socket transport (:class:`Channel`). The messages sent in one event-loop
  iteration leave together, as one pickled list framed by a 4-byte little-endian length, in one write: one
  batch's answers to one front end cost one ``pickle.dumps``, one ``pickle.loads`` and one system call. A peer
  that dies closes the socket: the other side learns it at once (:meth:`Channel.connection_lost`), which is how
  an engine drops a dead front end's requests and a front end answers 503 for a dead engine.
* **Shared memory** (:class:`Area`): one ``memfd_create`` mapping per connection, made by the engine process and
  passed to the front end with ``SCM_RIGHTS`` (:func:`send_hello` / :func:`recv_hello`). It has no name, so
  nothing is ever left in ``/dev/shm``: the memory goes when the last process holding it exits, whatever the exit.
  Its first half holds request tensors (the front end allocates, :class:`Allocator`), its second half response
  tensors (the engine allocates); a block is reused only after the other side said it is done with it.
"""

from __future__ import annotations

import asyncio
import bisect
import ctypes
import logging
import math
import mmap
import os
import pickle
import socket
import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .errors import BatcherError
from .protocol import InferRequest, Lease, ShmInput, ShmRef

#: tensors smaller than this travel inside the message, larger ones through the shared area (the design sketch's
#: measure: one copy into shared memory costs more than the socket below about 64 KiB).
INLINE_BYTES = 64 * 1024
#: alignment of blocks in the shared area (a cache line; numpy views of any dtype are aligned).
ALIGN = 64

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
_FRAME_MAX = 1 << 32  #: a frame's length must fit its 4-byte header
_HELLO_MAX = 1 << 16

# Message kinds (the first element of each message tuple).
#: front end -> engine: ``(REQ, rid, model, version, received, fields, inputs, failure)``: one inference request
#: (``fields``: :func:`request_fields`; ``inputs``: :func:`pack_tensors`; ``failure``: :func:`error_tuple` of what
#: reading it raised, :data:`CANCELED`, or None).
REQ = 1
#: ``(ABORT, rid)``: the client went away; cancel it. ``(ABORT, rid, OVERDUE)``: the front end answered 504 itself,
#: the request's deadline having passed without an answer (:data:`batcher.outcomes.OVERDUE`; counted ``timeout``).
ABORT = 2
#: ``(ACK, rid, error)``: the answer to RESULT was delivered (error None) or not (its :func:`error_tuple`).
ACK = 3
#: ``(CALL, cid, method, args, kwargs)``: call a public data-plane method (metadata, statistics, repository, ...).
CALL = 4
#: engine -> front end: ``(RESULT, rid, model, version, outputs, deadline, inputs_free)``.
RESULT = 11
#: ``(ERROR, rid, error, inputs_free)``: the request's outcome is this error (:func:`error_tuple`; None when it
#: was canceled and nobody waits for it).
ERROR = 12
#: ``(RELEASE, rid)``: the request's input blocks are no longer read (sent when that happens after its outcome).
RELEASE = 13
#: ``(REPLY, cid, ok, value)``: a CALL's result, or its :func:`error_tuple`.
REPLY = 14
#: ``(DRAINING, 0)``: the engine process drains (SIGTERM): route nothing new to it, readiness false until the
#: process that replaces it is connected (:meth:`batcher.remote.EngineLink.up`).
DRAINING = 15
#: a REQ's ``failure`` when the client went away before its request was read.
CANCELED = "canceled"


def error_tuple(exc: BaseException) -> tuple[int, str, str, int | None]:
    """``(status, reason, message, retry_after_s)`` of an error, for the other process (:class:`RemoteError`)."""
    if isinstance(exc, BatcherError):
        return exc.status, exc.reason, exc.message, exc.retry_after_s
    return 500, "other", f"internal error: {exc!r}", None


def request_fields(r: InferRequest) -> tuple:
    """An :class:`InferRequest` less its inputs and lease, for a REQ message."""
    return r.id, r.outputs, r.binary_output, r.timeout_us, r.priority, r.parameters, r.routing_key


def request_from(fields: tuple, inputs: dict[str, Any], lease: Lease | None) -> InferRequest:
    """The :class:`InferRequest` of a REQ message's ``fields`` and unpacked inputs."""
    rid, outputs, binary_output, timeout_us, priority, parameters, routing_key = fields
    return InferRequest(inputs, rid, outputs, binary_output, timeout_us, priority, parameters, routing_key, lease)


def pack_tensors(tensors: Mapping[str, Any], area: Area | None, allocator: Allocator | None
                 ) -> tuple[list[tuple], list[int]]:
    """Tensors for a message. A numeric array of :data:`INLINE_BYTES` or more is copied into a block of ``area``:
    ``(name, dtype, shape, offset)``; a smaller one rides inline as its bytes: ``(name, dtype, shape, bytes)``
    (pickling an ndarray costs ten times as much as its bytes: 5.2 against 0.5 us for a ``[1, 4]`` FP32 message on
    the 2-core machine); a shared-memory input as its fields, ``(name, datatype, shape, region, offset,
    byte_size)`` (a pickled :class:`ShmInput` costs 3.4 us to load against 0.6 for the tuple); anything else rides
    as itself, ``(name, value)`` (BYTES arrays). ``dtype`` is numpy's ``dtype.str``. An array that already lies in
    ``area`` (its request's body was read there) is sent as its offset, uncopied, taking no block. Returns the
    entries and the offsets of the blocks taken; when the area is full, arrays ride inline."""
    entries: list[tuple] = []
    blocks: list[int] = []
    for name, a in tensors.items():
        if type(a) is not np.ndarray or a.dtype.hasobject:
            if type(a) is ShmInput:
                entries.append((name, a.datatype, a.shape, a.ref.region, a.ref.offset, a.ref.byte_size))
            else:
                entries.append((name, a))
            continue
        if area is not None and a.nbytes >= INLINE_BYTES:
            off = area.offset_of(a)
            if off is not None:  # already in the area (a body read into it: :class:`batcher.remote.BodyBuffer`)
                entries.append((name, a.dtype.str, a.shape, off))
                continue
            off = allocator.alloc(a.nbytes)
            if off is not None:
                area_view(area.buf, a.shape, a.dtype, off)[...] = a
                entries.append((name, a.dtype.str, a.shape, off))
                blocks.append(off)
                continue
        entries.append((name, a.dtype.str, a.shape, a.tobytes()))
    return entries, blocks


def area_view(buf: Any, shape: tuple[int, ...], dtype: Any, offset: int = 0) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` over ``buf`` (an :class:`Area`'s mapping) from byte ``offset``, that keeps
    the mapping exported while it lives, so ``mmap.close()`` refuses (BufferError) instead of unmapping under it.
    ``np.ndarray(shape, dtype, buffer=buf, offset=...)`` does not hold the export (numpy 2.4): an area closed while
    a batch read such a view crashed the engine process (SIGSEGV), as a killed front end's area did."""
    dtype = np.dtype(dtype)
    return np.frombuffer(buf, dtype, count=math.prod(shape), offset=offset).reshape(shape)


def unpack_tensors(entries: list[tuple], area: Area | None, copy: bool = False) -> dict[str, Any]:
    """The tensors of :func:`pack_tensors`' entries: arrays in ``area`` are views, or copies with ``copy`` (the
    block may then be given back at once, whatever happens to the arrays); inline ones are read-only arrays over
    the message's bytes, as a decoded HTTP body's are."""
    out = {}
    for e in entries:
        if len(e) == 2:
            out[e[0]] = e[1]
        elif len(e) == 6:
            out[e[0]] = ShmInput(e[1], e[2], ShmRef(e[3], e[4], e[5]))
        elif type(e[3]) is int:
            view = area_view(area.buf, e[2], np.dtype(e[1]), e[3])
            out[e[0]] = view.copy() if copy else view
        else:
            out[e[0]] = np.frombuffer(e[3], np.dtype(e[1])).reshape(e[2])
    return out


class Channel(asyncio.Protocol):
    """A framed, pickled message stream over one Unix-socket connection.

    Args:
        on_message: called with each message, in order, on the event loop.
        on_lost: called once when the connection is gone (the peer exited or closed it).
    """

    def __init__(self, on_message: Callable[[Any], None], on_lost: Callable[[], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._out: list[Any] = []  # messages queued in this loop iteration
        self.closed = False

    # ---------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, end = 0, len(buf)
        frames = []
        with memoryview(buf) as view:
            while end - pos >= 4:
                (n,) = _LEN.unpack_from(buf, pos)
                if end - pos - 4 < n:
                    break
                frames.append(pickle.loads(view[pos + 4:pos + 4 + n]))
                pos += 4 + n
        del buf[:pos]
        on_message = self._on_message
        for messages in frames:
            for message in messages:
                try:
                    on_message(message)
                except Exception:  # a bug in a handler: log it, keep the connection
                    log.exception("handling message %r failed",
                                  message[:2] if isinstance(message, tuple) else message)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self._out.clear()
            self._on_lost()

    # ---------------------------------------------------------------- sending
    def send(self, message: Any, checked: bool = False) -> None:
        """Queue ``message``; everything queued in this loop iteration is pickled and written together. Dropped
        when closed. ``checked``: pickle it now too, so that a message that cannot cross raises here, in the
        caller (for messages whose contents are not this module's own, e.g. a data-plane method's answer);
        otherwise such a message is logged and dropped at the flush, alone."""
        if self.closed:
            return
        if checked:
            pickle.dumps(message, protocol=5)
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(message)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if not out or self.closed or self._transport is None:
            return
        try:
            payload = pickle.dumps(out, protocol=5)
            if len(payload) < _FRAME_MAX:
                self._transport.write(_LEN.pack(len(payload)) + payload)
                return
        except Exception:  # a bug: find the message, send the others
            pass
        for m in out:  # one frame each
            try:
                payload = pickle.dumps([m], protocol=5)
                if len(payload) >= _FRAME_MAX:
                    raise ValueError(f"a message of {len(payload)} bytes does not fit a frame")
            except Exception:
                log.exception("cannot send message %r", m[:2] if isinstance(m, tuple) else m)
                continue
            self._transport.write(_LEN.pack(len(payload)) + payload)

    def close(self) -> None:
        """Write what is queued, then close the connection (``on_lost`` follows)."""
        self._flush()
        if self._transport is not None:
            self._transport.close()


# ---------------------------------------------------------------------------------------------- shared area
class Area:
    """A shared mapping of ``size`` bytes backed by a memfd (no name in ``/dev/shm``).

    Attributes:
        buf: the mapping (numpy arrays view it with :func:`area_view`).
        fd: the memfd while this process still holds it (to pass on), else -1.
    """

    def __init__(self, size: int, fd: int | None = None) -> None:
        self.size = size
        if fd is None:
            fd = os.memfd_create("batcher-area", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd = fd
        self.buf = mmap.mmap(fd, size)
        probe = ctypes.c_char.from_buffer(self.buf)  # an export of the mapping only while it is read
        #: where the mapping starts in this process's memory (an array inside it lies at ``address + offset``)
        self.address = ctypes.addressof(probe)
        del probe

    def offset_of(self, a: np.ndarray) -> int | None:
        """The offset of ``a``'s data in this area when all of it lies inside (a contiguous array), else None."""
        start = a.__array_interface__["data"][0] - self.address
        return start if 0 <= start and start + a.nbytes <= self.size and a.flags.c_contiguous else None

    def close_fd(self) -> None:
        """Close the memfd (the mapping stays; the memory goes with the last mapping)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Unmap, unless numpy views of it are still alive (then the mapping goes with the last of them)."""
        self.close_fd()
        try:
            self.buf.close()
        except BufferError:
            pass


class Allocator:
    """First-fit allocation of aligned blocks in ``[start, start + size)`` of an :class:`Area`; free blocks
    coalesce. Sizes and offsets in bytes."""

    def __init__(self, start: int, size: int) -> None:
        self._starts = [start]  # free ranges, sorted by start
        self._ends = [start + size]
        self._used: dict[int, int] = {}  # offset -> end

    @property
    def used_bytes(self) -> int:
        return sum(end - off for off, end in self._used.items())

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free block of at least ``nbytes`` bytes, or None when none is free."""
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (s, e) in enumerate(zip(self._starts, self._ends)):
            if e - s >= need:
                if e - s == need:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = s + need
                self._used[s] = s + need
                return s
        return None

    def free(self, offset: int) -> None:
        """Give back the block at ``offset`` (KeyError if it is not allocated)."""
        end = self._used.pop(offset)
        i = bisect.bisect(self._starts, offset)
        if i > 0 and self._ends[i - 1] == offset:  # joins the range before it
            i -= 1
            self._ends[i] = end
        else:
            self._starts.insert(i, offset)
            self._ends.insert(i, end)
        if i + 1 < len(self._starts) and self._starts[i + 1] == self._ends[i]:  # and the one after it
            self._ends[i] = self._ends[i + 1]
            del self._starts[i + 1], self._ends[i + 1]


# ---------------------------------------------------------------------------------------------- handshake
def send_hello(sock: socket.socket, hello: Any, fds: list[int]) -> None:
    """Send the first message of a connection with file descriptors (``SCM_RIGHTS``); blocking, before the socket
    is handed to the event loop."""
    payload = pickle.dumps(hello, protocol=5)
    if len(payload) + 4 > _HELLO_MAX:
        raise ValueError(f"hello message of {len(payload)} bytes is too large")
    socket.send_fds(sock, [_LEN.pack(len(payload)) + payload], fds)


def recv_hello(sock: socket.socket, max_fds: int = 4) -> tuple[Any, list[int]]:
    """Receive :func:`send_hello`'s message and descriptors (blocking).

    Raises:
        ConnectionError: the peer closed the connection first.
    """
    data, fds, _, _ = socket.recv_fds(sock, _HELLO_MAX, max_fds)
    if len(data) < 4:
        raise ConnectionError("connection closed during the handshake")
    (n,) = _LEN.unpack_from(data, 0)
    while len(data) < 4 + n:  # a large hello may arrive in parts (the descriptors come with the first)
        more = sock.recv(4 + n - len(data))
        if not more:
            raise ConnectionError("connection closed during the handshake")
        data += more
    return pickle.loads(data[4:4 + n]), list(fds)
