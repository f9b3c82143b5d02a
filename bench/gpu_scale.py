"""Issue 10 on a GPU machine: front-end processes, shared memory, retention, two GPUs; resnet18 through HTTP.

Run on a machine with an NVIDIA GPU, onnxruntime-gpu, cuda-python and uvloop (extras gpu, uvloop)::

    python -m bench.gpu_scale --out bench/results/gpu_scale --parts r,n        # about 6 minutes on an H200
    python -m bench.gpu_scale --out bench/results/gpu_scale --parts r,m,t      # about 5 minutes
    python -m bench.gpu_scale --out bench/results/gpu_scale --parts r,g        # on a machine with two GPUs

Every step starts a real ``batcher serve`` (resnet18, ``--instances`` contexts per GPU, the GPU issue's allowed
batch sizes 1,2,4,8,16,32 and ``--precision``, ``--delay-us`` batch window) and drives it with the toolkit's
closed-loop driver (:func:`bench.sweep.run.run_sweep`) in ``--client-processes`` processes on the same machine,
one image per request, binary tensors; each row has the throughput, p50/p99, the batch size formed, the server's
CPU per request (all its processes) and the ratio to the raw engine's rows/s at that batch size (part r, same run).

* (r) ``gpu_a_raw``: the raw engine (bench.gpu_bench's part a) at ``--precision``: the reference of the ratios;
* (d) ``scale_d_dma``: one context's batch of 32 by where its input lies (pinned staging, a registered
  front-end area one DMA per request or back to back), alone and beside a thread running Python; GPU only;
* (s) ``scale_s_switch``: throughput at saturation by the engine's GIL switch interval (``--switch-sweep-us``,
  ``server.gil_switch_interval_us``), at the largest ``--frontends``;
* (n) ``scale_n_frontends``: throughput at saturation (``--clients``) for ``--frontends`` (0: single-process
  mode; default 0,1,2,4,8), the curve the issue asks for;
* (m) ``scale_m_shm``: the input in system shared memory (Triton's extension, one registered segment) against
  binary HTTP, at the largest number of front ends;
* (t) ``scale_t_retention``: two models served together (``--retention-models``, default two copies of the
  model; seed 000 served ``tiny_cnn,resnet18``), ``--retention-instances`` contexts each (the seed: 4), at each of
  ``--retention-clients`` clients per model (the seed: 4; 16 is at saturation on an H200), alone then together:
  what each keeps, and the seed's ratio; both in one engine process
  (``shared``), in an engine process each (``per_model``), the same under NVIDIA MPS (``per_model_mps``) or in a
  server each (``separate``, ``--retention-layouts``); first ``scale_t_raw_pair``, two contexts with no HTTP;
* (g) ``scale_g_gpus``: ``gpus: [0]`` against ``gpus: [0, 1]`` (one engine process and queue per GPU), twice the
  clients on two; skipped on a machine with one GPU.
* (p) ``scale_p_threads`` (and, with py-spy, ``scale_p_functions``): CPU per thread of every server process at
  saturation, the largest ``--frontends``; where the CPU goes (:mod:`bench.gpubench.profile`).

Progress lines are flushed as each step ends; each part writes ``OUT/<part>.csv``, ``.md`` (and ``.png``) when it
ends. ``--device cpu`` runs the parts on the CPU provider with tiny settings: a dry run of the code, not a
measurement.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.gpubench.common import add_load_arguments, chosen_parts, cuda_provider_missing, say
from bench.gpubench.scale import cpu_list
from bench.scripts import comma_list, script_parser


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.gpu_scale", __doc__)
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu_scale"), help="folder for CSV, tables, PNG")
    p.add_argument("--parts", default="r,n,m,t,g", help="which parts: r (raw engine), d, s, n, m, t, g, p")
    p.add_argument("--model", default="resnet18", help="zoo model (default: resnet18)")
    p.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "fp16"], help="GPU precision")
    p.add_argument("--instances", type=int, default=1, help="execution contexts per GPU (default: 1)")
    p.add_argument("--frontends", type=comma_list(int), default=[0, 1, 2, 4, 8],
                   help="(n): front ends to try; 0: one process")
    p.add_argument("--event-loop", choices=["asyncio", "uvloop"], default="uvloop", help="server.event_loop")
    p.add_argument("--buffer-mb", type=int, default=256, help="server.frontend_buffer_mb (per front end x engine)")
    p.add_argument("--retention-clients", type=comma_list(int), default=[4, 16],
                   help="(t): closed-loop clients per model, each a step (default 4,16; seed 000: 4)")
    p.add_argument("--retention-instances", type=int, default=None,
                   help="(t): contexts per model (default: --instances; seed 000: 4)")
    p.add_argument("--retention-rounds", type=int, default=1,
                   help="(t): rounds of alone-then-together at each client count; rows give the median round "
                        "(default: 1)")
    p.add_argument("--retention-models", type=comma_list(str), default=None,
                   help="(t): the two zoo models (default: two copies of --model; seed 000: tiny_cnn,resnet18)")
    p.add_argument("--retention-layouts", type=comma_list(layout), default=["shared", "per_model"],
                   help="(t): shared (one engine process, both models), per_model (engine_processes: per_model), "
                        "per_model_mps (the same with server.cuda_mps: NVIDIA MPS), separate (a server per model)")
    p.add_argument("--duration", type=float, default=6.0, help="measured seconds per step")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each step")
    p.add_argument("--gil-switch-us", type=switch_value, default=None,
                   help="server.gil_switch_interval_us of every step (default: the server's, 200); 'best': part s's")
    p.add_argument("--switch-sweep-us", type=comma_list(int), default=[5000, 1000, 200, 50],
                   help="(s): the values to try")
    p.add_argument("--raw-seconds", type=float, default=0.5, help="(r): seconds per batch size")
    p.add_argument("--profile-seconds", type=float, default=4.0, help="(p): seconds of CPU sampling")
    p.add_argument("--profile-transport", choices=["binary", "shm"], default="binary",
                   help="(p): the load's input: binary HTTP, or system shared memory (one registered region)")
    p.add_argument("--py-spy", default=None, help="(p): the py-spy binary (default: py-spy on PATH, else none)")
    p.add_argument("--engine-cpus", type=cpu_list, default=None,
                   help="pin the engine processes' threads to these CPUs (0-2,5), the front ends and the load "
                        "generator to the others (default: no pinning)")
    p.add_argument("--cuda-blocking-sync", action="store_true",
                   help="server.cuda_blocking_sync in every step, and in the raw engine's contexts (default: off)")
    p.add_argument("--engine-nice", type=int, default=None, help="the engine threads' nice value (default: as is)")
    add_load_arguments(p, clients=512, client_processes=6, delay_us=2000)  # --clients: at saturation, per GPU in g
    args = p.parse_args(argv)
    parts = chosen_parts(p, args.parts, "r,d,s,n,m,t,g,p")
    args.kind = "KIND_GPU" if args.device == "cuda" else "KIND_CPU"
    if args.device == "cpu":
        args.precision = "fp32"
    missing = cuda_provider_missing(args.device)
    if missing:
        say(missing)
        return 3

    run_parts(parts, args)
    return 0


def layout(text: str) -> str:
    """``--retention-layouts``: shared, per_model, per_model_mps or separate."""
    if text not in ("shared", "per_model", "per_model_mps", "separate"):
        raise ValueError(text)
    return text


def switch_value(text: str) -> int | str:
    """``--gil-switch-us``: microseconds, or ``best`` (part s's fastest)."""
    return text if text == "best" else int(text)


def run_parts(parts: set[str], args) -> None:
    """The raw engine (always: the ratios' reference), then each part asked for, in order."""
    from bench.gpubench import dma, profile, scale
    from bench.gpubench.raw import part_a

    t0 = time.perf_counter()
    if args.cuda_blocking_sync:
        from engines.base import ExecutionContext

        ExecutionContext.blocking_sync = True
    say(f"== (r) raw engine: {args.model} {args.precision}"
        f"{' (cuda_blocking_sync)' if args.cuda_blocking_sync else ''}")
    raw = part_a([args.model], [args.precision], args.device, args.raw_seconds, args.out)
    if args.gil_switch_us == "best" and "s" not in parts:
        args.gil_switch_us = None  # the server's default
    for key, title, fn in (("d", "host-to-device paths", dma.part_dma), ("s", "GIL switch interval", scale.part_switch),
                           ("n", "front ends", scale.part_frontends), ("m", "system shared memory", scale.part_shm),
                           ("t", "retention", scale.part_retention), ("g", "two GPUs", scale.part_gpus),
                           ("p", "where the CPU goes", profile.part_profile)):
        if key in parts:
            say(f"== ({key}) {title} ({time.perf_counter() - t0:.0f} s)")
            fn(raw, args, args.out)
    say(f"\nparts {','.join(sorted(parts))} done in {time.perf_counter() - t0:.0f} s; results in {args.out}")


if __name__ == "__main__":
    sys.exit(main())
