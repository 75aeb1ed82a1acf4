"""Issue 19's Sybil flood at the verifier, with the real ledger on each database backend: a stage
of 8 admitted honest replicas (the operator's roster) and an attacker with 1,000 fresh wallets
that register, vote a forged θ every round and run ahead to settle rounds early. Then an
attacker that earned admission for 2 wallets by honest rounds and a passed spot check, and
turns: one Byzantine member among ten, out-voted and refused by reputation as before.

Prints the figures (rounds decided by probationers, honest reputations, seconds per round with
and without the flood) for bench/RESULTS.md: pytest tests/verifier/test_sybil.py -s."""

import time
from typing import Any

import pytest
from sqlalchemy import func, select

from neuroshard.node.wallet import Wallet
from neuroshard.protocol.reports import Receipt, RegisterRequest
from neuroshard.protocol.roster import Roster
from neuroshard.protocol.signing import SignedBy, new_nonce
from neuroshard.verifier import ledger, members
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database
from neuroshard.verifier.members import MembershipConfig
from neuroshard.verifier.reputation import ReputationConfig

NOW = 1_700_000_000.0
NETWORK = "sybil-test"
OPERATOR = Wallet.from_token("sybil-operator")
HONEST = [Wallet.from_token(f"sybil-honest-{i}") for i in range(8)]
FLOOD = 1000
ROUNDS = 4
CFG = ledger.LedgerConfig(
    reputation=ReputationConfig(),
    num_stages=1,
    nonce_window_s=60,
    membership=MembershipConfig(policy="probation", admission_rounds=2, spot_checks_required=1),
    network_name=NETWORK,
)


def who(wallet: Wallet) -> SignedBy:
    return SignedBy(public_key_hex=wallet.public_key_hex, timestamp=NOW, nonce=new_nonce())


def theta(round_: int, forged: bool = False) -> str:
    return f"f{round_:063x}" if forged else f"{round_:064x}"


def receipt(round_: int, forged: bool = False) -> Receipt:
    doc: dict[str, Any] = {
        "stage": 0,
        "round": round_,
        "inner_steps": 4,
        "start_step": 4 * round_,
        "tokens": 256,
        "data": [{"shard_id": 0, "offset_start": 0, "offset_end": 8}],
        "losses": [5.0] * 4,
        "base_hash": theta(round_ - 1) if round_ else "0" * 64,
        "result_hash": theta(round_, forged),
        "delta_digest": "d" * 64,
    }
    return Receipt.from_obj(doc)


def register(db: Database, wallets: list[Wallet]) -> None:
    req = RegisterRequest(address="http://127.0.0.1:9000", stage=0, software_version="0.1.0")
    with db.write() as s:
        for w in wallets:
            ledger.register(s, who(w), req, now=NOW, cfg=CFG)


def report(db: Database, wallets: list[Wallet], round_: int, *, forged: bool = False) -> None:
    """Every wallet's receipt for `round_` in one transaction, then settlement (as the API does)."""
    req = receipt(round_, forged)
    with db.write() as s:
        for w in wallets:
            ledger.submit_receipt(s, who(w), req, body_sha256=f"{w.wallet_id:0<64}", now=NOW, cfg=CFG)
    with db.write() as s:
        ledger.settle_rounds(s, 0, now=NOW, cfg=CFG)


def install_roster(db: Database) -> None:
    roster = Roster.build(
        OPERATOR,
        network=NETWORK,
        version=1,
        expires_at=int(NOW) + 86_400,
        stages={0: [w.public_key_hex for w in HONEST]},
    )
    with db.write() as s:
        members.accept_roster(
            s, roster, operator_key=OPERATOR.public_key_hex, network=NETWORK, num_stages=1, now=NOW
        )


def rounds(db: Database) -> list[m.Round]:
    with db.read() as s:
        return list(s.scalars(select(m.Round).order_by(m.Round.round)))


def reputations(db: Database, wallets: list[Wallet]) -> list[float]:
    with db.read() as s:
        return [s.get(m.Wallet, w.wallet_id).reputation for w in wallets]  # type: ignore[union-attr]


