"""CI guard: every TensorRT / CUDA runtime call of engines/tensorrt.py exists in the real bindings, with matching
parameters, and the test stand-ins (tests/fake_tensorrt.py) cannot drift from them.

The real modules are ``tensorrt_lean`` (the lean runtime wheel ``tensorrt-lean-cu13``; the full ``tensorrt``
module has the same runtime classes) and ``cuda.bindings.runtime`` (``cuda-python``). Both import without a GPU;
they only describe themselves here (pybind11 ``__doc__`` signatures, Cython ``inspect.signature``), nothing is
executed - ``tensorrt_lean.Runtime(logger)`` would even crash the process without a CUDA driver.

How uses are found: engines/tensorrt.py names TensorRT objects by convention (``trt``/``self._trt`` the module,
``runtime_obj``/``self._runtime`` the Runtime, ``cuda_engine``/``self._cuda_engine`` the ICudaEngine,
``trt_context``/``self._trt_context`` the IExecutionContext, ``cudart``/``self._cudart`` the CUDA runtime). The
AST walk records every attribute access on those names (call with its positional count and keyword names, load,
store, ``hasattr``), plus enum chains like ``trt.DataType.HALF``; a test also fails if a TensorRT object is
aliased to a name outside the convention, so nothing escapes the check.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import engines.tensorrt as backend

real_trt = pytest.importorskip("tensorrt_lean", reason="the API guard needs tensorrt-lean-cu13 (imports without GPU)")
real_cudart = pytest.importorskip("cuda.bindings.runtime", reason="the API guard needs cuda-python")

from fake_tensorrt import FakeTensorRT  # noqa: E402  (tests/ is on sys.path via conftest's rootdir)

SOURCE = Path(backend.__file__).read_text()

TRT_RECEIVERS = {
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
}
CUDART_RECEIVERS = {"cudart": "module", "_cudart": "module", "self._cudart": "module", "owner._cudart": "module"}

#: Calls whose result is a TensorRT object: the name it is assigned to must be a receiver of that kind.
FACTORIES = {
    ("module", "Runtime"): "Runtime",
    ("Runtime", "deserialize_cuda_engine"): "ICudaEngine",
    ("ICudaEngine", "create_execution_context"): "IExecutionContext",
}

INSTANCE_CLASSES = {"Runtime", "ICudaEngine", "IExecutionContext"}


@dataclass(frozen=True)
class Use:
    owner: str  # "module", a class name or an enum name
    name: str
    kind: str  # "call", "load", "store", "hasattr"
    npos: int = 0
    keywords: tuple[str, ...] = ()
    line: int = 0


# --------------------------------------------------------------------------- collecting uses


def collect_uses(source: str, receivers: dict[str, str]) -> tuple[list[Use], list[str]]:
    """Attribute uses on receiver names in ``source``, and alias problems (a TensorRT object stored under a name
    that is not a receiver of its kind)."""
    tree = ast.parse(source)
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    uses: list[Use] = []
    problems: list[str] = []

    def owner_of(expr: ast.AST) -> tuple[str, str] | None:
        """(owner, attribute) when ``expr`` is ``<receiver>.attr`` or ``<module receiver>.Enum.member``."""
        if not isinstance(expr, ast.Attribute):
            return None
        recv = ast.unparse(expr.value)
        if recv in receivers:
            return receivers[recv], expr.attr
        if isinstance(expr.value, ast.Attribute) and receivers.get(ast.unparse(expr.value.value)) == "module":
            return expr.value.attr, expr.attr  # trt.DataType.HALF -> ("DataType", "HALF")
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                recv = ast.unparse(node.args[0])
                if recv in receivers:
                    uses.append(Use(receivers[recv], node.args[1].value, "hasattr", line=node.lineno))
        found = owner_of(node)
        if found is None:
            continue
        owner, name = found
        up = parent.get(node)
        if isinstance(up, ast.Call) and up.func is node:
            kws = tuple(k.arg for k in up.keywords if k.arg is not None)
            uses.append(Use(owner, name, "call", len(up.args), kws, node.lineno))
        elif isinstance(node.ctx, ast.Store):
            uses.append(Use(owner, name, "store", line=node.lineno))
        else:
            uses.append(Use(owner, name, "load", line=node.lineno))

    def made_by(value: ast.AST) -> str | None:
        if isinstance(value, ast.Call):
            return FACTORIES.get(owner_of(value.func))  # type: ignore[arg-type]
        return receivers.get(ast.unparse(value))

    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        pairs: list[tuple[ast.AST, ast.AST]] = []
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(target.elts) == len(node.value.elts):
                pairs.extend(zip(target.elts, node.value.elts))
            else:
                pairs.append((target, node.value))
        for target, value in pairs:
            made = made_by(value)
            if made is not None and receivers.get(ast.unparse(target)) != made:
                problems.append(f"line {node.lineno}: {made} object assigned to {ast.unparse(target)!r}, outside the naming convention")
    return uses, problems


# --------------------------------------------------------------------------- real signatures


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def pybind_signatures(func: object, name: str) -> list[list[tuple[str, bool]]]:
    """Parameter lists ``[(name, has_default), ...]`` (``self`` dropped) of every overload in a pybind11
    docstring: ``name(self: T, a: U, b: V = d) -> R``, or numbered ``1. name(...)`` lines after
    "Overloaded function."."""
    doc = getattr(func, "__doc__", None) or ""
    sigs = []
    for m in re.finditer(rf"(?m)^\s*(?:\d+\.\s*)?{re.escape(name)}\(", doc):
        start = m.end()
        depth, i = 1, start
        while i < len(doc) and depth:
            depth += {"(": 1, ")": -1}.get(doc[i], 0)
            i += 1
        inner = doc[start : i - 1]
        if inner.strip() == "*args, **kwargs":
            continue
        params = []
        for part in _split_top(inner):
            pname = part.split(":", 1)[0].split("=", 1)[0].strip()
            if pname == "self":
                continue
            params.append((pname, "=" in part))
        sigs.append(params)
    return sigs


def _accepts(params: list[tuple[str, bool]], npos: int, keywords: tuple[str, ...]) -> bool:
    if npos > len(params):
        return False
    rest = params[npos:]
    names = {n for n, _ in rest}
    if any(k not in names for k in keywords):
        return False
    return all(has_default or n in keywords for n, has_default in rest)


def _cython_accepts(func: object, npos: int, keywords: tuple[str, ...]) -> bool:
    try:
        inspect.signature(func).bind(*range(npos), **{k: None for k in keywords})  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


# --------------------------------------------------------------------------- verification


def _real_owner(module: object, owner: str) -> object | None:
    return module if owner == "module" else getattr(module, owner, None)


def verify_uses(uses: list[Use], module: object, *, cython: bool) -> list[str]:
    """Problems of ``uses`` against the real ``module`` (empty: all fine)."""
    problems = []
    for use in uses:
        where = f"line {use.line}: {use.owner}.{use.name}"
        owner = _real_owner(module, use.owner)
        if owner is None:
            problems.append(f"{where}: {use.owner} does not exist")
            continue
        members = getattr(owner, "__members__", None)
        if isinstance(members, dict) and use.kind == "load" and use.owner != "module":
            if use.name not in members:
                problems.append(f"{where}: no enum member {use.name} (members: {sorted(members)})")
            continue
        try:
            static = inspect.getattr_static(owner, use.name)
        except AttributeError:
            problems.append(f"{where}: does not exist in the real bindings")
            continue
        if use.kind == "hasattr":
            continue
        if isinstance(static, property):
            if use.kind == "call":
                problems.append(f"{where}: is a property, but the code calls it")
            elif use.kind == "store" and static.fset is None:
                problems.append(f"{where}: is a read-only property, but the code assigns it")
            continue
        if use.kind == "store":
            problems.append(f"{where}: is not a settable property")
            continue
        if use.kind == "load":
            if use.owner in INSTANCE_CLASSES and callable(static):
                problems.append(f"{where}: is a method, but the code reads it as an attribute")
            continue
        # a call
        target = getattr(owner, use.name)
        if cython:
            if not _cython_accepts(target, use.npos, use.keywords):
                problems.append(f"{where}: called with {use.npos} positional {list(use.keywords)}; real {inspect.signature(target)}")
            continue
        doc_name, doc_obj = (("__init__", target.__init__) if inspect.isclass(target) else (use.name, target))
        sigs = pybind_signatures(doc_obj, doc_name)
        if not sigs:
            problems.append(f"{where}: no signature in the real docstring")
        elif not any(_accepts(sig, use.npos, use.keywords) for sig in sigs):
            problems.append(f"{where}: called with {use.npos} positional {list(use.keywords)}; real overloads {sigs}")
    return problems


def declared(api: dict[str, tuple[str, ...]]) -> set[tuple[str, str]]:
    return {(owner, name) for owner, names in api.items() for name in names}


# --------------------------------------------------------------------------- (a) TensorRT


def test_backend_trt_uses_match_declared_list():
    uses, aliases = collect_uses(SOURCE, TRT_RECEIVERS)
    assert not aliases
    found = {(u.owner, u.name) for u in uses}
    assert found == declared(backend.TRT_API), (
        f"used but not in TRT_API: {sorted(found - declared(backend.TRT_API))}; "
        f"in TRT_API but unused: {sorted(declared(backend.TRT_API) - found)}"
    )


def test_backend_trt_uses_exist_in_real_lean_bindings():
    uses, _ = collect_uses(SOURCE, TRT_RECEIVERS)
    assert len(uses) > 30  # the walk really sees the backend's calls
    assert verify_uses(uses, real_trt, cython=False) == []


def test_declared_trt_api_exists_in_real_lean_bindings():
    for owner, name in sorted(declared(backend.TRT_API)):
        real_owner = _real_owner(real_trt, owner)
        assert real_owner is not None, owner
        assert hasattr(real_owner, name), f"{owner}.{name} missing in tensorrt_lean {real_trt.__version__}"


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


# --------------------------------------------------------------------------- (b) CUDA runtime


def test_backend_cudart_uses_match_declared_list():
    uses, _ = collect_uses(SOURCE, CUDART_RECEIVERS)
    found = {(u.owner, u.name) for u in uses}
    assert found == declared(backend.CUDART_API), (
        f"used but not in CUDART_API: {sorted(found - declared(backend.CUDART_API))}; "
        f"declared but unused: {sorted(declared(backend.CUDART_API) - found)}"
    )


def test_backend_cudart_uses_exist_in_real_cuda_bindings():
    uses, _ = collect_uses(SOURCE, CUDART_RECEIVERS)
    assert len(uses) > 20
    assert verify_uses(uses, real_cudart, cython=True) == []


def test_cudart_signatures_readable():
    assert list(inspect.signature(real_cudart.cudaMemcpyAsync).parameters) == ["dst", "src", "count", "kind", "stream"]
    assert list(inspect.signature(real_cudart.cudaStreamCreateWithFlags).parameters) == ["flags"]
    assert int(real_cudart.cudaStreamNonBlocking) == 1


# --------------------------------------------------------------------------- (c) the fake is a subset of the real API


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


def test_fake_cudart_is_subset_of_real_cuda_bindings():
    fake = FakeTensorRT().cudart
    problems = []
    for attr, value in vars(fake).items():
        if attr.startswith("__"):
            continue
        real = getattr(real_cudart, attr, None)
        if real is None:
            problems.append(f"{attr}: not in cuda.bindings.runtime")
        elif inspect.isclass(value):
            for member, v in value.__members__.items():
                if not hasattr(real, member):
                    problems.append(f"{attr}.{member}: not a real member")
                elif int(getattr(real, member)) != int(v):
                    problems.append(f"{attr}.{member}: fake value {int(v)}, real {int(getattr(real, member))}")
        elif callable(value):
            if _params(value) != list(inspect.signature(real).parameters):
                problems.append(f"{attr}{tuple(_params(value))}: real {inspect.signature(real)}")
        elif int(value) != int(real):
            problems.append(f"{attr} = {value}, real {int(real)}")
    assert problems == []


def test_fake_covers_every_name_the_backend_uses():
    fake = FakeTensorRT()
    for owner, name in declared(backend.TRT_API):
        obj = fake.trt if owner == "module" else getattr(fake.trt, owner, None)
        assert obj is not None and hasattr(obj, name), f"fake lacks {owner}.{name}"
    for owner, name in declared(backend.CUDART_API):
        obj = fake.cudart if owner == "module" else getattr(fake.cudart, owner)
        assert hasattr(obj, name), f"fake cudart lacks {owner}.{name}"


# --------------------------------------------------------------------------- (d) the checker catches drift


def test_checker_reports_a_renamed_method():
    source = "def run(trt_context, stream):\n    return trt_context.execute_async_v2(stream)\n"
    uses, _ = collect_uses(source, TRT_RECEIVERS)
    problems = verify_uses(uses, real_trt, cython=False)
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
    uses, _ = collect_uses(source, TRT_RECEIVERS)
    problems = verify_uses(uses, real_trt, cython=False)
    text = "\n".join(problems)
    assert len(problems) == 6, text
    for needle in ("execute_async_v3", "set_input_shape", "is a property", "read-only", "is a method", "FLOAT16"):
        assert needle in text


def test_checker_reports_cudart_drift():
    source = (
        "def run(cudart, dst, src, n, kind):\n"
        "    cudart.cudaMemcpyAsync(dst, src, n, kind)\n"  # stream missing
        "    cudart.cudaMallocAsync(n)\n"  # wrong arity: (size, hStream)
        "    cudart.cudaStreamCreateNonBlocking()\n"  # no such function
        "    e = cudart.cudaError_t.cudaOK\n"  # no such member
    )
    uses, _ = collect_uses(source, CUDART_RECEIVERS)
    problems = verify_uses(uses, real_cudart, cython=True)
    assert len(problems) == 4, problems


def test_checker_reports_aliasing_outside_the_convention():
    source = (
        "def load(trt, runtime_obj, cuda_engine, plan):\n"
        "    eng = runtime_obj.deserialize_cuda_engine(plan)\n"
        "    ctx, n = cuda_engine, 1\n"
    )
    _, problems = collect_uses(source, TRT_RECEIVERS)
    assert len(problems) == 2 and "'eng'" in problems[0] and "'ctx'" in problems[1]
