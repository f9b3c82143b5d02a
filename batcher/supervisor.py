"""Multi-process mode's supervisor: ``batcher serve`` with ``server.frontends`` >= 1.

It starts one engine process per device (:func:`batcher.topology.engine_devices`; :mod:`batcher.engine_proc`)
and waits until each has loaded its models, then starts the front ends (:mod:`batcher.frontend`), which all
listen on the server's port with ``SO_REUSEPORT`` (the supervisor holds the port bound, not listening, so that
port 0 resolves once and no other program takes it meanwhile). Then it watches them:

* a front end that dies is started again (its requests in progress are dropped and counted by the engines as
  ``dropped``); an engine process that dies is started again after a backoff (0.1 s doubling up to 5 s while it
  keeps dying), and until it is back its front ends answer 503 for its models; each restart counts in
  ``batcher_process_restart_total{process}``;
* a process whose event loop has not run for ``server.stall_timeout_s`` (SIGSTOP, a deadlock) is killed, then
  restarted as one that died (:mod:`batcher.heartbeat`);
* SIGTERM: the front ends drain (readiness false, new requests 503 + Retry-After, every accepted request
  answered, at most ``server.shutdown_grace_s``) and exit; then the engine processes release their models and
  exit; exit code 0. SIGINT stops every process at once.

With ``server.cuda_mps`` it starts NVIDIA's MPS control daemon before the engine processes and stops it after
them (:mod:`batcher.mps`).

Metrics: ``PROMETHEUS_MULTIPROC_DIR`` is a fresh folder under the supervisor's private runtime folder (with the
engines' sockets), set before any process imports prometheus-client, marked for each dead process
(``mark_process_dead``) and removed at exit. Children die with the supervisor (``PR_SET_PDEATHSIG``). A supervisor
killed with ``kill -9`` cannot remove its folder: the next one to start removes every runtime folder whose
supervisor is gone (:func:`batcher.runtime_dir.remove_stale_runtime_dirs`: the supervisor holds a lock on the folder's owner file).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from .cli import bind_socket
from .config import Config, ServerConfig
from .errors import ConfigError
from .heartbeat import Heartbeat
from .lograte import EveryFewSeconds
from .mps import MpsDaemon
from .runtime_dir import RUNTIME_PREFIX, claim_runtime_dir, remove_stale_runtime_dirs
from .topology import engines

log = logging.getLogger("batcher")

BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.1, 5.0
#: a process that lived at least this long before dying restarts without backoff.
STABLE_S = 10.0
#: seconds the supervisor waits for processes to exit after the front ends' drain before killing them.
EXIT_WAIT_S = 30.0
#: a child that has not beaten this long after its start (nor ``server.stall_timeout_s`` if longer) is stuck
#: starting (its imports: a hung driver or file system) and is killed as a stalled one is
FIRST_BEAT_S = 60.0
#: a gap between two of the supervisor's stall checks (every 0.5-1 s) longer than this, or than half of
#: ``server.stall_timeout_s``, means the supervisor itself did not run: no child is judged on that check.
SELF_STALL_S = 1.5
_LOG_FORMAT = "%(asctime)s %(levelname)s {role}%(name)s: %(message)s"


def setup_logging(level: str, role: str = "") -> None:
    """The server's log format; children name themselves (``[frontend 1] ``)."""
    logging.basicConfig(level=level.upper(), format=_LOG_FORMAT.format(role=role), stream=sys.stderr, force=True)


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    """A new event loop of ``server.event_loop``'s kind (``"asyncio"`` or ``"uvloop"``).

    Raises:
        ConfigError: uvloop is asked for and not installed.
    """
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            raise ConfigError('server.event_loop: uvloop is not installed (pip install -e ".[uvloop]")') from None
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    loop.set_exception_handler(AcceptErrors())
    return loop


class AcceptErrors:
    """The event loop's exception handler: ``accept()`` failing for want of file descriptors (clients holding
    connections open until the process's limit, ``ulimit -n``) is logged as one WARNING per :attr:`every_s` with
    the count since, not as asyncio's ERROR with a traceback at every retry (a new-user test: 16,000 ERROR lines in
    4 s from 200 idle connections at a limit of 128; uvloop's accept closes the surplus connection and logs
    nothing). Everything else goes to the loop's default handler. ``clock``: seconds, injectable for tests."""

    every_s = 10.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._due = EveryFewSeconds(self.every_s, clock)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
                and "accept" in str(context.get("message", ""))):
            loop.default_exception_handler(context)
            return
        suppressed = self._due.due()
        if suppressed is not None:
            log.warning("cannot accept connections: %s (%d more such failures since the last warning); the "
                        "connections open now reach the process's file limit", exc.strerror or exc, suppressed)


