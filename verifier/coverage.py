"""Who the replay spot checks have looked at: standings for the draw, and coverage to report.

A replay verdict is a reputation event (ledger.record_spot_check) whose reason says
"spot check passed|failed in stage S round R: replay: …"; the round of a wallet's latest one
is when it was last checked. Receipts of every stage that commit to a segment root are checked
by segments, older ones at stage 0 of a single-stage run by a whole-round replay
(verifier.replaycheck), so a wallet of any stage counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from . import models as m
from .budget import ReplayBudget, Standing, check_rates, unnoticed

REPLAY_REASON = "spot check % replay:%"
"""LIKE pattern of replay verdicts' reasons (the detail ReplayChecker._record writes)."""

LIE_FRACTIONS = (0.05, 0.1, 0.5)
HORIZONS = (10, 50, 100)


@dataclass(frozen=True)
class WalletCoverage:
    wallet_id: str
    check_probability: float
    """Chance a given round of this wallet is drawn at random (budget or fixed rate)."""
    last_check_round: int | None
    last_check_at: float | None


@dataclass(frozen=True)
class Unnoticed:
    lie_fraction: float
    rounds: int
    probability: float


@dataclass(frozen=True)
class Coverage:
    latest_round: int | None
    window_rounds: int
    wallets_reporting: int
    """Distinct wallets with a receipt in the window (any stage)."""
    wallets_checked: int
    """Of those, how many got a replay verdict for a round in the window."""
    max_gap_rounds: int | None
    """Every wallet is checked at least once in this many rounds (budget mode; None otherwise)."""
    mean_check_probability: float
    unnoticed: list[Unnoticed]
    """For the mean wallet: probability a liar in a fraction p of rounds is still uncaught after n."""
    wallets: list[WalletCoverage]


def standings(session: Session) -> list[Standing]:
    """Every wallet with a receipt (any stage): reputation, first round, round of its last check."""
    first = (
        select(m.Receipt.wallet_id, func.min(m.Receipt.round).label("first"))
        .group_by(m.Receipt.wallet_id)
        .subquery()
    )
    checked = (
        select(m.ReputationEvent.wallet_id, func.max(m.ReputationEvent.round).label("last"))
        .where(m.ReputationEvent.reason.like(REPLAY_REASON))
        .group_by(m.ReputationEvent.wallet_id)
        .subquery()
    )
    rows = session.execute(
        select(m.Wallet.wallet_id, m.Wallet.reputation, first.c.first, checked.c.last)
        .join(first, first.c.wallet_id == m.Wallet.wallet_id)
        .outerjoin(checked, checked.c.wallet_id == m.Wallet.wallet_id)
        .order_by(m.Wallet.wallet_id)
    ).all()
    return [Standing(w, rep, first_, last) for w, rep, first_, last in rows]


def coverage(
    session: Session,
    *,
    window: int,
    sample_rate: float | None,
    budget: ReplayBudget | None,
    limit: int,
    offset: int,
) -> Coverage:
    """The replay checks' reach over the last `window` rounds, with a page of per-wallet rows."""
    latest = session.scalar(select(func.max(m.Receipt.round)).where(m.Receipt.stage == 0))
    low = (latest or 0) - window + 1
    reporting = {
        w for (w,) in session.execute(select(m.Receipt.wallet_id).where(m.Receipt.round >= low).distinct())
    }
    last_at = dict(
        session.execute(
            select(m.ReputationEvent.wallet_id, func.max(m.ReputationEvent.created_at))
            .where(m.ReputationEvent.reason.like(REPLAY_REASON))
            .group_by(m.ReputationEvent.wallet_id)
        ).all()
    )
    everyone = standings(session)
    recent = [s for s in everyone if s.wallet_id in reporting]
    if budget is not None and latest is not None:
        rates = check_rates(recent, latest, budget)
        gap = budget.max_gap(len(recent))
    else:
        rates = {s.wallet_id: sample_rate or 0.0 for s in recent}
        gap = None
    checked = sum(1 for s in recent if s.last_checked_round is not None and s.last_checked_round >= low)
    mean_q = sum(rates.values()) / len(rates) if rates else 0.0
    return Coverage(
        latest_round=latest,
        window_rounds=window,
        wallets_reporting=len(recent),
        wallets_checked=checked,
        max_gap_rounds=gap,
        mean_check_probability=mean_q,
        unnoticed=[Unnoticed(p, n, unnoticed(mean_q, p, n)) for p in LIE_FRACTIONS for n in HORIZONS],
        wallets=[
            WalletCoverage(
                s.wallet_id, rates.get(s.wallet_id, 0.0), s.last_checked_round, last_at.get(s.wallet_id)
            )
            for s in everyone[offset : offset + limit]
        ],
    )