def honest_rounds(db: Database, first: int, last: int) -> float:
    """Seconds the honest replicas' receipts and settlements take for rounds first..last-1."""
    start = time.perf_counter()
    for r in range(first, last):
        report(db, HONEST, r)
    return (time.perf_counter() - start) / (last - first)


@pytest.mark.slow
def test_a_thousand_fresh_wallets_decide_nothing(db: Database) -> None:
    install_roster(db)
    register(db, HONEST)
    baseline = honest_rounds(db, 0, 2)
    sybils = [Wallet.from_token(f"sybil-{i}") for i in range(FLOOD)]
    register(db, sybils)
    with db.read() as s:
        on_probation = s.scalar(
            select(func.count()).select_from(m.Membership).where(m.Membership.status == m.MEMBER_PROBATION)
        )
    assert on_probation == FLOOD
    for r in range(2, 2 + ROUNDS):
        # The flood votes first and runs a round ahead: were they counted, they would settle
        # round r on their own before any honest receipt arrived, with their hash as majority.
        report(db, sybils, r, forged=True)
        report(db, sybils, r + 1, forged=True)
        assert all(row.round < r for row in rounds(db))
        start = time.perf_counter()
        report(db, HONEST, r)
        flooded = time.perf_counter() - start
    settled = rounds(db)
    decided_by_sybils = sum(row.majority_hash != theta(row.round) for row in settled)
    assert decided_by_sybils == 0 and len(settled) >= 2 + ROUNDS - 1
    assert all(row.votes == len(HONEST) == row.agreeing for row in settled)  # only members vote
    assert min(reputations(db, HONEST)) > ReputationConfig().initial
    with db.read() as s:
        doc = members.member_list(s, 0, CFG.membership, network=NETWORK, signer=OPERATOR, now=NOW)
        streaks = s.scalar(
            select(func.max(m.Membership.streak)).where(m.Membership.status == m.MEMBER_PROBATION)
        )
    assert set(doc.admitted) == {w.public_key_hex for w in HONEST}
    with db.read() as s:
        refused = s.scalar(
            select(func.count()).select_from(m.Wallet).where(m.Wallet.status == m.STATUS_REFUSED)
        )
    assert doc.probation == () and refused == FLOOD  # the forged votes cost the flood its reputation
    assert not streaks  # every forged vote restarted its wallet's probation
    print(
        f"\nsybil flood at the verifier ({db.engine.dialect.name}): {FLOOD} probationers x {ROUNDS} rounds, "
        f"{len(settled)} rounds settled, {decided_by_sybils} decided by probationers; honest round "
        f"{baseline * 1000:.1f} ms alone, {flooded * 1000:.1f} ms after the flood's receipts"
    )


def test_wallets_that_earned_admission_and_turn_are_outvoted(db: Database) -> None:
    install_roster(db)
    register(db, HONEST)
    turncoats = [Wallet.from_token(f"turncoat-{i}") for i in range(2)]
    register(db, turncoats)
    for r in range(3):  # honest work: two settled rounds with the majority...
        report(db, [*HONEST, *turncoats], r)
    for w in turncoats:  # ...and a passed replay spot check each
        with db.write() as s:
            ledger.record_spot_check(
                s, w.wallet_id, stage=0, round_=1, ok=True, detail="replay: ok", now=NOW,
                cfg=CFG.reputation, membership=CFG.membership,
            )  # fmt: skip
    with db.read() as s:
        assert members.counted(s, 0, CFG.membership, now=NOW) == {w.wallet_id for w in [*HONEST, *turncoats]}
    for r in range(3, 7):  # now admitted, they vote a forged θ
        report(db, HONEST, r)
        report(db, turncoats, r, forged=True)
    report(db, HONEST, 7)
    assert all(row.majority_hash == theta(row.round) for row in rounds(db))
    with db.read() as s:
        statuses = {s.get(m.Wallet, w.wallet_id).status for w in turncoats}  # type: ignore[union-attr]
    assert statuses == {m.STATUS_REFUSED}  # three minority rounds refuse a wallet, as before
