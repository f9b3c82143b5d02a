"""NVIDIA PyTriton serving an ONNX model through ONNX Runtime (CPU) with Triton's dynamic batcher: the peer of
``bench/peers.py``.

    python -m bench.pytriton_server --model-path mlp.onnx --model-name mlp --port 8000

PyTriton (``pip install nvidia-pytriton``) bundles ``tritonserver`` and Triton's Python backend; a request goes
HTTP -> tritonserver (C++: HTTP front end, dynamic batcher) -> the Python backend's stub process -> (ZeroMQ,
shared memory) -> this process, where ``@batch`` hands the batch to ONNX Runtime. The stub is built against
libpython and needs the running Python's own ``lib/`` (``sysconfig`` ``LIBDIR``, where ``libpython3.X.so`` is)
on ``LD_LIBRARY_PATH``: this script adds it to its environment before starting Triton, which passes its
environment on to tritonserver and the stub.

nvidia-pytriton 0.7.0 requires ``numpy<2``; run it from its own virtualenv (``bench/peers.py`` looks for one at
``/tmp/pytriton-venv``, see its ``--pytriton-python``). PyTriton is imported only in :func:`serve`, so ``--help``
works without it. Every port listens on 127.0.0.1 only; the HTTP, gRPC and metrics ports are free ports unless
given. Prints ``READY http=PORT metrics=PORT`` once the model is ready, and stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import sysconfig
from pathlib import Path

from bench.scripts import peer_server_parser  # these two: the standard library only (PyTriton's own virtualenv)
from bench.server import free_port


def python_lib_dir() -> str:
    """The directory of the running Python's ``libpython3.X.so`` (what the Python backend stub links to)."""
    libdir = sysconfig.get_config_var("LIBDIR") or str(Path(sys.base_prefix) / "lib")
    return libdir


def add_python_lib_to_ld_path() -> str:
    """Prepend :func:`python_lib_dir` to ``LD_LIBRARY_PATH`` in ``os.environ`` (inherited by tritonserver)."""
    libdir = python_lib_dir()
    parts = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if libdir not in parts:
        os.environ["LD_LIBRARY_PATH"] = ":".join([libdir, *parts])
    return libdir


def make_infer(model_path: str, intra_op_threads: int):
    """An ``@batch`` inference callable running ``model_path`` in one ONNX Runtime CPU session, plus the
    model's input/output (name, per-row shape) lists."""
    import numpy as np
    from pytriton.decorators import batch

    from bench.mlp import cpu_session

    session = cpu_session(model_path, intra_op_threads)
    ins = [(i.name, tuple(int(d) if isinstance(d, int) else -1 for d in i.shape[1:])) for i in session.get_inputs()]
    outs = [(o.name, tuple(int(d) if isinstance(d, int) else -1 for d in o.shape[1:]))
            for o in session.get_outputs()]
    out_names = [n for n, _ in outs]

    @batch
    def infer(**inputs):
        feeds = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in inputs.items()}
        return dict(zip(out_names, session.run(out_names, feeds)))

    return infer, ins, outs


def serve(args: argparse.Namespace) -> int:
    libdir = add_python_lib_to_ld_path()
    import numpy as np
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    infer, ins, outs = make_infer(args.model_path, args.intra_op_threads)
    http_port = args.port or free_port()
    metrics_port = args.metrics_port or free_port()
    config = TritonConfig(
        http_address="127.0.0.1", http_port=http_port,
        grpc_address="127.0.0.1", grpc_port=args.grpc_port or free_port(),
        metrics_address="127.0.0.1", metrics_port=metrics_port,
        allow_gpu_metrics=False, log_verbose=0,
    )
    if args.http_threads:
        config.http_thread_count = args.http_threads
    batcher = DynamicBatcher(max_queue_delay_microseconds=args.max_queue_delay_us)
    with Triton(config=config) as triton:
        triton.bind(
            model_name=args.model_name,
            infer_func=[infer] + [make_infer(args.model_path, args.intra_op_threads)[0]
                                  for _ in range(args.instances - 1)],
            inputs=[Tensor(name=n, dtype=np.float32, shape=s) for n, s in ins],
            outputs=[Tensor(name=n, dtype=np.float32, shape=s) for n, s in outs],
            config=ModelConfig(max_batch_size=args.max_batch_size, batcher=batcher),
            strict=False,
        )

        def stop(signum, frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        triton.run()  # starts tritonserver and loads the model; returns once it is ready
        print(f"READY http={http_port} metrics={metrics_port} (LD_LIBRARY_PATH starts with {libdir})", flush=True)
        try:
            triton.serve()
        except KeyboardInterrupt:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    p = peer_server_parser("bench.pytriton_server", __doc__)
    p.add_argument("--grpc-port", type=int, default=0, help="gRPC port on 127.0.0.1 (default: a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="metrics port on 127.0.0.1 (default: a free one)")
    p.add_argument("--max-batch-size", type=int, default=32, help="Triton max_batch_size (default: 32)")
    p.add_argument("--max-queue-delay-us", type=int, default=500,
                   help="dynamic batcher max_queue_delay_microseconds (default: 500)")
    p.add_argument("--instances", type=int, default=1, help="inference callables (model instances) (default: 1)")
    p.add_argument("--http-threads", type=int, default=0,
                   help="tritonserver --http-thread-count (default: Triton's own)")
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
