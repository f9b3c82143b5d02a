"""Pure tests of the KServe v2 codec (JSON and binary tensor extension)."""

from __future__ import annotations

import base64
import re
import struct

import numpy as np
import orjson
import pytest

from batcher.codec import (
    InferRequest,
    InferResponse,
    RequestedOutput,
    decode_bytes_elements,
    decode_request,
    decode_shm_register,
    encode_bytes_elements,
    encode_response,
)
from batcher.errors import InvalidInput
from batcher.protocol import ShmInput, ShmRef
from bench.sweep.requests import HEADER_LENGTH, build_request


def _binary(inputs: list[tuple[dict, bytes]], **extra) -> tuple[bytes, str]:
    """A binary-extension body written by hand: JSON and binary inputs mixed, or sizes that do not add up (well-formed
    requests come from the load toolkit's builder, as in test_binary_tensors_round_trip)."""
    head = orjson.dumps({"inputs": [t for t, _ in inputs], **extra})
    return head + b"".join(b for _, b in inputs), str(len(head))


@pytest.mark.parametrize(
    "datatype,data,expected",
    [
        ("FP32", [[1, 2.5], [3, 4]], np.array([[1, 2.5], [3, 4]], np.float32)),
        ("FP32", [1, 2.5, 3, 4], np.array([[1, 2.5], [3, 4]], np.float32)),
        ("INT64", [1, -2, 3, 4], np.array([[1, -2], [3, 4]], np.int64)),
        ("BOOL", [True, False, False, True], np.array([[True, False], [False, True]])),
        ("FP16", [0.5, 1, 2, 3], np.array([[0.5, 1], [2, 3]], np.float16)),
        ("UINT8", [0, 255, 1, 2], np.array([[0, 255], [1, 2]], np.uint8)),
        ("INT8", [-128, 127, 0, 1], np.array([[-128, 127], [0, 1]], np.int8)),
        ("INT32", [1, 2, 3, 4], np.array([[1, 2], [3, 4]], np.int32)),
        ("FP64", [1, 2, 3, 4.25], np.array([[1, 2], [3, 4.25]], np.float64)),
    ],
)
def test_json_tensors_flat_and_nested(datatype, data, expected):
    body = orjson.dumps({"inputs": [{"name": "a", "datatype": datatype, "shape": [2, 2], "data": data}]})
    req = decode_request(body)
    got = req.inputs["a"]
    assert got.dtype == expected.dtype and got.shape == (2, 2)
    np.testing.assert_array_equal(got, expected)


def test_bytes_tensor_json_and_binary():
    s = np.array([["héllo".encode(), b""]], dtype=object)
    for binary in (False, True):
        body, headers = build_request([("s", "BYTES", s)], binary=binary)
        got = decode_request(body, headers.get(HEADER_LENGTH)).inputs["s"]
        assert got.dtype == object and got.tolist() == [["héllo".encode(), b""]]


@pytest.mark.parametrize("datatype,dtype", [("FP32", "<f4"), ("INT64", "<i8"), ("FP16", "<f2"), ("UINT8", "u1"),
                                            ("BOOL", "?"), ("FP64", "<f8"), ("INT8", "i1"), ("INT32", "<i4")])
def test_binary_tensors_round_trip(datatype, dtype):
    arr = (np.arange(24) % 2 if datatype == "BOOL" else np.arange(24)).astype(dtype).reshape(2, 3, 4)
    body, headers = build_request([("a", datatype, arr)])
    got = decode_request(body, headers[HEADER_LENGTH]).inputs["a"]
    np.testing.assert_array_equal(got, arr)
    assert got.dtype == arr.dtype


def test_binary_bytes_and_mixed_inputs_in_order():
    s = np.array([b"ab", b"", b"xyz"], dtype=object)
    f = np.arange(3, dtype=np.float32)
    raw_s = encode_bytes_elements(s)
    assert raw_s == struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0) + struct.pack("<I", 3) + b"xyz"
    body, n = _binary([
        ({"name": "s", "datatype": "BYTES", "shape": [3], "parameters": {"binary_data_size": len(raw_s)}}, raw_s),
        ({"name": "j", "datatype": "FP32", "shape": [1], "data": [7]}, b""),
        ({"name": "f", "datatype": "FP32", "shape": [3], "parameters": {"binary_data_size": 12}}, f.tobytes()),
    ])
    req = decode_request(body, n)
    assert req.inputs["s"].tolist() == [b"ab", b"", b"xyz"]
    np.testing.assert_array_equal(req.inputs["f"], f)
    np.testing.assert_array_equal(req.inputs["j"], [7])


@pytest.mark.parametrize(
    "raw,count,fragment",
    [
        (b"\x05\x00\x00\x00ab", 1, "runs past the end"),
        (b"\x00\x00\x00\x00\x01\x00", 1, "truncated BYTES length prefix"),
        (b"\x01\x00\x00\x00a\x01\x00\x00\x00b", 1, "more than the 1 BYTES elements"),
        (b"\x04\x00\x00\x00abcd", 2, "declares 2 BYTES elements, binary data holds 1"),
        (b"\x04\x00\x00\x00abcd", 10**9, "8 bytes cannot hold them"),  # rejected before allocating
    ],
)
def test_bad_bytes_length_prefixes(raw, count, fragment):
    with pytest.raises(InvalidInput, match=fragment):
        decode_bytes_elements(raw, count, "input 's'")


