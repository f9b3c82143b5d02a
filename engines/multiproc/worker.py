"""The worker side of the multiproc engine: the process that owns one execution context, attaches to the parent's
segments (never creates one) and runs the batches the parent sends."""

from __future__ import annotations

import os
from multiprocessing.connection import Client
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from ..base import EngineError, ExecutionContext


#: the key of the output segment among the worker's segments (no input is called this: it is not a name)
OUTPUT = ""


class Segments:
    """The worker's view of the parent's segments: each input's (opened by name, page-locked on CUDA) and the
    outputs' (``OUTPUT``, never page-locked); one is closed when the parent replaces it (it grew) or at exit."""

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
            if self.register and name != OUTPUT:
                from ..cuda import CAPTURE_GATE, HostRegistration

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


def worker_main(address: str, authkey: bytes, path: str, options: dict) -> None:
    from ..onnxruntime import OnnxRuntimeEngine

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
    segments = Segments(register=options.get("device") == "cuda")
    try:
        if ctx.executor is not None:  # the context's own thread: no hop per batch
            ctx.executor.submit(serve, conn, ctx, segments).result()
        else:
            serve(conn, ctx, segments)
    finally:
        segments.close()
        ctx.release()
        engine.release()


def serve(conn, ctx: ExecutionContext, segments: Segments) -> None:
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None or not run_one(conn, ctx, segments, msg):
            return


def run_one(conn, ctx: ExecutionContext, segments: Segments, msg: tuple) -> bool:
    """Execute one batch: inputs from the parent's segments (one per input), outputs into its output segment
    (asking for a larger one when they do not fit). False: the parent went away."""
    specs, out_name = msg
    inputs = {name: np.ndarray(shape, dtype=np.dtype(dt), buffer=segments.buffer(name, seg_name))
              for name, dt, shape, seg_name in specs}
    try:
        outputs = {k: np.ascontiguousarray(v) for k, v in ctx.execute(inputs).items()}
    except EngineError as exc:
        conn.send(("error", str(exc)))
        return True
    finally:
        del inputs
    need = sum(a.nbytes for a in outputs.values())
    out = segments.buffer(OUTPUT, out_name)
    if len(out) < need:
        conn.send(("grow", need))
        try:
            out = segments.buffer(OUTPUT, conn.recv())
        except EOFError:
            return False
    off, out_specs = 0, []
    for name, arr in outputs.items():
        np.ndarray(arr.shape, arr.dtype, buffer=out, offset=off)[...] = arr
        out_specs.append((name, arr.dtype.str, arr.shape, off))
        off += arr.nbytes
    conn.send(("ok", out_specs))
    return True
