"""What every replica decides alike around a round, and what it reports about it.

- `AggregationRule` and `ordered_mean`: the rule an owner applies to each part it reduces
  (``neuroshard.node.outer.reduce``); honest replicas feeding it the same rows in the same
  (wallet) order get bit-identical results;
- `plurality`: the θ-hash vote after a round (and at join), the same winner on every replica
  that sees the same votes;
- `RoundReport`: one replica's account of one round, its log line and the verifier's receipt
  material (``neuroshard.node.receipt``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from torch import Tensor

from neuroshard.protocol.peer import StateInfo

AggregationRule = Callable[[Tensor], Tensor]
"""(n, L) float32 rows, one per contributor, sorted by wallet -> (L,) aggregate. In the partitioned
round L is the length of one part (``neuroshard.node.outer.reduce``)."""


def ordered_mean(stack: Tensor) -> Tensor:
    """Mean of the rows, summed one row at a time in row order.

    Element-wise adds in a fixed order give the same bits on every machine; a reduction
    kernel may split the sum differently by thread count or SIMD width. Replace with
    `neuroshard.node.aggregation` rules for robustness; this is the plain DiLoCo default.
    """
    total = stack[0].clone()
    for row in stack[1:]:
        total += row
    return total / stack.shape[0]


@dataclass(frozen=True)
class HashVote:
    """The hash most replicas at `round` report, and who reported it."""

    round: int
    theta_hash: str
    votes: int
    voters: int
    holders: tuple[StateInfo, ...]
    """Peers (not this replica) reporting the winning hash: where to sync from."""
    counts: Mapping[str, int]
    """Votes per θ hash."""


def plurality(statuses: Iterable[StateInfo], round_: int, own_hash: str | None) -> HashVote | None:
    """Count θ hashes at `round_` (this replica's own counts when `own_hash` is given).

    The hash with the most votes wins; a tie goes to the smallest hash. Every replica that
    sees the same votes picks the same winner, so a split (two replicas closing a round with
    different sets at the same moment) heals in one re-sync instead of lasting forever; with
    no majority there is no telling which side is right anyway. None when nobody reports `round_`.
    """
    at_round = [s for s in statuses if s.round == round_]
    counts = Counter(s.theta_hash for s in at_round)
    if own_hash is not None:
        counts[own_hash] += 1
    if not counts:
        return None
    best = max(counts.values())
    winner = min(h for h, c in counts.items() if c == best)
    holders = tuple(s for s in at_round if s.theta_hash == winner)
    return HashVote(round_, winner, best, sum(counts.values()), holders, dict(counts))


@dataclass(frozen=True)
class RoundReport:
    """What one replica did in one round: the verifier's receipt material and the swarm's log line."""

    stage: int
    round: int
    accepted: tuple[str, ...]
    """The round's contributors, sorted: members whose valid commitment this replica held when the
    commit phase closed (this replica alone when the round failed and it stepped with its own Δ).
    A contributor may still be refused on single parts (`rejected`)."""
    rejected: tuple[tuple[str, str], ...]
    """(wallet, reason), sorted by wallet: members that stayed silent, commitments refused (base
    hash, member list, banned), parts refused by the per-part screening of the parts this replica
    reduced, and proven cheats (fraud, equivocation)."""
    equivocators: tuple[str, ...]
    """Of `rejected`: wallets proven to have signed two commitments, or two claims for one part."""
    late: bool
    """True when this replica adopted the peers' result instead of stepping. The partitioned round
    has no late path (a replica behind re-syncs after the θ-hash vote): PeerPlane sets False."""
    next_round: int
    """The round this replica is at afterwards: round + 1, or later if it adopted the state of
    peers that were further ahead."""
    theta_hash: str
    """sha256 of θ_{next_round}, the state this replica ends the round with."""
    agree: int
    """Replicas (this one included) reporting `theta_hash` for next_round when compared."""
    voters: int
    resynced_from: str | None
    """Wallet whose state was adopted (late or minority), None when the own outer step stood."""
    seconds: float
    """The whole of `finish_round` for this round."""
    exchange_s: float = 0.0
    """Of which: the partitioned round, from committing to the members' digests agreeing."""
    commit_s: float = 0.0
    """Of exchange_s: the commit phase, reading the members' commitments (``outer.round``)."""
    step_s: float = 0.0
    """Of which: the outer step with the aggregate, publishing the new state, retiring the
    previous round's objects."""
    vote_s: float = 0.0
    """Of which: comparing θ hashes with the peers (and re-syncing if in the minority)."""

    def line(self) -> str:
        how = "late, adopted" if self.late else f"aggregated {len(self.accepted)}"
        if self.resynced_from and not self.late:
            how += ", minority: re-synced"
        rejected = "".join(f"; rejected {w[:12]}: {reason}" for w, reason in self.rejected)
        equivocated = "".join(f"; equivocator {w[:12]}" for w in self.equivocators)
        return (
            f"p2p round={self.round} {how}; θ_{self.next_round} {self.theta_hash[:16]} agree={self.agree}/{self.voters} "
            f"({self.seconds:.2f} s: exchange {self.exchange_s:.2f} (commit {self.commit_s:.2f}), step {self.step_s:.2f}, vote {self.vote_s:.2f})"
            f"{rejected}{equivocated}"
        )
