"""A served model's signature: its inputs (with the dims the config declares), outputs and maximum batch.

:meth:`ModelSignature.check` validates a decoded request against it before the request can reach a batch, so a
bad request is answered with 400 on its own and never fails the other requests of a batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from engines.base import Engine, TensorSpec
from engines.datatypes import NUMPY_DTYPES, from_numpy

from .batch_sizes import allowed_batch_sizes
from .config import ModelConfig
from .errors import ConfigError, InvalidInput

#: max_batch_size where neither the engine (no optimization profile) nor the config gives one.
DEFAULT_MAX_BATCH_SIZE = 8


def _fmt(dims: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


@dataclass(frozen=True)
class ModelSignature:
    """Inputs and outputs as served; shapes are full shapes with the batch dim first (``-1``)."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    #: the sizes every batch is padded up to, ascending, the last being ``max_batch_size``
    #: (:mod:`batcher.batch_sizes`); None: no padding.
    allowed_batch_sizes: tuple[int, ...] | None = None
    #: the backend carries BYTES as text (``Engine.bytes_as_text``): BYTES inputs must be UTF-8.
    bytes_as_text: bool = False
    #: input name -> what each dim of its full shape must be a multiple of (the config's ``dims_multiple_of``;
    #: 1 for the batch dim); inputs without one are absent
    multiples: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def batched(self) -> bool:
        """Whether inputs have a batch dimension (``max_batch_size >= 1``); without one (0, Triton's meaning)
        shapes are full shapes and each request executes alone."""
        return self.max_batch_size > 0

    @classmethod
    def build(cls, engine: Engine, cfg: ModelConfig, where: str) -> ModelSignature:
        """Combine the engine's tensors with the config's declared dims and max batch.

        A model is served without a batch dimension (``max_batch_size`` 0) when the config says 0, or says
        nothing and the engine's first dimension is fixed (an ONNX model exported for one shape).

        Args:
            where: the config path of the model (``models[3]``), for messages.

        Raises:
            ConfigError: the config asks for more rows than the engine's profile allows, for batching on a model
                whose first dimension is fixed, names an input the model lacks, declares dims that contradict the
                model's fixed dims or rank, or lists allowed batch sizes without the effective max_batch_size (or
                for a model without a batch dimension).
        """
        engine_max = engine.max_batch_size
        batched = cfg.max_batch_size != 0 and not (cfg.max_batch_size is None and engine_max == 0)
        if batched:
            for spec in engine.inputs:
                if not spec.shape:
                    raise ConfigError(f"{where}: input {spec.name!r} is a scalar; batching needs a batch dimension "
                                      "(max_batch_size: 0 serves the model without one)")
            if engine_max == 0:
                raise ConfigError(
                    f"{where}.max_batch_size: {cfg.max_batch_size}, but the model's first dimension is fixed "
                    f"({_fmt(engine.inputs[0].shape)}): it has no batch dimension; set max_batch_size: 0 to serve "
                    "it without batching, or export it with a dynamic first dimension")
        if cfg.max_batch_size is not None and engine_max is not None and cfg.max_batch_size > engine_max > 0:
            raise ConfigError(
                f"{where}.max_batch_size: {cfg.max_batch_size} exceeds the engine profile maximum {engine_max}"
            )
        max_batch = (cfg.max_batch_size or engine_max or DEFAULT_MAX_BATCH_SIZE) if batched else 0
        if not batched and cfg.allowed_batch_sizes is not None:
            raise ConfigError(f"{where}.allowed_batch_sizes: the model has no batch dimension (max_batch_size 0): "
                              "nothing is padded")
        try:
            allowed = allowed_batch_sizes(cfg, max_batch) if batched else None
        except ValueError as exc:
            unset = f" (max_batch_size is not set: {max_batch} is its default)" if cfg.max_batch_size is None else ""
            raise ConfigError(f"{where}.allowed_batch_sizes: {exc}{unset}") from None
        db = cfg.dynamic_batching
        if any(p > max_batch for p in db.preferred_batch_size):
            raise ConfigError(
                f"{where}.dynamic_batching.preferred_batch_size: {db.preferred_batch_size} exceed max_batch_size "
                f"{max_batch}" + ("" if batched else " (the model has no batch dimension)"))
        if not batched and db.max_queue_delay_microseconds:
            raise ConfigError(f"{where}.dynamic_batching.max_queue_delay_microseconds: the model has no batch "
                              "dimension (max_batch_size 0): each request executes alone, there is no window")
        skip = 1 if batched else 0  # the batch dim, which declared dims leave out
        declared = {i.name: i for i in cfg.inputs}
        names = [s.name for s in engine.inputs]
        for j, inp in enumerate(cfg.inputs):
            if inp.name not in names:
                raise ConfigError(f"{where}.inputs[{j}].name: model has no input {inp.name!r} (inputs: {names})")
        inputs = []
        multiples: dict[str, tuple[int, ...]] = {}
        for spec in engine.inputs:
            dims = spec.shape[skip:]
            d = declared.get(spec.name)
            if d is not None and d.dims is not None:
                j = cfg.inputs.index(d)
                besides = " besides the batch dim" if batched else " (no batch dim)"
                if len(d.dims) != len(dims):
                    raise ConfigError(
                        f"{where}.inputs[{j}].dims: {d.dims} has {len(d.dims)} dims, the model's input "
                        f"{spec.name!r} has {len(dims)}{besides} ({_fmt(dims)})"
                    )
                for k, (mine, theirs) in enumerate(zip(d.dims, dims)):
                    if theirs != -1 and mine != theirs:
                        raise ConfigError(
                            f"{where}.inputs[{j}].dims[{k}]: {mine} contradicts the model's fixed size {theirs}"
                        )
                dims = tuple(d.dims)
            if d is not None and d.dims_multiple_of is not None:
                j = cfg.inputs.index(d)
                if len(d.dims_multiple_of) != len(dims):
                    raise ConfigError(f"{where}.inputs[{j}].dims_multiple_of: {d.dims_multiple_of} has "
                                      f"{len(d.dims_multiple_of)} dims, the input has {len(dims)} ({_fmt(dims)})")
                for k, (size, m) in enumerate(zip(dims, d.dims_multiple_of)):
                    if size != -1 and size % m:
                        raise ConfigError(f"{where}.inputs[{j}].dims_multiple_of[{k}]: the input's fixed size "
                                          f"{size} is not a multiple of {m}")
                if any(m > 1 for m in d.dims_multiple_of):
                    multiples[spec.name] = (1, *d.dims_multiple_of) if batched else tuple(d.dims_multiple_of)
            inputs.append(TensorSpec(spec.name, spec.datatype, (-1, *dims) if batched else tuple(dims)))
        outputs = tuple(TensorSpec(o.name, o.datatype, (-1, *o.shape[1:]) if batched else tuple(o.shape))
                        for o in engine.outputs)
        return cls(tuple(inputs), outputs, max_batch, allowed, engine.bytes_as_text, multiples)

    def check(self, model: str, inputs: dict[str, np.ndarray]) -> int:
        """Validate a request's inputs; return its number of rows (its batch dim; 1 without a batch dim).

        Raises:
            InvalidInput: unknown or missing input, wrong datatype, rank or fixed dim, rows differ between
                inputs, zero rows, more rows than ``max_batch_size`` (never split silently), or, where the backend
                carries BYTES as text, a BYTES element that is not UTF-8.
        """
        if not self.batched:
            self._check_inputs(model, inputs, 0)
            return 1
        fixed = self._fixed_inputs
        if fixed is not None and len(inputs) == len(fixed):  # the common case in a few comparisons
            rows = -1
            for name, dtype, tail in fixed:
                arr = inputs.get(name)
                if type(arr) is not np.ndarray or arr.dtype != dtype or not arr.ndim or arr.shape[1:] != tail:
                    break
                if rows < 0:
                    rows = arr.shape[0]
                elif arr.shape[0] != rows:
                    break
            else:
                if 0 < rows <= self.max_batch_size:
                    return rows
        self._check_inputs(model, inputs, 1)
        rows = None
        for spec in self.inputs:
            n = inputs[spec.name].shape[0]
            if rows is None:
                rows = n
            elif n != rows:
                raise InvalidInput(f"input '{spec.name}': batch dim {n} differs from the other inputs' {rows}")
        if not rows:
            raise InvalidInput(f"model '{model}': the batch dimension must be at least 1, got 0")
        if rows > self.max_batch_size:
            raise InvalidInput(
                f"model '{model}': request of {rows} rows exceeds max_batch_size {self.max_batch_size}"
            )
        return rows

    @cached_property
    def _fixed_inputs(self) -> tuple[tuple[str, np.dtype, tuple[int, ...]], ...] | None:
        """``(name, dtype, dims past the batch dim)`` of every input when none is BYTES and all their dims past the
        batch dim are fixed (:meth:`check` then needs a few comparisons); None otherwise."""
        if not self.batched or any(s.datatype == "BYTES" or -1 in s.shape[1:] for s in self.inputs):
            return None
        return tuple((s.name, NUMPY_DTYPES[s.datatype], tuple(s.shape[1:])) for s in self.inputs)

    def _check_inputs(self, model: str, inputs: dict[str, np.ndarray], skip: int) -> None:
        """Names, datatypes, ranks, the fixed dims from dim ``skip`` on (1: past the batch dim), and UTF-8 BYTES
        where the backend carries them as text."""
        expected = [s.name for s in self.inputs]
        _require_known(inputs, expected, "input", model, "expected inputs")
        for spec in self.inputs:
            arr = inputs.get(spec.name)
            if arr is None:
                raise InvalidInput(f"missing input '{spec.name}' for model '{model}'; expected inputs: {expected}")
            if arr.dtype != NUMPY_DTYPES[spec.datatype]:
                raise InvalidInput(
                    f"input '{spec.name}': datatype {from_numpy(arr.dtype)} does not match the model's {spec.datatype}"
                )
            shape = arr.shape
            if len(shape) != len(spec.shape) or any(
                want != -1 and got != want for got, want in zip(shape[skip:], spec.shape[skip:])
            ):
                raise InvalidInput(
                    f"input '{spec.name}': shape {_fmt(shape)} does not match the model's {_fmt(spec.shape)}"
                )
            multiple = self.multiples.get(spec.name)
            if multiple is not None and any(got % m for got, m in zip(shape, multiple)):
                raise InvalidInput(
                    f"input '{spec.name}': shape {_fmt(shape)}: the model's dims {_fmt(spec.shape[skip:])} must be "
                    f"multiples of {_fmt(multiple[skip:])} (its config's dims_multiple_of)")
            if self.bytes_as_text and spec.datatype == "BYTES":
                _check_utf8(spec.name, arr)

    def check_outputs(self, model: str, names: Sequence[str]) -> None:
        """Raises InvalidInput when a requested output does not exist."""
        _require_known(names, [o.name for o in self.outputs], "output", model, "outputs")


def _require_known(names: Iterable[str], known: list[str], kind: str, model: str, listed: str) -> None:
    """Raises InvalidInput naming the first of ``names`` that is not one of the model's ``known`` tensors of
    ``kind`` (input, output) and listing them after ``listed``."""
    for name in names:
        if name not in known:
            raise InvalidInput(f"unknown {kind} '{name}' for model '{model}'; {listed}: {known}")


def _check_utf8(name: str, arr: np.ndarray) -> None:
    for i, b in enumerate(arr.ravel()):
        try:
            b.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(
                f"input '{name}': BYTES element {i} is not UTF-8 text ({exc.reason} at byte {exc.start}); this "
                "model's backend (ONNX Runtime) carries strings as UTF-8 text only") from None
