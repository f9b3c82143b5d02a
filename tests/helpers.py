"""Helpers for tests: in-process ONNX Runtime reference runs of zoo models."""

from __future__ import annotations

import functools

import numpy as np
import onnxruntime as ort

from engines.zoo import resolve


@functools.lru_cache(maxsize=None)
def reference_session(zoo_name: str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(resolve(f"zoo:{zoo_name}")), opts, providers=["CPUExecutionProvider"])


def reference(zoo_name: str, x: np.ndarray) -> np.ndarray:
    """The model's first output for ``x``, run in-process (one call, whatever the batch)."""
    sess = reference_session(zoo_name)
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]
