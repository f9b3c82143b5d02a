"""Triton's shared-memory extensions in-process: the registry over real POSIX shared-memory segments (registration
rules, bounds, reference counts, unmapping checked in /proc/self/maps), CUDA regions on the stand-in runtime
(tests/fake_cuda.py), and the data plane reading inputs from and writing outputs to regions."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import threading
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import pytest
from fakes import FakeLoader, SleepExecutor
from helpers import segment_factory
from fake_cuda import FakeCuda

import batcher.shm_regions as shm_regions
import engines.cuda as cuda
from batcher.config import SharedMemoryConfig, parse_config
from batcher.dataplane import DataPlane
from batcher.errors import InvalidInput, NotFound, Unavailable
from batcher.metrics import Metrics
from batcher.protocol import InferRequest, InferResponse, RequestedOutput, ShmInput, ShmRef
from batcher.repository import ModelRepository
from batcher.shm import SharedMemoryRegistry

_names = itertools.count()


@pytest.fixture
def segment():
    """Factory: a new POSIX segment of ``size`` bytes (this process maps it once), unlinked at the end."""
    yield from segment_factory(lambda _: f"trtb-unit-{os.getpid()}-{next(_names)}")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"trtb-unit-{os.getpid()}-")]


def mappings(seg: SharedMemory) -> int:
    """How many mappings of ``seg`` this process has (the test's own is one)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(f"/dev/shm/{seg.name}"))


def put(seg: SharedMemory, offset: int, arr: np.ndarray) -> None:
    seg.buf[offset:offset + arr.nbytes] = arr.tobytes()


def get(seg: SharedMemory, offset: int, dtype, shape) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(bytes(seg.buf[offset:offset + n]), dtype).reshape(shape)


def registry(system: bool = True, cuda_on: bool = False) -> SharedMemoryRegistry:
    return SharedMemoryRegistry(SharedMemoryConfig(system=system, cuda=cuda_on))


def request(inputs: dict, outputs: list[RequestedOutput] | None = None) -> InferRequest:
    return InferRequest(inputs, outputs=outputs)


# =========================================================================== system regions


async def test_register_status_and_a_read_at_an_unaligned_offset_copies_the_clients_bytes(segment):
    """A region not page-locked is read through its file descriptor (pread): the input is the server's own copy, so
    the client's later writes do not reach it and unregistering unmaps at once."""
    seg = segment(10_000)
    reg = registry()
    await reg.register("system", "r", key=seg.name, offset=100, byte_size=4096)  # not page-aligned
    assert reg.status("system") == [{"name": "r", "key": seg.name, "offset": 100, "byte_size": 4096}]
    assert reg.status("system", "r") == reg.status("system")
    assert mappings(seg) == 2
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    put(seg, 100 + 48, x)
    async with reg.hold(request({"x": ShmInput("FP32", (3, 4), ShmRef("r", 48, 48))})) as held:
        got = (await held.inputs())["x"]
        np.testing.assert_array_equal(got, x)
        assert not got.flags.writeable
        put(seg, 148, np.full(1, 99, np.float32))  # the client writes: the input already holds its own bytes
        assert got[0, 0] == 0
    await reg.unregister("system", "r")
    assert reg.status("system") == [] and mappings(seg) == 1


def test_a_segment_truncated_after_a_read_cannot_crash_the_process(segment):
    """A client truncating its segment while its request is read (a new user's ``ftruncate`` loop killed the server
    with SIGBUS within a few requests): the tensor read is the server's own copy, so touching it after the
    truncation is safe, and a read after it is a 400. In a child process, so that a SIGBUS fails this test instead
    of killing the run."""
    import subprocess
    import sys
    import textwrap

    seg = segment(8192)
    put(seg, 0, np.arange(16, dtype=np.float32))
    code = textwrap.dedent(f"""
        import os, numpy as np
        from _posixshmem import shm_open
        from batcher.errors import InvalidInput
        from batcher.protocol import ShmRef
        from batcher.shm_regions import SystemRegion
        region = SystemRegion("r", {seg.name!r}, 0, 8192)
        x = region.read(ShmRef("r", 0, 64), "FP32", (16,), "input 'x'")
        fd = shm_open({seg.name!r}, os.O_RDWR, 0o600)
        os.ftruncate(fd, 0)
        print(float(x.sum()))
        try:
            region.read(ShmRef("r", 0, 64), "FP32", (16,), "input 'x'")
        except InvalidInput as exc:
            print("400", exc.message)
        os.ftruncate(fd, 8192)
        os.close(fd)
        region.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"the process died: {out.returncode} {out.stderr[-500:]}"
    lines = out.stdout.splitlines()
    assert lines[0] == "120.0"
    assert lines[1] == (f"400 system shared memory region 'r': segment {seg.name!r} is now 0 bytes, smaller than "
                        "the registered offset 0 + byte_size 8192")


async def test_registration_errors_name_the_region_key_and_sizes(segment):
    seg = segment(4096)
    reg = registry()
    await reg.register("system", "r", key=seg.name, offset=0, byte_size=4096)
    cases = [
        (dict(key=seg.name, offset=0, byte_size=16), "r", "shared memory region 'r' is already registered"),
        (dict(key="/trtb-no-such-key", offset=0, byte_size=16), "a", "no shared memory segment has the key"),
        (dict(key=seg.name, offset=4000, byte_size=100), "b",
         f"offset 4000 + byte_size 100 runs past the end of segment '{seg.name}' (4096 bytes)"),
        (dict(key=seg.name, offset=0, byte_size=0), "c", "byte_size must be at least 1, got 0"),
        (dict(key="///", offset=0, byte_size=8), "d", "invalid key '///'"),
        (dict(key="a/b", offset=0, byte_size=8), "e", "cannot open key 'a/b'"),
    ]
    for params, name, message in cases:
        with pytest.raises(InvalidInput, match=re.escape(message)):
            await reg.register("system", name, **params)
    assert [r["name"] for r in reg.status("system")] == ["r"] and mappings(seg) == 2
    with pytest.raises(NotFound, match="unable to find system shared memory region 'zz'"):
        reg.status("system", "zz")
    await reg.close()
    assert mappings(seg) == 1


async def test_a_registration_that_would_leave_too_few_file_descriptors_for_connections_is_400(segment):
    """Under a soft limit of open files that leaves room for one region beyond the reserve: the first registration
    takes its two descriptors, the second is refused (a new user's 505 registrations took all of 1,024, and the
    server then accepted no connection); unregistering gives them back."""
    import resource

    from batcher.shm import FD_RESERVE, fds_free

    seg = segment(4096)
    reg = registry()
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    free, soft = fds_free()
    limit = soft - free + FD_RESERVE + 3  # what is open now, the reserve, one region and one descriptor more
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limits[1]))
    try:
        await reg.register("system", "a", key=seg.name, offset=0, byte_size=16)
        assert fds_free() == (FD_RESERVE + 1, limit)  # a region takes two
        with pytest.raises(InvalidInput, match=re.escape(
                f"cannot register shared memory region 'b': {FD_RESERVE + 1} of the server's {limit} file "
                f"descriptors are free, and it keeps {FD_RESERVE} for connections; unregister some regions first")):
            await reg.register("system", "b", key=seg.name, offset=0, byte_size=16)
        await reg.unregister("system", "a")
        await reg.register("system", "b", key=seg.name, offset=0, byte_size=16)
        assert [r["name"] for r in reg.status("system")] == ["b"]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
        await reg.close()


async def test_disabled_extensions_answer_not_found_and_requests_naming_regions_400():
    reg = registry(system=False, cuda_on=False)
    for call in (reg.register("system", "r", key="/k", offset=0, byte_size=8), reg.unregister("cuda", "r")):
        with pytest.raises(NotFound, match=r"shared memory is disabled \(server.shared_memory.(system|cuda): false\)"):
            await call
    with pytest.raises(NotFound, match="cuda shared memory is disabled"):
        reg.status("cuda")
    with pytest.raises(InvalidInput, match=r"region 'r' is not registered \(shared memory is disabled"):
        reg.hold(request({"x": ShmInput("FP32", (1,), ShmRef("r", 0, 4))}))


async def test_tensors_outside_their_region_are_400_before_anything_is_held(segment):
    seg = segment(4096)
    reg = registry()
    await reg.register("system", "r", key=seg.name, offset=0, byte_size=64)
    bad_input = request({"x": ShmInput("FP32", (4,), ShmRef("r", 56, 16))})
    with pytest.raises(InvalidInput, match="input 'x': shared_memory_offset 56 \\+ shared_memory_byte_size 16 runs "
                                           "past the end of shared memory region 'r' \\(64 bytes\\)"):
        reg.hold(bad_input)
    bad_output = request({"x": np.zeros(1, np.float32)}, [RequestedOutput("y", None, ShmRef("r", 65, 0))])
    with pytest.raises(InvalidInput, match="output 'y': shared_memory_offset 65"):
        reg.hold(bad_output)
    with pytest.raises(InvalidInput, match="output 'y': shared memory region 'nope' is not registered$"):
        reg.hold(request({}, [RequestedOutput("y", None, ShmRef("nope", 0, 4))]))
    await reg.unregister("system", "r")  # nothing held it: unmapped at once
    assert mappings(seg) == 1


async def test_an_output_larger_than_its_place_is_400(segment):
    seg = segment(4096)
    reg = registry()
    await reg.register("system", "r", key=seg.name, offset=0, byte_size=4096)
    async with reg.hold(request({}, [RequestedOutput("y", None, ShmRef("r", 0, 12))])) as held:
        with pytest.raises(InvalidInput, match="output 'y' needs 16 bytes, shared_memory_byte_size of region 'r' is 12"):
            await held.write({"y": np.ones(4, np.float32)})
        await held.write({"y": np.ones(3, np.float32)})
    np.testing.assert_array_equal(get(seg, 0, np.float32, (3,)), np.ones(3))
    await reg.close()


async def test_bytes_tensors_in_shared_memory_round_trip(segment):
    seg = segment(4096)
    reg = registry()
    await reg.register("system", "r", key=seg.name, offset=0, byte_size=4096)
    raw = b"\x02\x00\x00\x00hi\x03\x00\x00\x00abc"
    seg.buf[0:len(raw)] = raw
    req = request({"s": ShmInput("BYTES", (2,), ShmRef("r", 0, len(raw)))}, [RequestedOutput("t", None, ShmRef("r", 100, 64))])
    async with reg.hold(req) as held:
        assert list((await held.inputs())["s"]) == [b"hi", b"abc"]
        await held.write({"t": np.array([b"xyz"], dtype=object)})
    assert bytes(seg.buf[100:107]) == b"\x03\x00\x00\x00xyz"
    bad = request({"s": ShmInput("BYTES", (3,), ShmRef("r", 0, len(raw)))})
    async with reg.hold(bad) as held:
        with pytest.raises(InvalidInput, match="input 's': shape declares 3 BYTES elements, binary data holds 2"):
            await held.inputs()
    await reg.close()


async def test_unregister_while_held_answers_at_once_and_unmaps_when_the_last_request_is_done(segment):
    seg = segment(4096)
    reg = registry()
    await reg.register("system", "r", key=seg.name, offset=0, byte_size=4096)
    first = reg.hold(request({}, [RequestedOutput("y", None, ShmRef("r", 0, 16))]))
    second = reg.hold(request({}, [RequestedOutput("y", None, ShmRef("r", 16, 16))]))
    await reg.unregister("system")  # all regions of the kind
    assert reg.status("system") == [] and mappings(seg) == 2  # gone from the namespace, still mapped
    with pytest.raises(InvalidInput, match="region 'r' is not registered"):
        reg.hold(request({}, [RequestedOutput("y", None, ShmRef("r", 0, 16))]))
    await reg.register("system", "r", key=seg.name, offset=2048, byte_size=64)  # the name is free again
    assert mappings(seg) == 3
    async with first as held:
        await held.write({"y": np.full(4, 7, np.float32)})
    assert mappings(seg) == 3  # the second request still holds the old region
    async with second as held:
        await held.write({"y": np.full(4, 8, np.float32)})
    assert mappings(seg) == 2  # the old region is unmapped, the new one stays
    np.testing.assert_array_equal(get(seg, 0, np.float32, (8,)), [7] * 4 + [8] * 4)
    await reg.unregister("system", "r")
    await reg.unregister("system", "never-registered")  # not an error (Triton)
    assert mappings(seg) == 1


async def test_close_unmaps_every_region_held_or_not_and_refuses_new_ones(segment):
    seg = segment(4096)
    reg = registry()
    await reg.register("system", "a", key=seg.name, offset=0, byte_size=64)
    await reg.register("system", "b", key=seg.name, offset=64, byte_size=64)
    held = reg.hold(request({}, [RequestedOutput("y", None, ShmRef("a", 0, 4))]))
    await reg.unregister("system", "a")
    assert mappings(seg) == 3
    await reg.close()
    assert mappings(seg) == 1
    await held.__aexit__(None, None, None)  # a release after close is harmless
    with pytest.raises(Unavailable, match="shutting down"):
        await reg.register("system", "c", key=seg.name, offset=0, byte_size=64)


# =========================================================================== CUDA regions (stand-in runtime)


@pytest.fixture
def fake():
    f = FakeCuda()
    with cuda.use_runtime(f.cudart):
        yield f


def exported(fake: FakeCuda, nbytes: int) -> tuple[int, bytes]:
    """Device memory of "another process" and the 64 bytes of its IPC handle."""
    ptr = fake.gpu.alloc(nbytes, "cudaMalloc")
    return ptr, fake.gpu.export_ipc(ptr)


async def test_cuda_region_reads_inputs_and_writes_outputs_in_chunks(fake, monkeypatch):
    monkeypatch.setattr(shm_regions, "STAGING_BYTES", 64)  # several chunks per tensor
    ptr, handle = exported(fake, 4096)
    x = np.arange(100, dtype=np.float32)
    fake.gpu.write(ptr + 256, x.tobytes())
    reg = registry(system=False, cuda_on=True)
    await reg.register("cuda", "g", raw_handle=handle, device_id=0, byte_size=4096)
    assert reg.status("cuda") == [{"name": "g", "device_id": 0, "byte_size": 4096}]
    assert fake.gpu.counts()["ipc_open"] == 1
    req = request({"x": ShmInput("FP32", (100,), ShmRef("g", 256, 400))}, [RequestedOutput("y", None, ShmRef("g", 1024, 400))])
    async with reg.hold(req) as held:
        got = (await held.inputs())["x"]
        np.testing.assert_array_equal(got, x)
        await held.write({"y": x * 2})
    assert np.frombuffer(fake.gpu.read(ptr + 1024, 400), np.float32).tolist() == (x * 2).tolist()
    await reg.unregister("cuda", "g")
    await reg.close()
    counts = fake.gpu.counts()
    assert "ipc_open" not in counts and counts["pinned"] == 0 and counts["streams"] == 0


async def test_cuda_registration_errors_are_400(fake):
    _, handle = exported(fake, 256)
    reg = registry(system=False, cuda_on=True)
    with pytest.raises(InvalidInput, match="CUDA shared memory region 'g' cannot be registered: CUDA device 3 does not "
                                           "exist"):
        await reg.register("cuda", "g", raw_handle=handle, device_id=3, byte_size=256)
    with pytest.raises(InvalidInput, match="cannot be registered: cudaIpcOpenMemHandle failed: "
                                           "cudaErrorInvalidResourceHandle"):
        await reg.register("cuda", "g", raw_handle=bytes(64), device_id=0, byte_size=256)
    with pytest.raises(NotFound, match="system shared memory is disabled"):
        await reg.register("system", "s", key="/k", offset=0, byte_size=8)
    await reg.close()
    assert "ipc_open" not in fake.gpu.counts()


async def test_a_cancelled_cuda_copy_keeps_its_region_until_the_copy_ends(fake, monkeypatch):
    ptr, handle = exported(fake, 256)
    reg = registry(system=False, cuda_on=True)
    await reg.register("cuda", "g", raw_handle=handle, device_id=0, byte_size=256)
    started, proceed = threading.Event(), threading.Event()
    real_read = shm_regions.CudaRegion.read

    def slow_read(self, *args):
        started.set()
        proceed.wait(10)
        return real_read(self, *args)

    monkeypatch.setattr(shm_regions.CudaRegion, "read", slow_read)

    async def infer():
        async with reg.hold(request({"x": ShmInput("FP32", (4,), ShmRef("g", 0, 16))})) as held:
            await held.inputs()

    task = asyncio.create_task(infer())
    await asyncio.to_thread(started.wait, 10)
    await reg.unregister("cuda", "g")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fake.gpu.counts()["ipc_open"] == 1  # the copy still runs: the handle stays open
    proceed.set()
    for _ in range(1000):  # the copy's thread finishes; its done callback releases the region on the loop
        if "ipc_open" not in fake.gpu.counts():
            break
        await asyncio.sleep(0.01)
    assert "ipc_open" not in fake.gpu.counts()
    await reg.close()


# =========================================================================== the data plane


async def plane(**shared_memory) -> DataPlane:
    config = parse_config({"server": {"shared_memory": shared_memory},
                           "models": [{"name": "m", "path": "unused.onnx", "max_batch_size": 8}]})
    metrics = Metrics()
    dp = DataPlane(config, metrics, ModelRepository(config, metrics, loader=FakeLoader()),
                   executor=lambda ctx, name: SleepExecutor(ctx, name, seconds_per_row=0.010))
    await dp.start()
    return dp


async def plane_with_region(segment) -> tuple[SharedMemory, DataPlane]:
    """A started data plane with system shared memory on, and region ``io``: all 4096 bytes of a new segment."""
    seg = segment(4096)
    dp = await plane(system=True)
    await dp.shm_register("system", "io", key=seg.name, offset=0, byte_size=4096)
    return seg, dp


def counted(dp: DataPlane) -> dict[str, float]:
    sample = dp.metrics.registry.get_sample_value
    labels = {"model": "m", "version": "1"}
    return {"success": sample("batcher_request_success_total", labels) or 0.0,
            "invalid": sample("batcher_request_failure_total", {**labels, "reason": "invalid"}) or 0.0}


async def passthrough(response: InferResponse) -> InferResponse:
    return response


def reader(req: InferRequest):
    async def read() -> InferRequest:
        return req

    return read


@pytest.mark.looptime
async def test_data_plane_reads_inputs_from_and_writes_outputs_to_regions(segment):
    seg, dp = await plane_with_region(segment)
    assert dp.shm_status("system") == [{"name": "io", "key": seg.name, "offset": 0, "byte_size": 4096}]
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    put(seg, 0, x)
    req = request({"x": ShmInput("FP32", (2, 4), ShmRef("io", 0, 32))}, [RequestedOutput("y", None, ShmRef("io", 64, 32))])
    loop = asyncio.get_running_loop()
    resp = await dp.infer("m", None, loop.time(), reader(req), passthrough)
    np.testing.assert_array_equal(get(seg, 64, np.float32, (2, 4)), x * 2)
    assert resp.request.outputs[0].shm == ShmRef("io", 64, 32)
    small = request({"x": ShmInput("FP32", (2, 4), ShmRef("io", 0, 32))}, [RequestedOutput("y", None, ShmRef("io", 64, 16))])
    with pytest.raises(InvalidInput, match="output 'y' needs 32 bytes, shared_memory_byte_size of region 'io' is 16"):
        await dp.infer("m", None, loop.time(), reader(small), passthrough)
    assert counted(dp) == {"success": 1.0, "invalid": 1.0}
    await dp.shm_unregister("system", "io")
    assert mappings(seg) == 1
    await dp.close()


@pytest.mark.looptime
async def test_data_plane_unregister_during_a_request_waits_for_it(segment):
    seg, dp = await plane_with_region(segment)
    put(seg, 0, np.ones((1, 4), np.float32))
    req = request({"x": ShmInput("FP32", (1, 4), ShmRef("io", 0, 16))}, [RequestedOutput("y", None, ShmRef("io", 16, 16))])
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(dp.infer("m", None, loop.time(), reader(req), passthrough))
    await asyncio.sleep(0.005)  # its batch executes for 10 ms (SleepExecutor)
    assert not task.done() and dp.repository.slot("m").runner.queue_depth == 0
    await dp.shm_unregister("system", "io")
    assert dp.shm_status("system") == [] and mappings(seg) == 2
    await task
    np.testing.assert_array_equal(get(seg, 16, np.float32, (1, 4)), np.full((1, 4), 2.0))
    assert mappings(seg) == 1 and counted(dp)["success"] == 1
    await dp.close()


@pytest.mark.looptime
async def test_data_plane_close_unmaps_registered_regions(segment):
    seg, dp = await plane_with_region(segment)
    assert mappings(seg) == 2
    await dp.close()
    assert mappings(seg) == 1


async def test_a_segment_truncated_after_registration_is_a_400_not_a_bus_error(segment):
    """A client that shrinks its segment after registering it: reading the region would touch the mapping past the
    segment's end and kill the server with SIGBUS (a fresh user did exactly this); the size is checked again before
    the reads of each event-loop pass (one check for the requests of the same socket reads) and before each write."""
    seg = segment(8192)
    reg = registry()
    await reg.register("system", "r", key=seg.name, offset=0, byte_size=8192)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    put(seg, 4096, x)
    async with reg.hold(request({"x": ShmInput("FP32", (1, 4), ShmRef("r", 4096, 16))})) as held:
        np.testing.assert_array_equal((await held.inputs())["x"], x)  # intact: read as usual
    os.ftruncate(seg._fd, 4096)  # the client shrinks it (this test never touches its own mapping past 4096 again)
    await asyncio.sleep(0)  # its next request comes in a later pass of the event loop
    with pytest.raises(InvalidInput, match=r"region 'r': segment .* is now 4096 bytes, smaller than the registered "
                                           r"offset 0 \+ byte_size 8192"):
        async with reg.hold(request({"x": ShmInput("FP32", (1, 4), ShmRef("r", 4096, 16))})) as held:
            await held.inputs()
    await reg.unregister("system", "r")


async def test_the_reads_of_one_event_loop_pass_share_one_size_check(fake, segment, monkeypatch):
    """A page-locked region's reads are views of the mapping: one fstat for the requests read in one pass of the
    event loop (11 of the engine process's 93 us per shm request on the 2-core machine when every read made its
    own), a new one in the next pass, and one per write. A region read through its file descriptor needs none: a
    truncated segment reads short."""
    seg = segment(8192)
    reg = SharedMemoryRegistry(SharedMemoryConfig(system=True), page_lock=True)
    await reg.register("system", "r", key=seg.name, offset=0, byte_size=8192)
    calls = []
    fstat = os.fstat
    monkeypatch.setattr(shm_regions.os, "fstat", lambda fd: calls.append(fd) or fstat(fd))
    for _ in range(3):
        async with reg.hold(request({"x": ShmInput("FP32", (1, 4), ShmRef("r", 0, 16))})) as held:
            await held.inputs()
    assert len(calls) == 1
    await asyncio.sleep(0)
    async with reg.hold(request({"x": ShmInput("FP32", (1, 4), ShmRef("r", 0, 16))})) as held:
        await held.inputs()
    assert len(calls) == 2
    reg._regions["r"].write(0, np.zeros(16, np.uint8))
    assert len(calls) == 3
    await reg.unregister("system", "r")

    plain = registry()
    await plain.register("system", "p", key=seg.name, offset=0, byte_size=8192)
    registered = len(calls)  # its registration checked the segment's size
    for _ in range(3):
        async with plain.hold(request({"x": ShmInput("FP32", (1, 4), ShmRef("p", 0, 16))})) as held:
            await held.inputs()
    assert len(calls) == registered
    await plain.close()


async def test_a_gpu_process_page_locks_system_regions_so_batches_read_them_by_dma(fake, segment, caplog):
    """page_lock (a process with GPU models): the whole mapping is cudaHostRegister-ed (portable) at registration,
    inputs read from it count as page-locked (what ``gather_rows`` asks before sending a request's rows by DMA), and
    it is unregistered when the region closes; where CUDA refuses, the region still serves, pageable."""
    from engines.cuda.memory import page_locked

    seg = segment(8192)
    x = np.arange(16, dtype=np.float32)
    put(seg, 4096, x)
    reg = SharedMemoryRegistry(SharedMemoryConfig(system=True), page_lock=True)
    await reg.register("system", "r", key=seg.name, offset=4096, byte_size=4096)
    assert list(fake.gpu.registered.values()) == [4096]  # the mapping: from the page holding offset 4096
    req = request({"x": ShmInput("FP32", (16,), ShmRef("r", 0, 64))})
    async with reg.hold(req) as held:
        got = (await held.inputs())["x"]
        np.testing.assert_array_equal(got, x)
        assert page_locked(got.ctypes.data, got.nbytes)
    await reg.unregister("system", "r")
    assert fake.gpu.registered == {}
    fake.gpu.inject["cudaHostRegister"] = fake.cudart.cudaError_t.cudaErrorNotSupported
    await reg.register("system", "r", key=seg.name, offset=0, byte_size=4096)
    assert "stays pageable" in caplog.text and fake.gpu.registered == {}
    put(seg, 0, x)
    async with reg.hold(request({"x": ShmInput("FP32", (16,), ShmRef("r", 0, 64))})) as held:
        got = (await held.inputs())["x"]
        np.testing.assert_array_equal(got, x)
        assert not page_locked(got.ctypes.data, got.nbytes)
    await reg.close()
