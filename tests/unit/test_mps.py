"""batcher.mps on its own (the server's use of it is tested in tests/integration/test_frontends.py): a control
program that hangs is stopped with everything it started."""

from __future__ import annotations

import os
import time

import pytest

import batcher.mps as mps
from batcher.errors import ConfigError


def _running(pid: int) -> bool:
    """Whether ``pid`` runs: gone, or a zombie (killed, not yet reaped by whoever inherited it: in CI the killed
    shell's orphaned child waited for the container's init, and ``kill(pid, 0)`` succeeds on a zombie), is not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_control_program_that_hangs_is_killed_with_its_children(tmp_path, monkeypatch):
    """A fresh user's find: a hung control program left its child running after the server gave up on it."""
    pidfile = tmp_path / "child.pid"
    control = tmp_path / "hang.sh"
    control.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {pidfile}\nwait\n")
    control.chmod(0o755)
    monkeypatch.setenv("BATCHER_MPS_CONTROL", str(control))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "TIMEOUT_S", 0.5)
    daemon = mps.MpsDaemon(str(tmp_path))
    with pytest.raises(ConfigError, match=r"hang.sh -d' did not return within 0.5 s; it was stopped"):
        daemon.start()
    child = int(pidfile.read_text())
    for _ in range(500):  # the kill is asynchronous to the child's exit
        if not _running(child):
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"the control program's child {child} is still running")
    assert not daemon.started and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
