"""The KServe v2 inference request and response as the data plane sees them: named numpy tensors and the
request's options, independent of the wire format (:mod:`batcher.codec` reads and writes the HTTP forms).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class Lease:
    """Keeps a request's input buffers valid (e.g. a shared-memory slot that its front end writes the next request
    into once the lease ends) while anyone may read them.

    Starts with one holder (whoever made it); the scheduler holds it from queueing the request until its batch is
    done or it leaves the queue (a request answered 504 while its batch executes is still read by that batch).
    ``on_free`` runs once, when the last holder releases."""

    __slots__ = ("_holders", "_on_free")

    def __init__(self, on_free: Callable[[], None]) -> None:
        self._holders = 1
        self._on_free: Callable[[], None] | None = on_free

    @property
    def free(self) -> bool:
        return self._holders == 0

    def acquire(self) -> None:
        if self._holders == 0:
            raise RuntimeError("lease already ended")
        self._holders += 1

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0 and self._on_free is not None:
            on_free, self._on_free = self._on_free, None
            on_free()


@dataclass(frozen=True)
class ShmRef:
    """Where a tensor lies in a registered shared-memory region (Triton's ``shared_memory_region``,
    ``shared_memory_offset`` and ``shared_memory_byte_size`` parameters).

    Attributes:
        region: the name the region was registered under (system and CUDA regions share one namespace).
        offset: bytes from the start of the region (not of the underlying segment).
        byte_size: bytes the tensor may take there.
    """

    region: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class ShmInput:
    """An input whose data lies in shared memory; the data plane turns it into an array (:mod:`batcher.shm`)
    before validation. ``shape`` includes the batch dim; ``ref.byte_size`` was checked against it (non-BYTES)."""

    datatype: str
    shape: tuple[int, ...]
    ref: ShmRef


@dataclass(frozen=True)
class RequestedOutput:
    """An output the client asked for; ``binary`` is None when the client did not say; ``shm``: write it into
    that shared-memory place instead of the response body."""

    name: str
    binary: bool | None = None
    shm: ShmRef | None = None


@dataclass
class InferRequest:
    """A decoded inference request.

    Attributes:
        inputs: input name -> array; shape and dtype as the request declared (BYTES: object array of ``bytes``);
            a :class:`ShmInput` until the data plane resolves it.
        outputs: requested outputs in order; None means every output of the model.
        binary_output: the request-level ``binary_data_output`` default.
        timeout_us: Triton's ``parameters.timeout`` (microseconds), if given; 0 means "no timeout of its own"
            (the model's default timeout applies), as in Triton.
        priority: Triton's ``parameters.priority``: 1 is the highest level; None (or 0) means the model's default
            level.
        routing_key: the key of ``routing.strategy: hash`` (from the header or parameter it names), if any.
        lease: set when the inputs live in a buffer that is reused after the request (multi-process mode).
    """

    inputs: dict[str, np.ndarray | ShmInput]
    id: str | None = None
    outputs: list[RequestedOutput] | None = None
    binary_output: bool = False
    timeout_us: int | None = None
    priority: int | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    routing_key: str | None = None
    lease: Lease | None = None


@dataclass
class InferResponse:
    """One request's answer before encoding: the model that ran it and its rows of every output.

    Attributes:
        outputs: output name -> array (first dim: the request's rows); views into the batch's outputs.
        request: the request answered (its id, requested outputs and binary flags).
        deadline: event-loop time after which it must not be answered (None: no deadline).
    """

    model_name: str
    model_version: str
    outputs: dict[str, np.ndarray]
    request: InferRequest
    deadline: float | None = None
