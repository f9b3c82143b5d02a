"""Pure tests of the KServe v2 codec (JSON and binary tensor extension)."""

from __future__ import annotations

import base64
import json
import re
import struct

import numpy as np
import orjson
import pytest

from batcher import codec
from batcher.codec import (
    LITERAL_RULES,
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
from engines.datatypes import NUMPY_DTYPES


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
        ({"inputs": [{"name": "a", "datatype": "INT32", "shape": [1], "data": [1.5]}]}, "INT32 takes integer literals, got 1.5"),
        ({"inputs": [{"name": "a", "datatype": "BOOL", "shape": [1], "data": [1]}]}, "BOOL takes true or false, got 1"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [2], "data": [[1], [2, 3]]}]}, "ragged"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [-1], "data": [1]}]}, "integers from 0 to"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [0, 2**40], "data": []}]}, "integers from 0 to"),
        ({"inputs": [{"name": "a", "datatype": "BYTES", "shape": [10**9], "data": ["x"]}]}, "over the limit of"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1e39]}]}, "1e.39 is out of range for FP32"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
          "outputs": [{"name": "o"}, {"name": "o"}]}, "output 'o' is requested twice"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1]}]}, "needs data or"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": 1}]}, "expected an array"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}] * 2}, "given twice"),
        ({"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}, "name: expected a string"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
          "parameters": {"timeout": "soon"}}, "timeout: expected a non-negative integer"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
          "outputs": [{"name": "o", "parameters": {"classification": 3}}]}, "classification: not supported"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}], "id": 5}, "id: expected a string"),
        (None, "request body: expected a JSON object, got null"),  # JSON's type names, not Python's
        ({"inputs": [7]}, r"inputs\[0\]: expected an object, got number"),
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


def test_an_empty_outputs_list_asks_for_every_output_as_triton_answers_it():
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}], "outputs": []})
    req = decode_request(body, None)
    assert req.outputs is None
    outputs = {"o": np.array([[1.5]], np.float32), "p": np.array([[2]], np.int64)}
    head = orjson.loads(encode_response(InferResponse("m", "1", outputs, req))[0])
    assert [o["name"] for o in head["outputs"]] == ["o", "p"]


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
    ("system", b"[]", "expected a JSON object, got array"),
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


def _json_input(datatype: str, data_text: str, shape: list[int]) -> bytes:
    """A request with the data written as literal JSON text (exactly what a client sends, no re-serialisation)."""
    return ('{"inputs":[{"name":"a","datatype":"%s","shape":%s,"data":%s}]}' % (datatype, shape, data_text)).encode()


@pytest.mark.parametrize("datatype,text,shape,expected", [
    # issue 11: UINT64 >= 2**63 mixed with small values went through float64 and was refused
    ("UINT64", "[1, 9223372036854775808, 18446744073709551615]", [3], [1, 2**63, 2**64 - 1]),
    ("UINT64", "[[0, 18446744073709551614], [3, 9223372036854775809]]", [2, 2], [[0, 2**64 - 2], [3, 2**63 + 1]]),
    ("INT64", "[-9223372036854775808, 9223372036854775807, 0]", [3], [-2**63, 2**63 - 1, 0]),
    ("INT8", "[-128, 127]", [2], [-128, 127]),
    ("FP16", "[65504, -65504.0, 65519, 0.5]", [4], [65504.0, -65504.0, 65504.0, 0.5]),  # 65519 rounds to 65504
    ("FP32", "[3.4028235e38, 1, 2.5]", [3], [np.finfo(np.float32).max, 1.0, 2.5]),
    ("FP64", "[18446744073709551615, 0.5]", [2], [float(2**64 - 1), 0.5]),
    ("BOOL", "[true, false]", [2], [True, False]),
])
def test_every_datatype_takes_every_in_range_literal_exactly(datatype, text, shape, expected):
    got = decode_request(_json_input(datatype, text, shape)).inputs["a"]
    assert got.dtype == NUMPY_DTYPES[datatype] and got.shape == tuple(shape)
    assert got.tolist() == expected


