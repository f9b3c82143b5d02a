"""Where a pipelined GPU context waits: reads the per-batch timelines of :mod:`batcher.batch_trace` (a server run
with ``BATCHER_BATCH_TRACE=DIR``; ``bench.gpu_scale`` writes each step's window to ``DIR/steps.csv``) and prints,
per step, how often the device sat idle before a batch and which step of that batch's way was late.

    BATCHER_BATCH_TRACE=/tmp/tr python -m bench.gpu_scale --parts r,m --frontends 8 --duration 8
    python -m bench.gpubench.trace /tmp/tr --out bench/results/gpu_scale/traceN

A batch whose device idle time before it (the context's CUDA timing events) is over ``--idle-us`` is put in one
class, the first that holds, comparing it (k) with the batch launched before it in the same process (k-1: the batch
before it on its context where each engine process has one context, as in ``bench.gpu_scale`` by default; with
several the trace cannot tell them apart):

* ``queued in time``: k was queued for the context's thread before that thread began waiting for k-1
  (``put(k) <= collect0(k-1)``): k was launched behind k-1 and still the device waited, so its launch (copies,
  graph, the GIL in between) took longer than what was left of k-1;
* ``dispatched late``: k left the scheduler only after k-1 was launched (``dispatch(k) > launch1(k-1)``): no
  batch, or no staging token, was ready sooner;
* ``staged late``: k was dispatched in time but staged after the context's thread had begun waiting for k-1.

Columns of each step's row: batches, their mean rows, the device's busy share (the batches' timing events over the
window), the share of batches the device idled before and the idle ms per batch, the count of each class, the
medians (p90) of the intervals between steps (ms), of the gaps between the event loop's dispatches and settles
(``loop_gap``, ms: how long the loop went without a batch's turn), and the batches in the pipeline (dispatched, not
settled) at each dispatch.

Only a pipelined context's batches have every step (a CUDA-graph context); a trace with none of those is said so.
``steps.csv`` (written by ``bench.gpu_scale``, no header) has one line per step: label, start, end (the trace's
clock) and the measured seconds; each step's window is the last ``seconds`` of its load, less a quarter second at
each end. Without it the whole trace is one step.
"""

from __future__ import annotations

import csv
import gzip
import sys
from pathlib import Path

import numpy as np

from batcher.batch_trace import STEPS
from bench.scripts import script_parser
from bench.sweep.report import markdown_table, write_csv

#: (name, from step, to step) of the intervals reported, in the order a batch passes them
INTERVALS = (("dispatch>stage", "dispatch", "stage0"), ("stage", "stage0", "stage1"), ("put>launch", "put", "launch0"),
             ("launch", "launch0", "launch1"), ("wait", "collect0", "collect1"), ("collect>post", "collect1", "post"),
             ("post>finish", "post", "finish"))


def read_batches(folder: Path) -> tuple[list[dict[str, float]], int]:
    """Every traced batch of every process (``batches-*.csv``, or ``.csv.gz`` as committed) with every step, by
    launch time, and how many rows were read in all. A file that cannot be read is said on stderr and skipped."""
    rows, seen = [], 0
    for path in sorted([*folder.glob("batches-*.csv"), *folder.glob("batches-*.csv.gz")]):
        try:
            with (gzip.open(path, "rt", newline="") if path.suffix == ".gz" else open(path, newline="")) as f:
                for r in csv.DictReader(f):
                    seen += 1
                    if all(r.get(s) for s in STEPS):
                        row = {k: float(v) for k, v in r.items() if v not in ("", None)}
                        row["process"] = path.name.split(".")[0]
                        rows.append(row)
        except (OSError, EOFError, ValueError, csv.Error) as exc:
            print(f"skipping {path}: {exc}", file=sys.stderr)
    return sorted(rows, key=lambda r: r["launch0"]), seen


def read_steps(folder: Path) -> list[tuple[str, float, float, float]]:
    """``steps.csv``: (label, start, end, measured seconds) per step; one step over everything when absent."""
    path = folder / "steps.csv"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        label, start, end, duration = line.rsplit(",", 3)
        out.append((label, float(start), float(end), float(duration)))
    return out


