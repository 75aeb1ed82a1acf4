"""Membership with a price (verifier.members) through the ledger, on each database backend:
probation earned by rounds with the majority and a passed spot check, restarted by a minority
vote or a failed check; probationers never make a majority or settle a round; the operator's
roster (allowlist, versions, expiry); the signed member list and its epoch."""

from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import insert, select

from neuroshard.node.wallet import Wallet
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.reports import HeartbeatRequest, Receipt, RegisterRequest
from neuroshard.protocol.roster import MemberList, Roster
from neuroshard.protocol.signing import SignedBy, new_nonce
from neuroshard.verifier import ledger, members
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database
from neuroshard.verifier.members import MembershipConfig
from neuroshard.verifier.reputation import ReputationConfig

NOW = 1_700_000_000.0
NETWORK = "members-test"
OPERATOR = Wallet.from_token("members-operator")
FIRST = Wallet.from_token("members-genesis")
HONEST = [Wallet.from_token(f"members-honest-{i}") for i in range(3)]
SYBILS = [Wallet.from_token(f"members-sybil-{i}") for i in range(6)]
PROBATION = MembershipConfig(policy="probation", admission_rounds=2, spot_checks_required=1)


def config(membership: MembershipConfig = PROBATION) -> ledger.LedgerConfig:
    return ledger.LedgerConfig(
        reputation=ReputationConfig(),
        num_stages=2,
        nonce_window_s=60,
        membership=membership,
        network_name=NETWORK,
    )


def who(wallet: Wallet) -> SignedBy:
    return SignedBy(public_key_hex=wallet.public_key_hex, timestamp=NOW, nonce=new_nonce())


def theta(round_: int, honest: bool = True) -> str:
    return f"{round_:064x}" if honest else f"f{round_:063x}"


def receipt(round_: int, result: str, stage: int = 0) -> Receipt:
    doc: dict[str, Any] = {
        "stage": stage,
        "round": round_,
        "inner_steps": 4,
        "start_step": 4 * round_,
        "tokens": 256,
        "data": [{"shard_id": 0, "offset_start": 0, "offset_end": 8}],
        "losses": [5.0] * 4,
        "base_hash": theta(round_ - 1) if round_ else "0" * 64,
        "result_hash": result,
        "delta_digest": "d" * 64,
    }
    return Receipt.from_obj(doc)


def register(
    db: Database, wallets: list[Wallet], cfg: ledger.LedgerConfig, stage: int = 0, at: float = NOW
) -> None:
    req = RegisterRequest(address="http://127.0.0.1:9000", stage=stage, software_version="0.1.0")
    with db.write() as s:
        for w in wallets:
            ledger.register(s, who(w), req, now=at, cfg=cfg)


def vote(
    db: Database,
    wallet: Wallet,
    round_: int,
    cfg: ledger.LedgerConfig,
    honest: bool = True,
    at: float = NOW,
    stage: int = 0,
) -> None:
    req = receipt(round_, theta(round_, honest), stage)
    with db.write() as s:
        ledger.submit_receipt(s, who(wallet), req, body_sha256=req.result_hash, now=at, cfg=cfg)
    with db.write() as s:
        ledger.settle_rounds(s, stage, now=at, cfg=cfg)


def spot_check(
    db: Database, wallet: Wallet, round_: int, ok: bool, cfg: ledger.LedgerConfig, stage: int = 0
) -> None:
    with db.write() as s:
        ledger.record_spot_check(
            s,
            wallet.wallet_id,
            stage=stage,
            round_=round_,
            ok=ok,
            detail="replay: test",
            now=NOW,
            cfg=cfg.reputation,
            membership=cfg.membership,
        )


def status(db: Database, wallet: Wallet, stage: int = 0) -> str | None:
    with db.read() as s:
        row = s.get(m.Membership, (stage, wallet.wallet_id))
        return None if row is None else row.status


def listed(db: Database, cfg: ledger.LedgerConfig, stage: int = 0) -> MemberList:
    with db.read() as s:
        doc = members.member_list(s, stage, cfg.membership, network=NETWORK, signer=OPERATOR, now=NOW)
    parsed = MemberList.from_json(doc.to_json())
    parsed.verify(OPERATOR.public_key_hex, network=NETWORK, now=NOW)
    return parsed


def test_genesis_member_then_probation_until_rounds_and_a_spot_check(db: Database) -> None:
    cfg = config()
    register(db, [FIRST, HONEST[0]], cfg)
    assert (status(db, FIRST), status(db, HONEST[0])) == ("admitted", "probation")
    first = listed(db, cfg)
    assert first.admitted == (FIRST.public_key_hex,) and first.probation == (HONEST[0].public_key_hex,)
    for r in range(3):  # round r settles once round r+1 is in (settle_after_rounds=1)
        vote(db, FIRST, r, cfg)
        vote(db, HONEST[0], r, cfg)
    # rounds 0 and 1 settled with the majority: rounds enough, but no spot check passed yet
    assert status(db, HONEST[0]) == "probation"
    spot_check(db, HONEST[0], 1, True, cfg)
    assert status(db, HONEST[0]) == "admitted"
    later = listed(db, cfg)
    assert set(later.admitted) == {FIRST.public_key_hex, HONEST[0].public_key_hex} and later.probation == ()
    assert later.epoch > first.epoch and later.newer_than(first)


