"""Optimization profiles and shapes: profile shapes of an engine, the largest batch, which profile a new context
takes, how many rows a batch launches with, and the checks a batch must pass before TensorRT sees it.

Shapes are tuples of ints, batch dimension first. A profile gives each input a ``(min, opt, max)`` shape triple
(``ICudaEngine.get_tensor_profile_shape``); a context runs only the profile it was given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base import EngineError, TensorSpec
from .api import TensorRTError, dims

Shape = tuple[int, ...]
ProfileShapes = tuple[Shape, Shape, Shape]  # (min, opt, max), as get_tensor_profile_shape returns them


def read_profile_shapes(cuda_engine: Any, spec: TensorSpec, profile: int) -> ProfileShapes:
    """``(min, opt, max)`` of input ``spec`` in optimization profile ``profile`` of ``cuda_engine``; a static input
    whose profile TensorRT leaves empty gets its own shape three times.

    Raises:
        TensorRTError: TensorRT returned something else than three shapes of the input's rank for a dynamic input.
    """
    triple = cuda_engine.get_tensor_profile_shape(spec.name, profile)
    shapes = tuple(dims(s) for s in triple)
    if len(shapes) == 3 and all(len(s) == len(spec.shape) and min(s, default=0) >= 0 for s in shapes):
        return shapes  # type: ignore[return-value]
    if -1 not in spec.shape:  # a static input: its only shape is its profile
        return spec.shape, spec.shape, spec.shape
    raise TensorRTError(f"get_tensor_profile_shape({spec.name!r}, {profile}) returned {shapes}")


def max_batch_from_profiles(profiles: Mapping[str, Sequence[ProfileShapes]]) -> int:
    """Largest batch every context accepts, whatever profile it got.

    Args:
        profiles: input name -> one ``(min, opt, max)`` shape triple per optimization profile, as
            ``ICudaEngine.get_tensor_profile_shape(name, p)`` returns them (batch dimension first).

    Returns:
        the smallest ``max[0]`` over all inputs and profiles (a context can run only its own profile, and every
        input of a batch has the same rows).

    Raises:
        EngineError: no inputs, an input with no profile, or a 0-d input (no batch dimension).
    """
    if not profiles:
        raise EngineError("engine has no inputs")
    maxima = []
    for name, triples in profiles.items():
        if not triples:
            raise EngineError(f"input {name!r} has no optimization profile")
        for _min, _opt, mx in triples:
            if len(mx) == 0:
                raise EngineError(f"input {name!r} is a scalar; the server needs a batch dimension first")
            maxima.append(int(mx[0]))
    return min(maxima)


def pick_profile(in_use: Sequence[int], num_profiles: int) -> int:
    """Profile for a new context: the one used by the fewest live contexts (``in_use`` lists their profiles),
    lowest index on ties. With no releases, the k-th context (from 0) gets ``k % num_profiles``.

    Raises:
        EngineError: ``num_profiles < 1``.
    """
    if num_profiles < 1:
        raise EngineError(f"engine reports {num_profiles} optimization profiles")
    counts = [0] * num_profiles
    for p in in_use:
        if 0 <= p < num_profiles:
            counts[p] += 1
    return counts.index(min(counts))


def check_profile_shape(name: str, shape: Sequence[int], profile: int, lo: Sequence[int], hi: Sequence[int]) -> None:
    """Check that ``shape`` lies within ``[lo, hi]`` (per dimension) of optimization profile ``profile``.

    Raises:
        EngineError: rank differs or some dimension is outside the profile; the message names the tensor, the
            shape and the profile's min and max.
    """
    shape, lo, hi = tuple(int(d) for d in shape), tuple(int(d) for d in lo), tuple(int(d) for d in hi)
    if len(shape) != len(lo) or any(not (a <= s <= b) for s, a, b in zip(shape, lo, hi)):
        raise EngineError(
            f"input {name!r} shape {list(shape)} is outside optimization profile {profile}: "
            f"min {list(lo)}, max {list(hi)}"
        )


def launch_rows(rows: int, min_batch: int, max_batch: int) -> int:
    """Rows to run for a batch of ``rows``: ``rows`` itself, or the profile's ``min_batch`` when smaller (the
    batch is then padded with zero rows and the outputs cut back).

    Raises:
        EngineError: ``rows < 1`` or ``rows > max_batch`` (the profile's maximum batch).
    """
    if rows < 1:
        raise EngineError(f"batch has {rows} rows; at least 1 is needed")
    if rows > max_batch:
        raise EngineError(f"batch of {rows} rows exceeds the optimization profile's maximum batch {max_batch}")
    return max(rows, min_batch)


def buffer_nbytes(shape: Sequence[int], dtype: np.dtype | type | str) -> int:
    """Bytes of a dense tensor of ``shape`` (every dim >= 0) and numpy ``dtype``; ``()`` is one element.

    Raises:
        EngineError: a dimension is negative (a dynamic ``-1`` that was never resolved).
    """
    n = 1
    for d in shape:
        d = int(d)
        if d < 0:
            raise EngineError(f"cannot size a buffer for shape {tuple(shape)}: dimension {d} is unresolved")
        n *= d
    return n * np.dtype(dtype).itemsize


def slice_rows(arr: np.ndarray, rows: int) -> np.ndarray:
    """An owned copy of the first ``rows`` rows (first dimension) of ``arr``.

    Raises:
        EngineError: ``arr`` is 0-d or has fewer than ``rows`` rows.
    """
    if arr.ndim == 0 or arr.shape[0] < rows:
        raise EngineError(f"output of shape {arr.shape} has fewer than {rows} rows")
    return np.array(arr[:rows], copy=True)


@dataclass(frozen=True)
class ProfileBounds:
    """What one optimization profile allows: per input its ``(min, max)`` shapes, and the batch range.

    Attributes:
        index: the profile's index in the engine.
        shapes: input name -> ``(min, max)`` shape of this profile.
        min_batch: the largest ``min[0]`` over the inputs (smaller batches are padded up to it).
        max_batch: the smallest ``max[0]`` over the inputs.
    """

    index: int
    shapes: dict[str, tuple[Shape, Shape]]
    min_batch: int
    max_batch: int

    @classmethod
    def of(cls, profiles: Mapping[str, Sequence[ProfileShapes]], index: int) -> ProfileBounds:
        """Bounds of profile ``index`` from the engine's ``input -> [(min, opt, max) per profile]``."""
        shapes = {name: (triples[index][0], triples[index][2]) for name, triples in profiles.items()}
        return cls(index, shapes, max(lo[0] for lo, _hi in shapes.values()), min(hi[0] for _lo, hi in shapes.values()))

    def launch_shapes(
        self, arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, np.dtype]
    ) -> tuple[int, dict[str, Shape]]:
        """Check a batch against this profile and give the shape each input launches with.

        Args:
            arrays: every input by name (exactly the profile's inputs), first dimension the batch's rows.
            dtypes: the engine's numpy dtype of each input.

        Returns:
            ``(rows, shapes)``: the batch's rows, and per input its shape with the rows padded up to
            :attr:`min_batch` (:func:`launch_rows`).

        Raises:
            EngineError: missing or unexpected inputs, inputs that disagree on the rows, rows outside
                ``[1, max_batch]``, a dtype other than the engine's, or a shape outside the profile (names the
                tensor, the shape and the profile's min/max).
        """
        expected = list(self.shapes)
        missing = [n for n in expected if n not in arrays]
        extra = [n for n in arrays if n not in self.shapes]
        if missing or extra:
            raise EngineError(f"inputs must be exactly {expected}; missing {missing}, unexpected {extra}")
        rows_seen = {n: (arrays[n].shape[0] if arrays[n].ndim else 0) for n in expected}
        rows = next(iter(rows_seen.values()))
        if len(set(rows_seen.values())) != 1:
            raise EngineError(f"inputs disagree on the batch size: {rows_seen}")
        launch = launch_rows(rows, self.min_batch, self.max_batch)
        shapes: dict[str, Shape] = {}
        for name in expected:
            arr = arrays[name]
            if arr.dtype != dtypes[name]:
                raise EngineError(f"input {name!r} has dtype {arr.dtype}, the engine needs {dtypes[name]}")
            shape = (launch,) + tuple(arr.shape[1:])
            check_profile_shape(name, shape, self.index, *self.shapes[name])
            shapes[name] = shape
        return rows, shapes
