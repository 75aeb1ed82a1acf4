"""The live evaluator: a real node's peer server serves θ, the verifier checks it against the
settled majority hash, measures it on the held-out shard and records it (SQLite and PostgreSQL)."""

import time
from collections.abc import Iterator

import pytest
import torch
from conftest import PublishedData
from sqlalchemy import select

from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import build_stage
from neuroshard.node.p2p.plane import PeerPlane, PeerPlaneConfig
from neuroshard.node.wallet import Wallet
from neuroshard.testing.verifier import small_network
from neuroshard.verifier import models as m
from neuroshard.verifier.background import JobContext
from neuroshard.verifier.db import Database
from neuroshard.verifier.evaluate import measure_loss
from neuroshard.verifier.evaluator import Evaluator, EvaluatorConfig
from neuroshard.verifier.network import NetworkDefinition

NODE = Wallet.from_token("evaluator-test-node")
OPERATOR = Wallet.from_token("evaluator-test-operator")


def _network() -> NetworkDefinition:
    return small_network(
        model={"size": "micro", "vocab_size": 512},
        training={"batch_size": 4, "seq_len": 32},
        evaluation={"every_rounds": 1},
    )


@pytest.fixture
def node() -> Iterator[tuple[PeerPlane, DiLoCo]]:
    """A replica one round in (θ_1), serving its state on a loopback port."""
    torch.manual_seed(0)
    diloco = DiLoCo(build_stage(_network().model, 0, 1), DiLoCoConfig(inner_steps=2, warmup_steps=0))
    net = PeerPlane(PeerPlaneConfig(port=0, join_timeout_s=0), NODE, stage=0, log=lambda line: None)
    net.start()
    net.join_state(diloco)
    tokens = torch.randint(0, 512, (2, 4, 32), generator=torch.Generator().manual_seed(1))
    diloco.inner_step(tokens[0], tokens[1])
    diloco.inner_step(tokens[0], tokens[1])
    net.finish_round(diloco)
    assert diloco.round == 1
    yield net, diloco
    net.stop()


def _seed_db(database_url: str, address: str, majority_hash: str) -> Database:
    db = Database(database_url)
    now = time.time()
    with db.write() as s:
        s.add(m.Wallet(wallet_id=NODE.wallet_id, public_key=NODE.public_key_hex, reputation=0.5,
                       status=m.STATUS_ACTIVE, registered_at=now, software_version="0.1.0"))  # fmt: skip
        s.flush()
        s.add(
            m.Peer(wallet_id=NODE.wallet_id, address=address, stage=0, registered_at=now, last_heartbeat=now)
        )
        s.add(
            m.HashVote(stage=0, round=0, wallet_id=NODE.wallet_id, result_hash="1" * 64, base_hash="0" * 64)
        )
        s.add(m.Round(stage=0, round=0, majority_hash=majority_hash, votes=3, agreeing=3, synced=0,
                      sync_checked=0, settled_at=now))  # fmt: skip
    return db


def _evaluator(
    db: Database, published: PublishedData, lines: list[str], network: NetworkDefinition | None = None
) -> Evaluator:
    """An evaluator of `network` (the one-stage `_network()` by default) on the published shard 0."""
    held_out = published.dataset.source.fetch(published.dataset.manifest.shard(0))
    return Evaluator(
        JobContext(db=db, network=network or _network(), operator=OPERATOR, log=lines.append),
        config=EvaluatorConfig(max_batches=3, data_checks=None),
        held_out=lambda: held_out,
    )


def test_the_majority_weights_are_fetched_measured_and_recorded(
    node: tuple[PeerPlane, DiLoCo], database_url: str, published: PublishedData
) -> None:
    net, diloco = node
    db = _seed_db(database_url, f"http://{net.address}", diloco.weights_hash())
    lines: list[str] = []
    evaluator = _evaluator(db, published, lines)
    evaluator.run_once()
    with db.read() as s:
        rows = s.scalars(select(m.Evaluation)).all()
        assert [(r.round, r.tokens) for r in rows] == [(1, 3 * 4 * 32)]
        # The number is the held-out loss of exactly the node's θ_1.
        tokens = published.dataset.source.fetch(published.dataset.manifest.shard(0))
        expected = measure_loss(diloco.model, tokens, 4, 32, max_batches=3)
        assert rows[0].loss == pytest.approx(expected.loss, rel=1e-6)
    evaluator.run_once()  # nothing newer: no second measurement of the same round
    with db.read() as s:
        assert len(s.scalars(select(m.Evaluation)).all()) == 1
    db.dispose()


def test_a_minority_state_is_not_measured(
    node: tuple[PeerPlane, DiLoCo], database_url: str, published: PublishedData
) -> None:
    net, _ = node
    db = _seed_db(database_url, f"http://{net.address}", "f" * 64)
    lines: list[str] = []
    _evaluator(db, published, lines).run_once()
    with db.read() as s:
        assert s.scalars(select(m.Evaluation)).all() == []
    assert any("is not the majority" in line for line in lines), lines
    db.dispose()