def test_a_later_stage_probationer_is_admitted_only_after_a_spot_check(db: Database) -> None:
    """Segment checks replay every pipeline stage, so a stage-1 probationer's rounds with the
    majority are not enough either (before, a later stage's were: a key that learned the majority
    hash was admitted without doing the pipeline's work). It is on the replay checker's list of
    receipts to draw first once it has done all but its last round, and only there."""
    cfg = config()
    register(db, [FIRST, HONEST[0]], cfg, stage=1)
    register(db, [HONEST[1]], cfg)  # stage 0's genesis member
    assert (status(db, FIRST, 1), status(db, HONEST[0], 1)) == ("admitted", "probation")
    with db.read() as s:
        assert members.awaiting_checks(s, cfg.membership) == set()
    for r in range(3):
        vote(db, FIRST, r, cfg, stage=1)
        vote(db, HONEST[0], r, cfg, stage=1)
    assert status(db, HONEST[0], 1) == "probation"  # rounds enough, no spot check yet
    with db.read() as s:
        assert members.awaiting_checks(s, cfg.membership) == {(1, HONEST[0].wallet_id)}
    spot_check(db, HONEST[0], 1, True, cfg, stage=1)
    assert status(db, HONEST[0], 1) == "admitted"
    with db.read() as s:
        assert members.awaiting_checks(s, cfg.membership) == set()
    # With no checks asked for (no replays), rounds alone admit, at every stage as before.
    none = config(replace(PROBATION, spot_checks_required=0))
    register(db, [HONEST[2]], none, stage=1)
    for r in range(3, 6):
        vote(db, FIRST, r, none, stage=1)
        vote(db, HONEST[0], r, none, stage=1)
        vote(db, HONEST[2], r, none, stage=1)
    assert status(db, HONEST[2], 1) == "admitted"


def test_a_minority_vote_restarts_probation(db: Database) -> None:
    cfg = config()
    register(db, [FIRST, HONEST[0]], cfg)
    spot_check(db, HONEST[0], 0, True, cfg)
    vote(db, FIRST, 0, cfg)
    vote(db, HONEST[0], 0, cfg)
    vote(db, FIRST, 1, cfg)
    vote(db, HONEST[0], 1, cfg, honest=False)  # round 0 settles: streak 1
    vote(db, FIRST, 2, cfg)  # round 1 settles: HONEST[0] in the minority
    with db.read() as s:
        row = s.get(m.Membership, (0, HONEST[0].wallet_id))
        assert row is not None
        assert (row.status, row.streak, row.checks_passed) == ("probation", 0, 0)
        assert row.reason is not None and "minority hash in round 1" in row.reason


def test_late_receipts_bring_a_probationer_no_nearer_admission(db: Database) -> None:
    """Receipts sent after their rounds settled escape the spot checks: with the majority they
    count for nothing, against it they still restart probation."""
    cfg = config()
    register(db, [FIRST, HONEST[0]], cfg)
    spot_check(db, HONEST[0], 0, True, cfg)
    for r in range(4):
        vote(db, FIRST, r, cfg)  # rounds 0..2 settle with FIRST alone
    for r in range(2):
        vote(db, HONEST[0], r, cfg)  # late, with the majority
    with db.read() as s:
        row = s.get(m.Membership, (0, HONEST[0].wallet_id))
        assert row is not None and (row.status, row.streak) == ("probation", 0)
    vote(db, HONEST[0], 2, cfg, honest=False)  # late, against it
    with db.read() as s:
        row = s.get(m.Membership, (0, HONEST[0].wallet_id))
        assert row is not None and row.reason is not None and "minority hash in round 2" in row.reason


def test_a_late_minority_receipt_restarts_probation_after_later_rounds_were_counted(db: Database) -> None:
    """The streak counts each round once, in order; a vote against the majority restarts probation
    whenever it arrives, also for a round older than the last one counted."""
    cfg = config()
    register(db, [FIRST, HONEST[0]], cfg)
    vote(db, FIRST, 0, cfg)
    vote(db, HONEST[0], 0, cfg)
    vote(db, FIRST, 1, cfg)  # round 0 settles: streak 1
    vote(db, FIRST, 2, cfg)  # round 1 settles without HONEST[0]'s receipt
    vote(db, HONEST[0], 2, cfg)
    vote(db, FIRST, 3, cfg)  # round 2 settles: streak 2
    with db.read() as s:
        row = s.get(m.Membership, (0, HONEST[0].wallet_id))
        assert row is not None and (row.streak, row.last_round) == (2, 2)
    vote(db, HONEST[0], 1, cfg, honest=False)  # round 1's receipt, late and against the majority
    with db.read() as s:
        row = s.get(m.Membership, (0, HONEST[0].wallet_id))
        assert row is not None and (row.status, row.streak, row.last_round) == ("probation", 0, 2)
        assert row.reason is not None and "minority hash in round 1" in row.reason


