"""The replay budget: draw probabilities, bounded coverage, the unnoticed-liar bound, and the draw
the replay checker makes under a budget over real stored receipts."""

import math

import pytest
from sqlalchemy import select

from neuroshard.node.wallet import Wallet
from neuroshard.testing.verifier import small_network
from neuroshard.verifier import ledger
from neuroshard.verifier import models as m
from neuroshard.verifier.background import JobContext
from neuroshard.verifier.budget import (
    SEGMENT_OVERHEAD,
    ReplayBudget,
    Standing,
    check_rates,
    overdue,
    segment_check_cost,
    unnoticed,
)
from neuroshard.verifier.coverage import coverage, standings
from neuroshard.verifier.db import Database
from neuroshard.verifier.replaycheck import ReplayCheckConfig, ReplayChecker
from neuroshard.verifier.reputation import ReputationConfig


def test_rates_spend_the_random_share_and_favour_new_and_low_reputation_wallets() -> None:
    budget = ReplayBudget(replicas=4.0, coverage_share=0.5)
    old = [Standing(f"{i:020x}", 0.8, 0, None) for i in range(96)]
    new = [Standing(f"n{i:019x}", 0.8, 98, None) for i in range(2)]
    low = [Standing(f"l{i:019x}", 0.2, 0, None) for i in range(2)]
    rates = check_rates([*old, *new, *low], 100, budget)
    assert sum(rates.values()) == pytest.approx(2.0)  # (1 − c)·B
    assert rates[new[0].wallet_id] == pytest.approx(4 * rates[old[0].wallet_id])
    assert rates[low[0].wallet_id] == pytest.approx(2 * rates[old[0].wallet_id])
    assert check_rates(old[:1], 100, budget) == {old[0].wallet_id: 1.0}, "capped at certainty"


def test_coverage_gap_and_overdue() -> None:
    budget = ReplayBudget(replicas=1.0, coverage_share=0.5)
    assert budget.max_gap(1000) == 2000 and budget.max_gap(3) == 6
    assert ReplayBudget(replicas=1.0, coverage_share=0.0).max_gap(10) is None
    assert not overdue(Standing("a", 1, 10, None), 15, 6)
    assert overdue(Standing("a", 1, 10, None), 16, 6)
    assert not overdue(Standing("a", 1, 0, 12), 17, 6) and overdue(Standing("a", 1, 0, 12), 18, 6)
    with pytest.raises(ValueError, match="replicas must be > 0"):
        ReplayBudget(replicas=0)


def test_unnoticed_bound() -> None:
    assert unnoticed(0.1, 0.5, 10) == pytest.approx(0.95**10)
    assert unnoticed(1.0, 1.0, 1) == 0 and unnoticed(0.0, 1.0, 100) == 1
    with pytest.raises(ValueError):
        unnoticed(1.5, 0.1, 3)


WALLETS = 40
ROUNDS = 30


def store(db: Database, rounds: range) -> None:
    with db.write() as s:
        for r in rounds:
            for i in range(WALLETS):
                s.add(
                    m.Receipt(
                        wallet_id=f"{i:020x}", stage=0, round=r, inner_steps=2, start_step=0, tokens=1,
                        shard_id=0, offset_start=0, offset_end=1, data_spans=[[0, 0, 1]], losses=[1.0],
                        base_hash="0" * 64, result_hash="1" * 64, delta_digest="2" * 64, accepted=[],
                        rejected=[], equivocators=[], body_sha256=f"{r:032x}{i:032x}", received_at=0.0,
                    )
                )  # fmt: skip


def test_checker_draw_under_a_budget_covers_every_wallet_within_the_gap(db: Database) -> None:
    with db.write() as s:
        for i in range(WALLETS):
            s.add(m.Wallet(wallet_id=f"{i:020x}", public_key=f"{i:064x}", reputation=0.8, registered_at=0.0,
                           software_version="x"))  # fmt: skip
    budget = ReplayBudget(replicas=4.0, coverage_share=0.5)
    gap = budget.max_gap(WALLETS)
    assert gap == 20
    checker = ReplayChecker(
        JobContext(
            db=db, network=small_network(), operator=Wallet.from_token("test-operator"), log=lambda _: None
        ),
        config=ReplayCheckConfig(budget=budget),
    )
    store(db, range(0, 1))
    first_seen: dict[str, int] = {}
    per_round = []
    for r in range(ROUNDS):
        if r:
            store(db, range(r, r + 1))
        with db.read() as session:
            draw = checker._budget_draw(session)
            receipts = session.scalars(select(m.Receipt).where(m.Receipt.round == r)).all()
        picks = [rc.wallet_id for rc in receipts if draw(rc)]
        for w in picks:
            checker._picked[w] = r  # what _collect does with a drawn receipt
            first_seen.setdefault(w, r)
        per_round.append(len(picks))
    assert len(first_seen) == WALLETS, "every wallet checked"
    # All 40 joined in round 0, so all fall due in round 20; 2 a round go to the overdue ones.
    assert max(first_seen.values()) <= 2 * gap, "within the coverage gap"
    assert sum(per_round) <= budget.replicas * ROUNDS, per_round
    assert max(per_round) <= 8, per_round  # 2 overdue + the random share, which averages 2
    assert sum(per_round[:gap]) >= 5, per_round  # the random share works before anyone is due