def classify(prev: dict[str, float], cur: dict[str, float]) -> str:
    """Why the device idled before ``cur`` (module docstring), given the batch before it on the same context."""
    if cur["put"] <= prev["collect0"]:
        return "queued in time"
    if cur["dispatch"] > prev["launch1"]:
        return "dispatched late"
    return "staged late"


def _ms(values: list[float]) -> str:
    if not values:
        return ""
    a = np.asarray(values) * 1e3
    return f"{np.median(a):.3f} ({np.percentile(a, 90):.3f})"


def summarize(batches: list[dict[str, float]], label: str, start: float, end: float, idle_s: float) -> dict:
    """One step's row over the batches dispatched in ``[start, end]``."""
    inside = [b for b in batches if start <= b["dispatch"] <= end]
    span = end - start
    row: dict = {"step": label, "seconds": round(span, 2), "batches": len(inside)}
    if not inside or span <= 0:
        return row
    row["mean_rows"] = round(float(np.mean([b["rows"] for b in inside])), 2)
    busy = [b["device_s"] for b in inside if "device_s" in b]
    row["device_busy_share"] = round(sum(busy) / span, 3) if busy else None
    classes = {"queued in time": 0, "dispatched late": 0, "staged late": 0}
    idle_total = 0.0
    by_process: dict[str, list[dict[str, float]]] = {}
    for b in inside:
        by_process.setdefault(b["process"], []).append(b)
    idle_n = 0
    for seq in by_process.values():
        for prev, cur in zip(seq, seq[1:]):
            idle = cur.get("idle_s", 0.0)
            if idle > idle_s:
                idle_n += 1
                idle_total += idle
                classes[classify(prev, cur)] += 1
    row["idle_batches_share"] = round(idle_n / len(inside), 3)
    row["idle_ms_per_batch"] = round(idle_total / len(inside) * 1e3, 3)
    for name, n in classes.items():
        row[name.replace(" ", "_")] = n
    for name, a, b in INTERVALS:
        row[name] = _ms([x[b] - x[a] for x in inside])
    loop_events = np.sort([b["dispatch"] for b in inside] + [b["finish"] for b in inside])
    row["loop_gap"] = _ms(list(np.diff(loop_events)))
    # batches dispatched and not finished, seen at each dispatch: the pipeline's depth in batches
    starts = np.sort([b["dispatch"] for b in inside])
    ends = np.sort([b["finish"] for b in inside])
    depth = np.searchsorted(starts, starts, "right") - np.searchsorted(ends, starts, "right")
    row["in_pipe_median"] = float(np.median(depth))
    return row


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.gpubench.trace", __doc__)
    p.add_argument("folder", type=Path, help="the BATCHER_BATCH_TRACE folder of a run")
    p.add_argument("--idle-us", type=float, default=50.0,
                   help="device idle before a batch that counts, us (default: 50)")
    p.add_argument("--out", type=Path, default=None, help="folder for trace_summary.csv/.md")
    args = p.parse_args(argv)
    if args.idle_us < 0:
        p.error("--idle-us must be 0 or more")
    batches, seen = read_batches(args.folder)
    if not batches:
        print(f"no traced batches in {args.folder}" if not seen else
              f"{seen} batches traced in {args.folder}, none with every step: none ran on a pipelined context "
              "(a CUDA-graph context; on a CPU context only dispatch and finish are stamped)", file=sys.stderr)
        return 1
    steps = read_steps(args.folder) or [("all", batches[0]["dispatch"], batches[-1]["dispatch"] + 1.0,
                                         batches[-1]["dispatch"] - batches[0]["dispatch"])]
    rows = []
    for label, start, end, duration in steps:
        # the measured window: the last `duration` seconds of the step's load (its last batch ends the load), less
        # a quarter second at each end
        last = max((b["dispatch"] for b in batches if start <= b["dispatch"] <= end), default=end)
        lo, hi = max(start, last - duration + 0.25), last - 0.25
        if hi <= lo:  # a step shorter than half a second: all of it
            lo, hi = start, last
        rows.append(summarize(batches, label, lo, hi, args.idle_us / 1e6))
    table = markdown_table(rows)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(args.out / "trace_summary.csv", rows)
        (args.out / "trace_summary.md").write_text(f"# Where the device waited ({args.folder.name})\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
