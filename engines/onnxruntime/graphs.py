"""ONNX Runtime CUDA contexts with one CUDA graph per allowed batch size.

One session per context (``enable_cuda_graph: 1``), one ``gpu_graph_id`` per allowed size, all captured while the
context is created. Fixed buffers: per input a pinned staging buffer and a device buffer, per output a device
buffer and a pinned buffer, each sized for the largest allowed batch and bound once per size with IOBinding
(a graph replays the addresses it was captured with). One batch of ``n`` rows (``n`` one of the allowed sizes):
H2D of ``n`` rows on the context's stream (straight from page-locked memory, else after one copy into the pinned
buffer) -> replay of graph ``n`` on the same stream -> D2H of the outputs into pinned memory -> an event recorded
(:meth:`CudaGraphContext.launch` returns here) -> ONE wait, for that event -> owned copies of the outputs
(:meth:`CudaGraphContext.collect`). Nothing is allocated per batch (the IOBindings and run options of every size are
made once), and ``OrtValue.update_inplace`` is never used (it synchronizes the legacy default stream).

Two batches may be on the device at once (:attr:`CudaGraphContext.pipeline_depth`): the next one is launched
behind the running one on the same stream, so the device starts it the moment the first ends instead of waiting
for the host to see that and send it (each CUDA call of the host thread waits for the GIL behind a busy event
loop). Stream order keeps them apart: the second's H2D into the one device buffer per input runs after the
first's D2H out of the one device buffer per output. Each has its own pinned output buffers and event (output
slots 0 and 1), so collecting the first reads what its own D2H wrote.

Why a thread per context. What ONNX Runtime's source says (``core/providers/cuda/cuda_execution_provider.h`` and
``cuda_graph.cc``; checked against 1.18+ with per-id run counts, PR #19856):

* the captured graphs live in the provider's ``PerThreadContext`` (``cuda_graph_`` "is put under
  PerThreadContext"; ``Replay`` "CUDA EP maintains a separate cuda graph per thread");
* a ``gpu_graph_id`` is captured on that thread's first ``run`` with the id: ONNX Runtime runs it
  ``min_num_runs_before_cuda_graph_capture_`` (2) times normally, then captures, then replays - recursively,
  within the one call;
* capture is ``cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal)`` after a ``cudaStreamSynchronize``.

So a graph captured on the loader's thread is not found on the executor's thread: its first batch of each size
captures again, in Global mode, while other contexts of the process are synchronizing their streams - the H200
probe's "operation not permitted when stream is capturing" with 2-4 contexts on threads. Here each context owns
one thread (:attr:`executor`) that creates the session, captures every size and runs every batch, so no capture
ever happens after creation; and each capture holds :data:`engines.cuda.CAPTURE_GATE` exclusively, so a context
created while others serve (another model's load, an lru reload) cannot collide with their batches.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from ..base import DeviceTimes, EngineError, RowParts
from ..cuda import CAPTURE_GATE, CudaError, Event, PinnedBuffer, Stream, page_locked, set_device
from . import cuda as _cuda
from .cuda import CudaContext, CudaPlan, check_rows
from .options import run_options

log = logging.getLogger("engines.onnxruntime")

T = TypeVar("T")


class DeviceThread:
    """One thread that runs everything of one context: :meth:`call` runs a function there and returns its result
    (directly when already on it)."""

    def __init__(self, name: str) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.ident = self.pool.submit(threading.get_ident).result()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        if threading.get_ident() == self.ident:
            return fn(*args)
        return self.pool.submit(fn, *args).result()

    def stop(self) -> None:
        self.pool.shutdown(wait=threading.get_ident() != self.ident)


class CudaGraphContext(CudaContext):
    """A CUDA session with a CUDA graph per allowed batch size (see the module docstring).

    Args:
        plan: the session's model, device and options; every input and output must have static non-batch dims.
        batch_sizes: the allowed sizes, increasing; each gets its graph.

    Raises (constructor):
        EngineError: the session cannot be created with graphs (a node outside the CUDA provider, control flow), a
            capture failed (a kernel that synchronizes), or dims are dynamic; everything made so far is freed.
    """

    execution = "cuda_graphs"

    def __init__(self, plan: CudaPlan, batch_sizes: tuple[int, ...]) -> None:
        if plan.static_shapes(1) is None:
            raise EngineError("CUDA graphs need static non-batch dims on every input and output: "
                              + ", ".join(f"{s.name} {list(s.shape)}" for s in plan.inputs + plan.outputs))
        super().__init__(plan, tuple(batch_sizes))
        self._dtypes = {s.name: plan.dtype(s.name) for s in plan.inputs + plan.outputs}
        # staging slots 1 .. staging_slots - 1 (host_buffer(..., slot=k)), one pinned buffer per input each
        self._spare: list[dict[str, PinnedBuffer]] = [{} for _ in range(self.staging_slots - 1)]
        # output slots (:attr:`pipeline_depth`): slot 0's pinned output buffers are ``_buffers.pinned``, the
        # others' ``_out_spare``; one event per slot marks the end of its batch's D2H
        self._out_spare: list[dict[str, PinnedBuffer]] = [{} for _ in range(self.pipeline_depth - 1)]
        self._events: list[Event] = []
        self._free_slots: list[int] = list(range(self.pipeline_depth))
        self._generation = [0] * self.pipeline_depth  # launches per slot: a handle names its launch
        # device timing (:meth:`device_times`): a ring of pipeline_depth + 1 (start, end) timing event pairs, one
        # pair per launch in turn, so the previous launch's end is still unrecorded-over when a batch is collected
        self._timers: list[tuple[Event, Event]] = []
        self._launches = 0  # successful launches: the ring index of the next is launches % len(ring)
        self._timer_of = [0] * self.pipeline_depth  # per output slot: the launch number its batch had
        self._last_times: DeviceTimes | None = None
        self._first_timed = 0  # the first launch after the captures: no idle time (the gap since creation)
        self._session: Any = None
        self._bindings: dict[int, Any] = {}
        self._run_options: dict[int, Any] = {}
        self._thread = DeviceThread(f"cuda-graphs-{plan.path.stem}")
        self._measure_build(self._thread.call)

    # ---- creation, on the context's thread

    def _build(self) -> None:
        plan = self._plan
        set_device(plan.device_id)
        with CAPTURE_GATE.shared():
            self._stream = Stream()
            for name, shape in (plan.static_shapes(self._sizes[-1]) or {}).items():
                nbytes = int(np.prod(shape)) * self._dtypes[name].itemsize
                self._buffers.ensure(name, nbytes)
                if name not in self._output_names:  # staging slots 1 and up: the next batches are stacked there
                    for spare in self._spare:
                        spare[name] = PinnedBuffer(nbytes)
                else:  # output slot 1: the D2H of a batch launched behind another
                    for spare in self._out_spare:
                        spare[name] = PinnedBuffer(nbytes)
            for _ in range(self.pipeline_depth):
                # one by one: _free destroys those made
                self._events.append(Event(timing=False, blocking=self.blocking_sync))
            for _ in range(self.pipeline_depth + 1 if self.device_timing else 0):
                start = Event()
                try:
                    self._timers.append((start, Event()))
                except BaseException:
                    start.destroy()
                    raise
            self._session = plan.session(self._stream, graphs=True)
            for size in self._sizes:
                self._bindings[size] = self._bind(size)
                self._run_options[size] = run_options(graph_id=size)
        for size in self._sizes:
            zeros = {s.name: np.zeros((size, *s.shape[1:]), self._dtypes[s.name]) for s in plan.inputs}
            with CAPTURE_GATE.exclusive():  # ONNX Runtime captures in Global mode: nothing else may touch CUDA
                try:
                    self._run(size, zeros)
                except EngineError as exc:
                    raise EngineError(f"CUDA graph capture at batch {size} failed: {exc}") from exc
        self._last_times = None  # the captures are not batches, and the first batch's idle time is not counted
        self._first_timed = self._launches
        log.info("%s: CUDA graphs captured for batch sizes %s (%s, device %d)", plan.path.name, list(self._sizes),
                 plan.precision, plan.device_id)

    def _bind(self, size: int) -> Any:
        """An IOBinding of every input and output to its device buffer at ``size`` rows (made once per size)."""
        binding = self._session.io_binding()
        for spec in self._plan.inputs:
            binding.bind_input(spec.name, _cuda.ORT_DEVICE, self._plan.device_id, self._dtypes[spec.name],
                               [size, *spec.shape[1:]], self._buffers.device[spec.name].ptr)
        for spec in self._plan.outputs:
            binding.bind_output(spec.name, _cuda.ORT_DEVICE, self._plan.device_id, self._dtypes[spec.name],
                                [size, *spec.shape[1:]], self._buffers.device[spec.name].ptr)
        return binding

    # ---- one batch

    def _run(self, n: int, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch, launched and waited for; on the context's thread, the capture gate held by the caller."""
        return self._wait(self._enqueue(n, inputs))

    def _enqueue(self, n: int, inputs: Mapping[str, np.ndarray]) -> tuple[int, int, int]:
        """H2D, replay (or, the first time, capture) graph ``n``, D2H into a free output slot, its event recorded;
        returns ``(n, slot, generation)`` for :meth:`_wait`. On the context's thread, the capture gate held by the
        caller. An input that must be copied into the pinned staging buffer 0 first (not page-locked) waits until
        the batches launched before it are done: one of them may be reading that buffer.

        Raises:
            EngineError: both output slots are in use, or CUDA/ONNX Runtime refused (the slot is free again, once
                what this batch had queued has run)."""
        stream = self._stream
        assert stream is not None
        if not self._free_slots:
            raise EngineError(f"{self.pipeline_depth} batches launched and not collected")
        slot = self._free_slots.pop(0)
        pinned = self._out_buffers(slot)
        queued = False
        try:
            if len(self._free_slots) < self.pipeline_depth - 1 and any(
                    not isinstance(arr, RowParts) and self._buffers.needs_copy(name, arr)
                    for name, arr in inputs.items()):
                stream.synchronize()
            launch = self._launches
            if self._timers:
                self._timers[launch % len(self._timers)][0].record(stream)
            for name, arr in inputs.items():
                queued = True
                if isinstance(arr, RowParts):
                    self._buffers.upload_parts(name, arr, stream)
                else:
                    self._buffers.upload(name, arr, stream)
            self._launch(n)
            for spec in self._plan.outputs:
                nbytes = n * int(np.prod(spec.shape[1:])) * self._dtypes[spec.name].itemsize
                self._buffers.device[spec.name].copy_to_host_async(pinned[spec.name].ptr, nbytes, stream,
                                                                   repr(spec.name), locked=True)
            if self._timers:
                self._timers[launch % len(self._timers)][1].record(stream)
            self._events[slot].record(stream)
        except Exception as exc:
            if queued:  # its copies may still read the inputs, or write the slot: let them run first
                try:
                    stream.synchronize()
                except Exception as failed:
                    log.debug("synchronizing after a failed launch failed too: %r", failed)
            self._free_slots.insert(0, slot)
            if isinstance(exc, EngineError):
                raise
            raise EngineError(f"onnxruntime (cuda graphs): {exc}") from exc  # onnxruntime's own exception types
        self._generation[slot] += 1
        self._timer_of[slot] = launch
        self._launches = launch + 1
        return n, slot, self._generation[slot]

    def _wait(self, launched: tuple[int, int, int]) -> dict[str, np.ndarray]:
        """Wait for a launched batch's event, then owned copies of its outputs; its output slot is free again.

        Raises:
            EngineError: the batch failed on the device (CUDA's error), or the handle is not that of a batch
                launched and not yet collected."""
        n, slot, generation = launched
        if (not 0 <= slot < self.pipeline_depth or slot in self._free_slots
                or self._generation[slot] != generation):
            raise EngineError(f"output slot {slot} holds no launched batch of this handle")
        pinned = self._out_buffers(slot)
        try:
            self._events[slot].synchronize()
            self._last_times = self._time(self._timer_of[slot]) if self._timers else None
            return {spec.name: np.array(pinned[spec.name].view((n, *spec.shape[1:]), self._dtypes[spec.name]),
                                        copy=True) for spec in self._plan.outputs}
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"onnxruntime (cuda graphs): {exc}") from exc
        finally:
            self._free_slots.append(slot)

    def _time(self, launch: int) -> DeviceTimes | None:
        """The device times of launch number ``launch``, once its batch has completed: busy from its start event to
        its end event, idle from the previous launch's end event to its start (stream order: the previous launch is
        complete, and its pair is recorded over only ``len(ring)`` launches later, after this one is collected).
        None (logged at debug) when CUDA refuses, which never fails the batch."""
        ring = self._timers
        start, end = ring[launch % len(ring)]
        try:
            busy = end.elapsed_ms(start) / 1e3
            idle = (max(0.0, start.elapsed_ms(ring[(launch - 1) % len(ring)][1]) / 1e3)
                    if launch > self._first_timed else None)
        except CudaError as exc:
            log.debug("device timing of launch %d failed: %s", launch, exc)
            return None
        return DeviceTimes(busy, idle)

    def device_times(self) -> DeviceTimes | None:
        """The device time of the batch last collected (or executed) and the stream's idle time before it
        (:class:`~engines.base.DeviceTimes`; :attr:`device_timing`); on the context's thread."""
        return self._last_times

    def _out_buffers(self, slot: int) -> dict[str, PinnedBuffer]:
        """Output slot ``slot``'s pinned buffers, by output name."""
        return self._buffers.pinned if slot == 0 else self._out_spare[slot - 1]

    def _launch(self, n: int) -> None:
        """Queue graph ``n`` on the context's stream (ONNX Runtime replays it on ``user_compute_stream``)."""
        self._session.run_with_iobinding(self._bindings[n], self._run_options[n])

    def _checked(self, inputs: Mapping[str, np.ndarray]) -> int:
        """The batch's rows, once the inputs are exactly what the graphs take.

        Raises:
            EngineError: released, other input names, rows not an allowed size, another dtype or non-batch dims."""
        if self._session is None:
            raise EngineError("execution context was released")
        names = {s.name for s in self._plan.inputs}
        if set(inputs) != names:
            raise EngineError(f"inputs must be exactly {sorted(names)}, got {sorted(inputs)}")
        n = check_rows(inputs, self._sizes)
        for spec in self._plan.inputs:
            arr = inputs[spec.name]
            if arr.dtype != self._dtypes[spec.name] or arr.shape[1:] != tuple(spec.shape[1:]):
                raise EngineError(f"input {spec.name!r}: {arr.dtype} {list(arr.shape)} given, the graphs take "
                                  f"{self._dtypes[spec.name]} {[n, *spec.shape[1:]]}")
        return n

    def _execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = self._checked(inputs)
        with CAPTURE_GATE.shared():
            return self._run(n, inputs)

    def _launch_batch(self, inputs: Mapping[str, np.ndarray]) -> tuple[int, int, int]:
        n = self._checked(inputs)
        with CAPTURE_GATE.shared():
            return self._enqueue(n, inputs)

    def _collect(self, launched: tuple[int, int, int]) -> dict[str, np.ndarray]:
        if self._session is None:
            raise EngineError("execution context was released")
        with CAPTURE_GATE.shared():
            return self._wait(launched)

    # ---- contract

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch on the context's thread (see the module docstring).

        Args:
            inputs: every input by name, ``n`` rows (``n`` one of :attr:`batch_sizes`), the engine's dtypes and
                non-batch dims.

        Returns:
            every output by name, ``n`` rows, arrays the caller owns.

        Raises:
            EngineError: released, wrong inputs/rows/dtype/dims, or a CUDA/ONNX Runtime failure (the context stays
                usable).
        """
        return self._on_thread(self._execute, inputs)

    #: two batches on the device at once (module docstring): :meth:`launch` the next before collecting the last
    pipeline_depth = 2

    def launch(self, inputs: Mapping[str, np.ndarray]) -> tuple[int, int, int]:
        """Queue one batch on the device and return without waiting for it (on the context's thread).

        Args:
            inputs: as :meth:`execute` takes them; they, and the host memory of any :class:`RowParts`, must stay
                unchanged until :meth:`collect` returns.

        Returns:
            a handle for :meth:`collect` (rows, output slot, and which launch of that slot).

        Raises:
            EngineError: as :meth:`execute`, or :attr:`pipeline_depth` batches are launched and not collected.
        """
        return self._on_thread(self._launch_batch, inputs)

    def collect(self, launched: tuple[int, int, int]) -> dict[str, np.ndarray]:
        """Wait for a batch of :meth:`launch` (batches finish in launch order) and return its outputs, as
        :meth:`execute` does.

        Raises:
            EngineError: the batch failed on the device, or the handle is not a launched batch's.
        """
        return self._on_thread(self._collect, launched)

    def _on_thread(self, fn: Callable[[Any], T], arg: Any) -> T:
        """``fn(arg)`` on the context's thread. Raises EngineError: released."""
        thread = self._thread
        if thread is None:
            raise EngineError("execution context was released")
        return thread.call(fn, arg)

    @property
    def executor(self) -> Executor | None:
        return self._thread.pool if self._thread is not None else None

    #: four pinned staging buffers per input: while one batch is sent, the next is stacked, and two full ones after
    #: it may be (the scheduler's lookahead, :data:`batcher.scheduler.LOOKAHEAD_SLOT`). A batch's slot comes back
    #: only through the event loop once it is answered, so lookahead slots are what keeps the device fed while
    #: that hand-off lags. Measured on the H200 (``bench.gpu_scale --parts r,m``, 8 front ends, system shm,
    #: four runs each over two leases): 9,770 / 9,703 / 9,285 / 10,258 req/s with 4 against 7,284 / 8,728 /
    #: 8,302 / 9,428 with 3 (device busy 0.64-0.77 of the window against 0.52-0.73), binary HTTP equal
    #: (8,514 against 8,519 on average); 6 slots were no better than 4 (bench/results/gpu_scale/day6/)
    staging_slots = 4

    def host_buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype, slot: int = 0) -> np.ndarray | None:
        """A view of input ``name``'s pinned staging buffer ``slot`` (0 .. :attr:`staging_slots` - 1; fixed, sized for the largest
        allowed batch), or ``None`` when ``name`` is no input, the dtype differs or the shape does not fit. All are
        page-locked, so :meth:`execute` sends any straight to the device."""
        pinned = (self._buffers.pinned if slot == 0 else self._spare[slot - 1]).get(name)
        if pinned is None or name in self._output_names or np.dtype(dtype) != self._dtypes[name]:
            return None
        if int(np.prod(shape)) * np.dtype(dtype).itemsize > pinned.nbytes:
            return None
        return pinned.view(shape, dtype)

    def gather_rows(self, name: str, parts: list[np.ndarray], rows: int) -> RowParts | None:
        """The requests' arrays of input ``name`` unstacked, when every one is C-contiguous page-locked host memory
        (the front ends' shared areas of multi-process mode are ``cudaHostRegister``-ed): :meth:`execute` then
        sends each by DMA into the device buffer at its offset and zeroes the padding rows there, and no thread
        stacks them on the host. None otherwise (they are stacked into :meth:`host_buffer`)."""
        dtype = self._dtypes.get(name)
        if dtype is None or name in self._output_names or rows > max(self._sizes):
            return None
        row_shape = parts[0].shape[1:]
        ptrs = []
        for part in parts:
            if part.dtype != dtype or part.shape[1:] != row_shape or not part.flags.c_contiguous:
                return None
            ptr = part.ctypes.data
            if not page_locked(ptr, part.nbytes):
                return None
            ptrs.append(ptr)
        return RowParts(parts, rows, ptrs)

    def release(self) -> None:
        """Free the session (and its graphs), the buffers and the stream on the context's thread, then stop the
        thread. Idempotent."""
        thread, self._thread = getattr(self, "_thread", None), None  # type: ignore[assignment]
        if thread is None:
            return
        try:
            thread.call(self._free)
        finally:
            thread.stop()

    def _free(self) -> None:
        set_device(self._plan.device_id)
        with CAPTURE_GATE.shared():
            self._bindings.clear()
            self._run_options.clear()
            self._session = None
            self._buffers.free()
            for spare in (*self._spare, *self._out_spare):
                for buf in spare.values():
                    buf.free()
                spare.clear()
            for event in (*self._events, *(e for pair in self._timers for e in pair)):
                event.destroy()
            self._events = []
            self._timers = []
            if self._stream is not None:
                self._stream.destroy()
                self._stream = None
