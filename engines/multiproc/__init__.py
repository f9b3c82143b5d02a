"""Crash isolation: an engine whose execution contexts each live in a supervised worker process.

The parent talks to each worker over a Unix domain socket (``multiprocessing.connection``, family AF_UNIX) and
passes tensors through shared memory (``multiprocessing.shared_memory``): per call, only shapes, dtypes and
segment names cross the socket. Each input has its own segment, grown on demand; :meth:`MultiprocContext.host_buffer`
hands out views of it, so a caller stacks a batch straight into shared memory. On CUDA the worker page-locks each
input segment (``cudaHostRegister``), so its context copies host-to-device straight from shared memory: one host
copy per batch in all (into the segment). The worker runs its batches on the context's own thread where it has
one (a CUDA-graph context, :attr:`ExecutionContext.executor`).

Nothing is left behind when a worker dies (``kill -9``, a crash in native code):

* **Segments** are created, owned and unlinked by the parent only (one per input and one for the outputs, each
  grown on demand); a worker only attaches to them. A worker whose outputs do not fit asks for a larger output
  segment (``("grow", nbytes)``), so it never creates one itself. Segment names carry a per-server prefix
  (:data:`SEGMENT_PREFIX`, ``batcher_<pid>_``): :func:`sweep_orphan_segments` removes those of servers that are
  gone (a server killed together with its resource tracker).
* **The socket directory** exists only while a worker starts: the socket file is removed when the listener
  closes after the worker connected, and the directory right after.
* **The process** is reaped (joined) when its death is noticed.

Supervision: a watcher thread per context waits on the worker's process sentinel, so a worker that dies while
idle is noticed at once, logged (one WARNING with its exit code) and restarted after a backoff that doubles from
0.1 s up to 5 s while workers keep dying (:data:`BACKOFF_FIRST_S`, :data:`BACKOFF_MAX_S`); the next request then
finds a live worker. A worker that dies while running a batch fails that batch with :class:`WorkerCrashed` (the
server answers 503); a batch that could not even be handed over (the worker died just before) never ran and is
run on the restarted worker. The worker runs another backend (ONNX Runtime here) in its own process, so a crash
in native code, a leak or a stuck GIL stays there.
"""

from .parent import BACKOFF_FIRST_S, BACKOFF_MAX_S, START_TIMEOUT_S, MultiprocContext, MultiprocEngine, WorkerCrashed
from .shm import SEGMENT_PREFIX, sweep_orphan_segments

__all__ = ["MultiprocEngine", "MultiprocContext", "WorkerCrashed", "sweep_orphan_segments", "SEGMENT_PREFIX",
           "START_TIMEOUT_S", "BACKOFF_FIRST_S", "BACKOFF_MAX_S"]
