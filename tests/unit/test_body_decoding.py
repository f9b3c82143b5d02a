"""batcher.bodies in-process: gzip members split at every byte, the output cap across members, the budget's rules
(tests/integration/test_bodies.py has the real server)."""

from __future__ import annotations

import asyncio
import gzip
import os
import zlib
from unittest import mock

import pytest
from aiohttp.streams import StreamReader
from prometheus_client import CollectorRegistry, Gauge

from batcher.bodies import BodyBudget, Reservation, _read_into, _Zlib
from batcher.errors import PayloadTooLarge, Unavailable

PARTS = [os.urandom(3000), b"", b"x" * 5000, os.urandom(10)]
STREAM = b"".join(gzip.compress(p) for p in PARTS)


def _decode(data: bytes, step: int, cap: int = 1 << 30) -> bytes:
    d = _Zlib("gzip")
    out = b"".join(d.feed(data[i:i + step], cap) for i in range(0, len(data), step))
    d.finish()
    return out


@pytest.mark.parametrize("step", [1, 2, 7, 1000, len(STREAM)])
def test_every_gzip_member_decodes_whatever_the_read_boundaries(step):
    assert _decode(STREAM, step) == b"".join(PARTS)


def test_one_feed_stops_at_its_cap_across_members():
    d = _Zlib("gzip")
    out = d.feed(gzip.compress(b"a" * 10) + gzip.compress(b"b" * 10), 15)
    assert out == b"a" * 10 + b"b" * 5  # the caller sees the cap reached: 413


@pytest.mark.parametrize("tail,message", [
    (b"junk", "data after the end"), (b"\0", "data after the end"), (b"\x1f", "truncated"),
    (gzip.compress(b"z")[:-1], "truncated")])
def test_a_gzip_tail_that_is_not_a_whole_member_fails(tail, message):
    with pytest.raises(zlib.error, match=message):
        _decode(STREAM + tail, 1)


def test_deflate_stays_one_stream():
    d = _Zlib("deflate")
    with pytest.raises(zlib.error, match="data after the end"):
        d.feed(zlib.compress(b"a") + zlib.compress(b"b"), 100)


def test_the_budget_refuses_with_503_while_full_and_413_beyond_its_size_and_releases_everything():
    registry = CollectorRegistry()
    gauge = Gauge("g", "g", registry=registry)
    budget = BodyBudget(100, gauge)
    a, b = Reservation(budget), Reservation(budget)
    a.grow(60)
    a.grow(10)
    with pytest.raises(Unavailable) as busy:
        b.grow(31)
    assert busy.value.status == 503 and busy.value.retry_after_s == 1
    assert "(70 of server.max_inflight_body_bytes = 100 bytes held); this one needs 31 more" in busy.value.message
    with pytest.raises(PayloadTooLarge, match="at least 101 bytes"):
        a.grow(31)  # a alone would pass the whole budget: never fits
    b.grow(30)
    assert budget.used == 100 and registry.get_sample_value("g") == 100
    a.release()
    a.release()  # idempotent
    assert budget.used == 30 and a.held == 0 and registry.get_sample_value("g") == 30
    b.release()
    assert budget.used == 0 and registry.get_sample_value("g") == 0


class _Request:
    """What :func:`batcher.bodies._read_into` reads: ``content``, aiohttp's real StreamReader."""

    def __init__(self, content) -> None:
        self.content = content


def _stream() -> StreamReader:
    protocol = mock.Mock(_reading_paused=False)  # only pause_reading/resume_reading are called on it
    return StreamReader(protocol, 2 ** 16, loop=asyncio.get_running_loop())


async def test_a_plain_body_is_read_into_one_buffer_of_its_declared_length_whatever_its_chunks():
    body = os.urandom(300_000)
    stream = _stream()
    reading = asyncio.ensure_future(_read_into(_Request(stream), len(body)))
    for i in range(0, len(body), 70_000):  # chunks arriving one by one, the reader waiting between them
        stream.feed_data(body[i:i + 70_000])
        await asyncio.sleep(0)
    stream.feed_eof()
    got = await reading
    assert type(got) is bytearray and got == body


async def test_a_plain_body_whose_client_goes_away_raises_what_the_stream_was_given():
    stream = _stream()
    reading = asyncio.ensure_future(_read_into(_Request(stream), 1000))
    stream.feed_data(b"x" * 400)
    await asyncio.sleep(0)
    stream.set_exception(ConnectionResetError("gone"))
    with pytest.raises(ConnectionResetError):
        await reading
