"""Multi-process mode's runtime folders (``$TMPDIR/batcher-*``: the engine sockets, the metrics files, the MPS
pipes): each supervisor claims its own with a lock (:func:`claim_runtime_dir`), and the next one to start removes
those whose supervisor is gone (:func:`remove_stale_runtime_dirs`), a supervisor killed with ``kill -9`` included."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat

from .mps import MpsDaemon

log = logging.getLogger("batcher")

RUNTIME_PREFIX = "batcher-"  #: the runtime folders' names in the temporary folder: ``batcher-XXXXXXXX``
OWNER_FILE = "supervisor"  #: in each runtime folder: :data:`OWNER_TAG`, the supervisor's pid and start time
OWNER_TAG = "trt-batcher runtime folder"  #: the owner file's first words: a folder without them is not ours


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks after boot (``/proc/<pid>/stat`` field 22), for people reading an
    owner file; None if there is no such process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def claim_runtime_dir(folder: str) -> int:
    """Write ``folder``'s owner file and hold an exclusive ``flock`` on it for as long as the returned descriptor
    is open (the supervisor's life: the kernel releases it when the process ends, ``kill -9`` included). A lock,
    unlike a pid, says "gone" rightly across PID namespaces that share the folder (containers sharing ``/tmp``)."""
    fd = os.open(os.path.join(folder, OWNER_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"{OWNER_TAG} pid={os.getpid()} start={_start_time(os.getpid())}\n".encode())
    return fd


def _stale(folder: str) -> bool:
    """Whether ``folder`` is a runtime folder whose supervisor is gone: its owner file is a regular file of this
    user (not a link, a FIFO or a device: opened without following links or blocking, at most 256 bytes read) that
    starts with :data:`OWNER_TAG`, and no process holds its lock."""
    try:
        fd = os.open(os.path.join(folder, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid()
                or not os.read(fd, 256).startswith(OWNER_TAG.encode())):
            return False
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken: nobody holds the supervisor's exclusive lock
        return True
    except OSError:  # held (BlockingIOError), or unreadable
        return False
    finally:
        os.close(fd)


def remove_stale_runtime_dirs(parent: str) -> list[str]:
    """Remove the runtime folders in ``parent`` whose supervisor is gone (:func:`_stale`); the folders removed. A
    folder of another user, a link, or one without a valid owner file (being made right now, from before owner
    files, or not ours) is left alone. The MPS control daemon a removed folder holds the pipes of
    (``server.cuda_mps``) is sent ``quit`` first (:meth:`MpsDaemon.quit_stale`)."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(RUNTIME_PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _stale(entry.path):
            if MpsDaemon.quit_stale(entry.path):
                log.info("sent quit to the MPS control daemon of %s", entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed
