"""Screening a closed round before aggregation: content checks, bans, determinism."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from neuroshard.node import aggregation
from neuroshard.node.p2p.codec import decode_delta
from neuroshard.node.p2p.rounds import Contribution, aggregate
from neuroshard.node.p2p.screening import MIN_SCREENED, copiers, screen
from neuroshard.node.validation import ValidationConfig
from neuroshard.node.wallet import Wallet

NUMEL = 1000
MakeContribution = Callable[..., tuple[object, bytes]]


@pytest.fixture
def round_of(make_contribution: MakeContribution) -> Callable[..., list[Contribution]]:
    """Contributions of n wallets whose Δs share one direction plus their own noise (honest-like);
    `forge` maps a wallet index to a function replacing that wallet's Δ."""

    def build(
        n: int, forge: dict[int, Callable[[torch.Tensor], torch.Tensor]] | None = None
    ) -> list[Contribution]:
        gen = torch.Generator().manual_seed(7)
        common = torch.randn(NUMEL, generator=gen) * 1e-2
        out = []
        for i in range(n):
            delta = common + torch.randn(NUMEL, generator=gen) * 5e-3
            if forge and i in forge:
                delta = forge[i](delta)
            header, payload = make_contribution(Wallet.from_token(f"screen-{i}"), delta=delta)
            out.append(Contribution(header, payload, decode_delta(payload, "int8", NUMEL)))  # type: ignore[arg-type]
        return out

    return build


def _key(i: int) -> str:
    return Wallet.from_token(f"screen-{i}").public_key_hex


def test_forged_contributions_are_refused_with_the_reason(round_of) -> None:
    forge = {1: lambda d: -d, 3: lambda d: d * 10, 4: torch.zeros_like}
    kept = screen(round_of(6, forge), NUMEL, ValidationConfig(), {})
    reasons = dict(kept.rejected)
    assert set(reasons) == {_key(1), _key(3), _key(4)}
    assert reasons[_key(1)].startswith("cosine: ")
    assert reasons[_key(3)].startswith("norm_ratio: ")
    assert reasons[_key(4)].startswith("zero: ")
    assert [c.header.wallet for c in kept.accepted] == sorted([_key(0), _key(2), _key(5)])


def test_a_copy_is_refused_with_its_original(round_of) -> None:
    contributions = round_of(5)
    copied = contributions[0]
    contributions[4] = Contribution(contributions[4].header, copied.payload, copied.delta)
    kept = screen(contributions, NUMEL, ValidationConfig(), {})
    # Content cannot tell the original from the copy (validation.find_copies): both go.
    assert {w for w, r in kept.rejected if r.startswith("duplicate: ")} == {_key(0), _key(4)}


SHA = {"a": "0a" * 32, "b": "0b" * 32, "c": "0c" * 32}


@pytest.mark.parametrize(
    ("held", "refused"),
    [
        # b committed before a revealed; a is not in b's list: a committed after b revealed.
        ({"a": {"a": SHA["a"], "b": SHA["b"]}, "b": {"b": SHA["b"]}}, {"a"}),
        ({"a": {"a": SHA["a"]}, "b": {"a": SHA["a"], "b": SHA["b"]}}, {"b"}),
        # Each committed before the other revealed: they agreed on the Δ beforehand.
        ({"a": {"a": SHA["a"], "b": SHA["b"]}, "b": {"a": SHA["a"], "b": SHA["b"]}}, {"a", "b"}),
        # Neither lists the other, or there is no reveal at all: nothing tells who saw whom.
        ({"a": {"a": SHA["a"]}, "b": {"b": SHA["b"]}}, {"a", "b"}),
        ({}, {"a", "b"}),
        # A listed commitment with another payload_sha256 is not b's commitment.
        ({"a": {"a": SHA["a"], "b": "ff" * 32}, "b": {"b": SHA["b"]}}, {"a", "b"}),
    ],
)
def test_copiers_of_a_pair(held, refused) -> None:
    assert copiers({"a", "b"}, SHA, held) == refused


