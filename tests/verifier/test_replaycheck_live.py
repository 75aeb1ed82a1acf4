"""Live replay spot checks on loopback: a real verifier process checks every receipt of three
real `neuroshard-node` processes that joined it, by segments (node.segments: the definition's
segment_steps = 2, so 12 segments of 2 steps, 4 drawn per receipt). The honest node passes; a node that trained on windows
it was not assigned while reporting its assigned spans (`--work-lie data`) fails every check; a
node that claims 1.25 × its Δ (`--work-lie delta`, applied after its last inner step) sends a Δ
that its committed chain does not end on, which only the round's last segment shows: it fails the
checks that draw that segment (a third of them) and passes the others, and loses reputation for
the failures.

The nodes also show that a joined node trains by the network definition: they are started
with `--model-size small` and print the definition's `micro`, and log its aggregation rule.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PublishedData
from sqlalchemy import select

from neuroshard.node.model import ModelConfig
from neuroshard.node.wallet import Wallet
from neuroshard.swarm.verifier import SwarmVerifier, start_swarm_verifier
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database
from tests.swarm.test_swarm import free_base_port

pytestmark = pytest.mark.xdist_group("swarms")  # one swarm at a time (scripts/test)

NODE = str(Path(sys.executable).parent / "neuroshard-node")
ADVERSARY = str(Path(sys.executable).parent / "neuroshard-adversary")
H = 24
"""Rounds of ~1 s with the micro model: the verifier fetches a sampled round before the node drops it."""
TIMEOUT_S = 180.0
"""The loop ends as soon as every verdict it waits for is in, so the margin costs nothing when it passes."""
SEGMENTS_PER_CHECK = 4
"""The default: 4 of the round's 12 segments replayed per check. The delta liar's lie (a scaled Δ
after its last inner step) shows only in the last segment, which every check fetches and checks
against the commitments whether or not it is drawn, so each of its checks must catch it. (Before
that tail check, 4 random draws caught it in a third of the checks, and on a loaded CI machine
180 s once held too few checks for one to: 2026-11-26.)"""
LIES = {0: None, 1: "delta", 2: "data"}
"""Node index -> its --work-lie (TESTING ONLY flags); node 0 is honest."""


def _tables(published: PublishedData) -> dict[str, object]:
    model = ModelConfig.named("micro", vocab_size=published.dataset.tokenizer.vocab_size)
    return {
        "name": "replay-test",
        "model": model.to_dict(),
        # The default warm-up of the node (30 steps): replays follow the schedule by round.
        "diloco": {"inner_steps": H, "warmup_steps": 30, "total_steps": 20_000},
        "training": {"batch_size": 2, "seq_len": 32, "segment_steps": 2},
        "aggregation": {"rule": "trimmed_mean", "f": 1},
        "data": {"manifest_url": str(published.directory), "publisher_key": published.public_key_hex},
        "evaluation": {"every_rounds": 1, "held_out_shard": 0},
    }


def _start_node(i: int, home: Path, verifier: SwarmVerifier, ports: list[int]) -> subprocess.Popen[str]:
    peers = ",".join(f"127.0.0.1:{p}" for j, p in enumerate(ports) if j != i)
    lie = LIES[i]
    argv = [
        ADVERSARY if lie else NODE, *verifier.node_flags(),
        "--home", str(home / f"node{i}"),
        "--host", "127.0.0.1", "--port", str(ports[i]), "--peers", peers, "--min-peers", "2",
        "--threads", "1", "--model-size", "small", "--log-every", "1000", "--replay-rounds", "20",
        *(["--work-lie", lie] if lie else []),
    ]  # fmt: skip
    env = {
        **{k: v for k, v in os.environ.items() if k != "NEUROSHARD_TOKEN"},
        "NEUROSHARD_TOKEN": f"replay-{i}",
    }
    with (home / f"node{i}.out").open("w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)


def _replay_verdicts(db: Database) -> dict[str, list[str]]:
    """Wallet id -> the reasons of its replay spot-check events, oldest first."""
    with db.read() as session:
        events = session.scalars(
            select(m.ReputationEvent)
            .where(m.ReputationEvent.reason.contains("replay: "))
            .order_by(m.ReputationEvent.id)
        ).all()
        out: dict[str, list[str]] = {}
        for event in events:
            out.setdefault(event.wallet_id, []).append(event.reason)
        return out


@pytest.mark.slow
def test_replay_catches_a_delta_liar_and_a_data_liar_and_passes_the_honest_node(
    published: PublishedData, tmp_path: Path
) -> None:
    ports = free_base_port(4)
    node_ports = [ports + i for i in range(3)]
    verifier = start_swarm_verifier(
        tmp_path / "verifier",
        _tables(published),
        ports + 3,
        None,
        extra_args=["--replay-rate", "1", "--segments-per-check", str(SEGMENTS_PER_CHECK)],
    )
    wallets = {i: Wallet.from_token(f"replay-{i}").wallet_id for i in LIES}
    nodes = [_start_node(i, tmp_path, verifier, node_ports) for i in LIES]
    db = Database(f"sqlite:///{tmp_path / 'verifier' / 'verifier.sqlite3'}")
    verdicts: dict[str, list[str]] = {}
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            for i, node in enumerate(nodes):
                assert node.poll() is None, (tmp_path / f"node{i}.out").read_text()[-3000:]
            verdicts = _replay_verdicts(db)
            if (
                all(wallets[i] in verdicts for i in LIES)
                and any("spot check passed" in r for r in verdicts[wallets[0]])
                and any("spot check failed" in r for r in verdicts[wallets[1]])
            ):
                break
            time.sleep(1.0)
    finally:
        for node in nodes:
            node.terminate()
        for node in nodes:
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                # Stopped inside a round, a node finishes it first, and with its peers stopping
                # too that waits out the commit deadline (60 s): the verdicts are in by now.
                node.kill()
                node.wait(timeout=30)
        verifier.stop()
    log = verifier.log_path.read_text()
    assert all(wallets[i] in verdicts for i in LIES), f"{verdicts}\n{log[-4000:]}"

    honest = verdicts[wallets[0]]
    assert any("spot check passed" in r for r in honest), honest
    assert not any("spot check failed" in r for r in honest), honest
    delta_liar = verdicts[wallets[1]]
    caught = [r for r in delta_liar if "spot check failed" in r]
    reason = "the receipt's Δ is not θ_round minus the chain's last checkpoint"
    assert caught and all("segment 11 of 12" in r and reason in r for r in caught), delta_liar
    # The lie sits in the last segment, which every check checks (replayed or not): none passes.
    assert not any("spot check passed" in r for r in delta_liar), delta_liar
    data_liar = verdicts[wallets[2]]
    assert data_liar and all("spot check failed" in r and "cosine" in r for r in data_liar), data_liar
    assert "replay check:" in log

    with db.read() as session:
        reputation = {w.wallet_id: w.reputation for w in session.scalars(select(m.Wallet))}
    db.dispose()
    assert reputation[wallets[1]] < reputation[wallets[0]] and reputation[wallets[2]] < reputation[wallets[0]]

    honest_out = (tmp_path / "node0.out").read_text()
    assert "model micro:" in honest_out and "model small" not in honest_out
    assert "aggregation trimmed_mean f=1" in honest_out
    assert "WORK LIE delta" in (tmp_path / "node1.out").read_text()
