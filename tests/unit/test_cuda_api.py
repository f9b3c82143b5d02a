"""CI guard: every CUDA runtime call of both GPU backends exists in the real ``cuda.bindings.runtime`` (cuda-python),
with the parameters the code passes, and the stand-in (tests/fake_cuda.py) cannot drift from it.

Both backends reach CUDA only through the layer ``engines/cuda`` (a test below fails when any other module of
``engines`` imports cuda-python, names the runtime or calls it), so guarding every module of the layer guards
every CUDA call of ONNX Runtime's CUDA contexts and of TensorRT. The layer names the runtime module ``runtime()``
or ``cudart`` and an IPC handle ``ipc_handle`` (tests/api_guard.py explains the walk and the alias checks).

The real module imports without a GPU and only describes itself here (Cython ``inspect.signature``); nothing is
executed.
"""

from __future__ import annotations

import ast
import enum
import inspect
from pathlib import Path

import pytest

import engines
import engines.cuda as layer
from api_guard import Guard, cython_class_params, collect_uses, declared, verify_uses
from fake_cuda import FakeCuda

real_cudart = pytest.importorskip("cuda.bindings.runtime", reason="the API guard needs cuda-python")

LAYER_DIR = Path(layer.__file__).parent
LAYER = {p.name: p.read_text() for p in sorted(LAYER_DIR.glob("*.py"))}
OUTSIDE = {
    str(p.relative_to(LAYER_DIR.parent)): p.read_text()
    for p in sorted(Path(engines.__file__).parent.rglob("*.py"))
    if LAYER_DIR not in p.parents
}

CUDART = Guard(
    receivers={"cudart": "module", "runtime()": "module", "ipc_handle": "cudaIpcMemHandle_t"},
    factories={("module", "cudaIpcMemHandle_t"): "cudaIpcMemHandle_t"},
    module_names=("cuda.bindings.runtime", "cuda.cudart", "cuda.bindings"),
    instance_classes=frozenset({"cudaIpcMemHandle_t"}),
)


# --------------------------------------------------------------------------- (a) the layer's calls


def test_guard_reads_every_module_of_the_layer():
    assert set(LAYER) == {"__init__.py", "runtime.py", "device.py", "stream.py", "memory.py", "gate.py", "held.py"}
    assert {"onnxruntime/cuda.py", "onnxruntime/graphs.py", "tensorrt/context.py", "trt_build/build.py"} <= set(OUTSIDE)


def test_layer_uses_match_declared_list():
    uses, aliases = collect_uses(LAYER, CUDART)
    assert aliases == []
    found = {(u.owner, u.name) for u in uses}
    assert found == declared(layer.CUDART_API), (
        f"used but not in CUDART_API: {sorted(found - declared(layer.CUDART_API))}; "
        f"declared but unused: {sorted(declared(layer.CUDART_API) - found)}"
    )


def test_layer_uses_exist_in_real_cuda_bindings():
    uses, _ = collect_uses(LAYER, CUDART)
    assert len(uses) > 50  # the walk really sees the layer's calls
    assert {u.file for u in uses} == {"runtime.py", "device.py", "stream.py", "memory.py"}
    assert verify_uses(uses, real_cudart, CUDART, cython=True) == []


def test_declared_cudart_api_exists_in_real_bindings():
    for owner, name in sorted(declared(layer.CUDART_API)):
        obj = real_cudart if owner == "module" else getattr(real_cudart, owner)
        assert hasattr(obj, name), f"{owner}.{name} missing in cuda.bindings.runtime"


