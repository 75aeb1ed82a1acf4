"""Hash agreement and reputation: pure functions over one round's receipts.

Every honest replica of a stage ends round r with the bit-identical θ_{r+1} (deterministic
robust aggregation, ARCHITECTURE.md), so the result hashes in the receipts of (stage, r)
vote, and the majority hash is the network's θ_{r+1}. What moves a wallet's reputation:

- agreeing with a strict majority (> half the votes): +agree_reward;
- a result hash outside a strict majority: −minority_penalty;
- its contribution rejected, or it named as an equivocator, by more than half of the
  majority-agreeing reporters (other than itself): −rejected_penalty / −equivocation_penalty.
  Claims only count from reporters whose own result is the majority's, and only when most
  of them agree, so a minority of liars cannot talk an honest wallet down;
- a failed spot check (verifier.spotcheck): −spot_check_penalty; a challenge left unanswered
  (verifier.replaycheck): −unanswered_penalty.

No strict majority (e.g. a 1–1 split) moves nobody: the verifier cannot tell who is right.
A wallet whose reputation falls below `refuse_below` is refused until the operator
reinstates it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class ReputationConfig:
    initial: float = 0.5
    """Reputation of a newly registered wallet: trust is earned, not granted."""
    maximum: float = 1.0
    refuse_below: float = 0.2
    """Refused under this."""
    agree_reward: float = 0.02
    minority_penalty: float = 0.12
    """Three minority rounds in a row refuse a fresh wallet (0.5 → 0.38 → 0.26 → 0.14); values
    stay clear of the threshold so float rounding never decides."""
    rejected_penalty: float = 0.1
    equivocation_penalty: float = 0.5
    """Two signed payloads for one round is deliberate: one report refuses an average wallet."""
    spot_check_penalty: float = 0.5
    """A replayed Δ that does not match is deliberate too."""
    unanswered_penalty: float = 0.25
    """A sampled replica that did not serve what its receipt committed to within the checker's
    answer window (verifier.replaycheck). Not proof of a lie (a node may have died), so less than a
    failure; but like one it restarts the wallet's probation in the stage, since a replica that
    declined only the challenges of segments it faked would otherwise never be caught."""

    def __post_init__(self) -> None:
        if not 0 <= self.refuse_below < self.initial <= self.maximum:
            raise ValueError(
                f"ReputationConfig needs 0 ≤ refuse_below ({self.refuse_below}) < initial "
                f"({self.initial}) ≤ maximum ({self.maximum})"
            )


@dataclass(frozen=True)
class Vote:
    """One receipt as the judgement sees it."""

    wallet_id: str
    result_hash: str
    base_hash: str
    rejected: tuple[tuple[str, str], ...] = ()
    """(wallet, reason) of contributions this reporter rejected."""
    equivocators: tuple[str, ...] = ()


@dataclass(frozen=True)
class Majority:
    hash: str | None
    """The hash more than half the votes share, else None."""
    votes: int
    agreeing: int
    """Votes for the most common hash (whether or not it is a strict majority)."""

    @property
    def agreement_rate(self) -> float | None:
        return self.agreeing / self.votes if self.votes else None


@dataclass(frozen=True)
class Adjustment:
    wallet_id: str
    delta: float
    reason: str


@dataclass(frozen=True)
class RoundJudgement:
    majority: Majority
    synced: int
    """Votes whose base hash is the previous round's majority hash."""
    sync_checked: int
    """Votes whose base hash could be checked (0 when the previous majority is unknown)."""
    adjustments: list[Adjustment] = field(default_factory=list)


def majority(hashes: Iterable[str]) -> Majority:
    counts = Counter(hashes)
    total = sum(counts.values())
    if not counts:
        return Majority(hash=None, votes=0, agreeing=0)
    # Ties broken by the hash itself so the result never depends on arrival order.
    top, agreeing = min(counts.items(), key=lambda item: (-item[1], item[0]))
    return Majority(hash=top if 2 * agreeing > total else None, votes=total, agreeing=agreeing)


def _claims(reporters: Sequence[Vote], cfg: ReputationConfig, stage: int, round_: int) -> list[Adjustment]:
    """Rejections and equivocation reports that more than half the majority reporters make."""
    rejected: dict[str, Counter[str]] = {}
    equivocated: Counter[str] = Counter()
    for vote in reporters:
        for wallet, reason in dict(vote.rejected).items():  # one claim per reporter and wallet
            rejected.setdefault(wallet, Counter())[reason] += 1
        for wallet in set(vote.equivocators):
            equivocated[wallet] += 1
    reporter_ids = {v.wallet_id for v in reporters}
    out: list[Adjustment] = []

    def quorum(wallet: str, count: int) -> bool:
        eligible = len(reporter_ids - {wallet})
        return eligible > 0 and 2 * count > eligible

    for wallet in sorted(rejected):
        reasons = rejected[wallet]
        if quorum(wallet, sum(reasons.values())):
            reason = reasons.most_common(1)[0][0]
            out.append(
                Adjustment(
                    wallet,
                    -cfg.rejected_penalty,
                    f"contribution rejected in stage {stage} round {round_}: {reason}",
                )
            )
    for wallet in sorted(equivocated):
        if quorum(wallet, equivocated[wallet]):
            out.append(
                Adjustment(
                    wallet,
                    -cfg.equivocation_penalty,
                    f"equivocation reported in stage {stage} round {round_}",
                )
            )
    return out


def judge_round(
    votes: Sequence[Vote],
    previous_majority: str | None,
    cfg: ReputationConfig,
    *,
    stage: int,
    round_: int,
) -> RoundJudgement:
    """Majority, sync and reputation adjustments for one (stage, round), all votes in."""
    result = majority(v.result_hash for v in votes)
    synced = sum(v.base_hash == previous_majority for v in votes) if previous_majority else 0
    checked = len(votes) if previous_majority else 0
    if result.hash is None:
        return RoundJudgement(result, synced, checked)
    adjustments: list[Adjustment] = []
    for vote in sorted(votes, key=lambda v: v.wallet_id):
        adjustments.extend(judge_vote(vote, result.hash, cfg, stage=stage, round_=round_))
    adjustments.extend(_claims([v for v in votes if v.result_hash == result.hash], cfg, stage, round_))
    return RoundJudgement(result, synced, checked, adjustments)


def judge_vote(
    vote: Vote, majority_hash: str | None, cfg: ReputationConfig, *, stage: int, round_: int
) -> list[Adjustment]:
    """One vote against a known majority: also used for receipts arriving after the round settled."""
    if majority_hash is None:
        return []
    if vote.result_hash == majority_hash:
        return [
            Adjustment(vote.wallet_id, cfg.agree_reward, f"majority hash in stage {stage} round {round_}")
        ]
    return [
        Adjustment(
            vote.wallet_id,
            -cfg.minority_penalty,
            f"minority hash {vote.result_hash[:12]}… in stage {stage} round {round_} "
            f"(majority {majority_hash[:12]}…)",
        )
    ]


def next_reputation(current: float, delta: float, cfg: ReputationConfig) -> float:
    return min(cfg.maximum, max(0.0, current + delta))


def is_refused(reputation: float, cfg: ReputationConfig) -> bool:
    return reputation < cfg.refuse_below
