"""Multi-process mode's runtime folders: a supervisor killed with kill -9 leaves its folder behind, and the next
supervisor removes exactly the folders whose supervisor is gone
(:func:`batcher.runtime_dir.remove_stale_runtime_dirs`: the owner file's lock is free)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from batcher.runtime_dir import OWNER_FILE, OWNER_TAG, claim_runtime_dir, remove_stale_runtime_dirs


def _folder(parent, name: str) -> str:
    path = parent / name
    (path / "metrics").mkdir(parents=True)
    (path / "metrics" / "counter_1.db").write_bytes(b"\0" * 4096)
    return str(path)


def _claimed_by_a_process_that_exited(folder: str) -> None:
    code = f"from batcher.runtime_dir import claim_runtime_dir; claim_runtime_dir({folder!r})"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_only_the_folders_whose_supervisor_is_gone_are_removed(tmp_path):
    alive = _folder(tmp_path, "batcher-alive")
    fd = claim_runtime_dir(alive)  # this process holds its lock: its supervisor is alive
    dead = _folder(tmp_path, "batcher-dead")
    _claimed_by_a_process_that_exited(dead)
    assert open(os.path.join(dead, OWNER_FILE)).read().startswith(f"{OWNER_TAG} pid=")
    other = _folder(tmp_path, "other-dead")
    _claimed_by_a_process_that_exited(other)  # a dead owner, but not a runtime folder's name
    try:
        assert remove_stale_runtime_dirs(str(tmp_path)) == [dead]
        assert [os.path.isdir(p) for p in (alive, dead, other)] == [True, False, True]
        assert remove_stale_runtime_dirs(str(tmp_path)) == []
    finally:
        os.close(fd)
    assert remove_stale_runtime_dirs(str(tmp_path)) == [alive]  # its lock released: gone too


def test_folders_that_are_not_provably_ours_are_left_alone_without_blocking(tmp_path):
    """No owner file (one being made, or from before owner files), a file without the tag (a user's ``1 0``), a
    symlink as the owner file (to a real owner file, or to /dev/zero), a FIFO (opening it would block), a directory
    as the owner file, and a symlink named like a runtime folder: none is removed, and the scan does not hang."""
    victim = _folder(tmp_path, "victim")
    _claimed_by_a_process_that_exited(victim)
    kept = [_folder(tmp_path, f"batcher-{n}") for n in ("none", "untagged", "link", "zero", "fifo", "dir")]
    (tmp_path / "batcher-untagged" / OWNER_FILE).write_text("1 0")
    os.symlink(os.path.join(victim, OWNER_FILE), tmp_path / "batcher-link" / OWNER_FILE)
    os.symlink("/dev/zero", tmp_path / "batcher-zero" / OWNER_FILE)
    os.mkfifo(tmp_path / "batcher-fifo" / OWNER_FILE)
    os.mkdir(tmp_path / "batcher-dir" / OWNER_FILE)
    os.symlink(victim, tmp_path / "batcher-symlinked")
    if os.getuid() == 0:  # a tagged, unlocked owner file of another user (root can give it away)
        kept.append(_folder(tmp_path, "batcher-chowned"))
        _claimed_by_a_process_that_exited(kept[-1])
        os.chown(os.path.join(kept[-1], OWNER_FILE), 65534, 65534)
    assert remove_stale_runtime_dirs(str(tmp_path)) == []
    assert all(os.path.isdir(p) for p in [*kept, victim])
    assert remove_stale_runtime_dirs(str(tmp_path / "no-such-folder")) == []


def test_accept_failures_for_want_of_files_are_one_warning_per_interval(caplog):
    """batcher.supervisor.AcceptErrors: asyncio's "socket.accept() out of system resource" (EMFILE) becomes one
    WARNING per AcceptErrors.every_s with the count of those held back, on an injected clock; any other error goes
    to the loop's default handler as before."""
    import asyncio
    import errno
    import logging

    from batcher.supervisor import AcceptErrors

    now = [100.0]
    handler = AcceptErrors(clock=lambda: now[0])
    loop = asyncio.new_event_loop()
    emfile = {"message": "socket.accept() out of system resource",
              "exception": OSError(errno.EMFILE, "Too many open files")}
    try:
        with caplog.at_level(logging.WARNING):
            for t in (100.0, 101.0, 105.0, 109.9, 110.0, 110.5):
                now[0] = t
                handler(loop, emfile)
            handler(loop, {"message": "something else broke", "exception": ValueError("x")})
    finally:
        loop.close()
    warnings = [r for r in caplog.records if r.name == "batcher" and "cannot accept connections" in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING, logging.WARNING]
    assert "(0 more" in warnings[0].getMessage() and "(3 more" in warnings[1].getMessage()
    others = [r for r in caplog.records if "something else broke" in r.getMessage()]
    assert len(others) == 1 and others[0].levelno == logging.ERROR  # the default handler, unchanged