def test_a_failed_spot_check_sends_a_member_back_to_probation(db: Database) -> None:
    cfg = replace(config(), reputation=ReputationConfig(spot_check_penalty=0.1))  # not refused outright
    register(db, [FIRST], cfg)
    before = listed(db, cfg)
    spot_check(db, FIRST, 0, False, cfg)
    assert status(db, FIRST) == "probation"
    after = listed(db, cfg)
    assert after.admitted == () and after.probation == (FIRST.public_key_hex,) and after.epoch > before.epoch


def test_a_data_check_pass_does_not_count_toward_admission(db: Database) -> None:
    cfg = config()
    register(db, [FIRST, HONEST[0]], cfg)
    with db.write() as s:  # datacheck passes no membership config
        ledger.record_spot_check(
            s, HONEST[0].wallet_id, stage=0, round_=0, ok=True, detail="data", now=NOW, cfg=cfg.reputation
        )
        row = s.get(m.Membership, (0, HONEST[0].wallet_id))
        assert row is not None and row.checks_passed == 0


def test_probationers_neither_make_the_majority_nor_settle_rounds(db: Database) -> None:
    """Six fresh wallets vote a bogus θ against one member: the member's hash is the majority,
    the Sybils are judged against it, and their moving on settles nothing."""
    cfg = config()
    register(db, [FIRST, *SYBILS], cfg)
    for w in SYBILS:
        vote(db, w, 0, cfg, honest=False)
        vote(db, w, 1, cfg, honest=False)  # a round later: would settle round 0 if they counted
    with db.read() as s:
        assert s.get(m.Round, (0, 0)) is None
    vote(db, FIRST, 0, cfg)
    vote(db, FIRST, 1, cfg)
    with db.read() as s:
        settled = s.get(m.Round, (0, 0))
        assert settled is not None
        assert (settled.majority_hash, settled.votes, settled.agreeing) == (theta(0), 1, 1)
        sybil = s.get(m.Wallet, SYBILS[0].wallet_id)
        first = s.get(m.Wallet, FIRST.wallet_id)
        assert sybil is not None and first is not None
        assert sybil.reputation < 0.5 < first.reputation


def test_open_policy_counts_everyone_as_before(db: Database) -> None:
    cfg = config(MembershipConfig())
    register(db, [FIRST, *SYBILS[:2]], cfg)
    assert [status(db, w) for w in (FIRST, *SYBILS[:2])] == ["admitted"] * 3
    doc = listed(db, cfg)
    assert doc.policy == "open" and len(doc.admitted) == 3 and doc.probation == ()


def _roster(version: int, wallets: list[Wallet], *, expires_at: int = int(NOW) + 3600, **kw: Any) -> Roster:
    return Roster.build(
        kw.get("signer", OPERATOR),
        network=kw.get("network", NETWORK),
        version=version,
        expires_at=expires_at,
        stages={0: [w.public_key_hex for w in wallets]},
    )


def _accept(db: Database, roster: Roster, now: float = NOW) -> str:
    with db.write() as s:
        return members.accept_roster(
            s, roster, operator_key=OPERATOR.public_key_hex, network=NETWORK, num_stages=2, now=now
        )


def test_allowlist_admits_the_roster_and_refuses_the_rest(db: Database) -> None:
    cfg = config(MembershipConfig(policy="allowlist"))
    with pytest.raises(Refused, match="not on the operator's roster for stage 0 \\(none accepted yet\\)"):
        register(db, [HONEST[0]], cfg)
    assert _accept(db, _roster(1, HONEST[:2])) == "accepted"
    register(db, HONEST[:2], cfg)
    with pytest.raises(Refused, match="version 1") as refused:
        register(db, [SYBILS[0]], cfg)
    assert refused.value.code == "not_on_roster"
    with db.read() as s:
        assert s.get(m.Wallet, SYBILS[0].wallet_id) is None  # nothing of the refused registration stays
    doc = listed(db, cfg)
    assert set(doc.admitted) == {w.public_key_hex for w in HONEST[:2]} and doc.probation == ()
    # A newer roster replaces the older: HONEST[1] is off the list, HONEST[2] on it.
    assert _accept(db, _roster(2, [HONEST[0], HONEST[2]])) == "accepted"
    assert set(listed(db, cfg).admitted) == {HONEST[0].public_key_hex, HONEST[2].public_key_hex}


@pytest.mark.parametrize(
    "bad, status_, message",
    [
        (lambda: _roster(1, HONEST, signer=HONEST[0]), 422, "signed by"),
        (lambda: _roster(1, HONEST, network="other"), 422, "for network 'other'"),
        (lambda: _roster(1, HONEST, expires_at=int(NOW) - 1), 422, "expired"),
        (lambda: replace(_roster(1, HONEST), version=7), 422, "signature does not verify"),
        (
            lambda: Roster.build(
                OPERATOR, network=NETWORK, version=1, expires_at=int(NOW) + 60, stages={5: []}
            ),
            422,
            "stage 5",
        ),
    ],
    ids=["wrong signer", "other network", "expired", "tampered", "no such stage"],
)
def test_bad_rosters_are_refused_and_change_nothing(
    db: Database, bad: Any, status_: int, message: str
) -> None:
    with pytest.raises(Refused, match=message) as refused:
        _accept(db, bad())
    assert refused.value.code == "bad_roster"
    with db.read() as s:
        assert s.scalars(select(m.RosterRow)).all() == []
        assert members.epoch(s, 0) == 0


