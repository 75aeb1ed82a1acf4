"""Issue 19's probe, each defect on SQLite and PostgreSQL: numbers the store cannot sum, losses
that are no loss, and JSON the peer plane refuses (duplicate keys, deep nesting, huge integers)
are refused with a 4xx and change nothing; what is accepted never breaks a read."""

import json

import pytest
from sqlalchemy import insert

from neuroshard.node.wallet import Wallet
from neuroshard.protocol.reports import MAX_LOSS, MAX_TOKENS
from neuroshard.testing.api import Harness, receipt_doc
from neuroshard.verifier import models as m

H = "1" * 64
READS = ("/api/training/global", "/metrics", "/api/training/verify", "/api/training/history", "/api/nodes")


def _reads_answer(harness: Harness) -> dict[str, int]:
    return {path: harness.client.get(path).status_code for path in READS}


def test_tokens_past_the_bound_are_refused_and_nothing_is_stored(harness: Harness) -> None:
    """The probe: two wallets, two receipts each of 2^62 tokens, then /global and /metrics were 500."""
    wallets = [Wallet.from_token(f"flood-{i}") for i in range(2)]
    for wallet in wallets:
        harness.register(wallet)
    before = harness.counts()
    for wallet in wallets:
        for round_ in range(2):
            r = harness.post(wallet, "/api/receipts", receipt_doc(round_, H, tokens=2**62))
            assert r.status_code == 422, r.text
            assert r.json()["error"] == "invalid" and r.json()["detail"].startswith("receipt.tokens = ")
    r = harness.post(wallets[0], "/api/receipts", receipt_doc(0, H, tokens=MAX_TOKENS + 1))
    assert r.status_code == 422
    assert harness.counts() == before
    assert _reads_answer(harness) == dict.fromkeys(READS, 200)


def test_receipts_at_the_bound_sum_exactly_and_every_read_answers(harness: Harness) -> None:
    wallets = [Wallet.from_token(f"big-{i}") for i in range(4)]
    for wallet in wallets:
        harness.register(wallet)
    for wallet in wallets:
        for round_ in range(3):
            r = harness.post(wallet, "/api/receipts", receipt_doc(round_, H, tokens=MAX_TOKENS))
            assert r.status_code == 201, r.text
    assert _reads_answer(harness) == dict.fromkeys(READS, 200)
    assert harness.client.get("/api/training/global").json()["total_tokens"] == 12 * MAX_TOKENS
    assert f"neuroshard_tokens_total {12 * MAX_TOKENS}" in harness.client.get("/metrics").text


def test_rows_stored_before_the_bound_cannot_overflow_a_sum(harness: Harness) -> None:
    """Receipts written by an older verifier (tokens 2^62, a loss sum of -inf) must not break reads."""
    wallet = Wallet.from_token("legacy")
    harness.register(wallet)
    row = {
        "stage": 0,
        "inner_steps": 4,
        "start_step": 0,
        "tokens": 2**62,
        "shard_id": 0,
        "offset_start": 0,
        "offset_end": 8,
        "data_spans": [[0, 0, 8]],
        "losses": [],
        "loss_sum": float("-inf"),
        "loss_count": 4,
        "base_hash": "0" * 64,
        "result_hash": H,
        "delta_digest": "d" * 64,
        "accepted": [],
        "rejected": [],
        "equivocators": [],
        "accepted_count": 0,
        "rejected_count": 0,
        "body_sha256": "b" * 64,
        "received_at": harness.clock(),
    }
    with harness.services.db.write() as session:
        for round_ in range(4):
            session.execute(insert(m.Receipt).values(wallet_id=wallet.wallet_id, round=round_, **row))
            session.execute(
                insert(m.HashVote).values(
                    stage=0, round=round_, wallet_id=wallet.wallet_id, result_hash=H, base_hash="0" * 64
                )
            )
    assert _reads_answer(harness) == dict.fromkeys(READS, 200)
    body = harness.client.get("/api/training/global").json()
    assert body["total_tokens"] == 4 * 2**62  # past int64, still exact: 2^64 is a power of two
    assert body["global_loss_reported"] is None  # -inf is no loss
    assert harness.client.get("/api/training/verify").json()["reported_loss"] is None


