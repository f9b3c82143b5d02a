"""The engine process's request handling at its edges (DataPlane.start_infer / Started, engine_proc._Request, the
channel's pickling at the flush, ModelSignature.check's short path): an ABORT or a front end's loss in each window
of a request's life, a message that cannot cross, a REQ that does not unpack, a 0-d input. Found by a review of
1f7e870, where each of these tests failed; the engine connection runs here without a socket (FakeTransport)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pickle

import numpy as np
import pytest
from fakes import rows
from helpers import segment_factory
from test_dataplane import Outcome, counts, now
from test_dataplane import plane as dataplane_plane

from batcher.dataplane import DataPlane
from batcher.engine_proc import FrontendConnection
from batcher.errors import InvalidInput
from batcher.ipc import ABORT, ERROR, REPLY, REQ, area_view, pack_tensors, request_fields
from batcher.protocol import InferRequest, RequestedOutput, ShmRef
from batcher.signature import ModelSignature
from engines.base import TensorSpec

_names = itertools.count()


@pytest.fixture
def segment():
    yield from segment_factory(lambda _: f"trtb-review-{os.getpid()}-{next(_names)}")


async def plane(models=None, seconds_per_row=0.010, start=True, **server) -> DataPlane:
    """An engine process's data plane (its transport learns each answer's fate later)."""
    return await dataplane_plane(models, start=start, later=True, seconds_per_row=seconds_per_row, **server)


# ------------------------------------------------------------------ an engine connection without a socket
class FakeServer:
    def __init__(self, dp: DataPlane) -> None:
        self.dataplane = dp
        self.buffer_bytes = 1 << 20
        self.slot_index = {("m", "1"): 0}
        self.counts = np.zeros(1, np.int64)
        self.connections: set = set()
        self.stopping = False  # EngineServer.stopping: it closes its connections itself

    def register(self, area):
        return None

    def unregister(self, registration) -> None:
        pass


class FakeTransport:
    def __init__(self) -> None:
        self.messages: list[tuple] = []

    def write(self, data: bytes) -> None:
        self.messages.extend(pickle.loads(data[4:]))

    def close(self) -> None:
        pass


def connection(dp: DataPlane) -> tuple[FrontendConnection, FakeTransport]:
    server = FakeServer(dp)
    conn = FrontendConnection(server, 0)
    transport = FakeTransport()
    conn.channel.connection_made(transport)
    server.connections.add(conn)
    return conn, transport


def req_message(rid: int, request: InferRequest, received: float) -> tuple:
    entries, _ = pack_tensors(request.inputs, None, None)
    return (REQ, rid, "m", "1", received, request_fields(request), entries, None)


async def settle_loop(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def one_request_then_at_its_batch_end(dp: DataPlane, conn: FrontendConnection, event) -> None:
    """Request 1 by the fast path; ``event()`` runs right after its batch's end set its future, in the same loop
    iteration (as a message read from the socket then), before the answer is handed over."""
    runner = dp.repository.slot("m").runner
    finish = runner._finish

    def finish_then_event(*args):
        finish(*args)
        event()

    runner._finish = finish_then_event
    conn._on_message(req_message(1, InferRequest(rows(1)), now()))
    assert conn.requests[1].ticket is not None  # the fast path
    await asyncio.sleep(0.1)
    await settle_loop()


# ====================================================================================== defects
@pytest.mark.looptime
async def test_abort_read_after_the_batch_ended_but_before_the_done_callback_is_counted_canceled():
    """ABORT processed in the loop iteration where the batch's _finish set the future's result, before Started._done
    ran: the future is done, so withdrawing does nothing; a RESULT sent then would never be ACKed (the front end
    abandoned the request: frontend.py), the outcome never counted and its output blocks kept. As the task path
    (DataPlane.infer): counted 'canceled', ERROR sent."""
    dp = await plane()
    conn, transport = connection(dp)
    await one_request_then_at_its_batch_end(dp, conn, lambda: conn._on_message((ABORT, 1)))
    kinds = [m[0] for m in transport.messages if m[1] == 1]
    assert kinds == [ERROR], "a RESULT sent after the ABORT is never ACKed"
    assert 1 not in conn.acks
    assert counts(dp)["canceled"] == 1
    await dp.close()


@pytest.mark.looptime
async def test_front_end_lost_after_the_batch_ended_but_before_the_done_callback_is_counted_dropped():
    """Same window, the front end's loss: _on_lost already settled the acks it had; a CountedLater put into
    conn.acks after that would never be settled - the request counted neither success nor dropped."""
    dp = await plane()
    conn, transport = connection(dp)
    await one_request_then_at_its_batch_end(dp, conn, lambda: conn.channel.connection_lost(None))
    c = counts(dp)
    assert c["success"] + c["dropped"] + c["canceled"] == 1, f"the outcome was never counted: {c}, acks {conn.acks}"
    await dp.close()


@pytest.mark.looptime
async def test_a_request_in_progress_when_the_engine_closes_its_connection_itself_is_not_counted_there():
    """The engine process closing its connections itself (SIGTERM, its grace over: EngineServer.close): its front
    end answers the requests it still had 503 and counts them (EngineLost), so here they are counted under no
    reason at all, where a front end's death counts them ``dropped``."""
    for stopping, dropped in ((True, 0), (False, 1)):
        dp = await plane()
        conn, transport = connection(dp)
        conn.server.stopping = stopping
        conn._on_message(req_message(1, InferRequest(rows(1)), now()))
        assert conn.requests[1].ticket is not None  # queued by the fast path, its batch window open
        conn.channel.connection_lost(None)
        await asyncio.sleep(0.1)
        await settle_loop()
        c = counts(dp)
        others = sum(v for k, v in c.items() if k not in ("dropped", "stats_fail"))
        assert (c["dropped"], c["stats_fail"], others) == (dropped, dropped, 0), (stopping, c)
        await dp.close()


