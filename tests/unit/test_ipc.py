"""The wire between front ends and engine processes (batcher/ipc.py): framing over a real Unix socket pair,
memfd areas passed with SCM_RIGHTS, the block allocator."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket

import numpy as np
import pytest

from batcher.errors import InvalidInput, RemoteError
from batcher.protocol import ShmInput, ShmRef
from batcher.ipc import (INLINE_BYTES, Allocator, Area, Channel, error_tuple, pack_tensors, recv_hello, send_hello,
                         unpack_tensors)


def test_allocator_first_fit_coalesces_and_says_when_full():
    a = Allocator(0, 1024)
    x, y, z = a.alloc(100), a.alloc(64), a.alloc(200)
    assert (x, y, z) == (0, 128, 192)  # 64-byte aligned blocks, first fit
    assert a.alloc(700) is None  # 1024 - 448 = 576 left
    a.free(y)
    assert a.alloc(64) == 128  # the hole is reused
    a.free(128)
    a.free(x)
    a.free(z)  # the three joined with the free tail: one range again
    assert a.used_bytes == 0 and a.alloc(1024) == 0
    with pytest.raises(KeyError):
        a.free(64)  # not a block


async def test_channel_frames_every_message_in_order_and_batches_writes():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    loop = asyncio.get_running_loop()
    got: list = []
    lost = asyncio.Event()
    sender = Channel(lambda m: None, lambda: None)
    receiver = Channel(got.append, lost.set)
    writes: list[int] = []
    t_send, _ = await loop.create_unix_connection(lambda: sender, sock=left)
    await loop.create_unix_connection(lambda: receiver, sock=right)
    write = t_send.write
    t_send.write = lambda data: (writes.append(len(data)), write(data))
    messages = [(i, "x" * (i % 7), np.arange(i % 5)) for i in range(300)] + [(300, b"y" * 200_000)]
    for m in messages:
        sender.send(m)
    assert writes == []  # queued: one write at the end of this loop iteration
    while len(got) < len(messages):
        await asyncio.sleep(0.01)
    assert len(writes) == 1
    assert [m[0] for m in got] == list(range(301))
    assert all(np.array_equal(g[2], m[2]) for g, m in zip(got[:300], messages[:300]))
    assert got[300][1] == b"y" * 200_000  # arrived in many reads, framed back together
    sender.close()
    await asyncio.wait_for(lost.wait(), 5)  # the peer closing is seen at once
    assert receiver.closed


def test_hello_passes_a_memfd_area_that_both_sides_see_and_that_has_no_name():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    area = Area(1 << 20)
    assert os.readlink(f"/proc/self/fd/{area.fd}") == "/memfd:batcher-area (deleted)"  # no name in /dev/shm
    send_hello(left, {"area_bytes": area.size}, [area.fd])
    area.close_fd()
    hello, fds = recv_hello(right)
    theirs = Area(hello["area_bytes"], fds[0])
    theirs.close_fd()
    np.ndarray((4,), np.int64, buffer=area.buf, offset=4096)[:] = [1, 2, 3, 4]
    assert np.ndarray((4,), np.int64, buffer=theirs.buf, offset=4096).tolist() == [1, 2, 3, 4]
    area.close()
    theirs.close()
    left.close()
    right.close()


def test_tensors_of_64_kib_and_more_go_through_the_area_smaller_ones_inline():
    area = Area(1 << 20)
    alloc = Allocator(0, area.size)
    big = np.arange(INLINE_BYTES // 4, dtype=np.float32).reshape(-1, 4)
    small = np.ones((3, 4), np.float32)
    words = np.array([b"a", b"bc"], dtype=object)
    entries, blocks = pack_tensors({"big": big, "small": small, "words": words, "ref": ("shm", 0, 8)}, area, alloc)
    assert entries[0] == ("big", "<f4", (INLINE_BYTES // 16, 4), 0) and blocks == [0]
    assert entries[1] == ("small", "<f4", (3, 4), small.tobytes())  # a numeric array rides as its bytes
    assert [len(e) for e in entries[2:]] == [2, 2]  # BYTES and anything else: as themselves
    out = unpack_tensors(pickle.loads(pickle.dumps(entries, protocol=5)), area)
    assert np.array_equal(out["big"], big) and np.shares_memory(out["big"], np.frombuffer(area.buf, np.uint8))
    assert np.array_equal(out["small"], small) and out["small"].dtype == np.float32 and out["small"].shape == (3, 4)
    assert out["words"].tolist() == [b"a", b"bc"]
    assert out["ref"] == ("shm", 0, 8)  # anything else passes through
    shm_input = ShmInput("FP32", (1, 4), ShmRef("r", 64, 16))  # a shared-memory input: its fields, as a tuple
    [entry], _ = pack_tensors({"s": shm_input}, area, alloc)
    assert entry == ("s", "FP32", (1, 4), "r", 64, 16)
    assert unpack_tensors(pickle.loads(pickle.dumps([entry], protocol=5)), area) == {"s": shm_input}
    column = np.arange(12, dtype=">i2").reshape(3, 4)[:, 1]  # strided, big-endian: its values and dtype survive
    back = unpack_tensors(pack_tensors({"c": column}, area, alloc)[0], area)["c"]
    assert back.dtype == column.dtype and back.tolist() == [1, 5, 9]
    full = Allocator(0, 1024)
    entries, blocks = pack_tensors({"big": big}, area, full)  # no room: it rides inline
    assert entries[0][3] == big.tobytes() and blocks == []
    assert np.array_equal(unpack_tensors(entries, area)["big"], big)
    del out
    area.close()


def test_errors_cross_with_status_reason_and_retry_after():
    err = RemoteError(*error_tuple(InvalidInput("bad shape")))
    assert (err.status, err.reason, err.message, err.retry_after_s) == (400, "invalid", "bad shape", None)
    assert error_tuple(ValueError("boom")) == (500, "other", "internal error: ValueError('boom')", None)


def test_an_array_already_in_the_area_is_sent_as_its_offset_and_takes_no_block():
    """A front end reads a binary body straight into the area (batcher.remote.BodyBuffer): its tensors go to the
    engine as offsets, uncopied. A strided view inside the area is still copied into a block of its own."""
    area = Area(1 << 20)
    alloc = Allocator(0, area.size)
    inside = np.ndarray((INLINE_BYTES // 16, 4), np.float32, buffer=area.buf, offset=4096 + 148)
    inside[...] = 1.5
    entries, blocks = pack_tensors({"x": inside}, area, alloc)
    assert entries == [("x", "<f4", inside.shape, 4096 + 148)] and blocks == [] and alloc.used_bytes == 0
    assert area.offset_of(inside) == 4096 + 148 and area.offset_of(np.ones(4, np.float32)) is None
    back = unpack_tensors(entries, area)["x"]
    assert np.shares_memory(back, inside) and float(back.sum()) == 1.5 * inside.size
    strided = np.ndarray((INLINE_BYTES // 4, 2), np.float32, buffer=area.buf, offset=0)[:, 0]
    entries, blocks = pack_tensors({"s": strided}, area, alloc)
    assert blocks == [entries[0][3]] and alloc.used_bytes > 0
    del inside, back, strided
    area.close()
