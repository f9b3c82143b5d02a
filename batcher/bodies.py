"""Request bodies: reading them within the body limit and undoing their ``Content-Encoding``.

aiohttp's own decompression is off (``auto_decompress=False``, set by :func:`batcher.app.create_app`): it inflated a
whole compressed body before any limit applied, answered an undecodable one with a 500, and took an unknown coding
for plain JSON. Here, one rule for every coding (RFC 9110, 8.4):

* ``Content-Encoding`` lists the codings applied, in order; they are undone last to first. ``identity`` (and empty
  list elements) mean nothing. Supported: ``gzip`` (also ``x-gzip``), ``deflate`` (zlib-wrapped as RFC 9110 says,
  or raw deflate as some clients send it), and ``br`` where the ``brotli`` package is installed.
* Any other coding: **415**, with ``Accept-Encoding`` naming the supported ones (RFC 7694).
* A body that does not decode (not gzip, truncated, trailing garbage): **400**.
* The *decoded* body (and each intermediate form of stacked codings) may hold at most ``server.max_body_bytes``:
  decompression stops as soon as its output passes it (**413**), so a small compressed body never inflates past
  the limit in memory. A declared ``Content-Length``
  over the limit is refused before anything is read.
* Whatever was read of a body that is not returned - refused, or its client gone, or its handler cancelled - is
  dropped before the exception leaves :func:`_read`, so nothing of it stays referenced from the exception's
  traceback until the cyclic garbage collector runs (a client that started 12 MB uploads and hung up kept each
  one's bytes alive: the process grew by the bytes read while the budget's gauge was back at 0).
* A client that goes away while its body is being read (aiohttp sets ``ConnectionResetError`` on the body stream
  and, with ``handler_cancellation``, cancels the handler; which of the two the handler sees first depends on the
  Python version's ``asyncio.wait_for``) ends the request as a cancellation: :func:`read_body` raises
  ``asyncio.CancelledError``, so the request is counted ``canceled`` as when it goes away while queued, never
  ``other`` (a server bug).
* Multi-member gzip (RFC 1952, 2.2: ``cat a.gz b.gz``) decodes every member, the output cap counting across them;
  anything after a member that does not start a new one is a 400. ``deflate`` has no members: data after its end is
  a 400.

Every request body also counts against the process's :class:`BodyBudget` (``server.max_inflight_body_bytes``): the
bytes of bodies being read or held, summed over the process's requests, stay under it. A request reserves its
declared ``Content-Length`` before anything is read (a chunked body: each chunk as it arrives; a coded body: its
decoded bytes too, as they come out of the decoder) and keeps the reservation until its handler returns: binary
tensors view the body (``np.frombuffer``), so the body lives as long as the request. A reservation that does not
fit now is a **503** with ``Retry-After`` (counted as reason ``rejected``); one larger than the whole budget can
never fit: **413**. Not counted: the final ``b"".join`` of a coded or chunked body's parts (a second copy of one
complete body, for an instant; a plain body with a declared length is read straight into one buffer of that length,
:func:`_read_into`), aiohttp's per-connection read buffer (64 KiB, reading paused at twice that), and a body with no
coding that declares at most :data:`UNCOUNTED_BYTES` (no more than that buffer holds; not counting the small requests keeps
the budget off their path), so what is held beyond the budget is at most that much per connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import Gauge

from .errors import BatcherError, InvalidInput, PayloadTooLarge, RequestTimeout, Unavailable, UnsupportedMediaType

try:  # optional: aiohttp's speedups and many distributions install it
    import brotli
except ImportError:  # pragma: no cover - depends on the environment
    brotli = None

#: a body with no coding that declares at most this many bytes is not counted against the budget (module docstring)
UNCOUNTED_BYTES = 64 * 1024
#: bytes read from the socket at a time
CHUNK = 256 * 1024
#: a plain body with a declared length up to this size is read into a zero-filled bytearray; a larger one into
#: an uninitialised buffer whose pages are taken as its bytes arrive (:func:`_read_into`)
EAGER_BYTES = 1 << 20
#: the first two bytes of every gzip member (RFC 1952, 2.3.1)
GZIP_MAGIC = b"\x1f\x8b"


class _Zlib:
    """gzip (every member) or deflate (one stream), streaming, with the output capped per call."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self._d: zlib._Decompress | None = None

    def _start(self, data: bytes) -> zlib._Decompress:
        if self.coding == "deflate":  # zlib header (RFC 1950) or raw deflate
            wrapped = len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
            return zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
        return zlib.decompressobj(16 + zlib.MAX_WBITS)

    def feed(self, data: bytes, cap: int) -> bytes:
        """At most ``cap`` (>= 1) bytes of output; reaching ``cap`` means the caller refuses the body."""
        if self._d is None:
            self._d = self._start(data)
        out: list[bytes] = []
        n = 0
        while True:
            if self._d.eof:  # the member (gzip) or stream (deflate) has ended; data is what follows it
                if not data:
                    break
                if self.coding == "deflate" or not GZIP_MAGIC.startswith(data[:2]):
                    raise zlib.error("data after the end of the compressed stream")
                self._d = self._start(data)  # the next gzip member
            out.append(self._d.decompress(data, cap - n))
            n += len(out[-1])
            if not self._d.eof or n >= cap:  # needs more input, or the output reached the cap
                break
            data = self._d.unused_data
        return out[0] if len(out) == 1 else b"".join(out)

    def finish(self) -> None:
        if self._d is None or not self._d.eof:
            raise zlib.error("the compressed stream is truncated")


