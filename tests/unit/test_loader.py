"""Warm-up inputs: zeros, "0" for BYTES, or the config's inputs[].warmup_data repeated to fill the shape."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import model_config

from batcher.errors import ConfigError
from batcher.loader import WARMUP_TEXT, warmup_inputs
from batcher.signature import ModelSignature
from engines.base import TensorSpec


def _signature(*specs: TensorSpec) -> ModelSignature:
    return ModelSignature(specs, (TensorSpec("o", "FP32", (-1,)),), 8)


def test_defaults_are_zeros_and_text_a_string_parsing_model_accepts():
    sig = _signature(TensorSpec("x", "FP32", (-1, 2)), TensorSpec("s", "BYTES", (-1, -1)))
    got = warmup_inputs(sig, model_config(inputs=[{"name": "s", "warmup_dims": [3]}]), rows=2)
    np.testing.assert_array_equal(got["x"], np.zeros((2, 2), np.float32))
    assert got["s"].dtype == object and got["s"].shape == (2, 3)
    assert WARMUP_TEXT == b"0" and set(got["s"].ravel()) == {b"0"}  # not b"": Cast(STRING->FLOAT) fails on it


def test_warmup_data_is_repeated_row_major_to_fill_each_input():
    sig = _signature(TensorSpec("x", "INT64", (-1, 3)), TensorSpec("s", "BYTES", (-1,)))
    cfg = model_config(inputs=[{"name": "x", "warmup_data": [1, 2]}, {"name": "s", "warmup_data": ["2.5", "é"]}])
    got = warmup_inputs(sig, cfg, rows=2)
    assert got["x"].dtype == np.int64 and got["x"].tolist() == [[1, 2, 1], [2, 1, 2]]
    assert got["s"].tolist() == [b"2.5", "é".encode()]


@pytest.mark.parametrize("datatype,data,message", [
    ("FP32", ["a"], "model 'm': inputs[0].warmup_data[0]: FP32 takes numbers, got \"a\""),
    ("INT8", [1, 300], "model 'm': inputs[0].warmup_data[1]: 300 is out of range for INT8"),
    ("BYTES", [1], "model 'm': inputs[0].warmup_data[0]: BYTES elements must be strings, got 1"),
])
def test_warmup_data_the_input_does_not_take_is_a_config_error(datatype, data, message):
    sig = _signature(TensorSpec("x", datatype, (-1, 2)))
    with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        warmup_inputs(sig, model_config(inputs=[{"name": "x", "warmup_data": data}]))
