"""NVIDIA's Multi-Process Service (MPS) for the engine processes of one server (``server.cuda_mps: true``).

Without MPS, CUDA contexts of different processes on one GPU take turns on it (time slices), so two engine
processes sharing a GPU (``server.engine_processes: per_model``) each get about half of it even when neither
fills it. Under MPS their kernels run side by side, as the streams of one process do. On an H200, two resnet18
served together, 16 clients each, kept 0.73-0.82 of their throughput alone in an engine process each, 0.77-0.97
under MPS, 0.51-0.62 in one engine process (``python -m bench.gpu_scale --parts r,t``, layouts ``per_model``,
``per_model_mps``, ``shared``; README "Many front ends, shared memory, two GPUs").

The supervisor starts a private control daemon (``nvidia-cuda-mps-control -d``) whose pipe and log folders lie in
its runtime folder, so only this server's processes use it, and sets ``CUDA_MPS_PIPE_DIRECTORY`` and
``CUDA_MPS_LOG_DIRECTORY`` for the processes it starts; at exit it sends the daemon ``quit``. Where the
environment already names an MPS pipe folder (``CUDA_MPS_PIPE_DIRECTORY``, e.g. Kubernetes' NVIDIA device plugin
sharing a GPU through MPS), that daemon is used and none is started. NVIDIA's rules apply (MPS docs): one user's
processes per GPU under one daemon, and a GPU in the default or exclusive-process compute mode.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess

from .errors import ConfigError

log = logging.getLogger(__name__)

#: NVIDIA's control program (driver package); ``BATCHER_MPS_CONTROL`` names another path.
CONTROL = "nvidia-cuda-mps-control"
#: seconds to wait for the control program to answer (it daemonizes at once with ``-d``).
TIMEOUT_S = 20.0


class MpsDaemon:
    """The MPS control daemon of one server, under ``folder`` (:meth:`start`, :meth:`stop`)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.started = False
        self._env: dict[str, str] = {}

    def start(self) -> None:
        """Start the daemon and point this process's environment (inherited by the processes started after) at it;
        an MPS pipe folder already in the environment is used as it is.

        Raises:
            ConfigError: the control program is not found, or it failed (its output in the message).
        """
        if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
            log.info("server.cuda_mps: using the MPS daemon of CUDA_MPS_PIPE_DIRECTORY=%s",
                     os.environ["CUDA_MPS_PIPE_DIRECTORY"])
            return
        control = os.environ.get("BATCHER_MPS_CONTROL") or shutil.which(CONTROL)
        if not control:
            raise ConfigError(f"server.cuda_mps: {CONTROL} is not on PATH (it comes with the NVIDIA driver); "
                              "set server.cuda_mps: false, or BATCHER_MPS_CONTROL to its path")
        pipe, logs = self._attach(control)
        os.makedirs(pipe, exist_ok=True)
        os.makedirs(logs, exist_ok=True)
        try:
            code, output = self._run(["-d"], None)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"server.cuda_mps: '{control} -d' did not return within {TIMEOUT_S:g} s; "
                              "it was stopped") from None
        except OSError as exc:
            raise ConfigError(f"server.cuda_mps: '{control} -d' failed: {exc.strerror or exc}") from None
        if code != 0:
            raise ConfigError(f"server.cuda_mps: '{control} -d' failed (exit code {code}): {output or 'no output'}")
        os.environ.update(self._env)
        self.started = True
        log.info("server.cuda_mps: MPS control daemon started (pipes in %s)", pipe)

    @classmethod
    def quit_stale(cls, folder: str) -> bool:
        """Send ``quit`` to the daemon of a runtime folder whose supervisor is gone (killed with ``kill -9``: its
        daemon outlives it, and once the folder is removed nothing can reach its pipes); whether there was one to
        ask (``folder/mps-pipe`` and the control program). Failures are logged, as in :meth:`stop`."""
        control = os.environ.get("BATCHER_MPS_CONTROL") or shutil.which(CONTROL)
        daemon = cls(folder)
        if not control or not all(os.path.isdir(p) for p in daemon._attach(control)):
            return False
        daemon.started = True
        daemon.stop()
        return True

    def _attach(self, control: str) -> tuple[str, str]:
        """Use ``control`` on the daemon whose pipe and log folders are in :attr:`folder`; those two folders."""
        pipe, logs = os.path.join(self.folder, "mps-pipe"), os.path.join(self.folder, "mps-log")
        self._env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": logs}
        self._control = control
        return pipe, logs

    def stop(self) -> None:
        """Ask the daemon to quit (it stops its MPS servers once their clients have exited); logged if it fails."""
        if not self.started:
            return
        self.started = False
        try:
            code, output = self._run([], "quit\n")
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("server.cuda_mps: the MPS control daemon did not quit: %s", exc)
            return
        if code != 0:
            log.warning("server.cuda_mps: 'quit' to the MPS control daemon failed (exit code %d): %s", code, output)

    def _run(self, argv: list[str], stdin: str | None) -> tuple[int, str]:
        """The control program's exit code and output. Its output goes through a file, not a pipe: with ``-d`` the
        daemon it forks keeps the inherited descriptors open, and reading a pipe to its end would wait for it."""
        with open(os.path.join(self._env["CUDA_MPS_LOG_DIRECTORY"], "control-output.txt"), "w+") as out:
            proc = subprocess.Popen([self._control, *argv], stdin=subprocess.PIPE if stdin is not None else
                                    subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, **self._env}, start_new_session=True)
            try:
                proc.communicate(stdin, timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:  # hung: its whole process group goes, nothing is left behind
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
            out.seek(0)
            return proc.returncode, out.read().strip()
