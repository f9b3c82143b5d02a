"""The two kinds of client shared-memory region of Triton's shared-memory extensions, and how tensors are read from
and written to them (the rules they serve: :mod:`batcher.shm`).

* :class:`SystemRegion`: ``byte_size`` bytes at ``offset`` of the POSIX shared-memory segment ``key``
  (``shm_open(key, O_RDWR)``, as Triton opens it). Reads and writes go through the segment's file descriptor
  (``pread``, ``pwrite``): a client that truncates its segment while a request reads it makes a short read, a 400,
  where touching a mapping past the segment's new end would kill the process with SIGBUS (a new user's loop of
  ``ftruncate`` did, within a few requests). That is one copy per input, into memory of the server's own. In a
  process that runs models on a GPU the region is also mapped and page-locked (:meth:`SystemRegion.page_lock`,
  ``cudaHostRegister``), and its reads are zero-copy numpy views of the mapping, so a batch of inputs read from it
  goes host-to-device by DMA, one copy per request, without being stacked on the host first
  (``ExecutionContext.gather_rows``); while any view exists, ``mmap`` refuses to close (its buffer-export rule) and
  the mapping is unmapped only when the last view is gone. Outputs are written with ``pwrite`` either way. A
  page-locked region's inputs are read by the device, and by the host only where a batch cannot go by DMA; the
  truncation hazard remains there (the README's "Shared-memory tensors").
* :class:`CudaRegion`: ``byte_size`` bytes of another process's device memory opened from its CUDA IPC handle
  (``cudaIpcOpenMemHandle``, :class:`engines.cuda.IpcMemory`). Reads copy device-to-host and writes host-to-device
  through a :class:`CudaStaging` buffer of its device; both block (call them off the event loop).

Sizes and offsets are bytes. Every client mistake raises :class:`~batcher.errors.InvalidInput` (400).
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import threading
from typing import Any

import numpy as np

from engines.cuda import (CudaError, HostRegistration, IpcMemory, PinnedBuffer, Stream, memcpy_async, require_device,
                          set_device)
from engines.datatypes import NUMPY_DTYPES

from .codec import decode_bytes_elements, encode_bytes_elements
from .errors import InvalidInput
from .protocol import ShmRef

try:  # the call multiprocessing.shared_memory makes; that class would also hand the client's segment to the
    from _posixshmem import shm_open  # resource tracker, which unlinks it when this process exits (Python < 3.13)
except ImportError:  # pragma: no cover - not a POSIX system
    shm_open = None

log = logging.getLogger(__name__)

#: Bytes of pinned host memory per device through which CUDA regions are read and written, in chunks of this size.
STAGING_BYTES = 8 << 20


def tensor_bytes(arr: np.ndarray) -> np.ndarray:
    """An output's bytes as it is laid out in shared memory (row-major; BYTES: 4-byte little-endian length before
    each element, as the binary extension and tritonclient's ``get_contents_as_numpy`` read them), ``uint8``."""
    if arr.dtype == object:
        return np.frombuffer(encode_bytes_elements(arr), np.uint8)
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


#: the datatypes whose bytes are the array as they lie (no BYTES parsing, no BOOL check): :meth:`SystemRegion.read`
_PLAIN_DTYPES = {name: dt for name, dt in NUMPY_DTYPES.items() if name not in ("BYTES", "BOOL")}


