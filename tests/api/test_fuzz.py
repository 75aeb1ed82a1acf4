"""Fuzz the API from its own OpenAPI schema (schemathesis): whatever arrives, no 5xx.

Every operation gets schema-shaped (positive) and schema-breaking (negative) inputs: paths,
queries, JSON bodies. Writes go out twice: unsigned, which must be refused with a 4xx, and
signed by a registered wallet, so the bodies reach validation and the ledger. Bounded:
`EXAMPLES` cases per operation and mode, on each available database. Driven through
Hypothesis directly (schemathesis' pytest plugin does not run under our pytest 9)."""

import json
from collections.abc import Callable

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET

from neuroshard.api.app import create_app
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.signing import sign_request
from neuroshard.testing.api import ADDRESS, test_config
from neuroshard.testing.verifier import ManualClock

EXAMPLES = 30
SIGNER = Wallet.from_token("fuzz-node")


def _body(case: schemathesis.Case) -> bytes:
    if case.body is NOT_SET:
        return b""
    if isinstance(case.body, bytes):  # negative mode: not JSON at all
        return case.body
    return json.dumps(case.body).encode()


def _fuzz(
    operation: object, mode: GenerationMode, client: TestClient, clock: Callable[[], float], seen: set[int]
) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))  # type: ignore[attr-defined]
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def fuzz(case: schemathesis.Case) -> None:
        response = case.call()
        seen.add(response.status_code)
        assert response.status_code < 500, (case.method, case.formatted_path, response.text[:300])
        if case.method.upper() != "POST":
            return
        assert 400 <= response.status_code < 500  # unsigned: refused before parsing
        body, path = _body(case), case.formatted_path
        signed = sign_request(SIGNER, "POST", path, body, now=clock())
        signed["Content-Type"] = "application/json"
        response = client.post(path, content=body, headers=signed)
        seen.add(response.status_code)
        assert response.status_code < 500, (path, body[:300], response.text[:300])

    fuzz()


@pytest.mark.slow
def test_no_input_makes_the_api_fail(database_url: str) -> None:
    clock = ManualClock()
    app = create_app(test_config(database_url, clock))
    statuses: dict[str, set[int]] = {}
    with TestClient(app) as client:  # runs the lifespan (migrations, nonce purge)
        registration = json.dumps({"address": ADDRESS, "stage": 0, "software_version": "0.1.0"}).encode()
        headers = sign_request(SIGNER, "POST", "/api/register", registration, now=clock())
        headers["Content-Type"] = "application/json"
        registered = client.post("/api/register", content=registration, headers=headers)
        assert registered.status_code == 200, registered.text

        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 10  # every route is in the schema, so every route is fuzzed
        for operation in operations:
            for mode in GenerationMode:
                label = f"{operation.label} {mode.value}"
                statuses[label] = set()
                try:
                    _fuzz(operation, mode, client, clock, statuses[label])
                except Unsatisfiable:
                    # A route with no parameters and no body has no schema-breaking input.
                    assert mode is GenerationMode.NEGATIVE and not statuses.pop(label), label
    assert all(statuses.values()), statuses
    # The signed writes got past authentication: their bodies were validated (422) at least.
    assert 422 in statuses["POST /api/receipts negative"], statuses
    assert any(200 in codes for label, codes in statuses.items() if label.startswith("GET ")), statuses
