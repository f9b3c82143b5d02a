"""What a body with a declared length costs in memory before its bytes arrive (batcher.bodies._read_into): a large
one takes its pages as the bytes come, not at once (a client that declared 120 MB and sent 100 bytes had 114 MB of
real memory committed until its read timed out: a new user's report), and still reads whole and exact."""

from __future__ import annotations

import asyncio
import os
from unittest import mock

import pytest
from aiohttp.streams import StreamReader

from batcher.bodies import EAGER_BYTES, _read_into
from bench.server import proc_status


class Request(dict):  # what _read_into uses of an aiohttp request: its stream and its keys
    def __init__(self, content) -> None:
        super().__init__()
        self.content = content


def _stream() -> StreamReader:
    return StreamReader(mock.Mock(_reading_paused=False), 2 ** 16, loop=asyncio.get_running_loop())


async def test_a_large_declared_body_takes_memory_as_its_bytes_arrive():
    declared = 256 * 2 ** 20
    stream = _stream()
    before_kb = proc_status(os.getpid(), "VmRSS")
    reading = asyncio.ensure_future(_read_into(Request(stream), declared))
    stream.feed_data(b"x" * 1000)
    await asyncio.sleep(0)  # the buffer is made and the first chunk written into it
    grown_mb = (proc_status(os.getpid(), "VmRSS") - before_kb) / 1024
    stream.set_exception(ConnectionResetError("gone"))
    with pytest.raises(ConnectionResetError):
        await reading
    assert grown_mb < 32, f"{grown_mb:.0f} MB taken for 1,000 bytes of a body that declared 256 MiB"


@pytest.mark.parametrize("declared", [100, EAGER_BYTES, EAGER_BYTES + 1, 3 * EAGER_BYTES + 17])
async def test_a_body_reads_whole_and_exact_either_way(declared):
    data = bytes(range(256)) * (declared // 256) + bytes(declared % 256)
    stream = _stream()
    reading = asyncio.ensure_future(_read_into(Request(stream), declared))
    for i in range(0, declared, 70_000):
        stream.feed_data(data[i:i + 70_000])
        await asyncio.sleep(0)
    stream.feed_eof()
    body = await reading
    assert len(body) == declared and bytes(body) == data
    assert bytes(body[:10]) == data[:10]  # what the codec takes: slices, memoryview
