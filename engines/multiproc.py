"""Crash isolation: an engine whose execution contexts each live in a supervised worker process.

The parent talks to each worker over a Unix domain socket (``multiprocessing.connection``, family AF_UNIX) and
passes tensors through shared memory (``multiprocessing.shared_memory``): per call, only shapes, dtypes and
segment names cross the socket. Each input has its own segment, grown on demand; :meth:`MultiprocContext.host_buffer`
hands out views of it, so a caller stacks a batch straight into shared memory. On CUDA the worker page-locks each
input segment (``cudaHostRegister``), so its context copies host-to-device straight from shared memory: one host
copy per batch in all (into the segment). The worker runs its batches on the context's own thread where it has
one (a CUDA-graph context, :attr:`ExecutionContext.executor`). Each segment is unlinked by the process that created it (workers share the
server's resource tracker, which reports any segment left behind). A worker that dies (a crash, ``kill -9``) fails the batch it was running with
:class:`WorkerCrashed`; the next batch on that context starts a new worker, after a backoff that doubles from
0.1 s up to 5 s while workers keep dying. The worker runs another backend (ONNX Runtime here) in its own process,
so a crash in native code, a leak or a stuck GIL stays there.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from multiprocessing.connection import Client, Listener
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy as np

from .base import Engine, EngineError, EngineUnavailable, ExecutionContext, TensorSpec

#: seconds to wait for a worker to load its model and connect back.
START_TIMEOUT_S = 120.0
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.1, 5.0


class WorkerCrashed(EngineUnavailable):
    """The worker process of an execution context died; the batch it ran is lost (the server answers 503)."""


# --------------------------------------------------------------------------- worker side
class _Segments:
    """The worker's view of the parent's input segments: opened by name, page-locked on CUDA, closed when the
    parent replaces one (it grew) or at exit."""

    def __init__(self, register: bool) -> None:
        self.register = register
        self.by_input: dict[str, tuple[str, SharedMemory, Any]] = {}  # input -> (segment name, segment, registration)

    def buffer(self, name: str, seg_name: str) -> memoryview:
        held = self.by_input.get(name)
        if held is None or held[0] != seg_name:
            if held is not None:
                self._close(held)
            seg = SharedMemory(name=seg_name)
            reg = None
            if self.register:
                from .cuda import CAPTURE_GATE, HostRegistration

                with CAPTURE_GATE.shared():
                    reg = HostRegistration(np.frombuffer(seg.buf, np.uint8).ctypes.data, seg.size)
            held = self.by_input[name] = (seg_name, seg, reg)
        return held[1].buf

    @staticmethod
    def _close(held: tuple[str, SharedMemory, Any]) -> None:
        if held[2] is not None:
            held[2].unregister()
        held[1].close()

    def close(self) -> None:
        for held in self.by_input.values():
            self._close(held)
        self.by_input.clear()


def _worker_main(address: str, authkey: bytes, path: str, options: dict) -> None:
    from .onnxruntime import OnnxRuntimeEngine

    conn = Client(address, family="AF_UNIX", authkey=authkey)
    try:
        engine = OnnxRuntimeEngine(path, **options)
        ctx = engine.create_context()
    except Exception as exc:  # report the load failure, then exit
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", {"inputs": engine.inputs, "outputs": engine.outputs, "max_batch_size": engine.max_batch_size,
                         "engine_bytes": engine.nbytes, "context_bytes": ctx.nbytes,
                         "device_bytes": ctx.device_nbytes, "batch_sizes": ctx.batch_sizes,
                         "describe": ctx.describe(), "pid": os.getpid()}))
    segments = _Segments(register=options.get("device") == "cuda")
    try:
        if ctx.executor is not None:  # the context's own thread: no hop per batch
            ctx.executor.submit(_serve, conn, ctx, segments).result()
        else:
            _serve(conn, ctx, segments)
    finally:
        segments.close()
        ctx.release()
        engine.release()


def _serve(conn, ctx: ExecutionContext, segments: _Segments) -> None:
    out_shm: SharedMemory | None = None
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg is None:
                return
            out_shm = _run_one(conn, ctx, segments, out_shm, msg)
    finally:
        if out_shm is not None:
            out_shm.close()
            out_shm.unlink()


def _run_one(conn, ctx: ExecutionContext, segments: _Segments, out_shm: SharedMemory | None,
             msg: list) -> SharedMemory | None:
    """Execute one batch: inputs from the parent's segments (one per input), outputs into this worker's segment."""
    inputs = {name: np.ndarray(shape, dtype=np.dtype(dt), buffer=segments.buffer(name, seg_name))
              for name, dt, shape, seg_name in msg}
    try:
        outputs = ctx.execute(inputs)
    except EngineError as exc:
        conn.send(("error", str(exc)))
        return out_shm
    need = sum(a.nbytes for a in outputs.values())
    if out_shm is None or out_shm.size < need:
        if out_shm is not None:
            out_shm.close()
            out_shm.unlink()
        out_shm = SharedMemory(create=True, size=max(need, 1 << 20))
    off, out_specs = 0, []
    for name, arr in outputs.items():
        arr = np.ascontiguousarray(arr)
        np.ndarray(arr.shape, arr.dtype, buffer=out_shm.buf, offset=off)[...] = arr
        out_specs.append((name, arr.dtype.str, arr.shape, off))
        off += arr.nbytes
    conn.send(("ok", out_shm.name, out_specs))
    return out_shm


# --------------------------------------------------------------------------- parent side
def _drop(seg: SharedMemory) -> None:
    """Unlink a segment this process created; its mapping goes when the last view of it does (a caller may still
    hold a :meth:`MultiprocContext.host_buffer` view)."""
    try:
        seg.close()
    except BufferError:
        pass
    seg.unlink()

class _Worker:
    """One worker process and its connection."""

    def __init__(self, path: str, options: dict) -> None:
        self._dir = tempfile.mkdtemp(prefix="batcher-worker-")
        address = str(Path(self._dir) / "sock")
        authkey = uuid.uuid4().bytes
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self.process = mp.get_context("spawn").Process(
            target=_worker_main, args=(address, authkey, path, options), daemon=True)
        self.process.start()
        listener._listener._socket.settimeout(START_TIMEOUT_S)  # bounded wait for the worker to connect
        try:
            self.conn = listener.accept()
        except OSError as exc:
            self.process.kill()
            raise WorkerCrashed(f"worker for {path} did not start: {exc}") from None
        finally:
            listener.close()
        if not self.conn.poll(START_TIMEOUT_S):
            self.process.kill()
            raise WorkerCrashed(f"worker for {path} did not load the model within {START_TIMEOUT_S} s")
        kind, payload = self.conn.recv()
        if kind != "ready":
            self.process.join(5)
            raise EngineError(f"worker could not load {path}: {payload}")
        self.info = payload
        self.pid = payload["pid"]

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()
        try:
            os.rmdir(self._dir)
        except OSError:
            pass


class MultiprocContext(ExecutionContext):
    """An execution context in its own worker process; restarted after a crash (with backoff)."""

    def __init__(self, owner: MultiprocEngine, worker: _Worker) -> None:
        self._owner = owner
        self._worker: _Worker | None = worker
        self._segments: dict[str, SharedMemory] = {}  # input name -> its segment
        self._crashes = 0
        self._next_start = 0.0
        self._info = worker.info

    @property
    def pid(self) -> int | None:
        return self._worker.pid if self._worker is not None else None

    @property
    def nbytes(self) -> int:
        return self._worker.info["context_bytes"] if self._worker is not None else 0

    @property
    def device_nbytes(self) -> int:
        return self._worker.info["device_bytes"] if self._worker is not None else 0

    @property
    def batch_sizes(self) -> tuple[int, ...] | None:
        return self._info["batch_sizes"]

    def describe(self) -> dict[str, Any]:
        return {**self._info["describe"], "process": "worker"}

    def _segment(self, name: str, nbytes: int) -> SharedMemory:
        """Input ``name``'s segment, replaced by a larger one when it cannot hold ``nbytes``."""
        seg = self._segments.get(name)
        if seg is None or seg.size < nbytes:
            if seg is not None:
                _drop(seg)
            seg = self._segments[name] = SharedMemory(create=True, size=max(nbytes, 1 << 16))
        return seg

    def host_buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """A view of input ``name``'s shared-memory segment: a batch stacked into it crosses to the worker without
        another copy (and, on CUDA, reaches the device straight from it). ``None`` for an unknown input."""
        if name not in {spec.name for spec in self._info["inputs"]}:
            return None
        dtype = np.dtype(dtype)
        return np.ndarray(shape, dtype, buffer=self._segment(name, int(np.prod(shape)) * dtype.itemsize).buf)

    def _ensure_worker(self) -> _Worker:
        if self._worker is None:
            delay = self._next_start - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self._worker = self._owner._start_worker()
            self._info = self._worker.info
            self._owner._restarted()
        return self._worker

    def _crashed(self, what: str) -> WorkerCrashed:
        worker, self._worker = self._worker, None
        code = None
        if worker is not None:
            worker.process.join(1)
            code = worker.process.exitcode
            worker.conn.close()
        self._crashes += 1
        backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self._crashes - 1))
        self._next_start = time.monotonic() + backoff
        return WorkerCrashed(f"worker process of model {self._owner.path.name} died ({what}, exit code {code}); "
                             f"restarting it in {backoff:.1f} s")

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        worker = self._ensure_worker()
        specs = []
        for name, arr in inputs.items():
            seg = self._segment(name, arr.nbytes)
            view = np.ndarray(arr.shape, arr.dtype, buffer=seg.buf)
            if view.ctypes.data != arr.ctypes.data:  # not stacked into the segment by host_buffer
                view[...] = arr
            specs.append((name, arr.dtype.str, arr.shape, seg.name))
        try:
            worker.conn.send(specs)
            reply = worker.conn.recv()
        except (EOFError, OSError) as exc:
            raise self._crashed(type(exc).__name__) from None
        if reply[0] == "error":
            raise EngineError(reply[1])
        self._crashes = 0
        _, out_name, out_specs = reply
        out_shm = SharedMemory(name=out_name)
        try:
            return {name: np.ndarray(shape, np.dtype(dt), buffer=out_shm.buf, offset=o).copy()
                    for name, dt, shape, o in out_specs}
        finally:
            out_shm.close()

    def release(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        for seg in self._segments.values():
            _drop(seg)
        self._segments.clear()


class MultiprocEngine(Engine):
    """ONNX Runtime contexts in worker processes (``mode: multiproc``).

    Args:
        path: the model file; options: keyword arguments of :class:`engines.onnxruntime.OnnxRuntimeEngine`.
        on_restart: called (from the context's thread) each time a crashed worker is replaced.

    Raises:
        EngineError: the first worker could not load the model.
    """

    backend = "onnxruntime"

    def __init__(self, path: str | os.PathLike[str], *, on_restart: Callable[[], None] | None = None,
                 **options: Any) -> None:
        self.path = Path(path)
        self._options = options
        self.on_restart = on_restart
        self._lock = threading.Lock()
        self._spare: _Worker | None = self._start_worker()
        info = self._spare.info
        self._inputs: tuple[TensorSpec, ...] = tuple(info["inputs"])
        self._outputs: tuple[TensorSpec, ...] = tuple(info["outputs"])
        self._max = info["max_batch_size"]
        self._nbytes = info["engine_bytes"]
        self._contexts: list[MultiprocContext] = []

    def _start_worker(self) -> _Worker:
        return _Worker(str(self.path), self._options)

    def _restarted(self) -> None:
        if self.on_restart is not None:
            self.on_restart()

    @property
    def max_batch_size(self) -> int | None:
        return self._max

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def create_context(self) -> MultiprocContext:
        with self._lock:
            worker, self._spare = self._spare, None
        ctx = MultiprocContext(self, worker or self._start_worker())
        self._contexts.append(ctx)
        return ctx

    def release(self) -> None:
        for ctx in self._contexts:
            ctx.release()
        self._contexts.clear()
        if self._spare is not None:
            self._spare.stop()
            self._spare = None