def test_an_unsettled_round_waits(
    node: tuple[PeerPlane, DiLoCo], database_url: str, published: PublishedData
) -> None:
    net, diloco = node
    db = _seed_db(database_url, f"http://{net.address}", diloco.weights_hash())
    with db.write() as s:
        s.delete(s.get(m.Round, (0, 0)))
    evaluator = _evaluator(db, published, [])
    evaluator.run_once()
    assert list(evaluator.pending) == [1]  # fetched and verified, waiting for round 0 to settle
    with db.read() as s:
        assert s.scalars(select(m.Evaluation)).all() == []
    db.dispose()


# --- a pipeline: every stage's majority θ, assembled --------------------------------------

STAGE_WALLETS = [Wallet.from_token(f"evaluator-test-stage-{s}") for s in range(2)]


def _pipeline_network() -> NetworkDefinition:
    return small_network(
        model={"size": "micro", "vocab_size": 512},
        stages={"count": 2},
        training={"batch_size": 4, "seq_len": 32},
        evaluation={"every_rounds": 1},
    )


@pytest.fixture
def stages() -> Iterator[list[tuple[PeerPlane, DiLoCo]]]:
    """One replica per stage, each one round in and serving its stage's θ_1; stage 1 took a
    different number of inner steps (rounds are per stage)."""
    torch.manual_seed(0)
    config = _pipeline_network().model
    replicas = []
    for s, wallet in enumerate(STAGE_WALLETS):
        diloco = DiLoCo(build_stage(config, s, 2), DiLoCoConfig(inner_steps=2, warmup_steps=0))
        net = PeerPlane(PeerPlaneConfig(port=0, join_timeout_s=0), wallet, stage=s, log=lambda line: None)
        net.start()
        net.join_state(diloco)
        for p in diloco.params:  # a stand-in for inner steps: any move away from θ_0
            p.data.add_(0.01 * (s + 1) * torch.randn_like(p))
        net.finish_round(diloco)
        assert diloco.round == 1
        replicas.append((net, diloco))
    yield replicas
    for net, _ in replicas:
        net.stop()


def _seed_pipeline_db(
    database_url: str, replicas: list[tuple[PeerPlane, DiLoCo]], majorities: list[str]
) -> Database:
    db = Database(database_url)
    now = time.time()
    with db.write() as s:
        for stage, ((net, _), wallet, majority) in enumerate(
            zip(replicas, STAGE_WALLETS, majorities, strict=True)
        ):
            s.add(m.Wallet(wallet_id=wallet.wallet_id, public_key=wallet.public_key_hex, reputation=0.5,
                           status=m.STATUS_ACTIVE, registered_at=now, software_version="0.1.0"))  # fmt: skip
            s.flush()
            s.add(m.Peer(wallet_id=wallet.wallet_id, address=f"http://{net.address}", stage=stage,
                         registered_at=now, last_heartbeat=now))  # fmt: skip
            s.add(m.HashVote(stage=stage, round=0, wallet_id=wallet.wallet_id, result_hash="1" * 64,
                             base_hash="0" * 64))  # fmt: skip
            s.add(m.Round(stage=stage, round=0, majority_hash=majority, votes=3, agreeing=3, synced=0,
                          sync_checked=0, settled_at=now))  # fmt: skip
    return db


def test_a_pipeline_is_measured_on_every_stage_majority_assembled(
    stages: list[tuple[PeerPlane, DiLoCo]], database_url: str, published: PublishedData
) -> None:
    db = _seed_pipeline_db(database_url, stages, [d.weights_hash() for _, d in stages])
    lines: list[str] = []
    _evaluator(db, published, lines, _pipeline_network()).run_once()
    with db.read() as s:
        rows = s.scalars(select(m.Evaluation)).all()
    tokens = published.dataset.source.fetch(published.dataset.manifest.shard(0))
    expected = measure_loss([d.model for _, d in stages], tokens, 4, 32, max_batches=3)
    assert [(r.round, r.tokens) for r in rows] == [(1, 3 * 4 * 32)], lines
    assert rows[0].loss == pytest.approx(expected.loss, rel=1e-6)
    db.dispose()


def test_a_pipeline_with_one_minority_stage_is_not_measured(
    stages: list[tuple[PeerPlane, DiLoCo]], database_url: str, published: PublishedData
) -> None:
    db = _seed_pipeline_db(database_url, stages, [stages[0][1].weights_hash(), "f" * 64])
    lines: list[str] = []
    _evaluator(db, published, lines, _pipeline_network()).run_once()
    with db.read() as s:
        assert s.scalars(select(m.Evaluation)).all() == []
    assert any("stage 1" in line and "is not the majority" in line for line in lines), lines
    db.dispose()
