"""Round settlement and reputation through the database (the rules themselves: test_reputation.py)."""

from typing import Any

import pytest
from sqlalchemy import func, select, update

from neuroshard.node.wallet import Wallet
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.reports import HeartbeatRequest, Receipt, RegisterRequest
from neuroshard.protocol.signing import SignedBy, new_nonce
from neuroshard.verifier import ledger
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database
from neuroshard.verifier.reputation import ReputationConfig

CFG = ledger.LedgerConfig(reputation=ReputationConfig(), num_stages=2, nonce_window_s=60)
NOW = 1_700_000_000.0
GOOD = [Wallet.from_token(f"honest-{i}") for i in range(3)]
BAD = Wallet.from_token("attacker")


def who(wallet: Wallet, at: float = NOW) -> SignedBy:
    return SignedBy(public_key_hex=wallet.public_key_hex, timestamp=at, nonce=new_nonce())


def theta(round_: int, honest: bool = True) -> str:
    return f"{round_:064x}" if honest else f"f{round_:063x}"


def receipt(round_: int, result: str, **kw: Any) -> Receipt:
    doc: dict[str, Any] = {
        "stage": 0,
        "round": round_,
        "inner_steps": 4,
        "start_step": 4 * round_,
        "tokens": 256,
        "data": [{"shard_id": round_ % 3, "offset_start": 0, "offset_end": 8}],
        "losses": [5.0, 4.9, 4.8, 4.7],
        "base_hash": theta(round_ - 1) if round_ else "0" * 64,
        "result_hash": result,
        "delta_digest": "d" * 64,
    }
    doc.update(kw)
    return Receipt.from_obj(doc)


def register_all(db: Database, wallets: list[Wallet]) -> None:
    req = RegisterRequest(address="http://127.0.0.1:9000", stage=0, software_version="0.1.0")
    with db.write() as s:
        for w in wallets:
            ledger.register(s, who(w), req, now=NOW, cfg=CFG)


def submit(db: Database, wallet: Wallet, req: Receipt, body: str | None = None) -> str:
    with db.write() as s:
        status = ledger.submit_receipt(
            s, who(wallet), req, body_sha256=body or req.result_hash, now=NOW, cfg=CFG
        )
    with db.write() as s:
        ledger.settle_rounds(s, req.stage, now=NOW, cfg=CFG)
    return status


def wallet_row(db: Database, wallet: Wallet) -> m.Wallet:
    with db.read() as s:
        row = s.get(m.Wallet, wallet.wallet_id)
        assert row is not None
        return row


def test_attacker_in_the_minority_is_refused_and_honest_wallets_gain(db: Database) -> None:
    register_all(db, [*GOOD, BAD])
    for r in range(4):
        for w in GOOD:
            submit(db, w, receipt(r, theta(r)))
        if r < 3:
            submit(db, BAD, receipt(r, theta(r, honest=False)))
    # rounds 0..2 settled (round 3's receipts settle them); the attacker lost three times
    bad = wallet_row(db, BAD)
    assert bad.status == m.STATUS_REFUSED
    assert bad.reputation == pytest.approx(CFG.reputation.initial - 3 * CFG.reputation.minority_penalty)
    assert "minority hash" in (bad.status_reason or "")
    for w in GOOD:
        row = wallet_row(db, w)
        assert row.status == m.STATUS_ACTIVE
        assert row.reputation == pytest.approx(CFG.reputation.initial + 3 * CFG.reputation.agree_reward)
    with db.read() as s:
        rounds = s.scalars(select(m.Round).order_by(m.Round.round)).all()
        assert [(r.round, r.votes, r.agreeing) for r in rounds] == [(0, 4, 3), (1, 4, 3), (2, 4, 3)]
        assert [r.majority_hash for r in rounds] == [theta(0), theta(1), theta(2)]
        assert [(r.synced, r.sync_checked) for r in rounds] == [(0, 0), (4, 4), (4, 4)]
    with pytest.raises(Refused, match="is refused") as err, db.write() as s:
        ledger.submit_receipt(s, who(BAD), receipt(4, theta(4)), body_sha256="x", now=NOW, cfg=CFG)
    assert err.value.code == "wallet_refused"


def test_settlement_happens_once_even_if_asked_again(db: Database) -> None:
    register_all(db, GOOD)
    for r in range(2):
        for w in GOOD:
            submit(db, w, receipt(r, theta(r)))
    with db.write() as s:
        assert ledger.settle_rounds(s, 0, now=NOW, cfg=CFG) == []
    with db.read() as s:
        assert s.scalar(select(func.count()).select_from(m.ReputationEvent)) == 3


