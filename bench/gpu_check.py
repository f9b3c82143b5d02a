"""A quick check of the GPU path before the long bench (about a minute on an H200): ``python -m bench.gpu_check``.

For resnet18 and mid_cnn, in both arrangements of CUDA-graph contexts (threads of this process; worker processes,
``mode: multiproc``):

1. creates contexts with a CUDA graph per allowed size (1, 2, 4, 8) and checks they are graph contexts;
2. checks every size against ONNX Runtime on CPU in fp32 (max abs and relative diff printed; TF32 passes at 2e-2
   relative), and a padded batch (3 real rows + 1 zero row in the size-4 graph: the 3 rows as CPU);
3. runs 2 and 4 contexts concurrently for a few seconds (mixed sizes, each batch checked) and prints rows/s;
4. checks fp32 (TF32 off) against CPU at 1e-3, and fp16 when onnxconverter-common is installed.

Exits 1 if anything failed (each failure's traceback is printed), 3 without a CUDA provider.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np

SIZES = (1, 2, 4, 8)
TOLERANCE = {"tf32": 2e-2, "fp32": 1e-3, "fp16": 1e-1}  # max |gpu - cpu| / max |cpu|


def say(*parts: object) -> None:
    print(*parts, flush=True)


def diffs(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(max abs diff, max abs diff / max |want|)."""
    d = float(np.max(np.abs(got.astype(np.float64) - want)))
    return d, d / max(float(np.max(np.abs(want))), 1e-12)


def check_close(what: str, got: np.ndarray, want: np.ndarray, precision: str) -> None:
    ab, rel = diffs(got, want)
    ok = np.isfinite(got).all() and rel <= TOLERANCE[precision]
    say(f"  {what}: max abs diff {ab:.3g}, relative {rel:.3g} ({precision}, limit {TOLERANCE[precision]}) "
        f"{'ok' if ok else 'FAIL'}")
    if not ok:
        raise AssertionError(f"{what}: relative diff {rel:.3g} > {TOLERANCE[precision]}")


class Check:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def step(self, name: str, fn: Callable[[], None]) -> None:
        say(f"\n== {name}")
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:
            self.failures.append(name)
            say(f"FAILED: {name}")
            traceback.print_exc()
            sys.stderr.flush()
        say(f"   ({time.perf_counter() - t0:.1f} s)")


def reference(path, x: np.ndarray) -> np.ndarray:
    from engines.onnxruntime import OnnxRuntimeEngine

    engine = OnnxRuntimeEngine(path, device="cpu", intra_op_threads=0)
    ctx = engine.create_context()
    out = ctx.execute({"input": x})["logits"].astype(np.float64)
    ctx.release()
    engine.release()
    return out


def check_contexts(contexts: list, x: np.ndarray, want: np.ndarray, precision: str) -> None:
    """Every size on the first context, a padded batch, and every context at the largest size."""
    ctx = contexts[0]
    for n in SIZES:
        check_close(f"batch {n}", ctx.execute({"input": x[:n]})["logits"], want[:n], precision)
    padded = np.zeros((4, *x.shape[1:]), np.float32)
    padded[:3] = x[:3]
    check_close("padded 3 -> 4 rows (3 compared)", ctx.execute({"input": padded})["logits"][:3], want[:3], precision)
    for i, other in enumerate(contexts[1:], 1):
        check_close(f"context {i}, batch 8", other.execute({"input": x})["logits"], want, precision)


def concurrent(contexts: list, x: np.ndarray, want: np.ndarray, seconds: float) -> float:
    """Drive every context from its own thread (its executor, when it has one) with sizes 8, 4, 2, 1, 8, ...;
    every output is checked. Returns rows/s over all of them."""
    rows = [0] * len(contexts)
    errors: list[BaseException] = []
    start = threading.Barrier(len(contexts))
    cycle = (8, 4, 2, 1)

    def drive(i: int) -> None:
        ctx = contexts[i]
        try:
            start.wait()
            deadline = time.perf_counter() + seconds
            k = 0
            while time.perf_counter() < deadline:
                n = cycle[k % len(cycle)]
                out = ctx.execute({"input": x[:n]})["logits"]
                if k % 16 == 0 and not diffs(out, want[:n])[1] <= TOLERANCE["tf32"]:
                    raise AssertionError(f"context {i}: wrong output under load at batch {n}")
                rows[i] += n
                k += 1
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    t0 = time.perf_counter()
    runners = []
    for i, ctx in enumerate(contexts):
        executor = getattr(ctx, "executor", None)
        if executor is not None:
            runners.append(executor.submit(drive, i))
        else:
            t = threading.Thread(target=drive, args=(i,))
            t.start()
            runners.append(t)
    for r in runners:
        r.result() if hasattr(r, "result") else r.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(rows) / dt


