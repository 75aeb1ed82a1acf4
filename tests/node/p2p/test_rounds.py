"""Round bookkeeping and the choices every replica must make alike."""

import pytest
import torch

from neuroshard.node.p2p.codec import encode_delta, sha256_hex
from neuroshard.node.p2p.rounds import Contribution, RoundBook, aggregate, ordered_mean, plurality
from neuroshard.node.p2p.wire import ContributionHeader, Rejected, StateInfo

BASE = "ab" * 32


def _contribution(wallet, seed: int, numel: int = 300) -> Contribution:  # type: ignore[no-untyped-def]
    payload = encode_delta(torch.randn(numel, generator=torch.Generator().manual_seed(seed)), "int8")
    header = ContributionHeader.create(
        wallet, stage=0, round=2, base_hash=BASE, tokens=1, encoding="int8", numel=numel,
        payload_sha256=sha256_hex(payload),
    )  # fmt: skip
    return Contribution(header, payload)


def test_aggregation_order_is_by_wallet_whatever_the_arrival_order(wallets) -> None:
    contributions = [_contribution(w, seed=i) for i, w in enumerate(wallets)]
    books = [RoundBook(stage=0, round_=2, base_hash=BASE, numel=300) for _ in range(2)]
    for book, order in zip(books, (contributions, contributions[::-1]), strict=True):
        for c in order:
            assert book.admit(c.header)
            book.accept(c)
    closed = [book.close(book.accepted) for book in books]
    assert [c.header.wallet for c in closed[0]] == sorted(w.public_key_hex for w in wallets)
    results = [aggregate(c, 300, ordered_mean) for c in closed]
    assert torch.equal(results[0], results[1])
    # Closing publishes the set and lets go of the decoded tensors the book held.
    assert books[0].aggregated == tuple(sorted(w.public_key_hex for w in wallets))
    with pytest.raises(Rejected, match="already aggregated"):
        books[0].accept(_contribution(wallets[0], seed=9))


def test_aggregate_refuses_a_rule_that_returns_garbage(wallets) -> None:
    contributions = [_contribution(wallets[0], seed=0)]
    with pytest.raises(ValueError, match="expected \\(300,\\) finite float32"):
        aggregate(contributions, 300, lambda stack: stack[0] * float("nan"))
    with pytest.raises(ValueError, match="nothing to aggregate"):
        aggregate([], 300, ordered_mean)
    buffer = torch.empty(4, 300)
    assert torch.equal(
        aggregate(contributions, 300, ordered_mean, buffer), aggregate(contributions, 300, ordered_mean)
    )


def test_ordered_mean_is_the_mean() -> None:
    stack = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(ordered_mean(stack), stack.mean(dim=0), atol=1e-6)


def test_plurality_majority_and_deterministic_tie_break(wallets) -> None:
    def info(wallet, theta_hash, round_=4):  # type: ignore[no-untyped-def]
        return StateInfo.create(
            wallet, stage=0, round=round_, theta_hash=theta_hash, momentum_hash="", numel=10
        )

    a, b = "aa" * 32, "bb" * 32
    vote = plurality([info(wallets[1], b), info(wallets[2], b), info(wallets[3], a, round_=3)], 4, a)
    assert vote is not None and (vote.theta_hash, vote.votes, vote.voters) == (b, 2, 3)
    assert [h.wallet for h in vote.holders] == [wallets[1].public_key_hex, wallets[2].public_key_hex]
    # One against one: both sides pick the same (smaller) hash, whoever counts.
    assert plurality([info(wallets[1], b)], 4, a).theta_hash == a  # type: ignore[union-attr]
    assert plurality([info(wallets[1], a)], 4, b).theta_hash == a  # type: ignore[union-attr]
    assert plurality([info(wallets[1], a)], 5, None) is None
