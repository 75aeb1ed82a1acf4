"""Property: the verifier's decoders answer every generated input with a 2xx or a 4xx, never a
5xx, and a refused write changes nothing in the database; on SQLite and PostgreSQL.

Three layers: the wire schemas alone (protocol.reports: a message or a Refused),
the signed write routes over HTTP with any body (valid bodies with one field replaced or
written twice, any JSON, any bytes, hostile JSON text), and the signature headers with one
value broken. Every read endpoint still answers 200 afterwards. Complements tests/api/test_fuzz.py
(schemathesis, from the OpenAPI schema)."""

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuroshard.api.app import create_app
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.reports import HeartbeatRequest, Receipt, RegisterRequest, ReinstateRequest
from neuroshard.protocol.roster import Roster
from neuroshard.protocol.schema import Message
from neuroshard.protocol.signing import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WALLET_HEADER,
    sign_request,
)
from neuroshard.testing.api import ADDRESS, OPERATOR, Harness, receipt_doc, test_config
from neuroshard.testing.verifier import ManualClock
from neuroshard.verifier import models as m

SCHEMA_EXAMPLES = 150
HTTP_EXAMPLES = 120
NODE = Wallet.from_token("fuzz-verifier-node")
READS = ("/api/training/global", "/metrics", "/api/training/verify", "/api/training/history", "/api/nodes")

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
edge_numbers = st.sampled_from(
    [-1, 0, 2**31 - 1, 2**31, 2**40, 2**40 + 1, 2**53, 2**62, 2**63, 2**64, -1e308, 1e308, -0.0, 1e6, 1e6 + 1]
)
hostile_text = st.one_of(
    st.integers(min_value=500, max_value=5_000).map(lambda n: "[" * n + "]" * n),
    st.integers(min_value=4_300, max_value=6_000).map(lambda n: "9" * n),
    st.sampled_from(["1e999", "-1e999", "NaN", "Infinity", "-Infinity"]),
)

VALID: dict[str, dict[str, Any]] = {
    "/api/register": {"address": ADDRESS, "stage": 0, "software_version": "0.1.0"},
    "/api/heartbeat": {"stage": 0, "round": 1, "steps_in_round": 2},
    "/api/receipts": receipt_doc(1, "1" * 64),
    "/api/admin/reinstate": {"wallet_id": NODE.wallet_id},
}
SCHEMAS: dict[str, type[Message]] = {
    "/api/register": RegisterRequest,
    "/api/heartbeat": HeartbeatRequest,
    "/api/receipts": Receipt,
    "/api/admin/reinstate": ReinstateRequest,
}


def _broken(doc: dict[str, Any], field: str, value: Any, how: str) -> bytes:
    """`doc` with `field` replaced by `value`, written twice, or replaced by raw hostile text."""
    if how == "duplicate":
        return (json.dumps(doc)[:-1] + f", {json.dumps(field)}: {json.dumps(value)}}}").encode()
    if how == "raw" and isinstance(value, str):
        return json.dumps({**doc, field: 0}).replace(f'"{field}": 0', f'"{field}": {value}').encode()
    return json.dumps({**doc, field: value}).encode()


def _body(data: st.DataObject, path: str, how: str) -> bytes:
    doc = VALID[path]
    field = data.draw(st.sampled_from(sorted(doc)))
    if how in ("replace", "duplicate"):
        return _broken(doc, field, data.draw(json_values | edge_numbers), how)
    if how == "raw":
        return _broken(doc, field, data.draw(hostile_text), how)
    if how == "json":
        return json.dumps(data.draw(json_values)).encode()
    return data.draw(st.binary(max_size=200))