@pytest.mark.parametrize(
    "doc,fragment",
    [
        ({"inputs": [{"name": "a", "datatype": "INT8", "shape": [1], "data": [300]}]}, "out of range for INT8"),
        ({"inputs": [{"name": "a", "datatype": "INT32", "shape": [1], "data": [1.5]}]}, "INT32 expects integers"),
        ({"inputs": [{"name": "a", "datatype": "BOOL", "shape": [1], "data": [1]}]}, "BOOL expects true/false"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [2], "data": [[1], [2, 3]]}]}, "ragged"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [-1], "data": [1]}]}, "integers from 0 to"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [0, 2**40], "data": []}]}, "integers from 0 to"),
        ({"inputs": [{"name": "a", "datatype": "BYTES", "shape": [10**9], "data": ["x"]}]}, "over the limit of"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1e39]}]}, "value 1e.39 is out of range for FP32"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
          "outputs": [{"name": "o"}, {"name": "o"}]}, "output 'o' is requested twice"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1]}]}, "needs data or"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": 1}]}, "expected a list"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}] * 2}, "given twice"),
        ({"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}, "name: expected a string"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
          "parameters": {"timeout": "soon"}}, "timeout: expected a non-negative integer"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
          "outputs": [{"name": "o", "parameters": {"classification": 3}}]}, "classification: not supported"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}], "id": 5}, "id: expected a string"),
    ],
)
def test_bad_json_requests(doc, fragment):
    with pytest.raises(InvalidInput, match=fragment):
        decode_request(orjson.dumps(doc))


def test_timeout_zero_means_the_model_default():
    body = orjson.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
                         "parameters": {"timeout": 0}})
    assert decode_request(body).timeout_us is None


def test_binary_bytes_left_over_are_rejected():
    body, n = _binary([({"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}, b"\0\0\0\0")])
    with pytest.raises(InvalidInput, match="4 bytes sent, inputs declare 0"):
        decode_request(body, n)


def test_request_parameters():
    body = orjson.dumps({"id": "r1", "inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
                         "outputs": [{"name": "o", "parameters": {"binary_data": True}}, {"name": "p"}],
                         "parameters": {"timeout": 5000, "binary_data_output": False}})
    req = decode_request(body)
    assert req.id == "r1" and req.timeout_us == 5000 and req.binary_output is False
    assert req.outputs == [RequestedOutput("o", True), RequestedOutput("p", None)]


def test_encode_json_and_binary_outputs():
    outputs = {"o": np.array([[1.5, np.nan]], np.float32), "p": np.array([[1, 2]], np.int64)}
    req = InferRequest(inputs={}, id="r1", outputs=[RequestedOutput("o", True), RequestedOutput("p")])
    body, n = encode_response(InferResponse("m", "1", outputs, req))
    head = orjson.loads(body[:n])
    assert head == {"model_name": "m", "model_version": "1", "id": "r1", "outputs": [
        {"name": "o", "datatype": "FP32", "shape": [1, 2], "parameters": {"binary_data_size": 8}},
        {"name": "p", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]},
    ]}
    got = np.frombuffer(body[n:], np.float32)
    assert got[0] == 1.5 and np.isnan(got[1])


def test_encode_json_non_finite_is_null_and_valid_json():
    req = InferRequest(inputs={})
    body, n = encode_response(InferResponse("m", "1", {"o": np.array([np.inf, -np.inf, np.nan, 2], np.float32)}, req))
    assert n is None
    assert orjson.loads(body)["outputs"][0]["data"] == [None, None, None, 2.0]


def test_encode_bytes_output_json_and_binary():
    arr = np.array([b"ab", b"c"], dtype=object)
    body, n = encode_response(InferResponse("m", "1", {"s": arr}, InferRequest(inputs={})))
    assert orjson.loads(body)["outputs"][0] == {"name": "s", "datatype": "BYTES", "shape": [2], "data": ["ab", "c"]}
    body, n = encode_response(InferResponse("m", "1", {"s": arr}, InferRequest(inputs={}, binary_output=True)))
    assert decode_bytes_elements(body[n:], 2, "s").tolist() == [b"ab", b"c"]


def test_tensor_element_limit():
    body = orjson.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [10, 10], "data": [0] * 100}]})
    assert decode_request(body, None, 100).inputs["a"].shape == (10, 10)
    with pytest.raises(InvalidInput, match=r"\[10, 11\] holds 110 elements, over the limit of 100"):
        decode_request(orjson.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [10, 11],
                                                 "data": [0] * 110}]}), None, 100)


# ---------------------------------------------------------------------------- shared-memory parameters


def _shm_input(**params) -> bytes:
    return orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3], "parameters": params}]})


