"""batcher.remote.BodyBuffer: a front end reads a binary request body into its engine link's shared area; the
block becomes the request's when it is sent (freed as its other blocks are, once the engine no longer reads it),
is freed when the handler ends if it never was, and is left alone once the engine process is gone."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import orjson

from batcher.codec import decode_request
from batcher.ipc import ALIGN, INLINE_BYTES, Allocator, Area
from batcher.remote import EngineLink

CFG = SimpleNamespace(name="m", version=1)


def _link() -> tuple[EngineLink, list]:
    link = EngineLink(SimpleNamespace(name="cpu"), "/nowhere", [("m", "1")])
    link._area = Area(1 << 20)
    link._inputs = Allocator(0, link._area.size // 2)
    sent: list = []
    link._channel = SimpleNamespace(send=sent.append)
    link.connected = True
    return link, sent


def _body(link: EngineLink, x: np.ndarray):
    head = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                     "parameters": {"binary_data_size": x.nbytes}}]})
    body = link.body_buffer(len(head) + x.nbytes, len(head))
    body.view[:len(head)] = head
    body.view[len(head):] = x.tobytes()
    return body, decode_request(body.view, str(len(head)))


async def test_a_body_read_into_the_area_reaches_the_engine_uncopied_and_its_block_is_the_requests():
    link, sent = _link()
    x = np.arange(INLINE_BYTES // 4 * 2, dtype=np.float32).reshape(2, -1)
    body, request = _body(link, x)
    offset = link._area.offset_of(request.inputs["x"])
    assert offset is not None and offset % ALIGN == 0  # the binary part starts aligned in the area
    link.submit(7, CFG, 0.0, request, None)
    (msg,) = sent
    assert msg[6] == [("x", "<f4", (2, INLINE_BYTES // 4), offset)]  # its offset, not a copy
    assert link._sent[7].blocks == [body.offset] and link._bodies == {}
    body.release()  # the handler ends: handed over, so nothing is freed here
    assert link._inputs.used_bytes > 0
    link._free(7)  # the engine no longer reads it
    assert link._inputs.used_bytes == 0


def test_a_body_never_sent_is_freed_when_its_handler_ends_and_one_of_a_lost_engine_is_left_alone():
    link, _ = _link()
    body, _request = _body(link, np.ones((1, INLINE_BYTES // 4), np.float32))
    assert link._inputs.used_bytes > 0
    body.release()
    body.release()  # idempotent
    assert link._inputs.used_bytes == 0 and link._bodies == {}
    body, _request = _body(link, np.ones((1, INLINE_BYTES // 4), np.float32))
    link._closing = True  # no reconnect task
    link._on_lost()  # the engine process died: its area and allocator are gone
    body.release()  # frees nothing in the next area
    assert link._bodies == {} and link._inputs is None
    assert link.body_buffer(100, 10) is None  # not connected: the body is read into memory of its own


def test_bodies_take_at_most_half_of_the_inputs_half_of_the_area():
    """Bodies still arriving (slow clients) hold their blocks; past a quarter of the area they are read into memory
    of their own, so that decoded tensors of other requests still find room (else they would ride pickled)."""
    link, _ = _link()  # a 1 MiB area: 512 KiB for inputs, bodies up to 256 KiB in all
    first = link.body_buffer(200_000, 100)
    assert first is not None
    assert link.body_buffer(100_000, 100) is None  # 300 KB > 256 KiB
    first.release()
    assert link.body_buffer(100_000, 100) is not None


async def test_a_client_gone_mid_body_leaves_no_block_behind():
    """The body read into the area (batcher.bodies._read_into with ``into``) stops when its client goes away; the
    handler's end (batcher.bodies.release, from the ``finally`` of the application's edge, batcher.app.edge) frees
    its block."""
    import asyncio
    from unittest import mock

    import pytest
    from aiohttp.streams import StreamReader

    from batcher.bodies import _read_into, release

    class Request(dict):  # what _read_into and release use of an aiohttp request: its stream and its keys
        def __init__(self, content) -> None:
            super().__init__()
            self.content = content

    link, _ = _link()
    stream = StreamReader(mock.Mock(_reading_paused=False), 2 ** 16, loop=asyncio.get_running_loop())
    request = Request(stream)
    reading = asyncio.ensure_future(_read_into(request, 200_000, lambda n: link.body_buffer(n, 100)))
    stream.feed_data(b"x" * 70_000)
    await asyncio.sleep(0)
    assert link._inputs.used_bytes > 0
    stream.set_exception(ConnectionResetError("gone"))
    with pytest.raises(ConnectionResetError):
        await reading
    release(request)
    assert link._inputs.used_bytes == 0 and link._bodies == {}