def test_roster_versions_only_move_forward_and_expire(db: Database) -> None:
    assert _accept(db, _roster(2, HONEST[:1])) == "accepted"
    assert _accept(db, _roster(2, HONEST[:1])) == "duplicate"
    with pytest.raises(Refused, match="different roster version 2") as same:
        _accept(db, _roster(2, HONEST[:2]))
    assert same.value.code == "conflict"
    with pytest.raises(Refused, match="older than the held version 2"):
        _accept(db, _roster(1, HONEST))
    with db.read() as s:
        held = members.current_roster(s, now=NOW)
        assert held is not None and held.version == 2
        assert members.current_roster(s, now=NOW + 7200) is None  # expired: no roster in force


def test_a_roster_that_expires_leaves_the_lists_with_a_new_epoch(db: Database) -> None:
    """One epoch, one list: past its roster's expiry a list of the same epoch still names the
    roster's wallets (a node holding that epoch must not be told another list under it); the
    sweep's check (`roster_expired`) then moves the epoch, and the new list leaves them out."""
    cfg = config(MembershipConfig(policy="allowlist"))
    _accept(db, _roster(1, HONEST[:2], expires_at=int(NOW) + 60))
    register(db, HONEST[:2], cfg)
    before = listed(db, cfg)
    assert set(before.admitted) == {w.public_key_hex for w in HONEST[:2]}
    late = NOW + 61
    with db.read() as s:
        again = members.member_list(s, 0, cfg.membership, network=NETWORK, signer=OPERATOR, now=late)
        assert (again.epoch, again.admitted) == (before.epoch, before.admitted)
        assert not members.roster_expired(s, 0, now=NOW + 59)
        assert members.roster_expired(s, 0, now=late)
    with db.write() as s:
        members.bump_epoch(s, 0, now=late)
    with db.read() as s:
        assert not members.roster_expired(s, 0, now=late)
        after = members.member_list(s, 0, cfg.membership, network=NETWORK, signer=OPERATOR, now=late)
    assert after.epoch > before.epoch and after.admitted == ()


def test_roster_wallets_are_admitted_under_probation(db: Database) -> None:
    cfg = config()
    _accept(db, _roster(1, [HONEST[0]]))
    register(db, [HONEST[0], SYBILS[0]], cfg)  # the roster names stage 0's members: no genesis
    assert (status(db, HONEST[0]), status(db, SYBILS[0])) == ("admitted", "probation")


def test_refused_wallets_are_on_no_list(db: Database) -> None:
    cfg = config(MembershipConfig())
    register(db, [FIRST, HONEST[0]], cfg)
    with db.write() as s:
        row = s.get(m.Wallet, HONEST[0].wallet_id)
        assert row is not None
        row.status = m.STATUS_REFUSED
    assert listed(db, cfg).admitted == (FIRST.public_key_hex,)


def test_the_list_is_identical_within_an_expiry_window(db: Database) -> None:
    cfg = config()
    register(db, [FIRST], cfg)
    with db.read() as s:
        a = members.member_list(s, 0, cfg.membership, network=NETWORK, signer=OPERATOR, now=NOW)
        b = members.member_list(s, 0, cfg.membership, network=NETWORK, signer=OPERATOR, now=NOW + 1)
    assert a.to_json() == b.to_json() and a.expires_at > NOW + cfg.membership.list_ttl_s


def test_the_0005_upgrade_admits_existing_peers(db: Database) -> None:
    from alembic import command

    from neuroshard.verifier.db import alembic_config

    with db.engine.begin() as conn:
        command.downgrade(alembic_config(conn), "0004")
    with db.engine.begin() as conn:
        conn.execute(
            insert(m.Wallet.__table__).values(
                wallet_id="a" * 20, public_key="b" * 64, reputation=0.5, status="active",
                registered_at=0.0, software_version="x",
            )
        )  # fmt: skip
        conn.execute(
            insert(m.Peer.__table__).values(
                wallet_id="a" * 20, address="http://x:1", stage=1, registered_at=0.0, last_heartbeat=0.0
            )
        )
    db.upgrade()
    with db.read() as s:
        row = s.get(m.Membership, (1, "a" * 20))
        assert row is not None and row.status == "admitted"


def test_honest_work_climbs_past_idle_keys_in_a_capped_list(db: Database) -> None:
    """The list names at most `max_probation_listed` probationers, furthest along first: idle keys
    registered earlier do not keep a working newcomer off it, and each change is a new epoch.
    (No places kept for turns here: the ranking by progress alone.)"""
    cfg = config(replace(PROBATION, max_probation_listed=2, admission_rounds=5, probation_turns=0.0))
    register(db, [FIRST, *SYBILS[:4]], cfg)
    register(db, [HONEST[0]], cfg, at=NOW + 10)  # the last to register: named now only by the draw
    vote(db, FIRST, 0, cfg)
    vote(db, HONEST[0], 0, cfg)
    before = listed(db, cfg)
    vote(db, FIRST, 1, cfg)  # round 0 settles: HONEST[0] has one round with the majority
    after = listed(db, cfg)
    assert after.probation[0] == HONEST[0].public_key_hex and len(after.probation) == 2
    assert after.epoch > before.epoch


