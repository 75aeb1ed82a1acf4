"""Checks of a stage whose vocabulary grew with the tokenizer (node.vocab): the verifier reads the
vocabulary off what it checks (verifier.stageshape), so an honest grown replica passes the segment
replay (stage 0 and later stages), the whole-round replay, `neuroshard-check-proof` and the
evaluator, and a lie at the grown shape still fails."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import PublishedData
from sqlalchemy import select
from torch import Tensor

from neuroshard.cli import check_proof
from neuroshard.node.actcodec import DEFAULT_CODEC
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig, copy_into_parameters, flat_parameters, tensor_digest
from neuroshard.node.model import ModelConfig, Transformer, build_stage, cross_entropy_loss
from neuroshard.node.model_file import load_round_model
from neuroshard.node.p2p.pipeline_wire import (
    decode_activations,
    decode_gradient,
    encode_activations,
    encode_gradient,
)
from neuroshard.node.p2p.plane import PeerPlane, PeerPlaneConfig
from neuroshard.node.p2p.replay import encode_replay
from neuroshard.node.pipeline import remote_loss, stage_inner_step
from neuroshard.node.replay import InnerState, ReplayRecord, capture_inner_state
from neuroshard.node.segment_store import SegmentMaterial, SegmentStore
from neuroshard.node.segments import SegmentConfig, SegmentRecorder
from neuroshard.node.vocab import grow_replica, holds_vocab, regrow
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.identity import sha256_hex
from neuroshard.protocol.pipeline import ActivationHeader, GradientReply, micro_batch_id
from neuroshard.protocol.segments import Received
from neuroshard.testing.verifier import small_network
from neuroshard.verifier import models as m
from neuroshard.verifier.background import JobContext
from neuroshard.verifier.db import Database
from neuroshard.verifier.evaluate import build_from_state_dicts, measure_loss, stage_hash
from neuroshard.verifier.evaluator import Evaluator, EvaluatorConfig, Fetched
from neuroshard.verifier.network import NetworkDefinition
from neuroshard.verifier.replaycheck import (
    SAME_PRECISION_TOLERANCE,
    Malformed,
    ReplayCheckConfig,
    ReplayChecker,
)
from neuroshard.verifier.segmentcheck import SegmentClaim, SegmentFraudProof, check_segment, judge_fraud_proof
from neuroshard.verifier.spotcheck import SpotCheckError, compare_deltas, replay_inner_steps
from neuroshard.verifier.stageshape import label_bound, stage_config, stage_size, vocab_cap

MODEL = ModelConfig(vocab_size=512, dim=32, n_layers=3, n_heads=2, ffn_dim=64, max_seq_len=32)
GROWN = 576
"""The vocabulary after the tokenizer grew by 64 merges."""
H, K, B, T = 4, 2, 2, 16
DILOCO = DiLoCoConfig(inner_steps=H, warmup_steps=1, total_steps=100)
REPLICA = Wallet.from_token("grown-replica")
PREV = Wallet.from_token("grown-previous-stage")
NEXT = Wallet.from_token("grown-next-stage")
OPERATOR = Wallet.from_token("grown-operator")
ROUND = 1
"""The round checked: the replica trained round 0 at the definition's vocabulary, then grew."""


def _ids(seed: int, shape: tuple[int, ...], vocab: int) -> Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _vocab(round_: int) -> int:
    """Token ids in the data from this round on: the new merges' ids once the stage grew."""
    return GROWN if round_ >= ROUND else MODEL.vocab_size


def read_batch(span: tuple[int, int, int]) -> tuple[Tensor, Tensor]:
    """A stage-0 batch, a pure function of its span (span[0]: the round)."""
    tokens = _ids(1000 * span[0] + span[1], (B, T + 1), _vocab(span[0]))
    return tokens[:, :-1], tokens[:, 1:]


