"""Streams, events (timing) and CUDA graphs (capture once, launch many times).

Every object holds one CUDA handle and frees it in an idempotent ``destroy()``; none frees in ``__del__``
(freeing is the owner's business, in a known order). Handles are opaque: pass the object, or ``stream.ptr``
where a library wants the ``cudaStream_t`` as an integer (TensorRT's ``execute_async_v3``, ONNX Runtime's
``user_compute_stream``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .held import held
from .runtime import CudaError, check, runtime, take


class _Handle:
    """One CUDA handle (``self.handle``) that :meth:`destroy` frees exactly once with the subclass's ``_free``."""

    handle: Any = None

    def destroy(self) -> None:
        """Destroy the handle (CudaError if CUDA refuses; the handle is dropped all the same). Idempotent."""
        for handle in take(self, "handle"):
            self._free(handle)

    def _free(self, handle: Any) -> None:
        raise NotImplementedError


class Stream(_Handle):
    """A non-blocking CUDA stream (``cudaStreamCreateWithFlags(cudaStreamNonBlocking)``): it never serializes
    with the legacy default stream, so contexts on their own streams overlap.

    Raises (constructor):
        CudaError: CUDA refused (no device, out of resources) or cuda-python missing.
    """

    def __init__(self) -> None:
        cudart = runtime()
        self.handle: Any = check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking),
                                 "cudaStreamCreateWithFlags(cudaStreamNonBlocking)")

    @property
    def ptr(self) -> int:
        """The ``cudaStream_t`` as an integer."""
        return int(self.handle)

    def synchronize(self) -> None:
        """Block until all work queued on the stream has finished (``cudaStreamSynchronize``).

        Raises:
            CudaError: the stream is gone, or queued work failed (the error of the first failed operation).
        """
        check(runtime().cudaStreamSynchronize(self.handle), "cudaStreamSynchronize")

    def _free(self, handle: Any) -> None:  # queued work still completes
        check(runtime().cudaStreamDestroy(handle), "cudaStreamDestroy")


class Event(_Handle):
    """A CUDA event (``cudaEventCreateWithFlags``), to time work on a stream or wait for a point in it.

    Args:
        timing: record timestamps (``cudaEventDefault``); ``False``: ``cudaEventDisableTiming``, cheaper, for
            synchronization only (:meth:`elapsed_ms` then raises).
        blocking: ``cudaEventBlockingSync``: :meth:`synchronize` sleeps until the event completes instead of
            spinning on a core (CUDA's default on a machine with more cores than active contexts). The H200 measure
            of what that changes: ``server.cuda_blocking_sync``.

    Raises (constructor):
        CudaError: CUDA refused or cuda-python missing.
    """

    def __init__(self, timing: bool = True, blocking: bool = False) -> None:
        cudart = runtime()
        flags = int(cudart.cudaEventDefault if timing else cudart.cudaEventDisableTiming)
        if blocking:
            flags |= int(cudart.cudaEventBlockingSync)
        self.handle: Any = check(cudart.cudaEventCreateWithFlags(flags), f"cudaEventCreateWithFlags({int(flags)})")

    def record(self, stream: Stream) -> None:
        """Mark the current end of ``stream``'s queue (``cudaEventRecord``); the event completes when the work
        queued before it has run.

        Raises:
            CudaError: CUDA refused (destroyed event or stream).
        """
        calls = held()  # keeping the GIL (engines.cuda.held); refused there: again through the bindings, which raise
        if calls is not None and calls.event_record(int(self.handle), int(stream.handle)) == 0:
            return
        check(runtime().cudaEventRecord(self.handle, stream.handle), "cudaEventRecord")

    def synchronize(self) -> None:
        """Block until the event has completed (``cudaEventSynchronize``; at once if it was never recorded).

        Raises:
            CudaError: CUDA refused, or the work before the event failed.
        """
        check(runtime().cudaEventSynchronize(self.handle), "cudaEventSynchronize")

    def elapsed_ms(self, start: Event) -> float:
        """Milliseconds of device time from ``start`` to this event (``cudaEventElapsedTime``, resolution about
        0.5 us). Both must have been recorded and have completed (call :meth:`synchronize` first).

        Raises:
            CudaError: an event was not recorded (``cudaErrorInvalidResourceHandle``), has not completed
                (``cudaErrorNotReady``), or was created with ``timing=False``.
        """
        calls = held()
        if calls is not None:
            err, ms = calls.event_elapsed_ms(int(start.handle), int(self.handle))
            if err == 0:
                return float(ms)
        return float(check(runtime().cudaEventElapsedTime(start.handle, self.handle), "cudaEventElapsedTime"))

    def _free(self, handle: Any) -> None:
        check(runtime().cudaEventDestroy(handle), "cudaEventDestroy")


class Graph(_Handle):
    """An executable CUDA graph (``cudaGraphExec_t``) captured from a stream: one launch replays every operation
    the capture queued (same kernels, same addresses, same sizes) with a single CPU call.

    Made by :meth:`capture`. TensorRT documents capturing ``execute_async_v3`` after one ordinary (warm-up)
    enqueue with the same input shapes, and keeping one graph per input shape: a graph bakes in the shapes and
    the tensor addresses it was captured with, so shapes or buffers that change need another graph.
    """

    def __init__(self, exec_handle: Any) -> None:
        self.handle: Any = exec_handle

    @classmethod
    def capture(cls, stream: Stream, enqueue: Callable[[], None]) -> Graph:
        """Capture what ``enqueue()`` queues on ``stream`` and instantiate it.

        ``cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal)`` -> ``enqueue()`` ->
        ``cudaStreamEndCapture`` -> ``cudaGraphInstantiate(graph, 0)`` -> ``cudaGraphDestroy(graph)`` (the
        executable graph does not need it). Nothing runs during capture: work is only recorded. Thread-local
        mode: this thread may not call unsafe APIs (``cudaMalloc``, synchronizing) while capturing; other threads
        may.

        Raises:
            CudaError: a capture call failed, or the capture was invalidated (e.g. ``enqueue`` synchronized the
                stream); the stream has left capture mode and nothing is leaked.
            whatever ``enqueue`` raises, after capture mode was ended and its partial graph destroyed.
        """
        cudart = runtime()
        mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        check(cudart.cudaStreamBeginCapture(stream.handle, mode), "cudaStreamBeginCapture")
        try:
            enqueue()
        except BaseException:
            err, *rest = cudart.cudaStreamEndCapture(stream.handle)
            if err == cudart.cudaError_t.cudaSuccess and rest and rest[0] is not None:
                cudart.cudaGraphDestroy(rest[0])  # best effort: the original error matters more
            raise
        graph = check(cudart.cudaStreamEndCapture(stream.handle), "cudaStreamEndCapture")
        try:
            exec_handle = check(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        finally:
            check(cudart.cudaGraphDestroy(graph), "cudaGraphDestroy")
        return cls(exec_handle)

    def launch(self, stream: Stream) -> None:
        """Queue the whole graph on ``stream`` (``cudaGraphLaunch``); synchronize the stream to wait for it.

        Raises:
            CudaError: the graph was destroyed, or CUDA refused.
        """
        if self.handle is None:
            raise CudaError("cudaGraphLaunch on a destroyed graph")
        calls = held()
        if calls is not None and calls.graph_launch(int(self.handle), int(stream.handle)) == 0:
            return
        check(runtime().cudaGraphLaunch(self.handle, stream.handle), "cudaGraphLaunch")

    def _free(self, handle: Any) -> None:
        check(runtime().cudaGraphExecDestroy(handle), "cudaGraphExecDestroy")
