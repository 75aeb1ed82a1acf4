"""Signed writes: the happy path, and every kind of bad input answered 4xx with nothing stored."""

import json
from collections.abc import Callable, Iterator

import httpx2
import pytest
from fastapi.testclient import TestClient

from neuroshard.api.app import create_app
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.pipeline import GradientReply
from neuroshard.protocol.signing import SIGNATURE_HEADER, WALLET_HEADER
from neuroshard.testing.api import ADDRESS, OPERATOR, Harness, receipt_doc
from neuroshard.testing.api import test_config as make_config
from neuroshard.testing.verifier import ManualClock, signed_json
from neuroshard.verifier import models as m
from neuroshard.verifier.ratelimit import RateLimitConfig

NODE = Wallet.from_token("node")
STRANGER = Wallet.from_token("stranger")
H = "1" * 64


def test_register_heartbeat_receipt_doc(harness: Harness) -> None:
    ack = harness.register(NODE).json()
    assert ack == {
        "status": "registered",
        "wallet_id": NODE.wallet_id,
        "reputation": 0.5,
        "heartbeat_interval_s": 30.0,
    }
    r = harness.post(NODE, "/api/heartbeat", {"stage": 0, "round": 0, "steps_in_round": 3})
    assert r.status_code == 200 and r.json()["status"] == "alive"
    r = harness.post(NODE, "/api/receipts", receipt_doc(0, H))
    assert r.status_code == 201 and r.json()["status"] == "recorded"
    assert harness.counts() == {
        "wallets": 1,
        "peers": 1,
        "receipts": 1,
        "nonces": 3,
        "hash_votes": 1,
        "rounds": 0,
        "reputation_events": 0,
    }


def test_identical_resend_is_acknowledged_without_a_second_row(harness: Harness) -> None:
    harness.register(NODE)
    assert harness.post(NODE, "/api/receipts", receipt_doc(0, H)).status_code == 201
    r = harness.post(NODE, "/api/receipts", receipt_doc(0, H))  # a retry after a lost response: new nonce
    assert r.status_code == 200 and r.json()["status"] == "duplicate"
    assert harness.count(m.Receipt) == 1
    assert harness.post(NODE, "/api/receipts", receipt_doc(0, "2" * 64)).status_code == 409


def test_re_registration_moves_the_peer(harness: Harness) -> None:
    harness.register(NODE)
    r = harness.post(
        NODE, "/api/register", {"address": "http://10.0.0.2:9001", "stage": 0, "software_version": "0.2.0"}
    )
    assert r.status_code == 200
    nodes = harness.client.get("/api/nodes").json()
    assert [(n["address"], n["software_version"]) for n in nodes] == [("http://10.0.0.2:9001", "0.2.0")]


def _unsigned(h: Harness) -> httpx2.Response:
    return h.client.post("/api/receipts", json=receipt_doc(0, H))


def _forged_signature(h: Harness) -> httpx2.Response:
    body, headers = signed_json(STRANGER, "/api/receipts", receipt_doc(0, H), timestamp=h.clock())
    headers[WALLET_HEADER] = NODE.public_key_hex  # claims to be NODE, signed by someone else
    return h.client.post("/api/receipts", content=body, headers=headers)


def _tampered_body(h: Harness) -> httpx2.Response:
    body, headers = signed_json(NODE, "/api/receipts", receipt_doc(0, H), timestamp=h.clock())
    return h.client.post(
        "/api/receipts", content=body.replace(b'"tokens": 256', b'"tokens": 999'), headers=headers
    )


def _signed_for_another_path(h: Harness) -> httpx2.Response:
    body, headers = signed_json(NODE, "/api/heartbeat", receipt_doc(0, H), timestamp=h.clock())
    return h.client.post("/api/receipts", content=body, headers=headers)


def _query_string_not_signed(h: Harness) -> httpx2.Response:
    body, headers = signed_json(NODE, "/api/receipts", receipt_doc(0, H), timestamp=h.clock())
    return h.client.post("/api/receipts?round=9", content=body, headers=headers)