def test_copiers_of_a_group_keep_the_original_only() -> None:
    # c revealed holding only its own commitment; a and b copied it later, each listing c; a also
    # lists b (b committed before a revealed), b does not list a.
    held = {
        "c": {"c": SHA["c"]},
        "a": {"a": SHA["a"], "b": SHA["b"], "c": SHA["c"]},
        "b": {"b": SHA["b"], "c": SHA["c"]},
    }
    assert copiers({"a", "b", "c"}, SHA, held) == {"a", "b"}
    assert copiers({"c", "b", "a"}, SHA, dict(reversed(held.items()))) == {"a", "b"}  # order-free


def _reveal_lists(commitments: dict[str, str], **lists: str) -> dict[str, dict[str, str]]:
    """Wallet -> its reveal list, given as the letters of the wallets it names."""
    return {w: {v: commitments[v] for v in named} for w, named in lists.items()}


COLLUDING = {w: f"{i:02x}" * 32 for i, w in enumerate("abcdhx", start=10)}
"""h, c, d honest and committed in time; a colluder, revealed to, handed h's payload to colluder b,
which committed late and lists only itself; a lists b, not h. b and h's Δs are equal."""


def test_copiers_when_neither_lists_the_other_refuse_the_one_fewer_lists_hold() -> None:
    commitments = {w: COLLUDING[w] for w in "abcdh"}
    honest = dict.fromkeys("cdh", "acdh")
    held = _reveal_lists(commitments, a="abcd", b="b", **honest)
    # h is held by c and d, b by a alone: b is the copier, and the verdict is order-free.
    assert copiers({"h", "b"}, commitments, held) == {"b"}
    assert copiers(["b", "h"], dict(reversed(commitments.items())), dict(reversed(held.items()))) == {"b"}
    # A reveal of a wallet outside the closed set does not count.
    held |= _reveal_lists(COLLUDING, x="bx")
    assert copiers({"h", "b"}, commitments, held) == {"b"}
    # With x in the set, b is held by a and x, h by c and d: a tie, both go.
    assert copiers({"h", "b"}, COLLUDING, held) == {"b", "h"}


def test_copiers_with_an_honest_minority_refuse_the_original() -> None:
    # The known limit (_fewer_listed): colluders a, x list the late copy b; only c lists h. The
    # count names h, the original, as the copier. This pins the documented failure, not a goal.
    commitments = {"a": "0a" * 32, "b": "0b" * 32, "c": "0c" * 32, "h": "0d" * 32, "x": "0e" * 32}
    held = {
        "h": {"h": commitments["h"], "c": commitments["c"]},
        "c": {"h": commitments["h"], "c": commitments["c"]},
        "b": {"b": commitments["b"]},
        "a": {w: commitments[w] for w in ("a", "b", "x")},
        "x": {w: commitments[w] for w in ("a", "b", "x")},
    }
    assert copiers({"h", "b"}, commitments, held) == {"h"}


def test_a_copy_is_refused_alone_when_the_reveals_tell_who_copied(round_of) -> None:
    contributions = round_of(5)
    original = contributions[0]
    contributions[4] = Contribution(contributions[4].header, original.payload, original.delta)
    commitments = {c.header.wallet: c.header.payload_sha256 for c in contributions}
    # Every honest replica revealed after all five committed except the copier, which committed
    # after the original's reveal (so no honest list holds it) and lists everyone.
    honest = {w: h for w, h in commitments.items() if w != _key(4)}
    held = {w: dict(honest) for w in honest} | {_key(4): dict(commitments)}
    kept = screen(contributions, NUMEL, ValidationConfig(), {}, held)
    assert [w for w, r in kept.rejected] == [_key(4)] and kept.rejected[0][1].startswith("duplicate: ")
    assert _key(0) in [c.header.wallet for c in kept.accepted]
    # The copier lists nobody but itself (the colluding copy): the honest lists hold the original
    # and not the copy, so the copy alone still goes.
    held[_key(4)] = {_key(4): commitments[_key(4)]}
    kept = screen(contributions, NUMEL, ValidationConfig(), {}, held)
    assert [w for w, _ in kept.rejected] == [_key(4)]


