"""A sweep: one step per offered rate (open loop) or client count (closed loop), each a warm-up and a measured
window driven by :mod:`bench.sweep.drivers` (in this process or shared by client processes), summarized by
:mod:`bench.sweep.report` into one row (:data:`bench.sweep.report.COLUMNS`), with a progress bar."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from bench.sweep.arrivals import arrival_times
from bench.sweep.drivers import Job, Samples, client_processes, run_jobs, split
from bench.sweep.report import (avg_batch, avg_queue_depth, batch_counters, device_busy_seconds, measured_wall,
                                per_second, queue_seconds, summarize)
from bench.sweep.requests import infer_url


@dataclass
class SweepConfig:
    url: str
    model: str
    mode: str = "open"
    rates: list[float] = field(default_factory=list)
    concurrency: list[int] = field(default_factory=list)
    duration: float = 10.0
    warmup: float = 1.0
    arrivals: str = "constant"
    processes: int = 1
    max_inflight: int = 512
    max_lag_s: float = 0.1
    client_timeout_s: float = 10.0
    metrics_url: str | None = None  # None: no batch sizes
    version: str | None = None
    seed: int = 0
    progress: bool = True
    generator: str = "python"  # or "h2load": bench.sweep.h2load (constant arrivals, one client process)


async def _scrape(session, url: str | None) -> str | None:
    if not url:
        return None
    try:
        async with session.get(url) as r:
            return await r.text() if r.status == 200 else None
    except Exception:  # noqa: BLE001 - no metrics means blank batch sizes
        return None


def _jobs(cfg: SweepConfig, k: int, level: float, url: str, body: bytes, headers: dict[str, str],
          start_wall: float) -> list[Job]:
    span = cfg.warmup + cfg.duration
    if cfg.mode == "open":
        offsets = arrival_times(level, span, cfg.arrivals, seed=[cfg.seed, k])
        return [Job("open", url, body, headers, start_wall, cfg.client_timeout_s, offsets=offsets[p::cfg.processes],
                    max_inflight=m, max_lag_s=cfg.max_lag_s)
                for p, m in enumerate(split(cfg.max_inflight, cfg.processes))]
    return [Job("closed", url, body, headers, start_wall, cfg.client_timeout_s, concurrency=c, until=span)
            for c in split(int(level), cfg.processes) if c]


def _row(cfg: SweepConfig, k: int, level: float, s: Samples, before: tuple[str | None, float],
         after: tuple[str | None, float]) -> dict:
    """A step's row from its samples in the window and the metrics scraped (with the time) at its start and end."""
    open_loop = cfg.mode == "open"
    (before_text, before_t), (after_text, after_t) = before, after
    return {"step": k, "mode": cfg.mode, "concurrency": None if open_loop else int(level),
            "scheduled_qps": s.status.size / cfg.duration if open_loop else None,
            "duration_s": cfg.duration,
            **summarize(s.latency, s.status, measured_wall(cfg.duration, s.done, cfg.warmup),
                        level if open_loop else None, send_lags=s.send_lag if open_loop else None),
            "peak_inflight": s.peak_inflight,
            "avg_batch_size": avg_batch(batch_counters(before_text, cfg.model, cfg.version),
                                        batch_counters(after_text, cfg.model, cfg.version)),
            "avg_queue_depth": avg_queue_depth((queue_seconds(before_text, cfg.model, cfg.version), before_t),
                                               (queue_seconds(after_text, cfg.model, cfg.version), after_t)),
            "device_busy_share": per_second((device_busy_seconds(before_text, cfg.model, cfg.version), before_t),
                                            (device_busy_seconds(after_text, cfg.model, cfg.version), after_t))}


