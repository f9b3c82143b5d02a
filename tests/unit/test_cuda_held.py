"""engines/cuda/held.py: the driver calls made keeping the GIL, their C marshalling, and the layer's routing to them.

No machine of CI has a CUDA driver, so the driver's entry points are stood in for twice: by CPython's own
``PyGILState_Check`` (a real C function that says whether its caller holds the GIL) and by ctypes callbacks that
forward to the stand-in runtime (tests/fake_cuda.py), so that copies really move bytes. The signatures are checked
against the real ``cuda.bindings.driver``, which imports without a GPU. On the GPU, tests/gpu/test_gpu.py runs
the same round trip on the real driver.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
from ctypes import c_int, c_size_t, c_uint64

import numpy as np
import pytest

import engines.cuda as cuda
from engines.cuda import held as held_mod
from fake_cuda import FakeCuda

driver = pytest.importorskip("cuda.bindings.driver", reason="the stream-order attributes come from cuda-python")


def stream_order_attrs():
    attrs = driver.CUmemcpyAttributes()
    attrs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    return attrs


def test_signatures_name_the_driver_calls_of_the_real_bindings_with_their_parameters():
    for name, proto in held_mod.SIGNATURES.items():
        params = inspect.signature(getattr(driver, name)).parameters
        out_params = 1 if name == "cuEventElapsedTime" else 0  # the bindings return pMilliseconds
        assert len(params) == len(proto._argtypes_) - out_params, name
    assert int(driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM) == 1
    # the attributes' first field is the source access order (the C struct the batch call reads)
    attrs = stream_order_attrs()
    assert c_int.from_address(int(attrs.getPtr())).value == 1


def test_every_held_call_keeps_the_gil_where_a_plain_ctypes_call_releases_it():
    gil_check = ctypes.cast(ctypes.pythonapi.PyGILState_Check, ctypes.c_void_p).value
    attrs = stream_order_attrs()
    calls = held_mod.HeldCalls(lambda name: gil_check, int(attrs.getPtr()), keep=attrs)
    assert calls.event_record(1, 2) == 1
    assert calls.event_elapsed_ms(1, 2)[0] == 1
    assert [calls.memcpy(d, 1, 2, 3, 4) for d in ("H2D", "D2H", "D2D")] == [1, 1, 1]
    assert calls.memset(1, 0, 2, 3) == 1
    assert calls.graph_launch(1, 2) == 1
    assert calls.memcpy_batch([(1, 2, 3), (4, 5, 6)], 7) == 1
    released = ctypes.CFUNCTYPE(c_int)(gil_check)  # the control: CFUNCTYPE lets the GIL go around the call
    assert released() == 0
    with pytest.raises(ValueError, match="direction"):
        calls.memcpy("H2H", 1, 2, 3, 4)


class DriverOverFake:
    """The driver entry points of SIGNATURES as ctypes callbacks forwarding to the stand-in runtime; ``count``
    per entry point; ``refuse``: names that answer CUDA_ERROR_INVALID_VALUE (1) without forwarding."""

    def __init__(self, fake: FakeCuda) -> None:
        rt = fake.cudart
        kind = rt.cudaMemcpyKind
        self.count: dict[str, int] = {}
        self.refuse: set[str] = set()
        self.seen_batch: list[tuple] = []

        def elapsed(out, start, end):
            err, *value = rt.cudaEventElapsedTime(start, end)
            if err == 0:
                out[0] = value[0]
            return int(err)

        def batch(dsts, srcs, sizes, count, attrs, idxs, n_attrs, stream):
            d = list((c_uint64 * count).from_address(dsts))
            s = list((c_uint64 * count).from_address(srcs))
            z = list((c_size_t * count).from_address(sizes))
            a = rt.cudaMemcpyAttributes()
            a.srcAccessOrder = c_int.from_address(attrs).value
            self.seen_batch.append((d, s, z, n_attrs, list((c_size_t * n_attrs).from_address(idxs))))
            return int(rt.cudaMemcpyBatchAsync(d, s, z, count, [a], [0], n_attrs, stream)[0])

        def copy(direction):
            return lambda d, s, n, st: int(rt.cudaMemcpyAsync(d, s, n, direction, st)[0])

        forward = {
            "cuEventRecord": lambda e, s: int(rt.cudaEventRecord(e, s)[0]),
            "cuEventElapsedTime": elapsed,
            "cuMemcpyHtoDAsync": copy(kind.cudaMemcpyHostToDevice),
            "cuMemcpyDtoHAsync": copy(kind.cudaMemcpyDeviceToHost),
            "cuMemcpyDtoDAsync": copy(kind.cudaMemcpyDeviceToDevice),
            "cuMemsetD8Async": lambda d, v, n, st: int(rt.cudaMemsetAsync(d, v, n, st)[0]),
            "cuGraphLaunch": lambda g, st: int(rt.cudaGraphLaunch(g, st)[0]),
            "cuMemcpyBatchAsync": batch,
        }
        self._callbacks = {}
        for name, proto in held_mod.SIGNATURES.items():
            def entry(*args, _name=name, _fn=forward[name]):
                self.count[_name] = self.count.get(_name, 0) + 1
                return 1 if _name in self.refuse else _fn(*args)
            self._callbacks[name] = ctypes.CFUNCTYPE(proto._restype_, *proto._argtypes_)(entry)

    def address(self, name: str) -> int:
        return ctypes.cast(self._callbacks[name], ctypes.c_void_p).value


@pytest.fixture
def fake_with_held():
    fake = FakeCuda()
    drv = DriverOverFake(fake)
    attrs = stream_order_attrs()
    with cuda.use_runtime(fake.cudart):
        previous = held_mod.set_held(held_mod.HeldCalls(drv.address, int(attrs.getPtr()), keep=attrs))
        try:
            yield fake, drv
        finally:
            held_mod.set_held(previous)


def test_locked_copies_memsets_and_events_go_through_the_held_calls_and_move_the_bytes(fake_with_held):
    fake, drv = fake_with_held
    data = np.arange(64, dtype=np.uint8)
    src, back = cuda.PinnedBuffer(64), cuda.PinnedBuffer(64)
    src.array[:] = data
    dev, dev2 = cuda.DeviceBuffer(64), cuda.DeviceBuffer(64)
    stream = cuda.Stream()
    start, end = cuda.Event(), cuda.Event()
    start.record(stream)
    cuda.memcpy_batch_async([(dev.ptr, src.ptr, 16), (dev.ptr + 16, src.ptr + 16, 32)], stream, locked=True)
    cuda.memset_async(dev.ptr + 48, 7, 16, stream)
    cuda.memcpy_async(dev2.ptr, dev.ptr, 64, "D2D", stream)
    dev2.copy_to_host_async(back.ptr, 64, stream, locked=True)
    end.record(stream)
    stream.synchronize()
    assert bytes(back.array) == bytes(data[:48]) + bytes([7] * 16)
    assert end.elapsed_ms(start) > 0
    assert drv.count == {"cuEventRecord": 2, "cuMemcpyBatchAsync": 1, "cuMemsetD8Async": 1, "cuMemcpyDtoDAsync": 1,
                         "cuMemcpyDtoHAsync": 1, "cuEventElapsedTime": 1}
    assert drv.seen_batch == [([dev.ptr, dev.ptr + 16], [src.ptr, src.ptr + 16], [16, 32], 1, [0])]
    # the bindings were only reached through the callbacks (the stand-in counts both ways alike)
    assert fake.gpu.calls["cudaEventRecord"] == 2 and fake.gpu.calls["cudaMemcpyBatchAsync"] == 1


def test_copies_from_pageable_memory_keep_going_through_the_bindings(fake_with_held):
    fake, drv = fake_with_held
    dev, stream = cuda.DeviceBuffer(8), cuda.Stream()
    pinned = cuda.PinnedBuffer(8)
    dev.copy_from_host_async(pinned.ptr, 8, stream)  # locked not said: the caller does not know
    cuda.memcpy_batch_async([(dev.ptr, pinned.ptr, 4), (dev.ptr + 4, pinned.ptr + 4, 4)], stream)
    stream.synchronize()
    assert drv.count == {}
    assert fake.gpu.calls["cudaMemcpyAsync"] == 1 and fake.gpu.calls["cudaMemcpyBatchAsync"] == 1
    one = cuda.PinnedBuffer(4)
    cuda.memcpy_batch_async([(dev.ptr, one.ptr, 4)], stream, locked=True)  # one copy: the single-copy call
    assert drv.count == {"cuMemcpyHtoDAsync": 1}


def test_a_call_the_driver_refuses_is_made_again_through_the_bindings(fake_with_held):
    fake, drv = fake_with_held
    drv.refuse = {"cuEventRecord", "cuMemcpyHtoDAsync"}
    event, stream = cuda.Event(), cuda.Stream()
    event.record(stream)  # refused by the held call, then recorded by the bindings
    assert drv.count["cuEventRecord"] == 1 and fake.gpu.calls["cudaEventRecord"] == 1
    dev, pinned = cuda.DeviceBuffer(8), cuda.PinnedBuffer(8)
    pinned.array[:] = 5
    fake.gpu.inject["cudaMemcpyAsync"] = 1  # the bindings refuse too: their message is raised
    with pytest.raises(cuda.CudaError, match="cudaMemcpyAsync H2D 'x' 8 B failed"):
        dev.copy_from_host_async(pinned.ptr, 8, stream, "'x'", locked=True)


def test_no_held_calls_beside_a_stand_in_runtime():
    with cuda.use_runtime(FakeCuda().cudart):
        assert held_mod.held() is None


@pytest.mark.parametrize("value", ["0", "false", " Off "])
def test_the_environment_switch_turns_the_held_calls_off(monkeypatch, caplog, value):
    monkeypatch.setenv(held_mod.ENV_SWITCH, value)
    held_mod.reset()
    try:
        with caplog.at_level(logging.INFO, logger="engines.cuda"):
            assert held_mod.held() is None
        said = [r.getMessage() for r in caplog.records if "CUDA calls release the GIL" in r.getMessage()]
        assert said == [f"BATCHER_CUDA_HELD_CALLS={value.strip().lower()}: CUDA calls release the GIL"]
    finally:
        held_mod.reset()


def test_the_bench_times_calls_beside_a_busy_thread_and_says_plainly_when_there_is_no_gpu(tmp_path, capsys):
    from bench import cuda_gil

    calls = []
    assert cuda_gil.timed(lambda: calls.append(1), 50, 0.5, 3) > 0
    assert len(calls) == 150  # 3 timings of 50 calls, each on its own thread beside the busy one
    try:
        cuda.require_device(0)
    except cuda.CudaError:
        assert cuda_gil.main(["--out", str(tmp_path)]) == 2
        assert "bench.cuda_gil needs a CUDA device" in capsys.readouterr().err
        assert not (tmp_path / "cuda_gil.csv").exists()
