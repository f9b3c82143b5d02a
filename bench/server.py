"""Start and stop real servers on 127.0.0.1 for the benches (the tests' fixtures in ``tests/conftest.py`` use it
too): :class:`Subprocess` for any server command, :class:`ServerProcess` for ``batcher serve`` with a config.

Only the standard library at import time (``yaml`` and ``prometheus_client`` are imported where used), so the
peer servers that run from their own virtualenv (``bench/pytriton_server.py``) can take :func:`free_port` from here.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int, key: str) -> int:
    """The number of a ``/proc/<pid>/status`` line (Linux), e.g. ``VmRSS`` (kB) or ``Threads``."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} line in /proc/{pid}/status")


class Subprocess:
    """A server started as ``cmd`` (cwd: the repo root, its own process group), ready when ``GET base +
    ready_path`` answers 200; ``url`` is host:port (tritonclient), ``base`` http://host:port.

    Raises:
        RuntimeError: the process exited or was not ready within ``timeout_s``; the message holds its log.
    """

    def __init__(self, cmd: list[str], workdir: Path, name: str, port: int, *, env: dict[str, str] | None = None,
                 timeout_s: float = 180.0, ready_path: str = "/v2/health/ready") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.url = f"127.0.0.1:{port}"
        self.base = f"http://{self.url}"
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open while the server runs
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        try:
            self._wait_ready(name, ready_path, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, name: str, ready_path: str, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.base + ready_path, timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{name} not ready after {timeout_s} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics as {(sample name, sorted labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value (0.0 when absent, e.g. a counter never incremented)."""
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def rss_mb(self) -> float:
        """The server process's resident memory in MiB."""
        return proc_status(self.proc.pid, "VmRSS") / 1024

    def threads(self) -> int:
        """The server process's thread count."""
        return proc_status(self.proc.pid, "Threads")

    def stop(self) -> int:
        """SIGTERM, then SIGKILL to the process group after 30 s; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProcess(Subprocess):
    """A running ``python -m batcher serve`` on a free port.

    Args:
        config: a config dict (written to ``workdir/<name>.yaml``), a path to a YAML file, or None for the
            embedded default config.
        workdir: where the config and the server's log go.
        env: extra environment variables for the server.
        frontends: ``--frontends``: 0 (default) single-process mode whatever the machine's cores, so that a bench
            or test measures the same mode everywhere (the server's own default depends on the cores); None: the
            server's default. A config dict that sets ``server.frontends`` decides itself.

    Raises:
        RuntimeError: the server exited or was not ready within ``timeout_s``; the message holds its log.
    """

    def __init__(self, config: dict | str | Path | None, workdir: Path, *, env: dict[str, str] | None = None,
                 timeout_s: float = 180.0, name: str = "server", frontends: int | None = 0) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        cmd = [sys.executable, "-m", "batcher", "serve", "--port", str(port)]
        if frontends is not None and not (isinstance(config, dict) and "frontends" in config.get("server", {})):
            cmd += ["--frontends", str(frontends)]
        if isinstance(config, dict):
            import yaml

            path = workdir / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            cmd += ["--config", str(path)]
        elif config is not None:
            cmd += ["--config", str(config)]
        super().__init__(cmd, workdir, name, port, env=env, timeout_s=timeout_s)
