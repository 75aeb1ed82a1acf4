"""One outer round's bookkeeping, and the deterministic choices every replica makes alike.

A `RoundBook` holds what one replica knows about (stage, round): accepted contributions,
rejected ones with the reason, and equivocators with their two conflicting signed
headers. Every path in — a push, a pull, a digest entry — goes through `admit`, so the
same rules apply however a contribution arrives:

1. the contributor's signature over the header verifies (else 422, not recorded: anyone
   can send garbage in someone else's name, so it says nothing about that wallet);
2. stage and round are this book's (422 / 409, not recorded);
3. a second, different, validly signed header of a wallet is equivocation (409): the
   wallet is excluded from the round and both headers are kept as the proof;
4. numel and base hash match this replica's θ_r (422, recorded against the wallet: the
   header is signed, so the claim is the wallet's own).

A header that passes 1–3 is the wallet's *commitment* for the round (`committed`), held
before its payload: commit-then-reveal (exchange.py). Its payload is taken only together
with the contributor's signed `Reveal` (`reveals`), the commitments it held before it
started serving the payload. A second, different, validly signed reveal of a wallet is
equivocation too (409): the first reveal stands for this round, both are kept as the proof,
and the wallet is banned from later rounds like a header equivocator (screening.new_bans).
Payload checks (sha256, safetensors layout, finite values) follow in the caller; a payload
whose bytes match the signed sha256 but do not decode is recorded too.

Aggregation takes the accepted contributions sorted by wallet and applies the pluggable
rule, so honest replicas holding the same set compute bit-identical results.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .codec import all_finite, decode_delta
from .wire import ContributionHeader, Rejected, Reveal, StateInfo

AggregationRule = Callable[[Tensor], Tensor]
"""(n, d) float32 contributions, rows sorted by wallet -> (d,) aggregate."""


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
class Contribution:
    header: ContributionHeader
    payload: bytes
    """The safetensors body exactly as signed (sha256 == header.payload_sha256)."""
    delta: Tensor | None = field(default=None, compare=False, repr=False)
    """The decoded Δ (d,) float32, kept from the receipt check until the round closes, so the
    aggregation does not decode twice (int8 decode: 0.18 s per 29.5M values on one thread)."""


@dataclass(frozen=True)
class Rejection:
    wallet: str
    reason: str
    header: ContributionHeader


class RoundBook:
    """What this replica holds for one (stage, round). Lives on the network's event loop."""

    def __init__(
        self, *, stage: int, round_: int, base_hash: str, numel: int, max_wallets: int = 256
    ) -> None:
        self.stage = stage
        self.round = round_
        self.base_hash = base_hash
        self.numel = numel
        self.max_wallets = max_wallets
        """Distinct wallets (commitments and equivocators) the book takes; more is refused with 429."""
        self.committed: dict[str, ContributionHeader] = {}
        """Wallet -> its commitment: the first validly signed header of this stage and round seen."""
        self.reveals: dict[str, Reveal] = {}
        """Wallet -> its signed reveal statement (first seen), held before its payload is taken."""
        self.revealed_at: float | None = None
        """When this replica revealed its own payload (the clock of the node); None before."""
        self.accepted: dict[str, Contribution] = {}
        self.rejected: dict[str, Rejection] = {}
        self.equivocators: dict[str, tuple[ContributionHeader, ContributionHeader]] = {}
        self.reveal_equivocators: dict[str, tuple[Reveal, Reveal]] = {}
        """Wallet -> two different reveals it signed for this round (the first one stands)."""
        self.aggregated: tuple[str, ...] | None = None
        """Set when this replica closed the round: the wallets it aggregated, sorted."""
        self.changed = asyncio.Event()
        """Set whenever something was added; the round driver waits on it instead of polling."""
        self.wanted: dict[str, ContributionHeader] = {}
        """Headers seen in digests whose payload this replica still has to pull."""
        self.wanted_at: dict[str, float] = {}
        """When each wanted header was first seen (the clock of the node)."""
        self.checking: set[str] = set()
        """Wallets whose payload arrived and is being checked (decoded) now: not to be pulled again."""
        self.sources: dict[str, set[str]] = {}
        """Wallet -> peers (wallets) whose digest listed its contribution: where to pull it from."""
        self.finals: dict[str, tuple[str, ...]] = {}
        """Peer wallet -> the set that peer aggregated (from its closed digest)."""
        self.ahead: set[str] = set()
        """Peers whose digest for this round says they moved past it without a closed set for it."""

    @property
    def closed(self) -> bool:
        return self.aggregated is not None

    def heard_from(self) -> set[str]:
        """Wallets this replica has a decision on (accepted, rejected or equivocated)."""
        return set(self.accepted) | set(self.rejected) | set(self.equivocators)

    def proven_equivocators(self) -> set[str]:
        """Wallets this book holds two signed, different statements of: headers or reveals."""
        return set(self.equivocators) | set(self.reveal_equivocators)

    def committed_from(self) -> set[str]:
        """Wallets whose commitment this replica holds (equivocators included: they committed twice)."""
        return set(self.committed) | set(self.equivocators)

    def header_of(self, wallet: str) -> ContributionHeader | None:
        return self.committed.get(wallet)

    def headers(self) -> list[ContributionHeader]:
        """Every commitment held, with both halves of each equivocation proof (for digests)."""
        held = list(self.committed.values())
        for first, second in self.equivocators.values():
            held += [first, second]
        return sorted(held, key=lambda h: (h.wallet, h.payload_sha256))

    def _held(self, header: ContributionHeader) -> bool:
        """True if exactly this header is held; raises Rejected(409) on equivocation (recording it)."""
        wallet = header.wallet
        if wallet in self.equivocators:
            raise Rejected(
                409, "equivocation", f"wallet {wallet[:16]}… equivocated in round {self.round}; excluded"
            )
        known = self.header_of(wallet)
        if known is None:
            return False
        if known == header:
            return True
        self.accepted.pop(wallet, None)
        self.rejected.pop(wallet, None)
        self.committed.pop(wallet, None)
        self.reveals.pop(wallet, None)
        self.equivocators[wallet] = (known, header)
        self.changed.set()
        raise Rejected(
            409,
            "equivocation",
            f"wallet {wallet[:16]}… signed two different contributions for stage {self.stage} round "
            f"{self.round}; excluded and recorded",
        )

    def admit(self, header: ContributionHeader) -> bool:
        """Apply the header rules (module docstring) and hold the header as the wallet's commitment.
        True: its payload is still to be fetched and checked. False: the payload was already
        taken, nothing to do. Raises Rejected otherwise."""
        if not header.signature_valid():
            raise Rejected(
                422, "bad_contribution_signature", "the contribution header's signature does not verify"
            )
        if header.stage != self.stage:
            raise Rejected(
                422,
                "wrong_stage",
                f"contribution is for stage {header.stage}, this replica holds stage {self.stage}",
            )
        if header.round != self.round:
            raise Rejected(
                409,
                "wrong_round",
                f"contribution is for round {header.round}, this book is round {self.round}",
            )
        if self._held(header):
            rejection = self.rejected.get(header.wallet)
            if rejection is not None:
                raise Rejected(422, "rejected", rejection.reason)
            if header.wallet in self.accepted:
                return False
            if self.closed:
                raise Rejected(409, "round_closed", f"round {self.round} is already aggregated here")
            return True
        if self.closed:
            raise Rejected(409, "round_closed", f"round {self.round} is already aggregated here")
        if len(self.committed_from()) >= self.max_wallets:
            raise Rejected(429, "round_full", f"round {self.round} already holds {self.max_wallets} wallets")
        self.committed[header.wallet] = header
        self.changed.set()
        if header.numel != self.numel:
            self.reject(header, f"numel {header.numel} != this stage's {self.numel}")
        if header.base_hash != self.base_hash:
            self.reject(
                header,
                f"base_hash {header.base_hash[:16]}… != this replica's θ_r hash {self.base_hash[:16]}…",
            )
        return True

    def reject(
        self, header: ContributionHeader, reason: str, status: int = 422, code: str = "rejected"
    ) -> None:
        """Record a signed contribution (admitted: its commitment is held) as invalid and raise
        Rejected(status) with the reason."""
        if self._held(header) and not self.closed and header.wallet not in self.accepted:
            self.rejected.setdefault(header.wallet, Rejection(header.wallet, reason, header))
            self.changed.set()
        raise Rejected(status, code, reason)

    def accept(self, contribution: Contribution) -> None:
        """Store a contribution whose header passed `admit` and whose payload decoded. Re-checks
        for equivocation: two different headers may have been admitted concurrently."""
        if self.closed:
            raise Rejected(409, "round_closed", f"round {self.round} is already aggregated here")
        wallet = contribution.header.wallet
        if self._held(contribution.header) and wallet not in self.accepted and wallet not in self.rejected:
            self.accepted[wallet] = contribution
            self.changed.set()

    def add_reveal(self, reveal: Reveal) -> bool:
        """Hold a contributor's reveal statement whose contribution header passed `admit`; True if new.
        A second, different reveal of the same wallet is refused (409): the first one seen stands,
        and if the second is validly signed over other content the wallet is recorded as an
        equivocator (a re-signature of the same content proves nothing)."""
        held = self.reveals.get(reveal.wallet)
        if held == reveal:
            return False
        if held is not None:
            if held.signing_bytes() != reveal.signing_bytes() and reveal.signature_valid():
                self.reveal_equivocators.setdefault(reveal.wallet, (held, reveal))
                self.changed.set()
            raise Rejected(
                409,
                "reveal_conflict",
                f"wallet {reveal.wallet[:16]}… already revealed round {self.round} with another list",
            )
        self._held(reveal.contribution)
        self.reveals[reveal.wallet] = reveal
        self.changed.set()
        return True

    def select(self, wallets: Iterable[str]) -> tuple[Contribution, ...]:
        """The given wallets' accepted contributions, sorted by wallet: the aggregation order."""
        return tuple(self.accepted[w] for w in sorted(set(wallets)) if w in self.accepted)

    def close(self, wallets: Iterable[str]) -> tuple[Contribution, ...]:
        """`select`, and publish the choice: digests now say closed, with exactly these wallets.
        The book keeps serving the payloads but lets go of the decoded tensors."""
        chosen = self.select(wallets)
        self.aggregated = tuple(c.header.wallet for c in chosen)
        for wallet, held in self.accepted.items():
            self.accepted[wallet] = replace(held, delta=None)
        self.changed.set()
        return chosen


