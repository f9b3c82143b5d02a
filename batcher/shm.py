"""Triton's shared-memory extensions (``docs/protocol/extension_shared_memory.md``): the registry of the regions
clients registered, and each request's hold on the regions it names.

A local client puts tensors in memory it shares with the server instead of in the HTTP body: system shared memory
(POSIX segments, ``v2/systemsharedmemory/...``) or, on GPU, CUDA shared memory (device memory exported with a CUDA
IPC handle, ``v2/cudasharedmemory/...``). Region kinds: :mod:`batcher.shm_regions`. The registry lives where the
:class:`~batcher.dataplane.DataPlane` lives (the engine process when front ends run in other processes), so a
shared-memory input reaches the batch without passing through a front end.

Rules (Triton's unless said otherwise):

* Off unless ``server.shared_memory.system`` / ``.cuda`` is true; when off, its endpoints answer 404 and a
  request naming a region gets 400.
* Names: one namespace for system and CUDA regions; registering a name that is taken is 400, as are a key that
  does not exist, a segment smaller than ``offset + byte_size`` and a handle CUDA refuses. At most
  :data:`MAX_REGIONS` regions (this server's bound).
* Tensors: an input or output's ``shared_memory_offset + shared_memory_byte_size`` must lie inside its region
  (400 naming the region, the offset, the size and the region's size); an output larger than its
  ``shared_memory_byte_size`` is 400 after execution.
* Lifetime: a request holds every region it names (a reference count) from the moment it is read until its answer
  is delivered. Unregistering answers at once and the region leaves the namespace at once (status no longer lists
  it, new requests naming it get 400, the name can be registered again); it is unmapped when the last request
  holding it is done. Triton also answers at once and defers the unmap, but keeps the region listed and usable
  until then. Unregistering an unknown name is not an error (Triton). Every region is unmapped at shutdown.
* Copies: a system-shm input is read through the segment's file descriptor into the server's own memory
  (``pread``; a segment its client truncates reads short, a 400, instead of faulting the process), then stacked
  with its batch; in a process with GPU models the region is page-locked and an input is a zero-copy, read-only
  view of the mapping, which the batch sends to the device by DMA (:mod:`batcher.shm_regions`). A CUDA input is
  copied device-to-host once (the engine contract takes host arrays); outputs are copied into their region
  (``pwrite``, or into a page-locked mapping) before the answer is delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import resource
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from engines.cuda import CudaError

from .config import SharedMemoryConfig
from .errors import InvalidInput, NotFound, Unavailable
from .protocol import InferRequest, ShmInput, ShmRef
from .shm_regions import CudaRegion, CudaStaging, Region, SystemRegion, tensor_bytes

log = logging.getLogger(__name__)

#: Most regions registered at once (system and CUDA together).
MAX_REGIONS = 1024
#: file descriptors a process keeps free for its connections and its own files: a registration that would leave
#: fewer is refused. A system region holds two (its segment's, which reads and writes go through, and the copy
#: ``mmap`` keeps); with a soft limit of 1,024 a new user's 505 registrations took every one, and the server then
#: accepted no connection until they were unregistered. ``batcher serve`` raises the soft limit to the hard one at
#: start (:func:`batcher.supervisor.raise_fd_limit`), so this bites only where the hard limit is low.
FD_RESERVE = 256
#: file descriptors one registration may take (a system region's two).
FDS_PER_REGION = 2
#: A system-shm copy of more bytes than this runs in a worker thread, so the event loop keeps serving.
OFFLOAD_BYTES = 256 * 1024
KINDS = ("system", "cuda")


def require_enabled(config: SharedMemoryConfig, kind: str) -> None:
    """Raises NotFound (404) unless ``kind`` (``"system"`` or ``"cuda"``) is a shared-memory extension that is on."""
    if kind not in KINDS:
        raise NotFound(f"unknown shared memory kind {kind!r}; kinds: {', '.join(KINDS)}")
    if not getattr(config, kind):
        raise NotFound(f"{kind} shared memory is disabled (server.shared_memory.{kind}: false)")


def uses_shm(request: InferRequest) -> bool:
    """Whether the request names a shared-memory region (an input or a requested output); most do not, and skip
    the registry altogether."""
    for t in request.inputs.values():
        if type(t) is ShmInput:
            return True
    for o in request.outputs or ():
        if o.shm is not None:
            return True
    return False


def fds_free() -> tuple[int, int] | None:
    """``(free, limit)``: file descriptors this process may still open under its soft ``RLIMIT_NOFILE``, and that
    limit; None where it cannot tell (no limit, or no ``/proc/self/fd``)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself held open
    except OSError:
        return None
    return soft - used, soft


