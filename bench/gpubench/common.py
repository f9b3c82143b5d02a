"""What the GPU bench's parts share: the models and inputs, the timed loop, ratios to the raw engine, seed 002's
instance rule, progress lines and the CSV/table/PNG of a part."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.sweep.report import markdown_table, write_csv

#: allowed batch sizes of every part (the default list for max_batch_size 32: powers of two, and 32)
SIZES = (1, 2, 4, 8, 16, 32)
IMAGE = 224


def add_load_arguments(p, *, clients: int, client_processes: int, delay_us: int) -> None:
    """The options every GPU bench's HTTP steps share: the closed-loop clients and their processes, the batch window
    and the device (``cpu``: a dry run of the code on the CPU provider)."""
    p.add_argument("--clients", type=int, default=clients, help="closed-loop clients")
    p.add_argument("--client-processes", type=int, default=client_processes, help="load generator processes")
    p.add_argument("--delay-us", type=int, default=delay_us, help="max_queue_delay_microseconds with batching on")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of the code")


def chosen_parts(p, text: str, allowed: str) -> set[str]:
    """The parts ``--parts`` names (a comma-separated subset of ``allowed``); a parser error otherwise."""
    parts = set(text.split(","))
    if not parts <= set(allowed.split(",")):
        p.error(f"--parts takes a subset of {allowed}, got {text}")
    return parts


def cuda_provider_missing(device: str) -> str | None:
    """Why ``device`` cannot run here: ``cuda`` without ONNX Runtime's CUDA provider (what ``bench.gpu_bench``
    and ``bench.gpu_scale`` say, exit 3, instead of a traceback); None if it can."""
    import onnxruntime as ort

    if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        return ("CUDAExecutionProvider is not available: install onnxruntime-gpu on a machine with a GPU, or run "
                "--device cpu for a dry run of the code")
    return None


def say(*parts: object) -> None:
    """Print and flush: a run killed at its time limit still shows what it did."""
    print(*parts, flush=True)


def images(rows: int, size: int = IMAGE, seed: int = 0) -> np.ndarray:
    """``[rows, 3, size, size]`` float32 N(0, 1) images (fixed seed)."""
    return np.random.default_rng(seed).standard_normal((rows, 3, size, size)).astype(np.float32)


def mixed_sizes(n: int, seed: int = 1) -> list[int]:
    """``n`` batch sizes drawn uniformly from :data:`SIZES` (fixed seed): the mixed-size workload."""
    rng = np.random.default_rng(seed)
    return [int(SIZES[i]) for i in rng.integers(0, len(SIZES), n)]


def timed_loop(step: Callable[[int], int], seconds: float, warmup: int = 2) -> tuple[float, float, int]:
    """Call ``step(k)`` (it returns the rows it ran) for ``seconds`` after ``warmup`` calls;
    ``(rows/s, ms per call, calls)``."""
    for k in range(warmup):
        step(k)
    rows = calls = 0
    t0 = time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds or calls == 0:
        rows += step(calls)
        calls += 1
    return rows / dt, dt / calls * 1e3, calls


def on_thread(ctx, fn: Callable[[], object]) -> object:
    """Run ``fn`` on the context's own thread where it has one (a CUDA-graph context), as the executor does."""
    executor = getattr(ctx, "executor", None)
    return executor.submit(fn).result() if executor is not None else fn()


def errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """``(max abs diff, max abs diff / max |want|)`` against a reference (fp32 on CPU)."""
    d = float(np.max(np.abs(got.astype(np.float64) - want)))
    return d, d / max(float(np.max(np.abs(want))), 1e-12)


def raw_at(raw: Sequence[dict], model: str, precision: str, batch: float) -> float | None:
    """The raw engine's rows/s for ``model``/``precision`` at ``batch`` rows (interpolated between sizes)."""
    pts = sorted((r["batch"], r["rows_per_s"]) for r in raw
                 if r["model"] == model and r["precision"] == precision and isinstance(r["batch"], int))
    if not pts or not batch:
        return None
    return float(np.interp(batch, [b for b, _ in pts], [v for _, v in pts]))


def instance_rule(rows: Sequence[dict], key: str = "qps") -> dict[int, str]:
    """Seed 002's rule over 1 -> 2 -> 4 contexts (rows with ``contexts`` and ``key``, ``p99_ms``; batching on):
    stop adding instances when QPS grows by less than 30% while p99 rises by more than 20% (the SMs are
    saturated). Returns ``{contexts: verdict}`` for each step after the first, and ``{0: "picks N"}``."""
    steps = sorted(rows, key=lambda r: r["contexts"])
    verdict: dict[int, str] = {}
    pick = steps[0]["contexts"] if steps else 0
    for prev, cur in zip(steps, steps[1:]):
        growth = cur[key] / prev[key] - 1 if prev[key] else 0.0
        rise = cur["p99_ms"] / prev["p99_ms"] - 1 if prev["p99_ms"] else 0.0
        stop = growth < 0.30 and rise > 0.20
        verdict[cur["contexts"]] = (f"QPS {growth:+.0%}, p99 {rise:+.0%}: " + ("stop" if stop else "add"))
        if stop:
            break
        pick = cur["contexts"]
    verdict[0] = f"picks {pick}"
    return verdict


def finish(out: Path, name: str, title: str, rows: list[dict], plot: Callable[[Path], None] | None = None) -> None:
    """Write ``out/<name>.csv`` and ``out/<name>.md`` (the table), print the table, draw ``out/<name>.png``."""
    if not rows:
        return
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{name}.csv", rows)
    table = markdown_table(rows)
    (out / f"{name}.md").write_text(f"# {title}\n\n{table}\n")
    say(f"\n{title}\n{table}")
    if plot is not None:
        try:
            plot(out / f"{name}.png")
        except ImportError:
            say(f"({name}.png skipped: matplotlib is not installed)")


def line_plot(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]],
              logx: bool = False) -> None:
    """One PNG: a line per series ``label -> (xs, ys)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