def test_verdicts_and_aggregate_do_not_depend_on_arrival_order(round_of) -> None:
    contributions = round_of(7, {2: lambda d: -d, 5: lambda d: d * 8})
    results = []
    for seed in range(4):
        shuffled = contributions[:]
        random.Random(seed).shuffle(shuffled)
        kept = screen(shuffled, NUMEL, ValidationConfig(), {})
        rule = lambda s: aggregation.aggregate("default", s)  # noqa: E731
        results.append(
            (kept.rejected, [c.header.wallet for c in kept.accepted], aggregate(kept.accepted, NUMEL, rule))
        )
    for rejected, accepted, theta in results[1:]:
        assert rejected == results[0][0] and accepted == results[0][1]
        assert torch.equal(theta, results[0][2])  # bit-identical


def test_a_banned_wallet_is_refused_and_left_out_of_the_reference(round_of) -> None:
    contributions = round_of(5)
    banned = {_key(2): "equivocated in round 1"}
    kept = screen(contributions, NUMEL, ValidationConfig(), banned)
    assert kept.rejected == ((_key(2), "banned: equivocated in round 1"),)
    assert _key(2) not in [c.header.wallet for c in kept.accepted] and len(kept.accepted) == 4
    # Bans hold even with the content checks off.
    assert screen(contributions, NUMEL, None, banned).rejected == kept.rejected


def test_too_few_contributions_skip_the_content_checks(round_of) -> None:
    # With two, the median is their mean: a sign flip would pull it to ~0 and get the honest one
    # refused too, so nothing is judged on content below MIN_SCREENED.
    assert MIN_SCREENED == 3
    pair = round_of(2, {1: lambda d: -d})
    assert screen(pair, NUMEL, ValidationConfig(), {}).rejected == ()
    three = round_of(3, {1: lambda d: -d})
    assert [w for w, _ in screen(three, NUMEL, ValidationConfig(), {}).rejected] == [_key(1)]


def test_undecoded_contributions_are_decoded_from_their_payload(round_of) -> None:
    contributions = [Contribution(c.header, c.payload) for c in round_of(4, {0: lambda d: -d})]
    kept = screen(contributions, NUMEL, ValidationConfig(), {})
    assert [w for w, _ in kept.rejected] == [_key(0)]
    assert all(c.delta is not None and c.delta.shape == (NUMEL,) for c in kept.accepted)


def test_an_equivocation_proven_in_any_kept_book_bans_the_wallet(make_contribution) -> None:
    from neuroshard.node.p2p.rounds import RoundBook
    from neuroshard.node.p2p.screening import new_bans
    from neuroshard.node.p2p.wire import Rejected

    liar, honest = Wallet.from_token("screen-liar"), Wallet.from_token("screen-honest")
    books = {}
    for round_ in (2, 3):
        first, payload = make_contribution(liar, seed=1, round_=round_)
        second, _ = make_contribution(liar, seed=2, round_=round_)
        book = RoundBook(stage=0, round_=round_, base_hash=first.base_hash, numel=NUMEL)
        for header, body in (make_contribution(honest, round_=round_), (first, payload)):
            assert book.admit(header)
            book.accept(Contribution(header, body))
        with pytest.raises(Rejected, match="signed two different contributions"):
            book.admit(second)
        books[round_] = book
    assert new_bans(books, {}) == {liar.public_key_hex: "equivocated in round 2"}
    assert new_bans(books, {liar.public_key_hex: "equivocated in round 2"}) == {}  # only new ones


def test_a_majority_of_zero_deltas_leaves_nothing_to_judge_against_but_does_not_fail(round_of) -> None:
    contributions = round_of(5, {i: torch.zeros_like for i in (0, 1, 2)})
    kept = screen(contributions, NUMEL, ValidationConfig(), {_key(4): "equivocated in round 0"})
    assert kept.rejected == ((_key(4), "banned: equivocated in round 0"),)
    assert [c.header.wallet for c in kept.accepted] == sorted(_key(i) for i in range(4))