def test_cudart_signatures_as_the_layer_passes_them():
    def params(name: str) -> list[str]:
        return list(inspect.signature(getattr(real_cudart, name)).parameters)

    assert params("cudaMemcpyAsync") == ["dst", "src", "count", "kind", "stream"]
    assert params("cudaStreamCreateWithFlags") == ["flags"]
    assert params("cudaHostRegister") == ["ptr", "size", "flags"]
    assert params("cudaEventRecord") == ["event", "stream"]
    assert params("cudaEventElapsedTime") == ["start", "end"]
    assert params("cudaStreamBeginCapture") == ["stream", "mode"]
    assert params("cudaGraphInstantiate") == ["graph", "flags"]
    assert params("cudaGraphLaunch") == ["graphExec", "stream"]
    assert params("cudaIpcOpenMemHandle") == ["handle", "flags"]
    assert cython_class_params(real_cudart.cudaIpcMemHandle_t) == [("_ptr", True)]
    assert int(real_cudart.cudaStreamNonBlocking) == 1
    assert int(real_cudart.cudaEventDisableTiming) == 2
    assert int(real_cudart.cudaIpcMemLazyEnablePeerAccess) == 1
    assert real_cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal == 1


# --------------------------------------------------------------------------- (b) nothing else reaches CUDA


def _outside_problems(file: str, source: str) -> list[str]:
    """Ways ``source`` could reach the CUDA runtime without the layer."""
    problems = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            absolute = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if (isinstance(node, ast.Import) or node.level == 0) and any(m.split(".")[0] == "cuda" for m in absolute):
                problems.append(f"{file}:{node.lineno}: imports cuda-python")
            elif isinstance(node, ast.ImportFrom) and "cuda" in (node.module or "").split("."):  # the layer
                seam = {a.name for a in node.names} & {"runtime", "set_runtime", "use_runtime"}
                if seam or "runtime" in (node.module or "").split("."):
                    problems.append(f"{file}:{node.lineno}: imports the runtime seam of the layer {sorted(seam)}")
        if isinstance(node, ast.Constant) and str(node.value).startswith(("cuda.bind", "cuda.cudart")):
            problems.append(f"{file}:{node.lineno}: names the module {node.value}")
    uses, aliases = collect_uses({file: source}, CUDART)
    problems += [f"{u.where}: calls the CUDA runtime outside the layer" for u in uses] + aliases
    return problems


def test_no_module_outside_the_layer_reaches_the_cuda_runtime():
    problems = [p for file, source in OUTSIDE.items() for p in _outside_problems(file, source)]
    assert problems == []


def test_both_backends_use_the_layer():
    assert "from ..cuda import" in OUTSIDE["onnxruntime/cuda.py"]
    assert "from ..cuda import" in OUTSIDE["onnxruntime/graphs.py"]
    assert "from ..cuda import" in OUTSIDE["tensorrt/context.py"]
    assert "from ..cuda import" in OUTSIDE["tensorrt/engine.py"]


def test_outside_check_catches_a_direct_call():
    source = (
        "from cuda.bindings import runtime as cudart\n"
        "from engines.cuda.runtime import runtime as rt\n"
        "import importlib\n"
        "def f():\n"
        "    cudart.cudaDeviceSynchronize()\n"
        "    return importlib.import_module('cuda.bindings.runtime')\n"
    )
    problems = _outside_problems("x.py", source)
    assert len(problems) == 4, problems


# --------------------------------------------------------------------------- (c) the fake is a subset of the real API


