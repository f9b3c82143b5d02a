"""Small real string models for the soak and the tests, written with ``onnx.helper`` (no network, no weights)."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper


def string_models(folder) -> dict[str, str]:
    """Write small real string models (``onnx.helper``) into ``folder``; returns name -> path.

    * ``str_id1`` / ``str_id2`` / ``str_id3``: ``Identity`` on a STRING input ``s`` of rank 1 ``[N]``, 2 ``[N, 2]``
      and 3 ``[N, 2, 2]``; output ``o`` of the same shape.
    * ``str2f``: ``Cast`` STRING ``s`` ``[N, 2]`` -> FLOAT ``o`` (ONNX Runtime parses the text as a number).
    * ``f2str``: ``Cast`` FLOAT ``x`` ``[N, 2]`` -> STRING ``o``.
    """
    def save(name: str, op: str, in_type: int, out_type: int, dims: list, in_name: str = "s", **attrs) -> str:
        graph = helper.make_graph(
            [helper.make_node(op, [in_name], ["o"], **attrs)], name,
            [helper.make_tensor_value_info(in_name, in_type, ["N", *dims])],
            [helper.make_tensor_value_info("o", out_type, ["N", *dims])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests")
        model.ir_version = 8
        onnx.checker.check_model(model)
        path = Path(folder) / f"{name}.onnx"
        onnx.save(model, str(path))
        return str(path)

    S, F = TensorProto.STRING, TensorProto.FLOAT
    return {
        "str_id1": save("str_id1", "Identity", S, S, []),
        "str_id2": save("str_id2", "Identity", S, S, [2]),
        "str_id3": save("str_id3", "Identity", S, S, [2, 2]),
        "str2f": save("str2f", "Cast", S, F, [2], to=F),
        "f2str": save("f2str", "Cast", F, S, [2], in_name="x", to=S),
    }
