"""ONNX Runtime backend: the portable engine (CPU execution provider; CUDA provider with onnxruntime-gpu).

Modules: :mod:`.engine` (:class:`OnnxRuntimeEngine`), :mod:`.options` (precision, provider and session options,
the fp16 copy), :mod:`.cpu` (:class:`OnnxRuntimeContext`), :mod:`.cuda` (what CUDA contexts share, and
:class:`CudaSessionsContext`: one session per allowed batch size), :mod:`.graphs` (:class:`CudaGraphContext`: one
session with a CUDA graph per allowed batch size, on its own thread).

Each execution context is its own ``InferenceSession`` (or set of sessions) with its own intra-op thread pool, like
one Triton ONNX Runtime model instance, so contexts run side by side without sharing a thread pool. On CUDA each
context also owns a CUDA stream that its sessions compute on (``user_compute_stream``) and pinned/device buffers;
CUDA is reached only through :mod:`engines.cuda`.

Which CUDA context a model gets (``gpu_execution``, logged, and shown by ``describe()``):

============================  ===========================================================================
``batch_sizes`` None          ``cuda_sessions``: one session, any batch size (every new shape costs cuDNN
                              plan rebuilds: tens of ms on the H200)
graphs / auto                 ``cuda_graphs``: one session, a graph per allowed size, captured at creation
sessions, or auto when the    ``cuda_sessions``: one session per allowed size (each warmed once)
model cannot be captured
============================  ===========================================================================

Memory accounting (bytes): the engine counts the model file (its weights); a context counts the growth of the
process's resident memory (CPU) or the drop of free device memory (CUDA, ``cudaMemGetInfo``) measured while it
was created - ONNX Runtime reports no figure itself.
"""

from .cpu import OnnxRuntimeContext, tensor_spec
from .cuda import CudaPlan, CudaSessionsContext, IOBuffers
from .engine import OnnxRuntimeEngine
from .graphs import CudaGraphContext, DeviceThread
from .options import ARENA_STRATEGIES, EXECUTIONS, PRECISIONS

__all__ = [
    "OnnxRuntimeEngine",
    "OnnxRuntimeContext",
    "CudaSessionsContext",
    "CudaGraphContext",
    "CudaPlan",
    "IOBuffers",
    "DeviceThread",
    "tensor_spec",
    "PRECISIONS",
    "ARENA_STRATEGIES",
    "EXECUTIONS",
]