def test_coverage_report_counts_replay_verdicts(db: Database) -> None:
    with db.write() as s:
        for i in range(WALLETS):
            s.add(m.Wallet(wallet_id=f"{i:020x}", public_key=f"{i:064x}", reputation=0.8, registered_at=0.0,
                           software_version="x"))  # fmt: skip
    store(db, range(0, 5))
    with db.write() as s:
        for i in range(3):
            ledger.record_spot_check(
                s, f"{i:020x}", stage=0, round_=4 - i, ok=True, detail="replay: cosine 1.0", now=100.0 + i,
                cfg=ReputationConfig(),
            )  # fmt: skip
        ledger.record_spot_check(  # a data check is not a replay
            s, f"{5:020x}", stage=0, round_=4, ok=True, detail="data: ok", now=1.0, cfg=ReputationConfig()
        )
    with db.read() as s:
        marks = {st.wallet_id: st.last_checked_round for st in standings(s)}
        report = coverage(s, window=2, sample_rate=0.1, budget=None, limit=10, offset=0)
    assert marks[f"{0:020x}"] == 4 and marks[f"{2:020x}"] == 2 and marks[f"{5:020x}"] is None
    assert (report.latest_round, report.wallets_reporting, report.wallets_checked) == (4, WALLETS, 2)
    assert report.mean_check_probability == pytest.approx(0.1)
    bound = {(u.lie_fraction, u.rounds): u.probability for u in report.unnoticed}
    assert bound[(0.1, 100)] == pytest.approx((1 - 0.01) ** 100)
    assert [w.wallet_id for w in report.wallets][:2] == [f"{0:020x}", f"{1:020x}"] and len(
        report.wallets
    ) == 10
    assert report.wallets[1].last_check_round == 3 and report.wallets[1].last_check_at == 101.0
    assert math.isclose(report.wallets[3].check_probability, 0.1)


def test_a_cheaper_check_buys_more_checks_and_shorter_coverage() -> None:
    """Segment checks (issue 17) cost a fraction of a round's replay, k/H each with its overhead:
    the same compute covers every wallet sooner, and shorter segments sooner still."""
    whole = ReplayBudget(replicas=1.0, coverage_share=0.5)
    tenth = segment_check_cost(4, 0.1)
    fortieth = segment_check_cost(4, 1 / 40)
    assert tenth == pytest.approx(4 * 0.1 * SEGMENT_OVERHEAD)
    assert fortieth == pytest.approx(tenth / 4)
    assert fortieth <= 0.14  # four checks at k = H/40: about a tenth of the round they check
    segments = ReplayBudget(replicas=1.0, coverage_share=0.5, check_cost=tenth)
    assert segments.checks == pytest.approx(1 / tenth)
    assert whole.max_gap(100) == 200
    assert segments.max_gap(100) == math.ceil(100 / (0.5 / tenth))
    assert segment_check_cost(4, 1.0) == 4.0  # a segment of the whole round costs a round, no more
    with pytest.raises(ValueError, match="k/H"):
        segment_check_cost(4, 0.0)
    with pytest.raises(ValueError, match="check_cost"):
        ReplayBudget(replicas=1.0, check_cost=0)


def test_an_overdue_pick_that_is_not_checked_gives_its_place_back(db: Database) -> None:
    """Overdue wallets share a fixed number of places a round; one drawn overdue whose receipt is
    then not checked (the queue full, or its wallet holding its places in it: `_unpick`) gives its
    place back, so another overdue wallet is drawn in that round instead of none."""
    with db.write() as s:
        for i in range(WALLETS):
            s.add(m.Wallet(wallet_id=f"{i:020x}", public_key=f"{i:064x}", reputation=0.8, registered_at=0.0,
                           software_version="x"))  # fmt: skip
    budget = ReplayBudget(replicas=4.0, coverage_share=0.5)
    checker = ReplayChecker(
        JobContext(
            db=db, network=small_network(), operator=Wallet.from_token("test-operator"), log=lambda _: None
        ),
        config=ReplayCheckConfig(budget=budget),
    )
    late = budget.max_gap(WALLETS) + 1  # every wallet, seen since round 0 and never checked, is overdue
    store(db, range(0, late + 1))
    with db.read() as session:
        draw = checker._budget_draw(session)
        receipts = session.scalars(select(m.Receipt).where(m.Receipt.round == late)).all()
    places = math.ceil(budget.coverage_share * budget.checks)
    drawn = [rc for rc in receipts if draw(rc)]
    assert checker._overdue_picks[late] == places and len(drawn) >= places
    first = next(rc for rc in drawn if (rc.wallet_id, late) in checker._overdue_taken)
    checker._unpick(first, None)
    assert checker._overdue_picks[late] == places - 1
    others = [rc for rc in receipts if rc not in drawn]
    assert any(draw(rc) for rc in others)  # the place went to another overdue wallet
    assert checker._overdue_picks[late] == places
