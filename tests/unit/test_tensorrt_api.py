"""CI guard: every TensorRT call of the ``engines/tensorrt`` package exists in the real bindings, with matching
parameters, and the TensorRT stand-in (tests/fake_tensorrt.py) cannot drift from them. The CUDA runtime side of
both backends is guarded by tests/test_cuda_api.py.

The real module is ``tensorrt_lean`` (the lean runtime wheel ``tensorrt-lean-cu13``; the full ``tensorrt`` module
has the same runtime classes). It imports without a GPU; it only describes itself here (pybind11 ``__doc__``
signatures), nothing is executed - ``tensorrt_lean.Runtime(logger)`` would even crash the process without a CUDA
driver.

How uses are found (tests/api_guard.py): every module of the package names TensorRT objects by convention
(``trt``/``self._trt`` the module, ``runtime_obj``/``self._runtime`` the Runtime, ``cuda_engine``/
``self._cuda_engine`` the ICudaEngine, ``trt_context``/``self._trt_context`` the IExecutionContext). The AST walk
records every attribute access on those names, plus enum chains like ``trt.DataType.HALF``; a test also fails if
a TensorRT object is aliased to a name outside the convention or passed to a parameter outside it.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import engines.tensorrt as backend
from api_guard import Guard, collect_uses, declared, pybind_signatures, real_owner, verify_uses
from engines.tensorrt import api

real_trt = pytest.importorskip("tensorrt_lean", reason="the API guard needs tensorrt-lean-cu13 (imports without GPU)")

from fake_tensorrt import FakeTensorRT  # noqa: E402  (tests/ is on sys.path via conftest's rootdir)

PACKAGE = Path(backend.__file__).parent
SOURCES = {p.name: p.read_text() for p in sorted(PACKAGE.glob("*.py"))}

TRT = Guard(
    receivers={
        "trt": "module",
        "_trt": "module",
        "self._trt": "module",
        "owner._trt": "module",
        "runtime_obj": "Runtime",
        "self._runtime": "Runtime",
        "cuda_engine": "ICudaEngine",
        "self._cuda_engine": "ICudaEngine",
        "owner._cuda_engine": "ICudaEngine",
        "trt_context": "IExecutionContext",
        "self._trt_context": "IExecutionContext",
        "self.trt_context": "IExecutionContext",  # graphs.ShapeGraph keeps its size's context
    },
    # calls whose result is a TensorRT object: the name it is assigned to must be a receiver of that kind
    factories={
        ("", "load_trt"): "module",
        ("module", "Runtime"): "Runtime",
        ("Runtime", "deserialize_cuda_engine"): "ICudaEngine",
        ("ICudaEngine", "create_execution_context"): "IExecutionContext",
    },
    module_names=tuple(api.RUNTIME_MODULES.values()),
    instance_classes=frozenset({"Runtime", "ICudaEngine", "IExecutionContext"}),
)


def test_guard_reads_every_module_of_the_package():
    assert set(SOURCES) == {"__init__.py", "api.py", "profiles.py", "engine.py", "context.py", "graphs.py"}


def test_backend_trt_uses_match_declared_list():
    uses, aliases = collect_uses(SOURCES, TRT)
    assert aliases == []
    found = {(u.owner, u.name) for u in uses}
    assert found == declared(api.TRT_API), (
        f"used but not in TRT_API: {sorted(found - declared(api.TRT_API))}; "
        f"in TRT_API but unused: {sorted(declared(api.TRT_API) - found)}"
    )


def test_backend_trt_uses_exist_in_real_lean_bindings():
    uses, _ = collect_uses(SOURCES, TRT)
    assert len(uses) > 30  # the walk really sees the backend's calls
    assert {u.file for u in uses} >= {"api.py", "profiles.py", "engine.py", "context.py"}
    assert verify_uses(uses, real_trt, TRT, cython=False) == []


def test_declared_trt_api_exists_in_real_lean_bindings():
    for owner, name in sorted(declared(api.TRT_API)):
        owner_obj = real_owner(real_trt, owner)
        assert owner_obj is not None, owner
        assert hasattr(owner_obj, name), f"{owner}.{name} missing in tensorrt_lean {real_trt.__version__}"


@pytest.mark.parametrize(
    "cls, name",
    [
        ("ICudaEngine", "num_io_tensors"),
        ("ICudaEngine", "num_optimization_profiles"),
        ("ICudaEngine", "device_memory_size_v2"),
        ("Runtime", "engine_host_code_allowed"),
    ],
)
def test_properties_are_properties(cls, name):
    assert isinstance(inspect.getattr_static(getattr(real_trt, cls), name), property)


def test_engine_host_code_allowed_is_settable():
    assert inspect.getattr_static(real_trt.Runtime, "engine_host_code_allowed").fset is not None


def test_method_signatures_as_the_backend_passes_them():
    sig = pybind_signatures(real_trt.IExecutionContext.execute_async_v3, "execute_async_v3")
    assert sig == [[("stream_handle", False)]]
    sig = pybind_signatures(real_trt.IExecutionContext.set_optimization_profile_async, "set_optimization_profile_async")
    assert sig == [[("profile_index", False), ("stream_handle", False)]]
    sig = pybind_signatures(real_trt.ICudaEngine.get_tensor_profile_shape, "get_tensor_profile_shape")
    assert sig == [[("name", False), ("profile_index", False)]]
    # overloaded: tuple / list / Dims shapes
    sigs = pybind_signatures(real_trt.IExecutionContext.set_input_shape, "set_input_shape")
    assert len(sigs) == 3 and all(s == [("name", False), ("shape", False)] for s in sigs)
    sigs = pybind_signatures(real_trt.Runtime.deserialize_cuda_engine, "deserialize_cuda_engine")
    assert [("serialized_engine", False)] in sigs


# --------------------------------------------------------------------------- the fake is a subset of the real API


def _params(func: object) -> list[str]:
    return [p for p in inspect.signature(func).parameters if p != "self"]


def _fake_class_problems(name: str, fake_cls: type, real_cls: type) -> list[str]:
    problems = []
    members = getattr(fake_cls, "__members__", None)
    if isinstance(members, dict) and members:  # an Enum
        real_members = getattr(real_cls, "__members__", {})
        return [f"{name}.{m}: not a real member" for m in members if m not in real_members]
    for attr, value in vars(fake_cls).items():
        public = not attr.startswith("_") or attr == "__init__"
        if not public:
            continue
        if attr == "__init__" and name in ("ICudaEngine", "IExecutionContext"):
            continue  # not constructible by users in the real bindings; the fake builds them internally
        try:
            real = inspect.getattr_static(real_cls, attr)
        except AttributeError:
            problems.append(f"{name}.{attr}: not in the real bindings")
            continue
        if isinstance(value, property):
            if not isinstance(real, property):
                problems.append(f"{name}.{attr}: fake property, real {type(real).__name__}")
            elif value.fset is not None and real.fset is None:
                problems.append(f"{name}.{attr}: fake settable, real read-only")
        elif inspect.isfunction(value):
            if isinstance(real, property):
                problems.append(f"{name}.{attr}: fake method, real property")
                continue
            sigs = pybind_signatures(getattr(real_cls, attr), attr)
            mine = _params(value)
            if not any([n for n, _ in sig] == mine for sig in sigs):
                problems.append(f"{name}.{attr}{tuple(mine)}: no real overload with these parameters: {sigs}")
        elif inspect.isclass(value):
            problems.extend(_fake_class_problems(f"{name}.{attr}", value, getattr(real_cls, attr)))
    return problems


def test_fake_trt_is_subset_of_real_lean_bindings():
    fake = FakeTensorRT().trt
    problems = []
    for attr, value in vars(fake).items():
        if attr.startswith("__") and attr != "__version__":
            continue
        if not hasattr(real_trt, attr):
            problems.append(f"{attr}: not in tensorrt_lean")
        elif inspect.isclass(value):
            problems.extend(_fake_class_problems(attr, value, getattr(real_trt, attr)))
    assert problems == []


def test_fake_covers_every_name_the_backend_uses():
    fake = FakeTensorRT()
    for owner, name in declared(api.TRT_API):
        obj = fake.trt if owner == "module" else getattr(fake.trt, owner, None)
        assert obj is not None and hasattr(obj, name), f"fake lacks {owner}.{name}"


# --------------------------------------------------------------------------- the checker catches drift


def _check(source: str) -> tuple[list[str], list[str]]:
    uses, aliases = collect_uses({"t.py": source}, TRT)
    return verify_uses(uses, real_trt, TRT, cython=False), aliases


def test_checker_reports_a_renamed_method():
    problems, _ = _check("def run(trt_context, stream):\n    return trt_context.execute_async_v2(stream)\n")
    assert len(problems) == 1 and "IExecutionContext.execute_async_v2" in problems[0]
    assert "does not exist" in problems[0]


def test_checker_reports_wrong_arguments_properties_and_enums():
    source = (
        "def run(trt, cuda_engine, trt_context, stream):\n"
        "    trt_context.execute_async_v3(stream, 0)\n"  # one argument too many
        "    trt_context.set_input_shape(name='x')\n"  # shape missing
        "    n = cuda_engine.num_io_tensors()\n"  # property called
        "    cuda_engine.num_io_tensors = 3\n"  # read-only property assigned
        "    m = cuda_engine.get_tensor_name\n"  # method read as attribute
        "    t = trt.DataType.FLOAT16\n"  # no such member (it is HALF)
    )
    problems, _ = _check(source)
    text = "\n".join(problems)
    assert len(problems) == 6, text
    for needle in ("execute_async_v3", "set_input_shape", "is a property", "read-only", "is a method", "FLOAT16"):
        assert needle in text


def test_checker_reports_aliasing_outside_the_convention():
    source = (
        "import tensorrt_lean as lean\n"
        "def load(trt, runtime_obj, cuda_engine, plan):\n"
        "    eng = runtime_obj.deserialize_cuda_engine(plan)\n"
        "    ctx, n = cuda_engine, 1\n"
        "    mod, name = load_trt('auto')\n"
        "    helper(cuda_engine)\n"  # unknown callee: the engine leaves the checked code
        "    shapes(cuda_engine)\n"  # known callee, parameter outside the convention
        "    dtypes = trt.DataType\n"  # enum read as a value: its members would go unchecked
        "def shapes(engine):\n"
        "    return engine.get_tensor_shape('x')\n"
    )
    problems, aliases = _check(source)
    text = "\n".join(aliases)
    assert len(aliases) == 6, text
    for needle in ("'lean'", "'eng'", "'ctx'", "'mod'", "helper", "shapes(engine)"):
        assert needle in text
    assert len(problems) == 1 and "DataType" in problems[0] and "read as a value" in problems[0]


def test_checker_accepts_passing_along_the_convention():
    source = (
        "def load(trt, cuda_engine, spec):\n"
        "    trt, name = load_trt('auto')\n"
        "    return read(cuda_engine, spec), hasattr(cuda_engine, 'get_engine_stat'), tname(trt, 0)\n"
        "def read(cuda_engine, spec):\n"
        "    return cuda_engine.get_tensor_profile_shape(spec, 0)\n"
        "def tname(trt, t):\n"
        "    return trt.DataType.FLOAT\n"
    )
    problems, aliases = _check(source)
    assert aliases == [] and problems == []