@pytest.mark.parametrize("datatype,text,message", [
    # one rule for integer and float literals: 70000 became inf while 70000.0 was refused
    ("FP16", "[1, 70000]", "input 'a'.data[1]: 70000 is out of range for FP16 (-65504.0 to 65504.0)"),
    ("FP16", "[70000.0]", "input 'a'.data[0]: 70000.0 is out of range for FP16 (-65504.0 to 65504.0)"),
    ("FP32", "[3.5e38]", "input 'a'.data[0]: 3.5e+38 is out of range for FP32"),
    ("INT64", "[9223372036854775808]",
     "input 'a'.data[0]: 9223372036854775808 is out of range for INT64 (-9223372036854775808 to 9223372036854775807)"),
    ("UINT64", "[5, -1]", "input 'a'.data[1]: -1 is out of range for UINT64 (0 to 18446744073709551615)"),
    ("UINT64", "[-1, 9223372036854775808]", "input 'a'.data[0]: -1 is out of range for UINT64"),
    ("UINT64", "[18446744073709551616]", "data[0]: an integer literal beyond 64 bits (read as 1.8446744073709552e+19) "
                                         "is out of range for UINT64 (0 to 18446744073709551615)"),
    ("INT8", "[[1, 2], [3, 400]]", "input 'a'.data[3]: 400 is out of range for INT8 (-128 to 127)"),
    # true/false are BOOL's only; numbers are not BOOL
    ("FP32", "[1.5, true]", "input 'a'.data[1]: FP32 takes numbers, got true"),
    ("INT64", "[true, 2]", "input 'a'.data[0]: INT64 takes integer literals, got true"),
    ("FP32", "[false]", "input 'a'.data[0]: FP32 takes numbers, got false"),
    ("BOOL", "[true, 1]", "input 'a'.data[1]: BOOL takes true or false, got 1"),
    ("INT32", "[1.0]", "input 'a'.data[0]: INT32 takes integer literals, got 1.0"),
    # messages show JSON, never numpy reprs such as np.float64(...) or np.str_('a')
    ("INT8", '[1, "a"]', "input 'a'.data[1]: INT8 takes integer literals, got \"a\""),
    ("FP32", "[null]", "input 'a'.data[0]: FP32 takes numbers, got null"),
    ("UINT8", '[{"x": 1}]', "input 'a'.data[0]: UINT8 takes integer literals, got {\"x\":1}"),
])
def test_literal_rules_and_messages_show_the_literal_as_sent(datatype, text, message):
    n = text.count(",") + 1
    with pytest.raises(InvalidInput) as exc:
        decode_request(_json_input(datatype, text, [n]))
    assert message in exc.value.message
    assert "np." not in exc.value.message


def test_literal_rules_are_one_table_for_every_numeric_datatype():
    assert set(LITERAL_RULES) == set(NUMPY_DTYPES) - {"BYTES"}
    assert LITERAL_RULES["BOOL"][0] == "bool"
    for name, (kind, lo, hi) in LITERAL_RULES.items():
        dt = NUMPY_DTYPES[name]
        if dt.kind in "iu":
            assert (kind, lo, hi) == ("int", int(np.iinfo(dt).min), int(np.iinfo(dt).max))
        elif dt.kind == "f":
            assert (kind, lo, hi) == ("number", -float(np.finfo(dt).max), float(np.finfo(dt).max))


def test_a_shape_of_more_than_64_dimensions_is_a_400():
    body = orjson.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1] * 65, "data": [1.0]}]})
    with pytest.raises(InvalidInput, match="65 dimensions, more than the 64"):
        decode_request(body)
    ok = orjson.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1] * 64, "data": [1.0]}]})
    assert decode_request(ok).inputs["a"].ndim == 64


def test_an_integer_parameter_beyond_64_bits_is_named_as_one():
    """The JSON parser turns integers beyond 64 bits into floats; the message says what the client sent (a fresh
    user read "got 1e+30" for a timeout of 10**30)."""
    body = b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}], ' \
           b'"parameters": {"timeout": 1000000000000000000000000000000}}'
    with pytest.raises(InvalidInput, match=r"timeout: expected a non-negative integer of at most 64 bits, got one "
                                           r"of about 1e\+30"):
        decode_request(body)
    with pytest.raises(InvalidInput, match=r"timeout: expected a non-negative integer, got 1.5$"):
        decode_request(body.replace(b"1000000000000000000000000000000", b"1.5"))