@pytest.mark.parametrize("path", list(SCHEMAS))
def test_wire_schemas(path: str, tally: Any) -> None:
    schema, doc = SCHEMAS[path], VALID[path]

    @settings(
        max_examples=SCHEMA_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(
        obj=st.one_of(
            st.tuples(st.sampled_from(sorted(doc)), json_values | edge_numbers).map(
                lambda f: {**doc, f[0]: f[1]}
            ),
            st.sampled_from(sorted(doc)).map(lambda k: {n: v for n, v in doc.items() if n != k}),
            json_values,
        )
    )
    def run(obj: Any) -> None:
        label = f"verifier wire {schema.__name__}"
        try:
            schema.from_obj(obj)
        except Refused:
            tally.add(label, 422)
            return
        except Exception:
            tally.add(label, 500)
            raise
        tally.add(label, 200)

    run()


@pytest.fixture
def harness(database_url: str) -> Iterator[Harness]:
    clock = ManualClock()
    config = test_config(database_url, clock)
    with TestClient(create_app(config)) as client:
        yield Harness(client, clock, config)


def _backend(harness: Harness) -> str:
    return harness.config.database_url.split(":", 1)[0].split("+", 1)[0]


def test_signed_write_bodies(harness: Harness, tally: Any) -> None:
    harness.register(NODE)
    backend = _backend(harness)

    @settings(
        max_examples=HTTP_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        path = data.draw(st.sampled_from(sorted(VALID)))
        how = data.draw(st.sampled_from(["replace", "duplicate", "raw", "json", "bytes"]))
        body = _body(data, path, how)
        before = harness.counts()
        harness.clock.advance(0.01)
        response = harness.post_raw(NODE, path, body)
        tally.add(f"verifier POST {path} ({backend})", response.status_code)
        assert response.status_code < 500, (path, body[:200], response.text[:300])
        if response.status_code >= 400:
            assert harness.counts() == before, (path, body[:200], response.text[:300])
        if how == "duplicate":  # refused whatever the value, as on the peer plane
            assert response.status_code == 422 and "duplicate JSON key" in response.text, response.text[:300]

    run()
    assert {path: harness.client.get(path).status_code for path in READS} == dict.fromkeys(READS, 200)


AUTH_HEADERS = [WALLET_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER]


def test_signature_headers(harness: Harness, tally: Any) -> None:
    harness.register(NODE)
    backend = _backend(harness)
    body = json.dumps(VALID["/api/heartbeat"]).encode()

    @settings(
        max_examples=HTTP_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(
        header=st.sampled_from(AUTH_HEADERS),
        value=st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=140)
        | st.text("0123456789abcdef", max_size=140)
        | st.integers(min_value=0, max_value=10**20).map(str),
    )
    def run(header: str, value: str) -> None:
        before = harness.counts()
        harness.clock.advance(0.01)
        headers = sign_request(NODE, "POST", "/api/heartbeat", body, now=harness.clock())
        headers[header] = value
        headers["Content-Type"] = "application/json"
        response = harness.client.post("/api/heartbeat", content=body, headers=headers)
        tally.add(f"verifier signed headers ({backend})", response.status_code)
        assert response.status_code < 500, (header, value, response.text[:300])
        if response.status_code >= 400:
            assert harness.counts() == before

    run()


def test_roster_bodies_from_the_operator(harness: Harness, tally: Any) -> None:
    """POST /api/admin/roster signed by the operator itself: whatever the body, a 2xx or a 4xx, and
    no roster stored unless it was a valid, newer, operator-signed roster for this network."""
    backend = _backend(harness)
    valid = Roster.build(
        OPERATOR,
        network=harness.config.network.name,
        version=5,
        expires_at=2**40,
        stages={0: [NODE.public_key_hex]},
    ).to_obj()

    @settings(
        max_examples=HTTP_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        how = data.draw(st.sampled_from(["replace", "duplicate", "raw", "json", "bytes"]))
        field = data.draw(st.sampled_from(sorted(valid)))
        if how in ("replace", "duplicate"):
            body = _broken(valid, field, data.draw(json_values | edge_numbers), how)
        elif how == "raw":
            body = _broken(valid, field, data.draw(hostile_text), how)
        elif how == "json":
            body = json.dumps(data.draw(json_values)).encode()
        else:
            body = data.draw(st.binary(max_size=200))
        before = harness.count(m.RosterRow)
        harness.clock.advance(0.01)
        response = harness.post_raw(OPERATOR, "/api/admin/roster", body)
        tally.add(f"verifier POST /api/admin/roster ({backend})", response.status_code)
        assert response.status_code < 500, (body[:200], response.text[:300])
        if response.status_code >= 400:
            assert harness.count(m.RosterRow) == before
        if how == "duplicate":
            assert response.status_code == 400 and "duplicate JSON key" in response.text

    run()
