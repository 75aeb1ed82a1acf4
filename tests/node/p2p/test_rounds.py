"""The choices every replica must make alike around a round, and the round line it logs."""

import torch

from neuroshard.node.p2p.rounds import RoundReport, ordered_mean, plurality
from neuroshard.protocol.peer import StateInfo


def test_ordered_mean_is_the_mean_and_the_same_bits_whatever_the_thread_count() -> None:
    stack = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(ordered_mean(stack), stack.mean(dim=0), atol=1e-6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ordered_mean(stack)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, ordered_mean(stack))


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


def test_the_round_line_names_every_refusal_and_the_attack() -> None:
    good, bad, cheat = "a1" * 32, "b2" * 32, "c3" * 32
    report = RoundReport(
        stage=0, round=7, accepted=(good, bad, cheat),
        rejected=((bad, "part 1: norm_ratio 9.8 > 5"), (cheat, "equivocation: signed two commitments for round 7")),
        equivocators=(cheat,), late=False, next_round=8, theta_hash="ef" * 32, agree=2, voters=3,
        resynced_from=good, seconds=1.5, exchange_s=1.0, commit_s=0.25,
    )  # fmt: skip
    line = report.line()
    assert line.startswith(f"p2p round=7 aggregated 3, minority: re-synced; θ_8 {'ef' * 8} agree=2/3 ")
    assert "exchange 1.00 (commit 0.25)" in line
    assert f"; rejected {bad[:12]}: part 1: norm_ratio 9.8 > 5" in line
    assert f"; rejected {cheat[:12]}: equivocation" in line and f"; equivocator {cheat[:12]}" in line