def test_a_stage_is_built_at_the_vocabulary_its_theta_holds() -> None:
    for stage, num_stages, rows in ((0, 1, 2), (0, 2, 1), (1, 2, 1), (1, 3, 0)):
        base = stage_size(MODEL, stage, num_stages)[0]
        assert stage_config(MODEL, stage, num_stages, base) == MODEL
        if rows == 0:  # a middle stage holds no vocabulary rows: no other length is its
            with pytest.raises(ValueError, match="is not the definition's"):
                stage_config(MODEL, stage, num_stages, base + MODEL.dim)
            assert label_bound(MODEL, stage, num_stages) == vocab_cap(MODEL)  # the head may have grown
            continue
        grown = stage_config(MODEL, stage, num_stages, base + 64 * rows * MODEL.dim)
        assert grown.vocab_size == GROWN and dataclasses.replace(grown, vocab_size=512) == MODEL
        over = base + (vocab_cap(MODEL) + 1 - MODEL.vocab_size) * rows * MODEL.dim
        for bad in (base - rows * MODEL.dim, base + 1, over):  # shrunk, not whole rows, past the cap
            with pytest.raises(ValueError, match="is not the definition's"):
                stage_config(MODEL, stage, num_stages, bad)


def test_state_dicts_of_grown_stages_are_built_at_their_rows() -> None:
    base = build_stage(MODEL, 0, 1)
    model, _ = grow_replica(base, DiLoCo(base, DILOCO), GROWN)
    (rebuilt,) = build_from_state_dicts(MODEL, [model.state_dict()], [stage_hash(model)])
    assert rebuilt.config.vocab_size == GROWN
    small = build_stage(dataclasses.replace(MODEL, vocab_size=448), 0, 1)
    with pytest.raises(ValueError, match="448 vocabulary rows"):
        build_from_state_dicts(MODEL, [small.state_dict()])


# --- segment replay: stage 0 and later stages ------------------------------------------------


@dataclasses.dataclass
class Run:
    stage: int
    num_stages: int
    store: SegmentStore
    root: str
    base_hash: str
    delta_digest: str
    spans: list[tuple[int, int, int]]

    def material(self, segment: int) -> SegmentMaterial:
        """Segment `segment` of the grown round as the wire carries it (decoded at its own length)."""
        material = self.store.material(ROUND, segment)
        assert material is not None
        numel, n_tensors = material.theta_round.numel(), stage_size(MODEL, self.stage, self.num_stages)[1]
        return SegmentMaterial.decode(material.encode(), numel=numel, n_tensors=n_tensors)

    def claim(self) -> SegmentClaim:
        """What the verifier knows: the definition's model (at its vocabulary) and the receipt."""
        return SegmentClaim(
            model=MODEL, diloco=DILOCO, num_stages=self.num_stages, stage=self.stage, round=ROUND,
            wallet=REPLICA.public_key_hex, root=self.root, spans=self.spans,
            base_hash=self.base_hash, delta_digest=self.delta_digest,
        )  # fmt: skip


def _messages(
    stage: int, num_stages: int, round_: int, i: int
) -> tuple[list[Received], Received | None, str]:
    """Step i's activations from the previous stage (stage > 0; labels among the grown ids from
    round 1), the next stage's gradient (not the last stage) and the micro-batch id."""
    received, mb = [], micro_batch_id((PREV if stage else REPLICA).public_key_hex, round_, i)
    if stage > 0:
        body = encode_activations(
            torch.randn(B, T, MODEL.dim, generator=torch.Generator().manual_seed(50 + i)),
            _ids(60 + i, (B, T), _vocab(round_)),
            DEFAULT_CODEC,
        )
        header = ActivationHeader.create(
            PREV, to=REPLICA.public_key_hex, micro_batch=mb, stage=stage, round=round_, batch=B, seq_len=T, dim=MODEL.dim,
            codec=DEFAULT_CODEC, payload_sha256=sha256_hex(body),
        )  # fmt: skip
        received.append(Received("activations", PREV.public_key_hex, header.to_json(), body))
    if stage == num_stages - 1:
        return received, None, mb if stage else ""
    body = encode_gradient(
        1e-3 * torch.randn(B, T, MODEL.dim, generator=torch.Generator().manual_seed(90 + i)), DEFAULT_CODEC
    )
    reply = GradientReply.create(
        NEXT, to=REPLICA.public_key_hex, micro_batch=mb, stage=stage + 1, round=round_, loss=4.0, codec=DEFAULT_CODEC,
        payload_sha256=sha256_hex(body),
    )  # fmt: skip
    return received, Received("gradient", NEXT.public_key_hex, reply.to_json(), body), mb


