"""The peers benchmark's models, generated deterministically (fixed seed) with ``onnx.helper`` and numpy.

* ``mlp``: the 512-2048-512 MLP of the peer comparison (``bench/peers.py``): input ``x`` FP32 ``[-1, 512]``,
  ``Gemm(512->2048) + Relu + Gemm(2048->512)``, output ``y`` FP32 ``[-1, 512]`` (about 2.1 M parameters, 8.4 MB).
* ``trivial``: the front-end CPU test's model: input ``x`` FP32 ``[-1, 4]``, ``y = x + 1`` (one ``Add``), output
  ``y`` FP32 ``[-1, 4]``; its execution costs next to nothing, so the server's CPU time is its front end.

    python -m bench.mlp --out /tmp/models            # writes mlp.onnx and trivial.onnx

Both use opset 13 and IR version 8, which every ONNX Runtime since 1.10 loads (the one inside PyTriton's
separate virtualenv too). The same seed gives byte-identical files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from bench.scripts import script_parser

SEED = 20240611
OPSET = 13
IR_VERSION = 8
MLP_DIMS = (512, 2048, 512)
TRIVIAL_WIDTH = 4
INPUT = "x"
OUTPUT = "y"


def mlp_model(dims: tuple[int, int, int] = MLP_DIMS, seed: int = SEED):
    """The MLP as an ``onnx.ModelProto``: ``y = Relu(x W1^T + b1) W2^T + b2`` (He-scaled normal weights)."""
    from onnx import TensorProto, helper, numpy_helper

    d_in, d_hidden, d_out = dims
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((d_hidden, d_in)) * np.sqrt(2.0 / d_in)).astype(np.float32)
    b1 = (rng.standard_normal(d_hidden) * 0.01).astype(np.float32)
    w2 = (rng.standard_normal((d_out, d_hidden)) * np.sqrt(2.0 / d_hidden)).astype(np.float32)
    b2 = (rng.standard_normal(d_out) * 0.01).astype(np.float32)
    nodes = [
        helper.make_node("Gemm", [INPUT, "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["h_relu"], name="relu"),
        helper.make_node("Gemm", ["h_relu", "w2", "b2"], [OUTPUT], name="fc2", transB=1),
    ]
    graph = helper.make_graph(
        nodes, f"mlp_{d_in}_{d_hidden}_{d_out}",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, ["batch", d_in])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch", d_out])],
        initializer=[numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))],
    )
    return _model(graph)


def trivial_model(width: int = TRIVIAL_WIDTH):
    """``y = x + 1`` on FP32 ``[-1, width]``: one Add, so execution costs next to nothing."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Add", [INPUT, "one"], [OUTPUT], name="add")], "trivial",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch", width])],
        initializer=[numpy_helper.from_array(np.ones(width, np.float32), "one")],
    )
    return _model(graph)


def _model(graph):
    """The ``onnx.ModelProto`` of ``graph`` at :data:`OPSET` and :data:`IR_VERSION`, checked."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="bench.mlp")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def cpu_session(model_path: str | Path, intra_op_threads: int = 1):
    """The ONNX Runtime session every peer server runs its model in: CPU, ``intra_op_threads`` intra-op threads,
    one inter-op thread (onnxruntime is imported here, so PyTriton's virtualenv can use it too)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = intra_op_threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(model_path), sess_options=opts, providers=["CPUExecutionProvider"])


def _write(model, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = model.SerializeToString()
    if not (path.exists() and path.read_bytes() == data):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return path


def write_mlp(path: str | Path, dims: tuple[int, int, int] = MLP_DIMS, seed: int = SEED) -> Path:
    """Write the MLP to ``path`` (parents created; rewritten only if the bytes differ); returns the path."""
    return _write(mlp_model(dims, seed), Path(path))


def write_trivial(path: str | Path, width: int = TRIVIAL_WIDTH) -> Path:
    """Write the trivial ``y = x + 1`` model to ``path``; returns the path."""
    return _write(trivial_model(width), Path(path))


def reference(x: np.ndarray, dims: tuple[int, int, int] = MLP_DIMS, seed: int = SEED) -> np.ndarray:
    """The MLP's output computed with numpy (to check a server's answers)."""
    from onnx import numpy_helper

    inits = {t.name: numpy_helper.to_array(t) for t in mlp_model(dims, seed).graph.initializer}
    h = np.maximum(x @ inits["w1"].T + inits["b1"], 0)
    return h @ inits["w2"].T + inits["b2"]


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.mlp", __doc__)
    p.add_argument("--out", type=Path, required=True, help="directory for mlp.onnx and trivial.onnx")
    args = p.parse_args(argv)
    for path in (write_mlp(args.out / "mlp.onnx"), write_trivial(args.out / "trivial.onnx")):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
