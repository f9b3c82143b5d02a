"""The server driven by schemathesis from the upstream Open Inference Protocol REST specification
(``tests/specs/open_inference_rest.yaml``, source named in its header): every generated request gets an answer that
is not a 5xx, and answers the specification describes conform to it (status codes it lists, JSON bodies of the
schemas it gives). A bounded number of examples per operation keeps it to seconds."""

from __future__ import annotations

from pathlib import Path

import requests
import schemathesis
from hypothesis import HealthCheck, given, settings

SPEC = Path(__file__).resolve().parents[1] / "specs" / "open_inference_rest.yaml"
#: generated cases per operation
EXAMPLES = 25


def test_open_inference_protocol_spec(default_server):
    """Every operation of the specification, ``EXAMPLES`` generated cases each (schemathesis's strategies through
    hypothesis; its pytest plugin does not run on this pytest)."""
    schema = schemathesis.openapi.from_path(SPEC)
    schema.config.update(base_url=default_server.base)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 6  # health live/ready, server metadata, model ready, model metadata, infer
    calls = []

    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def run(case):
            response = case.call(timeout=30)
            calls.append((case.method, case.path, response.status_code))
            assert response.status_code < 500 or response.status_code == 503, (case.path, response.text[:300])
            case.validate_response(response, checks=[schemathesis.checks.not_a_server_error,
                                                   schemathesis.checks.response_schema_conformance])

        run()
    assert len(calls) >= len(operations)
    assert ("GET", "/v2/", 200) in calls  # the specification's server metadata path, with its trailing slash


def test_server_metadata_with_and_without_the_trailing_slash(default_server):
    """Issue 11: the specification declares ``GET /v2/``; it answered 404 while ``GET /v2`` worked."""
    with_slash = requests.get(default_server.base + "/v2/", timeout=10)
    without = requests.get(default_server.base + "/v2", timeout=10)
    assert with_slash.status_code == without.status_code == 200
    assert with_slash.json() == without.json() and with_slash.json()["name"] == "trt-batcher"
