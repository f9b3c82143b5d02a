"""The API guard's machinery: find every use of a binding's objects in our source by AST, and check each against
the real bindings (``tests/test_tensorrt_api.py`` for TensorRT, ``tests/test_cuda_api.py`` for the CUDA runtime).

How uses are found: the code names binding objects by convention - a ``Guard`` maps each receiver expression
(``"trt"``, ``"self._cuda_engine"``, ``"runtime()"``, ...) to what it is (``"module"`` or a class name). The AST
walk records every attribute access on a receiver (a call with its positional count and keyword names, a load, a
store, ``hasattr``/``getattr``), plus enum chains like ``trt.DataType.HALF``. Nothing escapes the check:

* a binding object assigned to a name outside the convention (``eng = runtime_obj.deserialize_cuda_engine(p)``,
  ``rt = runtime()``, ``import cuda.bindings.runtime as rt``) is a problem;
* a receiver passed as an argument is a problem unless the callee is the binding itself
  (``cudart.cudaIpcOpenMemHandle(ipc_handle, ...)``), is defined in the checked sources and names that parameter
  by the convention for the same kind (``read_profile_shapes(cuda_engine, ...)``), or is a harmless builtin
  (``hasattr``, ``int``, ...);
* reading a class or enum of the module as a value (``kinds = cudart.cudaMemcpyKind``) is a problem, since the
  members later read from it would go unchecked.

Real signatures: pybind11 ``__doc__`` lines (TensorRT: ``name(self: T, a: U, b: V = d) -> R``) or Cython
``inspect.signature`` (cuda-python; its classes give only a docstring ``Name(type arg=default)``).
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass, field

#: Builtins a receiver may be passed to without escaping the check.
HARMLESS = {"hasattr", "getattr", "int", "float", "bool", "str", "repr", "isinstance", "len", "id", "type"}


@dataclass(frozen=True)
class Use:
    owner: str  # "module", a class name or an enum name
    name: str
    kind: str  # "call", "load", "chain" (prefix of a longer chain), "store", "hasattr"
    npos: int = 0
    keywords: tuple[str, ...] = ()
    line: int = 0
    file: str = ""

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}: {self.owner}.{self.name}"


@dataclass
class Guard:
    """The naming convention of one binding.

    Attributes:
        receivers: expression text -> ``"module"`` or the class its value is an instance of.
        factories: ``(owner, attribute)`` of a call -> the class of the object it returns (its target must be a
            receiver of that class); ``("", name)`` for a plain function call such as ``load_trt(...)`` whose
            result (or first element) is the module.
        module_names: import paths of the real module (an import of one binds a name that must be a receiver).
        instance_classes: classes whose attributes are read on instances (a method read without a call is then
            a problem; in Cython bindings a method is called with ``self``).
    """

    receivers: dict[str, str]
    factories: dict[tuple[str, str], str] = field(default_factory=dict)
    module_names: tuple[str, ...] = ()
    instance_classes: frozenset[str] = frozenset()


# --------------------------------------------------------------------------- collecting uses


def _function_params(trees: list[ast.AST]) -> dict[str, list[str]]:
    """Function, method and class name (its ``__init__``) -> positional parameter names as a call passes them
    (``self``/``cls`` dropped for methods)."""
    params: dict[str, list[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        names = [a.arg for a in item.args.args][1:]
                        params[item.name] = names
                        if item.name == "__init__":
                            params[node.name] = names
            elif isinstance(node, ast.FunctionDef) and node.name not in params:
                params[node.name] = [a.arg for a in node.args.args]
    return params


def collect_uses(sources: dict[str, str], guard: Guard) -> tuple[list[Use], list[str]]:
    """Attribute uses on receivers in ``sources`` (file name -> text), and alias problems (see the module
    docstring)."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    params = _function_params(list(trees.values()))
    uses: list[Use] = []
    problems: list[str] = []
    for file, tree in trees.items():
        file_uses, file_problems = _collect_one(tree, guard, params, file)
        uses += file_uses
        problems += file_problems
    return uses, problems