def test_a_late_receipt_is_judged_against_the_settled_majority(db: Database) -> None:
    register_all(db, [*GOOD, BAD])
    for w in GOOD:
        submit(db, w, receipt(0, theta(0)))
    for w in GOOD:
        submit(db, w, receipt(1, theta(1)))  # 3 of 4 live replicas moved on: round 0 settles without BAD
    submit(db, BAD, receipt(0, theta(0, honest=False)))
    assert wallet_row(db, BAD).reputation == pytest.approx(
        CFG.reputation.initial - CFG.reputation.minority_penalty
    )
    with db.read() as s:
        settled = s.get(m.Round, (0, 0))
        assert settled is not None and settled.votes == 3  # the late vote does not reopen the round


def test_a_late_receipt_with_the_majority_earns_nothing(db: Database) -> None:
    """Spot checks give no verdict on a receipt that came after its round settled, so it cannot
    gain: reputation stays where it was, and nothing is logged for it."""
    register_all(db, [*GOOD, BAD])
    for w in GOOD:
        submit(db, w, receipt(0, theta(0)))
    for w in GOOD:
        submit(db, w, receipt(1, theta(1)))  # round 0 settles without BAD
    before = wallet_row(db, BAD).reputation
    submit(db, BAD, receipt(0, theta(0)))  # with the majority, but late
    assert wallet_row(db, BAD).reputation == before == CFG.reputation.initial
    assert wallet_row(db, GOOD[0]).reputation > CFG.reputation.initial  # on time: credited
    with db.read() as s:
        logged = s.scalars(
            select(m.ReputationEvent).where(m.ReputationEvent.wallet_id == BAD.wallet_id)
        ).all()
    assert logged == []


def test_one_wallet_cannot_settle_a_round_early(db: Database) -> None:
    """A bogus vote followed at once by a later-round receipt must not become the 'majority'."""
    register_all(db, [*GOOD, BAD])
    submit(db, BAD, receipt(0, theta(0, honest=False)))
    submit(db, BAD, receipt(1, theta(1, honest=False)))
    submit(db, BAD, receipt(5, theta(5, honest=False)))
    with db.read() as s:
        assert s.get(m.Round, (0, 0)) is None
    for w in GOOD:
        submit(db, w, receipt(0, theta(0)))
    submit(db, GOOD[0], receipt(1, theta(1)))
    with db.read() as s:
        assert s.get(m.Round, (0, 0)) is None  # 2 of 4 live replicas past round 0: not yet
    submit(db, GOOD[1], receipt(1, theta(1)))
    with db.read() as s:
        settled = s.get(m.Round, (0, 0))
        assert settled is not None and settled.majority_hash == theta(0)
        assert s.get(m.Round, (0, 1)) is None
    assert wallet_row(db, BAD).reputation < CFG.reputation.initial
    assert wallet_row(db, GOOD[2]).reputation > CFG.reputation.initial


def test_replicas_that_stopped_beating_do_not_block_settlement(db: Database) -> None:
    register_all(db, [*GOOD, BAD])  # BAD registers, then goes silent for longer than the peer TTL
    later = NOW + CFG.peer_ttl_s + 1
    with db.write() as s:
        for w in GOOD[:2]:
            ledger.heartbeat(
                s, who(w), HeartbeatRequest(stage=0, round=0, steps_in_round=0), now=later, cfg=CFG
            )
    for w in GOOD[:2]:
        with db.write() as s:
            ledger.submit_receipt(s, who(w), receipt(0, theta(0)), body_sha256="a", now=later, cfg=CFG)
    with db.write() as s:
        ledger.submit_receipt(s, who(GOOD[0]), receipt(1, theta(1)), body_sha256="b", now=later, cfg=CFG)
        ledger.submit_receipt(s, who(GOOD[1]), receipt(1, theta(1)), body_sha256="c", now=later, cfg=CFG)
    with db.write() as s:
        assert ledger.settle_rounds(s, 0, now=later, cfg=CFG) == [0]  # 2 of 2 live replicas moved on


def test_identical_resubmission_is_a_duplicate_and_a_different_one_conflicts(db: Database) -> None:
    register_all(db, GOOD[:1])
    assert submit(db, GOOD[0], receipt(0, theta(0)), body="body-1") == "recorded"
    assert submit(db, GOOD[0], receipt(0, theta(0)), body="body-1") == "duplicate"
    with pytest.raises(Refused, match="different receipt") as err:
        submit(db, GOOD[0], receipt(0, theta(1)), body="body-2")
    assert err.value.code == "conflict"


def test_receipts_must_match_the_registered_stage(db: Database) -> None:
    register_all(db, GOOD[:1])
    with pytest.raises(Refused, match="registered for stage 0, not stage 1"):
        submit(db, GOOD[0], receipt(0, theta(0), stage=1, data=[]))
    with pytest.raises(Refused, match="stage 5 does not exist"):
        submit(db, GOOD[0], receipt(0, theta(0), stage=5, data=[]))


