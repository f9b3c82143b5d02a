"""Multi-process mode's runtime folders: a supervisor killed with kill -9 leaves its folder behind, and the next
supervisor removes exactly the folders whose supervisor is gone
(:func:`batcher.supervisor.remove_stale_runtime_dirs`)."""

from __future__ import annotations

import os
import subprocess
import sys

from batcher.supervisor import OWNER_FILE, _start_time, remove_stale_runtime_dirs


def _folder(parent, name: str, owner: str | None) -> str:
    path = parent / name
    (path / "metrics").mkdir(parents=True)
    (path / "metrics" / "counter_1.db").write_bytes(b"\0" * 4096)
    if owner is not None:
        (path / OWNER_FILE).write_text(owner)
    return str(path)


def test_only_the_folders_of_supervisors_that_are_gone_are_removed(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)  # exited: its pid runs nothing now, or (reused) a process started later
    me = f"{os.getpid()} {_start_time(os.getpid())}"
    alive = _folder(tmp_path, "batcher-alive", me)
    dead = _folder(tmp_path, "batcher-dead", f"{dead_pid} 1")
    reused = _folder(tmp_path, "batcher-reused", f"{os.getpid()} 1")  # this pid, another start time
    making = _folder(tmp_path, "batcher-making", None)  # no owner file yet: left alone
    other = _folder(tmp_path, "other-dead", f"{dead_pid} 1")  # not a runtime folder's name
    assert sorted(remove_stale_runtime_dirs(str(tmp_path))) == sorted([dead, reused])
    assert [os.path.isdir(p) for p in (alive, dead, reused, making, other)] == [True, False, False, True, True]
    assert remove_stale_runtime_dirs(str(tmp_path)) == []


def test_the_start_time_names_this_process_and_no_process_for_a_pid_that_runs_nothing():
    assert _start_time(os.getpid()) == _start_time(os.getpid()) is not None
    assert _start_time(2**22 + 12345) is None  # above the kernel's pid_max
