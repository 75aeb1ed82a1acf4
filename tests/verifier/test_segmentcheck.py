"""Segment replay at stage 0 and at later stages: honest segments pass (same precision, and bf16
autocast replayed in fp32); each lie is refused — made-up inputs, skipped steps, scaled updates, a
checkpoint that does not match its hash, inputs that disagree with the sender's signed record."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import select
from torch import Tensor

from neuroshard.cli import check_proof
from neuroshard.node.actcodec import CODECS, DEFAULT_CODEC, FORMATS, round_trip
from neuroshard.node.device import Placement
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig, copy_into_parameters, flat_parameters, tensor_digest
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.p2p.pipeline_wire import (
    decode_activations,
    decode_gradient,
    encode_activations,
    encode_gradient,
)
from neuroshard.node.pipeline import remote_loss, stage_inner_step
from neuroshard.node.replay import InnerState, fresh_inner_digest
from neuroshard.node.segment_store import SegmentMaterial, SegmentStore
from neuroshard.node.segments import SegmentConfig, SegmentRecorder
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.identity import sha256_hex
from neuroshard.protocol.pipeline import ActivationHeader, GradientReply, micro_batch_id
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.segments import (
    FailedStep,
    Received,
    ReceivedRef,
    SegmentCommitment,
    SegmentLog,
    SentRef,
    SignedHeader,
    SignedSegmentLog,
    StepRecord,
    checkpoint_hash,
    segment_boundaries,
)
from neuroshard.testing.verifier import small_network
from neuroshard.verifier import models as m
from neuroshard.verifier import replaycheck
from neuroshard.verifier.background import JobContext
from neuroshard.verifier.db import Database
from neuroshard.verifier.network import NetworkDefinition
from neuroshard.verifier.replaycheck import (
    CALIBRATED_TOLERANCE,
    SEGMENT_TOLERANCE,
    Challenge,
    ReplayCheckConfig,
    ReplayChecker,
    calibrated_tolerance,
    tolerance_for,
)
from neuroshard.verifier.segmentcheck import (
    CONTINUITY_PROOF_MAGIC,
    SENDER_PROOF_MAGIC,
    ContinuityFraudProof,
    SegmentClaim,
    SegmentFraudProof,
    SegmentVerdict,
    SenderFraudProof,
    check_segment,
    commitment_problems,
    compare_sent,
    continuity_problem,
    contradicting,
    judge_continuity_proof,
    judge_fraud_proof,
    judge_sender_proof,
    sender_round,
    signed_log_problem,
)
from neuroshard.verifier.segmentlive import (
    SegmentsJudged,
    allowed_segment_steps,
    judge_segments,
    segment_count_problem,
)

MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, ffn_dim=64, max_seq_len=16)
H, K, B, T = 8, 4, 2, 16
DILOCO = DiLoCoConfig(inner_steps=H, warmup_steps=2, total_steps=100)
REPLICA = Wallet.from_token("segment-replica")
PREV = Wallet.from_token("segment-previous-stage")
NEXT = Wallet.from_token("segment-next-stage")
ROUND = 0
CODEC = DEFAULT_CODEC


def read_batch(span: tuple[int, int, int]) -> tuple[Tensor, Tensor]:
    """The data set as the verifier recomputes it: windows are a pure function of the span."""
    shard, start, _ = span
    g = torch.Generator().manual_seed(1000 * shard + start)
    tokens = torch.randint(0, MODEL.vocab_size, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


RUN = "5e" * 32
"""The run the pipeline headers and the sender logs of these tests name (a definition's digest)."""


def activations(step: int, *, stage: int) -> tuple[Received, str]:
    """A micro-batch from the previous stage, as its signed header and encoded body."""
    g = torch.Generator().manual_seed(50 + step)
    hidden = torch.randn(B, T, MODEL.dim, generator=g)
    labels = torch.randint(0, MODEL.vocab_size, (B, T), generator=g)
    body = encode_activations(hidden, labels, CODEC)
    mb = micro_batch_id(PREV.public_key_hex, ROUND, step)
    header = ActivationHeader.create(
        PREV, to=REPLICA.public_key_hex, micro_batch=mb, stage=stage, round=ROUND, batch=B, seq_len=T, dim=MODEL.dim,
        codec=CODEC, payload_sha256=sha256_hex(body), network=RUN,
    )  # fmt: skip
    return Received("activations", PREV.public_key_hex, header.to_json(), body), mb


def gradient(step: int, mb: str, *, stage: int) -> Received:
    """The next stage's answer: a signed gradient reply and its encoded body."""
    g = torch.Generator().manual_seed(90 + step)
    body = encode_gradient(torch.randn(B, T, MODEL.dim, generator=g) * 1e-3, CODEC)
    reply = GradientReply.create(
        NEXT, to=REPLICA.public_key_hex, micro_batch=mb, stage=stage + 1, round=ROUND, loss=4.0, codec=CODEC,
        payload_sha256=sha256_hex(body), network=RUN,
    )  # fmt: skip
    return Received("gradient", NEXT.public_key_hex, reply.to_json(), body)


Tamper = Callable[[int, DiLoCo], bool]
"""(step in round, engine) -> whether to skip the honest step (a liar's hook; False: honest)."""


@dataclasses.dataclass
class Run:
    stage: int
    num_stages: int
    store: SegmentStore
    root: str
    spans: list[tuple[int, int, int]]
    base_hash: str
    delta_digest: str

    def material(self, segment: int) -> SegmentMaterial:
        material = self.store.material(ROUND, segment)
        assert material is not None
        n = sum(p.numel() for p in build_stage(MODEL, self.stage, self.num_stages).parameters())
        k = len(list(build_stage(MODEL, self.stage, self.num_stages).parameters()))
        return SegmentMaterial.decode(material.encode(), numel=n, n_tensors=k)  # as the wire carries it

    def claim(self, precision: str = "fp32") -> SegmentClaim:
        return SegmentClaim(
            model=MODEL, diloco=DILOCO, num_stages=self.num_stages, stage=self.stage, round=ROUND,
            wallet=REPLICA.public_key_hex, root=self.root, spans=self.spans, precision=precision,
            base_hash=self.base_hash, delta_digest=self.delta_digest,
            network=_run_network(num_stages=self.num_stages).digest(),
        )  # fmt: skip


def train_round(
    tmp_path: Path,
    *,
    stage: int,
    num_stages: int,
    precision: str = "fp32",
    tamper: Tamper | None = None,
    after_step: Callable[[int, DiLoCo], None] | None = None,
    recorded: Callable[[int, Received], Received] | None = None,
    sends: Callable[[int, Tensor], Tensor] | None = None,
    unrecorded: int | None = None,
    crashed_offers: int = 0,
    fails: dict[int, Callable[[Tensor], Tensor] | tuple[Callable[[Tensor], Tensor], ...]] | None = None,
    unnamed: int | None = None,
) -> Run:
    """One replica's round of H steps with a SegmentRecorder, as the node records it. `sends`:
    (step, what the step computed) -> what the replica sends on instead (and records as sent);
    `unrecorded`: a step whose gradient sent back the replica leaves out of its log; `fails`
    (a middle stage): before step i, a micro-batch whose forward it offers downstream (the tensor
    it computed, through the hook) and whose every attempt fails, as the node records it (a tuple
    of hooks: that many failed micro-batches in a row before step i); `crashed_offers`: offers an
    earlier run of the round signed before a crash (the redone round carries them); `unnamed`: a
    step recorded (and its answer noted) under no micro-batch id."""
    torch.manual_seed(0)
    store = SegmentStore(tmp_path / "segments", SegmentConfig(segment_steps=K), log=lambda _: None)
    run_digest = _run_network(num_stages=num_stages).digest()  # the run `_definition` describes
    recorder = SegmentRecorder(SegmentConfig(segment_steps=K), stage=stage, sink=store, network=run_digest)
    place = Placement(device=torch.device("cpu"), precision=precision)
    model = build_stage(MODEL, stage, num_stages)
    current: list[Received] = []

    def downstream(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        reply = current[0]
        recorder.note_received(reply)
        sent = encode_activations(hidden if sends is None else sends(i, hidden), labels, CODEC)
        recorder.note_sent(
            GradientReply.from_json(reply.header).micro_batch, "activations", sha256_hex(sent), sent
        )
        g = GradientReply.from_json(reply.header)
        return decode_gradient(reply.body, (B, T, MODEL.dim), g.codec), g.loss

    last = stage == num_stages - 1
    kwargs = {"loss_fn": remote_loss(downstream)} if stage == 0 and not last else {}
    diloco = DiLoCo(model, DILOCO, placement=place, **kwargs)
    for n in range(crashed_offers):
        store.header(ROUND, SignedHeader(
            kind="activations", micro_batch=f"{n:032x}", to=NEXT.public_key_hex, payload_sha256="cc" * 32
        ))  # fmt: skip
    recorder.start_round(diloco)
    spans = []
    for i in range(H):
        hooks = () if fails is None else fails.get(i, ())
        for n, offer in enumerate(hooks if isinstance(hooks, tuple) else (hooks,)):
            act, failed_mb = activations(100 + i + 50 * n, stage=stage)
            inputs, labels = decode_activations(
                act.body, ActivationHeader.from_json(act.header), MODEL.vocab_size
            )

            def unanswered(
                hidden: Tensor,
                labels: Tensor,
                offer: Callable[[Tensor], Tensor] = offer,
                failed_mb: str = failed_mb,
            ) -> tuple[Tensor, float]:
                body = encode_activations(offer(hidden), labels, CODEC)
                for to in (NEXT, PREV):  # two replicas of the next stage tried, both failed
                    recorder.note_header(
                        ROUND, "activations", failed_mb, to.public_key_hex, sha256_hex(body), body
                    )
                raise ConnectionError("no replica of the next stage took it")

            with pytest.raises(ConnectionError):
                stage_inner_step(diloco, inputs, labels, unanswered)
            recorder.note_failed(failed_mb, [act])
        span, received, mb, reply = None, [], "", None
        if stage == 0:
            span = (3, i * B, (i + 1) * B)
            spans.append(span)
            inputs, labels = read_batch(span)
            mb = micro_batch_id(REPLICA.public_key_hex, ROUND, i) if not last else ""
        else:
            act, mb = activations(i, stage=stage)
            received.append(act)
            inputs, labels = decode_activations(
                act.body, ActivationHeader.from_json(act.header), MODEL.vocab_size
            )
        if not last:
            current[:] = [gradient(i, mb, stage=stage)]
        if tamper is None or not tamper(i, diloco):
            if stage == 0:
                diloco.inner_step(inputs, labels)
            else:
                grad, _ = stage_inner_step(diloco, inputs, labels, None if last else downstream)
                reply = encode_gradient(grad if sends is None else sends(i, grad), CODEC)
        elif stage > 0:  # a skipped step still answers its sender, and records the answer
            reply = encode_gradient(torch.zeros(B, T, MODEL.dim), CODEC)
        if after_step is not None:
            after_step(i, diloco)
        if recorded is not None:
            received = [recorded(i, m) for m in received]
        if i == unnamed:
            mb = ""
        recorder.record_step(diloco, data=span, micro_batch=mb, received=received)
        if reply is not None and i != unrecorded:  # noted after the step is recorded, as the node's reply is
            recorder.note_sent(mb, "gradient", sha256_hex(reply), reply)
    recorder.end_round(diloco)
    base_hash, delta = tensor_digest(diloco.theta_round), diloco.pseudo_gradient()
    diloco.outer_step(delta)
    closed = recorder.close_round(REPLICA)
    assert closed is not None
    log, commitment = closed
    assert commitment is not None and commitment.root == log.root() and log.segments == H // K
    return Run(stage, num_stages, store, log.root(), spans, base_hash, tensor_digest(delta))


def check(run: Run, segment: int, precision: str = "fp32", trained: str = "fp32") -> SegmentVerdict:
    tolerance = tolerance_for("cpu", trained, ReplayCheckConfig(), segment_steps=K)
    assert tolerance == SEGMENT_TOLERANCE
    return check_segment(run.claim(precision), run.material(segment), tolerance, read_batch=read_batch)


STAGES = [(0, 1), (0, 2), (1, 2), (1, 3)]
"""(stage, S): a lone stage, a driver, a last stage, a middle stage."""


@pytest.mark.parametrize(("stage", "num_stages"), STAGES)
def test_honest_segments_replay_exactly_in_the_same_precision(
    tmp_path: Path, stage: int, num_stages: int
) -> None:
    run = train_round(tmp_path, stage=stage, num_stages=num_stages)
    for j in range(H // K):
        verdict = check(run, j)
        assert verdict.ok and verdict.replayed, verdict.reason
        assert verdict.cosine is not None and verdict.cosine > 1 - 1e-9
        assert verdict.norm_ratio is not None and abs(verdict.norm_ratio - 1) < 1e-6


@pytest.mark.parametrize(("stage", "num_stages"), [(0, 1), (1, 2)])
def test_bf16_autocast_segments_pass_a_fp32_replay(tmp_path: Path, stage: int, num_stages: int) -> None:
    run = train_round(tmp_path, stage=stage, num_stages=num_stages, precision="bf16")
    for j in range(H // K):
        verdict = check(run, j, trained="bf16")
        assert verdict.ok, verdict.reason
        assert verdict.cosine is not None and verdict.cosine < 1 - 1e-9  # really another precision
    same = check(run, 0, precision="bf16", trained="bf16")  # replayed in the claimed precision
    assert same.ok and same.cosine is not None and same.cosine > 1 - 1e-6


@pytest.mark.parametrize(
    ("stage", "num_stages", "factor"), [(0, 1, 1.25), (1, 2, 1.25), (0, 1, 1.04), (1, 2, 1.04)]
)
def test_a_scaled_update_is_refused_and_proves_fraud(
    tmp_path: Path, stage: int, num_stages: int, factor: float
) -> None:
    """A segment's update inflated by 25%, or by 4% (which a whole round's ±5% would let through:
    segments are held to SEGMENT_TOLERANCE), is refused, and its material proves it alone."""
    starts: dict[int, Tensor] = {}

    def scale(i: int, diloco: DiLoCo) -> None:
        if i % K == 0:
            starts[i // K] = flat_parameters(diloco.params)  # after step i; close enough to its start
        if i % K == K - 1 and i // K == 1:
            start = starts[1]
            copy_into_parameters(start + factor * (flat_parameters(diloco.params) - start), diloco.params)

    run = train_round(tmp_path, stage=stage, num_stages=num_stages, after_step=scale)
    assert check(run, 0).ok
    verdict = check(run, 1)
    assert not verdict.ok and verdict.replayed and "norm ratio" in verdict.reason
    proof = SegmentFraudProof.decode(
        SegmentFraudProof(run.material(1)).encode(),
        numel=run.material(1).start.weights.numel(),
        n_tensors=run.material(1).start.inner.steps.numel(),
    )
    kw = dict(model=MODEL, diloco=DILOCO, num_stages=num_stages, read_batch=read_batch, spans=run.spans)
    tolerance = calibrated_tolerance(K)  # what neuroshard-check-proof holds a proof of k = K steps to
    assert judge_fraud_proof(proof, tolerance=tolerance, **kw).proves
    assert not judge_fraud_proof(SegmentFraudProof(run.material(0)), tolerance=tolerance, **kw).proves
    whole_round = judge_fraud_proof(proof, tolerance=calibrated_tolerance(None), **kw).proves
    assert whole_round == (factor > 1.05)  # a whole round's tolerance misses the 4%


def _skip_half(counters: bool) -> Tamper:
    """Train on half the micro-batches of segment 1 and advance the step counters as if not;
    with `counters` also AdamW's own per-parameter step counts."""

    def tamper(i: int, diloco: DiLoCo) -> bool:
        if i // K != 1 or i % 2 == 0:
            return False
        diloco.step += 1
        diloco.steps_in_round += 1
        if counters:
            for state in diloco.inner_optimizer.state.values():
                state["step"] += 1
        return True

    return tamper


@pytest.mark.parametrize(("stage", "num_stages"), [(0, 1), (1, 2)])
def test_skipped_steps_are_refused(tmp_path: Path, stage: int, num_stages: int) -> None:
    naive = train_round(tmp_path / "naive", stage=stage, num_stages=num_stages, tamper=_skip_half(False))
    verdict = check(naive, 1)
    assert not verdict.ok and "optimizer counted" in verdict.reason
    careful = train_round(tmp_path / "careful", stage=stage, num_stages=num_stages, tamper=_skip_half(True))
    assert check(careful, 0).ok
    verdict = check(careful, 1)
    assert not verdict.ok and verdict.replayed, verdict.reason


def test_training_on_made_up_data_at_stage_0_is_refused(tmp_path: Path) -> None:
    def other_data(i: int, diloco: DiLoCo) -> bool:
        if i // K != 1:
            return False
        diloco.inner_step(*read_batch((9, 100 + i * B, 100 + (i + 1) * B)))  # not the span it records
        return True

    run = train_round(tmp_path, stage=0, num_stages=1, tamper=other_data)
    assert check(run, 0).ok
    verdict = check(run, 1)
    assert not verdict.ok and "cosine" in verdict.reason


def test_step_spans_must_be_the_receipts(tmp_path: Path) -> None:
    run = train_round(tmp_path, stage=0, num_stages=1)
    other = dataclasses.replace(run, spans=[(3, B, B + B * H)])  # shifted by one batch
    verdict = check(other, 0)
    assert not verdict.ok and not verdict.replayed and "data spans differ" in verdict.reason


@pytest.mark.parametrize(("stage", "num_stages"), [(0, 1), (1, 2)])
def test_a_checkpoint_that_does_not_match_its_hash_is_refused(
    tmp_path: Path, stage: int, num_stages: int
) -> None:
    run = train_round(tmp_path, stage=stage, num_stages=num_stages)
    material = run.material(0)
    doctored = dataclasses.replace(
        material,
        end=dataclasses.replace(material.end, weights=material.end.weights * 1.01),
    )
    tolerance = tolerance_for("cpu", "fp32", ReplayCheckConfig())
    verdict = check_segment(run.claim(), doctored, tolerance, read_batch=read_batch)
    assert (
        not verdict.ok
        and not verdict.replayed
        and "step 4 does not match its committed hash" in verdict.reason
    )
    moments = dataclasses.replace(
        material, start=dataclasses.replace(material.start, inner=InnerState(
            material.start.inner.exp_avg + 1e-3, material.start.inner.exp_avg_sq, material.start.inner.steps))
    )  # fmt: skip
    verdict = check_segment(run.claim(), moments, tolerance, read_batch=read_batch)
    assert not verdict.ok and "step 0 does not match" in verdict.reason
    assert not judge_fraud_proof(
        SegmentFraudProof(doctored), model=MODEL, diloco=DILOCO, num_stages=num_stages,
        tolerance=tolerance, read_batch=read_batch, spans=run.spans,
    ).proves  # fmt: skip  # not signed as served: no proof against the wallet


SENT_LIES: dict[str, Callable[[Tensor], Tensor]] = {
    "scaled": lambda t: 1.2 * t,
    "rescaled by a tenth": lambda t: 1.1 * t,  # inside the fixed ±15% the check had until 2026-12-06
    "flipped": lambda t: -t,
    "noise": lambda t: torch.randn(t.shape, generator=torch.Generator().manual_seed(7)) * t.std(),
    "stale": lambda t: t.roll(1, dims=0),  # another micro-batch's rows
}


@pytest.mark.parametrize(("stage", "num_stages"), [(0, 2), (1, 2), (1, 3)])
@pytest.mark.parametrize("lie", sorted(SENT_LIES))
def test_what_a_replica_sends_on_is_held_to_what_its_step_computes(
    tmp_path: Path, stage: int, num_stages: int, lie: str
) -> None:
    """A replica that trains honestly but sends on something else than its step computed (and
    records what it sent, so its log and the header it signed agree) fails the segment that step
    is in, and the material proves it alone: the replay holds each payload it sent to the step's
    output (stage < S − 1) or input gradient (stage > 0) within SENT_TOLERANCE, which is relative
    to what the codec does to the replayed tensor (bench/RESULTS.md, "What each step sent on, held
    to the codec's own rounding")."""
    run = train_round(
        tmp_path, stage=stage, num_stages=num_stages, sends=lambda i, t: SENT_LIES[lie](t) if i == 5 else t
    )
    assert check(run, 0).ok
    verdict = check(run, 1)  # step 5's segment
    assert not verdict.ok and verdict.replayed and "step 5: the " in verdict.reason, verdict.reason
    assert "it sent are not what its step computes" in verdict.reason
    kw = dict(model=MODEL, diloco=DILOCO, num_stages=num_stages, read_batch=read_batch, spans=run.spans)
    proof = SegmentFraudProof(run.material(1))
    assert judge_fraud_proof(proof, tolerance=calibrated_tolerance(K), **kw).proves


def test_a_middle_stage_s_failed_steps_are_listed_and_replayed(tmp_path: Path) -> None:
    """A middle stage's micro-batch whose every attempt downstream failed changed no weights, but
    the activations it offered were signed for the replicas it tried: the log lists it as a
    failed step (what it ran on, what it offered, after which step), the store keeps its bytes,
    and the segment it ran in replays its forward and holds the offer to it as it holds a step's.
    An honest one passes; a replica that offered something else than its forward computed fails
    that segment, and the material proves it alone."""
    honest = train_round(tmp_path / "honest", stage=1, num_stages=3, fails={1: lambda t: t, 5: lambda t: t})
    material = honest.material(1)
    log = material.log
    assert log.failed is not None and [f.after for f in log.failed] == [1, 5]
    assert [n for n, _, _ in material.failed] == log.failures_in(1) == [1]
    assert log.failures_in(0) == [0] and len(honest.material(0).failed) == 1
    assert check(honest, 0).ok and check(honest, 1).ok
    headers = {(h.micro_batch, h.payload_sha256) for h in log.headers or ()}
    assert {(f.micro_batch, f.sent.payload_sha256) for f in log.failed} <= headers
    for lie in ("scaled", "noise", "stale"):
        liar = train_round(tmp_path / lie, stage=1, num_stages=3, fails={5: SENT_LIES[lie]})
        assert check(liar, 0).ok
        verdict = check(liar, 1)
        assert not verdict.ok and verdict.replayed, (lie, verdict.reason)
        assert "failed step 0: the activations it offered are not what its forward computes" in verdict.reason
        kw = dict(model=MODEL, diloco=DILOCO, num_stages=3, read_batch=read_batch, spans=liar.spans)
        assert judge_fraud_proof(
            SegmentFraudProof(liar.material(1)), tolerance=calibrated_tolerance(K), **kw
        ).proves
    # Served without the failed step's bytes, or with other ones: the material is not the log's.
    other = dataclasses.replace(material, failed=())
    assert (
        "the failed steps served are not the ones the segment replays"
        in check_segment(honest.claim(), other, SEGMENT_TOLERANCE).reason
    )
    n, messages, body = material.failed[0]
    swapped = dataclasses.replace(material, failed=((n, messages, body[:-1] + bytes([body[-1] ^ 1])),))
    assert (
        "are not the ones its record names"
        in check_segment(honest.claim(), swapped, SEGMENT_TOLERANCE).reason
    )
    # A last stage forwards nothing, so lists no failed step.
    claim = dataclasses.replace(honest.claim(), num_stages=2, stage=1)
    assert "never has" in " ".join(commitment_problems(material, claim))


def test_failed_steps_on_a_segment_boundary_and_in_a_row_replay_in_the_order_they_ran(
    tmp_path: Path,
) -> None:
    """A failed step before the first step of a segment ran at the segment's start checkpoint (its
    `after` is the boundary), and several before one step ran one after another at the same
    weights: each is replayed in its place, and a lie in the last of a row is the one named."""
    same: Callable[[Tensor], Tensor] = lambda t: t  # noqa: E731
    honest = train_round(tmp_path / "honest", stage=1, num_stages=3, fails={K: same, K + 2: (same, same)})
    log = honest.material(1).log
    assert log.failed is not None and [f.after for f in log.failed] == [K, K + 2, K + 2]
    assert log.failures_in(0) == [] and log.failures_in(1) == [0, 1, 2]
    assert check(honest, 0).ok and check(honest, 1).ok
    liar = train_round(
        tmp_path / "liar", stage=1, num_stages=3, fails={K: same, K + 2: (same, SENT_LIES["scaled"])}
    )
    verdict = check(liar, 1)
    assert not verdict.ok and verdict.replayed, verdict.reason
    assert "failed step 2: the activations it offered are not what its forward computes" in verdict.reason


def test_a_log_that_carries_a_crashed_run_s_offers_passes_without_credit(tmp_path: Path) -> None:
    """Offers a crashed run of the round signed are carried into the redone round's log without
    their input (listed, not replayed): its segments still replay and pass, but the pass earns no
    credit (verifier.replaycheck records no verdict), so claiming a crash buys no more than
    recording no log."""
    run = train_round(tmp_path, stage=1, num_stages=3, crashed_offers=2)
    assert run.material(0).log.carries
    network = _run_network(num_stages=3)
    last = H // K - 1
    pieces = {0: run.material(0), last: run.material(last)}
    receipt = m.Receipt(
        wallet_id=REPLICA.wallet_id, stage=1, round=ROUND, segment_root=run.root, segments=H // K,
        data_spans=[], base_hash=run.base_hash, delta_digest=run.delta_digest,
    )  # fmt: skip
    judged = judge_segments(network, receipt, pieces, tolerance_for("cpu", "fp32", ReplayCheckConfig()), None)
    assert judged.ok and not judged.credit, judged.detail
    assert "carries offers of a crashed run" in judged.detail
    clean = train_round(tmp_path / "clean", stage=1, num_stages=3)
    assert not clean.material(0).log.carries


def test_a_middle_stage_is_held_to_its_steps_and_failed_steps_on_a_micro_batch() -> None:
    """A middle stage that sends one replica of the next stage garbage, ignores its answer and
    records its step against another replica contradicts its own log: what it signs for a
    micro-batch is held to its steps and failed steps on it, whoever the header went to (each job
    encodes its output once). A failed step that names the offer is an honest log (and is replayed
    by a segment check); a log from before failed steps were listed is not held to this."""
    me, elsewhere = REPLICA.public_key_hex, NEXT.public_key_hex
    consumed = [activations(i, stage=2)[0] for i in range(H)]  # signed by PREV, a stage-1 replica
    mbs = [ActivationHeader.from_json(m.header).micro_batch for m in consumed]
    given = ReceivedRef(
        kind="activations", sender="aa" * 32, header_sha256="cd" * 32, payload_sha256="ef" * 32
    )

    def answer(by: str) -> ReceivedRef:
        return ReceivedRef(kind="gradient", sender=by, header_sha256="cd" * 32, payload_sha256="ef" * 32)

    def step(i: int, payload: str, by: str = me) -> StepRecord:
        return StepRecord(
            micro_batch=mbs[i], received=[given, answer(by)],
            sent=[SentRef(kind="activations", payload_sha256=payload), SentRef(kind="gradient", payload_sha256="12" * 32)],
        )  # fmt: skip

    def offer(i: int, to: str, payload: str) -> SignedHeader:
        return SignedHeader(kind="activations", micro_batch=mbs[i], to=to, payload_sha256=payload)

    def signed(
        steps: list[StepRecord], listed: set[SignedHeader], failed: tuple[FailedStep, ...] | None = ()
    ) -> SignedSegmentLog:
        log = SegmentLog(stage=1, round=ROUND, segment_steps=K, start_step=ROUND * H, steps=tuple(steps),
                         checkpoints=tuple("ab" * 32 for _ in segment_boundaries(len(steps), K)),
                         headers=tuple(sorted(listed)), failed=failed)  # fmt: skip
        return SignedSegmentLog(
            log, SegmentCommitment.create(PREV, stage=1, round=ROUND, root=log.root(), network=RUN)
        )

    real = [sha256_hex(m.body) for m in consumed]
    steps = [step(i, real[i]) for i in range(H)]
    listed = {offer(i, me, real[i]) for i in range(H)}
    assert sent_contradictions(signed(steps, listed), consumed, me) == []
    # Garbage to this replica for micro-batch 3, its answer ignored, the step recorded with another.
    steps[3] = step(3, "1" * 64, elsewhere)
    listed.add(offer(3, elsewhere, "1" * 64))
    lying = signed(steps, listed)
    (problem,) = sent_contradictions(lying, consumed, me)
    assert f"micro-batch {mbs[3]}" in problem and "its steps on it record sending 1111" in problem
    proof = SenderFraudProof(lying, Received(consumed[3].kind, consumed[3].sender, consumed[3].header, b""))
    assert judge_sender_proof(proof, num_stages=3, network=RUN).proves
    # The same offer as a failed step (every attempt failed, the micro-batch retried and stepped
    # with the other replica): listed, so no contradiction here; its segment check replays it.
    failed = (
        FailedStep(
            after=3,
            micro_batch=mbs[3],
            received=(given,),
            sent=SentRef(kind="activations", payload_sha256=real[3]),
        ),
    )
    assert sent_contradictions(signed(steps, listed, failed), consumed, me) == []
    # No step and no failed step on a micro-batch it signed for: a contradiction too.
    steps[5] = step(7, real[7])
    (none,) = sent_contradictions(signed(steps, listed, failed), consumed[5:6], me)
    assert "whose log has no step on it" in none
    # A log from before failed steps were listed is held as before: to the exchange with this replica.
    assert sent_contradictions(signed(steps, listed, None), consumed[3:4], me) == []


def _boundary_tensor(seed: int, gradient: bool) -> Tensor:
    """A (4, 64, 128) hidden state with outlier channels, or a gradient-sized tensor."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 64, 128, generator=g)
    if gradient:
        return x * 1e-4
    x[..., :3] *= 20.0
    return x


@pytest.mark.parametrize("codec_name", sorted(CODECS))
@pytest.mark.parametrize("gradient", [False, True])
def test_a_payload_is_held_to_its_codec_s_own_rounding(codec_name: str, gradient: bool) -> None:
    """compare_sent: an honest payload (the codec applied to the sender's tensor, 0.4% from the
    replay's as bf16 autocast leaves it) passes; one rescaled by 10% fails under every codec and
    by 2% under the near-lossless ones, which the fixed ±15% this replaced let through; a payload
    from another tensor, or coded with a coarser code than the run's, fails."""
    fmt = CODECS[codec_name].backward if gradient else CODECS[codec_name].forward
    for seed in range(3):
        replayed = _boundary_tensor(seed, gradient)
        noise = torch.randn(replayed.shape, generator=torch.Generator().manual_seed(99 + seed))
        sender = replayed + 0.004 * replayed.norm() / replayed.numel() ** 0.5 * noise
        assert compare_sent(round_trip(sender, fmt), replayed, fmt).ok, (
            seed,
            compare_sent(round_trip(sender, fmt), replayed, fmt),
        )
        assert not compare_sent(round_trip(1.1 * sender, fmt), replayed, fmt).ok
        if fmt.bits >= 8:
            assert not compare_sent(round_trip(1.02 * sender, fmt), replayed, fmt).ok
        other = _boundary_tensor(seed + 10, gradient)
        assert not compare_sent(round_trip(other, fmt), replayed, fmt).ok
        coarser = FORMATS["m2"]
        assert not compare_sent(round_trip(sender, coarser), replayed, fmt).ok
        assert not compare_sent(torch.zeros_like(replayed), replayed, fmt).ok
        assert not compare_sent(round_trip(sender, fmt)[:, :-1], replayed, fmt).ok


def test_the_sent_check_s_edges_from_a_review() -> None:
    """compare_sent at its edges (helper-57's review): never looser than the fixed limits it replaced
    (one 64-value group under a 3-bit code rescaled by 30% passed the codec-relative limits alone);
    an honest payload of values below the codec's smallest step (coded as zeros) passes; a replay the
    codec cannot code gets the fixed limits' verdict instead of an exception, and a non-finite one a
    refusal; a sender whose precision scales its tensor by 0.6% passes under the near-lossless codecs."""
    h3 = CODECS["hadamard43"].backward
    group = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(3))
    assert compare_sent(round_trip(group, h3), group, h3).ok
    lie = compare_sent(round_trip(1.3 * group, h3), group, h3)
    assert not lie.ok and "fixed limits" in lie.reason, lie.reason

    tiny = torch.full((1, 2, 64), 1e-44)  # below bf16 scales' smallest step: int8 codes it as zeros
    int8 = CODECS["int8"].forward
    assert not bool(round_trip(tiny, int8).any())
    assert compare_sent(torch.zeros_like(tiny), tiny, int8).ok

    fp16 = CODECS["fp16"].forward
    big = torch.full((1, 2, 64), 1e6)  # beyond fp16's range: the codec refuses to code it
    assert compare_sent(big, big, fp16).ok and not compare_sent(2 * big, big, fp16).ok
    bad = big.clone()
    bad[0, 0, 0] = float("nan")
    assert not compare_sent(big, bad, fp16).ok

    r = _boundary_tensor(0, gradient=False)
    for name in ("bf16", "int8"):
        fmt = CODECS[name].forward
        assert compare_sent(round_trip(1.006 * r, fmt), r, fmt).ok
        assert not compare_sent(round_trip(1.02 * r, fmt), r, fmt).ok


def test_a_gradient_sent_back_but_left_out_of_the_log_fails_the_check(tmp_path: Path) -> None:
    """A later stage's node records every gradient it answers with before it answers (node.
    stage_worker); a step whose record names none kept what it sent back out of the replay's
    comparison and out of sender matching, and fails on the material alone."""
    run = train_round(tmp_path, stage=1, num_stages=3, unrecorded=5)
    assert check(run, 0).ok
    verdict = check(run, 1)
    assert not verdict.ok and not verdict.replayed
    assert "step 5: its record names no gradient sent back" in verdict.reason


def test_a_pipeline_step_that_names_no_micro_batch_fails_the_check(tmp_path: Path) -> None:
    """Every step of a pipeline is on a micro-batch with an id; one recorded under none would keep
    what it sent back out of sender matching and out of disputes, and fails on the material alone."""
    run = train_round(tmp_path, stage=1, num_stages=2, unnamed=5)
    assert check(run, 0).ok
    verdict = check(run, 1)
    assert not verdict.ok and not verdict.replayed
    assert "step 5: a pipeline step names no micro-batch" in verdict.reason, verdict.reason


def test_a_payload_sent_but_not_served_fails_the_check(tmp_path: Path) -> None:
    """The log names what each step sent; a replica that keeps or serves none of it (so nothing it
    sent can be held to its step) fails on the material alone."""
    run = train_round(tmp_path, stage=1, num_stages=2)
    for path in (tmp_path / "segments").rglob("sent-00000005-*.bin"):
        path.unlink()
    assert check(run, 0).ok
    verdict = check(run, 1)
    assert not verdict.ok and not verdict.replayed
    assert "step 5: the payloads served as sent are not the ones its record names" in verdict.reason


def test_made_up_activations_are_refused_at_a_later_stage(tmp_path: Path) -> None:
    """A stage-1 replica records a micro-batch under a header it signed itself, naming the previous
    stage as sender: nobody sent it that, and the sender's signature says so."""

    def forge(i: int, m: Received) -> Received:
        if i != 5:
            return m
        header = ActivationHeader.from_json(m.header)
        forged = ActivationHeader.create(REPLICA, **{
            f.name: getattr(header, f.name) for f in dataclasses.fields(header) if f.name not in ("wallet", "signature")
        })  # fmt: skip
        return Received(m.kind, PREV.public_key_hex, forged.to_json(), m.body)

    run = train_round(tmp_path, stage=1, num_stages=2, recorded=forge)
    assert check(run, 0).ok
    verdict = check(run, 1)
    assert not verdict.ok and "not signed by its named sender" in verdict.reason


def test_activations_sent_to_another_replica_are_refused(tmp_path: Path) -> None:
    """A stage-1 replica records a micro-batch the previous stage really signed, but for another
    replica (another exchange): what it consumed was not sent to it."""

    def elsewhere(i: int, m: Received) -> Received:
        if i != 5:
            return m
        header = ActivationHeader.from_json(m.header)
        fields = {f.name: getattr(header, f.name) for f in dataclasses.fields(header)}
        fields["to"] = NEXT.public_key_hex
        del fields["wallet"], fields["signature"]
        return Received(m.kind, m.sender, ActivationHeader.create(PREV, **fields).to_json(), m.body)

    run = train_round(tmp_path, stage=1, num_stages=2, recorded=elsewhere)
    assert check(run, 0).ok
    verdict = check(run, 1)
    assert not verdict.ok and "activations header is addressed to another replica" in verdict.reason

    def own(i: int, m: Received) -> Received:  # inputs it made up and signed itself
        if i != 5:
            return m
        header = ActivationHeader.from_json(m.header)
        fields = {f.name: getattr(header, f.name) for f in dataclasses.fields(header)}
        del fields["wallet"], fields["signature"]
        return Received(
            m.kind, REPLICA.public_key_hex, ActivationHeader.create(REPLICA, **fields).to_json(), m.body
        )

    verdict = check(train_round(tmp_path / "own", stage=1, num_stages=2, recorded=own), 1)
    assert not verdict.ok and "activations header is signed by this replica itself" in verdict.reason


def test_inputs_that_disagree_with_the_senders_record_are_refused(tmp_path: Path) -> None:
    """The replica trained on other activations than the previous stage sent and records those:
    its record commits to a payload the sender's signed header does not name."""

    def swap(i: int, m: Received) -> Received:
        if i != 2:
            return m
        other, _ = activations(40, stage=1)
        return Received(m.kind, m.sender, m.header, other.body)

    run = train_round(tmp_path, stage=1, num_stages=2, recorded=swap)
    verdict = check(run, 0)
    assert not verdict.ok and "payload differs from what its sender signed" in verdict.reason
    assert check(run, 1).ok


def test_material_served_for_another_wallet_or_root_is_refused(tmp_path: Path) -> None:
    run = train_round(tmp_path, stage=1, num_stages=2)
    tolerance = tolerance_for("cpu", "fp32", ReplayCheckConfig())
    claim = dataclasses.replace(run.claim(), wallet=PREV.public_key_hex)
    assert "not signed by the receipt's wallet" in check_segment(claim, run.material(0), tolerance).reason
    claim = dataclasses.replace(run.claim(), root="0" * 64)
    assert "root differs" in check_segment(claim, run.material(0), tolerance).reason


def test_the_receipts_theta_and_delta_must_be_the_chains_ends(tmp_path: Path) -> None:
    """A replica whose chain is honest but whose receipt commits another Δ (what it sent the round),
    or another θ_round, is refused on the segments that touch them."""
    run = train_round(tmp_path, stage=1, num_stages=2)
    other_delta = dataclasses.replace(run, delta_digest="ab" * 32)
    assert check(other_delta, 0).ok  # the first segment does not reach the round's end
    verdict = check(other_delta, H // K - 1)
    assert not verdict.ok and "receipt's Δ is not θ_round minus" in verdict.reason
    other_base = dataclasses.replace(run, base_hash="cd" * 32)
    assert "not the receipt's base_hash" in check(other_base, 1).reason
    material = run.material(0)
    shifted = dataclasses.replace(material, theta_round=material.theta_round + 1e-3)
    tolerance = tolerance_for("cpu", "fp32", ReplayCheckConfig())
    claim = dataclasses.replace(run.claim(), base_hash=tensor_digest(shifted.theta_round))
    assert "segment 0 does not start from θ_round" in check_segment(claim, shifted, tolerance).reason


def test_one_gradient_reply_used_for_two_steps_is_refused(tmp_path: Path) -> None:
    """A driver that trains step 1 on the reply it got for step 0 (and records it so, consistently,
    under a log it signs): the reply is genuine, but one micro-batch cannot be two steps."""
    run = train_round(tmp_path, stage=0, num_stages=2)
    material = run.material(0)
    steps = list(material.log.steps)
    steps[1] = dataclasses.replace(steps[0], data=steps[1].data)
    log = dataclasses.replace(material.log, steps=tuple(steps))
    commitment = SegmentCommitment.create(
        REPLICA, stage=0, round=ROUND, root=log.root(), network=material.commitment.network
    )
    received = (material.received[0], material.received[0], *material.received[2:])
    reused = dataclasses.replace(material, log=log, commitment=commitment, received=received)
    claim = dataclasses.replace(run.claim(), root=log.root())
    verdict = check_segment(
        claim, reused, tolerance_for("cpu", "fp32", ReplayCheckConfig()), read_batch=read_batch
    )
    assert not verdict.ok and verdict.reason.startswith("the log names one exchange for two steps"), verdict


def sent_contradictions(sender: SignedSegmentLog, messages: list[Received], receiver: str) -> list[str]:
    """`contradicting`'s findings, as text."""
    return [text for _, text in contradicting(sender, messages, receiver)]


def test_a_sender_whose_log_contradicts_the_headers_it_signed_is_caught(tmp_path: Path) -> None:
    """Stage 1 holds what the driver sent it under the driver's signed headers; every activations
    header a sender signs is listed in the log of the round it names, so a driver whose signed log
    lists other bytes for that exchange, or none (it named a round it did other work in), or
    whose step with stage 1 records sending other bytes, contradicts itself, whatever stage 1 says. Only the sender's signatures count: a log it did not
    sign, or not the one its receipt committed to, is held against nobody."""
    stage1 = train_round(tmp_path / "s1", stage=1, num_stages=2)
    consumed = [m for j in range(H // K) for step in stage1.material(j).received for m in step]
    assert {sender_round(m) for m in consumed} == {(0, ROUND)}
    me = REPLICA.public_key_hex

    def micro_batch(m: Received) -> str:
        return ActivationHeader.from_json(m.header).micro_batch

    def step(m: Received, payload: str, answered_by: str = me) -> StepRecord:
        answer = ReceivedRef(
            kind="gradient", sender=answered_by, header_sha256="cd" * 32, payload_sha256="ef" * 32
        )
        return StepRecord(
            micro_batch=micro_batch(m),
            received=[answer],
            sent=[SentRef(kind="activations", payload_sha256=payload)],
        )

    def offer(mb: str, to: str, payload: str) -> SignedHeader:
        return SignedHeader(kind="activations", micro_batch=mb, to=to, payload_sha256=payload)

    def offers(steps: list[StepRecord]) -> set[SignedHeader]:
        """What an honest sender signs in these steps: each to the replica that answered it."""
        return {offer(s.micro_batch, s.received[0].sender, s.sent[0].payload_sha256) for s in steps if s.sent}

    sender_steps = [step(m, sha256_hex(m.body)) for m in consumed]

    def signed(
        steps: list[StepRecord],
        by: Wallet = PREV,
        run: str | None = RUN,
        offered: set[SignedHeader] | None = None,
    ) -> SignedSegmentLog:
        listed = tuple(sorted(offers(steps) if offered is None else offered))
        log = SegmentLog(stage=0, round=ROUND, segment_steps=K, start_step=ROUND * H, steps=tuple(steps),
                         checkpoints=tuple("ab" * 32 for _ in segment_boundaries(len(steps), K)),
                         headers=listed)  # fmt: skip
        commitment = SegmentCommitment.create(by, stage=0, round=ROUND, root=log.root(), network=run)
        return SignedSegmentLog(log, commitment)

    honest = signed(sender_steps)
    root = honest.log.root()
    assert signed_log_problem(honest, PREV.public_key_hex, 0, ROUND, root) is None
    assert sent_contradictions(honest, consumed, me) == []
    assert SignedSegmentLog.decode(honest.encode()) == honest  # as GET /p2p/segment-log carries it
    sender_steps[3] = step(consumed[3], "0" * 64)
    lying = signed(sender_steps)
    assert signed_log_problem(lying, PREV.public_key_hex, 0, ROUND, lying.log.root()) is None
    (problem,) = sent_contradictions(lying, consumed, me)
    assert f"micro-batch {sender_steps[3].micro_batch}" in problem and "does not list that header" in problem
    # Listed, but its step with this replica records sending other bytes: a contradiction as well.
    listed_too = offers(sender_steps) | {offer(sender_steps[3].micro_batch, me, sha256_hex(consumed[3].body))}
    (stepped,) = sent_contradictions(signed(sender_steps, offered=listed_too), consumed, me)
    assert "record sending 0000" in stepped
    # the receipt committed to the honest chain: a lying log served later is not its commitment
    assert "receipt committed" in (signed_log_problem(lying, PREV.public_key_hex, 0, ROUND, root) or "")
    forged = signed(sender_steps, by=NEXT)  # signed by someone else
    assert "not signed by it" in (signed_log_problem(forged, PREV.public_key_hex, 0, ROUND, root) or "")
    assert sent_contradictions(forged, consumed, me) == []  # NEXT signed none of these headers
    assert "round" in (signed_log_problem(lying, PREV.public_key_hex, 0, ROUND + 1, lying.log.root()) or "")
    # A retry elsewhere after this replica took the micro-batch and its answer was lost: the step
    # records the other exchange, the offers both. An honest log; one that leaves the first offer
    # out (as a log of completed exchanges would) no longer makes the header no claim.
    real3 = sha256_hex(consumed[3].body)  # a driver sends every attempt of a micro-batch the same bytes
    retried = [*sender_steps[:3], step(consumed[3], real3, NEXT.public_key_hex), *sender_steps[4:]]
    both = offers(retried) | {offer(micro_batch(consumed[3]), me, "0" * 64)}
    assert sent_contradictions(signed(retried, offered=both), consumed[3:4], me) != []  # other bytes
    both.add(offer(micro_batch(consumed[3]), me, sha256_hex(consumed[3].body)))
    assert sent_contradictions(signed(retried, offered=both), consumed, me) == []
    (lost,) = sent_contradictions(signed(retried), consumed, me)
    assert "does not list that header" in lost
    # A driver that sent this replica other bytes in an attempt whose answer it then ignored, and
    # records its step against another replica: listed, but not what its step on the id sent.
    garbage = offers(retried) | {offer(micro_batch(consumed[3]), me, real3)}
    forged_step = [*retried[:3], step(consumed[3], "2" * 64, NEXT.public_key_hex), *retried[4:]]
    (ignored,) = sent_contradictions(signed(forged_step, offered=garbage | offers(forged_step)), consumed, me)
    assert "its steps on it record sending 2222" in ignored
    # A log from before logs listed their headers (an old fraud proof's) is held to its steps only.
    unlisted = dataclasses.replace(signed(retried).log, headers=None)
    old = SignedSegmentLog(
        unlisted, SegmentCommitment.create(PREV, stage=0, round=ROUND, root=unlisted.root(), network=RUN)
    )
    assert sent_contradictions(old, consumed, me) == []
    # A header naming a round the sender did report, but whose log lists nothing sent to this
    # replica (its steps there went elsewhere): each header contradicts that log.
    elsewhere = [step(m, sha256_hex(m.body), NEXT.public_key_hex) for m in consumed]
    assert len(sent_contradictions(signed(elsewhere), consumed, me)) == len(consumed)

    # The contradiction as a proof anyone can check alone: both statements are the sender's.
    bare = Received(consumed[3].kind, consumed[3].sender, consumed[3].header, b"")
    proof = SenderFraudProof(lying, bare)
    assert proof.receiver == me  # named by the header PREV signed, not by whoever shows it
    data = proof.encode()
    assert data.startswith(SENDER_PROOF_MAGIC) and SenderFraudProof.decode(data) == proof
    assert (proof.step(), proof.segment()) == (3, 3 // K)
    verdict = judge_sender_proof(SenderFraudProof.decode(data), num_stages=2, network=RUN)
    assert verdict.proves and "does not list that header" in verdict.reason, verdict
    # One wallet trains several runs, whose rounds and micro-batch ids repeat: a log of another run,
    # or one that names none, makes no claim on this run's headers; a definition of another run
    # judges no proof of this one.
    for run in ("6f" * 32, None):
        assert sent_contradictions(signed(sender_steps, run=run), consumed, me) == []
        assert not judge_sender_proof(SenderFraudProof(signed(sender_steps, run=run), bare)).proves
    other_run = judge_sender_proof(proof, num_stages=2, network="6f" * 32)
    assert not other_run.proves and "not of this run" in other_run.reason
    assert not judge_sender_proof(proof, num_stages=1).proves  # no stage 0 sender in a 1-stage run
    for other, why in (
        (SenderFraudProof(honest, bare), "does not contradict"),
        (SenderFraudProof(forged, bare), "not contradict"),  # NEXT's log, PREV's header
    ):
        verdict = judge_sender_proof(other)
        assert not verdict.proves and why in verdict.reason, verdict
    tampered = SignedSegmentLog(honest.log, lying.commitment)  # the honest chain under the lie's signature
    assert "root" in judge_sender_proof(SenderFraudProof(tampered, bare)).reason

    # One id sent to two replicas (a retry elsewhere): the log lists both headers, each with its own
    # bytes. A header PREV signed for one exchange cannot be held against its record of the other,
    # and any header it signed that its log does not list is a proof.
    header3 = ActivationHeader.from_json(consumed[3].header)

    def readdressed(to: Wallet, payload: str) -> Received:
        fields = {f.name: getattr(header3, f.name) for f in dataclasses.fields(header3)}
        fields.update(to=to.public_key_hex, payload_sha256=payload)
        del fields["wallet"], fields["signature"]
        return Received(
            "activations", PREV.public_key_hex, ActivationHeader.create(PREV, **fields).to_json(), b""
        )

    twice = list(honest.log.steps)
    twice.insert(4, step(consumed[3], "1" * 64, NEXT.public_key_hex))
    to_both = signed(twice)
    for message, proves in (
        (bare, False),  # to me, the bytes its header to me lists
        (readdressed(NEXT, "1" * 64), False),  # to NEXT, the bytes its header to NEXT lists
        (readdressed(NEXT, sha256_hex(consumed[3].body)), True),  # to NEXT, but the bytes it sent me
        (readdressed(PREV, "1" * 64), True),  # to a replica its log lists no header to
    ):
        assert judge_sender_proof(SenderFraudProof(to_both, message)).proves is proves, message.header
    # A driver's header for a micro-batch none of its steps trained, even listed, is a proof: a
    # driver names micro-batches after its own steps.
    fields = {f.name: getattr(header3, f.name) for f in dataclasses.fields(header3)}
    fields.update(micro_batch="ab" * 16)
    del fields["wallet"], fields["signature"]
    stray = Received(
        "activations", PREV.public_key_hex, ActivationHeader.create(PREV, **fields).to_json(), b""
    )
    with_stray = signed(
        list(honest.log.steps),
        offered=offers(list(honest.log.steps)) | {offer("ab" * 16, me, header3.payload_sha256)},
    )
    verdict = judge_sender_proof(SenderFraudProof(with_stray, stray))
    assert verdict.proves and "whose log has no step on it" in verdict.reason, verdict

    # One proof, one encoding: anything else is refused, not listed under another sha256.
    obj = json.loads(data[len(SENDER_PROOF_MAGIC) :])
    respaced = {**obj, "header": json.dumps(json.loads(obj["header"]), indent=1)}
    with_end = {**obj, "log": {**obj["log"], "end": {}}}
    extra = {**obj, "receiver": me}
    for bad in (
        b"not a proof",
        SENDER_PROOF_MAGIC + b"{}",
        SENDER_PROOF_MAGIC + json.dumps(respaced).encode(),
        SENDER_PROOF_MAGIC + json.dumps(with_end).encode(),
        SENDER_PROOF_MAGIC + json.dumps(extra).encode(),
        SENDER_PROOF_MAGIC + json.dumps({**obj, "header": "\ud800"}).encode(),
        data + b" ",
    ):
        with pytest.raises(Refused):
            SenderFraudProof.decode(bad)


def test_fp16_step_counts_may_fall_short_but_must_agree(tmp_path: Path) -> None:
    """An fp16 replica's GradScaler skips the optimizer step of an overflowing micro-batch: its step
    counts may fall short of the segment's steps, uniformly; for other precisions they must match."""
    run = train_round(tmp_path, stage=1, num_stages=2, tamper=_skip_half(False))
    material, tolerance = run.material(1), tolerance_for("cpu", "fp16", ReplayCheckConfig())
    fp16 = dataclasses.replace(run.claim(), trained_precision="fp16")
    verdict = check_segment(fp16, material, tolerance)
    assert "optimizer counted" not in verdict.reason and not verdict.ok  # the replay still refuses it
    assert "optimizer counted" in check_segment(run.claim(), material, tolerance).reason

    def uneven(i: int, diloco: DiLoCo) -> bool:  # one parameter's count runs ahead of the others'
        if i // K == 1:
            state = diloco.inner_optimizer.state[diloco.params[0]]
            state["step"] += 1
        return False

    skewed = train_round(tmp_path / "uneven", stage=1, num_stages=2, tamper=uneven)
    claim = dataclasses.replace(skewed.claim(), trained_precision="fp16")
    assert "optimizer counted" in check_segment(claim, skewed.material(1), tolerance).reason


# --- neuroshard-check-proof on real material ---------------------------------------------------

OPERATOR = Wallet.from_token("segment-operator")


def _run_network(**changes: Any) -> NetworkDefinition:
    """The run these tests train (MODEL, DILOCO, 2 stages, k = K), with `changes`."""
    return dataclasses.replace(
        small_network(training={"batch_size": B, "seq_len": T}),
        **{"model": MODEL, "diloco": DILOCO, "num_stages": 2, "segment_steps": K, **changes},
    )


def _definition(tmp_path: Path, **changes: Any) -> Path:
    """`_run_network(**changes)` as GET /api/network's body."""
    network = _run_network(**changes)
    path = tmp_path / "network.json"
    path.write_bytes(network.canonical_bytes())
    return path


def _cli(
    tmp_path: Path, material: SegmentMaterial, capsys: pytest.CaptureFixture[str], *flags: str, **net: Any
) -> tuple[int, str]:
    proof = tmp_path / "p.proof"
    proof.write_bytes(SegmentFraudProof(material).encode())
    try:
        code = check_proof.main([str(proof), "--network", str(_definition(tmp_path, **net)), *flags])
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, (out.out + out.err).strip()


def _one_short(i: int, diloco: DiLoCo) -> None:
    """After the round's last step, every optimizer step count one short: an fp16 replica whose
    GradScaler skipped a step, as far as the counts show (the weights replay exactly)."""
    if i == H - 1:
        for state in diloco.inner_optimizer.state.values():
            state["step"] -= 1


def test_the_cli_defaults_hold_step_counts_to_the_loosest_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = train_round(tmp_path, stage=1, num_stages=2, after_step=_one_short)
    material = run.material(1)
    counts = material.end.inner.steps - material.start.inner.steps
    assert counts.tolist() == [K - 1] * counts.numel()
    code, out = _cli(tmp_path, material, capsys)
    assert code == 1 and out.startswith("does not prove fraud: the replay agrees"), out
    code, out = _cli(tmp_path, material, capsys, "--device", "cpu", "--precision", "fp16")
    assert code == 1, out
    code, out = _cli(tmp_path, material, capsys, "--device", "cpu", "--precision", "fp32")
    assert code == 0 and "optimizer counted" in out, out  # the listing said fp32: counts must match


def test_honest_material_does_not_prove_fraud(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = train_round(tmp_path, stage=1, num_stages=2)
    code, out = _cli(tmp_path, run.material(0), capsys)
    assert code == 1 and out.startswith("does not prove fraud: the replay agrees"), out
    assert "[definition sha256 " in out and "not checked against an operator key" in out
    code, out = _cli(tmp_path, run.material(0), capsys, num_stages=1)
    assert code == 1 and out.startswith("does not prove fraud: the proof is for stage 1, the run has 1"), out


def _scaled_run(tmp_path: Path) -> Run:
    """A stage-1 replica that scaled its update ×1.25 in segment 1 (and committed to it)."""
    starts: dict[int, Tensor] = {}

    def scale(i: int, diloco: DiLoCo) -> None:
        if i == K:
            starts[1] = flat_parameters(diloco.params)
        if i == 2 * K - 1:
            copy_into_parameters(
                starts[1] + 1.25 * (flat_parameters(diloco.params) - starts[1]), diloco.params
            )

    return train_round(tmp_path, stage=1, num_stages=2, after_step=scale)


def test_a_proof_names_its_signer_and_the_checked_definition(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    material = _scaled_run(tmp_path).material(1)
    code, out = _cli(tmp_path, material, capsys)
    assert code == 0 and out.startswith(f"PROVES FRAUD: wallet {REPLICA.wallet_id} stage 1 round 0 segment 1")
    digest = hashlib.sha256(_definition(tmp_path).read_bytes()).hexdigest()
    assert f"[definition sha256 {digest}, " in out
    for who in (REPLICA.wallet_id, REPLICA.public_key_hex):
        assert _cli(tmp_path, material, capsys, "--wallet", who)[0] == 0
    code, out = _cli(tmp_path, material, capsys, "--wallet", PREV.wallet_id)
    assert code == 2 and f"signed by wallet {REPLICA.wallet_id}, not {PREV.wallet_id}" in out, out
    # The definition, checked as a joining node checks GET /api/network's body.
    signature = OPERATOR.sign(_definition(tmp_path).read_bytes()).hex()
    key = ["--operator-key", OPERATOR.public_key_hex]
    code, out = _cli(tmp_path, material, capsys, *key, "--signature", signature)
    assert code == 0 and f"signed by operator {OPERATOR.public_key_hex[:16]}" in out, out
    other = PREV.sign(_definition(tmp_path).read_bytes()).hex()
    code, out = _cli(tmp_path, material, capsys, *key, "--signature", other)
    assert code == 2 and "not signed by the operator key" in out, out
    code, out = _cli(tmp_path, material, capsys, *key, "--signature", signature, name="another run")
    assert code == 2 and "not signed by the operator key" in out, out  # a definition edited after signing


def test_a_commitment_naming_the_victim_without_its_signature_proves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An attacker re-signs a failing segment's commitment with its own key and names the victim's
    wallet in it: the replay still fails, but nothing ties the material to the victim."""
    material = _scaled_run(tmp_path).material(1)
    mallory = Wallet.from_token("segment-mallory")
    c = material.commitment
    forged = SegmentCommitment.create(mallory, stage=c.stage, round=c.round, root=c.root)
    forged = dataclasses.replace(forged, wallet=REPLICA.public_key_hex)
    framed = dataclasses.replace(material, commitment=forged)
    code, out = _cli(tmp_path, framed, capsys)
    assert code == 1 and "not signed by the receipt's wallet" in out, out
    kw = dict(model=MODEL, diloco=DILOCO, num_stages=2, read_batch=read_batch)
    assert not judge_fraud_proof(SegmentFraudProof(framed), tolerance=CALIBRATED_TOLERANCE, **kw).proves


def test_a_proof_is_bounded_before_it_is_loaded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    material = train_round(tmp_path, stage=1, num_stages=2).material(0)
    short_rounds = dataclasses.replace(DILOCO, inner_steps=H // 2)
    code, out = _cli(tmp_path, material, capsys, diloco=short_rounds)
    assert code == 2 and f"its log has {H} steps, a round has {H // 2}" in out, out
    proof, network = tmp_path / "big.proof", _definition(tmp_path)
    proof.write_bytes(SegmentFraudProof(material).encode())
    with proof.open("r+b") as f:
        f.truncate(4 << 30)  # sparse: past any stage-1 segment of K steps of this model
    code = check_proof.main([str(proof), "--network", str(network)])
    out = capsys.readouterr().err
    assert code == 2 and "more than a stage-1 segment of 4 steps can" in out, out


def test_an_unexpected_failure_to_read_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    material = train_round(tmp_path, stage=1, num_stages=2).material(0)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a decoder bug")

    monkeypatch.setattr(SegmentFraudProof, "decode", broken)
    code, out = _cli(tmp_path, material, capsys)
    assert (
        code == 2
        and out
        == f"{check_proof.PROG}: error: cannot read {tmp_path / 'p.proof'}: RuntimeError: a decoder bug"
    )


def test_every_check_holds_the_receipt_s_delta_to_the_last_segment_even_undrawn(tmp_path: Path) -> None:
    """The live checker fetches the round's last segment on every check and checks it against the
    commitments without replaying it: a Δ changed after the last step fails even when only segment 0
    is drawn for replay, and honest material passes the same way."""
    run = train_round(tmp_path, stage=1, num_stages=2)
    network = _run_network()  # the run train_round's commitments name
    last = H // K - 1
    pieces = {0: run.material(0), last: run.material(last)}
    tolerance = tolerance_for("cpu", "fp32", ReplayCheckConfig())

    def receipt(delta_digest: str) -> m.Receipt:
        return m.Receipt(
            wallet_id=REPLICA.wallet_id, stage=1, round=ROUND, segment_root=run.root, segments=H // K,
            data_spans=[], base_hash=run.base_hash, delta_digest=delta_digest,
        )  # fmt: skip

    honest = judge_segments(network, receipt(run.delta_digest), pieces, tolerance, None, replay=(0,))
    assert honest.ok, honest.detail
    assert f"segments [0] of {H // K} replayed" in honest.detail
    assert f"segment {last} checked against its commitments" in honest.detail
    lie = judge_segments(network, receipt("ab" * 32), pieces, tolerance, None, replay=(0,))
    assert not lie.ok and not lie.proofs
    assert (
        f"segment {last} of {H // K} (not replayed)" in lie.detail
        and "receipt's Δ is not θ_round" in lie.detail
    )
    assert Challenge(receipt("ab" * 32), "x", segments=(0, 1), last=last).wanted == (0, 1)
    other_k = dataclasses.replace(network, segment_steps=2 * K)  # a log cut at another k
    refused = judge_segments(other_k, receipt(run.delta_digest), pieces, tolerance, None, replay=(0,))
    assert not refused.ok and f"segments are of {K} steps" in refused.detail
    assert Challenge(receipt("ab" * 32), "x", segments=(0,), last=last).wanted == (0, last)


def test_a_receipt_must_commit_to_the_runs_number_of_segments() -> None:
    """A replica that picked its own k would pick the verifier's cost (one segment of H steps makes
    every check a whole-round replay): its receipt fails the check before anything is fetched. The
    H/10 of nodes that joined under a definition signed before the H/40 default still passes."""

    def receipt(segments: int | None, inner_steps: int = 100) -> m.Receipt:
        root = None if segments is None else "ab" * 32
        return m.Receipt(inner_steps=inner_steps, segment_root=root, segments=segments)

    network = small_network(diloco={"inner_steps": 100, "warmup_steps": 0, "total_steps": 1000})
    allowed = allowed_segment_steps(network)
    assert network.segment_k == 2 and allowed == (2, 10)
    assert segment_count_problem(receipt(50), allowed) is None  # 100 steps in segments of 2
    assert segment_count_problem(receipt(10), allowed) is None  # a node on the served H/10
    assert segment_count_problem(receipt(34), (3,)) is None  # the last segment is shorter
    assert segment_count_problem(receipt(None), allowed) is None  # no segment root: a whole-round replay
    problem = segment_count_problem(receipt(1), allowed)
    assert (
        problem is not None and "commits to 1 segments" in problem and "50 (k = 2) or 10 (k = 10)" in problem
    )
    assert segment_count_problem(receipt(12, inner_steps=24), (2,)) is None  # a short round


@dataclasses.dataclass
class Rounds:
    """Rounds 1–3 of one replica, recorded and stored; its moments doctored between rounds 2 and 3."""

    store: SegmentStore
    logs: dict[int, SegmentLog]
    bases: dict[int, str]
    fresh: str
    n_tensors: int
    lines: list[str]

    def signed(self, round_: int) -> SignedSegmentLog:
        """The round's log as GET /p2p/segment-log serves it: with its commitment and end opening."""
        held = self.store.log(round_)
        assert held is not None and held[1] is not None
        return SignedSegmentLog(held[0], held[1], self.store.end_opening(round_))

    def proof(self, round_: int, previous: SignedSegmentLog | None) -> ContinuityFraudProof:
        """What the verifier builds from a challenge on `round_`: its log, θ_round and the served
        start opening, and the log of the round before."""
        opening, start = self.store.start_opening(round_), self.store.load_checkpoint(round_, 0)
        assert opening is not None and start is not None
        bare = dataclasses.replace(self.signed(round_), end=None)
        return ContinuityFraudProof.of(bare, start.weights, opening.inner_sha256, previous)


ONE_STAGE = _run_network(num_stages=1)
"""The run `_rounds` trains, as a lone stage."""


def _rounds(tmp_path: Path, network: str | None = ONE_STAGE.digest(), data_seed: int = 0) -> Rounds:
    """A recorder resets the inner optimizer of a round that does not follow one it committed and
    keeps it across consecutive rounds; round 3's moments are changed between rounds, which the
    recorder cannot tell (its commitment holds what was trained from). Its commitments name the
    run `network` (a definition's digest); `data_seed` picks other batches (another run's)."""
    config = SegmentConfig(segment_steps=2)
    store = SegmentStore(tmp_path, config, log=lambda _: None)
    lines: list[str] = []
    recorder = SegmentRecorder(config, stage=0, sink=store, log=lines.append, network=network)
    torch.manual_seed(0)
    diloco = DiLoCo(build_stage(MODEL, 0, 1), DILOCO)
    numel, n_tensors = sum(p.numel() for p in diloco.params), len(diloco.params)
    logs: dict[int, SegmentLog] = {}
    bases: dict[int, str] = {}
    for _ in range(H):  # a round trained before this recorder saw it: moments not committed here
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(7))
        diloco.inner_step(tokens[:, :-1], tokens[:, 1:])
    diloco.outer_step(diloco.pseudo_gradient())
    for round_ in (1, 2, 3):
        if round_ == 3:  # moments doctored between rounds
            for state in diloco.inner_optimizer.state.values():
                state["exp_avg"].mul_(3.0)
        bases[round_] = tensor_digest(diloco.theta_round)
        recorder.start_round(diloco)
        for i in range(H):
            tokens = torch.randint(
                0, 64, (2, 9), generator=torch.Generator().manual_seed(1000 * data_seed + i)
            )
            diloco.inner_step(tokens[:, :-1], tokens[:, 1:])
            recorder.record_step(diloco, data=(0, 2 * i, 2 * i + 2))
        recorder.end_round(diloco)
        diloco.outer_step(diloco.pseudo_gradient())
        closed = recorder.close_round(REPLICA)
        assert closed is not None and closed[0].round == round_
        logs[round_] = closed[0]
    return Rounds(store, logs, bases, fresh_inner_digest(numel, n_tensors), n_tensors, lines)


def test_a_round_must_start_fresh_or_from_the_state_its_previous_round_ended_with(tmp_path: Path) -> None:
    """The recorder keeps the end opening of each round; `continuity_problem` passes a fresh start
    and a continued one, and catches moments doctored between rounds, a log of the round before that
    is not the committed one, and an end opening that does not open it."""
    run = _rounds(tmp_path)
    first, second, third = run.logs[1], run.logs[2], run.logs[3]
    base1, base2, base3, fresh, signed = run.bases[1], run.bases[2], run.bases[3], run.fresh, run.signed
    key = REPLICA.public_key_hex
    assert run.lines == ["segments: round 1 does not follow a round committed here; "
                         "its inner optimizer starts fresh"]  # fmt: skip
    assert first.checkpoints[0] == checkpoint_hash(base1, fresh)
    assert continuity_problem(first, base1, fresh, None, key, None) is None

    # round 2 follows round 1: its moments carry over
    assert second.checkpoints[0] != checkpoint_hash(base2, fresh)
    assert signed(1).end is not None and signed(1).end.sha256() == first.checkpoints[-1]  # type: ignore[union-attr]
    assert SignedSegmentLog.decode(signed(1).encode()) == signed(1)
    assert continuity_problem(second, base2, fresh, signed(1), key, first.root()) is None
    assert "no log of round 1" in (continuity_problem(second, base2, fresh, None, key, None) or "")

    problem = continuity_problem(third, base3, fresh, signed(2), key, second.root())
    assert problem is not None and "nor the one its round 2 ended with" in problem, problem

    # The log of the round before must be the committed one, signed by the replica, and opened.
    other = continuity_problem(third, base3, fresh, signed(2), key, first.root())
    assert other is not None and "cannot be held to it" in other
    stranger = continuity_problem(third, base3, fresh, signed(2), PREV.public_key_hex, second.root())
    assert stranger is not None and "not signed by it" in stranger
    wrong = dataclasses.replace(signed(2), end=signed(1).end)
    assert "does not open its last checkpoint" in (
        continuity_problem(third, base3, fresh, wrong, key, second.root()) or ""
    )
    stripped = dataclasses.replace(signed(2), end=None)  # a log served without its end opening
    assert "does not open its last checkpoint" in (
        continuity_problem(third, base3, fresh, stripped, key, second.root()) or ""
    )
    # Without a receipt for the round before, a log of it could be made up to fit: only fresh passes.
    assert "sent no receipt for round 2" in (
        continuity_problem(third, base3, fresh, signed(2), key, None) or ""
    )
    assert "first round starts fresh" in (
        continuity_problem(dataclasses.replace(third, round=0), base3, fresh, None, key, None) or ""
    )


def test_a_continuity_break_is_a_fraud_proof_that_checks_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The doctored round's log, θ_round, its start opening and the log of the round before prove the
    break to anyone with the stage's shape: no data, no replay, no verifier's word. Honest starts
    (fresh, continued) prove nothing, nor does a proof whose parts were swapped or changed; one
    proof has one encoding."""
    run = _rounds(tmp_path)
    judge = functools.partial(
        judge_continuity_proof, n_tensors=run.n_tensors, network=ONE_STAGE.digest(), num_stages=1
    )
    proof = run.proof(3, run.signed(2))
    verdict = judge(proof)
    assert verdict.proves and "nor the one its round 2 ended with" in verdict.reason, verdict
    data = proof.encode()
    assert data.startswith(CONTINUITY_PROOF_MAGIC) and ContinuityFraudProof.decode(data) == proof
    assert len(data) < 4 * proof.numel + 64 * 1024  # θ and two small logs

    # Honest starts prove nothing.
    fresh = judge(run.proof(1, None))
    assert not fresh.proves and "starts with a fresh inner optimizer" in fresh.reason
    continued = judge(run.proof(2, run.signed(1)))
    assert not continued.proves and "continues the state its round 1 ended with" in continued.reason
    # Parts that are not the replica's own, or do not open what it signed, prove nothing.
    theta = bytearray(proof.theta)
    theta[0] ^= 1
    assert "do not open" in judge(dataclasses.replace(proof, theta=bytes(theta))).reason
    assert "do not open" in judge(dataclasses.replace(proof, theta=proof.theta[:-4])).reason
    assert "holds no log of round 2" in judge(dataclasses.replace(proof, previous=None)).reason
    older = judge(dataclasses.replace(proof, previous=run.signed(1)))
    assert not older.proves and "is for stage 0 round 1, not stage 0 round 2" in older.reason
    stripped = judge(dataclasses.replace(proof, previous=dataclasses.replace(run.signed(2), end=None)))
    assert not stripped.proves and "does not open its last checkpoint" in stripped.reason
    other = SegmentCommitment.create(PREV, stage=0, round=2, root=run.logs[2].root())
    foreign = judge(dataclasses.replace(proof, previous=dataclasses.replace(run.signed(2), commitment=other)))
    assert not foreign.proves and "not signed by it" in foreign.reason

    # One wallet trains several runs, whose round numbers repeat: a log of round 2 of another run
    # (honestly continued there) does not chain with this run's round 3, and proves nothing here;
    # nor do logs that name no run, or a run other than the one the proof is judged for.
    other_run = _rounds(
        tmp_path / "other", network=_run_network(num_stages=1, name="another").digest(), data_seed=1
    )
    assert other_run.signed(2).end != run.signed(2).end
    mixed = judge(run.proof(3, other_run.signed(2)))
    assert not mixed.proves and "do not name one run" in mixed.reason
    mixed = judge(other_run.proof(3, run.signed(2)))
    assert not mixed.proves and "not of this run" in mixed.reason
    unbound = _rounds(tmp_path / "unbound", network=None)
    assert "not of this run" in judge(unbound.proof(3, unbound.signed(2))).reason
    # Round 0 has no round before: it must start fresh, and a log of it that does not proves fraud.
    theta = bytes(4 * (len(proof.theta) // 4))
    start = checkpoint_hash(hashlib.sha256(theta).hexdigest(), "ab" * 32)
    first = SegmentLog(stage=0, round=0, segment_steps=H, start_step=0, steps=(StepRecord(data=(0, 0, 2)),) * H,
                       checkpoints=(start, "cd" * 32))  # fmt: skip
    signed0 = SignedSegmentLog(first, SegmentCommitment.create(REPLICA, stage=0, round=0, root=first.root(),
                                                                network=ONE_STAGE.digest()))  # fmt: skip
    zero = judge(ContinuityFraudProof(signed0, "ab" * 32, theta, None))
    assert zero.proves and "a run's first round starts fresh" in zero.reason

    # One encoding: anything else is refused before it is judged.
    for bad in (
        data.replace(b'"numel":', b'"numel": ', 1),  # not canonical
        data[:-1],  # θ shorter than numel says
        data + b"\0",
        b"NSSENDER1\n" + data[len(CONTINUITY_PROOF_MAGIC) :],
    ):
        with pytest.raises(Refused):
            ContinuityFraudProof.decode(bad)

    # neuroshard-check-proof: the definition gives the stage's shape; nothing else is needed.
    path, network = tmp_path / "c.proof", str(_definition(tmp_path, num_stages=1))
    path.write_bytes(data)
    assert check_proof.main([str(path), "--network", network, "--wallet", REPLICA.wallet_id]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"PROVES FRAUD: wallet {REPLICA.wallet_id} stage 0 round 3"), out
    assert check_proof.main([str(path)]) == 2
    assert "a continuity fraud proof needs --network" in capsys.readouterr().err
    assert check_proof.main([str(path), "--network", network, "--wallet", PREV.wallet_id]) == 2
    assert f"signed by wallet {REPLICA.wallet_id}, not" in capsys.readouterr().err
    bigger = dataclasses.replace(MODEL, vocab_size=2 * MODEL.vocab_size)  # θ is shorter: another model
    assert (
        check_proof.main([str(path), "--network", str(_definition(tmp_path, num_stages=1, model=bigger))])
        == 2
    )
    assert "is not a stage-0 proof of this run's model" in capsys.readouterr().err
    network = str(_definition(tmp_path, num_stages=1))  # the same file: written again
    for honest, why in (
        (run.proof(2, run.signed(1)), "round 2 continues"),
        (run.proof(1, None), "round 1 starts with a fresh"),
    ):
        path.write_bytes(honest.encode())
        assert check_proof.main([str(path), "--network", network]) == 1
        assert f"does not prove fraud: {why}" in capsys.readouterr().out
    path.write_bytes(data)
    another = str(_definition(tmp_path, num_stages=1, name="another"))  # same shapes, another run
    assert check_proof.main([str(path), "--network", another]) == 1
    assert "its log is not of this run" in capsys.readouterr().out


def test_the_live_checker_keeps_a_continuity_break_as_a_proof(
    tmp_path: Path, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check of the doctored round whose segments pass (their replay stood in here: the rounds read
    made-up spans) fails on continuity, and the checker keeps the break as a proof of kind
    "continuity" that judges alone. Material without a start opening (nodes before it was served)
    fails the same way and leaves no proof."""
    run = _rounds(tmp_path / "replica")
    now = time.time()
    with db.write() as s:
        s.add(m.Wallet(wallet_id=REPLICA.wallet_id, public_key=REPLICA.public_key_hex, reputation=0.5,
                       status=m.STATUS_ACTIVE, registered_at=now, software_version="0.1.0"))  # fmt: skip
        s.flush()
        for r in (2, 3):
            s.add(m.Receipt(
                wallet_id=REPLICA.wallet_id, stage=0, round=r, inner_steps=H, start_step=r * H, tokens=H,
                shard_id=0, offset_start=0, offset_end=2 * H, data_spans=[[0, 0, 2 * H]], losses=[],
                base_hash=run.bases[r], result_hash="1" * 64, delta_digest="2" * 64, inner_state_digest=None,
                accepted=[], rejected=[], equivocators=[], segment_root=run.logs[r].root(),
                segments=run.logs[r].segments, body_sha256=f"{r:064d}", received_at=now,
            ))  # fmt: skip
    with db.read() as s:
        receipt = s.scalars(select(m.Receipt).where(m.Receipt.round == 3)).one()
        s.expunge(receipt)
    network = ONE_STAGE
    lines: list[str] = []
    checker = ReplayChecker(
        JobContext(db=db, network=network, operator=OPERATOR, log=lines.append),
        config=ReplayCheckConfig(sample_rate=1.0, fraud_proof_dir=tmp_path / "proofs"),
        dataset=lambda: None,
    )
    monkeypatch.setattr(
        replaycheck, "judge_segments", lambda *args, **kwargs: SegmentsJudged(True, "replayed")
    )
    last = run.logs[3].segments - 1

    def challenge(**changes: Any) -> Challenge:
        pieces = {j: dataclasses.replace(run.store.material(3, j), **changes) for j in (0, last)}  # type: ignore[type-var]
        return Challenge(receipt, "http://127.0.0.1:9", segments=(0,), last=last, pieces=pieces,
                         previous=run.signed(2))  # fmt: skip

    checker._check_segments(challenge())
    assert checker.failed == 1 and "optimizer continuity" in lines[-1], lines
    with db.read() as s:
        (row,) = s.scalars(select(m.FraudProof)).all()
    assert (row.kind, row.wallet_id, row.round, row.segment) == ("continuity", REPLICA.wallet_id, 3, 0)
    assert row.device is None and row.data_spans == []
    data = (tmp_path / "proofs" / f"{row.sha256}.proof").read_bytes()
    assert data == checker.fraud_proofs[-1] and len(data) == row.size_bytes
    decoded = ContinuityFraudProof.decode(data)
    assert judge_continuity_proof(decoded, n_tensors=run.n_tensors, network=ONE_STAGE.digest()).proves

    checker._check_segments(challenge(start_inner=None))
    assert checker.failed == 2 and "optimizer continuity" in lines[-1], lines
    with db.read() as s:
        assert len(s.scalars(select(m.FraudProof)).all()) == 1

    # A pass without credit (its log carries a crashed run's offers): no verdict, no reputation.
    monkeypatch.setattr(
        replaycheck, "judge_segments", lambda *a, **k: SegmentsJudged(True, "replayed; carries", credit=False)
    )
    monkeypatch.setattr(checker, "_continuity", lambda c: None)
    verdicts = _events(db)
    checker._picked[REPLICA.wallet_id] = 3  # drawn when round 2 had been picked before
    checker._check_segments(dataclasses.replace(challenge(), picked_before=2))
    assert (checker.passed, checker.failed) == (0, 2) and "passed, not counted" in lines[-1], lines
    assert _events(db) == verdicts
    assert checker._picked[REPLICA.wallet_id] == 2  # still due for the budget's draw, as without a root


def _events(db: Database) -> list[str]:
    with db.read() as s:
        return [e.reason for e in s.scalars(select(m.ReputationEvent).order_by(m.ReputationEvent.id))]


def test_the_served_start_opening_must_open_the_round_s_first_checkpoint(tmp_path: Path) -> None:
    """The store serves the sha256 of the optimizer state the round started from with every segment
    (it travels in the material's metadata); with θ_round it must open the log's first checkpoint,
    or the material is not the committed one."""
    run = train_round(tmp_path, stage=1, num_stages=2)
    material = run.material(1)  # decoded from the wire
    assert material.start_inner is not None
    assert checkpoint_hash(run.base_hash, material.start_inner) == material.log.checkpoints[0]
    assert commitment_problems(material, run.claim()) == []
    wrong = dataclasses.replace(material, start_inner="0" * 64)
    assert commitment_problems(wrong, run.claim()) == [
        "the served start_inner and θ_round do not open the round's first checkpoint"
    ]
    older = dataclasses.replace(material, start_inner=None)  # nodes before it was served
    assert commitment_problems(older, run.claim()) == []
    n, k = material.theta_round.numel(), material.start.inner.steps.numel()
    assert SegmentMaterial.decode(older.encode(), numel=n, n_tensors=k).start_inner is None
    with pytest.raises(Refused, match="start_inner is not a sha256"):
        SegmentMaterial.decode(
            dataclasses.replace(material, start_inner="x" * 64).encode(), numel=n, n_tensors=k
        )


def test_a_commitment_must_name_the_run_it_is_checked_in(tmp_path: Path) -> None:
    """A wallet's runs repeat round numbers, and the proofs that hold two of its statements
    together hold only those of one run: a commitment that names another run, or none, would keep
    its replica out of them, so the live check refuses it (the claim carries the run's digest)."""
    run = train_round(tmp_path, stage=1, num_stages=2)
    material, claim = run.material(0), run.claim()
    assert claim.network == _run_network().digest() == material.commitment.network
    assert commitment_problems(material, claim) == []
    c = material.commitment
    for other in ("6f" * 32, None):
        resigned = SegmentCommitment.create(REPLICA, stage=c.stage, round=c.round, root=c.root, network=other)
        problems = commitment_problems(dataclasses.replace(material, commitment=resigned), claim)
        assert problems == ["the commitment does not name this run (the definition's digest)"]
        unbound = dataclasses.replace(claim, network=None)  # a claim without the run compares nothing
        assert commitment_problems(dataclasses.replace(material, commitment=resigned), unbound) == []
