"""A tensor's JSON ``data`` -> a flat numpy array, by Triton's JSON literal rules (:data:`LITERAL_RULES`); pure.

Part of the KServe v2 codec (:mod:`batcher.codec` decodes requests with it and re-exports its public names; the
loader reads ``warmup_data`` with it). A fast path lets numpy discover the literals' types in one C loop; the exact
path checks every literal in Python numbers and names the first offending one as the client wrote it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson

from engines.datatypes import NUMPY_DTYPES

from .errors import InvalidInput


def _limits(datatype: str, dtype: np.dtype) -> tuple[str, int | float, int | float]:
    if datatype == "BOOL":
        return "bool", 0, 1
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return "int", int(info.min), int(info.max)
    top = float(np.finfo(dtype).max)
    return "number", -top, top


#: The JSON literal rules of every numeric datatype, one table for integer and float literals alike (after
#: Triton's JSON parser): ``kind`` says which literals it takes - ``bool``: true/false only; ``int``: integer
#: literals only (a float literal, 1.0 included, is refused: it need not be exact); ``number``: integer and float
#: literals - and ``lo``/``hi`` bound the value, inclusive (integers: the type's range, exactly, whatever the
#: literal's size; floats: the largest finite value, a literal that would round to infinity is out of range).
#: true/false are not numbers: 400 for every type but BOOL.
LITERAL_RULES: dict[str, tuple[str, int | float, int | float]] = {
    name: _limits(name, dt) for name, dt in NUMPY_DTYPES.items() if name != "BYTES"}

_KIND_WORD = {"bool": "true or false", "int": "integer literals", "number": "numbers"}


def json_literal(v: Any) -> str:
    """A JSON value as the client wrote it (near enough: floats in Python's shortest repr), for messages."""
    if isinstance(v, bool) or v is None:
        return {True: "true", False: "false", None: "null"}[v]
    if isinstance(v, (int, float)):
        return repr(v)
    try:
        text = orjson.dumps(v, default=str).decode()
    except (TypeError, orjson.JSONEncodeError):  # nested past orjson's 255 levels (it parses 1,024): not a 500
        text = ("[" if isinstance(v, list) else "{") * 40
    return text if len(text) <= 40 else text[:37] + "..."


def json_type(v: Any) -> str:
    """The JSON type of a parsed value, for messages: ``object``, ``array``, ``string``, ``number``, ``boolean`` or
    ``null`` (not Python's ``dict``, ``list``, ``NoneType``)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {dict: "object", list: "array", str: "string"}.get(type(v), type(v).__name__)


def _flat(data: list) -> list:
    """Row-major flattening of nested lists (leaves that are not lists kept as they are)."""
    if not any(type(v) is list for v in data):
        return data
    out: list = []
    for v in data:
        out.extend(_flat(v) if type(v) is list else [v])
    return out


#: the array kinds numpy's type discovery gives for the literals each rule takes
_DISCOVERED_KINDS = {"bool": "b", "int": "iu", "number": "iuf"}


def _fast_numbers(data: list, datatype: str, dtype: np.dtype, where: str) -> np.ndarray | None:
    """The fast path: numpy's own type discovery (one C loop), then range checks on the array; None where the
    exact path must decide (a literal of another kind, out of range, or beyond what numpy holds exactly).

    Raises:
        InvalidInput: ragged nesting.
    """
    try:
        arr = np.asarray(data)
    except ValueError as exc:
        raise InvalidInput(f"{where}: ragged nested list ({exc})") from None
    kind, lo, hi = LITERAL_RULES[datatype]
    if arr.dtype.kind not in _DISCOVERED_KINDS[kind] or (kind != "bool" and _hides_bool(data, arr)):
        return None
    if kind == "int" and arr.size and (arr.min() < lo or arr.max() > hi):
        return None
    with np.errstate(over="ignore"):
        out = arr.astype(dtype, copy=False).ravel()
    # JSON has no infinity: an inf after narrowing is a literal beyond the type's range
    if kind == "number" and dtype.itemsize < arr.dtype.itemsize and np.isinf(out).any():
        return None
    return out


def _hides_bool(data: list, arr: np.ndarray) -> bool:
    """Whether a true/false is among the numbers: numpy's discovery reads them as 1 and 0, so only the elements
    equal to 0 or 1 need a look at their type."""
    idx = np.flatnonzero((arr == 0) | (arr == 1))
    if not idx.size:
        return False
    flat = data if arr.ndim == 1 else np.asarray(data, dtype=object).ravel()
    return any(type(flat[i]) is bool for i in idx.tolist())


def _exact(flat: list, datatype: str, dtype: np.dtype, where: str) -> np.ndarray:
    """The slow, exact path: check each literal against :data:`LITERAL_RULES` in Python numbers, then convert.

    Raises:
        InvalidInput: naming the first offending element, as the client sent it.
    """
    kind, lo, hi = LITERAL_RULES[datatype]
    with np.errstate(over="ignore"):
        _check_literals(flat, datatype, dtype, where, kind, lo, hi)
    return np.array(flat, dtype=dtype)


def _check_literals(flat: list, datatype: str, dtype: np.dtype, where: str, kind: str, lo: float, hi: float) -> None:
    for i, v in enumerate(flat):
        t = type(v)
        ok = t is bool if kind == "bool" else t is int if kind == "int" else t is int or t is float
        if kind == "int" and t is float and v.is_integer() and abs(v) >= 2**63:
            # orjson reads an integer literal beyond 64 bits as a float
            raise InvalidInput(f"{where}[{i}]: an integer literal beyond 64 bits (read as {v!r}) is out of "
                               f"range for {datatype} ({lo} to {hi})")
        if not ok:
            raise InvalidInput(f"{where}[{i}]: {datatype} takes {_KIND_WORD[kind]}, got {json_literal(v)}")
        if kind != "bool":
            try:
                inside = lo <= v <= hi or (kind == "number" and not math.isinf(np.asarray(float(v), dtype)))
            except OverflowError:  # an integer literal beyond float64
                inside = False
            if not inside:
                raise InvalidInput(f"{where}[{i}]: {json_literal(v)} is out of range for {datatype} "
                                   f"({json_literal(lo)} to {json_literal(hi)})")


def json_tensor(data: Any, datatype: str, count: int, where: str) -> np.ndarray:
    """A tensor's JSON ``data`` (flat or nested lists) as a flat array of ``datatype``, by the rules of
    :data:`LITERAL_RULES` (BYTES: strings, encoded as UTF-8).

    Raises:
        InvalidInput: not a list, ragged nesting, a literal the datatype does not take or out of its range (the
            message names ``where[i]``, the data's path, and shows the literal), or not ``count`` elements.
    """
    dtype = NUMPY_DTYPES[datatype]
    if not isinstance(data, list):
        raise InvalidInput(f"{where}: expected an array, got {json_type(data)}")
    if datatype == "BYTES":
        try:
            flat = np.asarray(data, dtype=object).ravel()
        except ValueError as exc:
            raise InvalidInput(f"{where}: ragged nested list ({exc})") from None
        arr = np.empty(flat.size, dtype=object)
        for i, item in enumerate(flat):
            if not isinstance(item, str):
                raise InvalidInput(f"{where}[{i}]: BYTES elements must be strings, got {json_literal(item)}")
            arr[i] = item.encode()
    else:
        arr = _fast_numbers(data, datatype, dtype, where)
        if arr is None:  # a literal of the wrong kind or out of range: the exact path names it
            arr = _exact(_flat(data), datatype, dtype, where)
    if arr.size != count:
        raise InvalidInput(f"{where}: shape holds {count} elements, data has {arr.size}")
    return arr