TURN_S = 100.0
PER_TURN = PROBATION.lead_rounds + members.TURN_ROUNDS
"""Rounds a turn needs past its start before the next may start."""


def next_turn(db: Database, cfg: ledger.LedgerConfig, at: float, stage: int = 0) -> str:
    with db.write() as s:
        return members.next_turn(s, stage, cfg.membership, now=at, alive_s=cfg.peer_ttl_s)


def turn(db: Database, stage: int = 0) -> members.Turn | None:
    with db.read() as s:
        return members.turn_of(s, stage)


def turns(**over: Any) -> ledger.LedgerConfig:
    return config(replace(PROBATION, probation_turn_s=TURN_S, **over))


class Rounds:
    """The genesis member reporting the stage's rounds one after another (settling each but the
    last), and probationers voting with it."""

    def __init__(self, db: Database, cfg: ledger.LedgerConfig) -> None:
        self.db, self.cfg, self.next = db, cfg, 0
        self.report(1)  # round 0: from now on, each `report(n)` moves the newest round by n

    def report(self, n: int, *voters: Wallet) -> None:
        for _ in range(n):
            for w in voters:
                vote(self.db, w, self.next, self.cfg)
            vote(self.db, FIRST, self.next, self.cfg)
            self.next += 1


def test_new_probationers_take_turns_on_a_full_list(db: Database) -> None:
    """Idle keys registered first do not hold a full list's places for ever: those without
    progress take the places in turns, round-robin (least recently named, then the longest
    waiting), each turn a new epoch, so with N waiting for P places every one is named within
    ⌈N / P⌉ turns. A turn ends once its time is over and the stage settled rounds past its start."""
    cfg = turns(max_probation_listed=2, probation_turns=0.5)
    register(db, [FIRST, *SYBILS[:4]], cfg)
    register(db, [HONEST[0]], cfg, at=NOW + 10)  # the last to register: by age it would never be named
    new = {w.public_key_hex for w in [*SYBILS[:4], HONEST[0]]}
    rounds = Rounds(db, cfg)
    first_named: dict[str, int] = {}
    epochs = [listed(db, cfg).epoch]
    at = NOW
    for i in range(6):
        doc = listed(db, cfg)
        assert len(doc.probation) == 2 and set(doc.probation) <= new
        for key in doc.probation:
            first_named.setdefault(key, i)
        rounds.report(PER_TURN)
        assert next_turn(db, cfg, at + TURN_S / 2) == "not due"  # within a turn, nothing moves
        at += TURN_S
        assert next_turn(db, cfg, at) == "started"  # the turn is over and three wait off the list
        assert turn(db) == members.Turn(i + 1, at, rounds.next - 1)
        epochs.append(listed(db, cfg).epoch)
    assert set(first_named) == new and max(first_named.values()) <= 2  # ⌈5 / 2⌉ turns
    assert epochs == sorted(set(epochs))  # every turn a new epoch


def beat(db: Database, cfg: ledger.LedgerConfig, at: float, *wallets: Wallet) -> None:
    with db.write() as s:
        for w in wallets:
            req = HeartbeatRequest(stage=0, round=0, steps_in_round=0)
            ledger.heartbeat(s, who(w), req, now=at, cfg=cfg)


def test_probationers_alive_at_a_turns_start_go_ahead_of_idle_keys(db: Database) -> None:
    """Keys that registered and went away (a flood, or people who tried once and left) hold places
    only when nobody alive wants them: a probationer whose replica sent a heartbeat within
    `peer_ttl_s` when the turn began is named ahead of every idle one, in the first turn that
    starts after it registered, however many idle keys wait, and it stays named while it stays
    alive; it goes back behind the idle ones when it stops. Heartbeats within a turn change
    nothing until the next (a list changes only with its epoch)."""
    cfg = turns(max_probation_listed=2, probation_turns=1.0)
    assert cfg.peer_ttl_s < TURN_S - 5  # a heartbeat 5 s into a turn is stale at its end
    idle = SYBILS[:4]
    register(db, [FIRST, *idle], cfg)
    register(db, HONEST[:2], cfg, at=NOW + 10)
    keys = lambda ws: {w.public_key_hex for w in ws}  # noqa: E731
    rounds = Rounds(db, cfg)
    first = set(listed(db, cfg).probation)
    assert len(first) == 2 and first <= keys(idle)  # in this turn the newcomers registered late
    rounds.report(PER_TURN)
    at = NOW + TURN_S
    beat(db, cfg, at - 10, *HONEST[:2])
    assert next_turn(db, cfg, at) == "started"
    assert set(listed(db, cfg).probation) == keys(HONEST[:2])  # ahead of the idle never named
    for _ in range(2):  # named last turn, and still ahead of the idle ones while alive
        before = listed(db, cfg)
        beat(db, cfg, at + 5, *idle)  # within the turn (stale by its end): the list does not move
        assert listed(db, cfg) == before
        rounds.report(PER_TURN)
        at += TURN_S
        beat(db, cfg, at - 10, *HONEST[:2])
        assert next_turn(db, cfg, at) == "started"
        assert set(listed(db, cfg).probation) == keys(HONEST[:2])
    rounds.report(PER_TURN)
    at += TURN_S  # they went away: the idle keys never named take the turn
    assert next_turn(db, cfg, at) == "started"
    assert set(listed(db, cfg).probation) == keys(idle) - first


