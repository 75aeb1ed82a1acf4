"""Segment replay, for every stage: re-run k inner steps of one replica from its committed checkpoint.

A replica commits, in its receipt and a signed `SegmentCommitment`, to the root of its round's
hash chain (node.segments): one record per inner step (stage 0: the data span; every stage: the
messages it received, each under its sender's signed header, and what it sent on) and the hash
of its weights and inner AdamW state every k steps. For a drawn segment j it serves the
`SegmentMaterial` (node.segment_store): the log, the commitment, the checkpoints at the segment's
two ends and the messages each step consumed. `check_segment` then

1. checks the material against the commitments: the commitment's signature and wallet, its root
   against the receipt's and the log's, both checkpoints against the log's hashes, every message
   against its step record, its sender's signature, its payload hash and micro-batch id, the
   schedule step, and (stage 0) the step spans against the receipt's assigned spans;
2. replays the segment's k steps from the start checkpoint with the production step functions
   (stage 0: the batches re-read from the data set, and at S > 1 the recorded gradients through
   `pipeline.remote_loss`; later stages: the recorded activations, labels and gradients through
   `pipeline.stage_inner_step`), the stage's model at the vocabulary the checkpoint holds (grown
   with the tokenizer, node.vocab; verifier.stageshape);
3. compares the committed end − start with the replayed end − start by cosine and norm ratio, at
   the tolerance the receipt's precision calls for (verifier.replaycheck.tolerance_for), and the
   optimizer's step counts exactly.

Step 1 failing is the verifier's verdict (like a digest mismatch today); step 3 failing on
material that passed step 1 is a `SegmentFraudProof`: everything in it is signed by the replica
or by the senders it names, so anyone with the run's definition and data re-checks it alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor

from neuroshard.node.actcodec import Format, codec, round_trip
from neuroshard.node.device import Placement
from neuroshard.node.diloco import (
    DiLoCo,
    DiLoCoConfig,
    copy_into_parameters,
    flat_parameters,
    tensor_digest,
)
from neuroshard.node.model import ModelConfig, build_stage, cross_entropy_loss
from neuroshard.node.p2p.pipeline_wire import decode_activations, decode_activations_as, decode_gradient
from neuroshard.node.pipeline import remote_loss, stage_inner_step
from neuroshard.node.replay import fresh_inner_digest, install_inner_state
from neuroshard.node.segment_store import SegmentMaterial
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.identity import sha256_hex, wallet_id_of
from neuroshard.protocol.pipeline import ActivationHeader, GradientReply
from neuroshard.protocol.refusal import Refused, malformed
from neuroshard.protocol.schema import canonical_json, parse_json
from neuroshard.protocol.segments import (
    KINDS,
    CheckpointOpening,
    Received,
    SegmentCommitment,
    SegmentLog,
    SignedSegmentLog,
    StepRecord,
    checkpoint_hash,
)

from .spotcheck import SpotCheckConfig, SpotCheckError, compare_deltas
from .stageshape import label_bound, stage_config

ANY_PRECISION = "any"
"""`SegmentClaim.trained_precision` when the receipt's precision is not known: the step-count rule
that holds for every precision (fp16's) applies."""
LENIENT_COUNTS = ("fp16", ANY_PRECISION)
"""Trained precisions whose optimizer step counts may fall short of a segment's steps, uniformly."""

BatchReader = Callable[[tuple[int, int, int]], tuple[Tensor, Tensor]]
"""(shard_id, offset_start, offset_end) -> (inputs, labels) (B, T) int64, read as the node read it
(verifier.spotcheck.claimed_batches over one span)."""


@dataclass(frozen=True, kw_only=True)
class SegmentClaim:
    """What the verifier knows without asking the replica: the run and the signed receipt."""

    model: ModelConfig
    diloco: DiLoCoConfig
    num_stages: int
    stage: int
    round: int
    wallet: str
    """The replica's Ed25519 public key (hex): the receipt's signer."""
    root: str
    """The receipt's `segment_root`."""
    spans: Sequence[tuple[int, int, int]] = ()
    """Stage 0: the receipt's data spans (already checked against the wallet's assignment)."""
    precision: str = "fp32"
    """The replay's placement precision (the verifier's CPU, fp32 by default)."""
    trained_precision: str | None = None
    """The receipt's precision. fp16 training skips the optimizer step of a micro-batch whose scaled
    gradients overflowed (GradScaler), so its step counts may fall short of the segment's steps.
    `ANY_PRECISION`: not known (a proof checked without the receipt's listing), so the count rule
    is fp16's, the most lenient. Only the count rule reads it; the replay's own precision is
    `precision`."""
    base_hash: str | None = None
    """The receipt's θ_round hash: segment 0 must start from it."""
    delta_digest: str | None = None
    """The receipt's Δ digest: the last segment must end where that Δ says (Δ = θ_round − end)."""
    network: str | None = None
    """The run's definition digest, which the commitment must name (a wallet's runs repeat round
    numbers, and a log of another run replays under another definition); None: not compared."""


@dataclass(frozen=True)
class SegmentVerdict:
    ok: bool
    reason: str
    replayed: bool = False
    """Whether the steps were replayed (False: the material failed its commitments first)."""
    cosine: float | None = None
    norm_ratio: float | None = None


@dataclass(frozen=True)
class StepInputs:
    """What one replayed step consumes, decoded."""

    inputs: Tensor
    """Stage 0: (B, T) int64 token ids; later stages: (B, T, C) float32 activations."""
    labels: Tensor
    """(B, T) int64."""
    grad: Tensor | None
    """(B, T, C) float32 gradient from the next stage; None on the last stage."""
    loss: float = 0.0
    """The loss the next stage reported (only shown)."""


def draw_segments(
    operator: Wallet, wallet_id: str, stage: int, round_: int, segments: int, draws: int
) -> tuple[int, ...]:
    """`draws` distinct segments of a receipt's `segments`, seeded by the operator's signature over
    (wallet, stage, round): deterministic for the verifier (Ed25519 signs deterministically), not
    predictable by the replica, and drawn only once its receipt committed the chain."""
    message = f"neuroshard/segment-draw/v1\n{wallet_id}/{stage}/{round_}".encode()
    seed = int.from_bytes(hashlib.sha256(operator.sign(message)).digest(), "big")
    return tuple(sorted(random.Random(seed).sample(range(segments), min(draws, segments))))


# --- 1. the material against the commitments ---------------------------------------------------


def commitment_problems(material: SegmentMaterial, claim: SegmentClaim) -> list[str]:
    """Everything in `material` that does not match what was committed (empty when it all does)."""
    log, c = material.log, material.commitment
    problems = []
    if c.wallet != claim.wallet or not c.signature_valid():
        problems.append("the segment commitment is not signed by the receipt's wallet")
    if (c.stage, c.round, log.stage, log.round) != (claim.stage, claim.round) * 2:
        problems.append(f"commitment and log are for stage {c.stage}/{log.stage} round {c.round}/{log.round}")
    if claim.network is not None and c.network != claim.network:
        problems.append("the commitment does not name this run (the definition's digest)")
    root = log.root()
    if not (c.root == claim.root == root):
        problems.append("the log's root differs from the receipt's or the signed commitment's")
    if log.start_step != claim.round * claim.diloco.inner_steps:
        problems.append(f"the log starts at schedule step {log.start_step}, round {claim.round} starts at "
                        f"{claim.round * claim.diloco.inner_steps}")  # fmt: skip
    first, end = log.segment(material.segment)
    j = material.segment
    if material.start.sha256() != log.checkpoints[j]:
        problems.append(f"the checkpoint at step {first} does not match its committed hash")
    if material.end.sha256() != log.checkpoints[j + 1]:
        problems.append(f"the checkpoint at step {end} does not match its committed hash")
    problems += _round_problems(material, claim)
    if len(material.received) != end - first:
        problems.append(f"messages for {len(material.received)} steps, the segment has {end - first}")
        return problems
    # One exchange per step: a micro-batch id with the replicas whose messages the step consumed
    # (one replica may train one driver's id twice, sent on by two replicas of the stage between).
    ids = [(s.micro_batch, tuple(sorted(r.sender for r in s.received))) for s in log.steps if s.micro_batch]
    if len(ids) != len(set(ids)):
        problems.append("the log names one exchange for two steps")  # one reply reused
    for i, messages in zip(range(first, end), material.received, strict=True):
        problems += _step_problems(i, log.steps[i], messages, claim)
    sent = material.sent or tuple(() for _ in range(first, end))
    if len(sent) != end - first:
        problems.append(f"sent payloads for {len(sent)} steps, the segment has {end - first}")
        return problems
    forwards, answers = claim.stage < claim.num_stages - 1, claim.stage > 0
    for i, served in zip(range(first, end), sent, strict=True):
        recorded = {(r.kind, r.payload_sha256) for r in log.steps[i].sent}
        if len({kind for kind, _ in recorded}) != len(log.steps[i].sent):
            problems.append(f"step {i}: its record names two payloads of one kind sent on")
        if forwards and not any(kind == "activations" for kind, _ in recorded):
            # A step of a stage that is not the last sends its output on before it is recorded (its
            # gradient comes back through that exchange), so its record names it; one that names
            # none would keep what it sent out of this comparison and out of sender matching.
            problems.append(f"step {i}: its record names no activations sent on")
        if answers and not any(kind == "gradient" for kind, _ in recorded):
            # A later stage's worker records the gradient it sends back before it answers, and the
            # round closes after every answer (node.stage_worker): a step without one kept its reply
            # out of this comparison and out of sender matching.
            problems.append(f"step {i}: its record names no gradient sent back")
        got = {(kind, sha256_hex(body)) for kind, body in served}
        if got != recorded:
            problems.append(f"step {i}: the payloads served as sent are not the ones its record names")
    problems += _failed_problems(material, claim)
    if (
        claim.stage == 0
        and claim.spans
        and _merged([s.data for s in log.steps]) != _merged(list(claim.spans))
    ):
        problems.append("the log's data spans differ from the receipt's")
    return problems


def _failed_problems(material: SegmentMaterial, claim: SegmentClaim) -> list[str]:
    """The failed steps the segment replays (`SegmentLog.failures_in`) against what was served for
    them: each ran on one activations message, signed for this replica and micro-batch, and
    offered the payload its record names. Only a middle stage forwards what it may fail to step on."""
    log, out = material.log, []
    if log.failed and not 0 < claim.stage < claim.num_stages - 1:
        out.append(
            f"the log lists failed steps, which a stage {claim.stage} replica of {claim.num_stages} never has"
        )
    if [n for n, _, _ in material.failed] != log.failures_in(material.segment):
        return [*out, "the failed steps served are not the ones the segment replays"]
    for n, messages, offered in material.failed:
        failed = (log.failed or ())[n]  # failures_in found it
        record = StepRecord(micro_batch=failed.micro_batch, received=list(failed.received))
        out += _step_problems(f"failed {n}", record, messages, claim, ["activations"])
        if sha256_hex(offered) != failed.sent.payload_sha256:
            out.append(
                f"failed step {n}: the activations served as offered are not the ones its record names"
            )
    return out


def _round_problems(material: SegmentMaterial, claim: SegmentClaim) -> list[str]:
    """The chain against the receipt's θ_round and Δ: the contribution sent is the chain's end;
    the round's first checkpoint opened by θ_round and the served `start_inner`, when served."""
    if claim.base_hash is None:
        return []
    theta = material.theta_round
    if tensor_digest(theta) != claim.base_hash:
        return ["the served θ_round is not the receipt's base_hash"]
    j, last = material.segment, material.log.segments - 1
    out = []
    inner = material.start_inner
    if inner is not None and checkpoint_hash(claim.base_hash, inner) != material.log.checkpoints[0]:
        out.append("the served start_inner and θ_round do not open the round's first checkpoint")
    if j == 0 and not torch.equal(material.start.weights, theta):
        out.append("segment 0 does not start from θ_round")
    delta = theta - material.end.weights
    if j == last and claim.delta_digest is not None and tensor_digest(delta) != claim.delta_digest:
        out.append("the receipt's Δ is not θ_round minus the chain's last checkpoint")
    return out


def _step_problems(
    i: int | str,
    step: StepRecord,
    messages: Sequence[Received],
    claim: SegmentClaim,
    wanted: list[str] | None = None,
) -> list[str]:
    """What is wrong with step `i`'s served messages (`wanted`: the kinds it must have consumed;
    default, what a step of the claim's stage consumes)."""
    out = []
    if [m.ref() for m in messages] != step.received:
        return [f"step {i}: the messages served differ from the ones its record commits to"]
    kinds = [m.kind for m in messages]
    if wanted is None:
        wanted = (["activations"] if claim.stage > 0 else []) + (
            ["gradient"] if claim.stage < claim.num_stages - 1 else []
        )
    if kinds != wanted:
        return [
            f"step {i}: received {kinds}, a stage {claim.stage} step of {claim.num_stages} takes {wanted}"
        ]
    if claim.stage == 0 and step.data is None:
        out.append(f"step {i}: a stage-0 step names no data span")
    if claim.num_stages > 1 and not step.micro_batch:
        # Every step of a pipeline is on a micro-batch with an id (a driver's names its inner step):
        # a step naming none would be out of reach of sender matching and of disputes.
        out.append(f"step {i}: a pipeline step names no micro-batch")
    for m in messages:
        try:
            header: ActivationHeader | GradientReply = (
                ActivationHeader.from_json(m.header)
                if m.kind == "activations"
                else GradientReply.from_json(m.header)
            )
        except Refused as exc:
            out.append(f"step {i}: {m.kind} header does not parse: {exc}")
            continue
        expected_stage = claim.stage if m.kind == "activations" else claim.stage + 1
        if header.wallet != m.sender or not header.signature_valid():
            out.append(f"step {i}: {m.kind} header is not signed by its named sender")
        elif header.payload_sha256 != sha256_hex(m.body):
            out.append(f"step {i}: {m.kind} payload differs from what its sender signed")
        elif header.stage != expected_stage:
            out.append(f"step {i}: {m.kind} header is for stage {header.stage}, not {expected_stage}")
        elif header.to != claim.wallet:
            out.append(f"step {i}: {m.kind} header is addressed to another replica")
        elif header.wallet == claim.wallet:  # another stage's replica signs what a step consumes
            out.append(f"step {i}: {m.kind} header is signed by this replica itself")
        elif isinstance(header, ActivationHeader) and (
            header.dim != claim.model.dim or header.seq_len > claim.model.max_seq_len
        ):
            out.append(
                f"step {i}: activations of width {header.dim} and length {header.seq_len}; the "
                f"model's are {claim.model.dim} and at most {claim.model.max_seq_len}"
            )
        elif step.micro_batch and header.micro_batch != step.micro_batch:
            out.append(
                f"step {i}: {m.kind} is for micro-batch {header.micro_batch}, the step for {step.micro_batch}"
            )
    return out


def _merged(spans: Sequence[tuple[int, int, int] | None]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for span in spans:
        if span is None:
            return [(-1, -1, -1)]
        if out and out[-1][0] == span[0] and out[-1][2] == span[1]:
            out[-1] = (span[0], out[-1][1], span[2])
        else:
            out.append(span)
    return out


def sender_round(message: Received) -> tuple[int, int] | None:
    """(stage, round) of the replica that signed `message`'s header: activations come from the
    stage before the one they are for, a gradient reply from the replier's own stage. None when
    the header does not parse."""
    try:
        if message.kind == "activations":
            act = ActivationHeader.from_json(message.header)
            return act.stage - 1, act.round
        reply = GradientReply.from_json(message.header)
        return reply.stage, reply.round
    except Refused:
        return None


def signed_log_problem(
    sender: SignedSegmentLog, wallet: str, stage: int, round_: int, root: str
) -> str | None:
    """Why a sender's served log cannot be held against it (None when it can): it must be signed by
    `wallet` for (`stage`, `round_`) and be the chain its receipt committed to (`root`)."""
    c, log = sender.commitment, sender.log
    if c.wallet != wallet or not c.signature_valid():
        return "its log's commitment is not signed by it"
    if (c.stage, c.round, log.stage, log.round) != (stage, round_) * 2:
        return f"its log is for stage {log.stage} round {log.round}, not stage {stage} round {round_}"
    if not c.root == log.root() == root:
        return "its log's root is not the one its receipt committed to"
    return None


def continuity_problem(
    log: SegmentLog,
    base_hash: str,
    fresh: str,
    previous: SignedSegmentLog | None,
    wallet: str,
    previous_root: str | None,
) -> str | None:
    """Why a round's starting optimizer state does not continue the replica's previous round (None
    when it does). `log` is the checked round's (already held to its receipt), `base_hash` its
    θ_round, `fresh` a fresh optimizer's digest (node.replay.fresh_inner_digest); `previous` the
    replica's signed log of the round before with its end opening, `wallet` its public key, and
    `previous_root` that round's committed root: None when the replica sent no receipt for it,
    and then only a fresh start passes (a log committed to nowhere could be made up to fit).

    The first checkpoint must hold θ_round with either a fresh optimizer (a node resets it whenever
    a round does not follow one it committed: a start, a restart, a jump in rounds) or the state
    the previous round's last checkpoint held. Otherwise the replica chose its moments between
    rounds, and Adam's first moment alone steers the next steps wherever it points while every
    segment still replays (a segment replays from whatever state its start checkpoint commits to)."""
    if not log.checkpoints:
        return "its log holds no checkpoint"
    start = log.checkpoints[0]
    if start == checkpoint_hash(base_hash, fresh):
        return None
    where = f"round {log.round} starts from an inner optimizer state that is not fresh"
    if log.round == 0:
        return f"{where}: a run's first round starts fresh"
    if previous is None:
        return f"{where}, and no log of round {log.round - 1} is held to continue"
    if previous_root is None:
        return f"{where}, and it sent no receipt for round {log.round - 1} whose log it could continue"
    problem = signed_log_problem(previous, wallet, log.stage, log.round - 1, previous_root)
    if problem is not None:
        return f"{where}, and its round {log.round - 1} log cannot be held to it ({problem})"
    end = previous.end
    if end is None or not previous.log.checkpoints or end.sha256() != previous.log.checkpoints[-1]:
        return f"{where}, and its round {log.round - 1} log does not open its last checkpoint"
    if start != checkpoint_hash(base_hash, end.inner_sha256):
        return f"{where}, nor the one its round {log.round - 1} ended with"
    return None


def contradicting(
    sender: SignedSegmentLog, messages: Iterable[Received], receiver: str
) -> list[tuple[Received, str]]:
    """Where a sender's signed round log contradicts headers it signed to `receiver` (a public key;
    empty when it agrees). Each of `messages` (what that checked replica consumed) whose header the
    log's signer signed, for the log's round and run and addressed to `receiver` (its signed `to`):

    - must be listed among the log's signed headers (`SignedHeader`: a node lists every header it
      signs in the log of the round the header names, activations offered whether the receiver
      took them or not, gradients answered with; node.segments, on disk before it is sent, so a
      round redone after a crash lists the crashed run's too);
    - activations must be what the log's steps on that micro-batch record sending, whoever they
      went to: a driver (stage 0) names each micro-batch after its own inner step
      (protocol.pipeline.micro_batch_id) and sends every attempt the same bytes (node.p2p.pipeline
      `forward`), so an attempt whose answer was lost is held to the step too. A later stage's
      replica also encodes a micro-batch's output once per job, and a job whose every attempt
      failed is listed as a failed step (`FailedStep`, replayed by a segment check like a step),
      so its activations are held to its steps and failed steps on that micro-batch. A later
      stage's log from before failed steps were listed (`failed` None) is not held to this;
    - and a step of the log that records the receiver's answer to the micro-batch (a received
      message from `receiver`: the gradient its activations got back, or the activations its
      gradient answered) must record sending that payload among what it sent of that kind; a
      step that records sending nothing of that kind contradicts it too (an honest node records
      the activations it sends during their step, and the gradient it answers with before it
      answers, and closes a round only once every answer is recorded: node.stage_worker).

    Both sides are the sender's own signatures — its commitment on the log; its header on the
    payload, on whom it was sent to and on the round — so a contradiction is its fault whatever its
    receiver did: it sent that receiver something other than what it recorded, or named a round
    whose log does not list it. A log from before logs listed their headers (`headers` None: an
    old fraud proof) is held to its steps only. Check the log with `signed_log_problem` first."""
    log, signer = sender.log, sender.commitment.wallet
    out: list[tuple[Received, str]] = []
    listed = (
        None
        if log.headers is None
        else {(x.kind, x.micro_batch, x.to, x.payload_sha256) for x in log.headers}
    )
    sent: dict[tuple[str, str], set[str]] = {}
    for step in log.steps:
        if step.micro_batch and any(ref.sender == receiver for ref in step.received):
            for kind in KINDS:  # a step that names the exchange records what it sent of each kind
                sent.setdefault((step.micro_batch, kind), set())
            for ref in step.sent:
                sent[(step.micro_batch, ref.kind)].add(ref.payload_sha256)
    offered: dict[str, set[str]] = {}
    """Micro-batch id → the activations the log's steps (and, past stage 0, its failed steps)
    record sending on, to anyone."""
    held = log.stage == 0 or log.failed is not None
    """Whether every activations header is held to `offered`: a driver's always; a later stage's
    when its log lists its failed steps (a log from before they were listed is not)."""
    for step in log.steps:
        if step.micro_batch:
            offered.setdefault(step.micro_batch, set()).update(
                ref.payload_sha256 for ref in step.sent if ref.kind == "activations"
            )
    if log.stage > 0:
        for failed in log.failed or ():
            offered.setdefault(failed.micro_batch, set()).add(failed.sent.payload_sha256)
    for message in messages:
        if message.sender != signer or sender_round(message) != (log.stage, log.round):
            continue
        parse = ActivationHeader.from_json if message.kind == "activations" else GradientReply.from_json
        header = parse(message.header)
        if header.wallet != signer or not header.signature_valid():
            continue  # not the sender's word (the receiver's own check refuses it)
        if header.to != receiver:
            continue  # signed for another exchange: its record is that one's
        if header.network is None or header.network != sender.commitment.network:
            continue  # another run's (or unbound): ids and rounds repeat across runs
        named = f"micro-batch {header.micro_batch}: it signed {message.kind} {header.payload_sha256[:16]}"
        if (
            listed is not None
            and (message.kind, header.micro_batch, receiver, header.payload_sha256) not in listed
        ):
            out.append((message, f"{named} for round {log.round}, whose log does not list that header"))
            continue
        if listed is not None and held and message.kind == "activations":
            # A driver names each micro-batch after its own step and sends every attempt of it the
            # same bytes; a later stage's replica encodes a micro-batch's output once per job and
            # records each job as a step or a failed step. So whoever it went to, what it signed is
            # what one of those records sending.
            stepped = offered.get(header.micro_batch)
            if stepped is None:
                out.append((message, f"{named} for round {log.round}, whose log has no step on it"))
                continue
            if header.payload_sha256 not in stepped:
                what = ", ".join(sorted(r[:16] for r in stepped)) or "nothing"
                out.append((message, f"{named}, its steps on it record sending {what}"))
                continue
        recorded = sent.get((header.micro_batch, message.kind))
        if recorded is not None and header.payload_sha256 not in recorded:
            what = ", ".join(sorted(r[:16] for r in recorded)) or "nothing of that kind"
            out.append((message, f"{named}, its log records sending {what}"))
    return out


# --- 2. the replay -----------------------------------------------------------------------------


def step_inputs(
    material: SegmentMaterial, claim: SegmentClaim, read_batch: BatchReader | None
) -> list[StepInputs]:
    """Decode each step's inputs (after `commitment_problems` came back empty; `claim` at the
    material's vocabulary, `at_material_vocab`). Raises Refused for a payload that does not decode
    (which its sender signed: a fault of the sender)."""
    first, end = material.log.segment(material.segment)
    out = []
    for i, messages in zip(range(first, end), material.received, strict=True):
        by_kind = {m.kind: m for m in messages}
        if claim.stage == 0:
            span = material.log.steps[i].data
            assert span is not None and read_batch is not None
            inputs, labels = read_batch(span)
            shape = (inputs.shape[0], inputs.shape[1], claim.model.dim)
        else:
            act = by_kind["activations"]
            header = ActivationHeader.from_json(act.header)
            vocab = label_bound(claim.model, claim.stage, claim.num_stages)
            inputs, labels = decode_activations(act.body, header, vocab)
            shape = (header.batch, header.seq_len, header.dim)
        grad, loss = None, 0.0
        if "gradient" in by_kind:
            reply = GradientReply.from_json(by_kind["gradient"].header)
            grad = decode_gradient(by_kind["gradient"].body, shape, reply.codec)
            loss = reply.loss
        out.append(StepInputs(inputs, labels, grad, loss))
    return out


def failed_inputs(material: SegmentMaterial, claim: SegmentClaim) -> list[tuple[int, Tensor, Tensor]]:
    """(after, activations, labels) of each failed step the segment replays, decoded (after
    `commitment_problems` came back empty). Raises Refused as `step_inputs` does."""
    vocab = label_bound(claim.model, claim.stage, claim.num_stages)
    out = []
    for n, messages, _ in material.failed:
        header = ActivationHeader.from_json(messages[0].header)
        inputs, labels = decode_activations(messages[0].body, header, vocab)
        out.append(((material.log.failed or ())[n].after, inputs, labels))
    return out


class _Abandoned(Exception):
    """Ends a replayed failed step once its forward is captured (nothing is stepped)."""


def at_material_vocab(claim: SegmentClaim, material: SegmentMaterial) -> SegmentClaim:
    """`claim` with the model at the vocabulary the material's weights hold: the definition's, or
    grown (verifier.stageshape). ValueError when they are no vocabulary of this stage's model, or
    the checkpoints and θ_round differ in length."""
    sizes = {material.start.weights.numel(), material.end.weights.numel(), material.theta_round.numel()}
    if len(sizes) != 1:
        raise ValueError(f"the checkpoints and θ_round differ in length: {sorted(sizes)} values")
    model = stage_config(claim.model, claim.stage, claim.num_stages, sizes.pop())
    return dataclasses.replace(claim, model=model)


def replay_segment(
    claim: SegmentClaim,
    material: SegmentMaterial,
    steps: Sequence[StepInputs],
    outputs: list[dict[str, Tensor]] | None = None,
    failed: Sequence[tuple[int, Tensor, Tensor]] = (),
    offers: list[Tensor] | None = None,
) -> Tensor:
    """The weights (d,) after replaying the segment's steps from its start checkpoint (`claim`'s
    model at the material's vocabulary: `at_material_vocab`). `outputs`, when given, gets per step
    what the step sends on as it computes it: "activations" (the stage's output, not the last
    stage) and "gradient" (∂loss/∂input, not stage 0), float32 on the CPU. `failed`
    (`failed_inputs`): each failed step's forward runs before the step its `after` names, as the
    replica ran it, and ends without a step; `offers` gets its activations, in order."""
    model = build_stage(claim.model, claim.stage, claim.num_stages)
    copy_into_parameters(material.start.weights, model.parameters())
    current: list[StepInputs] = []

    def recorded(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        grad = current[0].grad
        assert grad is not None
        if outputs is not None:
            outputs[-1]["activations"] = hidden.detach().float().cpu()
        return grad, current[0].loss

    placement = dataclasses.replace(Placement.cpu(), precision=claim.precision)
    last = claim.stage == claim.num_stages - 1
    loss_fn = remote_loss(recorded) if claim.stage == 0 and not last else cross_entropy_loss
    diloco = DiLoCo(model, claim.diloco, placement=placement, loss_fn=loss_fn)
    install_inner_state(diloco, material.start.inner)
    first, _ = material.log.segment(material.segment)
    diloco.round, diloco.steps_in_round = claim.round, first
    pending = list(failed)

    def offered(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        if offers is not None:
            offers.append(hidden.detach().float().cpu())
        raise _Abandoned

    for index, step in enumerate(steps):
        while pending and pending[0][0] == first + index:
            _, inputs, labels = pending.pop(0)
            with contextlib.suppress(_Abandoned):
                stage_inner_step(diloco, inputs, labels, offered)
        current[:] = [step]
        if outputs is not None:
            outputs.append({})
        if claim.stage == 0:
            diloco.inner_step(step.inputs, step.labels)
        else:
            grad, _ = stage_inner_step(diloco, step.inputs, step.labels, None if last else recorded)
            if outputs is not None:
                outputs[-1]["gradient"] = grad
    return flat_parameters(diloco.params)


FIXED_SENT_LIMITS = SpotCheckConfig(min_cosine=0.9, norm_tolerance=0.15)
"""The sent-payload check until 2026-12-06 (set from the codecs' worst rounding), kept as a bound."""


@dataclass(frozen=True)
class SentTolerance:
    """How far a payload a replica sent on (decoded, p) may sit from what its replayed step computes
    (r), measured against what the run's codec does to r itself (q = the codec's round trip of r).

    An honest payload is the codec applied to the sender's own tensor, which differs from r only by
    the precision it trained in. So it is held to two statistics of the codec's own rounding, and
    to the fixed limits that were the whole check before (which had to admit the coarsest codec's
    worst case, 15% of scale):

    - *energy*: ‖p − r‖² ≤ (1 + ``energy_slack`` + ``energy_spread`` · s_e) · (‖q − r‖² + ``drift``² ·
      ‖r‖²), where s_e = √Σe⁴ / Σe² (e = q − r per value) is the relative spread of the codec's error
      energy: a dithered code's error is a fresh draw on each side, and on a small tensor two draws'
      energies differ by tens of percent. Anything the sender adds to its codec's rounding adds
      energy: a rescaled, stale or other tensor, or a coarser code;
    - *norm*: |‖p‖ / ‖q‖ − 1| ≤ ``norm_floor`` + ``norm_spread`` · s_n, where s_n = √Σ r²e² / ‖r‖²
      is the standard deviation the codec's noise gives that ratio. The noise averages out of a
      norm, so this catches a rescaling that a noisy code hides from the energy. The floor is the
      room for a sender whose precision scales its tensors (radially) against an fp32 replay;
    - *coarse*: ``coarse`` against r (cosine ≥ 0.9, norm ratio 1 ± 0.15), so the check is never
      looser than the fixed limits: the spread terms grow as 1/√values, and on a payload of a group
      or two (or one whose energy sits in a few values) they let a 3-bit code rescaled by 20–30%
      through (a review measured ×1.29 on one 64-value group), which the fixed limits refuse.

    When the codec codes r as zeros (values below its smallest step), only the energy is held: the
    honest payload is zeros or the smallest codes, and no ratio to q is defined. When r cannot be
    coded at all (beyond fp16's range, or so large that the rotation overflows), only the fixed
    limits are: the sender could not have coded its own tensor either, unless it sat just inside.

    ``drift`` stands for the precision: bf16 autocast against the verifier's fp32 replay put the
    sent tensors at most 0.65% (relative, the test model; 0.47% the tiny one) from the replay's on
    CPU (bench/bench_sent_tolerance.py); fp32 replays on the same machine are exact. Not measured
    on GPUs. What is refused is measured with lies coded by the honest encoder; a sender that codes
    its lie with a better encoder (per-group steps chosen for least error) saves a quarter to a
    third of the 3-bit codes' rounding energy and can spend it on a lie (a review: another tensor
    mixed in at 0.10–0.14 rad passed). q comes from the checker's own encoder, whose fitted step
    search and dither are not bit-identical across machines, so a verdict at the very edge of a
    limit may differ between two checkers, as the replay's own floats may.
    """

    drift: float = 0.02
    energy_slack: float = 0.1
    energy_spread: float = 6.0
    norm_floor: float = 0.01
    norm_spread: float = 8.0
    coarse: SpotCheckConfig = field(default_factory=lambda: FIXED_SENT_LIMITS)


SENT_TOLERANCE = SentTolerance()
"""The segment check's tolerance for what a replica sent on (``SentTolerance``). Measured with
bench/bench_sent_tolerance.py on real segments (k = 4) of the test model (2×16×32 values a payload,
12 segments) and the tiny one (4×64×128, 4 segments), every wire codec, fp32 and bf16-autocast
senders against an fp32 replay: no honest payload refused. What it refuses, and what the fixed
limits it replaced let through, is in bench/RESULTS.md ("What each step sent on, held to the
codec's own rounding")."""


@dataclass(frozen=True)
class SentComparison:
    """``compare_sent``'s verdict on one payload."""

    ok: bool
    reason: str
    excess: float
    """‖p − r‖² over the codec's own error energy plus the drift allowance (honest: about 1 or less)."""
    excess_limit: float
    norm_ratio: float
    """‖p‖ / ‖q‖ (1 when q is zero or r could not be coded: not held)."""
    norm_limit: float


def compare_sent(
    sent: Tensor, replayed: Tensor, fmt: Format, tol: SentTolerance = SENT_TOLERANCE
) -> SentComparison:
    """Whether ``sent`` (a decoded payload) is ``fmt``'s coding of ``replayed`` within ``tol``."""
    if sent.shape != replayed.shape:
        why = f"shape {tuple(sent.shape)}, the replay's {tuple(replayed.shape)}"
        return SentComparison(False, why, 0.0, 0.0, 0.0, 0.0)
    p, r = sent.double().flatten(), replayed.double().flatten()
    if not bool(torch.isfinite(p).all()):
        return SentComparison(False, "non-finite values", float("inf"), 0.0, float("inf"), 0.0)
    if not bool(torch.isfinite(r).all()):  # the sender's step would have refused to send it
        return SentComparison(False, "the replayed step computes non-finite values", 0.0, 0.0, 0.0, 0.0)
    coarse = compare_deltas(p, r, tol.coarse)
    try:
        q = round_trip(replayed.float(), fmt).double().flatten()
    except ValueError as exc:  # PayloadError among them: r beyond what the codec carries
        why = f"the replay cannot be coded ({exc}); fixed limits only: {coarse.reason}"
        return SentComparison(coarse.ok, why, 0.0, 0.0, 1.0, 0.0)
    err = (q - r).pow(2)
    codec_energy, r_energy = float(err.sum()), float(r.pow(2).sum())
    allowed = codec_energy + tol.drift**2 * r_energy
    if allowed == 0.0:  # r is zero: so must p be
        ok = not bool(p.any())
        return SentComparison(
            ok, "the replay computed zeros" + ("" if ok else "; it sent otherwise"), 0.0, 0.0, 1.0, 0.0
        )
    excess = float((p - r).pow(2).sum()) / allowed
    spread = float(err.pow(2).sum().sqrt()) / codec_energy if codec_energy > 0 else 0.0
    excess_limit = 1 + tol.energy_slack + tol.energy_spread * spread
    problems = []
    if excess > excess_limit:
        problems.append(f"{excess:.3f}x the codec's error energy > {excess_limit:.3f}")
    q_norm = float(q.norm())
    ratio, norm_limit = 1.0, 0.0
    if q_norm > 0:  # else the codec codes r as zeros: the energy alone is held (class docstring)
        ratio = float(p.norm()) / q_norm
        norm_limit = tol.norm_floor + tol.norm_spread * float((r.pow(2) * err).sum().sqrt()) / r_energy
        if abs(ratio - 1) > norm_limit:
            problems.append(
                f"norm {ratio:.4f}x the codec's coding of the replay, outside 1 ± {norm_limit:.4f}"
            )
        if not coarse.ok:
            problems.append(f"beyond the fixed limits: {coarse.reason}")
    reason = "; ".join(problems) or f"{excess:.3f}x the codec's error energy, norm {ratio:.4f}x"
    return SentComparison(not problems, reason, excess, excess_limit, ratio, norm_limit)


def sent_comparisons(
    claim: SegmentClaim,
    material: SegmentMaterial,
    steps: Sequence[StepInputs],
    outputs: list[dict[str, Tensor]],
) -> Iterator[tuple[int, str, SentComparison | str]]:
    """(step, kind, comparison or what is wrong) for each payload the segment's steps sent on
    (served with the material and bound to the log's `sent` entries by `commitment_problems`):
    what was sent against what the replayed step computed (`replay_segment`'s `outputs`)."""
    first, _ = material.log.segment(material.segment)
    vocab = label_bound(claim.model, claim.stage, claim.num_stages)
    for i, (served, step, out) in enumerate(zip(material.sent, steps, outputs, strict=False)):
        codecs = [
            (ActivationHeader if m.kind == "activations" else GradientReply).from_json(m.header).codec
            for m in material.received[i]
        ]
        for kind, body in served:
            replayed = out.get(kind)
            if replayed is None:
                yield first + i, kind, f"it sent {kind}, which a stage {claim.stage} step does not"
                continue
            if not codecs:
                yield first + i, kind, "it received nothing that names the run's codec"
                continue
            shape = cast(tuple[int, int, int], tuple(replayed.shape))
            try:
                if kind == "activations":
                    sent, labels = decode_activations_as(body, shape, codecs[0], vocab)
                    if not torch.equal(labels, step.labels.long().cpu()):
                        yield first + i, kind, "the activations it sent carry other labels than its step's"
                        continue
                else:
                    sent = decode_gradient(body, shape, codecs[0])
            except Refused as exc:
                yield first + i, kind, f"the {kind} it sent do not decode: {exc}"
                continue
            fmt = codec(codecs[0]).forward if kind == "activations" else codec(codecs[0]).backward
            yield first + i, kind, compare_sent(sent, replayed, fmt)


def sent_problem(
    claim: SegmentClaim,
    material: SegmentMaterial,
    steps: Sequence[StepInputs],
    outputs: list[dict[str, Tensor]],
) -> str | None:
    """The first payload sent on that is not what its replayed step computed within
    SENT_TOLERANCE, or whose activations carry other labels than the step's; None when all are."""
    for i, kind, result in sent_comparisons(claim, material, steps, outputs):
        if isinstance(result, str):
            return f"step {i}: {result}"
        if not result.ok:
            return f"step {i}: the {kind} it sent are not what its step computes ({result.reason})"
    return None


def offer_problem(
    claim: SegmentClaim,
    material: SegmentMaterial,
    failed: Sequence[tuple[int, Tensor, Tensor]],
    offers: Sequence[Tensor],
) -> str | None:
    """The first failed step whose offered activations are not what its replayed forward computed
    (within SENT_TOLERANCE, as a step's), or carry other labels than it was given; None when none."""
    vocab = label_bound(claim.model, claim.stage, claim.num_stages)
    for (n, messages, body), (_, _, labels), replayed in zip(material.failed, failed, offers, strict=True):
        header_codec = ActivationHeader.from_json(messages[0].header).codec
        shape = cast(tuple[int, int, int], tuple(replayed.shape))
        try:
            sent, sent_labels = decode_activations_as(body, shape, header_codec, vocab)
        except Refused as exc:
            return f"failed step {n}: the activations it offered do not decode: {exc}"
        if not torch.equal(sent_labels, labels.long().cpu()):
            return f"failed step {n}: the activations it offered carry other labels than it was given"
        result = compare_sent(sent, replayed, codec(header_codec).forward)
        if not result.ok:
            return f"failed step {n}: the activations it offered are not what its forward computes ({result.reason})"
    return None


# --- 3. the verdict ----------------------------------------------------------------------------


def check_segment(
    claim: SegmentClaim,
    material: SegmentMaterial,
    tolerance: SpotCheckConfig,
    *,
    read_batch: BatchReader | None = None,
) -> SegmentVerdict:
    """Check one served segment: commitments, then replay and comparison (module docstring)."""
    if claim.stage == 0 and read_batch is None:
        raise ValueError("a stage-0 segment check needs read_batch to recompute the batches")
    problems = commitment_problems(material, claim)
    if problems:
        return SegmentVerdict(False, "; ".join(problems[:4]))
    try:
        claim = at_material_vocab(claim, material)
    except ValueError as exc:
        return SegmentVerdict(False, f"the material is not this stage's model: {exc}")
    try:
        steps = step_inputs(material, claim, read_batch)
        failed = failed_inputs(material, claim)
    except Refused as exc:
        return SegmentVerdict(False, f"a recorded payload does not decode: {exc}")
    outputs: list[dict[str, Tensor]] = []
    offers: list[Tensor] = []
    replayed = replay_segment(claim, material, steps, outputs, failed, offers)
    start = material.start.weights
    result = compare_deltas(material.end.weights - start, replayed - start, tolerance)
    counted = material.end.inner.steps - material.start.inner.steps
    if claim.trained_precision in LENIENT_COUNTS:
        uniform = bool((counted == counted[0]).all()) and 0 <= float(counted[0]) <= len(steps)
    else:
        uniform = torch.equal(counted, torch.full_like(counted, float(len(steps))))
    if not uniform:
        return SegmentVerdict(
            False,
            f"the optimizer counted {counted.tolist()[:3]}… steps for a segment of {len(steps)}",
            True,
            result.cosine,
            result.norm_ratio,
        )
    if result.ok:
        problem = sent_problem(claim, material, steps, outputs) or offer_problem(
            claim, material, failed, offers
        )
        if problem is not None:
            return SegmentVerdict(False, problem, True, result.cosine, result.norm_ratio)
    return SegmentVerdict(result.ok, result.reason, True, result.cosine, result.norm_ratio)


# --- fraud proofs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SegmentFraudProof:
    """A segment whose material matched the replica's signed commitment and failed its replay.
    The bytes are the material's (node.segment_store.SegmentMaterial.encode): the commitment's
    signature ties them to the wallet, the senders' signatures tie the inputs to them. The
    verifier keeps them under HOME/fraud-proofs (verifier.fraudproofs) and serves them on GET
    /api/fraud-proofs/{sha256}; `neuroshard-check-proof` re-checks one (cli.check_proof)."""

    material: SegmentMaterial

    def encode(self) -> bytes:
        return self.material.encode()

    @classmethod
    def decode(cls, data: bytes, *, numel: int, n_tensors: int) -> SegmentFraudProof:
        return cls(SegmentMaterial.decode(data, numel=numel, n_tensors=n_tensors))

    @staticmethod
    def commitment(data: bytes) -> SegmentCommitment:
        """The signed commitment in proof bytes, read from the header alone: its stage says which
        stage's model (numel, tensors) `decode` needs. Refused when it does not parse; whether
        the signature holds is `judge_fraud_proof`'s question."""
        return SegmentMaterial.read_commitment(data)


@dataclass(frozen=True)
class FraudProofVerdict:
    proves: bool
    """Whether the proof proves fraud by its own signed content."""
    reason: str
    """Why it does (the failed replay's comparison) or why it does not."""


def judge_fraud_proof(
    proof: SegmentFraudProof,
    *,
    model: ModelConfig,
    diloco: DiLoCoConfig,
    num_stages: int,
    tolerance: SpotCheckConfig,
    read_batch: BatchReader | None = None,
    spans: Sequence[tuple[int, int, int]] = (),
    trained_precision: str | None = None,
    network: str | None = None,
) -> FraudProofVerdict:
    """Whether `proof` proves fraud by its own signed content, and why: the commitment is valid
    and the material matches it, and the replay fails. Needs only the run's definition (and, at
    stage 0, its data), whose digest `network` the commitment must name (None: not compared); the
    claim is read from the signed commitment itself. `spans`: the
    receipt's stage-0 data spans, which the signed log must match (not compared when empty).
    `trained_precision`: the receipt's (fp16's optimizer may skip overflowed steps), or
    `ANY_PRECISION` when not known: the step counts are then held to the rule every precision
    meets; the replay itself does not depend on it."""
    c = proof.material.commitment
    if not 0 <= c.stage < num_stages:
        return FraudProofVerdict(False, f"the commitment is for stage {c.stage}; the run has {num_stages}")
    claim = SegmentClaim(
        model=model, diloco=diloco, num_stages=num_stages, stage=c.stage, round=c.round,
        wallet=c.wallet, root=c.root, spans=spans, trained_precision=trained_precision, network=network,
    )  # fmt: skip
    problems = commitment_problems(proof.material, claim)
    if problems:  # not attributable: the material is not what the wallet signed
        return FraudProofVerdict(False, "; ".join(problems[:4]))
    try:
        verdict = check_segment(claim, proof.material, tolerance, read_batch=read_batch)
    except SpotCheckError as exc:
        return FraudProofVerdict(False, f"the segment cannot be replayed: {exc}")
    if verdict.ok:
        return FraudProofVerdict(False, f"the replay agrees with the committed end: {verdict.reason}")
    if not verdict.replayed:
        return FraudProofVerdict(False, verdict.reason)
    return FraudProofVerdict(True, verdict.reason)


SENDER_PROOF_MAGIC = b"NSSENDER1\n"
"""The first bytes of a `SenderFraudProof` (a `SegmentFraudProof` begins with its safetensors
header's length, never with these)."""
SENDER_PROOF_KEYS = frozenset({"log", "kind", "header"})


@dataclass(frozen=True)
class SenderFraudProof:
    """A sender whose signed round log contradicts a header it signed for a receiver
    (`contradicting`): the log with its signed commitment, and the header as the receiver recorded
    it. Both contradicting statements carry the sender's own signature, and the header names the
    exchange (its micro-batch and its recipient, `to`), so the proof needs nothing else, no
    definition, no data and no replay; the payload is not kept (the header signs its sha256, and
    that is what the log contradicts). One proof has one encoding (canonical JSON, the header in
    its canonical form, the log without the opening of its end checkpoint), so it is kept and
    listed under one sha256, like a segment proof (verifier.fraudproofs); `neuroshard-check-proof`
    re-checks it alone."""

    log: SignedSegmentLog
    message: Received

    @property
    def receiver(self) -> str:
        """The public key (64 hex) the header is addressed to: the log's steps that name an
        exchange with it make the claim."""
        return self._header().to

    def _header(self) -> ActivationHeader | GradientReply:
        parse = ActivationHeader.from_json if self.message.kind == "activations" else GradientReply.from_json
        return parse(self.message.header)

    def encode(self) -> bytes:
        bare = SignedSegmentLog(self.log.log, self.log.commitment)  # the end opening proves nothing here
        obj = {
            "log": parse_json(bare.encode(), "signed segment log"),
            "kind": self.message.kind,
            "header": self._header().to_json().decode(),  # the schema's form: one per header
        }
        return SENDER_PROOF_MAGIC + canonical_json(obj)

    @classmethod
    def decode(cls, data: bytes) -> SenderFraudProof:
        """Refused ("malformed") for anything but a sender proof's exact shape, its one encoding."""
        if not data.startswith(SENDER_PROOF_MAGIC):
            raise malformed("not a sender fraud proof (no NSSENDER1 line)")
        body = data[len(SENDER_PROOF_MAGIC) :]
        obj = parse_json(body, "sender fraud proof")
        if not isinstance(obj, dict) or set(obj) != SENDER_PROOF_KEYS:
            raise malformed(f"a sender fraud proof holds exactly {', '.join(sorted(SENDER_PROOF_KEYS))}")
        kind, header = obj["kind"], obj["header"]
        if kind not in ("activations", "gradient") or not isinstance(header, str):
            raise malformed("a sender fraud proof's kind is activations or gradient, its header a string")
        try:
            raw = header.encode()
        except UnicodeError:
            raise malformed("a sender fraud proof's header is not text") from None
        if not isinstance(obj["log"], dict) or "end" in obj["log"]:
            raise malformed("a sender fraud proof's log holds its commitment and log, nothing else")
        log = SignedSegmentLog.decode(canonical_json(obj["log"]))
        parse = ActivationHeader.from_json if kind == "activations" else GradientReply.from_json
        proof = cls(log, Received(kind, parse(raw).wallet, raw, b""))
        if proof.encode() != data:
            raise malformed("a sender fraud proof has one encoding: canonical JSON, its header canonical")
        return proof

    def step(self) -> int | None:
        """The first step of the log that names the header's micro-batch and an exchange with the
        receiver (where the contradiction lies); None when there is none (a header the log does
        not list: the whole round's log is the proof)."""
        micro_batch, receiver = self._header().micro_batch, self.receiver
        for i, step in enumerate(self.log.log.steps):
            if step.micro_batch == micro_batch and any(r.sender == receiver for r in step.received):
                return i
        return None

    def segment(self) -> int:
        """The segment of the log holding `step` (0 when there is none)."""
        i = self.step()
        log = self.log.log
        return next((j for j in range(log.segments) if i is not None and i < log.segment(j)[1]), 0)


def judge_sender_proof(
    proof: SenderFraudProof, *, num_stages: int | None = None, network: str | None = None
) -> FraudProofVerdict:
    """Whether `proof` proves fraud by its own signed content, and why: the log is signed by the
    wallet that signed the header, its chain hashes to the root that signature covers, and it does
    not list the header among those it signed, or a step of it that exchanged with the replica
    the header is addressed to records sending something other than the payload the header signs
    (`contradicting`), though the header names the log's round; both name one run
    (their definition's digest: ids and rounds repeat across a wallet's runs). `num_stages` and
    `network` (its digest), when the run's definition is at hand: the commitment's stage must be one
    that sends what the header carries, and the run the definition's."""
    c = proof.log.commitment
    problem = signed_log_problem(proof.log, c.wallet, c.stage, c.round, c.root)
    if problem is not None:
        return FraudProofVerdict(False, problem)
    if network is not None and c.network != network:
        return FraudProofVerdict(
            False, "its log is not of this run (it names another definition's digest, or none)"
        )
    if num_stages is not None:
        kind = proof.message.kind  # activations go to the next stage, gradients back to the one before
        sends = 0 <= c.stage < num_stages - 1 if kind == "activations" else 1 <= c.stage < num_stages
        if not sends:
            return FraudProofVerdict(
                False, f"no stage {c.stage} replica sends {kind} in a run of {num_stages} stages"
            )
    found = contradicting(proof.log, [proof.message], proof.receiver)
    if not found:
        return FraudProofVerdict(
            False,
            "the log does not contradict the header (another signer, round or run, or the header is recorded)",
        )
    receiver = wallet_id_of(bytes.fromhex(proof.receiver))
    return FraudProofVerdict(True, f"its signed log contradicts what it signed for {receiver}: {found[0][1]}")


CONTINUITY_PROOF_MAGIC = b"NSCONTIN1\n"
"""The first bytes of a `ContinuityFraudProof`."""
CONTINUITY_PROOF_KEYS = frozenset({"log", "previous", "start_inner", "numel"})


@dataclass(frozen=True)
class ContinuityFraudProof:
    """A replica whose round started from an inner optimizer state that is neither fresh nor the
    one its previous round ended with (`continuity_problem`: it chose its AdamW moments between
    rounds). It holds the round's signed log, θ_round's bytes and the sha256 of the starting
    optimizer state (together they open the log's first checkpoint), and the replica's signed log
    of the round before with the opening of its last checkpoint (none for round 0, which must start
    fresh). Everything but the fresh state's digest is the replica's own signature or opens it: θ's
    bytes fix the model's size, and with the run's definition (its number of parameter tensors)
    the digest of a fresh optimizer of that size (node.replay.fresh_inner_digest). Both
    commitments name the run (SegmentCommitment.network, the definition's digest): within one run
    an honest node signs one log per round, so two signed logs that do not chain are its own
    contradiction (across runs of one wallet, round numbers repeat).

    One encoding: the NSCONTIN1 line, canonical JSON (the logs, `start_inner`, `numel`), a newline,
    then θ as `numel` little-endian float32 values. θ is 4 bytes per parameter: a continuity proof
    is a seventh of a segment proof (verifier.fraudproofs)."""

    log: SignedSegmentLog
    start_inner: str
    theta: bytes
    """θ_round, float32 little-endian: its sha256 is the first checkpoint's weights hash."""
    previous: SignedSegmentLog | None

    @property
    def numel(self) -> int:
        return len(self.theta) // 4

    def encode(self) -> bytes:
        bare = SignedSegmentLog(self.log.log, self.log.commitment)  # its own end opening proves nothing here
        obj = {
            "log": parse_json(bare.encode(), "signed segment log"),
            "previous": None
            if self.previous is None
            else parse_json(self.previous.encode(), "signed segment log"),
            "start_inner": self.start_inner,
            "numel": self.numel,
        }
        return CONTINUITY_PROOF_MAGIC + canonical_json(obj) + b"\n" + self.theta

    @staticmethod
    def read_head(data: bytes) -> dict[str, object]:
        """The proof's JSON part (what bounds the rest: its stage and θ's length), from its first
        line after the magic; Refused ("malformed") unless it has exactly the proof's keys."""
        if not data.startswith(CONTINUITY_PROOF_MAGIC):
            raise malformed("not a continuity fraud proof (no NSCONTIN1 line)")
        end = data.find(b"\n", len(CONTINUITY_PROOF_MAGIC))
        if end < 0:
            raise malformed("a continuity fraud proof's JSON line has no end")
        obj = parse_json(data[len(CONTINUITY_PROOF_MAGIC) : end], "continuity fraud proof")
        if not isinstance(obj, dict) or set(obj) != CONTINUITY_PROOF_KEYS:
            raise malformed(
                f"a continuity fraud proof holds exactly {', '.join(sorted(CONTINUITY_PROOF_KEYS))}"
            )
        numel = obj["numel"]
        if type(numel) is not int or numel < 1:
            raise malformed("a continuity fraud proof's numel is a positive integer")
        return obj

    @classmethod
    def decode(cls, data: bytes) -> ContinuityFraudProof:
        """Refused ("malformed") for anything but a continuity proof's exact shape, its one encoding."""
        obj = cls.read_head(data)
        theta = data[data.index(b"\n", len(CONTINUITY_PROOF_MAGIC)) + 1 :]
        if len(theta) != 4 * cast(int, obj["numel"]):
            raise malformed(
                f"a continuity fraud proof's θ holds {len(theta)} bytes, numel says {4 * cast(int, obj['numel'])}"
            )
        start_inner = obj["start_inner"]
        if (
            not isinstance(start_inner, str)
            or len(start_inner) != 64
            or set(start_inner) - set("0123456789abcdef")
        ):
            raise malformed("a continuity fraud proof's start_inner is a sha256 (64 lowercase hex digits)")
        log_obj, previous_obj = obj["log"], obj["previous"]
        if not isinstance(log_obj, dict) or "end" in log_obj:
            raise malformed("a continuity fraud proof's log holds its commitment and log, nothing else")
        if previous_obj is not None and not isinstance(previous_obj, dict):
            raise malformed("a continuity fraud proof's previous log is a signed log or null")
        log = SignedSegmentLog.decode(canonical_json(log_obj))
        previous = None if previous_obj is None else SignedSegmentLog.decode(canonical_json(previous_obj))
        proof = cls(log, start_inner, theta, previous)
        if proof.encode() != data:
            raise malformed("a continuity fraud proof has one encoding: canonical JSON, then θ's bytes")
        return proof

    @classmethod
    def of(
        cls, log: SignedSegmentLog, theta_round: Tensor, start_inner: str, previous: SignedSegmentLog | None
    ) -> ContinuityFraudProof:
        data = theta_round.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
        return cls(log, start_inner, data.astype("<f4").tobytes(), previous)


def judge_continuity_proof(
    proof: ContinuityFraudProof, *, n_tensors: int, network: str, num_stages: int | None = None
) -> FraudProofVerdict:
    """Whether `proof` proves fraud by its own signed content, and why (`ContinuityFraudProof`).
    `n_tensors`: the stage's parameter tensors (the run's definition: verifier.stageshape), which
    with θ's length fix a fresh optimizer's digest; `network`: that definition's digest, which
    both logs' commitments must name; `num_stages`, when the definition is at hand: the
    commitment's stage must be one of the run's."""
    signed = proof.log
    c, log = signed.commitment, signed.log
    problem = signed_log_problem(signed, c.wallet, c.stage, c.round, c.root)
    if problem is not None:
        return FraudProofVerdict(False, problem)
    if c.network != network:
        return FraudProofVerdict(
            False, "its log is not of this run (it names another definition's digest, or none)"
        )
    if num_stages is not None and not 0 <= c.stage < num_stages:
        return FraudProofVerdict(False, f"the proof is for stage {c.stage}, the run has {num_stages}")
    if not log.checkpoints:
        return FraudProofVerdict(False, "its log holds no checkpoint")
    opening = CheckpointOpening(
        weights_sha256=hashlib.sha256(proof.theta).hexdigest(), inner_sha256=proof.start_inner
    )
    if opening.sha256() != log.checkpoints[0]:
        return FraudProofVerdict(False, "θ and start_inner do not open the log's first checkpoint")
    if proof.start_inner == fresh_inner_digest(proof.numel, n_tensors):
        return FraudProofVerdict(False, f"round {log.round} starts with a fresh inner optimizer")
    where = f"round {log.round} starts from an inner optimizer state that is not fresh"
    if log.round == 0:
        return FraudProofVerdict(True, f"{where}: a run's first round starts fresh")
    previous = proof.previous
    if previous is None:
        return FraudProofVerdict(False, f"{where}, and the proof holds no log of round {log.round - 1}")
    p = previous.commitment
    problem = signed_log_problem(previous, c.wallet, c.stage, log.round - 1, p.root)
    if problem is not None:
        return FraudProofVerdict(False, f"its round {log.round - 1} log: {problem}")
    if c.network is None or p.network != c.network:
        # One wallet may train several runs, whose round numbers repeat: only logs of one run chain.
        return FraudProofVerdict(False, "its two logs do not name one run (their definitions' digest)")
    end = previous.end
    if end is None or not previous.log.checkpoints or end.sha256() != previous.log.checkpoints[-1]:
        return FraudProofVerdict(False, f"its round {log.round - 1} log does not open its last checkpoint")
    if end.inner_sha256 == proof.start_inner:
        return FraudProofVerdict(
            False, f"round {log.round} continues the state its round {log.round - 1} ended with"
        )
    return FraudProofVerdict(
        True, f"{where}, nor the one its round {log.round - 1} ended with (both logs signed by it)"
    )
