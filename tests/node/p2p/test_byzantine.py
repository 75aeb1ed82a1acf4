"""The attacker of `neuroshard-node --attack`: what it signs and sends, per attack, without a network."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from neuroshard.node import attacks
from neuroshard.node.cli import build_parser
from neuroshard.node.p2p.byzantine import (
    AttackConfig,
    Attacker,
    Forged,
    HonestRound,
    attacker_from_args,
    encode_unchecked,
    warning,
)
from neuroshard.node.p2p.codec import decode_delta, encode_delta, sha256_hex
from neuroshard.node.p2p.swarm import Node, report_rounds
from neuroshard.node.p2p.wire import InvalidMessage
from neuroshard.node.wallet import Wallet

NUMEL = 512
WALLET = Wallet.from_token("byzantine-test")
PEERS = tuple(sorted(Wallet.from_token(f"byzantine-peer-{i}").public_key_hex for i in range(4)))


def _delta(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * 1e-2


def _view(
    round_: int = 3, *, seen: dict[str, torch.Tensor] | None = None, theta_seed: int = 0
) -> HonestRound:
    theta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + theta_seed))
    return HonestRound(
        wallet=WALLET,
        stage=0,
        round=round_,
        base_hash=f"{round_:064x}",
        theta_round=theta,
        delta=_delta(round_),
        encoding="fp16",
        tokens=640,
        peers=PEERS,
        observe=lambda timeout_s: dict(seen or {}),
    )


def _sent(forged: Forged) -> torch.Tensor:
    header = forged.own.header
    assert header.signature_valid() and header.wallet == WALLET.public_key_hex
    assert header.payload_sha256 == sha256_hex(forged.own.payload)
    return decode_delta(forged.own.payload, header.encoding, NUMEL)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, rtol=1e-2, atol=1e-5))  # fp16 on the wire


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("sign_flip", lambda d: -d),
        ("scale", lambda d: d * 10),
        ("zero", torch.zeros_like),
    ],
)
def test_transform_attacks_sign_the_transformed_delta(name: str, expected) -> None:  # type: ignore[no-untyped-def]
    view = _view()
    forged = Attacker(AttackConfig(name=name)).forge(view)
    assert forged.outgoing is None and forged.note == name
    assert forged.own.header.base_hash == view.base_hash and forged.own.header.round == view.round
    assert _close(_sent(forged), expected(view.delta))


def test_gaussian_is_noise_of_the_honest_scale() -> None:
    view = _view()
    sent = _sent(Attacker(AttackConfig(name="gaussian", param=2.0)).forge(view))
    rms = float(view.delta.pow(2).mean().sqrt())
    assert float(sent.pow(2).mean().sqrt()) == pytest.approx(2 * rms, rel=0.1)
    assert abs(float(torch.nn.functional.cosine_similarity(sent, view.delta, dim=0))) < 0.2


def test_nan_goes_on_the_wire_and_the_wire_refuses_it() -> None:
    forged = Attacker(AttackConfig(name="nan", param=3)).forge(_view())
    with pytest.raises(InvalidMessage, match="non-finite"):
        decode_delta(forged.own.payload, "fp16", NUMEL)
    with pytest.raises(ValueError, match="non-finite"):
        encode_delta(attacks.nan(_delta(0)), "fp16")  # the honest encoder refuses what the attacker sends
    int8 = encode_unchecked(attacks.nan(_delta(0)), "int8")
    with pytest.raises(InvalidMessage, match="scales must be finite"):
        decode_delta(int8, "int8", NUMEL)


def test_equivocate_sends_two_signed_payloads_to_the_two_halves() -> None:
    forged = Attacker(AttackConfig(name="equivocate")).forge(_view())
    assert forged.outgoing is not None
    sent = [forged.outgoing(peer) for peer in PEERS]
    assert sent[0] == sent[1] == forged.own and sent[2] == sent[3] != forged.own
    first, second = forged.own.header, sent[2].header
    assert first.signature_valid() and second.signature_valid()
    assert (first.wallet, first.round) == (second.wallet, second.round)
    assert first.payload_sha256 != second.payload_sha256


def test_stale_replays_its_delta_from_k_rounds_ago_once_it_has_one() -> None:
    attacker = Attacker(AttackConfig(name="stale", param=2))
    sent = []
    for r in range(4):
        forged = attacker.forge(_view(r))
        sent.append(_sent(forged))
        assert ("no history yet" in forged.note) == (r < 2)
    assert _close(sent[0], _delta(0)) and _close(sent[1], _delta(1))
    assert _close(sent[2], _delta(0)) and _close(sent[3], _delta(1))


def test_wrong_base_signs_an_old_base_hash() -> None:
    attacker = Attacker(AttackConfig(name="wrong_base"))
    old = _view(4, theta_seed=4)
    first = attacker.forge(old)
    assert first.own.header.base_hash == old.base_hash and "honest" in first.note
    now = _view(5, theta_seed=5)
    forged = attacker.forge(now)
    assert forged.own.header.base_hash == old.base_hash != now.base_hash
    assert _close(_sent(forged), now.delta + (now.theta_round - old.theta_round))


def test_observing_attacks_use_the_peers_contributions() -> None:
    seen = {PEERS[i]: _delta(10 + i) for i in range(3)}
    honest = torch.stack([seen[w] for w in sorted(seen)])
    copy = Attacker(AttackConfig(name="copy")).forge(_view(seen=seen))
    assert copy.note == "copy (observed 3)"
    sent = _sent(copy)
    assert float((sent - honest[0]).norm() / honest[0].norm()) == pytest.approx(0.01, abs=0.005)
    assert _close(_sent(Attacker(AttackConfig(name="ipm")).forge(_view(seen=seen))), -0.5 * honest.mean(0))
    z = 0.3
    alie = _sent(Attacker(AttackConfig(name="alie", param=z)).forge(_view(seen=seen)))
    assert _close(alie, honest.mean(0) + z * honest.std(0))
    alone = Attacker(AttackConfig(name="ipm")).forge(_view())
    assert "nothing observed" in alone.note and _close(_sent(alone), _view().delta)


def test_unknown_attack_and_bad_params_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="unknown attack 'melt'"):
        AttackConfig(name="melt")
    with pytest.raises(ValueError, match="must be >= 1"):
        AttackConfig(name="stale", param=0)


def test_the_cli_flag_builds_an_attacker_and_a_loud_warning() -> None:
    args = build_parser().parse_args(["--peers", "127.0.0.1:1", "--attack", "scale", "--attack-param", "5"])
    attacker = attacker_from_args(args)
    assert attacker is not None and attacker.config.strength == 5.0
    assert warning(attacker).startswith("WARNING: ATTACK MODE scale (param 5)")
    assert attacker_from_args(build_parser().parse_args([])) is None


def test_the_swarm_labels_attackers_and_compares_honest_hashes(capsys: pytest.CaptureFixture[str]) -> None:
    from neuroshard.node.p2p.swarm import build_parser as swarm_parser
    from neuroshard.node.p2p.swarm import node_argv

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