async def _sweep(cfg: SweepConfig, body: bytes, headers: dict[str, str], pool, bar, rows: list[dict],
                 on_step: Callable[[list[dict]], None] | None) -> list[dict]:
    import aiohttp

    url = infer_url(cfg.url, cfg.model, cfg.version)
    steps = cfg.rates if cfg.mode == "open" else cfg.concurrency
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as meta_session:
        for k, level in enumerate(steps):
            start_wall = time.time() + (0.3 if pool is not None else 0.02)
            if bar is not None:
                desc = f"{level:g} req/s" if cfg.mode == "open" else f"{int(level)} clients"
                bar.set_description(f"step {k + 1}/{len(steps)}: {desc}")

            async def scrape_at_window_start(at: float) -> tuple[str | None, float]:
                await asyncio.sleep(max(0.0, at - time.time()))
                return await _scrape(meta_session, cfg.metrics_url), time.time()

            if cfg.generator == "h2load":
                from bench.sweep.h2load import run_step

                before_task = asyncio.create_task(scrape_at_window_start(time.time() + cfg.warmup))
                parts = [(await run_step(url, body, headers, cfg.mode, level, cfg.warmup, cfg.duration,
                                         cfg.client_timeout_s, cfg.max_inflight))[0]]
            else:
                before_task = asyncio.create_task(scrape_at_window_start(start_wall + cfg.warmup))
                parts = await run_jobs(_jobs(cfg, k, level, url, body, headers, start_wall), pool)
            before = await before_task
            after = await _scrape(meta_session, cfg.metrics_url), time.time()
            row = _row(cfg, k, level, Samples.merge(parts).window(cfg.warmup, cfg.warmup + cfg.duration), before,
                       after)
            rows.append(row)
            if on_step is not None:
                on_step(rows)
            if bar is not None:
                bar.set_postfix_str(f"last: {row['achieved_qps']:.1f} req/s, p99 {row['p99_ms']:.1f} ms, "
                                    f"{row['errors']} errors")
    return rows


async def _ticker(bar, total: float) -> None:
    t0 = time.monotonic()
    while True:
        await asyncio.sleep(0.25)
        bar.n = round(min(time.monotonic() - t0, total), 1)
        bar.refresh()


async def _sweep_with_progress(cfg: SweepConfig, body: bytes, headers: dict[str, str], pool, rows: list[dict],
                               on_step) -> list[dict]:
    tqdm = None
    if cfg.progress:
        try:
            from tqdm import tqdm
        except ImportError:
            print('no progress bar: tqdm is not installed (pip install -e ".[bench]")', file=sys.stderr)
    if tqdm is None:
        return await _sweep(cfg, body, headers, pool, None, rows, on_step)
    n_steps = len(cfg.rates if cfg.mode == "open" else cfg.concurrency)
    total = n_steps * (cfg.warmup + cfg.duration)
    with tqdm(total=round(total, 1), unit="s", file=sys.stderr, dynamic_ncols=True,
              bar_format="{desc}{percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s "
                         "[{elapsed}<{remaining}]{postfix}") as bar:
        tick = asyncio.create_task(_ticker(bar, total))
        try:
            rows = await _sweep(cfg, body, headers, pool, bar, rows, on_step)
        finally:
            tick.cancel()
        bar.n = bar.total
        bar.refresh()
    return rows


async def _interrupted_by_sigterm(coro: Awaitable[list[dict]]) -> list[dict]:
    """Await ``coro``; a SIGTERM meanwhile cancels it (its ``finally`` blocks run: h2load is killed and awaited, its
    folder removed) and then raises KeyboardInterrupt, as Ctrl-C does under :func:`asyncio.run`.

    The signal is taken by the event loop (``loop.add_signal_handler``: a wakeup fd, then a plain callback), not by
    a Python handler that raises wherever the main thread happens to be: raised inside a finalizer (``__del__``,
    a weakref callback), such a KeyboardInterrupt is printed as "Exception ignored" and lost, and the sweep ran
    on to its step's end. The Python handler in place before is put back afterwards.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    previous = signal.getsignal(signal.SIGTERM)
    terminated = False

    def on_sigterm() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await coro
    except asyncio.CancelledError:
        if terminated:
            raise KeyboardInterrupt from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)


def run_sweep(cfg: SweepConfig, body: bytes, headers: dict[str, str], rows: list[dict] | None = None,
              on_step: Callable[[list[dict]], None] | None = None, sigterm_interrupts: bool = False) -> list[dict]:
    """Run every step (rates in open loop, concurrencies in closed loop); one row per step
    (:data:`bench.sweep.report.COLUMNS`), appended to ``rows`` as each step ends, after which ``on_step(rows)``
    is called (so an interrupted sweep keeps, and can have saved, the finished steps).

    With ``sigterm_interrupts`` (from the main thread only), a SIGTERM during the steps stops them as Ctrl-C does:
    h2load and the client processes end at once and KeyboardInterrupt is raised (:func:`_interrupted_by_sigterm`).
    """
    rows = [] if rows is None else rows
    if cfg.generator not in ("python", "h2load"):
        raise ValueError(f"generator must be python or h2load, got {cfg.generator!r}")
    if cfg.generator == "h2load":
        from bench.sweep.h2load import h2load_refuses

        if refused := h2load_refuses(cfg.arrivals, cfg.processes):
            raise ValueError(refused)
    with client_processes(cfg.processes if cfg.generator == "python" else 1) as pool:
        steps = _sweep_with_progress(cfg, body, headers, pool, rows, on_step)
        return asyncio.run(_interrupted_by_sigterm(steps) if sigterm_interrupts else steps)