def test_nonce_replay_is_refused(db: Database) -> None:
    signed = who(GOOD[0])
    with db.write() as s:
        ledger.use_nonce(s, signed, window_s=60)
    with pytest.raises(Refused, match="replayed request") as err, db.write() as s:
        ledger.use_nonce(s, signed, window_s=60)
    assert err.value.code == "replayed"


def test_expired_nonces_are_forgotten(db: Database) -> None:
    with db.write() as s:
        ledger.use_nonce(s, who(GOOD[0]), window_s=60)
        ledger.use_nonce(s, who(GOOD[1]), window_s=60)
    with db.write() as s:  # a request records its nonce and deletes nothing (one statement)
        ledger.use_nonce(s, who(GOOD[0], at=NOW + 61), window_s=60)
    with db.read() as s:
        assert s.scalar(select(func.count()).select_from(m.Nonce)) == 3
    with db.write() as s:  # the lead process's housekeeping forgets the expired ones
        assert ledger.purge_nonces(s, now=NOW + 61) == 2
    with db.read() as s:
        assert s.scalar(select(func.count()).select_from(m.Nonce)) == 1


def test_a_heartbeat_is_refused_for_the_reason_that_applies(db: Database) -> None:
    register_all(db, GOOD[:1])
    beat = HeartbeatRequest(stage=0, round=3, steps_in_round=7)
    with db.write() as s:
        ledger.heartbeat(s, who(GOOD[0]), beat, now=NOW + 5, cfg=CFG)
    with db.read() as s:
        peer = s.get(m.Peer, GOOD[0].wallet_id)
        assert peer is not None and (peer.last_heartbeat, peer.round, peer.steps_in_round) == (NOW + 5, 3, 7)
    cases = [
        (GOOD[1], beat, "not registered"),
        (
            GOOD[0],
            HeartbeatRequest(stage=1, round=3, steps_in_round=7),
            "registered for stage 0, not stage 1",
        ),
        (GOOD[0], HeartbeatRequest(stage=9, round=3, steps_in_round=7), "stage 9 does not exist"),
    ]
    for wallet, request, reason in cases:
        with pytest.raises(Refused, match=reason), db.write() as s:
            ledger.heartbeat(s, who(wallet), request, now=NOW + 6, cfg=CFG)
    with db.write() as s:
        s.execute(update(m.Wallet).values(status=m.STATUS_REFUSED, status_reason="test"))
    with pytest.raises(Refused, match="is refused"), db.write() as s:
        ledger.heartbeat(s, who(GOOD[0]), beat, now=NOW + 7, cfg=CFG)
    with db.read() as s:
        peer = s.get(m.Peer, GOOD[0].wallet_id)
        assert peer is not None and peer.last_heartbeat == NOW + 5  # no refused beat moved it


def test_reinstate_and_spot_check(db: Database) -> None:
    register_all(db, [BAD])
    with db.write() as s:
        ledger.record_spot_check(
            s, BAD.wallet_id, stage=0, round_=3, ok=False, detail="cosine 0.1", now=NOW, cfg=CFG.reputation
        )
    assert wallet_row(db, BAD).status == m.STATUS_REFUSED
    with db.write() as s:
        ledger.reinstate(s, BAD.wallet_id, None, now=NOW, cfg=CFG.reputation)
    row = wallet_row(db, BAD)
    assert (row.status, row.reputation) == (m.STATUS_ACTIVE, CFG.reputation.initial)
    with pytest.raises(Refused, match="not registered") as err, db.write() as s:
        ledger.reinstate(s, GOOD[2].wallet_id, None, now=NOW, cfg=CFG.reputation)
    assert err.value.code == "not_found"
    with db.read() as s:
        reasons = s.scalars(select(m.ReputationEvent.reason).order_by(m.ReputationEvent.id)).all()
    assert reasons[0].startswith("spot check failed in stage 0 round 3: cosine 0.1")
    assert reasons[1].startswith("reinstated by the operator")


def test_record_evaluation_validates(db: Database) -> None:
    with db.write() as s:
        ledger.record_evaluation(s, 5, 4.2, 4096, stderr=0.01, now=NOW)
    with db.read() as s:
        row = s.scalars(select(m.Evaluation)).one()
        assert (row.round, row.loss, row.loss_stderr, row.tokens) == (5, 4.2, 0.01, 4096)
    for bad in ({"loss": float("nan")}, {"loss": -1.0}, {"tokens": 0}, {"stderr": float("inf")}):
        args: dict[str, Any] = {"loss": 4.0, "tokens": 10, "stderr": None, **bad}
        with pytest.raises(ValueError), db.write() as s:
            ledger.record_evaluation(s, 1, args["loss"], args["tokens"], stderr=args["stderr"])