def arrangement(name: str, model: str, make_engine: Callable[..., object], x: np.ndarray, want: np.ndarray,
                seconds: float) -> None:
    from engines.zoo import resolve

    engine = make_engine(resolve(f"zoo:{model}"), device="cuda", batch_sizes=list(SIZES), precision="tf32",
                         gpu_execution="graphs")
    contexts = []
    try:
        t0 = time.perf_counter()
        makers = [threading.Thread(target=lambda: contexts.append(engine.create_context())) for _ in range(4)]
        if name == "threads":  # one after the other: captures of one process are serialized anyway
            for m in makers:
                m.start()
                m.join()
        else:  # worker processes start in parallel
            for m in makers:
                m.start()
            for m in makers:
                m.join()
        if len(contexts) != 4:
            raise AssertionError(f"only {len(contexts)} of 4 contexts were created (see the errors above)")
        facts = contexts[0].describe()
        say(f"  4 contexts in {time.perf_counter() - t0:.1f} s: {facts}; device MB per context: "
            + ", ".join(f"{c.device_nbytes / 2**20:.0f}" for c in contexts))
        if facts.get("execution") != "cuda_graphs":
            raise AssertionError(f"expected CUDA-graph contexts, got {facts}")
        check_contexts(contexts, x, want, "tf32")
        for k in (1, 2, 4):
            say(f"  {k} context(s) concurrently, sizes 8/4/2/1: {concurrent(contexts[:k], x, want, seconds):,.0f} "
                "rows/s")
    finally:
        for c in contexts:
            c.release()
        engine.release()


def precision_check(model: str, precision: str, x: np.ndarray, want: np.ndarray) -> None:
    from engines.onnxruntime import OnnxRuntimeEngine
    from engines.zoo import resolve

    engine = OnnxRuntimeEngine(resolve(f"zoo:{model}"), device="cuda", batch_sizes=[8], precision=precision,
                               gpu_execution="graphs")
    ctx = engine.create_context()
    try:
        say(f"  {ctx.describe()}")
        check_close(f"{precision} batch 8", ctx.execute({"input": x})["logits"], want, precision)
    finally:
        ctx.release()
        engine.release()


def environment() -> None:
    import onnxruntime as ort

    from engines.cuda import compute_capability, device_count, mem_get_info

    say(f"  onnxruntime {ort.__version__}, providers {ort.get_available_providers()}")
    free, total = mem_get_info(0)
    say(f"  {device_count()} CUDA device(s); device 0: compute capability {compute_capability(0)}, "
        f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet18,mid_cnn")
    p.add_argument("--seconds", type=float, default=1.5, help="seconds of each concurrent run")
    p.add_argument("--arrangements", default="threads,processes")
    args = p.parse_args(argv)
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        say("CUDAExecutionProvider is not available: install onnxruntime-gpu on a machine with a GPU")
        return 3
    from engines.multiproc import MultiprocEngine
    from engines.onnxruntime import OnnxRuntimeEngine
    from engines.zoo import resolve

    t0 = time.perf_counter()
    check = Check()
    check.step("environment", environment)
    x = np.random.default_rng(0).standard_normal((8, 3, 224, 224)).astype(np.float32)
    makers = {"threads": OnnxRuntimeEngine, "processes": MultiprocEngine}
    for model in args.models.split(","):
        want = reference(resolve(f"zoo:{model}"), x)
        for name in args.arrangements.split(","):
            check.step(f"{model}: CUDA-graph contexts as {name}",
                       lambda: arrangement(name, model, makers[name], x, want, args.seconds))
        if model == "resnet18":
            check.step(f"{model}: fp32 (TF32 off)", lambda: precision_check(model, "fp32", x, want))
            if importlib.util.find_spec("onnxconverter_common") is not None:
                check.step(f"{model}: fp16", lambda: precision_check(model, "fp16", x, want))
            else:
                say("\n== fp16 skipped: onnxconverter-common is not installed")
    say(f"\n{'FAILED: ' + ', '.join(check.failures) if check.failures else 'all checks passed'} "
        f"({time.perf_counter() - t0:.0f} s)")
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
