"""KServe v2 requests: the one request builder (JSON and binary tensors, BYTES too) and response decoder of the
benches and the tests, the inputs a sweep sends (from the model metadata or the command line), and the HTTP
addresses and calls around them.

Datatypes come from :mod:`engines.datatypes` (the one KServe v2 <-> numpy table).
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from engines.datatypes import NUMPY_DTYPES, from_numpy

HEADER_LENGTH = "Inference-Header-Content-Length"  #: the binary tensor extension's header

Tensor = tuple[str, str, np.ndarray]  #: (input name, KServe v2 datatype, array)


# --------------------------------------------------------------------------------------------- the wire format


def _bytes_elements(a: np.ndarray) -> list[bytes]:
    return [x if isinstance(x, bytes) else str(x).encode() for x in np.asarray(a, dtype=object).reshape(-1)]


def build_request(tensors: Sequence[Tensor], *, binary: bool = True, binary_output: bool | None = None,
                  timeout_us: int | None = None, priority: int | None = None) -> tuple[bytes, dict[str, str]]:
    """A KServe v2 infer request body and its headers for ``(name, datatype, array)`` inputs.

    Binary (default): the binary tensor extension (``Inference-Header-Content-Length``; BYTES elements each with
    a 4-byte little-endian length); JSON: flat ``data`` lists (BYTES as UTF-8 strings). ``binary_output``
    (default: ``binary``) asks for binary outputs (``parameters.binary_data_output``); ``timeout_us`` and
    ``priority`` go into the request's ``parameters`` (Triton's meanings: microseconds, 1 = highest level).
    """
    params: dict = {}
    if timeout_us is not None:
        params["timeout"] = int(timeout_us)
    if priority is not None:
        params["priority"] = int(priority)
    if binary_output if binary_output is not None else binary:
        params["binary_data_output"] = True
    inputs, blobs = [], []
    for name, datatype, a in tensors:
        entry: dict = {"name": name, "datatype": datatype, "shape": list(np.shape(a))}
        if binary:
            if datatype == "BYTES":
                blob = b"".join(len(b).to_bytes(4, "little") + b for b in _bytes_elements(a))
            else:
                blob = np.ascontiguousarray(a, dtype=NUMPY_DTYPES[datatype]).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif datatype == "BYTES":
            entry["data"] = [b.decode("utf-8", "replace") for b in _bytes_elements(a)]
        else:
            entry["data"] = np.asarray(a, dtype=NUMPY_DTYPES[datatype]).reshape(-1).tolist()
        inputs.append(entry)
    head: dict = {"inputs": inputs}
    if params:
        head["parameters"] = params
    head_bytes = orjson.dumps(head)
    if not binary:
        return head_bytes, {"Content-Type": "application/json"}
    return head_bytes + b"".join(blobs), {HEADER_LENGTH: str(len(head_bytes)),
                                          "Content-Type": "application/octet-stream"}


def decode_response(body: bytes, headers: Mapping[str, str]) -> tuple[dict, dict[str, np.ndarray]]:
    """(the response's JSON, its outputs as arrays by name) from an infer response, JSON or binary.

    An error answer (``{"error": ...}``) gives its JSON and no outputs.
    """
    n = headers.get(HEADER_LENGTH)
    head = orjson.loads(body[:int(n)] if n is not None else body)
    arrays: dict[str, np.ndarray] = {}
    offset = int(n) if n is not None else 0
    for out in head.get("outputs") or []:
        datatype, shape = out["datatype"], out["shape"]
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is None:
            data = out["data"]
            a = (np.array([s.encode() for s in data], dtype=object) if datatype == "BYTES"
                 else np.asarray(data, dtype=NUMPY_DTYPES[datatype]))
        elif datatype == "BYTES":
            raw, elements, i = body[offset:offset + size], [], 0
            while i < len(raw):
                k = int.from_bytes(raw[i:i + 4], "little")
                elements.append(raw[i + 4:i + 4 + k])
                i += 4 + k
            a = np.array(elements, dtype=object)
        else:
            a = np.frombuffer(body[offset:offset + size], dtype=NUMPY_DTYPES[datatype])
        offset += size or 0
        arrays[out["name"]] = a.reshape(shape)
    return head, arrays


# ------------------------------------------------------------------------------------------------------ HTTP


def base_url(url: str) -> str:
    """The server's base URL, without a trailing slash: ``host:port`` -> ``http://host:port``; an ``http://`` or
    ``https://`` URL as it is.

    Raises:
        ValueError: empty; a URL of another scheme (``ftp://...``: KServe v2 speaks HTTP); no host
            (``http://``), or a ``/`` without a scheme (``http:/host:port``, ``//host:port``).
    """
    url = url.strip()
    if not url:
        raise ValueError("--url is empty: give host:port or http://host:port")
    if "://" not in url:
        if "/" in url.rstrip("/"):
            raise ValueError(f"--url {url}: expected host:port or http://host:port")
        return _checked(f"http://{url.rstrip('/')}", url)
    scheme, rest = url.split("://", 1)
    if scheme.lower() not in ("http", "https"):
        raise ValueError(f"--url {url}: a {scheme.lower()}:// URL; the KServe v2 HTTP protocol needs http:// or "
                         "https://")
    if not rest.rstrip("/") or rest.startswith("/"):
        raise ValueError(f"--url {url}: no host")
    return _checked(f"{scheme}://{rest.rstrip('/')}", url)


def _checked(base: str, given: str) -> str:
    """``base`` if it has a host, a port that is a number from 1 to 65535 (or none), and no query or fragment (the
    request paths are appended to it); else ValueError naming ``given``."""
    parts = urllib.parse.urlsplit(base)
    try:
        port = parts.port
    except ValueError:
        port = 0
    if not parts.hostname or port == 0 or parts.query or parts.fragment or base.endswith(("?", "#")):
        raise ValueError(f"--url {given}: expected host:port or http://host:port (a host, a port from 1 to 65535, "
                         "no query)")
    return base


def model_path(model: str, version: str | None = None) -> str:
    m = urllib.parse.quote(model, safe="")
    return f"/v2/models/{m}" + (f"/versions/{urllib.parse.quote(version, safe='')}" if version else "")


def infer_url(url: str, model: str, version: str | None = None) -> str:
    return base_url(url) + model_path(model, version) + "/infer"


def http_get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def post(url: str, body: bytes, headers: Mapping[str, str], timeout: float = 60.0
         ) -> tuple[int, dict[str, str], bytes]:
    """One blocking POST: (status, headers, body), error statuses included (never raises for them)."""
    req = urllib.request.Request(url, data=body, headers=dict(headers))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def infer(url: str, tensors: Sequence[Tensor], *, binary: bool = True, timeout: float = 60.0
          ) -> dict[str, np.ndarray]:
    """One request to an infer ``url``; the outputs by name.

    Raises:
        RuntimeError: the answer is not a 200 (the message holds the server's).
    """
    status, headers, body = post(url, *build_request(tensors, binary=binary), timeout=timeout)
    if status != 200:
        raise RuntimeError(f"POST {url}: HTTP {status}: {body[:500].decode(errors='replace')}")
    return decode_response(body, headers)[1]


# -------------------------------------------------------------------------------------------- what to send


def parse_shape(text: str) -> tuple[str | None, list[int]]:
    """``"1,3,224,224"``, ``"1x3x224x224"`` or ``"NAME:1,3,224,224"`` -> (name or None, dims)."""
    name = None
    if ":" in text:
        name, text = text.rsplit(":", 1)
    parts = [d.strip() for d in text.replace("x", ",").split(",")]
    if not parts or not all(d.isascii() and d.isdigit() for d in parts):  # "1,,3" or "1,3,x,224" is a typo
        raise ValueError(f"--shape: a shape is non-negative integers like 1,3,224,224 (got {text!r})")
    return name, [int(d) for d in parts]


@dataclass
class InputSpec:
    name: str
    datatype: str
    shape: list[int]
    data: np.ndarray | None = None  # from --input-file; generated otherwise


def datatype_of(a: np.ndarray) -> str:
    try:
        return from_numpy(a.dtype)
    except KeyError:
        raise ValueError(f"no KServe v2 datatype for numpy {a.dtype}") from None


def _fill(name: str, meta_shape: list[int], given: list[int] | None, batch_size: int) -> list[int]:
    dyn = [i for i, d in enumerate(meta_shape) if d < 0]
    if given is None:
        shape = list(meta_shape)
        if dyn and dyn[0] == 0:
            shape[0] = batch_size
        rest = [i for i, d in enumerate(shape) if d < 0]
        if rest:
            raise ValueError(f"input '{name}' has dynamic dims {meta_shape}: give its full shape with --shape "
                             f"(e.g. --shape {','.join(str(batch_size if d < 0 else d) for d in meta_shape)})")
        return shape
    if len(given) == len(meta_shape):
        fixed_mismatch = [i for i, d in enumerate(meta_shape) if d >= 0 and given[i] != d]
        if fixed_mismatch:
            print(f"warning: --shape {given} differs from the metadata of input '{name}' {meta_shape} at "
                  f"dims {fixed_mismatch}; sending {given}", file=sys.stderr)
        return list(given)
    if dyn and len(given) == len(dyn):
        shape = list(meta_shape)
        for i, v in zip(dyn, given):
            shape[i] = v
        return shape
    raise ValueError(f"--shape {given} fits neither input '{name}' {meta_shape} (give all {len(meta_shape)} "
                     f"dims) nor its {len(dyn)} dynamic dims")


def resolve_inputs(meta: dict | None, *, input_name: str | None = None, datatype: str | None = None,
                   shapes: dict[str | None, list[int]] | None = None, arrays: dict[str | None, np.ndarray] | None
                   = None, batch_size: int = 1) -> list[InputSpec]:
    """The tensors to send, from the model metadata (``GET /v2/models/{m}``; None if unavailable) and the
    command line.

    ``shapes``: ``--shape`` values by input name (None: every input without a named one); a full shape or just
    the values of the ``-1`` dims; without one, a leading ``-1`` becomes ``batch_size``. ``arrays``: sample
    tensors (``--input-file``) by input name (None: ``input_name`` or the first input), sent as they are.
    """
    shapes = dict(shapes or {})
    arrays = dict(arrays or {})
    if datatype is not None and datatype not in NUMPY_DTYPES:
        raise ValueError(f"--datatype must be one of {', '.join(NUMPY_DTYPES)} (got {datatype!r})")
    if meta is None or not meta.get("inputs"):
        if None in arrays and len(arrays) == 1 and input_name:
            a = arrays[None]
            return [InputSpec(input_name, datatype or datatype_of(a), list(a.shape), a)]
        if named := [k for k in arrays if k is not None]:
            return [InputSpec(k, datatype_of(arrays[k]), list(arrays[k].shape), arrays[k]) for k in named]
        given = shapes.get(input_name, shapes.get(None))
        if not (input_name and datatype and given):
            raise ValueError("no model metadata: give --input-name, --datatype and --shape (or --input-file)")
        return [InputSpec(input_name, datatype, list(given))]
    metas = meta["inputs"]
    names = [m["name"] for m in metas]
    for k in [input_name, *shapes, *arrays]:
        if k is not None and k not in names:
            raise ValueError(f"model '{meta.get('name', '?')}' has no input '{k}' (inputs: {', '.join(names)})")
    if None in arrays:
        arrays[input_name or names[0]] = arrays.pop(None)
    specs = []
    for m in metas:
        name = m["name"]
        if name in arrays:
            a = arrays[name]
            specs.append(InputSpec(name, datatype_of(a), list(a.shape), a))
            continue
        given = shapes.get(name, shapes.get(None))
        dt = datatype if datatype is not None and (input_name in (None, name)) else m["datatype"]
        specs.append(InputSpec(name, dt, _fill(name, [int(d) for d in m["shape"]], given, batch_size)))
    return specs


def make_tensor(spec: InputSpec, rng: np.random.Generator) -> np.ndarray:
    """The sample tensor for ``spec``: its data if given, else random values of its datatype and shape."""
    if spec.data is not None:
        return spec.data
    dt = NUMPY_DTYPES[spec.datatype]
    if spec.datatype == "BYTES":
        a = np.empty(spec.shape, dtype=object)
        a.fill(b"sample")
        return a
    if spec.datatype == "BOOL":
        return rng.random(spec.shape) < 0.5
    if dt.kind == "f":
        return rng.random(spec.shape, dtype=np.float32).astype(dt)
    return rng.integers(0, 10, size=spec.shape).astype(dt)
