"""The plan cache's key and the INT8 calibration data it covers."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .options import CACHE_FORMAT, BuildError, BuildOptions, Shape

# --------------------------------------------------------------------------- cache key


def _cc_text(compute_capability: str | Sequence[int]) -> str:
    if isinstance(compute_capability, str):
        return compute_capability
    return ".".join(str(int(x)) for x in compute_capability)


def cache_key(
    onnx_bytes: bytes,
    trt_version: str,
    compute_capability: str | Sequence[int],
    options: BuildOptions,
    *,
    calibration: str = "",
) -> str:
    """Hex sha256 naming the plan built from these inputs (``<cache_dir>/<key>.plan``).

    Covers: the sha256 of the ONNX bytes, the TensorRT version string, the compute capability (``"9.0"`` or
    ``(9, 0)``), precision, every profile's shapes (order of profiles matters: context k gets profile k % n; order
    of inputs within a profile does not), workspace, version/hardware compatibility, and ``calibration`` (a digest
    of the INT8 calibration data, :func:`calibration_digest`; ignored unless precision is int8). Not covered: the
    timing cache (it changes build time, not correctness).
    """
    payload = {
        "format": CACHE_FORMAT,
        "onnx_sha256": hashlib.sha256(onnx_bytes).hexdigest(),
        "tensorrt": str(trt_version),
        "compute_capability": _cc_text(compute_capability),
        "precision": options.precision,
        "profiles": [
            {name: [list(s) for s in triple] for name, triple in sorted(profile.items())}
            for profile in options.profiles
        ],
        "workspace_mb": options.workspace_mb,
        "version_compatible": bool(options.version_compatible),
        "hardware_compatibility": options.hardware_compatibility,
        "calibration": calibration if options.precision == "int8" else "",
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def calibration_digest(directory: Path) -> str:
    """sha256 over the names and contents of the ``.npy`` files in ``directory`` (sorted by name).

    Raises:
        BuildError: the directory cannot be read.
    """
    h = hashlib.sha256()
    try:
        for path in sorted(Path(directory).glob("*.npy")):
            h.update(path.name.encode() + b"\0")
            h.update(hashlib.sha256(path.read_bytes()).digest())
    except OSError as exc:
        raise BuildError(f"cannot read calibration data in {directory}: {exc}") from exc
    return h.hexdigest()


def load_calibration_batches(directory: Path, shape_min: Shape, shape_max: Shape, batch_size: int) -> list[np.ndarray]:
    """Calibration batches for a single-input model, from the ``.npy`` files of ``directory`` (sorted by name).

    Each file holds one sample (``ndim == len(shape_max) - 1``) or a batch of samples (``ndim ==
    len(shape_max)``); all samples are stacked and split into float32 batches of ``batch_size`` rows (a trailing
    partial batch is dropped). Every batch shape must lie within ``[shape_min, shape_max]`` (the calibration
    profile).

    Raises:
        BuildError: no ``.npy`` files, fewer samples than ``batch_size``, a sample of the wrong rank, or a batch
            shape outside the profile.
    """
    files = sorted(Path(directory).glob("*.npy"))
    if not files:
        raise BuildError(f"no .npy files in calibration_dir {directory}")
    rank = len(shape_max)
    samples = []
    for path in files:
        arr = np.load(path, allow_pickle=False)
        if arr.ndim == rank - 1:
            samples.append(arr[None])
        elif arr.ndim == rank:
            samples.append(arr)
        else:
            raise BuildError(f"{path}: shape {arr.shape} is neither one sample nor a batch for rank-{rank} input")
    try:
        data = np.concatenate(samples).astype(np.float32, copy=False)
    except ValueError as exc:
        raise BuildError(f"calibration samples in {directory} differ in shape: {exc}") from exc
    n = data.shape[0] // batch_size
    if n == 0:
        raise BuildError(f"{data.shape[0]} calibration samples in {directory}; need at least {batch_size}")
    batches = [np.ascontiguousarray(data[i * batch_size : (i + 1) * batch_size]) for i in range(n)]
    shape = batches[0].shape
    if len(shape) != rank or any(not (a <= s <= b) for s, a, b in zip(shape, shape_min, shape_max)):
        raise BuildError(f"calibration batch shape {list(shape)} is outside profile 0: {list(shape_min)}..{list(shape_max)}")
    return batches