def _garbage_signature(h: Harness) -> httpx2.Response:
    body, headers = signed_json(NODE, "/api/receipts", receipt_doc(0, H), timestamp=h.clock())
    headers[SIGNATURE_HEADER] = "0" * 128
    return h.client.post("/api/receipts", content=body, headers=headers)


def _stale(h: Harness) -> httpx2.Response:
    return h.post(NODE, "/api/receipts", receipt_doc(0, H), skew=-120)


def _from_the_future(h: Harness) -> httpx2.Response:
    return h.post(NODE, "/api/receipts", receipt_doc(0, H), skew=+120)


def _signed(h: Harness, body: bytes) -> httpx2.Response:
    return h.post_raw(NODE, "/api/receipts", body)


def _malformed_json(h: Harness) -> httpx2.Response:
    return _signed(h, b'{"stage": 0, "round": ')


def _extra_field(h: Harness) -> httpx2.Response:
    return h.post(NODE, "/api/receipts", {**receipt_doc(0, H), "reputation": 1.0})


def _string_for_int(h: Harness) -> httpx2.Response:
    return h.post(NODE, "/api/receipts", receipt_doc(0, H, round="0"))


def _bool_for_int(h: Harness) -> httpx2.Response:
    return h.post(NODE, "/api/receipts", receipt_doc(0, H, inner_steps=True))


def _nan_loss(h: Harness) -> httpx2.Response:
    return _signed(h, json.dumps(receipt_doc(0, H, losses=[float("nan")])).encode())


def _missing_field(h: Harness) -> httpx2.Response:
    doc = receipt_doc(0, H)
    del doc["result_hash"]
    return h.post(NODE, "/api/receipts", doc)


def _bad_hash(h: Harness) -> httpx2.Response:
    return h.post(NODE, "/api/receipts", receipt_doc(0, "XYZ"))


def _negative_round(h: Harness) -> httpx2.Response:
    return h.post(NODE, "/api/receipts", receipt_doc(-1, H))


def _too_many_losses(h: Harness) -> httpx2.Response:
    return h.post(NODE, "/api/receipts", receipt_doc(0, H, inner_steps=20_000, losses=[1.0] * 10_001))


def _unknown_stage(h: Harness) -> httpx2.Response:
    return h.post(NODE, "/api/receipts", receipt_doc(0, H, stage=3, data=[]))


def _not_an_object(h: Harness) -> httpx2.Response:
    return _signed(h, b"[1, 2, 3]")


def _huge_declared(h: Harness) -> httpx2.Response:
    return _signed(h, b" " * (h.config.max_body_bytes + 1))


def _huge_chunked(h: Harness) -> httpx2.Response:
    def chunks() -> Iterator[bytes]:
        for _ in range(64):
            yield b" " * 8192  # 512 KiB in total, no Content-Length

    return h.client.post("/api/receipts", content=chunks(), headers={"Content-Type": "application/json"})


def _unregistered_wallet(h: Harness) -> httpx2.Response:
    return h.post(STRANGER, "/api/receipts", receipt_doc(0, H))


def _unregistered_heartbeat(h: Harness) -> httpx2.Response:
    return h.post(STRANGER, "/api/heartbeat", {"stage": 0, "round": 0, "steps_in_round": 0})


def _register_bad_address(h: Harness) -> httpx2.Response:
    return h.post(
        STRANGER, "/api/register", {"address": "javascript:alert(1)", "stage": 0, "software_version": "1"}
    )


def _register_unknown_stage(h: Harness) -> httpx2.Response:
    return h.post(STRANGER, "/api/register", {"address": ADDRESS, "stage": 7, "software_version": "1"})


ANSWERERS = [Wallet.from_token(f"answerer-{i}") for i in range(2)]
MICRO_BATCH = "ab" * 16


def _reply(signer: Wallet, to: Wallet, **overrides: object) -> dict[str, object]:
    fields: dict[str, object] = dict(
        to=to.public_key_hex, micro_batch=MICRO_BATCH, stage=1, round=0, loss=5.0, codec="int8",
        payload_sha256="e" * 64,
    )  # fmt: skip
    fields.update(overrides)
    return GradientReply.create(signer, **fields).to_obj()  # type: ignore[arg-type]