def set_device_options(server: ServerConfig) -> None:
    """``server.device_timing`` and ``server.cuda_blocking_sync`` for the contexts this process creates from now
    on: whether they record CUDA timing events around each batch, and whether they sleep or spin while a batch
    runs (:attr:`engines.base.ExecutionContext.device_timing`, :attr:`~engines.base.ExecutionContext.blocking_sync`)."""
    from engines.base import ExecutionContext

    ExecutionContext.device_timing = server.device_timing
    ExecutionContext.blocking_sync = server.cuda_blocking_sync


#: the most the soft limit of open files is raised to where the hard limit is unlimited (Linux's default
#: ``fs.nr_open``; above it setrlimit fails).
FD_LIMIT_CAP = 1 << 20


def raise_fd_limit() -> None:
    """The soft limit of open files (``RLIMIT_NOFILE``) raised to the hard one, at most :data:`FD_LIMIT_CAP`; the
    processes this one starts inherit it. Each connection takes a file descriptor, each system shared-memory region
    two; under the common soft limit of 1,024 one client's 505 registrations left none for connections (a new
    user's report). Go's runtime and the JVM raise it so at start. The event loops poll with epoll, which has no
    limit of its own on descriptor numbers. Where the hard limit is low the shared-memory registry still keeps
    :data:`batcher.shm.FD_RESERVE` free."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FD_LIMIT_CAP if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT_CAP)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logging.getLogger("batcher").debug("open files stay limited to %d: %s", soft, exc)


def set_switch_interval(us: int | None) -> None:
    """``sys.setswitchinterval`` from ``server.gil_switch_interval_us`` (microseconds); None keeps Python's
    (5 ms). With a busy event loop, a thread returning from a call that released the GIL (a CUDA copy, ONNX
    Runtime's run) waits up to this long for it, once per such call."""
    if us is not None:
        sys.setswitchinterval(us / 1e6)


#: the garbage collector's first threshold once a process serves (Python's default: 700). The count is net
#: allocations of container objects; a batch's requests allocate thousands at once and free them soon after, so
#: at 700 the youngest generation was collected 3,660 times in an engine process's 11 s of load (307 ms of its
#: event loop, GIL held); at 10,000, 8 times (1 ms). Cyclic garbage waits for at most this many allocations.
GC_THRESHOLD0 = 10_000


def freeze_heap() -> None:
    """Once the process has started (its models loaded): collect, move every object alive into the garbage
    collector's permanent generation (``gc.freeze``), so that full collections no longer walk the modules, models
    and config loaded at start, and raise the first threshold to :data:`GC_THRESHOLD0`. Measured in an engine
    process on the 2-core machine (14k requests/s for 11 s): full collections 713 ms (36 of about 20 ms, the GIL
    held throughout), 41 ms with the heap frozen; all collections 1,066 ms, 21 ms with both."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD0, *gc.get_threshold()[1:])


async def freeze_on_startup(app: Any) -> None:
    """An aiohttp ``on_startup`` handler (appended after :func:`batcher.app.create_app`, so after the models
    load): :func:`freeze_heap` in a process that serves HTTP (single-process mode, a front end)."""
    freeze_heap()


def run(coro: Any, kind: str) -> Any:
    """Run ``coro`` to its end on a new event loop of ``kind`` (:func:`new_event_loop`)."""
    loop = new_event_loop(kind)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


#: glibc's ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` in the server's child processes (:func:`keep_heap`)
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20


def keep_heap(libc: ctypes.CDLL) -> None:
    """glibc's allocator in a front end or engine process: blocks up to :data:`MMAP_THRESHOLD_BYTES` (its largest
    allowed value) come from the heap instead of a fresh ``mmap`` each, and the heap's free top is given back to the
    kernel only past :data:`TRIM_THRESHOLD_BYTES`. A front end allocates the chunks of each large request body
    (aiohttp's, about 180 KB each) and frees them a moment later; with glibc's defaults each was new pages (a page
    fault for each 4 KiB, zeroed by the kernel) and a trim after it. The process keeps up to that much freed memory
    for the next bodies instead (``python -m bench.body_cpu`` measures it on and off). ``libc``: glibc, loaded with
    ``ctypes`` (:func:`child_setup`'s)."""
    libc.mallopt(-3, MMAP_THRESHOLD_BYTES)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, TRIM_THRESHOLD_BYTES)  # M_TRIM_THRESHOLD


def child_setup(role: str, log_level: str, keep: bool = True) -> None:
    """First thing in a child process: logging, dying with the supervisor (``PR_SET_PDEATHSIG``), its name as
    ``ps``, ``top`` and ``/proc/PID/comm`` show it (``PR_SET_NAME``: ``role`` with ``-`` for spaces, at most 15
    bytes, e.g. ``engine-gpu0``, ``frontend-3``), metrics that read the pid once
    (:func:`batcher.metrics.read_pid_once`), and with ``keep`` (``server.keep_heap``) :func:`keep_heap`."""
    from .metrics import read_pid_once

    read_pid_once()
    setup_logging(log_level, f"[{role}] ")
    # a process group of its own: a signal to the server's group (Ctrl-C in a terminal, ``kill -TERM -- -PGID``)
    # reaches the supervisor alone, which stops the children in order (front ends drain, then engines), instead of
    # an engine stopping at once under its front ends' accepted requests, or a front end getting SIGINT twice
    os.setpgrp()
    try:  # no-ops where the C library is not glibc
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(15, role.replace(" ", "-").encode()[:15])  # PR_SET_NAME
        if keep:
            keep_heap(libc)
    except (OSError, AttributeError):
        pass
    # the supervisor died before prctl: this process was handed to a reaper. Compared with the supervisor's pid, not
    # with 1: a supervisor that is PID 1 itself (``batcher serve`` as a container's entrypoint) is its children's
    # parent, and when PID 1 dies the kernel ends every process of its namespace anyway.
    supervisor = os.environ.get(SUPERVISOR_PID_ENV, "")
    orphaned = os.getppid() != int(supervisor) if supervisor.isdigit() else os.getppid() == 1
    if orphaned:
        sys.exit(1)


class _Child:
    """One supervised process: what it is, how to start it, its current process and restart backoff."""

    def __init__(self, kind: str, name: str, target: Any, args: tuple) -> None:
        self.kind, self.name, self.target, self.args = kind, name, target, args
        self.process: mp.process.BaseProcess | None = None
        self.ready: Any = None
        self.started_at = 0.0
        self.backoff = 0.0
        self.restart_at: float | None = None
        self.is_ready = False
        #: the child's heartbeat (one for every process started as this child: the front ends read the engine
        #: processes', :meth:`batcher.remote.EngineLink.responsive`), 0.0 again at each start
        self.heartbeat = Heartbeat()

    def start(self, ctx: Any) -> None:
        """Start the process: ``target(*args, heartbeat, ready)``, with :attr:`heartbeat` (set to 0.0) and the
        write end of a new readiness pipe."""
        r, w = ctx.Pipe(duplex=False)
        self.heartbeat.set(0.0)
        self.process = ctx.Process(target=self.target, args=(*self.args, self.heartbeat, w), name=self.name)
        self.process.start()
        w.close()
        self.ready, self.is_ready, self.started_at, self.restart_at = r, False, time.monotonic(), None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.exitcode is None

    def signal(self, sig: int) -> None:
        if self.alive:
            try:
                os.kill(self.process.pid, sig)
            except ProcessLookupError:
                pass


SUPERVISOR_PID_ENV = "BATCHER_SUPERVISOR_PID"  #: the supervisor's pid, in its children's environment


class Supervisor:
    """Runs the processes of one multi-process server until SIGTERM/SIGINT (:meth:`run`)."""

    def __init__(self, config: Config, frontends: int, access_log: bool = False) -> None:
        self.config = config
        self.server = config.server
        for path in remove_stale_runtime_dirs(tempfile.gettempdir()):
            log.info("removed %s: the runtime folder of a supervisor that is gone (killed with kill -9?)", path)
        self.dir = tempfile.mkdtemp(prefix=RUNTIME_PREFIX)
        self._owner_fd = claim_runtime_dir(self.dir)  # held until this process ends
        os.environ[SUPERVISOR_PID_ENV] = str(os.getpid())  # the children's check that their supervisor is alive
        metrics_dir = os.path.join(self.dir, "metrics")
        os.mkdir(metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before this process or any child imports it
        self.ctx = mp.get_context("spawn")
        self.mps = MpsDaemon(self.dir) if self.server.cuda_mps else None
        self.stopping: str | None = None  # "drain" (SIGTERM) or "now" (SIGINT)
        self.announced = False
        self.drain_deadline = 0.0
        self._checked_at = time.monotonic()  # the last stall check (:meth:`_kill_stalled`)
        from .engine_main import engine_main
        from .frontend import frontend_main

        # sockets by index: a model's name may be long or odd, and a socket path has 107 bytes at most
        self.paths = {e: os.path.join(self.dir, f"engine-{i}.sock") for i, e in enumerate(engines(config))}
        self.engines = [_Child("engine", f"engine-{e.name}", engine_main,
                               (config, e, self.paths[e], self.server.log_level)) for e in self.paths]
        beats = {e: c.heartbeat for e, c in zip(self.paths, self.engines)}
        self.frontends = [_Child("frontend", f"frontend-{i}", frontend_main,
                                 (config, i, self.paths, access_log, self.server.log_level, beats))
                          for i in range(frontends)]

    # ---------------------------------------------------------------- signals
    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM and self.stopping is None:
            log.info("SIGTERM: front ends drain (grace %g s), then the engine processes stop",
                     self.server.shutdown_grace_s)
            self.stopping = "drain"
            self.drain_deadline = time.monotonic() + self.server.shutdown_grace_s + EXIT_WAIT_S
            for c in self.frontends:
                c.signal(signal.SIGTERM)
            if not any(c.is_ready for c in self.frontends):  # still starting: nothing to drain
                self.stopping = "now"
        elif signum == signal.SIGINT:
            self.stopping = "now"
            for c in self.frontends + self.engines:
                c.signal(signal.SIGINT)

    # ---------------------------------------------------------------- running
    def run(self) -> int:
        """Start everything, supervise, stop; the exit code (0 clean, 1 port unusable, 2 a model failed to load)."""
        from .metrics import ProcessMetrics

        self.metrics = ProcessMetrics()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        log.info("multi-process mode: runtime folder %s (engine sockets, metrics)", self.dir)
        try:
            try:  # bound, not listening: port 0 resolves once, and no other program takes the port meanwhile
                self.reservation = bind_socket(self.server.host, self.server.port, reuse_port=True)
            except OSError as exc:
                log.error("cannot serve on %s:%d: %s", self.server.host, self.server.port, exc.strerror or exc)
                return 1
            self.port = self.reservation.getsockname()[1]
            if self.mps is not None:
                try:
                    self.mps.start()  # before any engine process starts: they inherit its environment
                except ConfigError as exc:
                    log.error("%s", exc)
                    return 2
            for c in self.frontends:
                c.args = (*c.args[:3], self.server.host, self.port, *c.args[3:])
            code = self._start_engines()
            if code or self.stopping:
                return code
            for c in self.frontends:
                c.start(self.ctx)
            self._supervise()
            return 0
        finally:
            self._stop_all()
            if self.mps is not None:
                self.mps.stop()
            shutil.rmtree(self.dir, ignore_errors=True)
            os.close(self._owner_fd)
            log.info("stopped")

    def _start_engines(self) -> int:
        for c in self.engines:
            c.start(self.ctx)
        while not all(c.is_ready for c in self.engines):
            if self.stopping:
                return 0
            self._wait(1.0)
            self._kill_stalled(time.monotonic())  # one stuck while loading exits, and the start fails
            for c in self.engines:
                if not c.is_ready and not c.alive:
                    log.error("the %s process exited (code %s) before it was ready", c.name, c.process.exitcode)
                    return 2
        return 0

    def _wait(self, timeout: float) -> None:
        """Wait for a child to exit or report ready (or ``timeout``); take the readiness reports."""
        waitables = [c.process.sentinel for c in self.engines + self.frontends if c.alive]
        waitables += [c.ready for c in self.engines + self.frontends if c.alive and not c.is_ready]
        try:
            ready = mpc.wait(waitables, timeout)
        except InterruptedError:
            return
        for c in self.engines + self.frontends:
            if c.ready in ready:
                try:
                    kind, detail = c.ready.recv()
                except (EOFError, OSError):
                    continue
                c.is_ready = kind == "ready"
                if c.is_ready:
                    self._on_ready(c)

    def _on_ready(self, c: _Child) -> None:
        log.info("%s ready (pid %d)", c.name, c.process.pid)
        if not self.announced and all(f.is_ready for f in self.frontends):
            self.announced = True
            log.info("%d front end(s), engine processes for %s", len(self.frontends),
                     ", ".join(e.name[7:] for e in self.engines))
            host = f"[{self.server.host}]" if ":" in self.server.host else self.server.host
            log.log(logging.WARNING if self.server.port == 0 else logging.INFO,  # as single-process mode logs it
                    "serving KServe v2 on http://%s:%d", host, self.port)

    def _supervise(self) -> None:
        from prometheus_client import multiprocess

        while self.stopping != "now":
            if self.stopping == "drain" and not any(c.alive for c in self.frontends):
                return
            if self.stopping == "drain" and time.monotonic() > self.drain_deadline:
                log.warning("front ends still running after the drain: stopping them")
                return
            self._wait(0.5)
            now = time.monotonic()
            self._kill_stalled(now)
            for c in self.engines + self.frontends:
                if c.process is not None and not c.alive and c.restart_at is None and self.stopping is None:
                    multiprocess.mark_process_dead(c.process.pid)
                    lived = now - c.started_at
                    c.backoff = 0.0 if c.kind == "frontend" and lived > STABLE_S else (
                        BACKOFF_FIRST_S if lived > STABLE_S or not c.backoff else min(BACKOFF_MAX_S, 2 * c.backoff))
                    c.restart_at = now + c.backoff
                    log.warning("the %s process (pid %d) died (exit code %s); starting it again in %.1f s",
                                c.name, c.process.pid, c.process.exitcode, c.backoff)
                if c.restart_at is not None and now >= c.restart_at and self.stopping is None:
                    self.metrics.restart.labels(c.kind).inc()
                    c.start(self.ctx)

    def _kill_stalled(self, now: float) -> None:
        """SIGKILL each child whose event loop has not run for ``server.stall_timeout_s`` since its first beat
        (:mod:`batcher.heartbeat`; loading its models or ready), or that has not beaten :data:`FIRST_BEAT_S` after
        its start, as its death is then handled: restarted by
        :meth:`_supervise`, a first start's failure in :meth:`_start_engines`, its requests answered 503 during a
        drain (SIGTERM; never restarted then). Not after SIGINT, and not right after this process itself did not
        run for half that time or :data:`SELF_STALL_S` (it was stopped, or the machine stalled: every child's
        heartbeat looks old then, through no fault of theirs)."""
        timeout = self.server.stall_timeout_s
        last, self._checked_at = self._checked_at, now
        if timeout is None or self.stopping == "now" or now - last > max(timeout / 2, SELF_STALL_S):
            return
        for c in self.engines + self.frontends:
            if not c.alive:
                continue
            late = c.heartbeat.stalled(now, timeout)
            if late is None and not c.heartbeat.last and now - c.started_at > max(timeout, FIRST_BEAT_S):
                late = now - c.started_at  # never beat: stuck starting (Python's start, its imports)
            if late is not None:
                log.warning("the %s process (pid %d) has not run its event loop for %.1f s (stopped, or stuck; "
                            "server.stall_timeout_s %g): killing it", c.name, c.process.pid, late, timeout)
                c.process.kill()
                c.process.join(EXIT_WAIT_S)

    def _stop_all(self) -> None:
        """Front ends first (they may still drain), then the engine processes; kill what outlives the wait."""
        for group in (self.frontends, self.engines):
            for c in group:
                c.signal(signal.SIGTERM if self.stopping != "now" else signal.SIGINT)
            end = time.monotonic() + EXIT_WAIT_S
            for c in group:
                if c.process is not None:
                    c.process.join(max(0.0, end - time.monotonic()))
                    if c.alive:
                        log.warning("the %s process did not exit: killing it", c.name)
                        c.process.kill()
                        c.process.join()
        reservation = getattr(self, "reservation", None)
        if reservation is not None:
            reservation.close()


def serve_multiprocess(config: Config, frontends: int, access_log: bool = False) -> int:
    """``batcher serve`` in multi-process mode; returns the exit code."""
    return Supervisor(config, frontends, access_log).run()
