"""The CPU context (one ``InferenceSession`` per context) and the tensor specs every ONNX Runtime context shares."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from ..base import EngineError, ExecutionContext, TensorSpec
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


class OnnxRuntimeContext(ExecutionContext):
    """An ``InferenceSession`` on the CPU provider, owned by one thread at a time."""

    def __init__(self, session: ort.InferenceSession, output_names: Sequence[str], nbytes: int) -> None:
        self._session: ort.InferenceSession | None = session
        self._output_names = list(output_names)
        self._nbytes = nbytes

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def describe(self) -> dict[str, Any]:
        return {"execution": "cpu", "precision": "fp32"}

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._session is None:
            raise EngineError("execution context was released")
        try:
            results = self._session.run(self._output_names, dict(inputs))
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidArgument/RuntimeException types
            raise EngineError(f"onnxruntime: {exc}") from exc
        return dict(zip(self._output_names, results))

    def release(self) -> None:
        self._session = None