def _disputed(h: Harness, *replies: dict[str, object]) -> httpx2.Response:
    doc = receipt_doc(0, H, disputes=[{"micro_batch": MICRO_BATCH, "replies": list(replies)}])
    return h.post(NODE, "/api/receipts", doc)


def _dispute_of_a_reply_to_another(h: Harness) -> httpx2.Response:
    return _disputed(h, _reply(ANSWERERS[0], NODE), _reply(ANSWERERS[1], STRANGER))


def _dispute_of_a_forged_reply(h: Harness) -> httpx2.Response:
    forged = _reply(ANSWERERS[1], NODE)
    forged["payload_sha256"] = "f" * 64  # changed after signing
    return _disputed(h, _reply(ANSWERERS[0], NODE), forged)


def _dispute_of_one_reply(h: Harness) -> httpx2.Response:
    return _disputed(h, _reply(ANSWERERS[0], NODE))


def _dispute_of_another_stage(h: Harness) -> httpx2.Response:
    """A stage-0 receipt disputes only stage 1's answers (the replies it was sent)."""
    return _disputed(h, _reply(ANSWERERS[0], NODE, stage=2), _reply(ANSWERERS[1], NODE, stage=2))


def _reinstate_by_a_node(h: Harness) -> httpx2.Response:
    return h.post(NODE, "/api/admin/reinstate", {"wallet_id": NODE.wallet_id})


BAD: dict[str, tuple[Callable[[Harness], httpx2.Response], int]] = {
    "unsigned": (_unsigned, 401),
    "forged signature": (_forged_signature, 401),
    "tampered body": (_tampered_body, 401),
    "signed for another path": (_signed_for_another_path, 401),
    "garbage signature": (_garbage_signature, 401),
    "query string not signed": (_query_string_not_signed, 401),
    "stale": (_stale, 401),
    "from the future": (_from_the_future, 401),
    "malformed JSON": (_malformed_json, 422),
    "extra field": (_extra_field, 422),
    "string for int": (_string_for_int, 422),
    "bool for int": (_bool_for_int, 422),
    "NaN loss": (_nan_loss, 422),
    "missing field": (_missing_field, 422),
    "bad hash": (_bad_hash, 422),
    "negative round": (_negative_round, 422),
    "too many losses": (_too_many_losses, 422),
    "unknown stage": (_unknown_stage, 422),
    "not an object": (_not_an_object, 422),
    "huge body (declared)": (_huge_declared, 413),
    "huge body (chunked)": (_huge_chunked, 413),
    "unregistered wallet": (_unregistered_wallet, 403),
    "unregistered heartbeat": (_unregistered_heartbeat, 403),
    "register: bad address": (_register_bad_address, 422),
    "register: unknown stage": (_register_unknown_stage, 422),
    "reinstate by a node": (_reinstate_by_a_node, 403),
    "dispute: a reply to another wallet": (_dispute_of_a_reply_to_another, 422),
    "dispute: a forged reply": (_dispute_of_a_forged_reply, 422),
    "dispute: one reply": (_dispute_of_one_reply, 422),
    "dispute: replies of a stage it does not send to": (_dispute_of_another_stage, 422),
}


def test_a_receipt_names_its_disputed_micro_batches_and_they_are_stored(harness: Harness) -> None:
    """The replies a receipt disputes, each signed to its wallet, are stored with it for the replay
    checker; a receipt without any stores none (and its JSON has no "disputes" key)."""
    harness.register(NODE)
    replies = [_reply(ANSWERERS[0], NODE), _reply(ANSWERERS[1], NODE, payload_sha256="c" * 64)]
    assert _disputed(harness, *replies).status_code == 201
    assert harness.post(NODE, "/api/receipts", receipt_doc(1, H)).status_code == 201
    with harness.services.db.read() as s:
        stored = {r.round: r.disputes for r in s.query(m.Receipt)}
    assert stored == {0: [{"micro_batch": MICRO_BATCH, "replies": replies}], 1: None}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_and_nothing_is_stored(harness: Harness, case: str) -> None:
    harness.register(NODE)
    before = harness.counts()
    send, status = BAD[case]
    response = send(harness)
    assert response.status_code == status, response.text
    assert "detail" in response.json()
    assert harness.counts() == before


