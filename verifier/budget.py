"""The replay checker's compute budget: how many receipts it can afford, and whom it draws.

A whole-round replay costs about what the round cost the replica (bench/RESULTS.md: replay/work
0.95 to 1.15); a segment check of s segments of k steps costs about s · k/H of it plus a fixed
overhead of up to a third of that (4 segments at k = H/10: 0.44–0.53; at k = H/40 ~0.13, issue 17). A budget of B replicas' worth of
compute therefore buys C = B / check_cost checks per round whatever the network's size; with a
thousand wallets the verifier cannot check everyone. The checks are split in two:

- a coverage share c·C goes to wallets that are overdue: not checked for `max_gap` rounds,
  max_gap = ceil(W / (c·C)) for W wallets reporting, at most ceil(c·C) of them a round. In
  steady state every wallet is checked at least once in max_gap rounds; wallets that all
  fall due together (joined together) wait up to another max_gap. Being due is
  predictable, so this bounds coverage, not cheating;
- the rest, (1 − c)·C, is drawn unpredictably (verifier.sampling: the operator's signature),
  wallet w's receipt with probability q_w = min(1, (1 − c)·C·weight_w / Σ weight), where
  new wallets (first receipt within `new_rounds`) weigh `new_weight` and wallets under
  `low_reputation` weigh `low_weight`: the ones with the least history are looked at most.

A wallet that lies in a fraction p of its rounds is caught in a round with probability at
least q_w·p (a replay of a lied round fails: tests/verifier/test_replaycheck_live.py), so it
has gone unnoticed for n rounds with probability at most (1 − q_w·p)^n.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(kw_only=True)
class ReplayBudget:
    replicas: float
    """Replays per round the verifier can afford, in units of one replica's round of compute
    (e.g. 1.0: one replica's CPU; a GPU verifier replaying tiny models: tens)."""
    check_cost: float = 1.0
    """What one check costs, in replica-rounds: 1 for a whole-round replay; for segment checks
    `segment_check_cost(segments)`. The budget buys replicas / check_cost checks a round."""
    coverage_share: float = 0.5
    """Part of the budget spent on overdue wallets (the rest is drawn at random)."""
    new_rounds: int = 10
    """A wallet whose first receipt is this recent (rounds) is new."""
    new_weight: float = 4.0
    low_reputation: float = 0.5
    low_weight: float = 2.0

    def __post_init__(self) -> None:
        if not self.replicas > 0:
            raise ValueError(f"ReplayBudget.replicas must be > 0, got {self.replicas}")
        if not self.check_cost > 0:
            raise ValueError(f"ReplayBudget.check_cost must be > 0, got {self.check_cost}")
        if not 0 <= self.coverage_share < 1:
            raise ValueError(f"ReplayBudget.coverage_share must lie in [0, 1), got {self.coverage_share}")
        if self.new_rounds < 0 or self.new_weight < 1 or self.low_weight < 1:
            raise ValueError(f"ReplayBudget: new_rounds ≥ 0 and weights ≥ 1 expected, got {self}")

    @property
    def checks(self) -> float:
        """Checks a round the budget buys."""
        return self.replicas / self.check_cost

    def max_gap(self, wallets: int) -> int | None:
        """Rounds within which every one of `wallets` is checked at least once (None: no coverage share)."""
        if self.coverage_share == 0 or wallets == 0:
            return None
        return max(1, math.ceil(wallets / (self.coverage_share * self.checks)))


SEGMENT_OVERHEAD = 1.33
"""What a segment check costs over its k/H share of the round's work (store read, hashes, model
build), as a factor: the largest measured ratio (bench/bench_replay.py, tiny model, CPU; bench/
RESULTS.md, issue 17): 0.133 at k/H = 0.1, 0.020–0.034 at k/H = 0.03, 0.023 at k/H = 0.02.
The parts that do not shrink with k (two checkpoints and θ_round fetched and hashed a segment)
grow with the model as the replay does, so the factor is taken to hold at other sizes; not
measured beyond the tiny model."""


def segment_check_cost(segments: int, segment_share: float) -> float:
    """What checking `segments` segments of one receipt costs, in replica-rounds, when a segment
    holds `segment_share` = k/H of the round's inner steps (the run's `[training] segment_steps`)."""
    if segments < 1 or not 0 < segment_share <= 1:
        raise ValueError(
            f"segment_check_cost needs segments ≥ 1 and 0 < k/H ≤ 1, got {segments}, {segment_share}"
        )
    return segments * min(1.0, SEGMENT_OVERHEAD * segment_share)


@dataclass(frozen=True)
class Standing:
    """What the draw knows of a wallet reporting receipts (any stage)."""

    wallet_id: str
    reputation: float
    first_round: int
    last_checked_round: int | None
    """Round of its latest replay verdict, None if never checked."""


def check_rates(standings: Sequence[Standing], round_: int, budget: ReplayBudget) -> dict[str, float]:
    """Each wallet's probability q_w of a random draw of its receipt for `round_`."""
    weights = {s.wallet_id: _weight(s, round_, budget) for s in standings}
    total = sum(weights.values())
    share = (1 - budget.coverage_share) * budget.checks
    return {w: min(1.0, share * weight / total) for w, weight in weights.items()} if total else {}


def _weight(s: Standing, round_: int, budget: ReplayBudget) -> float:
    weight = 1.0
    if round_ - s.first_round < budget.new_rounds:
        weight *= budget.new_weight
    if s.reputation < budget.low_reputation:
        weight *= budget.low_weight
    return weight


def overdue(s: Standing, round_: int, max_gap: int | None) -> bool:
    """Not checked for max_gap rounds (counted from its first receipt if never checked)."""
    if max_gap is None:
        return False
    since = s.first_round if s.last_checked_round is None else s.last_checked_round
    return round_ - since >= max_gap


def unnoticed(q: float, lie_fraction: float, rounds: int) -> float:
    """Upper bound on the probability that a wallet checked with probability q per round and
    lying in `lie_fraction` of its rounds has not been caught after `rounds` rounds."""
    if not (0 <= q <= 1 and 0 <= lie_fraction <= 1 and rounds >= 0):
        raise ValueError(
            f"unnoticed: q={q}, lie_fraction={lie_fraction} must lie in [0, 1], rounds={rounds} ≥ 0"
        )
    return (1 - q * lie_fraction) ** rounds
