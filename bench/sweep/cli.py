"""``python -m bench sweep``: the command line of the sweep (options, checks, main), and
:func:`sweep_subprocess` for benches that run it as a command and read its CSV."""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import urllib.error
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import bench.sweep
from bench.sweep import report
from bench.sweep.arrivals import KINDS
from bench.sweep.h2load import h2load_binary, h2load_refuses
from bench.sweep.report import COLUMN_DOCS
from bench.sweep.requests import base_url, build_request, http_get, make_tensor, model_path, parse_shape, resolve_inputs
from bench.sweep.run import SweepConfig, run_sweep
from engines.datatypes import NUMPY_DTYPES


def parse_list(text: str, kind: type = float) -> list:
    """``"10,20,50"`` or a range ``"start:stop:step"`` (stop included) -> values; positive only."""
    values: list = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            a, b, s = (float(x) for x in part.split(":"))
            if s <= 0:
                raise ValueError(f"range step must be > 0 in {part!r}")
            values += [kind(a + i * s) for i in range(math.floor((b - a) / s + 1e-9) + 1)]
        else:
            values.append(kind(float(part)) if kind is int else kind(part))
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"expected positive values like 10,20,50 or 10:100:10 (got {text!r})")
    return values


DESCRIPTION = bench.sweep.__doc__.split("\n\n")[0] + """

Open loop (default): requests go out at the offered rate whatever the server does; latency counts from each
request's scheduled send time (no coordinated omission). Closed loop: N clients, each sending its next request
when the previous one is answered. Writes OUT/sweep.csv and OUT/sweep.json after every step, then OUT/sweep.png
(needs matplotlib: pip install -e ".[bench]"), and prints the table. The input comes from the model metadata
(GET /v2/models/NAME), from --input-name/--datatype/--shape, or from --input-file."""

