"""Membership over HTTP (issue 19), on each database backend: the signed member list, the
operator's roster, the admission terms, the registration proof of work and the per-source
limit on new wallets. Every refusal is a 4xx that stores nothing."""

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from neuroshard.api.app import create_app
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.roster import MemberList, Roster, solve_pow
from neuroshard.testing.api import ADDRESS, OPERATOR, Harness, test_config
from neuroshard.testing.verifier import ManualClock
from neuroshard.verifier import models as m
from neuroshard.verifier.members import MembershipConfig
from neuroshard.verifier.ratelimit import SourceLimitConfig, source_key
from neuroshard.verifier.vocab import VocabWatchConfig, schedule_growth

WALLETS = [Wallet.from_token(f"api-members-{i}") for i in range(4)]
REGISTRATION = {"address": ADDRESS, "stage": 0, "software_version": "0.1.0"}


def _harness(database_url: str, **overrides: Any) -> Iterator[Harness]:
    clock = ManualClock()
    config = test_config(database_url, clock, **overrides)
    with TestClient(create_app(config)) as client:
        yield Harness(client, clock, config)


@pytest.fixture
def probation(database_url: str) -> Iterator[Harness]:
    yield from _harness(database_url, membership=MembershipConfig(policy="probation", admission_rounds=2))


def _members(h: Harness, stage: int = 0) -> MemberList:
    r = h.client.get(f"/api/stages/{stage}/members")
    assert r.status_code == 200, r.text
    doc = MemberList.from_json(r.content)
    doc.verify(OPERATOR.public_key_hex, network=h.config.network.name, now=h.clock())
    return doc


def _roster(h: Harness, version: int, wallets: list[Wallet], **kw: Any) -> Roster:
    return Roster.build(
        kw.get("signer", OPERATOR),
        network=kw.get("network", h.config.network.name),
        version=version,
        expires_at=kw.get("expires_at", int(h.clock()) + 3600),
        stages={0: [w.public_key_hex for w in wallets]},
    )


def test_member_list_is_signed_and_follows_registrations(probation: Harness) -> None:
    h = probation
    empty = _members(h)
    assert (empty.policy, empty.admitted, empty.probation, empty.epoch) == ("probation", (), (), 0)
    h.register(WALLETS[0])
    h.register(WALLETS[1])
    doc = _members(h)
    assert doc.admitted == (WALLETS[0].public_key_hex,) and doc.probation == (WALLETS[1].public_key_hex,)
    assert doc.newer_than(empty) and doc.admission_rounds == 2
    r = h.client.get("/api/stages/0/members")
    assert (
        h.client.get("/api/stages/0/members", headers={"If-None-Match": r.headers["ETag"]}).status_code == 304
    )
    assert h.client.get("/api/stages/5/members").status_code == 404
    assert h.client.get("/api/stages/-1/members").status_code == 422


def test_admission_terms(database_url: str) -> None:
    for h in _harness(
        database_url,
        registration_pow_bits=8,
        registration_limit=SourceLimitConfig(per_hour=30),
        membership=MembershipConfig(policy="probation", admission_rounds=4, spot_checks_required=2),
    ):
        assert h.client.get("/api/admission").json() == {
            "network": h.config.network.name,
            "policy": "probation",
            "admission_rounds": 4,
            "spot_checks_required": 2,
            "pow_bits": 8,
            "new_wallets_per_source_per_hour": 30.0,
            "roster_version": None,
        }


def test_operator_installs_rosters_and_nothing_else_does(database_url: str) -> None:
    for h in _harness(database_url, membership=MembershipConfig(policy="allowlist")):
        assert h.client.get("/api/roster").status_code == 404
        before = h.count(m.RosterRow)
        refusals = [
            (h.post_raw(WALLETS[0], "/api/admin/roster", _roster(h, 1, WALLETS[:1]).to_json()), 403),
            (h.post_raw(OPERATOR, "/api/admin/roster", b'{"version": 1}'), 400),
            (
                h.post_raw(
                    OPERATOR, "/api/admin/roster", _roster(h, 1, WALLETS, signer=WALLETS[0]).to_json()
                ),
                422,
            ),
            (h.post_raw(OPERATOR, "/api/admin/roster", _roster(h, 1, WALLETS, expires_at=1).to_json()), 422),
            (h.post_raw(OPERATOR, "/api/admin/roster", _roster(h, 1, WALLETS, network="x").to_json()), 422),
        ]
        for response, status in refusals:
            assert response.status_code == status, response.text
            assert "detail" in response.json()
        assert h.count(m.RosterRow) == before

        # Allowlist: nobody registers before a roster, only listed wallets after it.
        stranger = h.post(WALLETS[2], "/api/register", REGISTRATION)
        assert stranger.status_code == 403 and "roster" in stranger.json()["detail"]
        roster = _roster(h, 2, WALLETS[:2])
        r = h.post_raw(OPERATOR, "/api/admin/roster", roster.to_json())
        assert r.status_code == 200 and r.json()["status"] == "accepted"
        assert h.post_raw(OPERATOR, "/api/admin/roster", roster.to_json()).json()["status"] == "duplicate"
        assert h.post_raw(OPERATOR, "/api/admin/roster", _roster(h, 1, WALLETS).to_json()).status_code == 409
        assert Roster.from_json(h.client.get("/api/roster").content) == roster
        h.register(WALLETS[0])
        before = h.counts()
        assert h.post(WALLETS[2], "/api/register", REGISTRATION).status_code == 403
        assert h.counts() == before
        assert _members(h).admitted == tuple(sorted(w.public_key_hex for w in WALLETS[:2]))