class SharedMemoryRegistry:
    """The registered regions by name. Used from the event loop; CUDA work runs in worker threads."""

    def __init__(self, config: SharedMemoryConfig, page_lock: bool = False) -> None:
        """``page_lock``: the process runs models on a GPU: page-lock system regions as they are registered
        (:meth:`SystemRegion.page_lock`); where CUDA refuses, the region works unlocked (a warning is logged)."""
        self.config = config
        self.page_lock = page_lock
        self._regions: dict[str, Region] = {}
        self._opening: set[str] = set()  # names whose CUDA region is being opened in a thread
        self._retired: set[Region] = set()  # unregistered while held by requests
        self._staging: dict[int, CudaStaging] = {}  # device -> staging for its CUDA regions
        self._closed = False

    # ---------------------------------------------------------------- register, unregister, status
    async def register(self, kind: str, name: str, **params: Any) -> None:
        """Map a client's region under ``name``: ``kind`` ``"system"`` with ``key``, ``offset``, ``byte_size``, or
        ``"cuda"`` with ``raw_handle`` (64 bytes), ``device_id``, ``byte_size``.

        Raises:
            NotFound: the extension is off. InvalidInput: name taken or empty, too many regions, or the region
            cannot be opened (:mod:`batcher.shm_regions`). Unavailable: the server is shutting down.
        """
        require_enabled(self.config, kind)
        if self._closed:
            raise Unavailable("the server is shutting down")
        if not name:
            raise InvalidInput("a shared memory region needs a name")
        if name in self._regions or name in self._opening:
            raise InvalidInput(f"shared memory region '{name}' is already registered; unregister it first")
        if len(self._regions) + len(self._opening) >= MAX_REGIONS:
            raise InvalidInput(f"{MAX_REGIONS} shared memory regions are registered already; unregister some first")
        free = fds_free()
        if free is not None and free[0] - FDS_PER_REGION < FD_RESERVE:
            raise InvalidInput(f"cannot register shared memory region '{name}': {free[0]} of the server's "
                               f"{free[1]} file descriptors are free, and it keeps {FD_RESERVE} for connections; "
                               "unregister some regions first")
        if kind == "system":
            region: Region = SystemRegion(name, **params)
            if self.page_lock:
                await self._page_lock(region)
        else:
            device = params["device_id"]
            staging = self._staging.setdefault(device, CudaStaging(device))
            self._opening.add(name)
            try:
                region = await asyncio.to_thread(CudaRegion, name, staging=staging, **params)
            finally:
                self._opening.discard(name)
        if self._closed:  # closed while a thread opened it
            region.close()
            raise Unavailable("the server is shutting down")
        self._regions[name] = region

    async def _page_lock(self, region: SystemRegion) -> None:
        """Page-lock ``region`` in a thread (:meth:`SystemRegion.page_lock`); where CUDA refuses, it stays pageable
        (logged). Cancelled meanwhile: the thread goes on, and the region closes when it is done."""
        self._opening.add(region.name)
        locking = asyncio.ensure_future(asyncio.to_thread(region.page_lock))
        try:
            await asyncio.shield(locking)
        except CudaError as exc:
            log.warning("system shared memory region '%s' stays pageable: %s", region.name, exc)
        except asyncio.CancelledError:
            locking.add_done_callback(lambda f: (f.cancelled() or f.exception(), region.close()))
            raise
        finally:
            self._opening.discard(region.name)

    async def unregister(self, kind: str, name: str | None = None) -> None:
        """Unregister region ``name`` of ``kind``, or every region of ``kind`` when ``name`` is None (module
        docstring: lifetime). Raises NotFound: the extension is off."""
        require_enabled(self.config, kind)
        names = [name] if name is not None else list(self._regions)
        for n in names:
            region = self._regions.get(n)
            if region is None or region.kind != kind:
                continue
            del self._regions[n]
            region.retired = True
            if region.users:
                self._retired.add(region)
            else:
                region.close()

    def status(self, kind: str, name: str | None = None) -> list[dict[str, Any]]:
        """Triton's status list: every region of ``kind``, or region ``name`` (system: ``name, key, offset,
        byte_size``; CUDA: ``name, device_id, byte_size``).

        Raises:
            NotFound: the extension is off, no region has that name, or it is of the other kind.
        """
        require_enabled(self.config, kind)
        if name is None:
            return [r.status() for r in self._regions.values() if r.kind == kind]
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"unable to find {kind} shared memory region '{name}'")
        if region.kind != kind:
            raise NotFound(f"the region named '{name}' is registered as {region.kind} shared memory, not {kind}")
        return [region.status()]

    # ---------------------------------------------------------------- requests
    def hold(self, request: InferRequest) -> Hold:
        """Check every region the request names and take a reference on each until the hold is released.

        Raises:
            InvalidInput: a region that is not registered, or a tensor outside its region.
        """
        regions: dict[str, Region] = {}
        get = self._regions.get
        for name, t in request.inputs.items():  # per request: the checks inline, the messages only for a refusal
            if type(t) is ShmInput:
                ref = t.ref
                region = get(ref.region)
                if region is None or ref.offset + ref.byte_size > region.byte_size:
                    self._refuse(f"input '{name}'", ref, region)
                regions[ref.region] = region
        for o in request.outputs or ():
            ref = o.shm
            if ref is not None:
                region = get(ref.region)
                if region is None or ref.offset + ref.byte_size > region.byte_size:
                    self._refuse(f"output '{o.name}'", ref, region)
                regions[ref.region] = region
        return Hold(self, request, regions)

    def _refuse(self, where: str, ref: ShmRef, region: Region | None) -> None:
        """Raises InvalidInput: ``ref``'s region is not registered (``region`` None), or ``ref`` runs past it."""
        if region is None:
            off = "" if self.config.system or self.config.cuda else " (shared memory is disabled: server.shared_memory)"
            raise InvalidInput(f"{where}: shared memory region '{ref.region}' is not registered{off}")
        region.check(ref, where)

    def _release(self, regions: list[Region]) -> None:
        for region in regions:
            region.users -= 1
            if region.retired and not region.users:
                self._retired.discard(region)
                region.close()

    async def close(self) -> None:
        """Unmap every region and free the CUDA staging buffers (at shutdown, after the last request)."""
        self._closed = True
        regions = [*self._regions.values(), *self._retired]
        self._regions.clear()
        self._retired.clear()
        for region in regions:
            region.close()
        for staging in self._staging.values():
            staging.close()
        self._staging.clear()


