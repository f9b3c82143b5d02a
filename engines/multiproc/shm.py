"""Shared-memory segments of the multiproc engine: created, named and unlinked by the parent (the server) only.

Every segment of a server process is named ``batcher_<pid>_<id>`` (:data:`SEGMENT_PREFIX`), so
:func:`sweep_orphan_segments` can find those of servers that are gone.
"""

from __future__ import annotations

import os
import uuid
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

#: every shared-memory segment of this server process starts with this (``/dev/shm/batcher_<pid>_<id>``).
SEGMENT_PREFIX = f"batcher_{os.getpid()}_"
#: the smallest output segment (small batches never regrow it); an input segment starts at 64 KiB.
MIN_SEGMENT_BYTES = 1 << 20
MIN_INPUT_SEGMENT_BYTES = 1 << 16
SHM_DIR = Path("/dev/shm")


def sweep_orphan_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the segments of servers that no longer run (``batcher_<pid>_*`` whose pid is gone); returns their
    names. Those of live processes, this one included, are left alone."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:  # no /dev/shm on this platform
        return removed
    for name in names:
        if not name.startswith("batcher_"):
            continue
        try:
            pid = int(name.split("_")[1])
            os.kill(pid, 0)
            continue  # alive
        except (ValueError, IndexError):
            continue
        except PermissionError:
            continue  # alive, another user's
        except ProcessLookupError:
            pass
        try:
            os.unlink(shm_dir / name)
            removed.append(name)
        except OSError:
            pass
    return removed


def drop(seg: SharedMemory) -> None:
    """Unlink a segment this process created; its mapping goes when the last view of it does (a caller may still
    hold a :meth:`MultiprocContext.host_buffer` view)."""
    try:
        seg.close()
    except BufferError:
        pass
    seg.unlink()


def new_segment(old: SharedMemory | None, nbytes: int, minimum: int = MIN_SEGMENT_BYTES) -> SharedMemory:
    """A parent-owned segment of at least ``nbytes`` (and ``minimum``) named after this server; the old one, if
    any, is unlinked."""
    if old is not None:
        drop(old)
    return SharedMemory(name=f"{SEGMENT_PREFIX}{uuid.uuid4().hex[:16]}", create=True, size=max(nbytes, minimum))
