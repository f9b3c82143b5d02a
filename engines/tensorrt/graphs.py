"""A CUDA graph per allowed batch size of a TensorRT context.

TensorRT's recipe for CUDA graphs (Developer Guide, "CUDA Graphs"): set the input shapes, call ``enqueueV3`` once
(it updates the context's internal state for the new shapes), then capture a second ``enqueueV3`` on a
non-default stream and launch the instantiated graph instead of enqueueing. A graph bakes in the shapes and the
tensor addresses it was captured with.

Here each allowed size gets its own ``IExecutionContext`` (shapes set once and never changed), so nothing one size
does to a context's host-side state can reach the graph of another size. The per-size contexts are created with
``ExecutionContextAllocationStrategy.USER_MANAGED`` and share ONE activation buffer (``set_device_memory``): they
run one at a time on the context's stream, so one profile's worth of activation memory serves every size. All
sizes share the context's I/O buffers (sized for the largest), bound with ``set_tensor_address``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..cuda import DeviceBuffer, Graph, Stream
from .api import TensorRTError, dims
from .profiles import ProfileBounds, Shape


class ShapeGraph:
    """One allowed batch size: its ``IExecutionContext`` (kept alive for the graph), the graph captured from its
    ``execute_async_v3``, and every output's shape at that size."""

    def __init__(self, trt_context: Any, graph: Graph, outputs: dict[str, Shape]) -> None:
        self.trt_context = trt_context
        self.graph = graph
        self.outputs = outputs


def set_profile_and_shapes(trt_context: Any, profile: int, stream: Stream, shapes: Mapping[str, Shape]) -> None:
    """Put ``trt_context`` on optimization ``profile`` (``set_optimization_profile_async`` on ``stream``, then a
    synchronize) and set every input's shape from ``shapes`` (batch dim included).

    Raises:
        TensorRTError: TensorRT refused the profile or a shape (names it).
    """
    if not trt_context.set_optimization_profile_async(profile, stream.ptr):
        raise TensorRTError(f"set_optimization_profile_async({profile}) was refused")
    stream.synchronize()
    for name, shape in shapes.items():
        if not trt_context.set_input_shape(name, shape):
            raise TensorRTError(f"set_input_shape({name!r}, {list(shape)}) refused for profile {profile}")


def bind_addresses(trt_context: Any, device: Mapping[str, DeviceBuffer]) -> None:
    """Bind every I/O tensor of ``trt_context`` to its device buffer in ``device`` (``set_tensor_address``).

    Raises:
        TensorRTError: TensorRT refused an address (names the tensor).
    """
    for name, buf in device.items():
        if not trt_context.set_tensor_address(name, buf.ptr):
            raise TensorRTError(f"set_tensor_address({name!r}) refused")


def graph_sizes(bounds: ProfileBounds, sizes: Sequence[int]) -> str | None:
    """Why ``sizes`` cannot be captured on this profile (``None``: they can): a non-batch dim that the profile
    leaves dynamic (a graph needs one shape per size).

    Raises:
        TensorRTError: a size outside the profile's batch range (names the sizes and the range).
    """
    bad = [b for b in sizes if not bounds.min_batch <= b <= bounds.max_batch]
    if bad:
        raise TensorRTError(f"allowed batch sizes {bad} are outside optimization profile {bounds.index}'s batch range "
                            f"{bounds.min_batch}..{bounds.max_batch}")
    dynamic = [name for name, (lo, hi) in bounds.shapes.items() if tuple(lo[1:]) != tuple(hi[1:])]
    if dynamic:
        return f"inputs {dynamic} have dynamic non-batch dims in profile {bounds.index}; CUDA graphs need fixed ones"
    return None


def capture_graphs(cuda_engine: Any, trt: Any, bounds: ProfileBounds, sizes: Sequence[int], stream: Stream,
                   output_names: Sequence[str], allocate: Callable[[dict[str, Shape]], None],
                   device: dict[str, DeviceBuffer]) -> tuple[DeviceBuffer, dict[int, ShapeGraph]]:
    """Create, warm and capture one context per size (largest first).

    Args:
        cuda_engine, trt: the engine and the TensorRT module.
        output_names: the engine's outputs.
        allocate: ``allocate(shapes)`` makes the I/O buffers for the largest size's input and output shapes (into
            ``device``); called once, before any address is bound.
        device: the context's device buffers by tensor name, read after ``allocate``.

    Returns:
        ``(activation buffer, {size: ShapeGraph})``; the caller frees them (graphs and contexts before the buffer).

    Raises:
        TensorRTError: TensorRT refused a context, profile, shape, address or execution. CudaError: CUDA failed
            (capture included). What was made before the failure is returned through the exception's
            ``partial`` attribute: ``(activation buffer or None, graphs so far)``.
    """
    activation: DeviceBuffer | None = None
    graphs: dict[int, ShapeGraph] = {}
    try:
        nbytes = int(cuda_engine.device_memory_size_v2)
        activation = DeviceBuffer(nbytes)
        for size in sorted(sizes, reverse=True):
            trt_context = cuda_engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            if trt_context is None:
                raise TensorRTError("create_execution_context(USER_MANAGED) returned None")
            trt_context.set_device_memory(activation.ptr, nbytes)
            shapes = {name: (size, *hi[1:]) for name, (_lo, hi) in bounds.shapes.items()}
            set_profile_and_shapes(trt_context, bounds.index, stream, shapes)
            outputs = {name: dims(trt_context.get_tensor_shape(name)) for name in output_names}
            if any(min(shape, default=0) < 0 for shape in outputs.values()):
                raise TensorRTError(f"outputs {outputs} have data-dependent shapes; CUDA graphs cannot hold them")
            if not device:
                allocate({**shapes, **outputs})
            bind_addresses(trt_context, device)  # the largest size's buffers hold every smaller size
            if not trt_context.execute_async_v3(stream.ptr):  # the warm-up enqueue TensorRT asks for
                raise TensorRTError(f"execute_async_v3 (warm-up, batch {size}) returned False")
            stream.synchronize()

            def enqueue() -> None:
                if not trt_context.execute_async_v3(stream.ptr):
                    raise TensorRTError(f"execute_async_v3 returned False while capturing batch {size}")

            graphs[size] = ShapeGraph(trt_context, Graph.capture(stream, enqueue), outputs)
    except BaseException as exc:
        exc.partial = (activation, graphs)  # type: ignore[attr-defined]
        raise
    return activation, graphs
