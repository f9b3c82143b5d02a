"""TensorRT smoke benchmark: build the seed models, load them, measure device memory of engines and contexts.

NEVER RUN ON REAL TENSORRT YET: this script was written on a machine without a GPU and without the full
``tensorrt`` package; only its ONNX-side helpers (:func:`resized_variant`, :func:`peak_activation_bytes`) have run.
Treat its first run on a GPU machine as the test of the script itself.

Needs: an NVIDIA GPU, the full TensorRT (``pip install "trt-batcher[tensorrt]"``, builder + ONNX parser) and
cuda-python. Without either it prints one line and exits 3.

What it does
------------
For each seed model (``tiny_cnn``, ``mid_cnn``, ``resnet18`` from ``engines.zoo.resolve("zoo:<name>")``):

* builds plans with :func:`engines.trt_build.cached_build` (fp32 by default; plans and a shared timing cache
  under ``--cache-dir``) with profile min batch 1, opt = max = B for B in 1, 8, 16, 32 at input 224x224, and with
  max batch 32 at input sizes 64, 112 and 224;
* the zoo models are generated with a fixed ``[batch, 3, 224, 224]`` input and ``build_seed_model`` has no size
  parameter, so the 64/112 variants are made by :func:`resized_variant`: the same graph and weights with the
  input's spatial dims rewritten (every seed model ends in GlobalAveragePool, so any size >= 32 is valid and the
  output stays ``[batch, 1000]``; checked with ONNX Runtime on CPU);
* for every plan: free device memory (``cudaMemGetInfo``) before loading, after loading the engine, after
  ``create_context()``, after one execution at the max batch, after releasing the context, and after releasing
  the engine; plus what TensorRT itself reports (``TensorRTEngine.memory_report()``: plan size, weights,
  ``device_memory_size_v2``; ``TensorRTContext.nbytes`` = activation + I/O buffers).

Tables printed (MB = 10^6 bytes; ``cudaMemGetInfo`` moves in 2 MiB pages, so deltas under ~2 MB are noise):

1. model | params | context MB at max batch 32 (measured delta / TensorRT's report)
2. per model: max batch | context MB | theoretical peak activation MB
3. per model: input size | context MB (max batch 32)
4. model | load+ctx MB | returned by ctx MB | returned by engine MB | residue MB (max batch 32, input 224)

"Theoretical peak activation" is :func:`peak_activation_bytes`: the largest, over the graph's nodes, of the bytes
of that node's activation inputs plus outputs (weights excluded), times the batch - the memory one layer needs at
once if nothing else is alive, counting every ONNX node unfused and out of place (a ReLU over a 128x112x112
activation counts 2 x 6.4 MB per image). TensorRT fuses layers and reuses buffers, so its context memory can be
below or above it (workspace for tactics comes on top).

Every row is also written to ``bench/results/trt_smoke.csv`` (``--csv`` to change).

Run: ``python -m bench.trt_smoke [--models tiny_cnn mid_cnn resnet18] [--precision fp32] [--cache-dir DIR]``
"""

from __future__ import annotations

import argparse
import csv
import gc
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import onnx

EXIT_UNAVAILABLE = 3
MODELS = ("tiny_cnn", "mid_cnn", "resnet18")
BATCHES = (1, 8, 16, 32)
SIZES = (64, 112, 224)
RESULTS = Path(__file__).resolve().parent / "results"
MB = 1e6


def resized_variant(model: "onnx.ModelProto", size: int) -> "onnx.ModelProto":
    """A copy of a seed model whose input is ``[batch, 3, size, size]`` (weights and graph unchanged).

    Raises:
        ValueError: the model's input is not rank 4 or ``size < 32`` (five stride-2 stages need at least 32).
    """
    import onnx

    if size < 32:
        raise ValueError(f"input size {size} < 32: the seed models downsample 32x")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    dims = out.graph.input[0].type.tensor_type.shape.dim
    if len(dims) != 4:
        raise ValueError(f"expected a rank-4 image input, got rank {len(dims)}")
    dims[2].dim_value = size
    dims[3].dim_value = size
    return out


