"""Segment checks through the live replay checker, on loopback, in a 2-stage run: replicas of both
stages record their rounds (node.segments), serve segments from their peer servers
(GET /p2p/segment), and the checker draws segments of their receipts, fetches them signed with
the operator key and replays them. The honest replicas of stage 0 and stage 1 pass; a stage-1
replica that scaled its update in one segment (and committed to it, as a liar must) fails, loses
reputation, and leaves a fraud proof: kept as a file and a row, listed and served by the API, and
re-checked alone by neuroshard-check-proof (SQLite, and PostgreSQL when configured)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import PublishedData
from fastapi.testclient import TestClient
from sqlalchemy import select
from torch import Tensor

from neuroshard.api.app import create_app
from neuroshard.cli import check_proof
from neuroshard.data import BatchStream, assign_shards
from neuroshard.node.actcodec import DEFAULT_CODEC
from neuroshard.node.diloco import DiLoCo, copy_into_parameters, flat_parameters, tensor_digest
from neuroshard.node.model import build_stage
from neuroshard.node.p2p.pipeline_wire import (
    decode_activations,
    decode_gradient,
    encode_activations,
    encode_gradient,
)
from neuroshard.node.p2p.plane import PeerPlane, PeerPlaneConfig
from neuroshard.node.p2p.replay import SegmentService
from neuroshard.node.pipeline import remote_loss, stage_inner_step
from neuroshard.node.segment_store import SegmentStore
from neuroshard.node.segments import SegmentConfig, SegmentRecorder
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.identity import sha256_hex
from neuroshard.protocol.pipeline import ActivationHeader, GradientReply, micro_batch_id
from neuroshard.protocol.reports import Dispute
from neuroshard.protocol.segments import Received, SegmentLog
from neuroshard.testing.api import test_config
from neuroshard.testing.verifier import ManualClock, small_network
from neuroshard.verifier import models as m
from neuroshard.verifier.background import JobContext
from neuroshard.verifier.db import Database
from neuroshard.verifier.network import NetworkDefinition
from neuroshard.verifier.replaycheck import ReplayCheckConfig, ReplayChecker, tolerance_for
from neuroshard.verifier.reputation import ReputationConfig
from neuroshard.verifier.segmentcheck import SegmentFraudProof, SenderFraudProof, judge_fraud_proof

OPERATOR = Wallet.from_token("segment-live-operator")
DRIVER, HONEST, LIAR, LIAR0 = (
    Wallet.from_token(f"segment-live-{n}") for n in ("driver", "honest", "liar", "liar0")
)
H, K, B, T = 8, 2, 2, 32


def _network(published: PublishedData) -> NetworkDefinition:
    return small_network(
        model={"size": "micro", "vocab_size": 512},
        stages={"count": 2},
        diloco={"inner_steps": H, "warmup_steps": 2, "total_steps": 100},
        training={"batch_size": B, "seq_len": T, "segment_steps": K},
        data={"manifest_url": str(published.directory), "publisher_key": published.public_key_hex},
    )


@dataclass
class Replica:
    wallet: Wallet
    stage: int
    net: PeerPlane
    log: SegmentLog
    base_hash: str
    delta_digest: str
    spans: list[list[int]]


def _answer(diloco: DiLoCo, act: Received) -> tuple[bytes, float]:
    """A stage-1 replica's step on the activations `act` carries: the gradient it sends back, as the
    wire carries it, and its loss."""
    hidden, labels = decode_activations(act.body, ActivationHeader.from_json(act.header), 512)
    grad, loss = stage_inner_step(diloco, hidden, labels, None)
    return encode_gradient(grad, DEFAULT_CODEC), loss


def _gradient(mb: str, sender: Wallet, to: Wallet, body: bytes, loss: float, run: str) -> Received:
    reply = GradientReply.create(
        sender,
        to=to.public_key_hex,
        micro_batch=mb,
        stage=1,
        round=0,
        loss=loss,
        codec=DEFAULT_CODEC,
        payload_sha256=sha256_hex(body),
        network=run,
    )
    return Received("gradient", sender.public_key_hex, reply.to_json(), body)


DRIVER_SENT: dict[int, bytes] = {}
"""What the driver built last (in this test: it is built first) computed and sent at each step:
the activations its stage-1 receivers train on, so its own segments replay to what it sent."""


def _activations(
    step: int, sender: Wallet, to: Wallet, run: str, body: bytes | None = None
) -> tuple[Received, str]:
    g = torch.Generator().manual_seed(50 + step)
    if body is None and sender == DRIVER:
        body = DRIVER_SENT.get(step)
    if body is None:
        body = encode_activations(
            torch.randn(B, T, 32, generator=g), torch.randint(0, 512, (B, T), generator=g), DEFAULT_CODEC
        )
    mb = micro_batch_id(sender.public_key_hex, 0, step)
    header = ActivationHeader.create(
        sender, to=to.public_key_hex, micro_batch=mb, stage=1, round=0, batch=B, seq_len=T, dim=32,
        codec=DEFAULT_CODEC, payload_sha256=sha256_hex(body), network=run,
    )  # fmt: skip
    return Received("activations", sender.public_key_hex, header.to_json(), body), mb


def _replica(
    published: PublishedData,
    tmp: Path,
    wallet: Wallet,
    stage: int,
    *,
    lie: bool,
    lie_sent: bool = False,
    negate_at: int | None = None,
) -> Replica:
    """A replica that ran round 0 with a segment recorder and serves its segments to the operator.
    The driver records sending the activations stage 1 receives (under the headers it signed for
    both stage-1 replicas, all listed in its log), which are what its steps computed (`DRIVER_SENT`); `lie_sent`: its
    log names other bytes for one of them. `negate_at`: a stage-1 replica answers that step's
    micro-batch with the gradient its step computed negated, and records sending that (its log
    agrees with what it signed: only a replay of the step tells).
    A stage-0 replica's gradients come from HONEST as it trains (a copy of its stage-1 engine steps
    in lockstep: the model's init is the run's, so HONEST, built later on the same activations,
    computes and records the same replies), and a stage-1 replica records each gradient it answers
    with after its step, as the node's worker does."""
    network = _network(published)
    config = SegmentConfig(segment_steps=K)
    store = SegmentStore(tmp / wallet.wallet_id, config, log=lambda _: None)
    run = network.digest()
    recorder = SegmentRecorder(config, stage=stage, sink=store, network=run)
    current: list[Received] = []
    computed: dict[int, bytes] = {}
    recorded: dict[int, bytes] = {}

    answerer = DiLoCo(build_stage(network.model, 1, 2), network.diloco) if stage == 0 else None

    def downstream(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        computed[i] = encode_activations(hidden, labels, DEFAULT_CODEC)  # what a stage-0 replica sends on
        recorded[i] = encode_activations(1.01 * hidden, labels, DEFAULT_CODEC)  # close, not the same
        if wallet == DRIVER:
            DRIVER_SENT[i] = computed[i]
        act, mb = _activations(i, wallet, HONEST, run, computed[i])
        assert answerer is not None
        body, loss = _answer(answerer, act)
        current[:] = [_gradient(mb, HONEST, wallet, body, loss, run)]
        recorder.note_received(current[0])
        reply = GradientReply.from_json(current[0].header)
        return decode_gradient(current[0].body, (B, T, 32), reply.codec), reply.loss

    model = build_stage(network.model, stage, 2)
    kwargs = {"loss_fn": remote_loss(downstream)} if stage == 0 else {}
    diloco = DiLoCo(model, network.diloco, **kwargs)  # type: ignore[arg-type]
    manifest = published.dataset.manifest
    stream = BatchStream(
        source=published.dataset.source, manifest=manifest, seed=wallet.wallet_id, batch_size=B, seq_len=T,
        order=assign_shards(wallet.wallet_id, manifest, exclude={network.held_out_shard}),
    )  # fmt: skip
    recorder.start_round(diloco)
    base, spans, start = tensor_digest(diloco.theta_round), [], None
    for i in range(H):
        if i == H - K:
            start = flat_parameters(diloco.params)
        span, received = None, []
        if stage == 0:
            before = stream.position.offset
            inputs, labels = stream.next_batch()
            span = (stream.shard_id, before, stream.position.offset)
            spans.append(list(span))
            mb = micro_batch_id(wallet.public_key_hex, 0, i)
            diloco.inner_step(inputs, labels)
            # A liar records (and serves) bytes close enough to what its step computed to pass its own
            # segment check, but not the bytes its header signed for the receiver.
            body = recorded[i] if lie_sent and i == 5 else computed[i]
            for to in (HONEST, LIAR):  # both stage-1 replicas hold a header it signed for them
                recorder.note_header(0, "activations", mb, to.public_key_hex, sha256_hex(body))
            recorder.note_sent(mb, "activations", sha256_hex(body), body)
        else:
            act, mb = _activations(i, DRIVER, wallet, run)
            reply, _ = _answer(diloco, act)
            if i == negate_at:
                reply = encode_gradient(-decode_gradient(reply, (B, T, 32), DEFAULT_CODEC), DEFAULT_CODEC)
            received = [act]
        if lie and i == H - 1:  # the last segment's update, inflated by 25% and committed
            assert start is not None
            copy_into_parameters(start + 1.25 * (flat_parameters(diloco.params) - start), diloco.params)
        recorder.record_step(diloco, data=span, micro_batch=mb, received=received)
        if stage > 0:
            recorder.note_sent(mb, "gradient", sha256_hex(reply), reply)
            recorder.note_header(0, "gradient", mb, DRIVER.public_key_hex, sha256_hex(reply))
    recorder.end_round(diloco)
    delta = diloco.pseudo_gradient()
    diloco.outer_step(delta)
    closed = recorder.close_round(wallet)
    assert closed is not None
    service = SegmentService(store, allowed_wallet=OPERATOR.public_key_hex)
    net = PeerPlane(
        PeerPlaneConfig(port=0, join_timeout_s=0),
        wallet,
        stage=stage,
        log=lambda _: None,
        extensions=[service],
    )
    net.start()
    merged: list[list[int]] = []
    for s, a, b in spans:
        if merged and merged[-1][0] == s and merged[-1][2] == a:
            merged[-1][2] = b
        else:
            merged.append([s, a, b])
    return Replica(wallet, stage, net, closed[0], base, tensor_digest(delta), merged)


@pytest.fixture
def replicas(published: PublishedData, tmp_path: Path) -> Iterator[list[Replica]]:
    made = [
        _replica(published, tmp_path, DRIVER, 0, lie=False),
        _replica(published, tmp_path, HONEST, 1, lie=False),
        _replica(published, tmp_path, LIAR, 1, lie=True),
    ]
    yield made
    for r in made:
        r.net.stop()


def _receipt(r: Replica) -> m.Receipt:
    first = r.spans[0] if r.spans else [None, None, None]
    return m.Receipt(
        wallet_id=r.wallet.wallet_id, stage=r.stage, round=0, inner_steps=H, start_step=0,
        tokens=H * B * T, shard_id=first[0], offset_start=first[1], offset_end=first[2],
        data_spans=r.spans, losses=[], base_hash=r.base_hash, result_hash="1" * 64,
        delta_digest=r.delta_digest, inner_state_digest=None, accepted=[], rejected=[], equivocators=[],
        segment_root=r.log.root(), segments=r.log.segments, device="cpu", precision="fp32",
        body_sha256=sha256_hex(r.wallet.public_key), received_at=time.time(),
    )  # fmt: skip


def _register(db: Database, replicas: list[Replica]) -> None:
    now = time.time()
    with db.write() as s:
        for r in replicas:
            s.add(m.Wallet(wallet_id=r.wallet.wallet_id, public_key=r.wallet.public_key_hex, reputation=0.5,
                           status=m.STATUS_ACTIVE, registered_at=now, software_version="0.1.0"))  # fmt: skip
        s.flush()
        for r in replicas:
            s.add(m.Peer(wallet_id=r.wallet.wallet_id, address=f"http://{r.net.address}", stage=r.stage,
                         registered_at=now, last_heartbeat=now))  # fmt: skip


def _check(
    db: Database, published: PublishedData, replicas: list[Replica], config: ReplayCheckConfig
) -> tuple[ReplayChecker, list[str]]:
    """Register the replicas, post their receipts and run the checker until it judged them all."""
    _register(db, replicas)
    lines: list[str] = []
    checker = ReplayChecker(
        JobContext(db=db, network=_network(published), operator=OPERATOR, log=lines.append),
        config=config,
        dataset=lambda: published.dataset,
    )
    checker.run_once()  # the first pass notes where the receipts end
    with db.write() as s:
        for r in replicas:
            s.add(_receipt(r))
    for _ in range(len(replicas) + 1):  # one replay per pass
        checker.run_once()
    return checker, lines


def _proofs(db: Database) -> list[m.FraudProof]:
    with db.read() as s:
        rows = list(s.scalars(select(m.FraudProof).order_by(m.FraudProof.created_at)))
        s.expunge_all()
    return rows


def _check_proof(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = check_proof.main(argv)
    out = capsys.readouterr()
    return code, (out.out + out.err).strip()


def test_segments_of_every_stage_are_checked_and_the_liar_is_caught(
    replicas: list[Replica],
    db: Database,
    database_url: str,
    published: PublishedData,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    network = _network(published)
    kept = tmp_path / "fraud-proofs"
    config = ReplayCheckConfig(sample_rate=1.0, segments_per_check=4, max_queue=8, fraud_proof_dir=kept)
    checker, lines = _check(db, published, replicas, config)
    assert checker.passed == 2 and checker.failed == 1, lines
    with db.read() as s:
        events = {e.wallet_id: e.reason for e in s.scalars(select(m.ReputationEvent))}
        reputations = {w.wallet_id: w.reputation for w in s.scalars(select(m.Wallet))}
    assert "segments [0, 1, 2, 3] of 4 replayed" in events[DRIVER.wallet_id]
    assert "segments [0, 1, 2, 3] of 4 replayed" in events[HONEST.wallet_id]
    assert "segment 3 of 4: norm ratio" in events[LIAR.wallet_id], events
    assert (
        reputations[LIAR.wallet_id] < 0.5 <= min(reputations[DRIVER.wallet_id], reputations[HONEST.wallet_id])
    )
    (proof_bytes,) = checker.fraud_proofs
    stage_model = build_stage(network.model, 1, 2)
    proof = SegmentFraudProof.decode(
        proof_bytes,
        numel=sum(p.numel() for p in stage_model.parameters()),
        n_tensors=len(list(stage_model.parameters())),
    )
    assert proof.material.commitment.wallet == LIAR.public_key_hex
    assert judge_fraud_proof(
        proof, model=network.model, diloco=network.diloco, num_stages=2,
        tolerance=tolerance_for("cpu", "fp32", ReplayCheckConfig()),
    ).proves  # fmt: skip

    # Kept: the file, named by its sha256, and its row.
    (row,) = _proofs(db)
    path = kept / f"{row.sha256}.proof"
    assert path.read_bytes() == proof_bytes and hashlib.sha256(proof_bytes).hexdigest() == row.sha256
    assert (row.wallet_id, row.stage, row.round, row.segment) == (LIAR.wallet_id, 1, 0, 3)
    assert row.size_bytes == len(proof_bytes) and row.data_spans == [] and "norm ratio" in row.reason
    assert [p.name for p in kept.iterdir()] == [path.name]  # no temporary file left behind

    # Served: listed and downloaded through the API.
    with TestClient(create_app(test_config(database_url, ManualClock(), network=network))) as client:
        listing = client.get("/api/fraud-proofs")
        assert listing.status_code == 200 and listing.headers["x-total-count"] == "1"
        assert listing.json()["served"] is False  # this app was given no directory
        assert client.get(f"/api/fraud-proofs/{row.sha256}").json()["error"] == "not_held"
    app = create_app(test_config(database_url, ManualClock(), network=network, fraud_proof_dir=kept))
    with TestClient(app) as client:
        (listed,) = client.get("/api/fraud-proofs").json()["proofs"]
        assert listed["sha256"] == row.sha256 and listed["wallet_id"] == LIAR.wallet_id
        assert (listed["stage"], listed["round"], listed["segment"]) == (1, 0, 3)
        download = client.get(listed["download"])
        assert download.status_code == 200 and download.content == proof_bytes
        assert download.headers["content-type"] == "application/octet-stream"
        assert download.headers["content-length"] == str(len(proof_bytes))
        assert download.headers["etag"] == f'"{row.sha256}"'
        network_json = client.get("/api/network").content  # what a third party fetches

    # Checked alone, from the downloaded bytes and the signed run definition.
    (tmp_path / "network.json").write_bytes(network_json)
    fetched = tmp_path / "fetched.proof"
    fetched.write_bytes(download.content)
    code, out = _check_proof([str(fetched), "--network", str(tmp_path / "network.json")], capsys)
    assert code == 0 and out.startswith(
        f"PROVES FRAUD: wallet {LIAR.wallet_id} stage 1 round 0 segment 3 ("
    ), out
    tampered = bytearray(proof_bytes)
    tampered[len(tampered) // 2] ^= 0x01
    (tmp_path / "tampered.proof").write_bytes(bytes(tampered))
    code, out = _check_proof(
        [str(tmp_path / "tampered.proof"), "--network", str(tmp_path / "network.json")], capsys
    )
    assert (
        code == 1 and out.startswith("does not prove fraud: ") and "does not match its committed hash" in out
    ), out
    (tmp_path / "cut.proof").write_bytes(proof_bytes[:1000])
    code, out = _check_proof(
        [str(tmp_path / "cut.proof"), "--network", str(tmp_path / "network.json")], capsys
    )
    assert code == 2 and "not a segment fraud proof" in out, out


def test_a_sender_whose_log_contradicts_what_it_signed_loses_reputation(
    published: PublishedData, db: Database, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checking a stage-1 replica's segments, the verifier reads the signed log of the driver whose
    activations they consumed (GET /p2p/segment-log) once the driver's receipt is in, however
    much later: a driver whose log lists other bytes than the header it signed fails a
    spot check in its own stage and round, though its own segments replay fine; the receiver
    passes. The contradiction is kept as a sender fraud proof that `neuroshard-check-proof` checks
    alone, without the run's definition."""
    driver = _replica(published, tmp_path, DRIVER, 0, lie=False, lie_sent=True)
    receiver = _replica(published, tmp_path, HONEST, 1, lie=False)
    try:
        _register(db, [driver, receiver])
        lines: list[str] = []
        checker = ReplayChecker(
            JobContext(db=db, network=_network(published), operator=OPERATOR, log=lines.append),
            config=ReplayCheckConfig(
                sample_rate=1.0, segments_per_check=4, max_queue=8, fraud_proof_dir=tmp_path / "proofs"
            ),
            dataset=lambda: published.dataset,
        )
        checker.run_once()  # the first pass notes where the receipts end
        with db.write() as s:
            s.add(_receipt(receiver))
        for _ in range(3):  # the receiver is checked; the driver's receipt is not in: its match waits
            checker.run_once()
        assert checker.passed == 1 and checker.failed == 0 and len(checker._senders) == 1, lines
        with db.write() as s:
            s.add(_receipt(driver))
        for _ in range(3):
            checker.run_once()
    finally:
        for r in (driver, receiver):
            r.net.stop()
    assert checker.passed == 2 and checker.failed == 1, lines
    with db.read() as s:
        events = [
            (e.wallet_id, e.stage, e.round, e.delta, e.reason) for e in s.scalars(select(m.ReputationEvent))
        ]
    (failed,) = [e for e in events if e[3] < 0]
    assert failed[:3] == (DRIVER.wallet_id, 0, 0), events
    assert f"contradicts what it signed for {HONEST.wallet_id}" in failed[4]
    assert "it signed activations" in failed[4] and "whose log does not list that header" in failed[4]
    assert not [e for e in events if e[0] == HONEST.wallet_id and e[3] < 0]

    with db.read() as s:
        (row,) = s.scalars(select(m.FraudProof))
        assert (row.kind, row.wallet_id, row.stage, row.round, row.data_spans, row.device, row.precision) == (
            "sender",
            DRIVER.wallet_id,
            0,
            0,
            [],
            None,  # what the sender trained with does not bear on this proof
            None,
        )
    path = tmp_path / "proofs" / f"{row.sha256}.proof"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == row.sha256
    code, out = _check_proof([str(path), "--wallet", DRIVER.wallet_id], capsys)
    assert code == 0 and out.startswith(f"PROVES FRAUD: wallet {DRIVER.wallet_id} stage 0 round 0 step "), out
    assert f"contradicts what it signed for {HONEST.wallet_id}" in out and "[no definition]" in out, out
    (tmp_path / "network.json").write_bytes(_network(published).canonical_bytes())
    code, out = _check_proof([str(path), "--network", str(tmp_path / "network.json")], capsys)
    assert code == 0 and "PROVES FRAUD" in out and "definition sha256" in out, out
    # A header the driver signed for the same micro-batch to another replica is another exchange's:
    # held to its header to LIAR, which its log lists, it proves nothing; with bytes none lists, it does.
    proof = SenderFraudProof.decode(path.read_bytes())
    header = ActivationHeader.from_json(proof.message.header)
    (to_liar,) = [
        x
        for x in proof.log.log.headers or ()
        if (x.micro_batch, x.to) == (header.micro_batch, LIAR.public_key_hex)
    ]
    for payload, proves in ((to_liar.payload_sha256, False), ("1" * 64, True)):
        fields = {f.name: getattr(header, f.name) for f in dataclasses.fields(header)}
        fields.update(to=LIAR.public_key_hex, payload_sha256=payload)
        del fields["wallet"], fields["signature"]
        elsewhere = ActivationHeader.create(DRIVER, **fields).to_json()
        message = Received("activations", DRIVER.public_key_hex, elsewhere, b"")
        (tmp_path / "other.proof").write_bytes(SenderFraudProof(proof.log, message).encode())
        code, out = _check_proof([str(tmp_path / "other.proof")], capsys)
        if proves:
            assert code == 0 and f"contradicts what it signed for {LIAR.wallet_id}" in out, out
        else:
            assert code == 1 and out.startswith("does not prove fraud: the log does not contradict"), out
    # Its log edited (the counterpart renamed everywhere): no longer the chain its signature covers.
    edited = path.read_bytes().replace(HONEST.public_key_hex.encode(), DRIVER.public_key_hex.encode())
    (tmp_path / "edited.proof").write_bytes(edited)
    code, out = _check_proof([str(tmp_path / "edited.proof")], capsys)
    assert code == 1 and "root" in out, out
    code, out = _check_proof([str(path), "--wallet", HONEST.wallet_id], capsys)
    assert code == 2 and "is signed by wallet" in out, out


def _reply(replier: Replica, step: int, run: str) -> GradientReply:
    """The reply `replier` signed to the driver for its step `step` (what its log lists)."""
    mb = micro_batch_id(DRIVER.public_key_hex, 0, step)
    (listed,) = [h for h in replier.log.headers or () if h.micro_batch == mb and h.kind == "gradient"]
    return GradientReply.create(
        replier.wallet, to=DRIVER.public_key_hex, micro_batch=mb, stage=1, round=0, loss=5.0,
        codec=DEFAULT_CODEC, payload_sha256=listed.payload_sha256, network=run,
    )  # fmt: skip


def test_a_disputed_answer_has_its_segment_replayed_and_a_negating_replier_is_caught(
    published: PublishedData, db: Database, tmp_path: Path
) -> None:
    """A stage of two: the driver's audit of micro-batch 5 found the two stage-1 answers apart and
    could not tell which was wrong (no third replica to ask). Its receipt names the dispute. With
    nothing drawn at random (rate 0), the verifier holds each replier to its signed log, finds the
    step that consumed the micro-batch and replays that segment (segment 2 of 4, at k = 2): the
    replica that answered with the gradient negated, and recorded sending it (its log agrees with
    its signature), fails on the gradient it sent; the honest one passes, for no credit. Each
    disputed segment is replayed once: the same dispute again is not checked twice."""
    network = _network(published)
    made = [
        _replica(published, tmp_path, DRIVER, 0, lie=False),
        _replica(published, tmp_path, HONEST, 1, lie=False),
        _replica(published, tmp_path, LIAR, 1, lie=False, negate_at=5),
    ]
    driver, honest, liar = made
    try:
        _register(db, made)
        lines: list[str] = []
        checker = ReplayChecker(
            JobContext(db=db, network=network, operator=OPERATOR, log=lines.append),
            config=ReplayCheckConfig(sample_rate=0.0, segments_per_check=4, max_queue=8),
            dataset=lambda: published.dataset,
        )
        checker.run_once()  # the first pass notes where the receipts end
        run = network.digest()
        dispute = Dispute(
            micro_batch=micro_batch_id(DRIVER.public_key_hex, 0, 5),
            replies=(_reply(liar, 5, run), _reply(honest, 5, run)),
        )
        with db.write() as s:
            for r in made:
                row = _receipt(r)
                if r is driver:
                    row.disputes = [dispute.to_obj()] * 2  # the same dispute twice: checked once
                s.add(row)
        for _ in range(6):
            checker.run_once()
    finally:
        for r in made:
            r.net.stop()
    assert checker.disputes == 4 and checker.passed == 1 and checker.failed == 1, lines
    with db.read() as s:
        events = {e.wallet_id: (e.delta, e.reason) for e in s.scalars(select(m.ReputationEvent))}
    # Only the liar has a verdict: the disputing replica chose the segment, so the honest replier's
    # pass earns nothing (a colluder could otherwise hand its partner predictable passes), and
    # the driver was not drawn.
    assert set(events) == {LIAR.wallet_id}, events
    delta, reason = events[LIAR.wallet_id]
    assert delta < 0 and "the gradient it sent are not what its step computes" in reason, reason
    assert any(
        f"{HONEST.wallet_id} round 0 passed the check of disputed micro-batch" in line for line in lines
    ), lines
    assert sum("(disputed micro-batch" in line and "to replay" in line for line in lines) == 2, lines


def test_a_sender_that_does_not_serve_its_log_fails_as_an_unanswered_challenge(
    published: PublishedData, db: Database, tmp_path: Path
) -> None:
    """A driver whose receipt is in but which stops serving its round log is tried for the answer
    window, then fails a spot check in its own stage and round at `unanswered_penalty` (once: a
    restarted verifier finds the verdict in the ledger); the receiver passes."""
    driver = _replica(published, tmp_path, DRIVER, 0, lie=False)
    receiver = _replica(published, tmp_path, HONEST, 1, lie=False)
    _register(db, [driver, receiver])
    with db.write() as s:  # in before the checker starts: only the receiver is drawn
        s.add(_receipt(driver))
    lines: list[str] = []
    ctx = JobContext(db=db, network=_network(published), operator=OPERATOR, log=lines.append)
    config = ReplayCheckConfig(sample_rate=1.0, segments_per_check=4, max_queue=8, answer_window_s=60.0)
    checker = ReplayChecker(ctx, config=config, dataset=lambda: published.dataset)
    try:
        checker.run_once()
        driver.net.stop()  # gone before anyone asks for its log
        with db.write() as s:
            s.add(_receipt(receiver))
        for _ in range(3):
            checker.run_once()
    finally:
        receiver.net.stop()
    assert checker.passed == 1 and checker.failed == 0 and len(checker._senders) == 1, lines
    (match,) = checker._senders
    assert match.found is not None and match.declined.startswith("unreachable: "), match
    match.found = (match.found[0] - 61.0, match.found[1])
    checker.run_once()
    assert checker.failed == 1 and checker.unanswered == 1 and not checker._senders, lines
    with db.read() as s:
        events = [
            (e.wallet_id, e.stage, e.round, e.delta, e.reason) for e in s.scalars(select(m.ReputationEvent))
        ]
    (failed,) = [e for e in events if e[3] < 0]
    assert failed[:4] == (DRIVER.wallet_id, 0, 0, -ReputationConfig().unanswered_penalty), events
    assert "records: did not serve its round log within 60 s (unreachable: " in failed[4], failed

    # A restarted verifier does not fail the same round again.
    again = ReplayChecker(ctx, config=config, dataset=lambda: published.dataset)
    again._senders.append(match)
    again.run_once()
    assert again.failed == 0 and not again._senders, lines


def _toml(published: PublishedData) -> str:
    """_network(published) as a network.toml."""
    return f"""name = "test"
[model]
size = "micro"
vocab_size = 512
[stages]
count = 2
[diloco]
inner_steps = {H}
warmup_steps = 2
total_steps = 100
[training]
batch_size = {B}
seq_len = {T}
segment_steps = {K}
[data]
manifest_url = "{published.directory}"
publisher_key = "{published.public_key_hex}"
"""


def test_a_stage_0_proof_checks_against_the_data_and_only_the_newest_proofs_are_kept(
    published: PublishedData, db: Database, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two liars, one at each stage, with room for one proof: the older proof's file and row go;
    the stage-0 one re-checks alone against the run's data and the receipt's spans."""
    liars = [
        _replica(published, tmp_path, LIAR, 1, lie=True),
        _replica(published, tmp_path, LIAR0, 0, lie=True),
    ]
    kept = tmp_path / "fraud-proofs"
    try:
        config = ReplayCheckConfig(
            sample_rate=1.0, segments_per_check=4, fraud_proof_dir=kept, keep_fraud_proofs=1
        )
        checker, lines = _check(db, published, liars, config)
    finally:
        for r in liars:
            r.net.stop()
    assert checker.failed == 2 and len(checker.fraud_proofs) == 2, lines
    (row,) = _proofs(db)
    assert (row.wallet_id, row.stage, row.segment) == (LIAR0.wallet_id, 0, 3)
    assert row.data_spans == liars[1].spans
    assert [p.name for p in kept.iterdir()] == [f"{row.sha256}.proof"]  # the stage-1 proof's file is gone

    (tmp_path / "network.toml").write_text(_toml(published))
    proof = str(kept / f"{row.sha256}.proof")
    base = [proof, "--network", str(tmp_path / "network.toml"), "--cache-dir", str(tmp_path / "cache")]
    code, out = _check_proof([*base, "--spans", json.dumps(row.data_spans)], capsys)
    assert code == 0 and out.startswith(
        f"PROVES FRAUD: wallet {LIAR0.wallet_id} stage 0 round 0 segment 3"
    ), out
    code, out = _check_proof([*base, "--device", "cpu", "--precision", "fp32"], capsys)  # no spans to compare
    assert code == 0, out
    shard, start, end = row.data_spans[0]
    code, out = _check_proof([*base, "--spans", json.dumps([[shard, start + B, end + B]])], capsys)
    assert code == 1 and "data spans differ" in out, out


def test_a_dispute_costs_no_replier_anything_it_could_not_answer(
    published: PublishedData, db: Database, tmp_path: Path
) -> None:
    """A disputing replica picks what the verifier asks for, so what a replier cannot answer is no
    verdict: a reply naming a round the replier never reports (it may name one long gone) ends
    unmatched, a reply from a wallet not registered for the next stage is not taken up, and the
    disputes of a receipt that came after its round settled are not taken up at all."""
    network = _network(published)
    made = [
        _replica(published, tmp_path, DRIVER, 0, lie=False),
        _replica(published, tmp_path, HONEST, 1, lie=False),
    ]
    driver, honest = made
    stranger = Wallet.from_token("segment-live-stranger")
    try:
        _register(db, made)
        lines: list[str] = []
        checker = ReplayChecker(
            JobContext(db=db, network=network, operator=OPERATOR, log=lines.append),
            config=ReplayCheckConfig(sample_rate=0.0, sender_wait_s=0.0),
            dataset=lambda: published.dataset,
        )
        checker.run_once()
        run = network.digest()
        mb = micro_batch_id(DRIVER.public_key_hex, 0, 5)
        listed = _reply(honest, 5, run)
        fields = {f.name: getattr(listed, f.name) for f in dataclasses.fields(listed)}
        del fields["wallet"], fields["signature"]
        ahead = GradientReply.create(HONEST, **(fields | {"round": 7}))
        unknown = GradientReply.create(stranger, **fields)
        with db.write() as s:
            row = _receipt(driver)
            row.disputes = [Dispute(micro_batch=mb, replies=(ahead, unknown)).to_obj()]
            s.add(row)
            s.add(_receipt(honest))
            # Round 1 of stage 0 settled before the driver's receipt for it came: held back, it
            # could name answers its repliers no longer keep.
            s.add(m.Round(stage=0, round=1, majority_hash="1" * 64, votes=1, agreeing=1, synced=1,
                          sync_checked=1, settled_at=time.time() - 10))  # fmt: skip
            late = _receipt(driver)
            late.round, late.body_sha256 = 1, "9" * 64
            late.disputes = [Dispute(micro_batch=mb, replies=(listed, unknown)).to_obj()]
            s.add(late)
        for _ in range(4):
            time.sleep(0.01)
            checker.run_once()
    finally:
        for r in made:
            r.net.stop()
    assert checker.disputes == 1 and checker.failed == 0 and checker.unanswered == 0, lines
    with db.read() as s:
        assert list(s.scalars(select(m.ReputationEvent))) == []
    assert any("is not a registered replica of stage 1" in line for line in lines), lines
    assert any(
        f"{DRIVER.wallet_id} round 1 came after its round settled; its disputes are not taken up" in line
        for line in lines
    ), lines
    assert any("its disputed reply names" in line and "no verdict" in line for line in lines), lines