def test_shm_input_and_output_parameters_decode_to_refs():
    body = orjson.dumps({
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3],
                    "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 24,
                                   "shared_memory_offset": 8}},
                   {"name": "s", "datatype": "BYTES", "shape": [1],
                    "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 9}}],
        "outputs": [{"name": "y", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 24,
                                                 "binary_data": False}},
                    {"name": "z", "parameters": {"binary_data": True}}]})
    req = decode_request(body)
    assert req.inputs["x"] == ShmInput("FP32", (2, 3), ShmRef("in", 8, 24))
    assert req.inputs["s"] == ShmInput("BYTES", (1,), ShmRef("in", 0, 9))  # BYTES: size not derivable from shape
    assert req.outputs == [RequestedOutput("y", False, ShmRef("out", 0, 24)), RequestedOutput("z", True, None)]


@pytest.mark.parametrize("params,message", [
    ({"shared_memory_region": "r"}, "shared_memory_region needs shared_memory_byte_size"),
    ({"shared_memory_byte_size": 24}, "need shared_memory_region"),
    ({"shared_memory_offset": 0}, "need shared_memory_region"),
    ({"shared_memory_region": "r", "shared_memory_byte_size": 20}, "shape [2, 3] of FP32 needs 24 bytes, got 20"),
    ({"shared_memory_region": "r", "shared_memory_byte_size": -24}, "expected a non-negative integer"),
    ({"shared_memory_region": "r", "shared_memory_byte_size": 24, "shared_memory_offset": "8"},
     "shared_memory_offset: expected a non-negative integer"),
    ({"shared_memory_region": 7, "shared_memory_byte_size": 24}, "expected a region name, got 7"),
    ({"shared_memory_region": "r", "shared_memory_byte_size": 24, "binary_data_size": 24},
     "set only one of data, parameters.binary_data_size and parameters.shared_memory_region"),
])
def test_bad_shm_input_parameters_are_400(params, message):
    with pytest.raises(InvalidInput, match=re.escape(message)):
        decode_request(_shm_input(**params))


def test_shm_input_with_data_is_400():
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0],
                                     "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4}}]})
    with pytest.raises(InvalidInput, match="set only one of data"):
        decode_request(body)


def test_shm_output_with_binary_data_true_is_400():
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}],
                         "outputs": [{"name": "y", "parameters": {"shared_memory_region": "r",
                                                                  "shared_memory_byte_size": 4, "binary_data": True}}]})
    with pytest.raises(InvalidInput, match="shared_memory_region and binary_data true cannot be combined"):
        decode_request(body)


def test_shm_output_is_encoded_without_data_and_other_outputs_keep_theirs():
    req = InferRequest({}, outputs=[RequestedOutput("y", None, ShmRef("out", 16, 64)),
                                    RequestedOutput("z", True)], id="7")
    outputs = {"y": np.ones((2, 3), np.float32), "z": np.arange(3, dtype=np.int32)}
    body, json_length = encode_response(InferResponse("m", "1", outputs, req))
    doc = orjson.loads(body[:json_length])
    assert doc["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [2, 3],
         "parameters": {"shared_memory_region": "out", "shared_memory_offset": 16, "shared_memory_byte_size": 64}},
        {"name": "z", "datatype": "INT32", "shape": [3], "parameters": {"binary_data_size": 12}}]
    assert body[json_length:] == np.arange(3, dtype=np.int32).tobytes()  # y's bytes are not in the body


def test_shm_register_bodies():
    assert decode_shm_register("system", b'{"key": "/k", "byte_size": 64}') == {"key": "/k", "offset": 0,
                                                                               "byte_size": 64}
    handle = bytes(range(64))
    body = orjson.dumps({"raw_handle": {"b64": base64.b64encode(handle).decode()}, "device_id": 1, "byte_size": 8})
    assert decode_shm_register("cuda", body) == {"raw_handle": handle, "device_id": 1, "byte_size": 8}


@pytest.mark.parametrize("kind,body,message", [
    ("system", b"", "system shared memory register request is not valid JSON"),
    ("system", b"[]", "expected a JSON object, got list"),
    ("system", b'{"key": "/k"}', "byte_size is required"),
    ("system", b'{"key": 3, "byte_size": 8}', "key: expected the shared memory key (a string), got 3"),
    ("system", b'{"key": "/k", "byte_size": 8, "offset": -1}', "offset: expected a non-negative integer"),
    ("system", b'{"key": "/k", "byte_size": 8, "device_id": 0}', "unknown field(s) ['device_id']"),
    ("cuda", b'{"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 8}', "base64 of a 64-byte"),
    ("cuda", b'{"raw_handle": {"b64": "not base64!"}, "device_id": 0, "byte_size": 8}', "base64 of a 64-byte"),
    ("cuda", b'{"raw_handle": "x", "device_id": 0, "byte_size": 8}', "base64 of a 64-byte"),
    ("cuda", orjson.dumps({"raw_handle": {"b64": base64.b64encode(bytes(64)).decode()}, "byte_size": 8}),
     "device_id is required"),
])
def test_bad_shm_register_bodies_are_400(kind, body, message):
    with pytest.raises(InvalidInput, match=re.escape(message)):
        decode_shm_register(kind, body)
