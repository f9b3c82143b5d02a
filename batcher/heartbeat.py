"""Liveness of multi-process mode's children: a process whose event loop stops running is killed and restarted.

A process that dies is restarted by the supervisor (:mod:`batcher.supervisor`); one that stops running without
dying is not noticed by that: an engine process sent SIGSTOP (or deadlocked, or stuck in a loop that never
yields) kept its readiness true while every request and control call sent to it waited past its deadline (a new
user's report). So each child's event loop writes the monotonic clock (``CLOCK_MONOTONIC``: one clock for every
process of the machine) into a shared ``double`` of its own every :data:`INTERVAL_S` (:func:`beat`), and the
supervisor kills a ready child whose value is older than ``server.stall_timeout_s`` (:meth:`Heartbeat.stalled`);
the kill is then handled as any death: the front ends answer 503 for an engine process's requests and reconnect,
and the process starts again.

What counts as stalled: the event loop not running for ``stall_timeout_s``, whatever the cause - SIGSTOP, a
deadlock, a C call that holds the GIL that long (a model load in a thread that never releases it).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing import reduction
from typing import Any

#: seconds between two heartbeats of a child's event loop.
INTERVAL_S = 0.5


class Heartbeat:
    """One child process's heartbeat: 8 bytes of a ``memfd`` (nothing in ``/dev/shm``, gone with the last process
    holding it), a ``double`` of ``CLOCK_MONOTONIC`` seconds; 0.0 until the child's first beat. One per process
    started (a restarted child starts from zero). Passed to the child as a ``multiprocessing`` spawn argument (the
    descriptor travels as ``multiprocessing.reduction.DupFd``)."""

    def __init__(self, fd: int | None = None) -> None:
        """``fd``: the memfd of a heartbeat made by another process; None: a new one."""
        if fd is None:
            fd = os.memfd_create("batcher-heartbeat", os.MFD_CLOEXEC)
            os.ftruncate(fd, 8)
        self._fd = fd
        self._map = mmap.mmap(fd, 8)
        self._value = memoryview(self._map).cast("d")

    def __reduce__(self) -> tuple:
        return _rebuild, (reduction.DupFd(self._fd),)

    @property
    def last(self) -> float:
        """The last beat (``time.monotonic()`` in the child), 0.0 before the first."""
        return self._value[0]

    def set(self, now: float) -> None:
        self._value[0] = now

    def stalled(self, now: float, timeout_s: float) -> float | None:
        """Seconds since the last beat if that is more than ``timeout_s``, else None (also before the first beat:
        a child still starting is watched by its readiness report, not here). ``now``: ``time.monotonic()``."""
        last = self._value[0]
        if last and now - last > timeout_s:
            return now - last
        return None

    def close(self) -> None:
        """Unmap and close it here (idempotent)."""
        if self._fd >= 0:
            self._value.release()
            self._map.close()
            os.close(self._fd)
            self._fd = -1


def _rebuild(dupfd: Any) -> Heartbeat:
    return Heartbeat(dupfd.detach())


async def beat(heartbeat: Heartbeat, clock: Callable[[], float] = time.monotonic,
               interval_s: float = INTERVAL_S) -> None:
    """Write ``clock()`` into ``heartbeat`` (in the child) now and every ``interval_s``, until cancelled."""
    while True:
        heartbeat.set(clock())
        await asyncio.sleep(interval_s)


def beat_ctx(heartbeat: Heartbeat) -> Callable[[Any], AsyncIterator[None]]:
    """:func:`beat` as an aiohttp ``cleanup_ctx`` entry (a front end): started with the app, cancelled and awaited
    at its cleanup."""

    async def ctx(app: Any) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(beat(heartbeat))
        yield
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    return ctx
