"""The load drivers: open loop (requests at scheduled times, whatever the server does) and closed loop (clients
that send again as soon as they are answered). Both are async and take any ``send()`` coroutine function that
returns an HTTP status, so a bench can drive anything with them (a fake server in the tests, a mix of requests in
the soak); :func:`http_sender` is the plain one: POST one body, read the whole answer.

A step can be shared by client processes (:class:`Job`, :func:`client_processes`, :func:`run_jobs`) so that the
client is not the bottleneck; each process drives its share from the same wall-clock start.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import numpy as np

# Outcomes that are not HTTP statuses (the ``status`` arrays hold them as negative codes).
CLIENT_OVERLOAD = -1  #: not sent: in-flight cap reached or the send would have been too late
TRANSPORT_ERROR = -2  #: connection refused/reset, malformed answer
CLIENT_TIMEOUT = -3  #: no full answer within the client's timeout
OUTCOME_NAMES = {CLIENT_OVERLOAD: "client-overload", TRANSPORT_ERROR: "transport", CLIENT_TIMEOUT: "client-timeout"}

Send = Callable[[], Awaitable[int]]


@dataclass
class Samples:
    """Per-request records of one step (one client process or merged): offsets are seconds from the step start.

    ``scheduled``: the scheduled send time (open) or the send time (closed); ``latency``/``done``: nan for
    requests never sent; ``send_lag``: actual - scheduled send (open loop).
    """

    scheduled: np.ndarray
    latency: np.ndarray
    status: np.ndarray
    done: np.ndarray
    send_lag: np.ndarray
    peak_inflight: int = 0

    @staticmethod
    def merge(parts: Sequence[Samples]) -> Samples:
        def cat(attr: str, dtype) -> np.ndarray:
            arrays = [getattr(p, attr) for p in parts]
            return np.concatenate(arrays).astype(dtype) if arrays else np.empty(0, dtype)

        return Samples(cat("scheduled", np.float64), cat("latency", np.float64), cat("status", np.int32),
                       cat("done", np.float64), cat("send_lag", np.float64),
                       sum(p.peak_inflight for p in parts))

    def window(self, start: float, end: float | None = None) -> Samples:
        m = self.scheduled >= start - 1e-9  # k / rate == warmup exactly belongs to the window
        if end is not None:
            m &= self.scheduled < end - 1e-9
        return Samples(self.scheduled[m], self.latency[m], self.status[m], self.done[m], self.send_lag[m],
                       self.peak_inflight)


async def _status(send: Send) -> int:
    """``await send()``; a timeout is :data:`CLIENT_TIMEOUT`, any other failure :data:`TRANSPORT_ERROR`."""
    try:
        return await send()
    except asyncio.TimeoutError:
        return CLIENT_TIMEOUT
    except Exception:  # noqa: BLE001 - any failure to get an answer is a transport error
        return TRANSPORT_ERROR


async def drive_open(offsets: np.ndarray, send: Send, *, max_inflight: int = 512, max_lag_s: float = 0.1,
                     start: float | None = None, clock: Callable[[], float] = time.perf_counter) -> Samples:
    """Call ``send()`` at ``start + offsets[i]`` (``clock`` seconds) whatever the earlier calls are doing.

    A request whose turn comes with ``max_inflight`` outstanding, or more than ``max_lag_s`` late, is not sent
    (status :data:`CLIENT_OVERLOAD`). Latency is from the scheduled time to ``send()``'s return; ``send``
    returns an HTTP status (an exception counts as :data:`TRANSPORT_ERROR`, a timeout as
    :data:`CLIENT_TIMEOUT`). Returns after every sent request is answered.
    """
    offsets = np.asarray(offsets, dtype=np.float64)
    n = offsets.size
    status = np.full(n, CLIENT_OVERLOAD, np.int32)
    latency = np.full(n, np.nan)
    done = np.full(n, np.nan)
    lag = np.full(n, np.nan)
    t0 = clock() if start is None else start
    inflight = peak = 0
    tasks: set[asyncio.Task] = set()  # only the outstanding ones: a long run does not keep every task

    async def one(i: int, target: float) -> None:
        nonlocal inflight
        st = await _status(send)
        t = clock()
        status[i], latency[i], done[i] = st, t - target, t - t0
        inflight -= 1

    for i in range(n):
        target = t0 + offsets[i]
        delay = target - clock()
        await asyncio.sleep(max(0.0, delay))  # yield even when late so queued sends go out
        late = clock() - target
        lag[i] = max(late, 0.0)
        if inflight >= max_inflight or late > max_lag_s:
            continue
        inflight += 1
        peak = max(peak, inflight)
        task = asyncio.create_task(one(i, target))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while tasks:
        await asyncio.gather(*list(tasks))
    return Samples(offsets, latency, status, done, lag, peak)


async def drive_closed(concurrency: int, send: Send, *, until: float | None = None, count: int | None = None,
                       start: float | None = None, clock: Callable[[], float] = time.perf_counter) -> Samples:
    """``concurrency`` clients, each calling ``send()`` again as soon as the previous call returns, until
    ``start + until`` (``clock`` seconds) or until ``count`` calls in all have been made, whichever comes first;
    latency is from each send (failures as in :func:`drive_open`). Records are in the order calls returned."""
    if until is None and count is None:
        raise ValueError("drive_closed needs until or count")
    t0 = clock() if start is None else start
    end = t0 + until if until is not None else math.inf
    left = count if count is not None else math.inf
    rec: list[tuple[float, float, int, float]] = []

    async def client() -> None:
        nonlocal left
        while left > 0 and (s := clock()) < end:
            left -= 1
            st = await _status(send)
            t = clock()
            rec.append((s - t0, t - s, st, t - t0))
            if st < 0:
                await asyncio.sleep(0.001)  # don't spin on a refused connection

    delay = t0 - clock()
    if delay > 0:
        await asyncio.sleep(delay)
    await asyncio.gather(*(client() for _ in range(concurrency)))
    a = np.array(rec, dtype=np.float64).reshape(-1, 4)
    return Samples(a[:, 0], a[:, 1], a[:, 2].astype(np.int32), a[:, 3], np.full(len(a), np.nan), concurrency)


@asynccontextmanager
async def http_sender(url: str, body: bytes, headers: dict[str, str], *, connections: int = 512,
                      timeout_s: float = 10.0) -> AsyncIterator[Send]:
    """``send()`` for the drivers over one aiohttp session of at most ``connections`` connections: POST
    ``body`` to ``url``, read the whole answer (within ``timeout_s``), return the status."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=max(connections, 1), limit_per_host=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:

        async def send() -> int:
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                return r.status

        yield send


