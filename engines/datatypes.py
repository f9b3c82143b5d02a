"""KServe v2 / Triton tensor datatypes and their numpy equivalents.

The names are the KServe v2 protocol's ("FP32", "INT64", "BYTES", ...), see
https://kserve.github.io/website/latest/modelserving/data_plane/v2_protocol/#tensor-data-types .
BYTES tensors are numpy ``object`` arrays whose elements are ``bytes``.
"""

from __future__ import annotations

import numpy as np

#: KServe v2 datatype -> numpy dtype (little-endian where it matters).
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}

_BY_KIND: dict[tuple[str, int], str] = {
    (dt.kind, dt.itemsize): name for name, dt in NUMPY_DTYPES.items() if name != "BYTES"
}

#: ONNX tensor type strings as reported by onnxruntime (``NodeArg.type``) -> KServe v2 datatype.
ONNX_TYPES: dict[str, str] = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


def to_numpy(datatype: str) -> np.dtype:
    """Return the numpy dtype of a KServe v2 ``datatype``.

    Raises:
        KeyError: ``datatype`` is not a KServe v2 datatype.
    """
    return NUMPY_DTYPES[datatype]


def from_numpy(dtype: np.dtype) -> str:
    """Return the KServe v2 datatype of a numpy dtype (``object``/``S``/``U`` -> ``BYTES``).

    Raises:
        KeyError: no KServe v2 datatype holds ``dtype`` (e.g. complex numbers).
    """
    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return "BYTES"
    return _BY_KIND[(dtype.kind, dtype.itemsize)]
