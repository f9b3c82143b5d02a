"""The CPU context (one ``InferenceSession`` per context) and the tensor specs every ONNX Runtime context shares.

Strings: the engine contract's BYTES tensors hold ``bytes``; ONNX Runtime's Python binding takes ``str`` for a
string tensor (a ``bytes`` element would become the text ``"b'abc'"``) and gives ``str`` back. A context decodes
BYTES inputs as UTF-8 and encodes string outputs as UTF-8, so text goes through byte-exact. Bytes that are not
UTF-8 cannot be carried by an ONNX Runtime string tensor: :class:`EngineInputError` (the server checks this before
queueing, :attr:`OnnxRuntimeEngine.bytes_as_text`). A batch with string inputs that ONNX Runtime fails on at run
time (``RUNTIME_EXCEPTION``/``INVALID_ARGUMENT``: a string-parsing operator such as ``Cast`` meets text it cannot
parse) fails with :class:`EngineInputError` too: the data, not the model, is at fault. Run-time failures are not
logged by ONNX Runtime's own logger (the exception carries the message).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from ..base import EngineError, EngineInputError, ExecutionContext, TensorSpec
from ..datatypes import ONNX_TYPES


def tensor_spec(arg: ort.NodeArg) -> TensorSpec:
    """The :class:`TensorSpec` of an ONNX Runtime input/output (symbolic or unknown dims become ``-1``).

    Raises:
        EngineError: the tensor's type has no KServe v2 datatype.
    """
    try:
        datatype = ONNX_TYPES[arg.type]
    except KeyError:
        raise EngineError(f"tensor {arg.name!r} has type {arg.type}, which the server does not support") from None
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or []))
    return TensorSpec(arg.name, datatype, shape)


#: ONNX Runtime's run-time errors that text input can cause (a string-parsing operator); the pybind error types.
_DATA_ERRORS = tuple(getattr(ort.capi.onnxruntime_pybind11_state, n) for n in ("RuntimeException", "InvalidArgument"))


def run_failure(exc: Exception, feeds: Mapping[str, Any], what: str = "onnxruntime") -> EngineError:
    """ONNX Runtime's failure on ``feeds``: the input's fault (:class:`EngineInputError`, a 400) when one of them
    has a dimension of size 0, which the model's dynamic dims admit and its operators cannot run on (PP-OCR's
    detector on ``[1, 3, 0, 32]``: "Invalid input shape"); else the engine's (a 500). Its message on one line,
    after ``what``."""
    message = " ".join(str(exc).split())
    if any(getattr(a, "size", 1) == 0 for a in feeds.values()):
        return EngineInputError(f"{what} cannot run on an input with a dimension of size 0: {message}")
    return EngineError(f"{what}: {message}")


def quiet_run_options() -> ort.RunOptions:
    """Run options that keep ONNX Runtime's own logger quiet on a failed run (the exception says why)."""
    ro = ort.RunOptions()
    ro.log_severity_level = 4  # fatal only
    return ro


def text_feeds(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs as ONNX Runtime takes them: BYTES (object arrays of ``bytes``) decoded to ``str`` as UTF-8.

    Raises:
        EngineInputError: a BYTES element is not UTF-8 (the message names the input and the element).
    """
    feeds = {}
    for name, arr in inputs.items():
        if arr.dtype == object:
            flat = arr.ravel()
            try:
                text = np.fromiter((b.decode("utf-8") if isinstance(b, bytes) else b for b in flat), object, flat.size)
            except UnicodeDecodeError as exc:
                raise EngineInputError(f"input {name!r}: a BYTES element is not UTF-8 text ({exc.reason} at byte "
                                       f"{exc.start}); ONNX Runtime string tensors carry UTF-8 text only") from None
            arr = text.reshape(arr.shape)
        feeds[name] = arr
    return feeds


def bytes_outputs(arr: np.ndarray) -> np.ndarray:
    """An ONNX Runtime output as the contract has it: string tensors (``str`` elements) as ``bytes`` (UTF-8)."""
    if arr.dtype != object:
        return arr
    flat = arr.ravel()
    return np.fromiter((s.encode("utf-8") if isinstance(s, str) else s for s in flat), object, flat.size).reshape(
        arr.shape)


class OnnxRuntimeContext(ExecutionContext):
    """An ``InferenceSession`` run with plain ``run`` (host arrays in and out), owned by one thread at a time: the
    CPU provider's context, and on CUDA the context of models with string tensors (which have no device memory in
    ONNX Runtime, so neither IOBinding nor graphs can hold them)."""

    def __init__(self, session: ort.InferenceSession, output_names: Sequence[str], nbytes: int,
                 facts: dict[str, Any] | None = None) -> None:
        self._session: ort.InferenceSession | None = session
        self._output_names = list(output_names)
        self._nbytes = nbytes
        self._run_options = quiet_run_options()
        self._facts = facts or {"execution": "cpu", "precision": "fp32"}

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def describe(self) -> dict[str, Any]:
        return dict(self._facts)

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._session is None:
            raise EngineError("execution context was released")
        feeds = text_feeds(inputs)
        try:
            results = self._session.run(self._output_names, feeds, self._run_options)
        except _DATA_ERRORS as exc:
            if any(a.dtype == object for a in feeds.values()):  # text the model could not parse
                raise EngineInputError(f"onnxruntime could not run on this input: {exc}") from exc
            raise run_failure(exc, feeds) from exc
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidArgument/RuntimeException types
            raise run_failure(exc, feeds) from exc
        return {name: bytes_outputs(r) for name, r in zip(self._output_names, results)}

    def release(self) -> None:
        self._session = None