def peak_activation_bytes(model: "onnx.ModelProto", batch: int) -> int:
    """Largest (activation inputs + outputs) of any node, in bytes, for ``batch`` rows; float32 assumed for
    tensors whose type shape inference leaves unknown. Initializers (weights) are not counted.

    Raises:
        ValueError: shape inference leaves a non-batch dimension unknown.
    """
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    weights = {init.name for init in graph.initializer}
    sizes: dict[str, int] = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        dims = vi.type.tensor_type.shape.dim
        n = 1
        for i, d in enumerate(dims):
            if d.HasField("dim_value"):
                n *= d.dim_value
            elif i == 0:
                n *= batch
            else:
                raise ValueError(f"tensor {vi.name} has an unknown dimension {i}")
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type).itemsize
        sizes[vi.name] = n * itemsize
    peak = 0
    for node in graph.node:
        names = [n for n in list(node.input) + list(node.output) if n and n not in weights]
        peak = max(peak, sum(sizes.get(n, 0) for n in names))
    return peak


@dataclass
class Row:
    model: str
    params: int
    input_size: int
    max_batch: int
    plan_mb: float = 0.0
    weights_mb: float | None = None
    engine_load_mb: float = 0.0  # free-memory drop when the engine was deserialized
    ctx_delta_mb: float = 0.0  # free-memory drop at create_context()
    ctx_reported_mb: float = 0.0  # TensorRTContext.nbytes (device_memory_size_v2 + I/O buffers)
    activation_reported_mb: float = 0.0  # device_memory_size_v2
    exec_delta_mb: float = 0.0  # further drop during the first execution at max batch
    returned_ctx_mb: float = 0.0
    returned_engine_mb: float = 0.0
    residue_mb: float = 0.0
    theoretical_peak_mb: float = 0.0

    @property
    def load_ctx_mb(self) -> float:
        return self.engine_load_mb + self.ctx_delta_mb + self.exec_delta_mb


def _free() -> int:
    from engines.tensorrt import device_memory_info

    gc.collect()
    return device_memory_info(0)[0]


def measure(plan: Path, row: Row) -> Row:
    """Load ``plan``, make one context, run one max batch, release both; fill ``row``'s memory columns."""
    from engines.tensorrt import TensorRTEngine

    f0 = _free()
    engine = TensorRTEngine(plan, runtime="full")
    f1 = _free()
    ctx = engine.create_context()
    f2 = _free()
    report = engine.memory_report()
    x = np.random.default_rng(0).standard_normal((row.max_batch, 3, row.input_size, row.input_size), dtype=np.float32)
    y = ctx.execute({"input": x})["logits"]
    if y.shape != (row.max_batch, 1000) or not np.isfinite(y).all():
        raise RuntimeError(f"{row.model}: bad output {y.shape}")
    f3 = _free()
    row.ctx_reported_mb = ctx.nbytes / MB
    ctx.release()
    f4 = _free()
    engine.release()
    del ctx, engine
    f5 = _free()
    row.plan_mb = report["plan_bytes"] / MB
    row.weights_mb = None if report["weights_bytes"] is None else report["weights_bytes"] / MB
    row.activation_reported_mb = report["context_bytes"] / MB
    row.engine_load_mb = (f0 - f1) / MB
    row.ctx_delta_mb = (f1 - f2) / MB
    row.exec_delta_mb = (f2 - f3) / MB
    row.returned_ctx_mb = (f4 - f3) / MB
    row.returned_engine_mb = (f5 - f4) / MB
    row.residue_mb = (f0 - f5) / MB
    return row


