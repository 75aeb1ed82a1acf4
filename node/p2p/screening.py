"""Screening a closed round: which of its contributions the aggregation rule gets to see.

The round book already refused what a header or a payload proves wrong on arrival (bad
signature, base hash, numel, undecodable or non-finite payload, equivocation). What is left is
well-formed, and screening judges its *content* against the round: every contribution of the
closed set is validated (``neuroshard.node.validation.screen_round``: norm ratio, cosine and
variance ratio against the coordinate median of the set, zero Δs, copies), and wallets this
replica has banned (proven equivocators) are refused whatever they send.

Determinism: the verdicts are a pure function of the closed set (the same signed payloads,
decoded to the same bits) and the ban set, computed in wallet order, so honest replicas that
close on the same set refuse the same wallets and aggregate the same rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from ..validation import ValidationConfig, screen_round
from .codec import decode_delta
from .rounds import Contribution, RoundBook

MIN_SCREENED = 3
"""Fewest contributions the content checks run on. The reference is their coordinate median,
which only lies inside the honest range while honest contributions are a majority: with two,
it is their mean, and one sign-flipped Δ would drag it to ~0 and get the honest one refused too."""


@dataclass(frozen=True)
class Screened:
    accepted: tuple[Contribution, ...]
    """Contributions to aggregate, sorted by wallet, each with its decoded Δ."""
    rejected: tuple[tuple[str, str], ...]
    """(wallet, reason) of the refused ones, sorted by wallet."""


def screen(
    contributions: Iterable[Contribution],
    numel: int,
    config: ValidationConfig | None,
    banned: Mapping[str, str],
) -> Screened:
    """Split a closed round's contributions into accepted and rejected (module docstring).
    `config` None skips the content checks (bans still apply); `banned` maps wallet -> why."""
    ordered = sorted(contributions, key=lambda c: c.header.wallet)
    rejected = {
        c.header.wallet: f"banned: {banned[c.header.wallet]}" for c in ordered if c.header.wallet in banned
    }
    kept = [_decoded(c, numel) for c in ordered if c.header.wallet not in banned]
    if config is not None and len(kept) >= MIN_SCREENED:
        try:
            verdicts = screen_round({c.header.wallet: c.delta for c in kept}, (numel,), config)
        except ValueError:
            # The median is all zeros (most Δs are zero): nothing to judge content against. Every
            # replica holding this set ends up here alike; the rule then sees the set unscreened.
            return Screened(tuple(kept), tuple(sorted(rejected.items())))
        rejected.update({w: v.reason for w, v in verdicts.items() if not v.ok})
        kept = [c for c in kept if verdicts[c.header.wallet].ok]
    return Screened(tuple(kept), tuple(sorted(rejected.items())))


def _decoded(contribution: Contribution, numel: int) -> Contribution:
    if contribution.delta is not None:
        return contribution
    header = contribution.header
    return replace(contribution, delta=decode_delta(contribution.payload, header.encoding, numel))


def new_bans(books: Mapping[int, RoundBook], banned: Mapping[str, str]) -> dict[str, str]:
    """Wallets the kept round books prove to equivocate (both signed headers are held) that are
    not banned yet, each with the reason: a wallet that lied once is refused in every later round,
    not just the one it lied in. Earliest round first, so the reason names the first lie."""
    found: dict[str, str] = {}
    for round_, book in sorted(books.items()):
        for wallet in sorted(book.equivocators):
            if wallet not in banned and wallet not in found:
                found[wallet] = f"equivocated in round {round_}"
    return found