def test_replayed_request_is_refused_and_stores_nothing(harness: Harness) -> None:
    harness.register(NODE)
    body, headers = signed_json(NODE, "/api/receipts", receipt_doc(0, H), timestamp=harness.clock())
    assert harness.client.post("/api/receipts", content=body, headers=headers).status_code == 201
    before = harness.counts()
    harness.clock.advance(30)  # still inside the freshness window
    replay = harness.client.post("/api/receipts", content=body, headers=headers)
    assert replay.status_code == 409
    assert "replayed request" in replay.json()["detail"]
    assert harness.counts() == before


def test_replay_of_a_registration_is_refused(harness: Harness) -> None:
    doc = {"address": ADDRESS, "stage": 0, "software_version": "0.1.0"}
    body, headers = signed_json(NODE, "/api/register", doc, timestamp=harness.clock())
    assert harness.client.post("/api/register", content=body, headers=headers).status_code == 200
    before = harness.counts()
    assert harness.client.post("/api/register", content=body, headers=headers).status_code == 409
    assert harness.counts() == before


def test_nonces_survive_a_restart(database_url: str) -> None:
    """Replay protection lives in the database, not in the process."""
    clock = ManualClock()
    body, headers = signed_json(
        NODE, "/api/register", {"address": ADDRESS, "stage": 0, "software_version": "1"}, timestamp=clock()
    )
    with TestClient(create_app(make_config(database_url, clock))) as client:
        assert client.post("/api/register", content=body, headers=headers).status_code == 200
    with TestClient(create_app(make_config(database_url, clock))) as client:
        assert client.post("/api/register", content=body, headers=headers).status_code == 409


def test_refused_wallet_gets_403_until_the_operator_reinstates_it(harness: Harness) -> None:
    harness.register(NODE)
    with harness.services.db.write() as session:
        row = session.get(m.Wallet, NODE.wallet_id)
        assert row is not None
        row.status, row.status_reason, row.reputation = m.STATUS_REFUSED, "test", 0.0
    before = harness.counts()
    for path, doc in (
        ("/api/receipts", receipt_doc(0, H)),
        ("/api/register", {"address": ADDRESS, "stage": 0, "software_version": "1"}),
        ("/api/heartbeat", {"stage": 0, "round": 0, "steps_in_round": 0}),
    ):
        r = harness.post(NODE, path, doc)
        assert r.status_code == 403, path
        assert "refused" in r.json()["detail"]
    assert harness.counts() == before
    assert [p["wallet_id"] for p in harness.client.get("/api/peers").json()] == []

    r = harness.post(OPERATOR, "/api/admin/reinstate", {"wallet_id": NODE.wallet_id})
    assert r.status_code == 200
    assert r.json() == {
        "status": "reinstated",
        "wallet_id": NODE.wallet_id,
        "reputation": 0.5,
        "heartbeat_interval_s": None,
    }
    assert harness.post(NODE, "/api/receipts", receipt_doc(0, H)).status_code == 201
    assert (
        harness.post(OPERATOR, "/api/admin/reinstate", {"wallet_id": STRANGER.wallet_id}).status_code == 404
    )


def test_rate_limit_per_wallet(database_url: str) -> None:
    clock = ManualClock()
    config = make_config(database_url, clock)
    config.rate_limit = RateLimitConfig(capacity=3, refill_per_s=0.5)
    with TestClient(create_app(config)) as client:

        def beat(wallet: Wallet) -> httpx2.Response:
            doc = {"address": ADDRESS, "stage": 0, "software_version": "1"}
            body, headers = signed_json(wallet, "/api/register", doc, timestamp=clock())
            return client.post("/api/register", content=body, headers=headers)

        assert [beat(NODE).status_code for _ in range(4)] == [200, 200, 200, 429]
        limited = beat(NODE)
        assert limited.headers["Retry-After"] == "2"
        assert beat(STRANGER).status_code == 200  # another wallet has its own bucket
        clock.advance(2)
        assert beat(NODE).status_code == 200