def _print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    def fmt(v: object) -> str:
        return f"{v:,.1f}" if isinstance(v, float) else ("-" if v is None else f"{v:,}" if isinstance(v, int) else str(v))

    cells = [header] + [[fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, r in enumerate(cells):
        print(" | ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def _unavailable() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    try:
        import tensorrt  # noqa: F401
    except (ImportError, OSError) as exc:
        return f'needs the full TensorRT package (import tensorrt failed: {exc}); pip install "trt-batcher[tensorrt]"'
    from engines.base import EngineError

    try:
        _free()
    except EngineError as exc:
        return f"needs an NVIDIA GPU with a working CUDA driver and cuda-python: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trt_smoke", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--precision", choices=("fp32", "fp16"), default="fp32")
    parser.add_argument("--workspace-mb", type=int, default=None)
    parser.add_argument("--cache-dir", type=Path, default=RESULTS / "plans", help="plans and timing cache")
    parser.add_argument("--csv", type=Path, default=RESULTS / "trt_smoke.csv")
    args = parser.parse_args(argv)

    reason = _unavailable()
    if reason is not None:
        print(f"trt_smoke: {reason}", file=sys.stderr)
        return EXIT_UNAVAILABLE

    from engines import trt_build
    from engines.zoo import build_seed_model, count_parameters, resolve

    args.cache_dir.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            base = build_seed_model(name)
            params = count_parameters(base)
            configs = [(224, b) for b in BATCHES] + [(s, 32) for s in SIZES if s != 224]
            for size, batch in configs:
                if size == 224:
                    onnx_path = resolve(f"zoo:{name}")
                    model = base
                else:
                    model = resized_variant(base, size)
                    onnx_path = Path(tmp) / f"{name}-{size}.onnx"
                    onnx_path.write_bytes(model.SerializeToString())
                shape = lambda b: (b, 3, size, size)  # noqa: E731
                options = trt_build.BuildOptions(
                    profiles=[{"input": (shape(1), shape(batch), shape(batch))}],
                    precision=args.precision,
                    workspace_mb=args.workspace_mb,
                    timing_cache=args.cache_dir / "timing.cache",
                )
                print(f"building {name} input {size} max batch {batch} ...", flush=True)
                plan = trt_build.cached_build(onnx_path, options, args.cache_dir)
                row = Row(name, params, size, batch)
                row.theoretical_peak_mb = peak_activation_bytes(model, batch) / MB
                rows.append(measure(plan, row))
                print(f"  context {row.ctx_delta_mb:.1f} MB measured, {row.ctx_reported_mb:.1f} MB reported", flush=True)

    at = {(r.model, r.input_size, r.max_batch): r for r in rows}
    _print_table(
        "1. context memory at max batch 32 (input 224)",
        ["model", "params", "context MB (measured)", "context MB (TensorRT)"],
        [[m, at[m, 224, 32].params, at[m, 224, 32].ctx_delta_mb, at[m, 224, 32].ctx_reported_mb] for m in args.models],
    )
    for m in args.models:
        _print_table(
            f"2. {m}: context memory by max batch (input 224)",
            ["max batch", "context MB (measured)", "context MB (TensorRT)", "theoretical peak activation MB"],
            [[b, at[m, 224, b].ctx_delta_mb, at[m, 224, b].ctx_reported_mb, at[m, 224, b].theoretical_peak_mb] for b in BATCHES],
        )
    for m in args.models:
        _print_table(
            f"3. {m}: context memory by input size (max batch 32)",
            ["input size", "context MB (measured)", "context MB (TensorRT)"],
            [[s, at[m, s, 32].ctx_delta_mb, at[m, s, 32].ctx_reported_mb] for s in SIZES],
        )
    _print_table(
        "4. load and release (max batch 32, input 224)",
        ["model", "load+ctx MB", "returned by ctx MB", "returned by engine MB", "residue MB"],
        [
            [m, at[m, 224, 32].load_ctx_mb, at[m, 224, 32].returned_ctx_mb, at[m, 224, 32].returned_engine_mb,
             at[m, 224, 32].residue_mb]
            for m in args.models
        ],
    )

    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        fields = list(asdict(rows[0])) + ["load_ctx_mb"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            d = asdict(r)
            d["load_ctx_mb"] = r.load_ctx_mb
            writer.writerow(d)
    print(f"\nwrote {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
