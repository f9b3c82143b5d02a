"""Stand-in for the TensorRT runtime module, for machines without a GPU; the CUDA runtime and the fake device come
from ``tests/fake_cuda.py``.

Only the hardware is faked; everything the backend computes (shapes, buffer sizes, profile choice, slicing) runs
for real against it. ``FakeTensorRT()`` gives three things:

* ``.trt``: a module with the names the ``engines/tensorrt`` package uses from ``tensorrt``/``tensorrt_lean``
  (``Logger``, ``Runtime``, ``ICudaEngine``, ``IExecutionContext``, ``DataType``, ...). Every public attribute and
  method of it mirrors the real API's name, kind (method/property) and parameter names -
  ``tests/test_tensorrt_api.py`` checks that it is a subset of the real ``tensorrt_lean`` 11.4 bindings;
* ``.cudart``: the ``cuda.bindings.runtime`` stand-in of ``tests/fake_cuda.py`` (checked by
  ``tests/test_cuda_api.py``), to inject with ``engines.cuda.use_runtime``;
* ``.gpu``: the fake device's state and the test controls (never part of a real API): allocations, streams, an
  ordered event log, call counters, error injection (see ``tests/fake_cuda.py``).

The TensorRT side:

* an engine is described by a JSON spec wrapped by :func:`make_plan`; ``execute_async_v3`` only QUEUES the
  computation on the stream (it runs when the stream is synchronized, or when a captured graph of it is launched
  and then synchronized) and computes, per row r, ``out[r].flat[k] = 2 * (sum of every input's row r) + k`` cast
  to the output's dtype, where the output shape is ``(rows,) + spec_shape[1:]``; ``gpu.executions`` lists the
  input shapes of every computation that RAN;
* creating an execution context allocates the engine's ``device_memory_size_v2`` activation bytes and
  deserializing an engine allocates its weights bytes; both are freed when the Python object dies (the real
  bindings free in ``__del__`` too), and the event log records ``"context destroyed"``, ``"engine destroyed"``,
  ``"runtime destroyed"`` in order.
"""

from __future__ import annotations

import enum
import json
from types import ModuleType
from typing import Any

import numpy as np

from fake_cuda import FakeCuda, FakeGPU

__all__ = ["FakeTensorRT", "FakeGPU", "make_plan", "PLAN_MAGIC", "NUMPY_BY_TRT"]

PLAN_MAGIC = b"FAKETRTPLAN\n"

#: DataType member name -> numpy dtype, for the fake's arithmetic.
NUMPY_BY_TRT = {
    "FLOAT": np.float32,
    "HALF": np.float16,
    "INT8": np.int8,
    "INT32": np.int32,
    "INT64": np.int64,
    "BOOL": np.bool_,
    "UINT8": np.uint8,
}


def make_plan(spec: dict[str, Any]) -> bytes:
    """Serialize an engine spec into fake plan bytes (only the fake ``Runtime`` can read them).

    spec keys: ``inputs``: list of ``{"name", "dtype" (DataType name), "shape" (-1 = dynamic), "profiles": [[min,
    opt, max], ...]}``; ``outputs``: list of ``{"name", "dtype", "shape"}`` (first dim -1 = batch); optional
    ``activation_bytes`` (one per profile), ``weights_bytes``, ``version_compatible`` (needs
    ``engine_host_code_allowed``), ``location`` per tensor (``"HOST"`` for shape tensors).
    """
    nprof = {len(i["profiles"]) for i in spec["inputs"]}
    if len(nprof) != 1:
        raise ValueError("every input needs the same number of profiles")
    return PLAN_MAGIC + json.dumps(spec).encode()


class FakeTensorRT:
    """``.trt`` (TensorRT runtime module stand-in), ``.cudart`` (cuda.bindings.runtime stand-in), ``.gpu``."""

    def __init__(self, gpu: FakeGPU | None = None) -> None:
        cuda = FakeCuda(gpu)
        self.gpu = cuda.gpu
        self.cudart = cuda.cudart
        self.trt = _make_trt(self.gpu, self.cudart)


# =========================================================================== TensorRT runtime stand-in