def _collect_one(tree: ast.AST, guard: Guard, params: dict[str, list[str]], file: str) -> tuple[list[Use], list[str]]:
    receivers = guard.receivers
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

    def made_by(value: ast.AST) -> str | None:
        if isinstance(value, ast.Call):
            if isinstance(value.func, ast.Name) and ("", value.func.id) in guard.factories:
                return guard.factories["", value.func.id]
            if ast.unparse(value) in receivers:
                return receivers[ast.unparse(value)]
            return guard.factories.get(owner_of(value.func))  # type: ignore[arg-type]
        if isinstance(value, ast.Call | ast.Attribute | ast.Name):
            return receivers.get(ast.unparse(value))
        return None

    def problem(node: ast.AST, text: str) -> None:
        problems.append(f"{file}:{getattr(node, 'lineno', 0)}: {text}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if owner_of(node.func) is None:  # handing binding objects back to the binding itself is fine
                _check_arguments(node, receivers, params, problem)
            if isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr") and len(node.args) >= 2:
                recv = ast.unparse(node.args[0])
                if recv in receivers and isinstance(node.args[1], ast.Constant):
                    uses.append(Use(receivers[recv], node.args[1].value, "hasattr", line=node.lineno, file=file))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                path = f"{node.module}.{alias.name}" if isinstance(node, ast.ImportFrom) else alias.name
                bound = alias.asname or alias.name.split(".")[0]
                if path in guard.module_names and receivers.get(bound) != "module":
                    problem(node, f"module {path} imported as {bound!r}, outside the naming convention")
        found = owner_of(node)
        if found is None:
            continue
        owner, name = found
        up = parent.get(node)
        if isinstance(up, ast.Call) and up.func is node:
            kws = tuple(k.arg for k in up.keywords if k.arg is not None)
            uses.append(Use(owner, name, "call", len(up.args), kws, node.lineno, file))
        elif isinstance(node.ctx, ast.Store):
            uses.append(Use(owner, name, "store", line=node.lineno, file=file))
        elif isinstance(up, ast.Attribute) and up.value is node:
            uses.append(Use(owner, name, "chain", line=node.lineno, file=file))
        else:
            uses.append(Use(owner, name, "load", line=node.lineno, file=file))

    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        pairs: list[tuple[ast.AST, ast.AST]] = []
        for target in node.targets:
            value = node.value
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
                pairs.extend(zip(target.elts, value.elts))
            elif isinstance(target, ast.Tuple) and target.elts:
                pairs.append((target.elts[0], node.value))  # trt, name = load_trt(...): the first element
            else:
                pairs.append((target, node.value))
        for target, value in pairs:
            made = made_by(value)
            if made is not None and receivers.get(ast.unparse(target)) != made:
                problem(node, f"{made} object assigned to {ast.unparse(target)!r}, outside the naming convention")
    return uses, problems


def _check_arguments(call: ast.Call, receivers: dict[str, str], params: dict[str, list[str]], problem) -> None:
    """A receiver passed to ``call`` must land in a parameter of the same kind (see the module docstring)."""
    func = call.func
    callee = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    passed = [(i, None, a) for i, a in enumerate(call.args)] + [(None, k.arg, k.value) for k in call.keywords]
    for index, keyword, arg in passed:
        kind = receivers.get(ast.unparse(arg))
        if kind is None or callee in HARMLESS:
            continue
        names = params.get(callee or "", [])
        name = keyword if keyword is not None else (names[index] if index is not None and index < len(names) else None)
        if name is None or receivers.get(name) != kind:
            problem(call, f"{kind} object {ast.unparse(arg)!r} passed to {callee or ast.unparse(func)}"
                          f"({name or '?'}), outside the naming convention")


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


def cython_class_params(cls: type) -> list[tuple[str, bool]] | None:
    """Constructor parameters ``[(name, has_default)]`` of a cuda-python class from the first line of its
    docstring or of its nearest base's (``cudaIpcMemHandle_t`` documents nothing; its base
    ``cudaIpcMemHandle_st`` starts with ``cudaIpcMemHandle_st(void_ptr _ptr=0)``); ``None`` if none has one."""
    docs = (getattr(k, "__doc__", None) or "" for k in inspect.getmro(cls) if k is not object)
    m = next((m for m in (re.match(r"\s*\w+\((.*?)\)", d) for d in docs) if m), None)
    if m is None:
        return None
    params = []
    for part in _split_top(m.group(1)):
        decl = part.split("=", 1)[0].split(":", 1)[0].split()
        params.append((decl[-1], "=" in part))
    return params


def accepts(params: list[tuple[str, bool]], npos: int, keywords: tuple[str, ...]) -> bool:
    """Whether a call with ``npos`` positional arguments and ``keywords`` fits ``params``."""
    if npos > len(params):
        return False
    rest = params[npos:]
    names = {n for n, _ in rest}
    if any(k not in names for k in keywords):
        return False
    return all(has_default or n in keywords for n, has_default in rest)


def _cython_call_problem(target: object, use: Use, bound_method: bool) -> str | None:
    npos = use.npos + (1 if bound_method else 0)  # an instance method takes self first
    if inspect.isclass(target):
        params = cython_class_params(target)
        if params is None:
            return "no signature in the real docstring"
        return None if accepts(params, npos, use.keywords) else f"called with {use.npos} positional; real {params}"
    try:
        signature = inspect.signature(target)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "no readable signature in the real bindings"
    try:
        signature.bind(*range(npos), **{k: None for k in use.keywords})
    except TypeError:
        return f"called with {use.npos} positional {list(use.keywords)}; real {signature}"
    return None


def _pybind_call_problem(target: object, use: Use) -> str | None:
    doc_name, doc_obj = (("__init__", target.__init__) if inspect.isclass(target) else (use.name, target))
    sigs = pybind_signatures(doc_obj, doc_name)
    if not sigs:
        return "no signature in the real docstring"
    if not any(accepts(sig, use.npos, use.keywords) for sig in sigs):
        return f"called with {use.npos} positional {list(use.keywords)}; real overloads {sigs}"
    return None


# --------------------------------------------------------------------------- verification


def real_owner(module: object, owner: str) -> object | None:
    return module if owner == "module" else getattr(module, owner, None)


def verify_uses(uses: list[Use], module: object, guard: Guard, *, cython: bool) -> list[str]:
    """Problems of ``uses`` against the real ``module`` (empty: all fine)."""
    problems = []
    for use in uses:
        text = _verify_one(use, module, guard, cython)
        if text is not None:
            problems.append(f"{use.where}: {text}")
    return problems


def _verify_one(use: Use, module: object, guard: Guard, cython: bool) -> str | None:
    owner = real_owner(module, use.owner)
    if owner is None:
        return f"{use.owner} does not exist"
    members = getattr(owner, "__members__", None)
    if isinstance(members, dict) and use.kind == "load" and use.owner != "module":
        near = sorted(m for m in members if m.lower()[:6] == use.name.lower()[:6])[:8] or sorted(members)[:8]
        return None if use.name in members else f"no enum member {use.name} (members such as {near})"
    try:
        static = inspect.getattr_static(owner, use.name)
    except AttributeError:
        return "does not exist in the real bindings"
    if use.kind in ("hasattr", "chain"):
        return None
    if isinstance(static, property):
        if use.kind == "call":
            return "is a property, but the code calls it"
        if use.kind == "store" and static.fset is None:
            return "is a read-only property, but the code assigns it"
        return None
    if use.kind == "store":
        return "is not a settable property"
    if use.kind == "load":
        if use.owner in guard.instance_classes and callable(static):
            return "is a method, but the code reads it as an attribute"
        if use.owner == "module" and inspect.isclass(getattr(owner, use.name)):
            return "is a class or enum read as a value: the members read from it later would go unchecked"
        return None
    target = getattr(owner, use.name)
    if cython:
        return _cython_call_problem(target, use, use.owner in guard.instance_classes)
    return _pybind_call_problem(target, use)


def declared(api: dict[str, tuple[str, ...]]) -> set[tuple[str, str]]:
    return {(owner, name) for owner, names in api.items() for name in names}
