"""Part (d) of ``bench.gpu_scale``: where a batch's host-to-device time goes, outside the server. One CUDA-graph
context at batch 32 (resnet18), ``ctx.execute`` in a tight loop on the context's thread, with the input given as:

* ``numpy -> pinned``: copied into the context's pinned staging buffer first (part r's raw engine);
* ``pinned, no copy``: already in the staging buffer (the GPU's own time: one DMA, the graph, the output back);
* ``area, one DMA per request``: the requests' arrays in a ``cudaHostRegister``-ed memfd area of multi-process
  mode (:class:`batcher.ipc.Area`), 1 MiB apart (:class:`engines.base.RowParts`, the front ends' blocks), the 32
  copies queued in one ``cudaMemcpyBatchAsync`` (``one call``), or one ``cudaMemcpyAsync`` each;
* ``area, back to back``: the same arrays adjacent (one DMA for the batch, :func:`contiguous_runs`);
* ``area, one DMA per request, launched ahead``: as the server's device pipeline runs them, each batch launched
  behind the one before, which is collected after it (``ctx.launch`` / ``ctx.collect``, ``pipeline_depth``);

each alone and beside a thread running pure Python (the engine process's event loop holds the GIL most of the
time), at Python's switch interval and at 200 us. ms per batch and rows/s; the ratio to ``pinned, no copy`` alone
is what the path costs."""

from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path

import numpy as np

from .common import SIZES, finish, images, on_thread, say, timed_loop

MiB = 1 << 20


class Spinner:
    """A thread running pure Python (holding the GIL but for the interpreter's switches) until stopped."""

    def __enter__(self) -> Spinner:
        self.stop = False
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()
        return self

    def _spin(self) -> None:
        n = 0
        while not self.stop:
            n += 1

    def __exit__(self, *exc) -> None:
        self.stop = True
        self.thread.join()


def part_dma(raw: list[dict], args, out: Path) -> list[dict]:
    """(d): see the module docstring; GPU only (page-locking needs CUDA), skipped with ``--device cpu``."""
    if args.device != "cuda":
        say("  (d) skipped: it measures host-to-device copies, which need a GPU")
        return []
    from batcher.ipc import Area
    from engines.cuda import HostRegistration, memory
    from engines.onnxruntime import OnnxRuntimeEngine
    from engines.zoo import resolve

    top = max(SIZES)
    x = images(top)
    row = x[0].nbytes
    area = Area(64 * MiB)
    base = np.frombuffer(area.buf, np.uint8)
    registration = HostRegistration(base.ctypes.data, area.size)

    def parts_at(step: int) -> list[np.ndarray]:  # one request per block, ``step`` bytes apart
        views = [np.ndarray((1, *x.shape[1:]), x.dtype, buffer=area.buf, offset=k * step) for k in range(top)]
        for k, v in enumerate(views):
            v[...] = x[k:k + 1]
        return views

    engine = OnnxRuntimeEngine(resolve(f"zoo:{args.model}"), device=args.device, batch_sizes=SIZES,
                               precision=args.precision)
    ctx = engine.create_context()
    rows: list[dict] = []
    try:
        staging = ctx.host_buffer("input", x.shape, x.dtype)
        spaced = parts_at(MiB)  # 32 MiB from the area's start, then 32 back to back after them
        adjacent = [np.ndarray(v.shape, v.dtype, buffer=area.buf, offset=40 * MiB + k * row)
                    for k, v in enumerate(spaced)]
        for k, v in enumerate(adjacent):
            v[...] = x[k:k + 1]
        spaced_in = ctx.gather_rows("input", spaced, top)
        adjacent_in = ctx.gather_rows("input", adjacent, top)
        if spaced_in is None or adjacent_in is None:
            say("  (d) the area's arrays are not taken in place (gather_rows: None)")
        want = on_thread(ctx, lambda: ctx.execute({"input": x})["logits"])

        def copied(k: int) -> int:
            np.copyto(staging, x)
            ctx.execute({"input": staging})
            return top

        def one_call_each(k: int) -> int:  # what the layer does where the driver lacks cudaMemcpyBatchAsync
            binding = memory.runtime().cudaMemcpyBatchAsync
            known = memory._BATCH_COPIES.get(binding)
            memory._BATCH_COPIES[binding] = False  # the layer's own "refused here" mark, undone below
            try:
                ctx.execute({"input": spaced_in})
            finally:
                memory._BATCH_COPIES.pop(binding, None)
                if known is not None:
                    memory._BATCH_COPIES[binding] = known
            return top

        pending: list = []

        def ahead(k: int) -> int:  # the server's device pipeline: launch the next, then collect the oldest
            pending.append(ctx.launch({"input": spaced_in}))
            if len(pending) >= ctx.pipeline_depth:
                ctx.collect(pending.pop(0))
            return top

        cases = {"numpy -> pinned": copied,
                 "pinned, no copy": lambda k: (ctx.execute({"input": staging}), top)[1],
                 "area, one DMA per request, one call": lambda k: (ctx.execute({"input": spaced_in}), top)[1],
                 "area, one DMA per request, one call each": one_call_each,
                 "area, back to back": lambda k: (ctx.execute({"input": adjacent_in}), top)[1],
                 "area, one DMA per request, launched ahead": ahead}
        for name, case in (("area, one DMA per request", spaced_in), ("area, back to back", adjacent_in)):
            got = on_thread(ctx, lambda case=case: ctx.execute({"input": case})["logits"])
            say(f"  (d) {name}: max abs diff to the stacked input {float(np.max(np.abs(got - want))):.3g}")
        default = sys.getswitchinterval()
        for busy, switch_us in ((False, None), (True, None), (True, 200)):
            sys.setswitchinterval(switch_us / 1e6 if switch_us else default)
            for name, step in cases.items():
                with Spinner() if busy else contextlib.nullcontext():
                    rps, ms, _ = on_thread(ctx, lambda step=step: timed_loop(step, args.raw_seconds))
                    while pending:
                        on_thread(ctx, lambda: ctx.collect(pending.pop(0)))
                rows.append({"input": name, "python_thread_beside": busy,
                             "switch_interval_us": switch_us or round(default * 1e6), "batch": top,
                             "ms_per_batch": round(ms, 3), "rows_per_s": round(rps, 1)})
                say(f"  (d) {rows[-1]}")
        sys.setswitchinterval(default)
    finally:
        ctx.release()
        engine.release()
        registration.unregister()
        del base
        area.close()
    ref = next(r["ms_per_batch"] for r in rows if r["input"] == "pinned, no copy")
    for r in rows:
        r["over_no_copy_alone"] = round(r["ms_per_batch"] / ref, 3)
    finish(out, "scale_d_dma", f"(d) {args.model} batch {top}: ctx.execute by where the input lies", rows)
    return rows