@pytest.mark.looptime
async def test_a_lost_front_ends_area_stays_mapped_until_the_batch_reading_it_ends():
    """A front end killed while its request's batch executes: the request is dropped at once, but the batch still
    reads its inputs, views of that front end's area. The area is unmapped (and unregistered from CUDA) only after
    that batch: unmapped before, the engine process died of SIGSEGV (a new user's ``kill -9`` of a front end 25 ms
    after a resnet18 request, 4 of 4 tries)."""
    dp = await plane(seconds_per_row=0.010)
    conn, _ = connection(dp)
    x = rows(1)["x"]
    area_view(conn.area.buf, x.shape, x.dtype, 0)[...] = x  # the request's body, read into the area
    conn._on_message((REQ, 1, "m", "1", now(), request_fields(InferRequest(rows(1))),
                      [("x", x.dtype.str, x.shape, 0)], None))
    runner = dp.repository.slot("m").runner
    while not runner._executing_rows:  # its batch executes (10 ms)
        await asyncio.sleep(0.0005)
    conn.channel.connection_lost(None)
    await settle_loop()
    assert not conn.requests  # dropped at once...
    assert not conn.closed.is_set() and not conn.area.buf.closed  # ...while its batch still reads the area
    assert conn.leased == 1
    await asyncio.sleep(0.05)
    assert conn.closed.is_set() and conn.leased == 0
    assert counts(dp)["dropped"] == 1
    await dp.close()


def test_an_area_view_keeps_the_mapping_until_it_goes():
    """ipc.area_view holds the mapping's export: closing the area while a view lives leaves it mapped (the view
    stays readable); np.ndarray(buffer=mmap) would let it be unmapped under the view."""
    from batcher.ipc import Area

    area = Area(1 << 16)
    view = area_view(area.buf, (2, 4), np.float32, 4096)
    view[...] = 3.0
    area.close()  # BufferError inside: the mapping stays while the view lives
    assert not area.buf.closed and view.sum() == 24.0
    del view
    area.buf.close()
    assert area.buf.closed


async def test_an_abort_before_a_task_path_request_starts_still_ends_it():
    """REQ and ABORT in one frame for a request that takes the task path (here: server not ready): a task
    cancelled before its first step would never run its body (req.fail, the count) - the _Request would stay in
    conn.requests, its status count up, and on the front end's loss _close_when_idle would wait forever."""
    dp = await plane()
    dp.ready = False  # start_infer declines: the task path
    conn, transport = connection(dp)
    conn._on_message(req_message(1, InferRequest(rows(1)), now()))
    assert conn.requests[1].task is not None
    conn._on_message((ABORT, 1))  # same data_received
    await asyncio.sleep(0.05)
    assert not conn.requests, "the aborted request is never forgotten"
    assert conn.server.counts[0] == 0, "its status count (least_queue routing) leaks"
    conn.channel.connection_lost(None)
    await asyncio.wait_for(conn.closed.wait(), 1.0)  # the area is unmapped only then
    await dp.close()


