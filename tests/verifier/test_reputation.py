import pytest

from neuroshard.verifier.reputation import (
    ReputationConfig,
    Vote,
    is_refused,
    judge_round,
    majority,
    next_reputation,
)

CFG = ReputationConfig()
H1, H2, H3 = "1" * 64, "2" * 64, "3" * 64
BASE = "b" * 64


def deltas(judgement: object) -> dict[str, float]:
    out: dict[str, float] = {}
    for adj in judgement.adjustments:  # type: ignore[attr-defined]
        out[adj.wallet_id] = out.get(adj.wallet_id, 0.0) + adj.delta
    return out


def test_majority_needs_more_than_half() -> None:
    assert majority([H1, H1, H2]).hash == H1
    assert majority([H1, H2]).hash is None
    assert majority([H1, H1, H2, H3]).hash is None
    assert majority([H1, H1, H2, H3]).agreeing == 2
    assert majority([]).agreement_rate is None
    assert majority([H1, H1, H1, H2]).agreement_rate == 0.75


def test_minority_loses_and_majority_gains() -> None:
    votes = [Vote("a", H1, BASE), Vote("b", H1, BASE), Vote("c", H1, BASE), Vote("x", H2, BASE)]
    j = judge_round(votes, None, CFG, stage=0, round_=3)
    assert j.majority.hash == H1
    assert deltas(j) == {
        "a": CFG.agree_reward,
        "b": CFG.agree_reward,
        "c": CFG.agree_reward,
        "x": -CFG.minority_penalty,
    }


def test_a_split_round_moves_nobody() -> None:
    j = judge_round([Vote("a", H1, BASE), Vote("b", H2, BASE)], None, CFG, stage=0, round_=0)
    assert j.majority.hash is None
    assert j.adjustments == []


def test_claims_need_a_majority_of_majority_reporters() -> None:
    honest = [Vote(w, H1, BASE, rejected=(("x", "norm too large"),)) for w in "ab"] + [Vote("c", H1, BASE)]
    j = judge_round([*honest, Vote("x", H1, BASE)], None, CFG, stage=0, round_=1)
    # 2 of the 3 other majority reporters rejected x: the claim stands
    assert deltas(j)["x"] == pytest.approx(CFG.agree_reward - CFG.rejected_penalty)
    assert any("norm too large" in a.reason for a in j.adjustments)


def test_a_lone_liar_cannot_talk_an_honest_wallet_down() -> None:
    votes = [
        Vote("liar", H1, BASE, rejected=(("a", "bad"),), equivocators=("a",)),
        Vote("a", H1, BASE),
        Vote("b", H1, BASE),
        Vote("c", H1, BASE),
    ]
    j = judge_round(votes, None, CFG, stage=0, round_=1)
    assert deltas(j)["a"] == CFG.agree_reward


def test_claims_from_the_minority_do_not_count() -> None:
    votes = [
        Vote("a", H1, BASE),
        Vote("b", H1, BASE),
        Vote("m1", H2, BASE, equivocators=("a",)),
        Vote("m2", H2, BASE, equivocators=("a",)),
    ]
    j = judge_round([*votes, Vote("c", H1, BASE)], None, CFG, stage=0, round_=1)
    assert deltas(j)["a"] == CFG.agree_reward


def test_equivocation_reported_by_the_majority() -> None:
    votes = [Vote(w, H1, BASE, equivocators=("x",)) for w in "abc"] + [Vote("x", H2, BASE)]
    j = judge_round(votes, None, CFG, stage=0, round_=2)
    assert deltas(j)["x"] == pytest.approx(-CFG.minority_penalty - CFG.equivocation_penalty)


def test_sync_counts_base_hashes_against_the_previous_majority() -> None:
    votes = [Vote("a", H1, BASE), Vote("b", H1, BASE), Vote("c", H1, "0" * 64)]
    j = judge_round(votes, BASE, CFG, stage=0, round_=4)
    assert (j.synced, j.sync_checked) == (2, 3)
    assert judge_round(votes, None, CFG, stage=0, round_=0).sync_checked == 0


def test_clamping_and_refusal() -> None:
    assert next_reputation(0.99, 0.05, CFG) == CFG.maximum
    assert next_reputation(0.05, -0.5, CFG) == 0.0
    rep = CFG.initial
    history = []
    for _ in range(3):
        rep = next_reputation(rep, -CFG.minority_penalty, CFG)
        history.append(is_refused(rep, CFG))
    assert history == [False, False, True]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="refuse_below"):
        ReputationConfig(initial=0.1, refuse_below=0.2)
