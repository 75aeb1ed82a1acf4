"""Screening a closed round: which of its contributions the aggregation rule gets to see.

The round book already refused what a header or a payload proves wrong on arrival (bad
signature, base hash, numel, undecodable or non-finite payload, equivocation). What is left is
well-formed, and screening judges its *content* against the round: every contribution of the
closed set is validated (``neuroshard.node.validation.screen_round``: norm ratio, cosine and
variance ratio against the coordinate median of the set, zero Δs, copies), and wallets this
replica has banned (proven equivocators) are refused whatever they send.

Copies are told apart by the contributors' signed reveals (`copiers`): content alone cannot say
which of two equal Δs is the original, but a wallet that committed after the other's payload
was revealed can only be the copier, and a wallet that committed late is listed by fewer of the
round's reveals than one that committed in time.

Determinism: the verdicts are a pure function of the closed set (the same signed payloads,
decoded to the same bits) and the ban set, computed in wallet order, so honest replicas that
close on the same set refuse the same wallets and aggregate the same rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from itertools import combinations

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


def copiers(
    group: Iterable[str], commitments: Mapping[str, str], held: Mapping[str, Mapping[str, str]]
) -> set[str]:
    """The members of a copy group (wallets with near-equal Δs in one round) to refuse.

    `commitments` maps each wallet of the closed set to the payload_sha256 it signed; `held[w]` is
    what w's signed reveal lists, wallet -> payload_sha256 (a wallet without a reveal lists
    nothing; reveals of wallets outside the closed set are not counted). For each pair A, B: B's
    commitment in A's list means B committed before A revealed, so B cannot have copied A. If A
    lists B and B does not list A, A committed after B revealed — after it could see B's payload:
    A is the copier, and only A is refused. If each lists the other (both committed before either
    revealed: they agreed on the Δ beforehand), both are refused. A member is refused if any of
    its pairs refuses it.

    If neither lists the other, the rest of the closed set decides (`_fewer_listed`): the one whose
    commitment fewer of the other reveal lists hold is the copier; on a tie both are refused.
    """
    refused: set[str] = set()

    def lists(a: str, b: str) -> bool:
        return b in commitments and held.get(a, {}).get(b) == commitments[b]

    def listed_by(wallet: str) -> int:
        return sum(1 for other in commitments if other != wallet and lists(other, wallet))

    for a, b in combinations(sorted(set(group)), 2):
        a_lists_b, b_lists_a = lists(a, b), lists(b, a)
        if a_lists_b and not b_lists_a:
            refused.add(a)
        elif b_lists_a and not a_lists_b:
            refused.add(b)
        elif a_lists_b:
            refused |= {a, b}
        else:
            refused |= _fewer_listed({a: listed_by(a), b: listed_by(b)})
    return refused


def _fewer_listed(listed: Mapping[str, int]) -> set[str]:
    """Of a pair that does not list each other, the one held by strictly fewer reveal lists of the
    closed set (both on a tie): the copier when honest replicas are a majority of the set.

    This is the colluding copy: attacker A commits in time, is revealed to, and hands honest H's
    payload to attacker B, which commits late and lists nobody. Honest replicas reveal once they
    hold every live peer's commitment (exchange.py), so each of them lists H, which committed in
    time; B could only commit after H revealed, so an honest replica lists it only if it revealed
    later still, and then lists H as well. Only colluders list B without H, so the counts differ by
    the honest replicas listing H alone against the colluders listing B alone (each wallet's own
    list aside): B alone is refused when the honest replicas that revealed before B committed (H
    aside) outnumber B's fellow colluders — the case under an honest majority, since honest
    replicas reveal together at the end of the commit phase. With an honest minority the count can
    turn: colluders listing B alone outnumber honest replicas listing H alone, and H alone is
    refused — worse than refusing both. No count of lists does better without an honest majority
    of the closed set (Sybil wallets whose Δs pass screening count as lists too).
    """
    fewest = min(listed.values())
    losers = {w for w, n in listed.items() if n == fewest}
    return losers if len(losers) == 1 else set(listed)


def screen(
    contributions: Iterable[Contribution],
    numel: int,
    config: ValidationConfig | None,
    banned: Mapping[str, str],
    held: Mapping[str, Mapping[str, str]] | None = None,
) -> Screened:
    """Split a closed round's contributions into accepted and rejected (module docstring).
    `config` None skips the content checks (bans still apply); `banned` maps wallet -> why; `held`
    maps wallet -> the commitments its reveal lists (None: copies cannot be told apart, every
    member of a copy group is refused)."""
    ordered = sorted(contributions, key=lambda c: c.header.wallet)
    rejected = {
        c.header.wallet: f"banned: {banned[c.header.wallet]}" for c in ordered if c.header.wallet in banned
    }
    kept = [_decoded(c, numel) for c in ordered if c.header.wallet not in banned]
    if config is not None and len(kept) >= MIN_SCREENED:
        try:
            commitments = {c.header.wallet: c.header.payload_sha256 for c in kept}
            resolve = None if held is None else lambda group: copiers(group, commitments, held)
            verdicts = screen_round({c.header.wallet: c.delta for c in kept}, (numel,), config, resolve)
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
    """Wallets the kept round books prove to equivocate (both signed headers, or both signed
    reveals, are held) that are not banned yet, each with the reason: a wallet that lied once is
    refused in every later round, not just the one it lied in. Earliest round first, so the reason
    names the first lie."""
    found: dict[str, str] = {}
    for round_, book in sorted(books.items()):
        for wallet in sorted(book.proven_equivocators()):
            if wallet not in banned and wallet not in found:
                how = "" if wallet in book.equivocators else " (two reveals)"
                found[wallet] = f"equivocated in round {round_}{how}"
    return found
