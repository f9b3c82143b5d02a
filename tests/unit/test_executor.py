"""execute_batch: a batch the engine fails on is run again request by request, so only the request at fault fails."""

from __future__ import annotations

import numpy as np
from fakes import FakeContext, rows

from batcher.batching import Pending, shape_key
from batcher.errors import ExecutionFailed, InvalidInput
from batcher.executor import execute_batch
from engines.base import EngineError, EngineInputError


class PickyContext(FakeContext):
    """``y = 2 * x``, but a batch holding a row of -1 fails with ``error`` (as a string-parsing model fails on text
    it cannot parse)."""

    def __init__(self, error: type[EngineError]) -> None:
        super().__init__()
        self.error = error

    def execute(self, inputs):
        if (inputs["x"] == -1).any():
            self.batches.append(-inputs["x"].shape[0])
            raise self.error("cannot parse -1")
        return super().execute(inputs)


def _pending(value: float, n: int = 1) -> Pending:
    inputs = rows(n, value)
    return Pending(inputs, n, shape_key(inputs), arrival=0.0)


def test_one_bad_request_fails_alone_and_its_batch_mates_get_their_outputs():
    ctx = PickyContext(EngineInputError)
    batch = [_pending(1.0), _pending(-1.0), _pending(3.0, n=2)]
    result = execute_batch(ctx, batch, "m", None, now=lambda: 0.0)
    good0, bad, good2 = result.outcomes
    np.testing.assert_array_equal(good0["y"], np.full((1, 4), 2.0, np.float32))
    np.testing.assert_array_equal(good2["y"], np.full((2, 4), 6.0, np.float32))
    assert isinstance(bad, InvalidInput) and "cannot run on this request's input: cannot parse -1" in bad.message
    assert ctx.batches == [-4, 1, -1, 2]  # the batch, then each request alone
    assert result.rows == 4


def test_an_engine_failure_that_is_not_the_input_is_a_500_for_the_request_that_fails():
    ctx = PickyContext(EngineError)
    outcomes = execute_batch(ctx, [_pending(-1.0)], "m", None, now=lambda: 0.0).outcomes
    assert isinstance(outcomes[0], ExecutionFailed) and outcomes[0].status == 500
    assert ctx.batches == [-1]  # a batch of one is not run twice