# --------------------------------------------------------------------------------------------- client processes


@dataclass
class Job:
    """One client process's share of a step (picklable: sent to worker processes)."""

    mode: str
    url: str
    body: bytes
    headers: dict[str, str]
    start_wall: float  # time.time() at which the step starts (shared by all client processes)
    client_timeout_s: float
    offsets: np.ndarray | None = None  # open
    max_inflight: int = 512  # open
    max_lag_s: float = 0.1  # open
    concurrency: int = 0  # closed
    until: float = 0.0  # closed: seconds after the start


async def run_job(job: Job) -> Samples:
    limit = job.max_inflight if job.mode == "open" else job.concurrency
    async with http_sender(job.url, job.body, job.headers, connections=limit,
                           timeout_s=job.client_timeout_s) as send:
        start = time.perf_counter() + (job.start_wall - time.time())
        if job.mode == "open":
            return await drive_open(job.offsets, send, max_inflight=job.max_inflight, max_lag_s=job.max_lag_s,
                                    start=start)
        return await drive_closed(job.concurrency, send, until=job.until, start=start)


def _run_job_sync(job: Job) -> Samples:
    return asyncio.run(run_job(job))


def _ping_wait(seconds: float) -> float:
    import aiohttp  # noqa: F401 - import in the worker before the first timed step

    time.sleep(seconds)  # keeps this worker busy so the next ping starts another one
    return time.time()


@contextmanager
def client_processes(processes: int) -> Iterator[ProcessPoolExecutor | None]:
    """A pool of ``processes`` started client processes (spawned, aiohttp imported), or None for one: this one.
    Left by an exception (an interrupted sweep), its processes are terminated at once rather than awaited."""
    if processes <= 1:
        yield None
        return
    pool = ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn"))
    try:
        list(pool.map(_ping_wait, [0.2] * processes))  # start every worker before the first timed step
        yield pool
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM): a running job would go on to its step's end, and the pool's shutdown would
        # wait for it; its samples are lost anyway, so the workers are ended now. They are this process's only
        # multiprocessing children (the resource tracker is not a Process).
        for child in mp.active_children():
            child.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


async def run_jobs(jobs: Sequence[Job], pool: ProcessPoolExecutor | None) -> list[Samples]:
    """Every job at once: in ``pool``'s processes, or in this event loop without one."""
    if pool is None:
        return list(await asyncio.gather(*(run_job(j) for j in jobs)))
    loop = asyncio.get_running_loop()
    return list(await asyncio.gather(*(loop.run_in_executor(pool, _run_job_sync, j) for j in jobs)))


def split(n: int, parts: int) -> list[int]:
    """``n`` as ``parts`` near-equal whole shares, the larger ones first."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