class _Brotli:
    def __init__(self) -> None:
        self._d = brotli.Decompressor()

    def feed(self, data: bytes, cap: int) -> bytes:
        return self._d.process(data, output_buffer_limit=cap)

    def finish(self) -> None:
        if not self._d.is_finished():
            raise brotli.error("the compressed stream is truncated")


DECODERS: dict[str, Callable[[], _Zlib | _Brotli]] = {
    "gzip": lambda: _Zlib("gzip"), "x-gzip": lambda: _Zlib("gzip"), "deflate": lambda: _Zlib("deflate")}
if brotli is not None:
    DECODERS["br"] = _Brotli
_ERRORS = (zlib.error,) + ((brotli.error,) if brotli is not None else ())


#: codings one body may stack: each costs a decoder's state (about 34 KB for gzip) while the body decodes, which no
#: budget counts (a fresh user's find: 20,000 stacked gzip layers took 680 MB and stalled the event loop 2.6 s).
#: Real clients stack one, at most two.
MAX_CODINGS = 4


def content_codings(header: str | None) -> list[str]:
    """The codings of a ``Content-Encoding`` value, in the order they were applied (identity left out).

    Raises:
        UnsupportedMediaType: a coding this server cannot undo (415). InvalidInput: more than :data:`MAX_CODINGS`
            codings (400).
    """
    if not header:  # nearly every request: no header at all
        return []
    codings = [c.strip().lower() for c in header.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if len(codings) > MAX_CODINGS:
        raise InvalidInput(f"Content-Encoding lists {len(codings)} codings; at most {MAX_CODINGS} are undone")
    for c in codings:
        if c not in DECODERS:
            raise UnsupportedMediaType(
                f"Content-Encoding {c!r} is not supported; supported: identity, {', '.join(DECODERS)}",
                headers={"Accept-Encoding": ", ".join(DECODERS)})
    return codings


class BodyBudget:
    """The bytes of request bodies this process may hold at once: ``server.max_inflight_body_bytes``.

    One per aiohttp application (each front-end process of multi-process mode has its own). Requests take
    :class:`Reservation` s from it (:func:`read_body`, which finds it as the application's :data:`BUDGET`);
    :func:`release` gives a request's back when its handler returns or raises, on every path (answer, error,
    timeout, client gone): the application's edge (:func:`batcher.app.edge`, around every route's handler) calls it.

    Args:
        capacity: bytes, at least ``server.max_body_bytes`` (:class:`batcher.config.ServerConfig` checks).
        gauge: ``batcher_inflight_body_bytes``, set to :attr:`used` on every change.
    """

    def __init__(self, capacity: int, gauge: Gauge | None = None) -> None:
        self.capacity = capacity
        #: bytes reserved now, over every request of the process
        self.used = 0
        self._gauge = gauge
        #: the handler tasks reading a body now (:func:`read_body`'s waiting path), and those :meth:`cut`
        self.reading: set[asyncio.Task] = set()
        self._cut: set[asyncio.Task] = set()

    def cut(self) -> int:
        """The end of SIGTERM's grace (:func:`batcher.app._drain_on_sigterm`): every body still being read stops,
        and its request is answered 503 + Retry-After (:func:`read_body`) instead of being cancelled with no answer
        when the server exits. Returns how many were cut."""
        for task in self.reading:
            self._cut.add(task)
            task.cancel()
        return len(self.reading)

    def was_cut(self, task: asyncio.Task | None) -> bool:
        """Whether ``task``'s cancellation is :meth:`cut`'s (then forgotten)."""
        if task in self._cut:
            self._cut.discard(task)
            return True
        return False

    def _take(self, held: int, n: int) -> None:
        if held + n > self.capacity:
            raise PayloadTooLarge(f"request body of at least {held + n} bytes (its decoded form counted too) is over "
                                  f"server.max_inflight_body_bytes = {self.capacity}")
        if self.used + n > self.capacity:
            raise Unavailable(f"the server is busy reading other request bodies ({self.used} of "
                              f"server.max_inflight_body_bytes = {self.capacity} bytes held); this one needs {n} "
                              "more: retry later")
        self.used += n
        if self._gauge is not None:
            self._gauge.set(self.used)

    def _give(self, n: int) -> None:
        if n:
            self.used -= n
            if self._gauge is not None:
                self._gauge.set(self.used)


class Reservation:
    """One request's share of a :class:`BodyBudget`, in bytes (:attr:`held`)."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.held = 0

    def grow(self, n: int) -> None:
        """Reserve ``n`` more bytes.

        Raises:
            Unavailable (503 + Retry-After): they do not fit beside the other requests' now.
            PayloadTooLarge (413): this request's reservation would be over the whole budget.
        """
        self.budget._take(self.held, n)
        self.held += n

    def release(self) -> None:
        """Give back everything (idempotent)."""
        self.budget._give(self.held)
        self.held = 0


#: the process's budget: one per application (:func:`batcher.app.create_app`)
BUDGET = web.AppKey("body_budget", BodyBudget)
#: the request's :class:`Reservation`, made by :func:`read_body` when it counts the body
RESERVATION = web.RequestKey("body_reservation", Reservation)
#: the buffer ``read_body``'s ``into`` gave the request's body (:func:`_read_into`), released by :func:`release`
BODY_BUFFER = web.RequestKey("body_buffer", object)


#: bytes of memory a request's JSON may cost once parsed, beyond a copy of its own bytes (its strings): per value
#: (one per comma), per object (``{``) and per array (``[``). Measured with ``tracemalloc`` around ``orjson.loads``
#: on Python 3.11: a number 32 bytes (then about as much again for the array made of them: 30 million ``0.5``
#: values raised a server's peak memory by 1.9 GB, 63 bytes a value), ``{"a":1}`` 192, ``[[]]`` 128 (64 an array),
#: ``{"a":{"a":{}}}`` 440 (a new user's 100 MiB body of them took 3.6 GB, which one per comma missed).
JSON_VALUE_COST, JSON_OBJECT_COST, JSON_ARRAY_COST = 64, 192, 64


def json_cost(json_part: bytes) -> int:
    """What parsing ``json_part`` may cost in memory, in bytes (:data:`JSON_VALUE_COST`): an upper bound for the
    documents measured, whatever the nesting (a ``,``, ``{`` or ``[`` inside a string counts too), plus its bytes
    other than spaces and newlines once more (the copies its strings become; padding becomes nothing)."""
    text = len(json_part) - json_part.count(b" ") - json_part.count(b"\n")
    return (text + JSON_VALUE_COST * (json_part.count(b",") + 1) + JSON_OBJECT_COST * json_part.count(b"{")
            + JSON_ARRAY_COST * json_part.count(b"["))


def reserve_decoded(request: web.Request, n: int) -> None:
    """Count ``n`` more bytes, of what decoding the request's body makes (its parsed JSON, its BYTES elements),
    against the process's budget beside the body, until its handler returns; on the event loop's thread. At most
    :data:`UNCOUNTED_BYTES` are not counted.

    Raises:
        Unavailable (503 + Retry-After): they do not fit beside the other requests' now.
        PayloadTooLarge (413): this request's reservation would be over the whole budget.
    """
    if n <= UNCOUNTED_BYTES:  # as a small body: not counted, which keeps the budget off small requests' path
        return
    held = request.get(RESERVATION)
    if held is None:
        held = request[RESERVATION] = Reservation(request.app[BUDGET])
    held.grow(n)


def decoded_reserver(request: web.Request, loop: asyncio.AbstractEventLoop,
                     wait_s: float = 10.0) -> Callable[[int], None]:
    """:func:`reserve_decoded` for ``request`` as a callback that a decoder may call from the event loop or from a
    worker thread: there it waits (at most ``wait_s``, then 503) for the event loop to make the reservation, which
    is owned by the event loop, and raises what it raised."""
    def reserve(n: int) -> None:
        if threading.get_ident() == thread:
            reserve_decoded(request, n)
            return
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def on_loop() -> None:
            try:
                reserve_decoded(request, n)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                done.set_exception(exc)
            else:
                done.set_result(None)

        loop.call_soon_threadsafe(on_loop)
        try:
            done.result(wait_s)
        except concurrent.futures.TimeoutError:
            raise Unavailable("the server is busy: the request's decoded size could not be counted",
                              retry_after_s=1) from None

    thread = threading.get_ident()
    return reserve


def release(request: web.Request) -> None:
    """Give back the request's :data:`RESERVATION` and :data:`BODY_BUFFER`, if it has them (idempotent): call when
    its handler is done. A request that keeps nothing (most small ones: no key at all) costs one ``len``: a
    request's ``get`` of a missing key raises and catches a KeyError inside (``MutableMapping.get``), about 0.7 us
    for the two on every request (:func:`batcher.app.edge` calls this)."""
    if not len(request):  # (a request is always true: BaseRequest.__bool__)
        return
    held = request.get(RESERVATION)
    if held is not None:
        held.release()
    given = request.get(BODY_BUFFER)
    if given is not None:
        given.release()


def check_declared(declared: int | None, max_bytes: int) -> None:
    """Raises PayloadTooLarge (413) when a declared ``Content-Length`` is over ``max_bytes``: refused unread."""
    if declared is not None and declared > max_bytes:
        raise PayloadTooLarge(f"request body of {declared} bytes is over server.max_body_bytes = {max_bytes}")


async def read_body(request: web.Request, max_bytes: int, timeout_s: float,
                    into: Callable[[int], Any] | None = None) -> bytes | bytearray | memoryview:
    """The request's body, decoded, at most ``max_bytes`` long, counted against the process's :class:`BodyBudget`
    (the request's :data:`RESERVATION`, given back by :func:`release` when its handler returns). ``into``: where a
    plain body with a declared length that is still arriving may be read (:func:`_read_into`).

    Raises:
        UnsupportedMediaType (415): unknown content coding. PayloadTooLarge (413): the body, or its decoded form,
        is over ``max_bytes``, or the body with its decoded form over the whole budget. Unavailable (503 +
        Retry-After): the budget has no room for it now (nothing read). InvalidInput (400): it does not decode.
        RequestTimeout (408): it did not arrive within ``timeout_s``. asyncio.CancelledError: the client went away
        before its body was read (module docstring).
    """
    try:  # costs nothing until something is raised
        # the header on several lines is one list (RFC 9110, 5.3; a fresh user's find: the second line was ignored)
        codings = content_codings(",".join(request.headers.getall("Content-Encoding", ())) or None)
        declared = request.content_length
        check_declared(declared, max_bytes)
        plain = not codings and declared is not None
        whole = plain and request.content.is_eof()
        small = plain and declared <= UNCOUNTED_BYTES  # not counted (module docstring)
        if whole and small:
            return _buffered(request)  # most small requests: arrived, no reservation, no timer, no task
        held = request.get(RESERVATION)
        if held is None:
            held = request[RESERVATION] = Reservation(request.app[BUDGET])
        if declared is not None and not small:
            held.grow(declared)  # before anything is read: a body that does not fit is refused unread
        if whole:
            return _buffered(request)  # all of it has arrived already: no timer, no task
        budget, task = request.app[BUDGET], asyncio.current_task()
        budget.reading.add(task)
        try:
            reading = _read_into(request, declared, into) if plain else _read(request, codings, max_bytes, held,
                                                                              declared is None)
            return await asyncio.wait_for(reading, timeout_s)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"request body not received within server.read_timeout_s = {timeout_s} s") from None
        except asyncio.CancelledError:
            if not budget.was_cut(task):
                raise
            task.uncancel()  # type: ignore[union-attr]
            raise Unavailable("the server is shutting down: the request body did not arrive within "
                              "server.shutdown_grace_s", retry_after_s=1) from None
        finally:
            budget.reading.discard(task)
    except ConnectionError:  # the client went away mid-body: its handler is being cancelled (module docstring)
        raise asyncio.CancelledError("the client disconnected while its request body was being read") from None


def _buffered(request: web.Request) -> bytes:
    """A body that has arrived whole (its stream at EOF), taken from the stream's buffer: the one chunk itself, or
    one join of its chunks (``request.read()`` copies it twice, into a bytearray and then into bytes, and awaits
    once per chunk)."""
    return request.content.read_nowait(-1)


async def _read_into(request: web.Request, declared: int, into: Callable[[int], Any] | None = None
                     ) -> bytearray | memoryview:
    """A body with no coding and a declared length, read chunk by chunk straight into one buffer of that length:
    one copy of each byte (:func:`_read`'s ``iter_chunked`` slices and joins the buffered chunks, then joins the
    parts: two or three). Each chunk is the stream's buffered one as the parser fed it (``readchunk`` of a body
    that is not chunked splits nothing). The HTTP parser ends the body at ``declared`` bytes; one that ends
    sooner (its client gone) raises from the stream, as in :func:`_read`.

    ``into(declared)`` may give the buffer instead (an object with ``view``, a writable memoryview of ``declared``
    bytes, and ``release()``; :meth:`batcher.remote.EngineLink.body_buffer`: shared memory an engine process reads),
    which is then returned as that view and released when the handler ends (:func:`release`); None: a bytearray,
    or over :data:`EAGER_BYTES` a memoryview of an uninitialised NumPy buffer, whose pages are taken only as the
    bytes arrive (what a client declared but has not sent costs its reservation, not memory).

    Raises:
        InvalidInput (400): broken framing found while the body streams in. ConnectionResetError and the like:
        its client went away (the buffer is dropped before the exception leaves this frame).
    """
    given = into(declared) if into is not None else None
    if given is not None:
        request[BODY_BUFFER] = given
        body, view = None, given.view
    elif declared <= EAGER_BYTES:
        body = bytearray(declared)
        view = memoryview(body)
    else:  # taken as its bytes arrive: bytearray(n) zero-fills every page at once, so a client that declared 120 MB
        # and sent 100 bytes had 114 MB of real memory committed until its read timed out (a new user's report)
        body = np.empty(declared, np.uint8)
        view = memoryview(body)
    size = 0
    try:
        while True:
            chunk, _ = await request.content.readchunk()
            if not chunk:
                break
            n = len(chunk)
            view[size:size + n] = chunk
            size += n
    except HttpProcessingError as exc:
        if given is None:
            view.release()
        body = view = chunk = None  # noqa: F841 - nothing of a refused body stays referenced from this frame
        raise InvalidInput(f"request body is not well-formed HTTP: {exc.message}") from None
    except BaseException:
        if given is None:
            view.release()
        body = view = chunk = None  # noqa: F841 - as in _read
        raise
    if size != declared:  # not reached while the parser ends the body at Content-Length; never a short body
        raise InvalidInput(f"request body of {size} bytes, {declared} declared")
    if given is not None or type(body) is not bytearray:
        return view
    view.release()
    return body


async def _read(request: web.Request, codings: list[str], max_bytes: int, held: Reservation, chunked: bool) -> bytes:
    """The body, read chunk by chunk; ``held`` grows by each chunk of a ``chunked`` body (no declared length) as it
    arrives, and by the decoded bytes of a coded body as they come out of the decoders."""
    decoders = [DECODERS[c]() for c in reversed(codings)]
    parts: list[bytes] = []
    chunk = b""
    size = 0
    refused: BatcherError | None = None
    try:
        async for chunk in request.content.iter_chunked(CHUNK):
            if chunked:
                held.grow(len(chunk))
            for d in decoders:  # each decoded form is capped: a coding never inflates past the limit
                chunk = d.feed(chunk, max_bytes - size + 1)
                if size + len(chunk) > max_bytes:
                    break
            size += len(chunk)
            if size > max_bytes:
                what = " (decoded)" if codings else ""
                refused = PayloadTooLarge(f"request body{what} is over server.max_body_bytes = {max_bytes} bytes")
                break
            if decoders:
                held.grow(len(chunk))
            parts.append(chunk)
        else:
            for d in decoders:
                d.finish()
    except _ERRORS as exc:
        refused = InvalidInput(f"request body does not decode as Content-Encoding {', '.join(codings)}: {exc}")
    except HttpProcessingError as exc:  # e.g. broken chunked framing, found while the body streams in
        refused = InvalidInput(f"request body is not well-formed HTTP: {exc.message}")
    except (PayloadTooLarge, Unavailable) as exc:  # the budget's
        refused = exc
    except BaseException:  # the client went away (ConnectionResetError), the handler cancelled, the read timed out
        parts.clear()  # as below: this frame stays referenced from the exception's traceback
        chunk = decoders = None  # noqa: F841
        raise
    if refused is not None:
        # nothing of a refused body may stay referenced from this frame: the exception's traceback holds the frame,
        # and asyncio's wait_for makes that a reference cycle, freed only by the cyclic garbage collector
        parts.clear()
        chunk = decoders = None  # noqa: F841
        raise refused
    return b"".join(parts)
