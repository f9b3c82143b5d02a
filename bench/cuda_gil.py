"""What one CUDA enqueue costs a thread when another thread runs Python: through cuda-python's bindings (which
release the GIL around the call and must take it back) and through the held calls of ``engines.cuda.held``
(which keep it). Needs a CUDA device and cuda-python.

A second thread runs Python for ``duty`` of every millisecond (a busy loop, holding the GIL) and sleeps the rest,
as an engine process's event loop does under load; meanwhile the measuring thread makes ``--calls`` calls of
each kind and times them. Kinds: ``cudaEventRecord`` (bindings) against ``cuEventRecord`` (held), and a batch of
``--copies`` host-to-device copies of 4 KiB from pinned memory in one ``cudaMemcpyBatchAsync`` (bindings)
against one held ``cuMemcpyBatchAsync``. At duty 0 nothing competes: the difference is the call itself.

It prints a table and saves ``OUT/cuda_gil.csv``: ``duty``, ``call``, ``path`` (bindings | held), ``us_per_call``
(median of ``--repeats`` timings of ``--calls`` calls each) and ``held_speedup`` (bindings over held, same duty
and call)::

    python -m bench.cuda_gil --out bench/results/cuda_gil
    python -m bench.cuda_gil --out /tmp/cuda_gil --duties 0,0.5,0.9,1 --switch-us 200
"""

from __future__ import annotations

import csv
import statistics
import sys
import threading
import time
from pathlib import Path

from bench.scripts import comma_list, script_parser


def busy(stop: threading.Event, duty: float) -> None:
    """Hold the GIL running Python for ``duty`` ms of every ms, sleep (GIL free) the rest, until ``stop``."""
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < duty * 1e-3:
            pass
        if duty < 1.0:
            time.sleep((1.0 - duty) * 1e-3)


def timed(fn, calls: int, duty: float, repeats: int) -> float:
    """Median microseconds per ``fn()`` over ``repeats`` runs of ``calls`` calls on a thread of their own, beside a
    :func:`busy` thread at ``duty`` (none at 0)."""
    samples = []
    for _ in range(repeats):
        stop, result = threading.Event(), {}
        other = threading.Thread(target=busy, args=(stop, duty)) if duty > 0 else None

        def measure() -> None:
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            result["us"] = (time.perf_counter() - t) / calls * 1e6

        worker = threading.Thread(target=measure)
        if other is not None:
            other.start()
            time.sleep(0.01)
        worker.start()
        worker.join()
        stop.set()
        if other is not None:
            other.join()
        samples.append(result["us"])
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.cuda_gil", __doc__)
    p.add_argument("--out", type=Path, required=True, help="folder for cuda_gil.csv (the committed run: "
                   "bench/results/cuda_gil)")
    p.add_argument("--duties", type=comma_list(float), default=[0.0, 0.6, 1.0],
                   help="shares of each millisecond the other thread holds the GIL (default 0,0.6,1)")
    p.add_argument("--calls", type=int, default=500, help="calls per timing (default 500)")
    p.add_argument("--repeats", type=int, default=5, help="timings per row, the median is kept (default 5)")
    p.add_argument("--copies", type=int, default=32, help="copies per batch call (default 32: a batch of 32 rows)")
    p.add_argument("--switch-us", type=int, default=200, help="sys.setswitchinterval in us (default 200, the "
                   "server's server.gil_switch_interval_us default)")
    args = p.parse_args(argv)
    sys.setswitchinterval(args.switch_us * 1e-6)

    import engines.cuda as cuda
    from engines.cuda.held import held

    try:
        cuda.require_device(0)
    except cuda.CudaError as exc:
        print(f"bench.cuda_gil needs a CUDA device: {exc}", file=sys.stderr)
        return 2
    cuda.set_device(0)
    stream, event = cuda.Stream(), cuda.Event(timing=False)
    src, dev = cuda.PinnedBuffer(4096 * args.copies), cuda.DeviceBuffer(4096 * args.copies)
    copies = [(dev.ptr + 4096 * i, src.ptr + 4096 * i, 4096) for i in range(args.copies)]
    cudart = cuda.runtime()
    calls = held()
    if calls is None:
        print("engines.cuda.held: no held calls on this machine (driver older than CUDA 13.0, or "
              "BATCHER_CUDA_HELD_CALLS=0): only the bindings are timed")
    kinds = {
        ("cudaEventRecord", "bindings"): lambda: cudart.cudaEventRecord(event.handle, stream.handle),
        ("cudaMemcpyBatchAsync", "bindings"): lambda: cuda.memcpy_batch_async(copies, stream),
    }
    if calls is not None:
        ev, st = int(event.handle), int(stream.handle)
        kinds[("cudaEventRecord", "held")] = lambda: calls.event_record(ev, st)
        kinds[("cudaMemcpyBatchAsync", "held")] = lambda: calls.memcpy_batch(copies, st)
    rows = []
    for duty in args.duties:
        for (call, path), fn in kinds.items():
            fn()
            stream.synchronize()
            n = args.calls if call == "cudaEventRecord" else max(args.calls // 10, 20)
            us = timed(fn, n, duty, args.repeats)
            stream.synchronize()
            rows.append({"duty": duty, "call": call, "path": path, "us_per_call": round(us, 2)})
    for r in rows:
        other = next((o for o in rows if o["duty"] == r["duty"] and o["call"] == r["call"] and o["path"] == "held"),
                     None)
        r["held_speedup"] = round(r["us_per_call"] / other["us_per_call"], 1) if other else ""
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "cuda_gil.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"one enqueue beside a thread holding the GIL for `duty` of each ms (switch interval {args.switch_us} us, "
          f"batch: {args.copies} copies of 4 KiB)")
    print(f"{'duty':>5}  {'call':<22} {'path':<9} {'us/call':>9}  {'bindings/held':>13}")
    for r in rows:
        print(f"{r['duty']:>5.2f}  {r['call']:<22} {r['path']:<9} {r['us_per_call']:>9.2f}  {r['held_speedup']!s:>13}")
    print(f"wrote {args.out / 'cuda_gil.csv'}")
    for buf in (src, dev):
        buf.free()
    event.destroy()
    stream.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