def _fake_problems(attr: str, value: object, real: object) -> list[str]:
    if isinstance(value, type) and issubclass(value, enum.Enum):  # members and their values
        return [
            f"{attr}.{member}: not a real member" if not hasattr(real, member)
            else f"{attr}.{member}: fake value {int(v)}, real {int(getattr(real, member))}"
            for member, v in value.__members__.items()  # type: ignore[attr-defined]
            if not hasattr(real, member) or int(getattr(real, member)) != int(v)
        ]
    if inspect.isclass(value):  # a handle class: constructor and methods
        problems = []
        init = [p for p in inspect.signature(value.__init__).parameters if p != "self"]
        if init != [n for n, _ in cython_class_params(real) or []]:  # type: ignore[arg-type]
            problems.append(f"{attr}{tuple(init)}: real {cython_class_params(real)}")  # type: ignore[arg-type]
        for name, method in vars(value).items():
            if name.startswith("_") or not inspect.isfunction(method):
                continue
            real_method = getattr(real, name, None)
            mine = list(inspect.signature(method).parameters)
            if real_method is None or mine != list(inspect.signature(real_method).parameters):
                problems.append(f"{attr}.{name}: not a real method with these parameters")
        return problems
    if callable(value):
        mine = list(inspect.signature(value).parameters)
        real_params = list(inspect.signature(real).parameters)
        return [] if mine == real_params else [f"{attr}{tuple(mine)}: real {inspect.signature(real)}"]
    return [] if int(value) == int(real) else [f"{attr} = {value}, real {int(real)}"]  # type: ignore[call-overload]


def test_fake_cudart_is_subset_of_real_cuda_bindings():
    fake = FakeCuda().cudart
    problems = []
    for attr, value in vars(fake).items():
        if attr.startswith("__"):
            continue
        real = getattr(real_cudart, attr, None)
        problems += [f"{attr}: not in cuda.bindings.runtime"] if real is None else _fake_problems(attr, value, real)
    assert problems == []


def test_fake_covers_every_name_the_layer_uses():
    fake = FakeCuda().cudart
    for owner, name in declared(layer.CUDART_API):
        obj = fake if owner == "module" else getattr(fake, owner)
        assert hasattr(obj, name), f"fake cudart lacks {owner}.{name}"


# --------------------------------------------------------------------------- (d) the checker catches drift


def _check(source: str) -> tuple[list[str], list[str]]:
    uses, aliases = collect_uses({"t.py": source}, CUDART)
    return verify_uses(uses, real_cudart, CUDART, cython=True), aliases


def test_checker_reports_a_renamed_call():
    problems, _ = _check("def f(start, end):\n    return runtime().cudaEventElapsedTimeMs(start, end)\n")
    assert len(problems) == 1 and "module.cudaEventElapsedTimeMs" in problems[0] and "does not exist" in problems[0]


def test_checker_reports_cudart_drift():
    source = (
        "def run(cudart, dst, src, n, kind, stream):\n"
        "    cudart.cudaMemcpyAsync(dst, src, n, kind)\n"  # stream missing
        "    cudart.cudaMallocAsync(n)\n"  # wrong arity: (size, hStream)
        "    cudart.cudaStreamCreateNonBlocking()\n"  # no such function
        "    e = cudart.cudaError_t.cudaOK\n"  # no such member
        "    runtime().cudaStreamBeginCapture(stream)\n"  # mode missing
        "    m = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadlocal\n"  # misspelt member
        "    ipc_handle = cudart.cudaIpcMemHandle_t(0, 1)\n"  # one argument too many
        "    ipc_handle.getPtr(1)\n"  # takes none
        "    ipc_handle.reserved\n"  # no such attribute in cuda-python 13
    )
    problems, aliases = _check(source)
    assert aliases == [] and len(problems) == 9, "\n".join(problems)


def test_checker_reports_aliasing_outside_the_convention():
    source = (
        "import cuda.bindings.runtime as rt\n"
        "def f(cudart, ptr):\n"
        "    mod = runtime()\n"
        "    h = cudart.cudaIpcMemHandle_t()\n"
        "    helper(cudart)\n"
        "    free(runtime(), ptr)\n"
        "    kinds = cudart.cudaMemcpyKind\n"
        "def free(module, ptr):\n"
        "    return module.cudaFree(ptr)\n"
    )
    problems, aliases = _check(source)
    text = "\n".join(aliases)
    assert len(aliases) == 5, text
    for needle in ("'rt'", "'mod'", "'h'", "helper", "free(module)"):
        assert needle in text
    assert len(problems) == 1 and "cudaMemcpyKind" in problems[0] and "read as a value" in problems[0]