Lie = Callable[[int, DiLoCo], None]
"""(step in the grown round, engine): what a liar does after the step, before it is recorded."""


def train(tmp_path: Path, stage: int, num_stages: int, *, lie: Lie | None = None) -> Run:
    """A replica's round 0 at the definition's vocabulary, its growth (a stage with rows) at the
    boundary, and round 1 at the grown vocabulary, each recorded as the node records it."""
    torch.manual_seed(0)
    store = SegmentStore(tmp_path / "segments", SegmentConfig(segment_steps=K), log=lambda _: None)
    recorder = SegmentRecorder(
        SegmentConfig(segment_steps=K), stage=stage, sink=store, network=_run().digest()
    )
    current: list[Received] = []

    def downstream(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        recorder.note_received(current[0])
        reply = GradientReply.from_json(current[0].header)
        sent = encode_activations(hidden, labels, DEFAULT_CODEC)  # what it sends on, as the node does
        recorder.note_sent(reply.micro_batch, "activations", sha256_hex(sent), sent)
        return decode_gradient(current[0].body, (B, T, MODEL.dim), reply.codec), reply.loss

    last = stage == num_stages - 1
    loss_fn = remote_loss(downstream) if stage == 0 and not last else cross_entropy_loss
    diloco = DiLoCo(build_stage(MODEL, stage, num_stages), DILOCO, loss_fn=loss_fn)
    for round_ in (0, ROUND):
        if round_ == ROUND and holds_vocab(stage, num_stages):
            diloco = regrow(diloco, GROWN)
        recorder.start_round(diloco)
        spans = []
        for i in range(H):
            received, reply, mb = _messages(stage, num_stages, round_, i)
            current[:] = [] if reply is None else [reply]
            span = None
            if stage == 0:
                span = (round_, i * B, (i + 1) * B)
                spans.append(span)
                diloco.inner_step(*read_batch(span))
            else:
                header = ActivationHeader.from_json(received[0].header)
                inputs, labels = decode_activations(received[0].body, header, GROWN)
                grad, _ = stage_inner_step(diloco, inputs, labels, None if last else downstream)
                sent = encode_gradient(grad, DEFAULT_CODEC)
            if lie is not None and round_ == ROUND:
                lie(i, diloco)
            recorder.record_step(diloco, data=span, micro_batch=mb, received=received)
            if stage > 0:  # the reply is encoded after the step is recorded, as the node's is
                recorder.note_sent(mb, "gradient", sha256_hex(sent), sent)
        recorder.end_round(diloco)
        base_hash, delta = tensor_digest(diloco.theta_round), diloco.pseudo_gradient()
        diloco.outer_step(delta)
        closed = recorder.close_round(REPLICA)
        assert closed is not None
        root = closed[0].root()
    return Run(stage, num_stages, store, root, base_hash, tensor_digest(delta), spans)


def scaled_segment_1() -> Lie:
    """A liar: segment 1's update scaled ×1.25 and committed as if training gave it."""
    start: list[Tensor] = []

    def lie(i: int, diloco: DiLoCo) -> None:
        if i == K - 1:
            start[:] = [flat_parameters(diloco.params)]
        if i == 2 * K - 1:
            copy_into_parameters(start[0] + 1.25 * (flat_parameters(diloco.params) - start[0]), diloco.params)

    return lie


STAGES = [(0, 1), (0, 2), (1, 2), (1, 3)]
"""(stage, S): a lone stage (embedding and head), a driver (embedding), a last stage (head), a
middle stage (neither: it passes on labels among the grown ids)."""


@pytest.mark.parametrize(("stage", "num_stages"), STAGES)
def test_an_honest_grown_stage_passes_its_segment_replay(tmp_path: Path, stage: int, num_stages: int) -> None:
    run = train(tmp_path, stage, num_stages)
    definition = stage_size(MODEL, stage, num_stages)[0]
    assert (run.material(0).theta_round.numel() > definition) == holds_vocab(stage, num_stages)
    for j in range(H // K):
        verdict = check_segment(run.claim(), run.material(j), SAME_PRECISION_TOLERANCE, read_batch=read_batch)
        assert verdict.ok and verdict.replayed, verdict.reason
        assert verdict.cosine is not None and verdict.cosine > 1 - 1e-9


@pytest.mark.parametrize(("stage", "num_stages"), STAGES)
def test_a_lie_at_the_grown_shape_fails_and_proves_fraud(tmp_path: Path, stage: int, num_stages: int) -> None:
    run = train(tmp_path, stage, num_stages, lie=scaled_segment_1())
    honest = check_segment(run.claim(), run.material(0), SAME_PRECISION_TOLERANCE, read_batch=read_batch)
    assert honest.ok, honest.reason
    verdict = check_segment(run.claim(), run.material(1), SAME_PRECISION_TOLERANCE, read_batch=read_batch)
    assert not verdict.ok and verdict.replayed and "norm ratio" in verdict.reason, verdict.reason
    judged = judge_fraud_proof(
        SegmentFraudProof(run.material(1)), model=MODEL, diloco=DILOCO, num_stages=num_stages,
        tolerance=SAME_PRECISION_TOLERANCE, read_batch=read_batch,
    )  # fmt: skip
    assert judged.proves, judged.reason


def test_material_of_a_vocabulary_below_the_definitions_is_not_replayed(tmp_path: Path) -> None:
    run = train(tmp_path, 1, 2)
    claim = dataclasses.replace(run.claim(), model=dataclasses.replace(MODEL, vocab_size=GROWN + 64))
    verdict = check_segment(claim, run.material(0), SAME_PRECISION_TOLERANCE)
    assert not verdict.ok and not verdict.replayed and "not this stage's model" in verdict.reason, (
        verdict.reason
    )


def _run(model: ModelConfig = MODEL) -> NetworkDefinition:
    """The two-stage run these segments were trained in (at `model`)."""
    return dataclasses.replace(
        small_network(training={"batch_size": B, "seq_len": T}),
        model=model, diloco=DILOCO, num_stages=2, segment_steps=K,
    )  # fmt: skip


def _definition(tmp_path: Path, model: ModelConfig = MODEL) -> Path:
    """`_run(model)` as GET /api/network's body."""
    network = _run(model)
    path = tmp_path / "network.json"
    path.write_bytes(network.canonical_bytes())
    return path


def _check_proof(
    tmp_path: Path, material: SegmentMaterial, capsys: pytest.CaptureFixture[str], **kw: ModelConfig
) -> tuple[int, str]:
    proof = tmp_path / "p.proof"
    proof.write_bytes(SegmentFraudProof(material).encode())
    code = check_proof.main([str(proof), "--network", str(_definition(tmp_path, **kw))])
    out = capsys.readouterr()
    return code, (out.out + out.err).strip()


def test_check_proof_replays_a_grown_stage_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    honest = train(tmp_path / "honest", 1, 2).material(1)
    code, out = _check_proof(tmp_path, honest, capsys)
    assert code == 1 and out.startswith("does not prove fraud: the replay agrees"), out
    lying = train(tmp_path / "lying", 1, 2, lie=scaled_segment_1()).material(1)
    code, out = _check_proof(tmp_path, lying, capsys)
    assert code == 0 and out.startswith(
        f"PROVES FRAUD: wallet {REPLICA.wallet_id} stage 1 round 1 segment 1"
    ), out
    code, out = _check_proof(tmp_path, lying, capsys, model=dataclasses.replace(MODEL, vocab_size=GROWN + 64))
    assert code == 2 and "is not a stage-1 proof of this run's model" in out, out


def _checker(db: Database, network: NetworkDefinition) -> ReplayChecker:
    return ReplayChecker(
        JobContext(db=db, network=network, operator=OPERATOR, log=lambda _: None),
        config=ReplayCheckConfig(sample_rate=1.0),
    )


def _serve(monkeypatch: pytest.MonkeyPatch, checker: ReplayChecker, body: bytes) -> None:
    """The replica's answer to the checker's signed GET, held to the checker's size bound."""

    def signed_get(address: str, path: str, limit: int) -> bytes:
        assert len(body) <= limit, (len(body), limit)
        return body

    monkeypatch.setattr(checker, "_signed_get", signed_get)


def test_the_checker_decodes_grown_segment_material_at_its_length(
    tmp_path: Path, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = train(tmp_path, 1, 2)
    network = _run()  # the run its commitments name
    checker = _checker(db, network)
    material = run.material(1)
    _serve(monkeypatch, checker, material.encode())
    receipt = m.Receipt(stage=1, round=ROUND, inner_steps=H, segment_root=run.root, segments=H // K)
    got = checker._get_segment("http://replica", receipt, 1)
    assert torch.equal(got.end.weights, material.end.weights)


# --- the whole-round replay of a lone replica -------------------------------------------------


def _grown_round() -> tuple[ReplayRecord, list[tuple[Tensor, Tensor]]]:
    """A lone replica's round 1 after it grew at the boundary: its replay record and batches."""
    torch.manual_seed(0)
    diloco = DiLoCo(build_stage(MODEL, 0, 1), DILOCO)
    for i in range(H):
        diloco.inner_step(*read_batch((0, i * B, (i + 1) * B)))
    diloco.outer_step(diloco.pseudo_gradient())
    diloco = regrow(diloco, GROWN)
    theta, inner = diloco.theta_round.detach().clone(), capture_inner_state(diloco)
    assert inner is not None
    batches = [read_batch((ROUND, i * B, (i + 1) * B)) for i in range(H)]
    for batch in batches:
        diloco.inner_step(*batch)
    return ReplayRecord(round=ROUND, theta_round=theta, inner=inner, delta=diloco.pseudo_gradient()), batches


def test_the_round_replay_of_a_grown_replica(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    record, batches = _grown_round()
    assert record.theta_round.numel() == stage_size(dataclasses.replace(MODEL, vocab_size=GROWN), 0, 1)[0]
    replayed = replay_inner_steps(
        MODEL, DILOCO, record.theta_round, batches, round_=ROUND, inner_state=record.inner
    )
    honest = compare_deltas(record.delta, replayed, SAME_PRECISION_TOLERANCE)
    assert honest.ok and honest.cosine > 1 - 1e-9, honest.reason
    assert not compare_deltas(1.25 * record.delta, replayed, SAME_PRECISION_TOLERANCE).ok
    other = [read_batch((7, i * B, (i + 1) * B)) for i in range(H)]
    elsewhere = replay_inner_steps(
        MODEL, DILOCO, record.theta_round, other, round_=ROUND, inner_state=record.inner
    )
    assert not compare_deltas(record.delta, elsewhere, SAME_PRECISION_TOLERANCE).ok
    with pytest.raises(SpotCheckError, match="is not the definition's"):
        replay_inner_steps(MODEL, DILOCO, record.theta_round[:-1], batches)

    # The checker fetches it at the grown length, and refuses a body of no vocabulary of the model.
    checker = _checker(db, dataclasses.replace(small_network(), model=MODEL, diloco=DILOCO))
    _serve(monkeypatch, checker, encode_replay(record))
    got = checker._get_replay("http://replica", ROUND)
    assert torch.equal(got.theta_round, record.theta_round) and torch.equal(got.delta, record.delta)
    cut = stage_size(dataclasses.replace(MODEL, vocab_size=448), 0, 1)[0]
    shrunk = ReplayRecord(
        round=ROUND, theta_round=record.theta_round[:cut].clone(), delta=record.delta[:cut].clone(),
        inner=InnerState(record.inner.exp_avg[:cut].clone(), record.inner.exp_avg_sq[:cut].clone(), record.inner.steps),
    )  # fmt: skip
    _serve(monkeypatch, checker, encode_replay(shrunk))
    with pytest.raises(Malformed, match="is not the definition's"):
        checker._get_replay("http://replica", ROUND)


# --- the evaluator ----------------------------------------------------------------------------


def _network(stages: int = 1) -> NetworkDefinition:
    return small_network(
        model={"size": "micro", "vocab_size": 512},
        stages={"count": stages},
        training={"batch_size": 4, "seq_len": 32},
        evaluation={"every_rounds": 1},
    )


def _serving(wallet: Wallet, diloco: DiLoCo, vocab: int) -> PeerPlane:
    """A replica one round in (θ_1, trained on ids below `vocab`), serving its state on a loopback port."""
    net = PeerPlane(PeerPlaneConfig(port=0, join_timeout_s=0), wallet, stage=0, log=lambda _: None)
    net.start()
    net.join_state(diloco)
    tokens = _ids(1, (2, 4, 32), vocab)
    for _ in range(2):
        diloco.inner_step(tokens[0], tokens[1])
    net.finish_round(diloco)
    return net


def _add_replica(db: Database, wallet: Wallet, address: str, reputation: float) -> None:
    now = time.time()
    with db.write() as s:
        s.add(m.Wallet(wallet_id=wallet.wallet_id, public_key=wallet.public_key_hex, reputation=reputation,
                       status=m.STATUS_ACTIVE, registered_at=now, software_version="0.1.0"))  # fmt: skip
        s.flush()
        s.add(
            m.Peer(
                wallet_id=wallet.wallet_id, address=address, stage=0, registered_at=now, last_heartbeat=now
            )
        )
        s.add(
            m.HashVote(stage=0, round=0, wallet_id=wallet.wallet_id, result_hash="1" * 64, base_hash="0" * 64)
        )


def _settled(db: Database, stage: int, round_: int, majority: str) -> None:
    with db.write() as s:
        s.add(m.Round(stage=stage, round=round_, majority_hash=majority, votes=3, agreeing=3, synced=0,
                      sync_checked=0, settled_at=time.time()))  # fmt: skip


def _evaluator(
    db: Database, network: NetworkDefinition, published: PublishedData, lines: list[str], **config: object
) -> Evaluator:
    held_out = published.dataset.source.fetch(published.dataset.manifest.shard(0))
    return Evaluator(
        JobContext(db=db, network=network, operator=OPERATOR, log=lines.append),
        config=EvaluatorConfig(max_batches=3, data_checks=None, **config),  # type: ignore[arg-type]
        held_out=lambda: held_out,
        tokenizer=lambda: published.dataset.tokenizer,
    )


def test_the_evaluator_measures_a_grown_replica_and_refuses_another_model(
    database_url: str, published: PublishedData
) -> None:
    torch.manual_seed(0)
    config = DiLoCoConfig(inner_steps=2, warmup_steps=0)
    grown = regrow(DiLoCo(build_stage(_network().model, 0, 1), config), GROWN)
    shrunk = DiLoCo(build_stage(dataclasses.replace(_network().model, vocab_size=448), 0, 1), config)
    nets = [_serving(REPLICA, grown, GROWN), _serving(PREV, shrunk, 448)]
    try:
        db = Database(database_url)
        _add_replica(db, REPLICA, f"http://{nets[0].address}", 0.5)
        _add_replica(db, PREV, f"http://{nets[1].address}", 0.9)  # asked first
        _settled(db, 0, 0, grown.weights_hash())
        lines: list[str] = []
        _evaluator(db, _network(), published, lines).run_once()
    finally:
        for net in nets:
            net.stop()
    with db.read() as s:
        rows = s.scalars(select(m.Evaluation)).all()
    tokens = published.dataset.source.fetch(published.dataset.manifest.shard(0))
    expected = measure_loss(grown.model, tokens, 4, 32, max_batches=3)
    assert [(r.round, r.tokens) for r in rows] == [(1, 3 * 4 * 32)], lines
    assert rows[0].loss == pytest.approx(expected.loss, rel=1e-6)
    assert any(PREV.wallet_id in line and "is not the definition's" in line for line in lines), lines
    db.dispose()


def _grown_stages(network: NetworkDefinition, vocabs: list[int]) -> list[Transformer]:
    """A majority model whose stages hold these vocabularies (rows grown by node.vocab), its
    grown head rows scaled up: the sampler would pick them first."""
    gen = torch.Generator().manual_seed(5)
    stages = []
    for s, vocab in enumerate(vocabs):
        stage = build_stage(network.model, s, network.num_stages)
        with torch.no_grad():
            for p in stage.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        stage, _ = grow_replica(stage, DiLoCo(stage, DILOCO), vocab)
        if stage.head is not None:  # trained to favour the new ids, which the sample must not draw
            with torch.no_grad():
                stage.head.weight[network.model.vocab_size :] *= 50
        stages.append(stage.eval())
    return stages


def _pending(
    db: Database, evaluator: Evaluator, round_: int, stages: list[Transformer], lie: bool = False
) -> None:
    """The stages fetched at `round_` (θ and its hash) and round_ − 1 settled on their hashes (on
    another hash for the first stage, with `lie`)."""
    fetched = []
    for i, stage in enumerate(stages):
        h = stage_hash(stage)
        _settled(db, i, round_ - 1, "f" * 64 if lie and i == 0 else h)
        fetched.append(
            Fetched(
                stage=i,
                round=round_,
                theta_hash=h,
                theta=flat_parameters(stage.parameters()),
                wallet_id="w" * 20,
            )
        )
    evaluator.pending[round_] = tuple(fetched)


def test_a_grown_model_is_measured_kept_and_sampled_and_a_minority_is_not(
    database_url: str, published: PublishedData, tmp_path: Path
) -> None:
    """The whole model grew past the tokenizer the verifier holds (576 rows, 512 ids)."""
    network, models = _network(), tmp_path / "models"
    db = Database(database_url)
    lines: list[str] = []
    evaluator = _evaluator(db, network, published, lines, models_dir=models, sample_every=1)
    stages = _grown_stages(network, [GROWN])
    _pending(db, evaluator, 3, stages)
    evaluator.run_once()
    kept = load_round_model(models, "3")
    assert (
        kept.config.vocab_size == GROWN
        and kept.build()(torch.zeros(1, 4, dtype=torch.long)).shape[-1] == GROWN
    )
    with db.read() as s:
        assert [e.round for e in s.scalars(select(m.Evaluation))] == [3], lines
        samples = s.scalars(select(m.TextSample)).all()
    assert [t.round for t in samples] == [3] and samples[0].text, lines
    _pending(db, evaluator, 5, stages, lie=True)  # a θ at the grown shape that is not the majority's
    evaluator.run_once()
    with db.read() as s:
        assert [e.round for e in s.scalars(select(m.Evaluation))] == [3]
    assert any("is not the majority" in line for line in lines), lines
    db.dispose()


def test_a_pipeline_whose_head_grew_first_is_measured_and_sampled_but_not_kept(
    database_url: str, published: PublishedData, tmp_path: Path
) -> None:
    network, models = _network(2), tmp_path / "models"
    db = Database(database_url)
    lines: list[str] = []
    evaluator = _evaluator(db, network, published, lines, models_dir=models, sample_every=1)
    stages = _grown_stages(network, [network.model.vocab_size, GROWN])
    _pending(db, evaluator, 2, stages)
    evaluator.run_once()
    tokens = published.dataset.source.fetch(published.dataset.manifest.shard(0))
    with db.read() as s:
        rows = s.scalars(select(m.Evaluation)).all()
        assert [t.round for t in s.scalars(select(m.TextSample))] == [2], lines
    assert [r.round for r in rows] == [2] and rows[0].loss == pytest.approx(
        measure_loss(stages, tokens, 4, 32, max_batches=3).loss, rel=1e-6
    )
    assert any("not kept: its embedding and head hold vocabularies [512, 576]" in line for line in lines), (
        lines
    )
    assert not models.exists() or not list(models.glob("round-*"))
    db.dispose()