@pytest.mark.parametrize("length", [" 2", "+2", "2 ", "\u0662", "-0", "0x2"])
def test_the_header_length_is_ascii_digits_only(length):
    """int() would take " 2", "+2" and Arabic-Indic digits as 2: a header not of ASCII digits is a 400."""
    with pytest.raises(InvalidInput, match="Inference-Header-Content-Length: expected a decimal byte count"):
        decode_request(b"{}", length)


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("datatype", [["FP32"], {}, {"a": 1}, _nested(300)])
def test_a_datatype_that_is_not_a_string_is_400_not_500(datatype):
    """A new user's report: ``"datatype": ["FP32"]`` was a 500 (unhashable in the dtype lookup) with an ERROR line."""
    body = json.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": [1, 1], "data": [1]}]}).encode()
    with pytest.raises(InvalidInput, match=r"input 'x'\.datatype: expected one of BOOL"):
        decode_request(body)


def test_a_value_nested_past_orjsons_own_depth_in_an_error_message_is_400_not_500():
    """orjson parses 1,024 levels but writes 255: a message quoting a value 300 deep was a 500 (a new user's
    report); it quotes the start of it instead."""
    body = json.dumps({"id": _nested(300), "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1],
                                                        "data": [1]}]}).encode()  # orjson writes 255 levels
    with pytest.raises(InvalidInput, match=r"id: expected a string, got \[\[\[\["):
        decode_request(body)


