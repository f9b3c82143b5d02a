"""Allowed batch sizes (TF Serving's ``allowed_batch_sizes``): the default rule, checking an explicit list, and the
size a batch is padded to. Pure.

A GPU context prepares one executable per allowed size (a CUDA graph, a TensorRT profile shape); every batch is
padded up to the smallest allowed size that holds it (:func:`padded_size`) and its outputs are sliced back, so
padding rows never reach a client. The largest allowed size is ``max_batch_size``, so a full batch is never padded
and a batch never exceeds the largest allowed size.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ModelConfig


def check_allowed_batch_sizes(sizes: Sequence[int], max_batch_size: int | None) -> None:
    """An explicit list: ascending unique sizes in 1..max_batch_size, ``max_batch_size`` among them (None: not
    known before the model is open; the list's own rules only, so that ``check-config`` without ``--load`` catches
    them too).

    Raises:
        ValueError: naming the problem and the values.
    """
    sizes = list(sizes)
    if not sizes:
        raise ValueError("allowed_batch_sizes must not be empty (leave it out for the default)")
    if sizes[0] < 1:
        raise ValueError(f"allowed_batch_sizes must be >= 1, got {sizes}")
    if any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"allowed_batch_sizes must be sorted ascending without repeats, got {sizes}")
    if max_batch_size is None:
        return
    if sizes[-1] > max_batch_size:
        raise ValueError(f"allowed_batch_sizes {sizes} exceed max_batch_size {max_batch_size}")
    if sizes[-1] != max_batch_size:
        raise ValueError(f"allowed_batch_sizes {sizes} must contain max_batch_size {max_batch_size}")


def default_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The powers of two below ``max_batch_size``, then ``max_batch_size`` (32 -> 1, 2, 4, 8, 16, 32; 24 -> 1, 2,
    4, 8, 16, 24): the issue's GPU default; each batch pads by less than half its rows."""
    return (*(1 << k for k in range(max_batch_size.bit_length()) if 1 << k < max_batch_size), max_batch_size)


def allowed_batch_sizes(cfg: ModelConfig, max_batch_size: int) -> tuple[int, ...] | None:
    """The sizes batches of ``cfg`` are padded to, given its effective ``max_batch_size``: the explicit list, else
    on KIND_GPU :func:`default_batch_sizes`, else None (CPU: no padding unless configured; a model without a batch
    dimension, ``max_batch_size`` 0, on any device: each request runs alone at its own shape).

    Raises:
        ValueError: an explicit list that :func:`check_allowed_batch_sizes` rejects.
    """
    if cfg.allowed_batch_sizes is not None:
        check_allowed_batch_sizes(cfg.allowed_batch_sizes, max_batch_size)
        return tuple(cfg.allowed_batch_sizes)
    return default_batch_sizes(max_batch_size) if cfg.device == "cuda" and max_batch_size > 0 else None


def padded_size(rows: int, sizes: Sequence[int] | None) -> int:
    """The smallest allowed size >= ``rows`` (``rows`` itself when ``sizes`` is None or empty).

    Raises:
        ValueError: ``rows`` exceeds the largest allowed size (the batcher never forms such a batch).
    """
    if not sizes:
        return rows
    i = bisect.bisect_left(sizes, rows)
    if i == len(sizes):
        raise ValueError(f"a batch of {rows} rows exceeds the largest allowed batch size {sizes[-1]}")
    return sizes[i]
