"""`neuroshard-swarm --nodes 6 --byzantine 2 --attack NAME` with a realistic adaptive attack.

Real processes on loopback, the real partitioned round: each of the two colluders commits, before
anything of the round is revealed, to the Δ its search picks from its own honest Δ and the
aggregates earlier rounds revealed (adversary/contributions.py), aimed just inside the per-part
screening. The honest replicas must still agree on θ every round, refuse none of each other's
contributions, and learn. Short (micro model, H = 10, 5 rounds) and marked slow. First, without a
network, what the wire attacker reads back and forges.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from neuroshard.adversary.contributions import AttackConfig, Attacker, revealed_aggregate
from neuroshard.node.outer.state import RoundInput
from neuroshard.node.wallet import Wallet
from tests.swarm.test_swarm import swarm_command

pytestmark = pytest.mark.xdist_group("swarms")  # one swarm at a time (scripts/test)

NODES, BYZANTINE, H, ROUNDS = 6, 2, 10, 5
HONEST = range(NODES - BYZANTINE)
AGREE = re.compile(
    r"^\[swarm\] round (\d+): ([34])/\2 honest nodes agree on θ hash [0-9a-f]+; ATTACKER node 4 "
)
"""A node that starts last may join round 0 by state sync and have nothing to report for it: 3/3."""
ROUND_LINE = re.compile(r"^\[(\d)\] p2p round=(\d+) ")
LOSS = re.compile(r"^\[(\d)\] step=\d+ round=\d+ loss=([0-9.]+) ")


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_revealed_aggregate_reads_the_outer_step_back(momentum: float) -> None:
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(1000, generator=gen).requires_grad_(True)
    outer = torch.optim.SGD([theta], lr=0.7, momentum=momentum, nesterov=momentum > 0)
    buffer = None
    for _ in range(4):
        g = torch.randn(1000, generator=gen)
        before = theta.detach().clone()
        theta.grad = g.clone()
        outer.step()
        read, buffer = revealed_aggregate(before, theta.detach().clone(), buffer, 0.7, momentum)
        torch.testing.assert_close(read, g, rtol=1e-4, atol=1e-5)


def test_the_wire_attacker_reads_the_ramped_rounds_of_an_outer_warmup_back() -> None:
    # A network.toml's default ramps the outer lr over 3 rounds: round r's step is lr·min(1, (r+1)/3).
    members = tuple(sorted(f"{i:02d}" * 32 for i in range(6)))
    attacker = Attacker(
        AttackConfig(name="alie_search", outer_lr=0.7, outer_momentum=0.5, outer_warmup_rounds=3)
    )
    gen = torch.Generator().manual_seed(2)
    theta = torch.randn(512, generator=gen).requires_grad_(True)
    outer = torch.optim.SGD([theta], lr=0.7, momentum=0.5, nesterov=True)
    applied: list[torch.Tensor] = []
    for r in range(5):
        delta = torch.randn(512, generator=gen)
        honest = RoundInput(stage=0, round=r, base_hash=f"{r:064x}", members=members, delta=delta, tokens=64)
        attacker.forge_input(honest, theta.detach().clone())
        if r > 0:  # round r − 1's aggregate, read back from θ at round r
            torch.testing.assert_close(attacker._aggregates[-1], applied[-1], rtol=1e-4, atol=1e-4)
        g = torch.randn(512, generator=gen)
        outer.param_groups[0]["lr"] = 0.7 * min(1.0, (r + 1) / 3)
        theta.grad = g.clone()
        outer.step()
        applied.append(g)


def test_the_wire_attacker_waits_for_a_revealed_round_then_searches_inside_the_screening() -> None:
    members = tuple(sorted(f"{i:02d}" * 32 for i in range(6)))
    attacker = Attacker(AttackConfig(name="alie_search", outer_lr=1.0, outer_momentum=0.5))
    gen = torch.Generator().manual_seed(1)
    direction = torch.randn(4096, generator=gen)
    theta = torch.zeros(4096)
    buffer = torch.zeros(4096)
    for r in range(3):
        delta = direction + 0.8 * torch.randn(4096, generator=gen)
        honest = RoundInput(stage=0, round=r, base_hash=f"{r:064x}", members=members, delta=delta, tokens=64)
        forged, note = attacker.forge_input(honest, theta)
        if r == 0:
            assert forged == honest and "nothing revealed yet" in note
        else:
            assert "alie_search (realistic, γ=" in note and attacker.gamma > 0
            assert not torch.equal(forged.delta, honest.delta)
            assert (forged.base_hash, forged.members) == (honest.base_hash, honest.members)
        aggregate = direction + 0.3 * torch.randn(4096, generator=gen)  # what the round revealed
        buffer = 0.5 * buffer + aggregate
        theta = theta - (aggregate + 0.5 * buffer)


def run_swarm(published, home: Path, attack: str) -> list[str]:  # type: ignore[no-untyped-def]
    command = swarm_command(
        published, home,
        "--nodes", str(NODES), "--byzantine", str(BYZANTINE), "--attack", attack,
        "--inner-steps", str(H), "--max-steps", str(ROUNDS * H), "--round-timeout", "30",
        nodes=NODES,
        node_args=(
            "--model-size", "micro", "--batch-size", "2", "--seq-len", "32", "--log-every", str(H),
            "--min-peers", str(NODES - 1), "--round-close", "full",
        ),
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "NEUROSHARD_TOKEN"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    lines = (done.stdout + done.stderr).splitlines()
    print("\n".join(lines))  # shown by pytest when an assertion fails
    assert done.returncode == 0, lines[-20:]
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["alie_search", "edge"])
def test_honest_replicas_agree_refuse_no_honest_and_learn(published, tmp_path: Path, attack: str) -> None:
    lines = run_swarm(published, tmp_path, attack)
    keys = {
        i: Wallet.from_token((tmp_path / "swarm" / f"node{i}" / "token").read_text().strip())
        for i in range(NODES)
    }
    honest = {keys[i].public_key_hex[:12] for i in HONEST}
    for i in range(NODES - BYZANTINE, NODES):
        assert any(line.startswith(f"[{i}] WARNING: ATTACK MODE {attack}") for line in lines)

    # Honest replicas end every round on the same θ.
    assert "DIFFER" not in "\n".join(lines)
    agreed = sorted(int(m.group(1)) for m in map(AGREE.match, lines) if m)
    assert agreed == list(range(ROUNDS)), agreed

    # No honest contribution is refused in any honest replica's round, and nobody is called an
    # equivocator: the colluders committed once, before anything was revealed.
    rounds = [(int(m.group(1)), int(m.group(2)), line) for line in lines if (m := ROUND_LINE.match(line))]
    for r in range(ROUNDS):
        aggregated = [line for n, rr, line in rounds if rr == r and n in HONEST]
        assert len(aggregated) >= (3 if r == 0 else 4), f"round {r}: {aggregated}"
        for line in aggregated:
            assert not any(f"rejected {h}" in line for h in honest), line
            assert "equivocator" not in line
    # The colluders searched: from round 1 on (with a revealed aggregate) their note names a γ.
    sent = re.compile(r"^\[(\d+)\] round (\d+): ATTACKER sent (.*)$")
    notes = [
        m.group(3)
        for m in map(sent.match, lines)
        if m and int(m.group(1)) >= NODES - BYZANTINE and int(m.group(2)) >= 1
    ]
    assert notes and all(re.search(rf"{attack} \(realistic, γ=", line) for line in notes), notes

    # And the honest replicas learn.
    for node in HONEST:
        losses = [float(m.group(2)) for m in map(LOSS.match, lines) if m and int(m.group(1)) == node]
        assert len(losses) == ROUNDS and losses[-1] < losses[0] - 0.3, (node, losses)
