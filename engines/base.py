"""The engine contract every backend implements (ONNX Runtime now, TensorRT next).

An :class:`Engine` is a loaded model: its named input/output tensors, the largest batch it accepts and its
memory footprint. It hands out :class:`ExecutionContext` objects; a context holds everything one execution needs
(an ONNX Runtime session, or a TensorRT ``IExecutionContext`` with its CUDA stream and buffers) and is NOT
thread-safe: the caller must use one context from one thread at a time (the serving layer gives each context its
own executor thread). Contexts may run side by side.

Shapes include the batch dimension first; ``-1`` marks a dynamic dimension. BYTES tensors are numpy ``object``
arrays whose elements are ``bytes``, inputs and outputs alike; a backend converts to and from its own string type.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np


class EngineError(RuntimeError):
    """A backend failed to load a model or to execute a batch; the message gives the backend's reason."""


class EngineInputError(EngineError):
    """The backend cannot take this batch's input data (e.g. BYTES elements that are not UTF-8 for a backend that
    carries strings as text, or text a string-parsing operator rejects): the request's fault, answered 400."""


class EngineUnavailable(EngineError):
    """The context cannot run batches for now (e.g. its worker process died with the batch and is being
    restarted); the caller should answer 503 + Retry-After rather than 500."""


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor of an engine.

    Attributes:
        name: tensor name as the model file declares it.
        datatype: KServe v2 datatype (``"FP32"``, ``"INT64"``, ``"BYTES"``, ... see :mod:`engines.datatypes`).
        shape: full shape, batch dimension first; ``-1`` for a dynamic dimension.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class DeviceTimes:
    """One batch's time on the device, from CUDA timing events (``cudaEventElapsedTime``, resolution about
    0.5 us) recorded on the context's stream before its first host-to-device copy and after its last
    device-to-host copy.

    Attributes:
        busy_s: seconds from the batch's first copy starting to its last copy ending (copies and kernels).
        idle_s: seconds the stream sat empty between the previous batch's last copy and this batch's first one
            (0 when this batch was queued behind it; the host was late otherwise); None for the context's first
            batch timed.
    """

    busy_s: float
    idle_s: float | None


