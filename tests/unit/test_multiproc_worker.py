"""The multiproc engine's pieces in-process: who owns shared memory (the parent only), the worker's side of one
batch with its request for a larger output segment, the sweep of a dead server's segments, exit codes in words.

The real worker processes, kill -9 and the restart are tests/integration/test_multiproc.py."""

from __future__ import annotations

import os
import subprocess
from collections import deque

import numpy as np
import pytest
from fakes import FakeContext
from helpers import segment_factory

import engines.multiproc.worker as worker
from engines.base import EngineError
from engines.multiproc.parent import _describe_exit
from engines.multiproc.shm import MIN_SEGMENT_BYTES, SEGMENT_PREFIX, new_segment, sweep_orphan_segments
from engines.multiproc.worker import Segments, run_one


class FakeConn:
    """The worker's end of the socket: ``replies`` are what the parent sends next; ``sent`` what the worker sent."""

    def __init__(self, *replies) -> None:
        self.replies = deque(replies)
        self.sent: list = []

    def send(self, obj) -> None:
        self.sent.append(obj)

    def recv(self):
        if not self.replies:
            raise EOFError
        return self.replies.popleft()


@pytest.fixture
def segments():
    """Parent-owned segments made by the test; all unlinked afterwards."""
    create = new_segment.__globals__["SharedMemory"]  # the real class, even where a test patches the worker's
    yield from segment_factory(lambda k: f"{SEGMENT_PREFIX}t{k}", MIN_SEGMENT_BYTES, create)


@pytest.fixture
def no_creation_in_the_worker(monkeypatch):
    """The worker side may attach to segments, never create one."""
    real = worker.SharedMemory

    def attach_only(name=None, create=False, size=0):
        assert not create, "the worker created a shared-memory segment"
        return real(name=name)

    monkeypatch.setattr(worker, "SharedMemory", attach_only)


def _stage(seg, x: np.ndarray) -> list[tuple]:
    """Input ``x`` staged in its segment, as the parent's message lists it."""
    np.ndarray(x.shape, x.dtype, buffer=seg.buf)[...] = x
    return [("x", x.dtype.str, x.shape, seg.name)]


def test_segments_are_named_after_this_server_and_never_smaller_than_the_minimum():
    seg = new_segment(None, 10)
    try:
        assert seg.name.startswith(SEGMENT_PREFIX) and SEGMENT_PREFIX == f"batcher_{os.getpid()}_"
        assert seg.size == MIN_SEGMENT_BYTES
        assert os.path.exists(f"/dev/shm/{seg.name}")
        grown = new_segment(seg, MIN_SEGMENT_BYTES + 1)  # the old one is unlinked
        assert not os.path.exists(f"/dev/shm/{seg.name}") and grown.size == MIN_SEGMENT_BYTES + 1
        seg = grown
    finally:
        seg.close()
        seg.unlink()


def test_the_worker_writes_outputs_into_the_parents_segment(segments, no_creation_in_the_worker):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    seg_in, seg_out = segments(x.nbytes), segments(0)
    conn, attached = FakeConn(), Segments(register=False)
    assert run_one(conn, FakeContext(), attached, (_stage(seg_in, x), seg_out.name))
    attached.close()
    ((kind, specs),) = conn.sent
    assert kind == "ok" and specs == [("y", "<f4", (3, 4), 0)]
    np.testing.assert_array_equal(np.ndarray((3, 4), np.float32, buffer=seg_out.buf), x * 2)


def test_outputs_too_large_for_the_segment_make_the_worker_ask_for_a_larger_one(segments, no_creation_in_the_worker):
    x = np.ones((MIN_SEGMENT_BYTES // 16 + 1, 4), np.float32)  # one row more than the minimum segment holds
    seg_in, small, large = segments(x.nbytes), segments(0), segments(x.nbytes)
    conn, attached = FakeConn(large.name), Segments(register=False)
    assert run_one(conn, FakeContext(), attached, (_stage(seg_in, x), small.name))
    attached.close()
    assert conn.sent[0] == ("grow", x.nbytes)
    assert conn.sent[1][0] == "ok"
    np.testing.assert_array_equal(np.ndarray(x.shape, np.float32, buffer=large.buf), x * 2)


def test_an_engine_error_is_sent_back_and_the_worker_keeps_serving(segments):
    x = np.ones((1, 4), np.float32)
    seg_in, seg_out = segments(x.nbytes), segments(0)
    ctx = FakeContext()
    ctx.fail = EngineError("bad batch")
    conn, attached = FakeConn(), Segments(register=False)
    assert run_one(conn, ctx, attached, (_stage(seg_in, x), seg_out.name))
    assert run_one(conn, ctx, attached, (_stage(seg_in, x), seg_out.name))
    attached.close()
    assert conn.sent[0] == ("error", "bad batch") and conn.sent[1][0] == "ok"


def test_a_parent_gone_while_the_worker_waits_for_a_larger_segment_ends_the_worker(segments):
    x = np.ones((MIN_SEGMENT_BYTES // 16 + 1, 4), np.float32)
    seg_in, small = segments(x.nbytes), segments(0)
    attached = Segments(register=False)
    assert not run_one(FakeConn(), FakeContext(), attached, (_stage(seg_in, x), small.name))
    attached.close()


def test_the_sweep_removes_segments_of_dead_servers_only(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = [f"batcher_{dead.pid}_abc", f"batcher_{os.getpid()}_def", "batcher_x_1", "psm_123", "other"]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    assert sweep_orphan_segments(tmp_path) == [f"batcher_{dead.pid}_abc"]
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])


def test_exit_codes_name_their_signal():
    assert _describe_exit(-9) == "exit code -9, SIGKILL"
    assert _describe_exit(-11) == "exit code -11, SIGSEGV"
    assert _describe_exit(1) == "exit code 1"
    assert _describe_exit(None) == "exit code unknown"