def test_a_turn_nobody_waits_for_marks_the_alive_unless_the_epoch_moved_meanwhile(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list that names everyone waiting keeps its names, so when nobody waits the turn's clock
    restarts and the alive are marked with no new epoch. That write is made only if the epoch has
    not moved since the standings were read: a registration committed meanwhile by another process
    must not get its rank from marks its own epoch's list did not have."""
    cfg = turns(max_probation_listed=4, probation_turns=1.0)
    register(db, [FIRST, *SYBILS[:2]], cfg)
    Rounds(db, cfg).report(PER_TURN)
    at = NOW + TURN_S
    beat(db, cfg, at - 10, SYBILS[0])
    before = listed(db, cfg)
    assert next_turn(db, cfg, at) == "nobody waits"
    assert listed(db, cfg) == before
    with db.read() as s:
        alive = {w: s.get(m.Membership, (0, w.wallet_id)).alive_turn for w in SYBILS[:2]}  # type: ignore[union-attr]
    assert alive == {SYBILS[0]: 0, SYBILS[1]: None} and turn(db) == members.Turn(0, at, 0)
    real = members.standings

    def meanwhile(session: Any, stage: int) -> list[members.Standing]:
        rows = real(session, stage)
        members.bump_epoch(session, stage, now=at)  # stands for another process's registration
        return rows

    monkeypatch.setattr(members, "standings", meanwhile)
    assert next_turn(db, cfg, at + TURN_S) == "raced"
    assert turn(db) == members.Turn(0, at, 0)  # the clock did not restart


def test_a_turn_lasts_until_its_list_had_rounds_to_work_in(db: Database) -> None:
    """However long ago the turn began, a stage whose rounds are slower than turns keeps the
    turn's list until rounds past its start settled."""
    cfg = turns(max_probation_listed=1, probation_turns=1.0)
    register(db, [FIRST, *SYBILS[:3]], cfg)
    rounds = Rounds(db, cfg)
    rounds.report(PER_TURN - 1)
    assert next_turn(db, cfg, NOW + 50 * TURN_S) == "not due"
    rounds.report(1)
    assert next_turn(db, cfg, NOW + 50 * TURN_S) == "started"


def test_a_far_off_round_claimed_by_a_probationer_moves_no_turn_and_no_list(db: Database) -> None:
    """A probationer's receipt for round 2²⁹ − 1 neither ends the turn early nor freezes turns
    and lists for ever: a turn counts the rounds the stage settled, and a list takes effect at
    most `REPORT_SLACK` rounds past them."""
    cfg = turns(max_probation_listed=1, probation_turns=1.0)
    register(db, [FIRST, *SYBILS[:3]], cfg)
    rounds = Rounds(db, cfg)
    with db.write() as s:
        far = receipt(2**29 - 1, theta(2**29 - 1))
        ledger.submit_receipt(s, who(SYBILS[0]), far, body_sha256=far.result_hash, now=NOW, cfg=cfg)
    assert next_turn(db, cfg, NOW + TURN_S) == "not due"
    rounds.report(PER_TURN)
    assert next_turn(db, cfg, NOW + TURN_S) == "started"
    capped = rounds.next - 1 + members.REPORT_SLACK  # the stage's settled rounds, and the slack at most
    assert turn(db) == members.Turn(1, NOW + TURN_S, capped)
    assert listed(db, cfg).effective_round == capped + cfg.membership.lead_rounds


def test_a_registration_within_a_turn_keeps_its_names(db: Database) -> None:
    """A registration (a new epoch) after the turn's time is over does not change who is named:
    a key that registered after the turn began waits for the next one."""
    cfg = turns(max_probation_listed=2, probation_turns=1.0)
    register(db, [FIRST, *SYBILS[:5]], cfg)
    Rounds(db, cfg).report(PER_TURN)
    for k in range(3):
        before = listed(db, cfg)
        register(db, [HONEST[k]], cfg, at=NOW + (k + 1) * 3 * TURN_S)
        after = listed(db, cfg)
        assert after.epoch > before.epoch and after.probation == before.probation
    assert turn(db) == members.Turn(0, NOW, 0)


def test_a_newcomer_keeps_its_place_by_a_round_with_the_majority(db: Database) -> None:
    """A newcomer named in its turn that does a round with the majority stays named while it keeps
    doing rounds, even where progress finds no place of its own (it takes turns from where it
    was); once nobody waits off the list, turns stop (no new epochs)."""
    cfg = turns(admission_rounds=50, max_probation_listed=2, probation_turns=0.5)
    register(db, [FIRST, *SYBILS[:4], HONEST[0]], cfg)
    rounds = Rounds(db, cfg)
    at = NOW
    for _ in range(6):  # until HONEST[0]'s turn
        if HONEST[0].public_key_hex in listed(db, cfg).probation:
            break
        rounds.report(PER_TURN)
        at += TURN_S
        assert next_turn(db, cfg, at) == "started"
    else:
        pytest.fail("HONEST[0] was never named")
    rounds.report(2, HONEST[0])  # its round settles with HONEST[0] in the majority
    assert HONEST[0].public_key_hex in listed(db, cfg).probation  # named by its progress now
    for _ in range(8):
        rounds.report(PER_TURN, HONEST[0])
        at += TURN_S
        assert next_turn(db, cfg, at) == "started"
        assert HONEST[0].public_key_hex in listed(db, cfg).probation
    for w in SYBILS[:3]:  # the idle keys leave (refused): nobody waits, no more turns
        with db.write() as s:
            ledger.apply_adjustment(
                s, ledger.Adjustment(w.wallet_id, -1.0, "test: refused"), stage=0, round_=None, now=NOW,
                cfg=cfg.reputation,
            )  # fmt: skip
    rounds.report(PER_TURN, HONEST[0])
    epoch = listed(db, cfg).epoch
    assert next_turn(db, cfg, at + 2 * TURN_S) == "nobody waits"
    assert listed(db, cfg).epoch == epoch
    assert set(listed(db, cfg).probation) == {HONEST[0].public_key_hex, SYBILS[3].public_key_hex}


def test_progress_left_idle_goes_back_to_taking_turns(db: Database) -> None:
    """Keys that did a round once and went idle hold places by progress only for
    `probation_idle_rounds` before a turn's start; then they take turns like the rest, while a
    probationer that keeps doing rounds keeps its place."""
    cfg = turns(max_probation_listed=4, probation_turns=0.25, probation_idle_rounds=2, admission_rounds=99)
    register(db, [FIRST, *SYBILS[:4], *HONEST[:2]], cfg)
    rounds = Rounds(db, cfg)
    rounds.report(2, *SYBILS[:2], HONEST[0])  # round 1 settled with the three in its majority
    idle = {w.public_key_hex for w in SYBILS[:2]}
    assert idle | {HONEST[0].public_key_hex} <= set(listed(db, cfg).probation)  # three places of four
    missing: set[str] = set()
    at = NOW
    for _ in range(10):
        rounds.report(PER_TURN, HONEST[0])
        at += TURN_S
        assert next_turn(db, cfg, at) == "started"
        named = set(listed(db, cfg).probation)
        assert HONEST[0].public_key_hex in named and len(named) == 4
        missing |= idle - named
    assert missing == idle  # each idle key was left out in some turn


def test_no_turn_without_someone_waiting_or_a_place_for_turns(db: Database) -> None:
    """Nobody waiting off the list: no new epoch, the turn's clock starts again. No place kept
    for turns, or another policy: never due."""
    cfg = turns(max_probation_listed=8, probation_turns=0.25)
    register(db, [FIRST, *SYBILS[:3]], cfg)
    Rounds(db, cfg).report(PER_TURN)
    epoch = listed(db, cfg).epoch
    assert next_turn(db, cfg, NOW + TURN_S) == "nobody waits"
    assert listed(db, cfg).epoch == epoch and turn(db) == members.Turn(0, NOW + TURN_S, 0)
    assert next_turn(db, cfg, NOW + 1.5 * TURN_S) == "not due"  # read again a turn later
    none = turns(max_probation_listed=1, probation_turns=0.0)
    assert next_turn(db, none, NOW + 10 * TURN_S) == "not due"
    for policy in ("open", "allowlist"):
        assert next_turn(db, turns(policy=policy), NOW + 10 * TURN_S) == "not due"
    assert listed(db, cfg).epoch == epoch


def test_a_turn_moved_by_another_process_first_is_left_alone(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two leads at a lease handover: the one that finds the turn already moved changes nothing."""
    cfg = turns(max_probation_listed=1, probation_turns=1.0)
    register(db, [FIRST, *SYBILS[:3]], cfg)
    Rounds(db, cfg).report(PER_TURN)
    stale = turn(db)
    assert stale is not None and next_turn(db, cfg, NOW + TURN_S) == "started"
    epoch = listed(db, cfg).epoch
    monkeypatch.setattr(members, "turn_due", lambda *a, **k: stale)  # it read the turn before
    assert next_turn(db, cfg, NOW + TURN_S) == "raced"
    assert listed(db, cfg).epoch == epoch and turn(db) == members.Turn(
        1, NOW + TURN_S, stale.round + PER_TURN
    )


def test_a_refused_or_reinstated_wallet_moves_its_stage_s_epoch(db: Database) -> None:
    """A wallet refused for its reputation leaves its stage's list, one reinstated comes back: a
    new epoch each time, so one epoch is one list."""
    cfg = turns(max_probation_listed=8)
    register(db, [FIRST, *SYBILS[:2]], cfg)
    before = listed(db, cfg)
    with db.write() as s:
        ledger.apply_adjustment(
            s, ledger.Adjustment(SYBILS[0].wallet_id, -1.0, "test: refused"), stage=0, round_=None, now=NOW,
            cfg=cfg.reputation,
        )  # fmt: skip
    refused = listed(db, cfg)
    assert refused.epoch > before.epoch and SYBILS[0].public_key_hex not in refused.probation
    with db.write() as s:
        ledger.reinstate(s, SYBILS[0].wallet_id, None, now=NOW, cfg=cfg.reputation)
    back = listed(db, cfg)
    assert back.epoch > refused.epoch and SYBILS[0].public_key_hex in back.probation


def test_a_list_read_while_its_epoch_moves_is_read_again(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registration committed while a list is being read (each statement may see the latest
    commit) moves the epoch: the list is read again, and an epoch is served with one list; a
    membership that keeps moving gets a busy refusal rather than a list."""
    cfg = turns(max_probation_listed=8)
    register(db, [FIRST, *SYBILS[:2]], cfg)
    real, raced = members.standings, []

    def racing(session: Any, stage: int) -> list[members.Standing]:
        if not raced:
            raced.append(True)
            register(db, [HONEST[0]], cfg)  # its own transaction, committed now
        return real(session, stage)

    monkeypatch.setattr(members, "standings", racing)
    doc = listed(db, cfg)
    assert raced and HONEST[0].public_key_hex in doc.probation
    monkeypatch.setattr(members, "standings", real)
    assert doc.to_json() == listed(db, cfg).to_json()

    def always(session: Any, stage: int) -> list[members.Standing]:
        with db.write() as other:
            members.bump_epoch(other, stage, now=NOW)
        return real(session, stage)

    monkeypatch.setattr(members, "standings", always)
    with pytest.raises(Refused) as refused:
        listed(db, cfg)
    assert refused.value.code == "busy"


def test_a_round_in_its_turn_costs_a_probationer_no_place() -> None:
    """X, named in turns, does its round: it joins those with progress, finds no place there (the
    share kept for turns leaves two), and takes turns from where it was, so it stays named and the
    probationer with more progress that was waiting stays waiting."""

    def standing(key: str, streak: int, since: float = 0.0, named: int | None = None) -> members.Standing:
        return members.Standing(key, key, "probation", streak, 0, since, None, 10 if streak else None, named)

    cfg = replace(PROBATION, max_probation_listed=4, probation_turns=0.5)
    at = members.Turn(3, 100.0, 10)
    before = [
        standing("w1", 5),
        standing("w2", 4),
        standing("w3", 3, named=2),  # named in the turn before: behind i1 and x
        standing("i1", 0, 1.0),
        standing("x", 0, 2.0),
    ]
    after = [*before[:4], standing("x", 1, 2.0)]
    named = members.listed_probation(before, cfg, turn=at).listed
    assert sorted(named) == ["i1", "w1", "w2", "x"]
    assert sorted(members.listed_probation(after, cfg, turn=at).listed) == sorted(named)


def test_a_restarted_probation_is_a_new_epoch(db: Database) -> None:
    """A probationer voting with the minority restarts (a later `since`: it ranks last in turns),
    which can change who is named: a new epoch, so one epoch is one list."""
    cfg = turns(max_probation_listed=1, probation_turns=1.0)
    register(db, [FIRST, *SYBILS[:2]], cfg)
    rounds = Rounds(db, cfg)
    before = listed(db, cfg)
    named = next(w for w in SYBILS[:2] if w.public_key_hex in before.probation)
    later = NOW + 50  # after the turn began
    vote(db, named, rounds.next, cfg, honest=False, at=later)
    vote(db, FIRST, rounds.next, cfg, at=later)
    vote(db, FIRST, rounds.next + 1, cfg, at=later)  # the round settles: the minority restarts
    after = listed(db, cfg)
    assert after.epoch > before.epoch and named.public_key_hex not in after.probation


def test_places_kept_for_turns_never_exceed_the_list() -> None:
    """Recent progress fills what turns do not keep; turns take what progress leaves, and progress
    beyond its places takes turns from where it was."""

    def standing(key: str, streak: int, named: int | None = None) -> members.Standing:
        return members.Standing(key, key, "probation", streak, 0, 0.0, None, 10 if streak else None, named)

    working = [standing(f"w{i}", 1 + i, named=0) for i in range(5)]
    new = [standing(f"n{i}", 0, named=None if i < 3 else 1) for i in range(5)]
    cfg = replace(PROBATION, max_probation_listed=4, probation_turns=0.25)
    at = members.Turn(2, 0.0, 10)
    got = members.listed_probation(working + new, cfg, turn=at)
    # w1 and w0 find no place by progress: they take turns after those never named (n0 to n2)
    assert got.listed == ["w4", "w3", "w2", "n0"] and got.unlisted_turns == 6
    got = members.listed_probation(working[:1] + new, cfg, turn=at)
    assert got.listed == ["w0", "n0", "n1", "n2"] and got.unlisted_turns == 2
    got = members.listed_probation(working, cfg, turn=at)  # nobody else: the rest of progress takes turns
    assert got.listed == ["w4", "w3", "w2", "w0"] and got.unlisted_turns == 1
    stale = members.Turn(2, 0.0, 10 + cfg.probation_idle_rounds + 1)  # their rounds are too old now
    assert members.listed_probation(working + new, cfg, turn=stale).listed == ["n0", "n1", "n2", "w0"]
    with pytest.raises(ValueError, match="probation_turns"):
        replace(PROBATION, probation_turns=1.5)
    with pytest.raises(ValueError, match="probation_turn_s"):
        replace(PROBATION, probation_turn_s=0.0)
    with pytest.raises(ValueError, match="probation_idle_rounds"):
        replace(PROBATION, probation_idle_rounds=-1)
