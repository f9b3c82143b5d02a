"""Property-based fuzzing of the HTTP API (hypothesis) against a real server, and the OpenAPI description."""

from __future__ import annotations

import http.client
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate

DATATYPES = ["BOOL", "UINT8", "INT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES", "FLOAT", "", None, 3]

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                         st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c,
                                                                                             max_size=4), max_leaves=12)
shapes = st.one_of(st.lists(st.integers(-3, 2**40), max_size=5), json_values)
tensors = st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["x", "input", ""]), json_scalars),
     "datatype": st.sampled_from(DATATYPES),
     "shape": shapes},
    optional={"data": json_values,
              "parameters": st.one_of(json_values, st.fixed_dictionaries({"binary_data_size": st.integers(-5, 2**40)}))},
)
bodies = st.one_of(
    st.fixed_dictionaries({"inputs": st.one_of(st.lists(tensors, max_size=3), json_values)},
                          optional={"outputs": json_values, "parameters": json_values, "id": json_values}),
    json_values,
)
headers = st.one_of(st.none(), st.sampled_from(["0", "-1", "abc", "99999999", "5"]), st.integers(0, 400).map(str))
models = st.sampled_from(["ppocr_cls", "tiny_cnn", "nope", "ppocr_cls/versions/1", "ppocr_cls/versions/x"])


def _post(port: int, path: str, body: bytes, header_length: str | None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    h = {"Content-Type": "application/json"}
    if header_length is not None:
        h["Inference-Header-Content-Length"] = header_length
    conn.request("POST", path, body=body, headers=h)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, data


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(model=models, body=bodies, trailer=st.binary(max_size=64), header_length=headers)
def test_no_5xx_for_malformed_requests_and_every_error_is_json(default_server, model, body, trailer, header_length):
    raw = json.dumps(body).encode()
    status, data = _post(default_server.port, f"/v2/models/{model}/infer", raw + trailer, header_length)
    assert status < 500 or status == 503, (status, data[:300])
    if status >= 400:
        assert isinstance(json.loads(data)["error"], str)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=300), header_length=headers)
def test_no_5xx_for_random_bytes(default_server, raw, header_length):
    status, data = _post(default_server.port, "/v2/models/ppocr_cls/infer", raw, header_length)
    assert status in (400, 404, 413), (status, data[:300])
    assert "error" in json.loads(data)


def test_server_stays_live_and_the_openapi_description_is_valid(default_server):
    conn = http.client.HTTPConnection("127.0.0.1", default_server.port, timeout=10)
    conn.request("GET", "/v2/health/live")
    live = conn.getresponse()
    live.read()
    assert live.status == 200
    conn.request("GET", "/v2/openapi.json")
    r = conn.getresponse()
    spec = json.loads(r.read())
    assert r.status == 200
    validate(spec)  # a valid OpenAPI 3 document
    assert "/v2/models/{model}/infer" in spec["paths"]


@pytest.mark.parametrize("datatype,data,expected", [("FP32", "NaN", 400), ("FP32", "Infinity", 400)])
def test_nan_and_infinity_literals_are_not_json(default_server, datatype, data, expected):
    """The documented rule: JSON has no NaN/Infinity, so such literals are a 400 (send them as binary tensors);
    non-finite outputs are written as null in JSON and bit-exact in binary."""
    body = ('{"inputs":[{"name":"x","datatype":"%s","shape":[1],"data":[%s]}]}' % (datatype, data)).encode()
    status, resp = _post(default_server.port, "/v2/models/ppocr_cls/infer", body, None)
    assert status == expected and "not valid JSON" in json.loads(resp)["error"]
