"""What an ONNX Runtime session is created with: precision, the CUDA provider's options, session options, and the
fp16 copy of a model.

Precision (``precision=``; default ``tf32`` on CUDA, ``fp32`` on CPU):

* ``fp32``: CUDA with ``use_tf32: 0``, results match the CPU to ~1e-5 (measured 1.3e-5 on resnet18, H200);
* ``tf32``: CUDA with ``use_tf32: 1`` (ONNX Runtime's default, and PyTorch's for cuDNN convolutions): Ampere+
  tensor cores, 2.3x the fp32 compute of resnet18 at batch 32 on the H200 (``shared/design/gpu-probe.md``), about
  1e-2 absolute difference on logits of order 10;
* ``fp16``: the model converted by onnxconverter-common's ``convert_float_to_float16(keep_io_types=True)``, so
  inputs and outputs stay fp32 (casts at the edges); the converted file is cached beside the zoo's models.

CPU accepts only ``fp32`` (TF32 is a GPU format; ONNX Runtime's CPU kernels lack most fp16 ops).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import onnxruntime as ort

from ..base import EngineError
from ..files import atomic_write

PRECISIONS = ("fp32", "tf32", "fp16")
#: ONNX Runtime's names for the arena's growth (``arena_extend_strategy``).
ARENA_STRATEGIES = ("kNextPowerOfTwo", "kSameAsRequested")
#: graphs: one session + a CUDA graph per allowed batch size; sessions: one session per size; auto: graphs, else
#: sessions when the model cannot be captured.
EXECUTIONS = ("graphs", "sessions", "auto")


def resolve_precision(precision: str | None, device: str) -> str:
    """The precision to run: ``precision``, or the device's default (``tf32`` on CUDA, ``fp32`` on CPU).

    Raises:
        EngineError: unknown name, or ``tf32``/``fp16`` on CPU.
    """
    if precision is None:
        return "tf32" if device == "cuda" else "fp32"
    if precision not in PRECISIONS:
        raise EngineError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if device == "cpu" and precision != "fp32":
        raise EngineError(f"precision {precision} needs a GPU (device cuda); on CPU only fp32 runs")
    return precision


def check_cuda_options(gpu_mem_limit: int | None, arena_extend_strategy: str | None, gpu_execution: str) -> None:
    """Raises EngineError for a negative/zero memory limit, an unknown arena strategy or execution mode."""
    if gpu_mem_limit is not None and int(gpu_mem_limit) <= 0:
        raise EngineError(f"gpu_mem_limit must be a positive number of bytes, got {gpu_mem_limit}")
    if arena_extend_strategy is not None and arena_extend_strategy not in ARENA_STRATEGIES:
        raise EngineError(f"arena_extend_strategy must be one of {', '.join(ARENA_STRATEGIES)}, "
                          f"got {arena_extend_strategy!r}")
    if gpu_execution not in EXECUTIONS:
        raise EngineError(f"gpu_execution must be one of {', '.join(EXECUTIONS)}, got {gpu_execution!r}")


def session_options(intra_op_threads: int) -> ort.SessionOptions:
    """Session options of every context: its own intra-op pool of ``intra_op_threads`` threads (0: all cores), no
    spinning (spinning pool threads burn the cores other contexts and the event loop need), warnings off."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = intra_op_threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return opts


def cuda_provider(device_id: int, stream_ptr: int, precision: str, *, graphs: bool, gpu_mem_limit: int | None = None,
                  arena_extend_strategy: str | None = None) -> tuple[str, dict[str, str]]:
    """The ``("CUDAExecutionProvider", options)`` entry of a context's session.

    * ``user_compute_stream``: the context's own non-blocking stream; ONNX Runtime then computes (and with
      ``enable_cuda_graph`` captures and replays its graphs) on it, so the context's copies order with its compute
      and never serialize with other contexts;
    * ``do_copy_in_default_stream: 0``: ONNX Runtime's own copies stay off the legacy default stream;
    * ``use_tf32``: from ``precision`` (``fp32`` -> 0);
    * ``cudnn_conv_algo_search: EXHAUSTIVE`` (the default, written out): the best algorithm per shape; the search
      runs once per allowed size, before capture;
    * ``enable_cuda_graph``: ``graphs``;
    * ``gpu_mem_limit`` (bytes, the arena's cap) and ``arena_extend_strategy`` when given.
    """
    options = {
        "device_id": str(device_id),
        "user_compute_stream": str(stream_ptr),
        "do_copy_in_default_stream": "0",
        "use_tf32": "0" if precision == "fp32" else "1",
        "cudnn_conv_algo_search": "EXHAUSTIVE",
        "enable_cuda_graph": "1" if graphs else "0",
    }
    if gpu_mem_limit is not None:
        options["gpu_mem_limit"] = str(int(gpu_mem_limit))
    if arena_extend_strategy is not None:
        options["arena_extend_strategy"] = arena_extend_strategy
    return "CUDAExecutionProvider", options


def run_options(graph_id: int | None) -> ort.RunOptions:
    """Run options of one batch size: ``gpu_graph_id`` (the CUDA graph of that size; ids from 1, 0 is ONNX Runtime's
    default id) and ``disable_synchronize_execution_providers: 1`` (the context synchronizes its stream once, after
    its device-to-host copies)."""
    opts = ort.RunOptions()
    if graph_id is not None:
        opts.add_run_config_entry("gpu_graph_id", str(graph_id))
    opts.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return opts


def fp16_path(path: Path, cache: Path) -> Path:
    """The fp16 copy of the model at ``path`` (fp32 inputs and outputs kept), converted once and cached in
    ``cache`` under the source's content hash (``<stem>-<sha256[:16]>-fp16.onnx``, written atomically).

    Raises:
        EngineError: onnxconverter-common is not installed (the message says ``pip install``), or the conversion
            failed.
    """
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    target = cache / f"{path.stem}-{digest}-fp16.onnx"
    if target.is_file():
        return target
    try:
        import onnx
        from onnxconverter_common import float16
    except ImportError as exc:
        raise EngineError(f"precision fp16 needs onnxconverter-common ({exc}): pip install onnxconverter-common") from None
    try:
        model = float16.convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)
    except Exception as exc:  # the converter raises whatever onnx/numpy raise
        raise EngineError(f"cannot convert {path} to fp16: {exc}") from exc
    atomic_write(target, model.SerializeToString())
    return target


def provider_summary(providers: list[Any]) -> str:
    """``"CUDAExecutionProvider(use_tf32=1, enable_cuda_graph=1, ...)"`` for log lines."""
    parts = []
    for p in providers:
        if isinstance(p, tuple):
            opts = ", ".join(f"{k}={v}" for k, v in p[1].items() if k != "user_compute_stream")
            parts.append(f"{p[0]}({opts})")
        else:
            parts.append(str(p))
    return ", ".join(parts)
