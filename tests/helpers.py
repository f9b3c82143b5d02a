"""Helpers for tests: in-process ONNX Runtime reference runs of zoo models, request bodies for aiohttp from the
load toolkit's one KServe v2 request builder (:func:`bench.sweep.requests.build_request`), and waiting for a state
a server reports (:func:`until`, :func:`dispatched`, :func:`queued`), and programs outside Python that some tests
need (:func:`require_program`)."""

from __future__ import annotations

import asyncio
import functools
import http.client
import os
from collections.abc import Callable, Iterator
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import onnxruntime as ort
import pytest

from bench.string_models import string_models  # noqa: F401 - the tests' string models
from bench.sweep.requests import build_request
from engines.datatypes import from_numpy
from engines.zoo import resolve


def require_program(path: str | None, why: str, required_by: str) -> str:
    """``path`` of a program a test needs; without it (None) the test is skipped with ``why``, or fails where the
    environment variable ``required_by`` is ``1`` (CI installs the program and sets it, so that the test cannot pass
    by being skipped)."""
    if path is None:
        if os.environ.get(required_by) == "1":
            pytest.fail(f"{why} ({required_by}=1)")
        pytest.skip(why)
    return path


def http_post(server, body, headers: dict | None = None, path: str = "/v2/models/f2str/infer"):
    """POST ``body`` (bytes, or an iterable of bytes: sent chunked) with http.client; (status, body, headers)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    finally:
        conn.close()


@functools.lru_cache(maxsize=None)
def reference_session(zoo_name: str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(resolve(f"zoo:{zoo_name}")), opts, providers=["CPUExecutionProvider"])


def reference(zoo_name: str, x: np.ndarray) -> np.ndarray:
    """The model's first output for ``x``, run in-process (one call, whatever the batch)."""
    sess = reference_session(zoo_name)
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def infer_kwargs(x: np.ndarray, name: str = "input", *, binary: bool = True, **options) -> dict:
    """``session.post(url, **infer_kwargs(x))``: one input ``name`` holding ``x`` (its datatype from its dtype),
    binary tensors in and out by default; ``options``: ``timeout_us``, ``priority``, ``binary_output``."""
    body, headers = build_request([(name, from_numpy(x.dtype), x)], binary=binary, **options)
    return {"data": body, "headers": headers}


async def until(predicate, timeout_s: float = 120.0, poll_s: float = 0.005) -> None:
    """Wait until ``predicate()`` (run in a thread: it may query the server) is true: tests wait for the state the
    server reports (event ordering), never for a guessed time. ``timeout_s`` only stops a broken run."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not await asyncio.to_thread(predicate):
        assert loop.time() < end, f"timed out after {timeout_s} s waiting for {getattr(predicate, '__name__', '')}"
        await asyncio.sleep(poll_s)


def dispatched(server, model: str) -> int:
    """Requests of ``model`` (version 1) that have left its queue for a batch so far (the queue-time histogram's
    count: observed when a batch is formed)."""
    return int(server.metric("batcher_queue_duration_seconds_count", model=model, version="1"))


def queued(server, model: str) -> int:
    """Requests of ``model`` (version 1) waiting in its queue now."""
    return int(server.metric("batcher_queue_depth", model=model, version="1"))


def segment_factory(name: Callable[[int], str], min_size: int = 1,
                    create: type = SharedMemory) -> Iterator[Callable[[int], SharedMemory]]:
    """A fixture's body: yields ``make(size)``, a new POSIX segment named ``name(k)`` (k: 0, 1, ...) of at least
    ``min_size`` bytes; closes and unlinks every one made when the fixture ends."""
    made: list[SharedMemory] = []

    def make(size: int) -> SharedMemory:
        seg = create(name=name(len(made)), create=True, size=max(size, min_size))
        made.append(seg)
        return seg

    yield make
    for seg in made:
        seg.close()
        seg.unlink()
