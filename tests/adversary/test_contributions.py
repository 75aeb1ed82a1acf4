"""The attacker of `neuroshard-adversary --attack`: the round input it forges, per attack, without a network."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from neuroshard.adversary.cli import attacker_from_args, roles_from_args
from neuroshard.adversary.cli import build_parser as adversary_parser
from neuroshard.adversary.contributions import AttackConfig, Attacker, ForgingRound, warning
from neuroshard.cli.node import Roles
from neuroshard.cli.node_flags import build_parser
from neuroshard.node.outer.round import OuterRound
from neuroshard.node.outer.state import RoundInput
from neuroshard.node.trainer import Trainer
from neuroshard.node.wallet import Wallet
from neuroshard.swarm.cli import Node, report_rounds

NUMEL = 512
WALLET = Wallet.from_token("byzantine-test")
MEMBERS = tuple(
    sorted(
        [WALLET.public_key_hex, *(Wallet.from_token(f"byzantine-peer-{i}").public_key_hex for i in range(4))]
    )
)


def _delta(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * 1e-2


def _theta(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + seed))


def _honest(round_: int = 3) -> RoundInput:
    return RoundInput(
        stage=0,
        round=round_,
        base_hash=f"{round_:064x}",
        members=MEMBERS,
        delta=_delta(round_),
        tokens=640,
        banned=frozenset({"ee" * 32}),
    )


def _forge(attacker: Attacker, round_: int = 3) -> tuple[RoundInput, RoundInput, str]:
    """(honest input, forged input, note) for `round_`, θ_round seeded by the round."""
    honest = _honest(round_)
    kept = honest.delta.clone()
    forged, note = attacker.forge_input(honest, _theta(round_))
    assert torch.equal(honest.delta, kept), "the honest Δ must not be changed in place"
    return honest, forged, note


def _only_delta_differs(honest: RoundInput, forged: RoundInput) -> bool:
    return replace(forged, delta=honest.delta) == honest


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("sign_flip", lambda d: -d),
        ("scale", lambda d: d * 10),
        ("zero", torch.zeros_like),
        ("ipm", lambda d: -0.5 * d),  # −ε · the mean of what it holds when committing: its own Δ
        ("alie", lambda d: d),  # mean + z·σ of its own Δ alone: σ = 0, so its Δ
    ],
)
def test_transform_attacks_commit_to_the_transformed_delta(name: str, expected) -> None:  # type: ignore[no-untyped-def]
    honest, forged, note = _forge(Attacker(AttackConfig(name=name)))
    assert note == name and _only_delta_differs(honest, forged)
    assert forged.delta.shape == (NUMEL,) and forged.delta.dtype == torch.float32
    assert torch.allclose(forged.delta, expected(honest.delta), rtol=1e-6, atol=1e-7)


def test_gaussian_is_noise_of_the_honest_scale() -> None:
    honest, forged, note = _forge(Attacker(AttackConfig(name="gaussian", param=2.0)))
    assert note == "gaussian" and _only_delta_differs(honest, forged)
    rms = float(honest.delta.pow(2).mean().sqrt())
    assert float(forged.delta.pow(2).mean().sqrt()) == pytest.approx(2 * rms, rel=0.1)
    assert abs(float(torch.nn.functional.cosine_similarity(forged.delta, honest.delta, dim=0))) < 0.2
    # Seeded: the same attack config forges the same noise.
    assert torch.equal(_forge(Attacker(AttackConfig(name="gaussian", param=2.0)))[1].delta, forged.delta)


def test_stale_replays_its_delta_from_k_rounds_ago_once_it_has_one() -> None:
    attacker = Attacker(AttackConfig(name="stale", param=2))
    for r in range(5):
        honest, forged, note = _forge(attacker, r)
        assert _only_delta_differs(honest, forged)
        if r < 2:
            assert "no history yet" in note and torch.equal(forged.delta, honest.delta)
        else:
            assert note == "stale" and torch.equal(forged.delta, _delta(r - 2))


def test_wrong_base_commits_against_an_old_base_hash() -> None:
    attacker = Attacker(AttackConfig(name="wrong_base"))
    old, first, note = _forge(attacker, 4)
    assert first is old and "honest" in note
    now, forged, note = _forge(attacker, 5)
    assert note == "wrong_base"
    assert forged.base_hash == old.base_hash != now.base_hash
    assert replace(forged, delta=now.delta, base_hash=now.base_hash) == now
    assert torch.allclose(forged.delta, now.delta + (_theta(5) - _theta(4)))


@pytest.mark.parametrize("name", ["copy", "equivocate", "nan"])
def test_attacks_not_mounted_in_the_partitioned_round_send_the_honest_input(name: str) -> None:
    honest, forged, note = _forge(Attacker(AttackConfig(name=name)))
    assert forged is honest and note == f"{name} (not mounted in the partitioned round: honest Δ)"


def test_unknown_attack_and_bad_params_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="unknown attack 'melt'"):
        AttackConfig(name="melt")
    with pytest.raises(ValueError, match="must be >= 1"):
        AttackConfig(name="stale", param=0)


def test_the_cli_flag_builds_an_attacker_and_a_loud_warning() -> None:
    args = adversary_parser().parse_args(
        ["--peers", "127.0.0.1:1", "--attack", "scale", "--attack-param", "5"]
    )
    attacker = attacker_from_args(args)
    assert attacker.config.strength == 5.0
    assert warning(attacker).startswith("WARNING: ATTACK MODE scale (param 5)")
    roles = roles_from_args(args)
    assert roles.banner == warning(attacker) and roles.trainer is Trainer
    assert roles.rounds(lambda: torch.zeros(1)).func is ForgingRound  # type: ignore[attr-defined]
    with pytest.raises(SystemExit):  # an adversary must say what it does wrong
        adversary_parser().parse_args([])


def test_the_attacker_reads_aggregates_back_with_the_outer_step_the_node_runs() -> None:
    # The outer lr's default depends on H (node.diloco.tuned_outer_lr): the attacker follows it.
    base = ["--peers", "127.0.0.1:1", "--attack", "alie_search"]
    short = attacker_from_args(adversary_parser().parse_args([*base, "--inner-steps", "10"]))
    long = attacker_from_args(adversary_parser().parse_args([*base, "--inner-steps", "100"]))
    given = attacker_from_args(
        adversary_parser().parse_args([*base, "--inner-steps", "10", "--outer-lr", "1.2"])
    )
    assert (short.config.outer_lr, long.config.outer_lr, given.config.outer_lr) == (0.7, 1.0, 1.2)
    assert short.config.outer_warmup_rounds == 0  # the node's flag default, not a network.toml's 3
    ramped = attacker_from_args(adversary_parser().parse_args([*base, "--outer-warmup-rounds", "3"]))
    assert ramped.config.outer_warmup_rounds == 3
    with pytest.raises(SystemExit, match="neuroshard-adversary: error: DiLoCoConfig: outer_lr must be > 0"):
        attacker_from_args(adversary_parser().parse_args([*base, "--outer-lr", "0"]))


def test_the_honest_node_has_no_attack_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--attack", "--owner-attack", "--work-lie"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([flag, "scale"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "attack" not in capsys.readouterr().out.lower()
    assert Roles().rounds(lambda: torch.zeros(1)) is OuterRound and Roles().trainer is Trainer


def test_the_swarm_labels_attackers_and_compares_honest_hashes(capsys: pytest.CaptureFixture[str]) -> None:
    from neuroshard.swarm.cli import build_parser as swarm_parser
    from neuroshard.swarm.cli import node_argv

    nodes = [Node(i, 7420 + i, Path("."), f"w{i}", attack="nan" if i == 2 else None) for i in range(3)]
    nodes[0].rounds, nodes[1].rounds, nodes[2].rounds = {0: "aa"}, {0: "aa"}, {0: "ff"}
    report_rounds(nodes, set())
    assert (
        "round 0: 2/2 honest nodes agree on θ hash aa; ATTACKER node 2 (nan) θ hash ff"
        in capsys.readouterr().out
    )
    args = swarm_parser().parse_args(["--nodes", "3", "--byzantine", "1", "--attack", "nan"])
    assert isinstance(args, argparse.Namespace)
    argv = node_argv(args, nodes[2], [7420, 7421, 7422], [], threads=1)
    assert argv[argv.index("--attack") + 1] == "nan"
    assert "--attack" not in node_argv(args, nodes[0], [7420, 7421, 7422], [], threads=1)


def test_owner_attack_and_work_lie_flags_mount_the_adversary_parts() -> None:
    from neuroshard.adversary.owners import MismatchedPart, Withholder
    from neuroshard.adversary.work_lies import ScaledDeltaTrainer, UnassignedDataTrainer

    def roles(*argv: str) -> Roles:
        return roles_from_args(adversary_parser().parse_args(list(argv)))

    assert roles("--owner-attack", "withholder").rounds(lambda: torch.zeros(1)) is Withholder
    assert roles("--owner-attack", "mismatched_part").rounds(lambda: torch.zeros(1)) is MismatchedPart
    assert roles("--work-lie", "delta").trainer is ScaledDeltaTrainer
    assert roles("--work-lie", "data").trainer is UnassignedDataTrainer
    with pytest.raises(SystemExit):
        adversary_parser().parse_args(["--owner-attack", "bribe"])
    with pytest.raises(SystemExit):  # one wrong at a time
        adversary_parser().parse_args(["--attack", "scale", "--work-lie", "delta"])


def test_an_adversary_at_a_later_stage_is_refused_rather_than_running_honestly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from neuroshard.adversary.cli import main

    monkeypatch.setenv("NEUROSHARD_TOKEN", "adversary-stage-test")
    argv = ["--home", str(tmp_path), "--stages", "2", "--stage", "1", "--attack", "scale", "--threads", "1"]
    assert main(argv) == 2
    assert "mounted at stage 0 only" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_a_realistic_attacker_aims_under_the_anchor_when_the_round_has_one() -> None:
    """In an anchored round the realistic colluder knows the anchor (the public momentum buffer):
    its forged Δ clears the floor, where the same search without the anchor would not have to."""
    anchor = sum(_delta(r) for r in range(4))  # where its Δs go on average, as the buffer is
    cosines = {}
    for anchored in (True, False):
        attacker = Attacker(AttackConfig(name="minsum_sign", outer_lr=0.7, anchor_floor=0.3))
        for r in range(4):
            honest = replace(_honest(r), anchor=anchor if anchored else None)
            forged, note = attacker.forge_input(honest, _theta(r))
            if r >= 2:  # something revealed: the search runs
                assert "realistic" in note and "no γ passes" not in note, note
                cosines[anchored, r] = float(
                    torch.nn.functional.cosine_similarity(forged.delta, anchor, dim=0)
                )
    assert all(cosines[True, r] >= 0.3 - 1e-6 for r in (2, 3)), cosines
    assert any(cosines[False, r] < 0.3 for r in (2, 3)), cosines  # unanchored, it goes further
