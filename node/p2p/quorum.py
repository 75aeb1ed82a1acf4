"""Which peer state a replica may adopt: a quorum of signed statuses must vouch for it.

A replica adopts another's θ_round (and outer momentum) when it joins, when it is late, and
when its θ hash lost the vote after a round. Each of those used to trust the plurality at the
highest round any single status claimed, so one peer lying about its round (or inventing a
hash in a two-replica vote) could hand a replica a forged state. Now a state is adopted only
when at least ``quorum(voters)`` peers report exactly that (round, θ hash, momentum hash):

- ``voters`` is the number of replicas whose status was heard, this one included;
- ``tolerated(voters) = ⌊(voters − 1)/3⌋`` is the most liars a vote among them can outlast
  (n ≥ 3f + 1; Lamport, Shostak & Pease 1982, "The Byzantine Generals Problem");
- ``quorum = tolerated + 1``: with at most that many liars, at least one voucher is honest, so
  the state is one an honest replica computed, and the download is then checked against its hash.

Below 4 voters f = 0 and one voucher suffices: with two or three replicas nothing can tell a
liar from an honest minority, and refusing there would stop honest re-syncs (a late replica
with one peer). The statuses are signed, so a liar speaks only for its own wallet.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from neuroshard.protocol.peer import StateInfo

from .rounds import HashVote, plurality


def tolerated(voters: int) -> int:
    """f: the most lying voters among `voters` that a vote can outlast (n ≥ 3f + 1)."""
    if voters < 1:
        raise ValueError(f"tolerated needs at least one voter, got {voters}")
    return (voters - 1) // 3


def quorum(voters: int) -> int:
    """Peers that must report a state before a replica adopts it: f + 1, so one is honest."""
    return tolerated(voters) + 1


def backing(vote: HashVote) -> tuple[str, int]:
    """(momentum hash, holders) of the largest group of the vote's holders that agree on the
    momentum too (ties: the smallest hash): a state is θ *and* momentum, both must be vouched for."""
    momenta = Counter(h.momentum_hash for h in vote.holders)
    if not momenta:
        return "", 0
    best = max(momenta.values())
    return min(h for h, c in momenta.items() if c == best), best


def vouched(statuses: Iterable[StateInfo], min_round: int, voters: int) -> HashVote | None:
    """The highest round ≥ `min_round` whose plurality state is backed by a quorum of `voters`.

    Rounds are tried from the highest down, so one status claiming a far-ahead round is skipped
    rather than followed; None when no round has a vouched state."""
    infos = list(statuses)
    need = quorum(voters)
    for round_ in sorted({i.round for i in infos if i.round >= min_round}, reverse=True):
        vote = plurality(infos, round_, None)
        if vote is not None and backing(vote)[1] >= need:
            return vote
    return None
