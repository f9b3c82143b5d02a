"""Shared fixtures: real servers started as `python -m batcher serve` subprocesses on 127.0.0.1.

Tests live in two tiers, each marked by its folder: ``tests/unit`` (``-m unit``: in-process, fast) and
``tests/integration`` (``-m integration``: real servers and clients). ``python -m pytest`` runs unit first.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.server import ServerProcess


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in ("unit", "integration"):
            item.add_marker(tier)


@pytest.fixture
def h2load() -> str:
    """The h2load binary (``apt-get install nghttp2-client``), else skip (fail with BATCHER_REQUIRE_H2LOAD=1)."""
    from helpers import require_program

    return require_program(shutil.which("h2load"), "h2load is not installed (apt-get install nghttp2-client)",
                           "BATCHER_REQUIRE_H2LOAD")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One zoo cache for the whole run, shared by the servers and the in-process reference runs."""
    path = tmp_path_factory.mktemp("zoo-cache")
    os.environ["BATCHER_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Iterator[ServerProcess]:
    """`batcher serve` on the embedded default config (all six zoo models)."""
    with ServerProcess(None, tmp_path_factory.mktemp("default")) as server:
        yield server


@pytest.fixture
def start_server(tmp_path: Path, cache_dir: Path) -> Iterator:
    """Factory: ``start_server({"models": [...]}, env={...})`` writes the config to YAML and starts a server on it
    (keywords go to :class:`bench.server.ServerProcess`)."""
    servers: list[ServerProcess] = []

    def start(config: dict, **kw) -> ServerProcess:
        server = ServerProcess(config, tmp_path, name=f"server{len(servers)}", **kw)
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()
