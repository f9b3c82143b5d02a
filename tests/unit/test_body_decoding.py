"""batcher.bodies in-process: gzip members split at every byte, the output cap across members, the budget's rules
(tests/integration/test_bodies.py has the real server)."""

from __future__ import annotations

import gzip
import os
import zlib

import pytest
from prometheus_client import CollectorRegistry, Gauge

from batcher.bodies import BodyBudget, Reservation, _Zlib
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