def tensor_from_bytes(raw: np.ndarray, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """An input of ``datatype`` and ``shape`` over ``raw`` (``uint8``, exactly its bytes): a view, except BYTES
    (parsed into an object array) and unaligned data (copied).

    Raises:
        InvalidInput: BYTES elements that do not fill ``raw`` exactly, BOOL bytes other than 0 and 1.
    """
    if datatype == "BYTES":
        return decode_bytes_elements(raw, int(np.prod(shape)), where).reshape(shape)
    arr = raw.view(NUMPY_DTYPES[datatype]).reshape(shape)
    if datatype == "BOOL" and raw.size and raw.max() > 1:
        raise InvalidInput(f"{where}: BOOL bytes must be 0 or 1")
    return arr if arr.flags.aligned else arr.copy()


class Region:
    """A registered region: its name, kind, size and the requests holding it (:mod:`batcher.shm` counts them)."""

    kind = ""
    #: reads and writes block (CUDA copies): run them off the event loop.
    blocking = False

    def __init__(self, name: str, byte_size: int) -> None:
        self.name = name
        self.byte_size = byte_size
        self.users = 0  # requests holding it
        self.retired = False  # unregistered: closed when the last user is done

    def check(self, ref: ShmRef, where: str) -> None:
        """Raises InvalidInput unless ``ref`` lies inside this region."""
        if ref.offset + ref.byte_size > self.byte_size:
            raise InvalidInput(
                f"{where}: shared_memory_offset {ref.offset} + shared_memory_byte_size {ref.byte_size} runs past the "
                f"end of shared memory region '{self.name}' ({self.byte_size} bytes)")

    def read(self, ref: ShmRef, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
        """The input tensor at ``ref`` (checked against the region already)."""
        raise NotImplementedError

    def write(self, offset: int, data: np.ndarray) -> None:
        """Copy ``data`` (``uint8``) to ``offset`` (checked against the region already)."""
        raise NotImplementedError

    def status(self) -> dict[str, Any]:
        """The region's entry in Triton's status list."""
        raise NotImplementedError

    def close(self) -> None:
        """Unmap or close the region. Idempotent."""
        raise NotImplementedError


class SystemRegion(Region):
    """``byte_size`` bytes at ``offset`` of the POSIX shared-memory segment ``key``, mapped read/write.

    Raises (constructor):
        InvalidInput: no segment has that key, it cannot be opened, it is smaller than ``offset + byte_size``,
            or ``byte_size`` is 0.
    """

    kind = "system"

    def __init__(self, name: str, key: str, offset: int, byte_size: int) -> None:
        super().__init__(name, byte_size)
        self.key, self.offset = key, offset
        what = f"system shared memory region '{name}'"
        if byte_size <= 0:
            raise InvalidInput(f"{what}: byte_size must be at least 1, got {byte_size}")
        if not key.strip("/") or "\0" in key or shm_open is None:
            raise InvalidInput(f"{what}: invalid key {key!r}")
        try:
            fd = shm_open(key, os.O_RDWR, 0o600)
        except FileNotFoundError:
            raise InvalidInput(f"{what}: no shared memory segment has the key {key!r}") from None
        except OSError as exc:
            raise InvalidInput(f"{what}: cannot open key {key!r}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InvalidInput(f"{what}: offset {offset} + byte_size {byte_size} runs past the end of segment "
                                   f"{key!r} ({size} bytes)")
            start = offset - offset % mmap.ALLOCATIONGRANULARITY  # mmap's offset must be page-aligned
            self._map: mmap.mmap | None = mmap.mmap(fd, offset + byte_size - start, offset=start)
            self._base = offset - start
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise InvalidInput(f"{what}: cannot map key {key!r}: {exc.strerror}") from None
            raise
        self._fd = fd  # kept: uses check the segment's size again (fstat, :meth:`_view`)
        self._size_checked = False
        self._locked: HostRegistration | None = None

    def page_lock(self) -> None:
        """Page-lock the whole mapping for every GPU of the process (``cudaHostRegister``, portable), until
        :meth:`close`. Blocks (pins every page): call it off the event loop.

        Raises:
            CudaError: no CUDA runtime or device, or CUDA refused (the region then works unlocked).
        """
        if self._map is None or self._locked is not None:
            return
        view = np.frombuffer(self._map, np.uint8)
        try:
            self._locked = HostRegistration(view.ctypes.data, view.nbytes, portable=True)
        finally:
            del view  # no export may outlive this call: close() unmaps

    def _view(self, offset: int, nbytes: int, loop: asyncio.AbstractEventLoop | None = None) -> np.ndarray:
        self._check_mapped(loop)
        return np.frombuffer(self._map, np.uint8, nbytes, self._base + offset)

    def _check_mapped(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Raises InvalidInput: unregistered, or the segment is now smaller than the region."""
        if self._map is None:
            raise InvalidInput(f"system shared memory region '{self.name}' was unregistered")
        # a segment the client truncated after registering: a 400 rather than a file grown back by a write, or
        # (a page-locked region's views) the mapping touched past its new end, which kills the process with
        # SIGBUS. Checked at every write and, on the event loop (``loop``), at the first view of each loop
        # iteration (one fstat: 11 us per request of the engine process's 93 on the 2-core machine when done for
        # every read; the reads of one iteration are the requests of the same few socket reads). A truncation
        # after the check and before a view's batch is copied is not caught (the README's "Shared-memory
        # tensors"); reads through the file descriptor need no check (:meth:`_pread`).
        if loop is None or not self._size_checked:
            size = os.fstat(self._fd).st_size
            if self.offset + self.byte_size > size:
                raise InvalidInput(f"system shared memory region '{self.name}': segment {self.key!r} is now {size} "
                                   f"bytes, smaller than the registered offset {self.offset} + byte_size "
                                   f"{self.byte_size}")
            if loop is not None:
                self._size_checked = True
                loop.call_soon(self._recheck)

    def _recheck(self) -> None:
        self._size_checked = False

    def _pread(self, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes at ``offset`` of the region, copied through the file descriptor into a new ``uint8``
        array (never through the mapping: a truncated segment reads short instead of faulting).

        Raises:
            InvalidInput: unregistered, or the segment ends before them (truncated by its client).
        """
        if self._map is None:
            raise InvalidInput(f"system shared memory region '{self.name}' was unregistered")
        out = np.empty(nbytes, np.uint8)
        done, view = 0, memoryview(out)
        while done < nbytes:
            n = os.preadv(self._fd, [view[done:]], self.offset + offset + done)
            if n <= 0:
                size = os.fstat(self._fd).st_size
                raise InvalidInput(f"system shared memory region '{self.name}': segment {self.key!r} is now {size} "
                                   f"bytes, smaller than the registered offset {self.offset} + byte_size "
                                   f"{self.byte_size}")
            done += n
        return out

    def read(self, ref: ShmRef, datatype: str, shape: tuple[int, ...], where: str,
             loop: asyncio.AbstractEventLoop | None = None) -> np.ndarray:
        """The tensor at ``ref``, read-only: a copy of the client's bytes (:meth:`_pread`), or on a page-locked
        region a view of the mapping; ``loop``: called on that event loop (a view's size check is shared by the
        reads of one iteration). Raises InvalidInput: unregistered, truncated, or not parseable."""
        if self._locked is None:
            arr = tensor_from_bytes(self._pread(ref.offset, ref.byte_size), datatype, shape, where)
            arr.flags.writeable = False
            return arr
        dtype = _PLAIN_DTYPES.get(datatype)
        if dtype is not None and (self._base + ref.offset) % dtype.alignment == 0:
            # a numeric tensor at an aligned offset (every request but BYTES, BOOL and odd offsets): the typed view
            # at once, fewer numpy calls than through bytes (the codec checked that byte_size is the shape's size,
            # and :meth:`Region.check` that it lies inside the region). np.frombuffer holds an export of the
            # mapping while the array lives (np.ndarray(buffer=...) does not: an unregister could unmap under it,
            # tests/unit/test_shm_registry.py)
            self._check_mapped(loop)
            arr = np.frombuffer(self._map, dtype, ref.byte_size // dtype.itemsize, self._base + ref.offset
                                ).reshape(shape)
        else:
            arr = tensor_from_bytes(self._view(ref.offset, ref.byte_size, loop), datatype, shape, where)
        arr.flags.writeable = False  # a view of the client's memory: the engine reads it, nobody writes it
        return arr

    def write(self, offset: int, data: np.ndarray) -> None:
        """``data`` (``uint8``, C-contiguous) into the region at ``offset``, through the file descriptor
        (``pwrite``: a segment truncated after the size check grows back instead of faulting the process).

        Raises:
            InvalidInput: unregistered, or the segment is smaller than the region.
        """
        self._check_mapped(None)
        done, view = 0, memoryview(data).cast("B")
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], self.offset + offset + done)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def close(self) -> None:
        """Unlock (nothing reads it by DMA now: the registry closes a region only when no request holds it), close
        the segment and unmap it, or leave the unmapping to the last numpy view still alive."""
        locked, self._locked = self._locked, None
        if locked is not None:
            try:
                locked.unregister()
            except CudaError as exc:
                log.warning("system shared memory region '%s': %s", self.name, exc)
        mapping, self._map = self._map, None
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:  # views of it are still alive (a batch still running): the last one unmaps it
                pass


class CudaStaging:
    """One stream and one pinned buffer of :data:`STAGING_BYTES` for the CUDA regions of one device; one copy at a
    time (a lock), in chunks. Created lazily on first use; :meth:`close` frees it."""

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self._lock = threading.Lock()
        self._stream: Stream | None = None
        self._pinned: PinnedBuffer | None = None

    def _copy(self, device_ptr: int, host: np.ndarray, direction: str) -> None:
        """Copy between ``host`` (``uint8``, C-contiguous) and ``device_ptr``; blocks until done.

        Raises:
            CudaError: CUDA refused (e.g. an address past the end of the exporter's allocation).
        """
        with self._lock:
            set_device(self.device_id)  # current device is per thread
            if self._stream is None:
                self._stream = Stream()
            if self._pinned is None:
                self._pinned = PinnedBuffer(STAGING_BYTES)
            stage = self._pinned.array
            for start in range(0, host.size, STAGING_BYTES):
                n = min(STAGING_BYTES, host.size - start)
                if direction == "H2D":
                    stage[:n] = host[start:start + n]
                    memcpy_async(device_ptr + start, self._pinned.ptr, n, "H2D", self._stream, "shared memory",
                                 locked=True)
                    self._stream.synchronize()
                else:
                    memcpy_async(self._pinned.ptr, device_ptr + start, n, "D2H", self._stream, "shared memory",
                                 locked=True)
                    self._stream.synchronize()
                    host[start:start + n] = stage[:n]

    def to_host(self, device_ptr: int, nbytes: int) -> np.ndarray:
        """A new ``uint8`` array holding ``nbytes`` bytes read from ``device_ptr``."""
        out = np.empty(nbytes, np.uint8)
        self._copy(device_ptr, out, "D2H")
        return out

    def to_device(self, device_ptr: int, data: np.ndarray) -> None:
        """Write ``data`` (``uint8``) to ``device_ptr``."""
        self._copy(device_ptr, np.ascontiguousarray(data), "H2D")

    def close(self) -> None:
        with self._lock:
            if self._pinned is not None:
                self._pinned.free()
            if self._stream is not None:
                self._stream.destroy()
            self._pinned = self._stream = None


class CudaRegion(Region):
    """``byte_size`` bytes of another process's device memory on ``device_id``, opened from its IPC handle. CUDA
    does not report the exported allocation's size: a ``byte_size`` larger than it makes the copies fail (400).

    Raises (constructor, which blocks):
        InvalidInput: no usable CUDA device ``device_id``, or CUDA refused the handle (not 64 bytes, exporter gone,
            a handle of this same process).
    """

    kind = "cuda"
    blocking = True

    def __init__(self, name: str, raw_handle: bytes, device_id: int, byte_size: int, staging: CudaStaging) -> None:
        super().__init__(name, byte_size)
        self.device_id = device_id
        self._staging = staging
        what = f"CUDA shared memory region '{name}'"
        if byte_size <= 0:
            raise InvalidInput(f"{what}: byte_size must be at least 1, got {byte_size}")
        try:
            require_device(device_id)
            self._memory = IpcMemory(raw_handle, byte_size)
        except CudaError as exc:
            raise InvalidInput(f"{what} cannot be registered: {exc}") from None

    def _ptr(self, offset: int) -> int:
        if not self._memory.ptr:
            raise InvalidInput(f"CUDA shared memory region '{self.name}' was unregistered")
        return self._memory.ptr + offset

    def read(self, ref: ShmRef, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
        try:
            raw = self._staging.to_host(self._ptr(ref.offset), ref.byte_size)
        except CudaError as exc:
            raise InvalidInput(f"{where}: cannot read CUDA shared memory region '{self.name}': {exc}") from None
        return tensor_from_bytes(raw, datatype, shape, where)

    def write(self, offset: int, data: np.ndarray) -> None:
        try:
            self._staging.to_device(self._ptr(offset), data)
        except CudaError as exc:
            raise InvalidInput(f"cannot write CUDA shared memory region '{self.name}': {exc}") from None

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def close(self) -> None:
        self._memory.close()