class Hold:
    """A request's references on the regions it names (:meth:`SharedMemoryRegistry.hold`); ``async with`` releases
    them on exit. While a CUDA copy started for it still runs (its request was cancelled meanwhile), the release
    waits for that copy."""

    def __init__(self, registry: SharedMemoryRegistry, request: InferRequest, regions: dict[str, Region]) -> None:
        self._registry = registry
        self._request = request
        self._regions = regions
        self._busy: asyncio.Future | None = None
        self._blocking = False  # a region read and written in worker threads (CUDA)
        for region in regions.values():
            region.users += 1
            self._blocking = self._blocking or region.blocking
        #: whether the request placed an output in shared memory (:meth:`write` has work)
        self.writes = any(o.shm is not None for o in request.outputs) if request.outputs else False

    async def __aenter__(self) -> Hold:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Give the regions back (once; after a CUDA copy still running for the request, when it ends)."""
        if not self._regions:
            return
        regions = list(self._regions.values())
        self._regions = {}
        self._blocking = False
        if self._busy is not None and not self._busy.done():
            self._busy.add_done_callback(lambda _: self._registry._release(regions))
        else:
            self._registry._release(regions)

    async def _run(self, region: Region, nbytes: int, fn: Any, *args: Any) -> Any:
        """``fn(*args)``: inline, or in a worker thread for CUDA and for large system copies."""
        if not region.blocking and nbytes <= OFFLOAD_BYTES:
            return fn(*args)
        self._busy = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        return await asyncio.shield(self._busy)

    @property
    def immediate(self) -> bool:
        """Whether every region it holds is read and written on the event loop, without waiting (system regions:
        :meth:`read_now`, :meth:`write_now`); CUDA regions copy in worker threads."""
        return not self._blocking

    def read_now(self) -> dict[str, np.ndarray]:
        """:meth:`inputs` of an :attr:`immediate` hold, at once (system reads are views). Raises as :meth:`inputs`;
        RuntimeError: the hold is not immediate."""
        if not self.immediate:
            raise RuntimeError("a CUDA shared memory region is read in a worker thread (Hold.inputs)")
        inputs = self._request.inputs
        if not self._regions:
            return inputs  # type: ignore[return-value]
        out = dict(inputs)
        loop = asyncio.get_running_loop()
        regions = self._regions
        for name, t in inputs.items():
            if type(t) is ShmInput:
                out[name] = regions[t.ref.region].read(t.ref, t.datatype, t.shape, f"input '{name}'", loop)
        return out

    def _placements(self, outputs: dict[str, np.ndarray]) -> list[tuple[Region, int, np.ndarray]]:
        """``(region, offset, bytes)`` of each output the request placed in shared memory.

        Raises:
            InvalidInput: an output larger than its ``shared_memory_byte_size``.
        """
        todo = []
        for o in self._request.outputs or ():
            if o.shm is None:
                continue
            data = tensor_bytes(outputs[o.name])
            ref: ShmRef = o.shm
            if data.nbytes > ref.byte_size:
                raise InvalidInput(f"output '{o.name}' needs {data.nbytes} bytes, shared_memory_byte_size of region "
                                   f"'{ref.region}' is {ref.byte_size}")
            todo.append((self._regions[ref.region], ref.offset, data))
        return todo

    def write_now(self, outputs: dict[str, np.ndarray]) -> bool:
        """:meth:`write` at once where it costs no wait (system regions, each output at most ``OFFLOAD_BYTES``):
        True, written; False, nothing written (use :meth:`write`). Raises as :meth:`write`, nothing written."""
        todo = self._placements(outputs)
        if any(region.blocking or data.nbytes > OFFLOAD_BYTES for region, _, data in todo):
            return False
        for region, offset, data in todo:
            region.write(offset, data)
        return True

    async def inputs(self) -> dict[str, np.ndarray]:
        """The request's inputs with every :class:`~batcher.protocol.ShmInput` read from its region (module
        docstring: copies). Raises InvalidInput: BYTES or BOOL data that does not parse, a CUDA copy refused."""
        inputs = self._request.inputs
        if not self._regions:
            return inputs  # type: ignore[return-value]
        if self.immediate:
            return self.read_now()
        out = dict(inputs)
        for name, t in inputs.items():
            if isinstance(t, ShmInput):
                region = self._regions[t.ref.region]
                if region.blocking:
                    out[name] = await self._run(region, t.ref.byte_size, region.read, t.ref, t.datatype, t.shape,
                                                f"input '{name}'")
                else:  # a system read: here, on the event loop (a view's size check shared by this pass)
                    out[name] = region.read(t.ref, t.datatype, t.shape, f"input '{name}'",
                                            asyncio.get_running_loop())
        return out

    async def write(self, outputs: dict[str, np.ndarray]) -> None:
        """Copy each output the request placed in shared memory into its region.

        Raises:
            InvalidInput: an output larger than its ``shared_memory_byte_size``; a CUDA copy refused.
        """
        for region, offset, data in self._placements(outputs):
            await self._run(region, data.nbytes, region.write, offset, data)


class RegistryLock:
    """Serializes the changes that front-end processes make to the engine processes' registries (register,
    unregister, a restarted engine process given the others' regions): each front end sends a change to every
    engine process, and two changes of one name through two front ends at once reached the engine processes in
    different orders (a fresh user's find: both clients got 400 "already registered", and the models of different
    engine processes read different segments under one name). An exclusive ``flock`` on ``path`` (a file in the
    server's runtime folder), polled every :data:`LOCK_POLL_S` so that a cancelled waiter leaves at once; the lock
    goes with its process, whatever the exit."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._here = asyncio.Lock()  # one holder per process: a flock belongs to an open file, not a coroutine

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        async with self._here:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        await asyncio.sleep(LOCK_POLL_S)
                yield
            finally:
                os.close(fd)  # releases the lock


#: how often a front end waiting for :class:`RegistryLock` tries again, in seconds
LOCK_POLL_S = 0.002