def aggregate(
    contributions: Iterable[Contribution], numel: int, rule: AggregationRule, buffer: Tensor | None = None
) -> Tensor:
    """Stack the decoded Δs in the given (wallet) order as (n, d) and apply the rule; the result
    must be (d,) finite float32. With `buffer` (at least (n, d) float32) the stack is written into
    it rather than into fresh memory; the result may then be a view of it (Krum returns a row), so
    use it before the next call."""
    rows = [
        c.delta if c.delta is not None else decode_delta(c.payload, c.header.encoding, numel)
        for c in contributions
    ]
    if not rows:
        raise ValueError("nothing to aggregate: not even this replica's own contribution was accepted")
    if buffer is not None and buffer.shape[0] >= len(rows) and buffer.shape[1:] == (numel,):
        stack = torch.stack(rows, out=buffer[: len(rows)])
    else:
        stack = torch.stack(rows)
    result = rule(stack)
    if result.shape != (numel,) or result.dtype != torch.float32 or not all_finite(result):
        raise ValueError(
            f"aggregation rule returned {tuple(result.shape)} {result.dtype}, expected ({numel},) finite float32"
        )
    return result


@dataclass(frozen=True)
class Vote:
    """The hash most replicas at `round` report, and who reported it."""

    round: int
    theta_hash: str
    votes: int
    voters: int
    holders: tuple[StateInfo, ...]
    """Peers (not this replica) reporting the winning hash: where to sync from."""
    counts: Mapping[str, int]
    """Votes per θ hash."""