class RowParts:
    """One input of a batch as the requests' own arrays, not stacked: what a device context that reads page-locked
    host memory in place copies host-to-device part by part (one DMA per request, no host copy; the front ends'
    shared memory of multi-process mode, ``cudaHostRegister``-ed). Quacks like the stacked array where a context
    checks an input: ``shape`` (``[rows, ...]``, padding rows included), ``dtype``, ``nbytes``.

    Args:
        parts: the requests' arrays in batch order, each ``[r_i, ...]``, C-contiguous, one dtype and row shape.
        rows: the batch's rows with padding (>= the parts' rows); rows past the parts' are zeros.
        ptrs: the parts' host addresses (``part.ctypes.data``, about 1 us each), where the caller has them already;
            else read here.
    """

    __slots__ = ("parts", "ptrs", "shape", "dtype", "row_nbytes")

    def __init__(self, parts: list[np.ndarray], rows: int, ptrs: list[int] | None = None) -> None:
        first = parts[0]
        self.parts = parts
        self.ptrs = ptrs if ptrs is not None else [p.ctypes.data for p in parts]
        self.shape = (rows, *first.shape[1:])
        self.dtype = first.dtype
        self.row_nbytes = first.dtype.itemsize * int(np.prod(first.shape[1:], dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.row_nbytes * self.shape[0]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def real_rows(self) -> int:
        return sum(p.shape[0] for p in self.parts)

    def stacked(self) -> np.ndarray:
        """The parts stacked into one new array, padding rows zero (for a context that cannot take parts)."""
        out = np.zeros(self.shape, self.dtype)
        np.concatenate(self.parts, axis=0, out=out[: self.real_rows])
        return out


class ExecutionContext(abc.ABC):
    """One execution context of an engine. Not thread-safe: one thread at a time."""

    @abc.abstractmethod
    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch.

        Args:
            inputs: every input of the engine by name; each array's first dimension is the batch size ``n``
                (``1 <= n <= engine.max_batch_size``, and one of :attr:`batch_sizes` when that is not ``None``),
                dtypes as the engine's :class:`TensorSpec` says.

        Returns:
            every output by name, each with first dimension ``n``; arrays the caller owns (never views of buffers
            that the next batch overwrites).

        Raises:
            EngineError: the backend failed on this batch (the context stays usable).
        """

    @property
    def batch_sizes(self) -> tuple[int, ...] | None:
        """The batch sizes this context prepared executables for (a CUDA graph per size, TensorRT's shapes), in
        increasing order; :meth:`execute` may then only be called with a first dimension in this tuple (the caller
        pads a batch up to the next size and slices the outputs back). ``None``: any size from 1 to the maximum."""
        return None

    @property
    def device_nbytes(self) -> int:
        """Device memory of this context in bytes (sessions, weights, workspaces and CUDA graphs included), as
        measured with ``cudaMemGetInfo`` around its creation or reported by the backend; 0 on CPU."""
        return 0

    @property
    def executor(self) -> Executor | None:
        """A single-thread executor this context must be used from, or ``None`` (any one thread at a time).

        ONNX Runtime keeps the CUDA graphs it captured per host thread, so a CUDA-graph context owns the thread that
        captured them; :meth:`execute` called from another thread hands the batch over to it (one thread hop each
        way). A caller that runs its per-batch work on this executor avoids the hop."""
        return None

    def describe(self) -> dict[str, Any]:
        """Small JSON-able facts for metadata and statistics, e.g. ``{"execution": "cuda_graphs",
        "batch_sizes": [1, 2, 4, 8, 16, 32], "precision": "tf32"}``."""
        return {}

    #: how many host staging buffers :meth:`host_buffer` offers (``slot`` 0 .. staging_slots - 1). A context whose
    #: execution runs on a device, asynchronously to the host, offers 2: the caller may stack the next batch into
    #: one while the batch staged in the other is sent and executed (a two-stage pipeline).
    staging_slots: int = 1

    def host_buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype, slot: int = 0) -> np.ndarray | None:
        """A writable host array for input ``name`` that :meth:`execute` reads without a further copy
        (a GPU context's pinned staging buffer), or None where the backend has none (CPU).

        The caller may stack a batch straight into it and pass it to :meth:`execute`; it stays valid until the
        next call on this context that uses the same ``slot`` (< :attr:`staging_slots`).
        """
        return None

    #: whether a context that can time its device (a CUDA-graph context) records timing events around each batch for
    #: :meth:`device_times`; read when a context is created (``server.device_timing`` sets it for a process)
    device_timing: bool = True

    #: whether a GPU context waits for its batches by sleeping (``cudaEventBlockingSync`` on the event it waits
    #: for) instead of spinning a core until the batch ends (CUDA's default wait with more cores than active
    #: contexts); read when a context is created (``server.cuda_blocking_sync`` sets it for a process)
    blocking_sync: bool = False

    #: batches this context takes on its device at once: with 2 or more, :meth:`launch` queues a batch and returns
    #: and :meth:`collect` waits for it, so the caller can queue the next batch behind the running one and the
    #: device never waits for the host between batches (:class:`batcher.device_pipeline.DevicePipeline`). 1 (the
    #: default): only :meth:`execute`.
    pipeline_depth: int = 1

    def launch(self, inputs: Mapping[str, np.ndarray]) -> Any:
        """Queue one batch (the inputs :meth:`execute` takes) on the device and return without waiting: a handle
        for :meth:`collect`. At most :attr:`pipeline_depth` batches may be launched and not yet collected, and
        their inputs must stay unchanged until collected. :meth:`execute` while batches are launched takes a free
        launch slot of its own (so at most ``pipeline_depth - 1`` may be launched then) and runs after them.

        Raises:
            EngineError: as :meth:`execute`, or too many batches launched; NotImplementedError: depth 1.
        """
        raise NotImplementedError(f"{type(self).__name__} only executes (pipeline_depth 1)")

    def collect(self, launched: Any) -> dict[str, np.ndarray]:
        """Wait for a batch of :meth:`launch` (batches complete in launch order) and return its outputs as
        :meth:`execute` does.

        Raises:
            EngineError: the batch failed, or the handle is not one of a launched batch; NotImplementedError:
                depth 1.
        """
        raise NotImplementedError(f"{type(self).__name__} only executes (pipeline_depth 1)")

    def device_times(self) -> DeviceTimes | None:
        """How long the device took over the batch last returned by :meth:`execute` or :meth:`collect`, and how long
        it sat idle before it (:class:`DeviceTimes`, from CUDA timing events); None where the context does not
        time its device (CPU, the default). Call it on the thread that executed or collected that batch, before
        the next call on this context."""
        return None

    def gather_rows(self, name: str, parts: list[np.ndarray], rows: int) -> RowParts | None:
        """Input ``name`` of a batch as its requests' arrays (:class:`RowParts`, ``rows`` with padding), when
        :meth:`execute` can read every part where it lies (page-locked host memory sent by DMA part by part), so
        nobody stacks them on the host; None (the default) to have them stacked into :meth:`host_buffer`."""
        return None

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Memory held by this context in bytes, as measured or reported by the backend."""

    @abc.abstractmethod
    def release(self) -> None:
        """Free the context's memory. Idempotent; the context must not be used afterwards."""


class DeviceContext(ExecutionContext):
    """An execution context on a GPU (ONNX Runtime's CUDA contexts, TensorRT's): all the memory it holds is device
    memory (:attr:`device_nbytes` is :attr:`nbytes`), and :attr:`batch_sizes` are the sizes it prepared an
    executable for, kept in ``_sizes`` (set when the context is created; None: any size)."""

    _sizes: tuple[int, ...] | None = None

    @property
    def batch_sizes(self) -> tuple[int, ...] | None:
        return self._sizes

    @property
    def device_nbytes(self) -> int:
        return self.nbytes

    @property
    def _sizes_fact(self) -> list[int] | None:
        """``describe()["batch_sizes"]``: :attr:`batch_sizes` as a JSON list, None for any size."""
        return list(self._sizes) if self._sizes else None


class Engine(abc.ABC):
    """A loaded model. Creating, using and releasing contexts is the caller's business."""

    #: backend name, e.g. ``"onnxruntime"``.
    backend: str = ""

    #: True where the backend carries BYTES as text (ONNX Runtime: ``std::string`` from a Python ``str``): every
    #: element of a BYTES input must then be UTF-8, and the server rejects other bytes (400) before queueing.
    bytes_as_text: bool = False

    #: set by each backend when it opens the model
    _inputs: tuple[TensorSpec, ...] = ()
    _outputs: tuple[TensorSpec, ...] = ()

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        """Input tensors, in the model's order."""
        return self._inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        """Output tensors, in the model's order."""
        return self._outputs

    @property
    @abc.abstractmethod
    def max_batch_size(self) -> int | None:
        """Largest batch the engine accepts (TensorRT: its optimization profile's maximum);
        ``None`` where the model states no limit (ONNX with a dynamic batch dim): the config then decides."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Memory held by the engine itself (weights, plan), excluding its contexts, in bytes."""

    @property
    def device_nbytes(self) -> int:
        """Device memory held by the engine itself, excluding its contexts, in bytes (TensorRT: the plan's weights
        and kernels); 0 where every context holds its own copy (ONNX Runtime: one session per context)."""
        return 0

    @abc.abstractmethod
    def create_context(self) -> ExecutionContext:
        """Create a new execution context.

        Raises:
            EngineError: the backend could not create it (e.g. out of memory).
        """

    @abc.abstractmethod
    def release(self) -> None:
        """Free the engine. Release its contexts first. Idempotent."""

    def input(self, name: str) -> TensorSpec:
        """Return the input spec called ``name``.

        Raises:
            KeyError: no such input.
        """
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(name)
