"""The parent side of the multiproc engine: starting and supervising worker processes, one per execution
context (:mod:`engines.multiproc` says what is guaranteed)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from multiprocessing.connection import Listener, wait
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy as np

from ..base import Engine, EngineError, EngineUnavailable, ExecutionContext, TensorSpec
from .shm import MIN_INPUT_SEGMENT_BYTES, drop, new_segment, sweep_orphan_segments
from .worker import worker_main

log = logging.getLogger("engines.multiproc")

#: seconds to wait for a worker to load its model and connect back.
START_TIMEOUT_S = 120.0
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.1, 5.0


class WorkerCrashed(EngineUnavailable):
    """The worker process of an execution context died; the batch it ran is lost (the server answers 503)."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code}, {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


class _Worker:
    """One worker process and its connection. The socket directory lives only until the worker connected.

    Raises:
        WorkerCrashed: the worker died or did not connect/load within :data:`START_TIMEOUT_S`.
        EngineError: the worker could not load the model.
    """

    def __init__(self, path: str, options: dict) -> None:
        sockdir = tempfile.mkdtemp(prefix="batcher-worker-")
        self.process = None
        try:
            address = str(Path(sockdir) / "sock")
            authkey = uuid.uuid4().bytes
            listener = Listener(address, family="AF_UNIX", authkey=authkey)
            try:
                self.process = mp.get_context("spawn").Process(
                    target=worker_main, args=(address, authkey, path, options), daemon=True)
                self.process.start()
                sock = listener._listener._socket
                if sock not in wait([sock, self.process.sentinel], START_TIMEOUT_S):
                    self._kill()
                    raise WorkerCrashed(f"worker for {path} did not connect ({_describe_exit(self.process.exitcode)})")
                self.conn = listener.accept()
            finally:
                listener.close()  # removes the socket file
        except OSError as exc:
            self._kill()
            raise WorkerCrashed(f"worker for {path} did not start: {exc}") from None
        finally:
            shutil.rmtree(sockdir, ignore_errors=True)
        if self.conn not in wait([self.conn, self.process.sentinel], START_TIMEOUT_S):
            self._kill()
            raise WorkerCrashed(f"worker for {path} did not load the model within {START_TIMEOUT_S} s")
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            self._kill()
            raise WorkerCrashed(f"worker for {path} died while loading the model "
                                f"({_describe_exit(self.process.exitcode)})") from None
        if kind != "ready":
            self._kill()
            raise EngineError(f"worker could not load {path}: {payload}")
        self.info = payload
        self.pid: int = payload["pid"]

    def _kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
        if getattr(self, "conn", None) is not None:
            self.conn.close()

    def dead(self) -> bool:
        return self.process.exitcode is not None

    def reap(self) -> int | None:
        """After its death: wait for the process (no zombie), close the connection; returns its exit code."""
        self.process.join(5)
        self.conn.close()
        return self.process.exitcode

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


