"""The GPU bench of issue 9: the raw engine, the batcher without HTTP, the service through HTTP, and device memory.

Run on a machine with an NVIDIA GPU, onnxruntime-gpu and cuda-python (onnxconverter-common for fp16)::

    python -m bench.gpu_bench --out bench/results/gpu                 # every part (estimated 7-8 minutes, H200)
    python -m bench.gpu_bench --parts a,d    # then --parts b,c: two calls that each fit a 10-minute window

One run writes, per part, a table (``.md``, also printed), a ``.csv`` (as soon as the part ends) and a ``.png``:

* (a) ``gpu_a_raw``, ``gpu_a_precision``: the raw engine (one context, a CUDA graph per allowed size 1..32) in
  rows/s at every allowed size and over a mixed-size workload, per precision (fp32 = TF32 off, tf32, fp16), each
  batch copied once from numpy into pinned memory; at batch 32 the TF32/fp32 and fp16/TF32 ratios and each
  precision's max abs and relative error against fp32 on CPU; tiny_cnn, mid_cnn, resnet18;
* (b) ``gpu_b_runner``: the batcher and executors without HTTP (``DataPlane.infer`` with no-op read/deliver,
  closed-loop asyncio clients), 1/2/4 contexts, batching on/off, contexts in this process and in worker processes;
* (c) ``gpu_c_http``: the same through HTTP (a real ``batcher serve``, binary tensors, the toolkit's closed-loop
  driver in client processes), with the server's CPU per request and the executor's times per batch;
* (d) ``gpu_d_memory_batch``, ``gpu_d_memory_input``, ``gpu_d_reload``: seed 000's context-memory tables, memory
  returned on release, and load times (cold, bare loop, lru reload);
* (t, not by default) ``gpu_tests.txt``: the output of ``python -m pytest -v tests/gpu``.

Rows of (b) and (c) give their ratio to (a) at the batch size they formed (``over_raw``; tf32, the GPU default)
and, over 1 -> 2 -> 4 contexts with batching on, seed 002's rule (stop adding instances when QPS grows < 30%
while p99 rises > 20%) with the count it picks. Progress lines are flushed as each step ends. ``--device cpu`` runs
every part on the CPU provider (fp32 only) with tiny settings: a dry run of the bench's code, not a measurement.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.gpubench.common import add_load_arguments, chosen_parts, cuda_provider_missing, say
from bench.scripts import script_parser

MODELS = "tiny_cnn,mid_cnn,resnet18"


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.gpu_bench", __doc__)
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu"), help="folder for the tables, CSV, PNG")
    p.add_argument("--parts", default="a,b,c,d", help="which parts to run, e.g. a,b; t: the GPU tests (tests/gpu)")
    p.add_argument("--duration", type=float, default=3.0, help="measured seconds of each (b)/(c) step")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each (b)/(c) step")
    p.add_argument("--raw-seconds", type=float, default=0.4, help="(a): seconds per batch size and precision")
    p.add_argument("--models", default=MODELS, help="(a) and (d)")
    p.add_argument("--precisions", default="fp32,tf32,fp16", help="(a)")
    p.add_argument("--service-models", default="resnet18", help="(b) and (c)")
    p.add_argument("--contexts", default="1,2,4", help="(b) and (c): contexts per model")
    p.add_argument("--modes", default="inprocess,multiproc", help="(b): where contexts run")
    p.add_argument("--http-modes", default="inprocess", help="(c): where contexts run")
    p.add_argument("--reloads", type=int, default=2, help="(d): bare-loop loads and lru rounds per model")
    add_load_arguments(p, clients=256, client_processes=4, delay_us=500)
    args = p.parse_args(argv)
    parts = chosen_parts(p, args.parts, "a,b,c,d,t")

    missing = cuda_provider_missing(args.device)
    if missing:
        say(missing)
        return 3
    kind = "KIND_GPU" if args.device == "cuda" else "KIND_CPU"
    precision = "tf32" if args.device == "cuda" else "fp32"
    precisions = args.precisions.split(",") if args.device == "cuda" else ["fp32"]
    models, service = args.models.split(","), args.service_models.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    t0 = time.perf_counter()
    if "t" in parts:
        import subprocess

        say("== (t) GPU tests: python -m pytest tests/gpu")
        args.out.mkdir(parents=True, exist_ok=True)
        run = subprocess.run([sys.executable, "-m", "pytest", "-v", "tests/gpu"], capture_output=True, text=True)
        (args.out / "gpu_tests.txt").write_text(run.stdout + run.stderr)
        say(run.stdout[-3000:])
    raw: list[dict] = []
    if "a" in parts:
        from bench.gpubench.raw import part_a

        say(f"== (a) raw engine: {models}, {precisions}")
        raw = part_a(models, precisions, args.device, args.raw_seconds, args.out)
    elif {"b", "c"} & parts:  # ratios need the raw engine at the served precision: measure it briefly
        from bench.gpubench.raw import part_a

        say("== (a) raw engine at the served precision, for the ratios of (b)/(c)")
        raw = part_a(service, [precision], args.device, args.raw_seconds, args.out / "ratios")
    if "b" in parts:
        from bench.gpubench.runner import part_b

        say(f"== (b) batcher without HTTP: {service}, contexts {contexts}, modes {args.modes} "
            f"({time.perf_counter() - t0:.0f} s)")
        part_b(service, args.modes.split(","), contexts, kind, raw, precision, args, args.out)
    if "c" in parts:
        from bench.gpubench.http import part_c

        say(f"== (c) through HTTP: {service}, contexts {contexts} ({time.perf_counter() - t0:.0f} s)")
        part_c(service, args.http_modes.split(","), contexts, kind, raw, precision, args, args.out)
    if "d" in parts:
        from bench.gpubench.memory import part_d

        say(f"== (d) device memory and load times: {models} ({time.perf_counter() - t0:.0f} s)")
        part_d(models, args.device, args.reloads, args.out)
    say(f"\ndone in {time.perf_counter() - t0:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