def test_a_new_wallet_pays_the_proof_of_work_once(database_url: str) -> None:
    for h in _harness(database_url, registration_pow_bits=10):
        name, key = h.config.network.name, WALLETS[0].public_key_hex
        before = h.counts()
        missing = h.post(WALLETS[0], "/api/register", REGISTRATION)
        assert missing.status_code == 403 and "proof of work" in missing.json()["detail"]
        nonce = solve_pow(name, key, 10)
        wrong = next(n for n in range(nonce + 1, nonce + 10_000) if solve_pow(name, key, 10, start=n) != n)
        assert h.post(WALLETS[0], "/api/register", {**REGISTRATION, "pow_nonce": wrong}).status_code == 403
        other_wallet = solve_pow(name, WALLETS[1].public_key_hex, 10)  # not this wallet's work
        if other_wallet != nonce:
            assert (
                h.post(WALLETS[0], "/api/register", {**REGISTRATION, "pow_nonce": other_wallet}).status_code
                == 403
            )
        assert h.counts() == before
        assert h.post(WALLETS[0], "/api/register", {**REGISTRATION, "pow_nonce": nonce}).status_code == 200
        # A known wallet re-registers (a restart, a new address) without paying again.
        assert h.post(WALLETS[0], "/api/register", REGISTRATION).status_code == 200


def test_new_wallets_are_limited_per_source(database_url: str) -> None:
    for h in _harness(database_url, registration_limit=SourceLimitConfig(capacity=2, per_hour=60)):
        assert [h.post(w, "/api/register", REGISTRATION).status_code for w in WALLETS[:2]] == [200, 200]
        before = h.counts()
        limited = h.post(WALLETS[2], "/api/register", REGISTRATION)
        assert limited.status_code == 429 and limited.headers["Retry-After"] == "60"
        assert h.counts() == before
        assert h.post(WALLETS[0], "/api/register", REGISTRATION).status_code == 200  # known: not limited
        h.clock.advance(60)
        assert h.post(WALLETS[2], "/api/register", REGISTRATION).status_code == 200


@pytest.mark.parametrize(
    "host, key",
    [
        ("203.0.113.5", "203.0.113.5"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::7", "2001:db8:1:2::/64"),
        ("::ffff:203.0.113.5", "203.0.113.5"),
        ("127.0.0.1", None),
        ("::1", None),
        ("testclient", "testclient"),
        (None, "unknown"),
    ],
)
def test_source_keys(host: str | None, key: str | None) -> None:
    assert source_key(host, exempt_loopback=True) == key
    assert source_key("127.0.0.1", exempt_loopback=False) == "127.0.0.1"


def test_member_list_serves_the_vocabulary_schedule_and_the_leader_watches_the_manifest(
    database_url: str,
) -> None:
    """The vocabulary schedule (verifier.vocab) travels in the signed member list; with
    `vocab_watch` set the leader runs the job that makes it."""
    for h in _harness(database_url, vocab_watch=VocabWatchConfig(period_s=3600)):
        assert h.client.app.state.lease.running()["VocabWatch"] == 1  # type: ignore[attr-defined]
        before = _members(h)
        assert (before.vocab_size, before.vocab_from_round) == (None, None)
        with h.services.db.write() as session:
            line = schedule_growth(
                session,
                num_stages=1,
                network_vocab=h.config.network.model.vocab_size,
                target_vocab=h.config.network.model.vocab_size + 88,
                cfg=h.config.membership,
                now=h.clock(),
            )
        assert line is not None
        after = _members(h)
        assert after.newer_than(before)
        assert (after.vocab_size, after.vocab_from_round) == (h.config.network.model.vocab_size + 88, 2)