def _make_trt(gpu: FakeGPU, cudart: ModuleType) -> ModuleType:
    m = ModuleType("fake_tensorrt")
    m.__version__ = "11.4.0.fake"

    class DataType(enum.Enum):
        FLOAT = 0
        HALF = 1
        INT8 = 2
        INT32 = 3
        BOOL = 4
        UINT8 = 5
        FP8 = 6
        BF16 = 7
        INT64 = 8
        INT4 = 9
        FP4 = 10
        E8M0 = 11

    class TensorIOMode(enum.Enum):
        NONE = 0
        INPUT = 1
        OUTPUT = 2

    class TensorLocation(enum.Enum):
        DEVICE = 0
        HOST = 1

    class EngineStat(enum.Enum):
        TOTAL_WEIGHTS_SIZE = 0
        STRIPPED_WEIGHTS_SIZE = 1

    class ExecutionContextAllocationStrategy(enum.Enum):
        STATIC = 0
        ON_PROFILE_CHANGE = 1
        USER_MANAGED = 2

    class Dims(tuple):
        """Tuple-like, as the real ``Dims``."""

    class Logger:
        class Severity(enum.IntEnum):
            INTERNAL_ERROR = 0
            ERROR = 1
            WARNING = 2
            INFO = 3
            VERBOSE = 4

        INTERNAL_ERROR = Severity.INTERNAL_ERROR
        ERROR = Severity.ERROR
        WARNING = Severity.WARNING
        INFO = Severity.INFO
        VERBOSE = Severity.VERBOSE

        def __init__(self, min_severity=Severity.WARNING):
            self._min_severity = min_severity

    class Runtime:
        def __init__(self, logger):
            if gpu.device_count == 0:  # the real one segfaults here; a stand-in may be kinder
                raise RuntimeError("fake TensorRT: no CUDA device")
            self._logger = logger
            self._host_code = False
            gpu.events.append("runtime created")

        @property
        def engine_host_code_allowed(self):
            return self._host_code

        @engine_host_code_allowed.setter
        def engine_host_code_allowed(self, value):
            self._host_code = bool(value)

        def deserialize_cuda_engine(self, serialized_engine):
            data = bytes(serialized_engine)
            if not data.startswith(PLAN_MAGIC):
                return None
            spec = json.loads(data[len(PLAN_MAGIC) :])
            if spec.get("version_compatible") and not self._host_code:
                return None  # TensorRT refuses plans with embedded host code unless allowed
            return ICudaEngine(spec)

        def __del__(self):
            gpu.events.append("runtime destroyed")

    class ICudaEngine:
        def __init__(self, spec):
            self._spec = spec
            self._inputs = {t["name"]: t for t in spec["inputs"]}
            self._outputs = {t["name"]: t for t in spec["outputs"]}
            self._order = [t["name"] for t in spec["inputs"]] + [t["name"] for t in spec["outputs"]]
            nprof = len(spec["inputs"][0]["profiles"]) if spec["inputs"] else 1
            self._activation = list(spec.get("activation_bytes", [1 << 20] * nprof))
            self._weights_ptr = gpu.alloc(int(spec.get("weights_bytes", 4096)), "weights")
            gpu.events.append("engine created")

        def _tensor(self, name):
            return self._inputs.get(name) or self._outputs.get(name)

        @property
        def num_io_tensors(self):
            return len(self._order)

        @property
        def num_optimization_profiles(self):
            return len(self._activation)

        @property
        def device_memory_size_v2(self):
            return max(self._activation)

        def get_device_memory_size_for_profile_v2(self, profile_index):
            return self._activation[profile_index]

        def get_engine_stat(self, stat=EngineStat.TOTAL_WEIGHTS_SIZE):
            return int(self._spec.get("weights_bytes", 4096)) if stat == EngineStat.TOTAL_WEIGHTS_SIZE else -1

        def get_tensor_name(self, index):
            return self._order[index]

        def get_tensor_mode(self, name):
            if name in self._inputs:
                return TensorIOMode.INPUT
            return TensorIOMode.OUTPUT if name in self._outputs else TensorIOMode.NONE

        def get_tensor_dtype(self, name):
            return DataType[self._tensor(name)["dtype"]]

        def get_tensor_shape(self, name):
            return Dims(self._tensor(name)["shape"])

        def get_tensor_location(self, name):
            return TensorLocation[self._tensor(name).get("location", "DEVICE")]

        def get_tensor_profile_shape(self, name, profile_index):
            if name not in self._inputs:
                return []
            return [Dims(s) for s in self._inputs[name]["profiles"][profile_index]]

        def create_execution_context(self, strategy=ExecutionContextAllocationStrategy.STATIC):
            return IExecutionContext(self, strategy)

        def __del__(self):
            gpu.free(self._weights_ptr)
            gpu.events.append("engine destroyed")

    class IExecutionContext:
        def __init__(self, engine, strategy=ExecutionContextAllocationStrategy.STATIC):
            self._engine = engine  # the real context keeps its engine alive too
            self._profile = 0
            self._shapes: dict[str, tuple[int, ...]] = {}
            self._addresses: dict[str, int] = {}
            self._user_memory: int | None = None  # USER_MANAGED: set_device_memory's address
            self._activation_ptr = None
            if strategy != ExecutionContextAllocationStrategy.USER_MANAGED:
                self._activation_ptr = gpu.alloc(engine.device_memory_size_v2, "activation")
            gpu.events.append("context created")

        def set_device_memory(self, memory, size):
            if self._activation_ptr is not None or size < self._engine.device_memory_size_v2 or gpu.find_device(
                    int(memory), int(size)) is None or int(memory) % 256:
                raise RuntimeError("set_device_memory: not a USER_MANAGED context, too small, or not device memory")
            self._user_memory = int(memory)

        @property
        def active_optimization_profile(self):
            return self._profile

        def set_optimization_profile_async(self, profile_index, stream_handle):
            if int(stream_handle) not in gpu.streams:
                return False
            if not 0 <= profile_index < self._engine.num_optimization_profiles:
                return False
            self._profile = profile_index
            self._shapes = {}
            return True

        def set_input_shape(self, name, shape):
            spec = self._engine._inputs.get(name)
            if spec is None:
                return False
            lo, _opt, hi = spec["profiles"][self._profile]
            shape = tuple(int(d) for d in shape)
            if (name, shape) in gpu.refuse_shapes:
                return False
            if len(shape) != len(lo) or any(not (a <= s <= b) for s, a, b in zip(shape, lo, hi)):
                return False  # the real runtime logs an error and returns False
            self._shapes[name] = shape
            return True

        def get_tensor_shape(self, name):
            eng = self._engine
            if name in eng._inputs:
                return Dims(self._shapes.get(name, eng._inputs[name]["shape"]))
            spec_shape = tuple(eng._outputs[name]["shape"])
            if len(self._shapes) < len(eng._inputs):
                return Dims(spec_shape)
            rows = self._shapes[next(iter(eng._inputs))][0]
            return Dims((rows,) + spec_shape[1:])

        def set_tensor_address(self, name, memory):
            if self._engine._tensor(name) is None:
                return False
            self._addresses[name] = int(memory)
            return True

        def execute_async_v3(self, stream_handle):
            stream = int(stream_handle)
            if gpu.fail_execute > 0:
                gpu.fail_execute -= 1
                return False
            eng = self._engine
            if stream not in gpu.streams or len(self._shapes) < len(eng._inputs):
                return False
            if any(n not in self._addresses for n in eng._order):
                return False
            if self._activation_ptr is None and self._user_memory is None:
                return False  # USER_MANAGED without device memory
            shapes = dict(self._shapes)
            outs = {n: tuple(self.get_tensor_shape(n)) for n in eng._outputs}
            addresses = dict(self._addresses)

            def op() -> int:
                gpu.executions.append(shapes)
                rows = next(iter(shapes.values()))[0]
                total = np.zeros(rows, np.float64)
                try:
                    for name, shape in shapes.items():
                        dt = np.dtype(NUMPY_BY_TRT[eng._inputs[name]["dtype"]])
                        nbytes = int(np.prod(shape)) * dt.itemsize
                        x = np.frombuffer(gpu.read(addresses[name], nbytes), dt).reshape(shape)
                        gpu.last_inputs[name] = x.copy()
                        total += x.reshape(rows, -1).astype(np.float64).sum(axis=1)
                    for name, shape in outs.items():
                        dt = np.dtype(NUMPY_BY_TRT[eng._outputs[name]["dtype"]])
                        per_row = int(np.prod(shape[1:]))
                        y = 2 * total[:, None] + np.arange(per_row)[None, :]
                        gpu.write(addresses[name], y.astype(dt).reshape(shape).tobytes())
                except IndexError:
                    return cudart.cudaError_t.cudaErrorIllegalAddress
                return cudart.cudaError_t.cudaSuccess

            gpu.enqueue(stream, op)
            return True

        def __del__(self):
            if self._activation_ptr is not None:
                gpu.free(self._activation_ptr)
            gpu.events.append("context destroyed")

    for obj in (
        DataType,
        TensorIOMode,
        TensorLocation,
        EngineStat,
        ExecutionContextAllocationStrategy,
        Dims,
        Logger,
        Runtime,
        ICudaEngine,
        IExecutionContext,
    ):
        setattr(m, obj.__name__, obj)
    return m