@pytest.mark.parametrize(
    "losses", [[-1e308] * 4, [-0.5], [1e308] * 4, [MAX_LOSS * 2], [0.0, float("inf")]], ids=str
)
def test_impossible_losses_are_refused(harness: Harness, losses: list[float]) -> None:
    wallet = Wallet.from_token("liar")
    harness.register(wallet)
    before = harness.counts()
    body = json.dumps(receipt_doc(0, H, losses=losses)).encode()  # inf as Infinity: Python's json
    r = harness.post_raw(wallet, "/api/receipts", body)
    assert r.status_code == 422, r.text
    assert harness.counts() == before
    assert harness.client.get("/api/training/verify").json()["reported_loss"] is None


def test_zero_and_largest_losses_are_accepted(harness: Harness) -> None:
    wallet = Wallet.from_token("honest")
    harness.register(wallet)
    r = harness.post(wallet, "/api/receipts", receipt_doc(0, H, losses=[0.0, MAX_LOSS, 1.0, 2.0]))
    assert r.status_code == 201, r.text


def _dup(doc: dict[str, object], key: str, value: object) -> bytes:
    """`doc` as JSON with `key` written a second time, last: json.loads would keep `value`."""
    body = json.dumps(doc)
    return (body[:-1] + f", {json.dumps(key)}: {json.dumps(value)}}}").encode()


DUPLICATES = {
    "receipt: tokens": ("/api/receipts", _dup(receipt_doc(0, H), "tokens", 10**9)),
    "receipt: result hash": ("/api/receipts", _dup(receipt_doc(0, H), "result_hash", "2" * 64)),
    "receipt: nested span": (
        "/api/receipts",
        json.dumps(receipt_doc(0, H))
        .replace('"offset_end": 8}', '"offset_end": 8, "offset_end": 9}')
        .encode(),
    ),
    "register: stage": (
        "/api/register",
        _dup({"address": "http://10.0.0.1:9", "stage": 0, "software_version": "1"}, "stage", 0),
    ),
    "heartbeat: round": ("/api/heartbeat", _dup({"stage": 0, "round": 0, "steps_in_round": 1}, "round", 7)),
}


@pytest.mark.parametrize("case", list(DUPLICATES))
def test_duplicate_keys_are_refused_as_on_the_peer_plane(harness: Harness, case: str) -> None:
    wallet = Wallet.from_token("dup")
    harness.register(wallet)
    before = harness.counts()
    path, body = DUPLICATES[case]
    r = harness.post_raw(wallet, path, body)
    assert r.status_code == 422, r.text
    assert "duplicate JSON key" in r.json()["detail"]
    assert harness.counts() == before


@pytest.mark.parametrize(
    "body, message",
    [
        (b"[" * 3000 + b"]" * 3000, "nests too deep"),
        (b'{"stage": ' + b"9" * 5000 + b"}", "not acceptable JSON"),
        (b'{"stage": 1e999}', "overflows a float"),
        (b'{"stage": NaN}', "JSON constant NaN"),
        (b'{"stage": 0, "round": \xff}', "not UTF-8"),
    ],
    ids=["deep", "long int", "float overflow", "NaN", "not utf-8"],
)
def test_hostile_json_is_a_422_with_the_reason(harness: Harness, body: bytes, message: str) -> None:
    wallet = Wallet.from_token("hostile")
    harness.register(wallet)
    before = harness.counts()
    r = harness.post_raw(wallet, "/api/receipts", body)
    assert r.status_code == 422, r.text
    assert message in r.json()["detail"]
    assert harness.counts() == before
