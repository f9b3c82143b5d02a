"""Shared fixtures: real servers started as `python -m batcher serve` subprocesses on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running `batcher serve` process. ``url`` is host:port (tritonclient), ``base`` is http://host:port."""

    def __init__(self, config_path: Path | None, log_path: Path, cache_dir: Path) -> None:
        self.port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        self.base = f"http://{self.url}"
        cmd = [sys.executable, "-m", "batcher", "serve", "--port", str(self.port)]
        if config_path is not None:
            cmd += ["--config", str(config_path)]
        env = dict(os.environ, BATCHER_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1")
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 120.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.base + "/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics as {(sample name, sorted labels): value}."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value (0.0 when absent, e.g. a counter never incremented)."""
        key = (name, tuple(sorted(labels.items())))
        return self.metrics().get(key, 0.0)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One zoo cache for the whole run, shared by the servers and the in-process reference runs."""
    path = tmp_path_factory.mktemp("zoo-cache")
    os.environ["BATCHER_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Iterator[Server]:
    """`batcher serve` on the embedded default config (all six zoo models)."""
    server = Server(None, tmp_path_factory.mktemp("default") / "server.log", cache_dir)
    yield server
    server.stop()


@pytest.fixture
def start_server(tmp_path: Path, cache_dir: Path) -> Iterator:
    """Factory: ``start_server({"models": [...]})`` writes the config to YAML and starts a server on it."""
    servers: list[Server] = []

    def start(config: dict) -> Server:
        path = tmp_path / f"config{len(servers)}.yaml"
        path.write_text(yaml.safe_dump(config))
        server = Server(path, tmp_path / f"server{len(servers)}.log", cache_dir)
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()