EPILOG = "CSV columns:\n" + "\n".join(f"  {c:<17} {d}" for c, d in COLUMN_DOCS.items() if d) + """

examples:
  python -m bench sweep --url 127.0.0.1:8000 --model resnet18 --rates 50,100,200 --duration 10 --out out/r18
  python -m bench sweep --url 127.0.0.1:8000 --model ppocr_rec --shape 1,3,48,320 --rates 10:50:10 --json \\
      --arrivals poisson --timeout-us 200000 --duration 5 --out out/rec
  python -m bench sweep --url 127.0.0.1:8000 --model tiny_cnn --mode closed --concurrency 1,4,16 \\
      --duration 5 --out out/closed
  Triton: --url 127.0.0.1:8000 --metrics-url http://127.0.0.1:8002/metrics"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 or 127.0.0.1:8000")
    g.add_argument("--model", required=True, help="model name")
    g.add_argument("--model-version", default=None, help="model version (default: the server's choice)")
    g.add_argument("--metrics-url", default=None,
                   help="Prometheus endpoint for average batch sizes (default: URL/metrics; Triton serves "
                        "them on port 8002)")
    g.add_argument("--no-metrics", action="store_true", help="do not read /metrics (avg_batch_size blank)")
    g = p.add_argument_group("load")
    g.add_argument("--mode", choices=["open", "closed"], default="open",
                   help="open: fixed offered rates (--rates); closed: N concurrent clients (--concurrency) "
                        "(default: open)")
    g.add_argument("--rates", default=None,
                   help="open loop: offered rates in req/s, comma separated or start:stop:step, e.g. 20,40,80 "
                        "or 10:100:10")
    g.add_argument("--concurrency", default=None,
                   help="closed loop: client counts to sweep, e.g. 1,4,16 (or start:stop:step)")
    g.add_argument("--arrivals", choices=list(KINDS), default="constant",
                   help="open loop: evenly spaced sends or a Poisson process (default: constant)")
    g.add_argument("--duration", type=float, default=10.0, help="measured seconds per step (default: 10)")
    g.add_argument("--warmup", type=float, default=1.0,
                   help="seconds at the same load before each step's window, not measured (default: 1)")
    g.add_argument("--generator", choices=["python", "h2load"], default="python",
                   help="who sends: this package's drivers (default) or nghttp2's h2load, a native load generator "
                        "(apt install nghttp2-client; HTTP/1.1, constant arrivals, one process). With h2load, "
                        "--max-inflight caps an open-loop step's connections, open-loop latency counts from each "
                        "send's due time (a late send keeps the server's answer; --max-send-lag-ms does not "
                        "apply), and --client-timeout counts late answers as client-timeout "
                        "(bench/sweep/h2load.py)")
    g.add_argument("--processes", type=int, default=1,
                   help="client processes sharing the load, so the client is not the bottleneck (default: 1)")
    g.add_argument("--max-inflight", type=int, default=512,
                   help="open loop: most outstanding requests (all processes together); beyond it a request "
                        "is not sent and counts as client-overload (default: 512)")
    g.add_argument("--max-send-lag-ms", type=float, default=100.0,
                   help="open loop: a request the client cannot send within this many ms of its scheduled "
                        "time is not sent and counts as client-overload (default: 100)")
    g.add_argument("--client-timeout", type=float, default=10.0,
                   help="seconds to wait for an answer before counting client-timeout (default: 10)")
    g.add_argument("--seed", type=int, default=0, help="seed of Poisson arrivals and random inputs (default: 0)")
    g = p.add_argument_group("request")
    g.add_argument("--json", action="store_true", help="JSON tensors (default: the binary tensor extension)")
    g.add_argument("--timeout-us", type=int, default=None,
                   help="per-request deadline sent as parameters.timeout (microseconds)")
    g.add_argument("--input-name", default=None,
                   help="input to send (default: every input in the model metadata)")
    g.add_argument("--datatype", default=None, choices=list(NUMPY_DTYPES),
                   help="input datatype (default: from the metadata)")
    g.add_argument("--shape", action="append", default=[], metavar="[NAME:]DIMS",
                   help="input shape, e.g. 1,3,224,224 or 1x3x48x320: all dims, or just the metadata's -1 dims "
                        "in order; NAME: for one input of several; repeatable (default: the metadata's, with a "
                        "leading -1 set to --batch-size)")
    g.add_argument("--batch-size", type=int, default=1,
                   help="rows per request where the metadata's leading dim is -1 and no --shape (default: 1)")
    g.add_argument("--input-file", action="append", default=[], metavar="[NAME=]FILE",
                   help="sample tensor(s) sent as they are (include the batch dim): .npy for one input "
                        "(--input-name or the first), .npz for inputs by name; repeatable")
    g = p.add_argument_group("output")
    g.add_argument("--out", required=True, type=Path,
                   help="directory for sweep.csv and sweep.json (written after every step) and sweep.png")
    g.add_argument("--title", default=None, help="plot title (default: model, mode and arrivals)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _load_arrays(items: Sequence[str]) -> dict[str | None, np.ndarray]:
    arrays: dict[str | None, np.ndarray] = {}
    for item in items:
        name, _, path = item.rpartition("=") if "=" in item else (None, "", item)
        loaded = np.load(path, allow_pickle=True)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            if name:
                raise ValueError(f"--input-file {item}: an .npz names its inputs itself")
            arrays.update({k: loaded[k] for k in loaded.files})
        else:
            arrays[name or None] = loaded
    return arrays


def main(args: argparse.Namespace) -> int:
    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    try:
        # each mode sweeps its own option: (mode, option, its value, its kind, an example)
        levels = [("open", "--rates", args.rates, float, "20,40,80"),
                  ("closed", "--concurrency", args.concurrency, int, "1,4,16")]
        (_, flag, text, kind, example), (other_mode, other_flag, other_text, _, _) = (
            levels if args.mode == "open" else levels[::-1])
        if other_text:
            return fail(f"{other_flag} is for --mode {other_mode} ({args.mode} loop sweeps {flag})")
        if not text:
            return fail(f"{flag} is required in {args.mode} loop (e.g. {flag} {example})")
        try:
            values = parse_list(text, kind)
        except ValueError as e:
            return fail(f"{flag} {text!r}: {e}")
        rates, conc = (values, []) if args.mode == "open" else ([], values)
        if args.duration <= 0 or args.warmup < 0 or args.processes < 1 or args.max_inflight < 1:
            return fail("--duration must be > 0, --warmup >= 0, --processes >= 1, --max-inflight >= 1")
        if args.processes > args.max_inflight and args.mode == "open":
            return fail("--max-inflight must be at least --processes")
        if args.generator == "h2load":
            if refused := h2load_refuses(args.arrivals, args.processes):
                return fail(refused)
            h2load_binary()  # RuntimeError, below, if it is not installed
        shapes: dict[str | None, list[int]] = {}
        for s in args.shape:
            name, dims = parse_shape(s)
            shapes[name] = dims
        arrays = _load_arrays(args.input_file)
        base = base_url(args.url)
    except (ValueError, OSError, RuntimeError) as e:
        return fail(str(e))

    meta = None
    meta_error = ""
    try:
        meta = json.loads(http_get(base + model_path(args.model, args.model_version)))
    except urllib.error.HTTPError as e:  # the server answered: no such model (or version), or no metadata
        meta_error = f" (GET {model_path(args.model, args.model_version)}: {e})"
        if e.code == 404:
            return fail(f"the server at {base} has no model {args.model!r}"
                        + (f" version {args.model_version}" if args.model_version else "") + meta_error)
    except (urllib.error.URLError, OSError) as e:  # nobody answered
        return fail(f"cannot reach a server at {base} (GET {model_path(args.model, args.model_version)}: {e})")
    except ValueError as e:
        meta_error = f" (GET {model_path(args.model, args.model_version)}: {e})"
    try:
        specs = resolve_inputs(meta, input_name=args.input_name, datatype=args.datatype, shapes=shapes,
                               arrays=arrays, batch_size=args.batch_size)
    except ValueError as e:
        return fail(f"{e}{meta_error}")
    try:  # only once the server answered: a sweep that cannot start leaves no folder behind
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return fail(f"--out {args.out}: {e.strerror or e}")
    rng = np.random.default_rng(args.seed)
    tensors = [(s.name, s.datatype, make_tensor(s, rng)) for s in specs]
    body, headers = build_request(tensors, binary=not args.json, timeout_us=args.timeout_us)
    metrics_url = None if args.no_metrics else (args.metrics_url or base + "/metrics")
    cfg = SweepConfig(
        url=base, model=args.model, mode=args.mode, rates=rates, concurrency=conc, duration=args.duration,
        warmup=args.warmup, arrivals=args.arrivals, processes=args.processes, max_inflight=args.max_inflight,
        max_lag_s=args.max_send_lag_ms / 1e3, client_timeout_s=args.client_timeout, metrics_url=metrics_url,
        version=args.model_version, seed=args.seed, progress=not args.no_progress, generator=args.generator,
    )
    desc = ", ".join(f"{n} {d} {list(t.shape)}" for n, d, t in tensors)
    print(f"{args.model} at {base}: {desc}, {'JSON' if args.json else 'binary'}, {len(body)} B/request, "
          f"{args.mode} loop" + (f", {args.arrivals} arrivals" if args.mode == "open" else ""), file=sys.stderr)
    info = {"settings": {k: v for k, v in vars(args).items() if k != "func"},
            "inputs": [{"name": n, "datatype": d, "shape": list(t.shape)} for n, d, t in tensors],
            "request_bytes": len(body)}
    rows: list[dict] = []
    interrupted = False

    def stop(signum, frame):  # SIGTERM as Ctrl-C: the finished steps are kept, h2load and client processes end
        raise KeyboardInterrupt  # before and after the steps; during them the event loop takes it (run_sweep)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        run_sweep(cfg, body, headers, rows, on_step=lambda done: report.save_sweep(args.out, done, info),
                  sigterm_interrupts=True)
    except RuntimeError as e:  # h2load failed to run
        return fail(str(e))
    except KeyboardInterrupt:
        print(f"\ninterrupted: keeping the {len(rows)} finished step(s)", file=sys.stderr)
        interrupted = True
        if not rows:
            return 130
    finally:
        signal.signal(signal.SIGTERM, previous)

    title = args.title or (f"{args.model}: {args.mode} loop" + (f", {args.arrivals}" if args.mode == "open" else "")
                           + f", {args.duration:g} s/step, {'JSON' if args.json else 'binary'}"
                           + (", h2load" if args.generator == "h2load" else ""))
    written = report.save_sweep(args.out, rows, info)
    png = report.plot_sweep(rows, args.out / "sweep.png", title)
    print(report.format_table(rows))
    print(f"wrote {', '.join(str(p) for p in [written[0], *([png] if png else []), written[1]])}", file=sys.stderr)
    if interrupted:
        return 130
    if not any(r["ok"] for r in rows):  # a misconfiguration, not a measurement: say so in the exit status
        print(f"error: no request was answered 200 in any step ({rows[0]['errors_by_status'] or 'no requests'})",
              file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------- for the other benches


def sweep_command(url: str, model: str, out: Path, *options: str) -> list[str]:
    """The ``python -m bench sweep`` command line for ``model`` at ``url``, results in ``out``, no progress bar."""
    return [sys.executable, "-m", "bench", "sweep", "--url", url, "--model", model, "--out", str(out),
            "--no-progress", *options]


def sweep_subprocess(url: str, model: str, out: Path, *options: str) -> list[dict[str, str]]:
    """Run ``python -m bench sweep`` (stdout discarded) and return its ``sweep.csv`` rows (strings, as written)."""
    subprocess.run(sweep_command(url, model, out, *options), check=True, stdout=subprocess.DEVNULL)
    return report.read_csv(out / "sweep.csv")


def start_sweep_subprocess(url: str, model: str, out: Path, *options: str) -> subprocess.Popen:
    """Start ``python -m bench sweep`` (stdout discarded); read ``out/sweep.csv`` with
    :func:`bench.sweep.report.read_csv` once it has exited."""
    return subprocess.Popen(sweep_command(url, model, out, *options), stdout=subprocess.DEVNULL)