class MultiprocContext(ExecutionContext):
    """An execution context in its own worker process, watched by a thread and restarted after a death (with
    backoff). Segments (inputs, outputs) belong to this context, in the parent, and outlive its workers."""

    def __init__(self, owner: MultiprocEngine, worker: _Worker) -> None:
        self._owner = owner
        self._lock = threading.Lock()  # the worker, its connection and the segments: one user at a time
        self._worker: _Worker | None = worker
        self._info = worker.info
        self._segments: dict[str, SharedMemory] = {}  # input name -> its segment
        self._out: SharedMemory | None = None
        self._crashes = 0
        self._next_start = 0.0
        self._closed = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._watcher = threading.Thread(target=self._watch, name=f"watch-{owner.label}", daemon=True)
        self._watcher.start()

    def _reported(self, key: str) -> Any:
        """What the live worker reported when it started (None while there is none)."""
        worker = self._worker
        return worker.info[key] if worker is not None else None

    @property
    def pid(self) -> int | None:
        return self._reported("pid")

    @property
    def nbytes(self) -> int:
        return self._reported("context_bytes") or 0

    @property
    def device_nbytes(self) -> int:
        return self._reported("device_bytes") or 0

    @property
    def batch_sizes(self) -> tuple[int, ...] | None:
        return self._info["batch_sizes"]

    def describe(self) -> dict[str, Any]:
        return {**self._info["describe"], "process": "worker"}

    # ------------------------------------------------------------------ supervision
    def _watch(self) -> None:
        """Notice a death while idle (the process sentinel) and restart the worker after the backoff."""
        while not self._closed.is_set():
            worker = self._worker
            if worker is None:
                if self._closed.wait(max(0.0, self._next_start - time.monotonic())):
                    return
                with self._lock:
                    if not self._closed.is_set():
                        try:
                            self._ensure_worker()
                        except EngineError:
                            pass  # logged; retried after the next backoff
                continue
            ready = wait([worker.process.sentinel, self._wake_r])
            if self._wake_r in ready:
                return
            with self._lock:
                if self._worker is worker:  # not already handled by execute()
                    self._lost(worker, "while idle")

    def _lost(self, worker: _Worker, when: str) -> WorkerCrashed:
        """Its worker died (caller holds the lock): reap it, log it once, schedule the restart."""
        self._worker = None
        code = worker.reap()
        backoff = self._backoff()
        msg = (f"worker process {worker.pid} of model {self._owner.label} died {when} ({_describe_exit(code)}); "
               f"restarting it in {backoff:.1f} s")
        log.warning("%s", msg)
        return WorkerCrashed(msg)

    def _backoff(self) -> float:
        self._crashes += 1
        backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self._crashes - 1))
        self._next_start = time.monotonic() + backoff
        return backoff

    def _ensure_worker(self) -> _Worker:
        """The live worker; starts one after the backoff if there is none (caller holds the lock)."""
        if self._worker is None:
            delay = self._next_start - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                self._worker = self._owner._start_worker()
                self._info = self._worker.info
            except EngineError as exc:
                log.warning("model %s: worker restart failed (%s); next attempt in %.1f s", self._owner.label, exc,
                            self._backoff())
                raise
            self._owner._restarted()
        return self._worker

    # ------------------------------------------------------------------ execution
    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            if self._closed.is_set():
                raise EngineError("execution context was released")
            for _ in range(2):
                worker = self._ensure_worker()
                if worker.dead():  # died idle, before the watcher noticed: the batch has not been handed over
                    self._lost(worker, "while idle")
                    continue
                msg = self._stage(inputs)
                try:
                    worker.conn.send(msg)
                except OSError:  # died just before: the batch never ran; run it on the next worker
                    self._lost(worker, "while idle")
                    continue
                try:
                    return self._collect(worker)
                except (EOFError, OSError):
                    raise self._lost(worker, "while running a batch") from None
            raise WorkerCrashed(f"worker process of model {self._owner.label} keeps dying")

    def _segment(self, name: str, nbytes: int) -> SharedMemory:
        """Input ``name``'s segment, replaced by a larger one when it cannot hold ``nbytes``."""
        seg = self._segments.get(name)
        if seg is None or seg.size < nbytes:
            seg = self._segments[name] = new_segment(seg, nbytes, MIN_INPUT_SEGMENT_BYTES)
        return seg

    def host_buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """A view of input ``name``'s shared-memory segment: a batch stacked into it crosses to the worker without
        another copy (and, on CUDA, reaches the device straight from it). ``None`` for an unknown input."""
        if name not in {spec.name for spec in self._info["inputs"]}:
            return None
        dtype = np.dtype(dtype)
        return np.ndarray(shape, dtype, buffer=self._segment(name, int(np.prod(shape)) * dtype.itemsize).buf)

    def _stage(self, inputs: Mapping[str, np.ndarray]) -> tuple[list[tuple], str]:
        """Inputs into their segments (unless stacked there already); the message for the worker."""
        specs = []
        for name, arr in inputs.items():
            seg = self._segment(name, arr.nbytes)
            view = np.ndarray(arr.shape, arr.dtype, buffer=seg.buf)
            if view.ctypes.data != arr.ctypes.data:  # not stacked into the segment by host_buffer
                view[...] = arr
            specs.append((name, arr.dtype.str, arr.shape, seg.name))
        if self._out is None:
            self._out = new_segment(None, 0)
        return specs, self._out.name

    def _collect(self, worker: _Worker) -> dict[str, np.ndarray]:
        reply = worker.conn.recv()
        if reply[0] == "grow":
            self._out = new_segment(self._out, reply[1])
            worker.conn.send(self._out.name)
            reply = worker.conn.recv()
        if reply[0] == "error":
            raise EngineError(reply[1])
        self._crashes = 0
        buf = self._out.buf
        return {name: np.ndarray(shape, np.dtype(dt), buffer=buf, offset=o).copy() for name, dt, shape, o in reply[1]}

    def release(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        os.write(self._wake_w, b"x")
        self._watcher.join()
        with self._lock:
            if self._worker is not None:
                self._worker.stop()
                self._worker = None
            for seg in [*self._segments.values(), *([self._out] if self._out is not None else [])]:
                drop(seg)
            self._segments.clear()
            self._out = None
        os.close(self._wake_r)
        os.close(self._wake_w)


class MultiprocEngine(Engine):
    """ONNX Runtime contexts in worker processes (``mode: multiproc``).

    Args:
        path: the model file; options: keyword arguments of :class:`engines.onnxruntime.OnnxRuntimeEngine`.
        on_restart: called (from the context's thread or its watcher) each time a dead worker is replaced.
        label: the model's name in log lines (default: the file name).

    Raises:
        EngineError: the first worker could not load the model.
    """

    backend = "onnxruntime"
    _swept = False

    def __init__(self, path: str | os.PathLike[str], *, on_restart: Callable[[], None] | None = None,
                 label: str | None = None, **options: Any) -> None:
        self.path = Path(path)
        self.label = label or self.path.name
        self._options = options
        self.on_restart = on_restart
        if not MultiprocEngine._swept:  # once per process: segments of servers that died with their tracker
            MultiprocEngine._swept = True
            for name in sweep_orphan_segments():
                log.info("removed shared-memory segment %s of a server that is gone", name)
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