def test_parameters_nested_deeper_than_max_parameter_depth_are_400():
    """They cross to an engine process pickled: 500 levels failed there and the request was never answered (a new
    user's report); refused in both modes alike. 32 levels pass."""
    from batcher.codec import MAX_PARAMETER_DEPTH

    x = {"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1]}
    ok = {"inputs": [x], "parameters": {"a": _nested(MAX_PARAMETER_DEPTH - 1)}}
    assert decode_request(json.dumps(ok).encode()).parameters["a"] == _nested(MAX_PARAMETER_DEPTH - 1)
    for doc, where in (({"inputs": [x], "parameters": {"a": _nested(500)}}, "request"),
                       ({"inputs": [x], "outputs": [{"name": "y", "parameters": {"b": {"c": _nested(40)}}}]},
                        r"outputs\[0\]")):
        with pytest.raises(InvalidInput, match=rf"^{where}\.parameters: objects and arrays nested deeper than 32"):
            decode_request(json.dumps(doc).encode())


# ---------------------------------------------------------------------------- a JSON part decoded once (_HeaderPlan)


def _two_inputs(a: np.ndarray, b: np.ndarray, **extra) -> tuple[bytes, str]:
    return _binary([({"name": "a", "datatype": "FP32", "shape": list(a.shape),
                      "parameters": {"binary_data_size": a.nbytes}}, a.tobytes()),
                    ({"name": "b", "datatype": "INT64", "shape": list(b.shape),
                      "parameters": {"binary_data_size": b.nbytes}}, b.tobytes())], **extra)


@pytest.fixture
def no_plans():
    codec._plans.clear()
    yield codec._plans
    codec._plans.clear()


def test_a_repeated_json_part_is_not_parsed_again_and_decodes_each_body_to_its_own_values(no_plans, monkeypatch):
    extra = {"outputs": [{"name": "y", "parameters": {"binary_data": True}}],
             "parameters": {"binary_data_output": False, "timeout": 7000, "priority": 2, "k": "v"}}
    first = _two_inputs(np.arange(6, dtype=np.float32).reshape(2, 3), np.array([[5], [6]], np.int64), **extra)
    full = decode_request(*first)
    assert len(no_plans) == 1
    # the next request with the same JSON part never reaches the parser
    monkeypatch.setattr(codec, "json_object", lambda *a: pytest.fail("the JSON part was parsed again"))
    a2, b2 = np.full((2, 3), 9.5, np.float32), np.array([[-1], [2**40]], np.int64)
    second = _two_inputs(a2, b2, **extra)
    assert second[0][:int(second[1])] == first[0][:int(first[1])]
    again = decode_request(*second)
    np.testing.assert_array_equal(again.inputs["a"], a2)
    np.testing.assert_array_equal(again.inputs["b"], b2)
    assert again.inputs["a"].dtype == np.float32 and again.inputs["b"].dtype == np.int64
    assert again.inputs["b"].shape == (2, 1)
    np.testing.assert_array_equal(full.inputs["a"], np.arange(6, dtype=np.float32).reshape(2, 3))  # not aliased
    for f in ("id", "outputs", "binary_output", "timeout_us", "priority", "parameters"):
        assert getattr(again, f) == getattr(full, f), f
    assert again.timeout_us == 7000 and again.priority == 2 and again.outputs == [RequestedOutput("y", True)]
    again.parameters["k"] = "changed"  # each request owns its parameters and outputs list
    again.outputs.append(RequestedOutput("z"))
    third = decode_request(*second)
    assert third.parameters["k"] == "v" and third.outputs == [RequestedOutput("y", True)]


def test_a_kept_json_part_with_binary_data_of_another_length_gets_the_same_400(no_plans):
    body, n = _two_inputs(np.zeros((2, 3), np.float32), np.zeros((2, 1), np.int64))
    decode_request(body, n)
    assert len(no_plans) == 1
    with pytest.raises(InvalidInput, match=r"binary data: 44 bytes sent, inputs declare 40"):
        decode_request(body + b"\0\0\0\0", n)
    with pytest.raises(InvalidInput, match=r"input 'b'.binary_data_size: 16 bytes at offset 24 run past the 36"):
        decode_request(body[:-4], n)


def test_a_kept_json_part_still_meets_a_lower_element_limit(no_plans):
    body, n = _two_inputs(np.zeros((2, 3), np.float32), np.zeros((2, 1), np.int64))
    decode_request(body, n)
    with pytest.raises(InvalidInput, match=r"\[2, 3\] holds 6 elements, over the limit of 5"):
        decode_request(body, n, 5)


@pytest.mark.parametrize("case", ["id", "bytes", "bool", "json data", "shm output"])
def test_json_parts_whose_decoding_depends_on_more_than_their_bytes_are_not_kept(no_plans, case):
    a = np.zeros((1, 2), np.float32)
    inputs = [({"name": "a", "datatype": "FP32", "shape": [1, 2], "parameters": {"binary_data_size": 8}},
               a.tobytes())]
    extra: dict = {}
    if case == "id":
        extra["id"] = "r1"
    elif case == "bytes":
        inputs.append(({"name": "s", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6}},
                       struct.pack("<I", 2) + b"hi"))
    elif case == "bool":
        inputs.append(({"name": "t", "datatype": "BOOL", "shape": [1], "parameters": {"binary_data_size": 1}},
                       b"\x01"))
    elif case == "json data":
        inputs.append(({"name": "j", "datatype": "FP32", "shape": [1], "data": [1.5]}, b""))
    else:
        extra["outputs"] = [{"name": "y", "parameters": {"shared_memory_region": "r",
                                                         "shared_memory_byte_size": 8}}]
    decode_request(*_binary(inputs, **extra))
    assert not no_plans
    if case == "bool":  # a BOOL byte that is not 0 or 1 is still found in the next request with the same JSON
        with pytest.raises(InvalidInput, match="BOOL bytes must be 0 or 1"):
            decode_request(*_binary(inputs[:1] + [(inputs[1][0], b"\x07")]))


def test_the_kept_json_parts_are_bounded(no_plans, monkeypatch):
    monkeypatch.setattr(codec, "HEADER_PLANS", 3)
    for i in range(1, 8):
        decode_request(*_binary([({"name": "a", "datatype": "FP32", "shape": [1, i],
                                   "parameters": {"binary_data_size": 4 * i}}, bytes(4 * i))]))
        assert 1 <= len(no_plans) <= 3
    big = {"name": "a", "datatype": "FP32", "shape": [1, 1], "parameters": {"binary_data_size": 4, "pad": "x" * 1100}}
    no_plans.clear()
    decode_request(*_binary([(big, bytes(4))]))
    assert not no_plans  # a JSON part over HEADER_PLAN_MAX_BYTES is decoded every time