def plurality(statuses: Iterable[StateInfo], round_: int, own_hash: str | None) -> Vote | None:
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
    return Vote(round_, winner, best, sum(counts.values()), holders, dict(counts))


@dataclass(frozen=True)
class RoundReport:
    """What one replica did in one round: the verifier's receipt material and the swarm's log line."""

    stage: int
    round: int
    accepted: tuple[str, ...]
    """Wallets aggregated, sorted (empty when the replica was late and adopted state)."""
    rejected: tuple[tuple[str, str], ...]
    """(wallet, reason) of contributions refused, sorted by wallet: on arrival (header, payload),
    by screening the closed set (content checks, see screening.py), or because the wallet is banned."""
    equivocators: tuple[str, ...]
    late: bool
    """True when peers had closed the round without this replica: it adopted their result."""
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
    """Of which: from the own contribution being ready to the aggregated set being fixed."""
    commit_s: float = 0.0
    """Of exchange_s: the commit phase, until this replica revealed its payload (exchange.py)."""
    step_s: float = 0.0
    """Of which: decode, aggregate, outer step (or state adoption), publishing the new state."""
    vote_s: float = 0.0
    """Of which: comparing θ hashes with the peers (and re-syncing if in the minority)."""
    attack: str | None = None
    """Set only on a node run with `--attack` (testing): what it sent instead of its honest Δ."""

    def line(self) -> str:
        how = "late, adopted" if self.late else f"aggregated {len(self.accepted)}"
        if self.resynced_from and not self.late:
            how += ", minority: re-synced"
        rejected = "".join(f"; rejected {w[:12]}: {reason}" for w, reason in self.rejected)
        equivocated = "".join(f"; equivocator {w[:12]}" for w in self.equivocators)
        return (
            f"p2p round={self.round} {how}; θ_{self.next_round} {self.theta_hash[:16]} agree={self.agree}/{self.voters} "
            f"({self.seconds:.2f} s: exchange {self.exchange_s:.2f} (commit {self.commit_s:.2f}), step {self.step_s:.2f}, vote {self.vote_s:.2f})"
            f"{rejected}{equivocated}{f'; ATTACKER sent {self.attack}' if self.attack else ''}"
        )
