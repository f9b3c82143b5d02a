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
* Whatever was read of a refused body is dropped before the error is raised, so nothing of it stays referenced
  from the exception's traceback until the cyclic garbage collector runs.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .errors import InvalidInput, PayloadTooLarge, RequestTimeout, UnsupportedMediaType

try:  # optional: aiohttp's speedups and many distributions install it
    import brotli
except ImportError:  # pragma: no cover - depends on the environment
    brotli = None

#: bytes read from the socket at a time
CHUNK = 256 * 1024


class _Zlib:
    """gzip or deflate, streaming, with the output capped per call."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self._d: zlib._Decompress | None = None

    def feed(self, data: bytes, cap: int) -> bytes:
        if self._d is None:
            if self.coding == "deflate":  # zlib header (RFC 1950) or raw deflate
                wrapped = len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
                self._d = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
            else:
                self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        if self._d.eof:
            if data:
                raise zlib.error("data after the end of the compressed stream")
            return b""
        out = self._d.decompress(data, cap)
        if self._d.eof and self._d.unused_data:
            raise zlib.error("data after the end of the compressed stream")
        return out

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


def content_codings(header: str | None) -> list[str]:
    """The codings of a ``Content-Encoding`` value, in the order they were applied (identity left out).

    Raises:
        UnsupportedMediaType: a coding this server cannot undo (415).
    """
    codings = [c.strip().lower() for c in (header or "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    for c in codings:
        if c not in DECODERS:
            raise UnsupportedMediaType(
                f"Content-Encoding {c!r} is not supported; supported: identity, {', '.join(DECODERS)}",
                headers={"Accept-Encoding": ", ".join(DECODERS)})
    return codings


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request's body, decoded, at most ``max_bytes`` long.

    Raises:
        UnsupportedMediaType (415): unknown content coding. PayloadTooLarge (413): the body, or its decoded form,
        is over ``max_bytes``. InvalidInput (400): it does not decode. RequestTimeout (408): it did not arrive within
        ``timeout_s``.
    """
    codings = content_codings(request.headers.get("Content-Encoding"))
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise PayloadTooLarge(f"request body of {declared} bytes is over server.max_body_bytes = {max_bytes}")
    if not codings and declared is not None and request.content.is_eof():
        return await request.read()  # all of it has arrived already (most small requests): no timer, no task
    try:
        return await asyncio.wait_for(_read(request, codings, max_bytes), timeout_s)
    except asyncio.TimeoutError:
        raise RequestTimeout(f"request body not received within server.read_timeout_s = {timeout_s} s") from None


async def _read(request: web.Request, codings: list[str], max_bytes: int) -> bytes:
    decoders = [DECODERS[c]() for c in reversed(codings)]
    parts: list[bytes] = []
    chunk = b""
    size = 0
    too_large = bad = None
    try:
        async for chunk in request.content.iter_chunked(CHUNK):
            for d in decoders:  # each decoded form is capped: a coding never inflates past the limit
                chunk = d.feed(chunk, max_bytes - size + 1)
                if size + len(chunk) > max_bytes:
                    break
            size += len(chunk)
            if size > max_bytes:
                too_large = size
                break
            parts.append(chunk)
        else:
            for d in decoders:
                d.finish()
    except _ERRORS as exc:
        bad = f"request body does not decode as Content-Encoding {', '.join(codings)}: {exc}"
    except HttpProcessingError as exc:  # e.g. broken chunked framing, found while the body streams in
        bad = f"request body is not well-formed HTTP: {exc.message}"
    if too_large is not None or bad is not None:
        # nothing of a refused body may stay referenced from this frame: the exception's traceback holds the frame,
        # and asyncio's wait_for makes that a reference cycle, freed only by the cyclic garbage collector
        parts.clear()
        chunk = decoders = None  # noqa: F841
        if bad is not None:
            raise InvalidInput(bad)
        what = " (decoded)" if codings else ""
        raise PayloadTooLarge(f"request body{what} is over server.max_body_bytes = {max_bytes} bytes")
    return b"".join(parts)
