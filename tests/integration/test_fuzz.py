"""Property-based fuzzing of the HTTP API (hypothesis) against real servers - bodies, headers, content codings, BYTES
tensors on real string models - and the OpenAPI description."""

from __future__ import annotations

import gzip
import http.client
import json
import zlib

import brotli

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


# ---------------------------------------------------------------------------------------------- headers, codings, BYTES
@pytest.fixture(scope="module")
def string_server(tmp_path_factory, cache_dir):
    """Real string models (identity on STRING [N], Cast STRING->FLOAT [N, 2]) and Cast FLOAT->STRING."""
    from helpers import string_models

    from bench.server import ServerProcess

    paths = string_models(tmp_path_factory.mktemp("fuzz-models"))
    config = {"models": [{"name": n, "path": paths[n], "max_batch_size": 8} for n in ("str_id1", "str2f", "f2str")]}
    with ServerProcess(config, tmp_path_factory.mktemp("fuzz-strings")) as server:
        yield server


def _send(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body=body, headers=headers)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, data


def _assert_json_error(status: int, data: bytes, framing: bool = False) -> None:
    """No 5xx; an error has a JSON body, except aiohttp's own 400 for a request it cannot parse (``framing``: a
    Transfer-Encoding it does not know breaks the message before any of the server's code runs)."""
    assert status < 500, (status, data[:300])
    if status >= 400 and not (framing and status == 400):
        assert isinstance(json.loads(data)["error"], str)


F2STR_BODY = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2]}]}).encode()
HEADER_NAMES = ["Content-Encoding", "Inference-Header-Content-Length", "Content-Type", "Accept-Encoding", "Expect",
                "Transfer-Encoding", "Authorization", "Connection", "X-Anything"]
header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
header_names = st.one_of(st.sampled_from(HEADER_NAMES),
                         st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz-ABC0123456789"), min_size=1, max_size=20))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(headers=st.dictionaries(header_names, header_values, max_size=6))
def test_no_5xx_for_any_request_headers(string_server, headers):
    headers = {k: v for k, v in headers.items() if k.lower() not in ("content-length", "host")}
    status, data = _send(string_server.port, "/v2/models/f2str/infer", F2STR_BODY, headers)
    _assert_json_error(status, data, framing=any(k.lower() == "transfer-encoding" for k in headers))


CODINGS = ["gzip", "x-gzip", "deflate", "br", "identity", "GZIP", "", "zstd", "compress", "gzip;q=1"]
ENCODERS = {"gzip": gzip.compress, "x-gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress,
            "identity": lambda b: b}


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(declared=st.lists(st.one_of(st.sampled_from(CODINGS), header_values), max_size=3),
       applied=st.lists(st.sampled_from(list(ENCODERS)), max_size=3),
       body=st.one_of(st.just(F2STR_BODY), st.binary(max_size=200)))
def test_no_5xx_for_content_codings(string_server, declared, applied, body):
    """Declared codings and the codings really applied, matching or not: 200, 400, 415 or 413, never a 5xx."""
    for coding in applied:
        body = ENCODERS[coding](body)
    status, data = _send(string_server.port, "/v2/models/f2str/infer", body,
                         {"Content-Encoding": ", ".join(declared)})
    _assert_json_error(status, data)
    assert status in (200, 400, 404, 413, 415)
    if status == 415:
        assert "is not supported" in json.loads(data)["error"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(elements=st.lists(st.binary(max_size=12), min_size=1, max_size=6))
def test_bytes_in_binary_come_back_exact_or_get_a_400(string_server, elements):
    raw = b"".join(len(e).to_bytes(4, "little") + e for e in elements)
    head = json.dumps({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [len(elements)],
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    status, data = _send(string_server.port, "/v2/models/str_id1/infer", head + raw,
                         {"Inference-Header-Content-Length": str(len(head))})
    _assert_json_error(status, data)
    try:
        text = [e.decode("utf-8") for e in elements]
    except UnicodeDecodeError:
        assert status == 400 and "is not UTF-8 text" in json.loads(data)["error"]
    else:
        assert status == 200 and json.loads(data)["outputs"][0]["data"] == text


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(model=st.sampled_from(["str_id1", "str2f"]), text=st.lists(st.text(max_size=10), min_size=2, max_size=2),
       datatype=st.sampled_from(["BYTES", "BYTES", "FP32", "BOOL"]))
def test_bytes_in_json_never_5xx_and_text_comes_back_exact(string_server, model, text, datatype):
    shape = [2] if model == "str_id1" else [1, 2]
    body = json.dumps({"inputs": [{"name": "s", "datatype": datatype, "shape": shape, "data": text}]}).encode()
    status, data = _send(string_server.port, f"/v2/models/{model}/infer", body, {})
    _assert_json_error(status, data)
    surrogates = any(0xD800 <= ord(c) <= 0xDFFF for t in text for c in t)
    if model == "str_id1" and datatype == "BYTES" and not surrogates:
        assert status == 200 and json.loads(data)["outputs"][0]["data"] == text


def test_the_fuzzed_servers_logged_no_error(string_server, default_server):
    for server in (string_server, default_server):
        log = server.log()
        assert " ERROR " not in log and "Traceback" not in log, log[-3000:]