async def test_abort_before_the_large_shm_output_write_task_starts_still_ends_the_request(segment):
    """An output > OFFLOAD_BYTES to a system region: Started._done starts the write in a task; an ABORT (or the
    front end's loss) read in that same iteration cancels the task before its first step. The request must still
    end: fail() called, Inflight left (else the SIGTERM drain waits its whole grace), the Hold released (else the
    region cannot be unmapped)."""
    n = 16_400  # y is n x 16 bytes > 256 KiB (no batch dim: any first dim)
    dp = await plane([{"name": "m", "max_batch_size": 0}], seconds_per_row=0.0, shared_memory={"system": True})
    seg = segment(n * 16)
    await dp.shm_register("system", "io", key=seg.name, offset=0, byte_size=n * 16)
    region = dp.shm._regions["io"]
    out = Outcome()
    request = InferRequest({"x": np.ones((n, 4), np.float32)}, outputs=[RequestedOutput("y", None, ShmRef("io", 0, n * 16))])
    started = dp.start_infer("m", None, now(), request, out.deliver, out.fail)
    assert started is not None
    # runs right after Started._done, in the same iteration: as an ABORT read from the socket then
    started._pending.future.add_done_callback(lambda _: started.cancel())
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(out.done), 2.0)
    write_task, inflight, users = started._task, dp._inflight.count, region.users
    await dp.close()
    assert write_task is not None and write_task.cancelled()  # the _write task was cancelled before it ran
    assert out.done.done(), f"fail() never called; Inflight {inflight}, region users {users}"
    assert out.done.result()[0] == "error" and inflight == 0 and users == 0


async def test_a_reply_that_cannot_be_pickled_still_answers_the_call():
    """A REPLY is pickled when sent (``checked``), so a value that cannot cross is answered REPLY(False, 500) by
    _call's except; dropped at the flush, the front end's EngineLink.call (no timeout) would wait forever. The same holds
    for a RESULT that cannot be pickled (logged and dropped: a bug of ours, never a client's data)."""
    dp = await plane()
    conn, transport = connection(dp)
    with pytest.raises(Exception):
        pickle.dumps(dp.repository_slots("m"))  # a value the method returns that cannot cross
    await conn._call(7, "repository_slots", ("m",), {})
    await settle_loop()
    assert [m for m in transport.messages if m[0] == REPLY and m[1] == 7], "no REPLY: the caller hangs"
    await dp.close()


async def test_a_req_whose_tensors_cannot_be_unpacked_is_answered_and_forgotten():
    """A REQ whose entries do not unpack (a front end's bug) is answered ERROR (500) and counted 'other', as when
    read() unpacked it in the task; it must not leave the _Request in conn.requests (status count up, lease
    held)."""
    dp = await plane()
    conn, transport = connection(dp)
    bad = (REQ, 1, "m", "1", now(), request_fields(InferRequest(rows(1))), [("x", "<f4", (1, 4), 1 << 40)], None)
    conn.channel.data_received(len(pickle.dumps([bad], protocol=5)).to_bytes(4, "little")
                               + pickle.dumps([bad], protocol=5))
    await settle_loop()
    (error,) = [m for m in transport.messages if m[1] == 1]
    assert error[0] == ERROR and error[2][0] == 500
    assert not conn.requests and conn.server.counts[0] == 0 and counts(dp)["other"] == 1
    await dp.close()


def test_signature_short_path_refuses_a_0d_input_with_invalid_input_as_the_full_check():
    """Inputs of shape [-1]: a 0-d array (KServe shape [] decodes to one) has shape[1:] == () == tail; the short
    path must not reach arr.shape[0] (IndexError: a 500) but leave it to the full check (InvalidInput, 400)."""
    sig = ModelSignature((TensorSpec("x", "FP32", (-1,)),), (TensorSpec("y", "FP32", (-1,)),), 8)
    with pytest.raises(InvalidInput):
        sig.check("m", {"x": np.array(1.0, np.float32)})
