"""The process-wide capture gate: no CUDA work of this process runs while ONNX Runtime captures a CUDA graph.

Why: ONNX Runtime's CUDA execution provider captures its graphs with ``cudaStreamBeginCapture(stream,
cudaStreamCaptureModeGlobal)`` (``CUDAGraphManager::CaptureBegin`` in ``core/providers/cuda/cuda_graph.cc``, which
synchronizes the stream first). In Global mode CUDA forbids "potentially unsafe" calls - ``cudaMalloc``,
``cudaStreamSynchronize``, ``cudaFree``, synchronous copies - in EVERY thread of the process while the capture is
under way: the call fails with ``cudaErrorStreamCaptureUnsupported`` ("operation not permitted when stream is
capturing") and the capture is invalidated. That is what the H200 probe saw with 2-4 graph sessions as threads of
one process (``shared/design/gpu-probe.md``).

The rule: a capture holds the gate :meth:`CaptureGate.exclusive`; every other piece of CUDA work of the GPU
backends (creating sessions and buffers, executing a batch, freeing) holds it :meth:`CaptureGate.shared`. Shared
holders run side by side; a capture waits for them to finish and keeps new ones out (writer preference, so a
stream of batches cannot starve a capture). Captures happen only while contexts are created (a few runs per
allowed batch size), so serving pauses briefly when another model loads, never otherwise.

Not reentrant: never take :meth:`~CaptureGate.exclusive` while holding :meth:`~CaptureGate.shared` in the same
thread (it would wait for itself).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class CaptureGate:
    """A writer-preferring readers-writer lock: many :meth:`shared` holders, or one :meth:`exclusive` holder.

    Attributes (for tests and stats, read without the lock):
        captures: how many exclusive sections have been entered.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self.captures = 0

    def shared(self) -> contextlib.AbstractContextManager[None]:
        """Hold the gate for ordinary CUDA work (any number of threads at once)."""
        return self._hold(self._enter_shared, self._leave_shared)

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """Hold the gate alone, for a Global-mode graph capture: waits for every shared holder to leave."""
        return self._hold(self._enter_exclusive, self._leave_exclusive)

    @contextlib.contextmanager
    def _hold(self, enter: Callable[[], None], leave: Callable[[], None]) -> Iterator[None]:
        """The caller's block between ``enter()`` and ``leave()``, each run under the lock."""
        with self._cond:
            enter()
        try:
            yield
        finally:
            with self._cond:
                leave()

    def _enter_shared(self) -> None:
        self._cond.wait_for(lambda: not (self._writer or self._writers_waiting))
        self._readers += 1

    def _leave_shared(self) -> None:
        self._readers -= 1
        if self._readers == 0:
            self._cond.notify_all()

    def _enter_exclusive(self) -> None:
        self._writers_waiting += 1
        try:
            self._cond.wait_for(lambda: not (self._writer or self._readers))
        finally:
            self._writers_waiting -= 1
        self._writer = True
        self.captures += 1

    def _leave_exclusive(self) -> None:
        self._writer = False
        self._cond.notify_all()


#: The one gate of this process (CUDA's capture modes are per process, whatever the device).
CAPTURE_GATE = CaptureGate()
