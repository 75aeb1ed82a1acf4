"""Response shapes of the verifier's HTTP API (request bodies are neuroshard.protocol.reports).

Times are unix seconds. Losses are mean next-token cross-entropy in nats. "Measured" losses
come from the verifier's own evaluation of the majority model on held-out data; "reported"
losses are what nodes wrote in their receipts and never decide anything.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from neuroshard.verifier.verdict import Trend


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True, frozen=True)


class ErrorOut(_Out):
    detail: str = Field(description="What was wrong, in one sentence.")
    error: str | None = Field(
        default=None,
        description="The refusal's machine-readable code (neuroshard.protocol.refusal), e.g. stale, replayed.",
    )


class WriteAck(_Out):
    status: Literal["registered", "alive", "recorded", "duplicate", "reinstated", "accepted"] = Field(
        description="'duplicate': an identical receipt was already recorded; nothing changed."
    )
    wallet_id: str
    reputation: float | None = None
    heartbeat_interval_s: float | None = Field(
        default=None, description="How often to POST /api/heartbeat to stay in the peer list."
    )


class NodeOut(_Out):
    wallet_id: str
    public_key: str
    status: Literal["active", "refused"]
    status_reason: str | None
    reputation: float = Field(description="0..1; refused under the configured threshold.")
    registered_at: float
    software_version: str
    address: str | None
    stage: int | None
    last_heartbeat: float | None
    alive: bool = Field(description="Heartbeat within the peer TTL.")
    round: int | None = Field(description="Outer round at the last heartbeat.")
    steps_in_round: int | None = Field(description="Inner steps into that round at the last heartbeat.")


class PeerOut(_Out):
    wallet_id: str
    public_key: str
    address: str
    stage: int
    last_heartbeat: float
    reputation: float


class ReceiptOut(_Out):
    stage: int
    round: int
    inner_steps: int
    tokens: int
    result_hash: str
    in_majority: bool | None = Field(
        description="None until the round settles (or without a strict majority)."
    )
    mean_loss: float | None = Field(description="Self-reported mean inner-step loss.")
    accepted: int
    rejected: int
    received_at: float


class EventOut(_Out):
    stage: int | None
    round: int | None
    delta: float
    reason: str
    created_at: float


class NodeDetailOut(_Out):
    node: NodeOut
    receipts: int
    recent_receipts: list[ReceiptOut]
    recent_events: list[EventOut] = Field(description="Recent verdicts on this wallet, newest first.")


class VerifyOut(_Out):
    training_verified: bool = Field(
        description="True only when the measured held-out loss fell significantly since the first evaluation."
    )
    reason: str
    global_loss: float | None = Field(description="Latest measured held-out loss.")
    initial_loss: float | None = Field(description="First measured held-out loss.")
    loss_drop: float | None
    required_drop: float | None
    loss_trend: Trend
    loss_slope_per_round: float | None
    evaluations: int
    reported_loss: float | None = Field(
        description="Self-reported loss of the latest round: shown, never judged."
    )
    hash_agreement_rate: float | None
    sync_success_rate: float | None
    active_nodes: int
    rounds: int = Field(description="Outer rounds reported so far (highest round in any receipt + 1).")
    rounds_settled: int


class StageOut(_Out):
    stage: int
    replicas_alive: int
    latest_round: int | None
    settled: bool
    majority_hash: str | None
    hash_agreement_rate: float | None
    accepted_contributions: int
    rejected_contributions: int


class DiLoCoOut(_Out):
    inner_steps_per_round: int
    outer_rounds: int
    inner_progress: float | None = Field(
        description="Mean fraction of H done in the current round by live nodes."
    )
    aggregation_rule: str
    aggregation_f: int
    outer_lr: float
    outer_momentum: float


class GlobalOut(_Out):
    network: str
    training_verified: bool
    reason: str
    nodes_training: int
    nodes_registered: int
    nodes_refused: int
    global_loss_measured: float | None
    global_loss_reported: float | None
    total_inner_steps: int
    total_tokens: int
    data_shards_covered: int
    hash_agreement_rate: float | None
    sync_success_rate: float | None
    stages: list[StageOut]
    diloco: DiLoCoOut


class EvaluationOut(_Out):
    round: int
    loss: float
    stderr: float | None
    tokens: int
    created_at: float


class RoundOut(_Out):
    stage: int
    round: int
    settled: bool
    votes: int
    agreeing: int
    agreement_rate: float | None
    majority_hash: str | None
    synced: int
    sync_checked: int
    accepted: int
    rejected: int
    reported_loss: float | None


class HistoryOut(_Out):
    evaluations: list[EvaluationOut] = Field(description="Measured held-out losses, oldest first.")
    rounds: list[RoundOut] = Field(
        description="Recent (stage, round)s: agreement and reported loss, oldest first."
    )


class TextSampleOut(_Out):
    round: int = Field(description="Stage 0's round of the measured majority model that wrote it.")
    prompt: str = Field(description="The fixed prompt every sample continues.")
    text: str = Field(
        description="The continuation (without the prompt), as generated: plain text, not HTML."
    )
    max_new_tokens: int = Field(description="Tokens asked for; fewer when the model ended the text.")
    temperature: float = Field(description="Sampling temperature (0: greedy).")
    seed: int | None = Field(description="Sampling seed: the same weights give the same text.")
    created_at: float


class SampleOut(_Out):
    sample: TextSampleOut | None = Field(description="The latest sample; null until the first one.")
    every_evaluations: int | None = Field(
        description="The verifier writes a sample every this many evaluations; null: it writes none."
    )


class StageModelOut(_Out):
    stage: int
    round: int = Field(description="The stage's own round R: its weights are the result of round R − 1.")
    theta_hash: str = Field(description="The settled majority θ hash of that result (sha256, hex).")


class ModelFileOut(_Out):
    round: int = Field(description="Stage 0's round, as in the evaluations.")
    bytes: int = Field(description="Size of GET /api/training/models/{round} (safetensors, fp32).")
    tokenizer_sha256: str | None
    stages: list[StageModelOut] = Field(description="Where each stage's weights come from, stage 0 first.")


class ModelsOut(_Out):
    models: list[ModelFileOut] = Field(
        description="The measured majority models the verifier keeps, oldest first (the newest few)."
    )


class FraudProofOut(_Out):
    sha256: str = Field(
        description="sha256 of the proof's bytes: its name in GET /api/fraud-proofs/{sha256}."
    )
    wallet_id: str = Field(description="The wallet whose signed commitment the proof holds.")
    stage: int
    round: int
    segment: int = Field(
        description="The round's segment whose replay failed; of a sender proof, the segment of the "
        "sender's log holding the step that contradicts its header; of a continuity proof, 0."
    )
    kind: str = Field(
        description='"segment": a segment whose replay failed (needs the run\'s definition, and at '
        'stage 0 its data, to check); "sender": the wallet\'s signed round log contradicts a header '
        'it signed (checks alone); "continuity": the round starts from an optimizer state neither '
        "fresh nor the one the wallet's round before ended with (checks with the run's definition)."
    )
    reason: str = Field(description="The verifier's verdict.")
    size_bytes: int
    data_spans: list[list[int]] = Field(
        description="Stage 0: the receipt's [[shard_id, offset_start, offset_end], ...], for "
        "neuroshard-check-proof --spans; [] at later stages."
    )
    device: str | None = Field(
        description="The receipt's device (None: CPU); with precision it sets the tolerance."
    )
    precision: str | None = Field(description="The receipt's precision (None: fp32).")
    created_at: float
    download: str = Field(description="Path of the proof's bytes on this verifier.")


class FraudProofsOut(_Out):
    proofs: list[FraudProofOut] = Field(description="Fraud proofs, newest first.")
    served: bool = Field(
        description="Whether this verifier process serves the proofs' bytes (false: listed, not kept here)."
    )


class UnnoticedOut(_Out):
    lie_fraction: float = Field(description="Share of its rounds a wallet lies in.")
    rounds: int
    probability: float = Field(
        description="Upper bound on the chance it is still uncaught after that many rounds."
    )


class WalletCoverageOut(_Out):
    wallet_id: str
    check_probability: float = Field(description="Chance one of its rounds is drawn at random for a replay.")
    last_check_round: int | None = Field(
        description="Round of its latest replay verdict; None: never checked."
    )
    last_check_at: float | None


class CoverageOut(_Out):
    mode: Literal["off", "rate", "budget"] = Field(
        description="--replay-rate, --replay-budget, or no replays."
    )
    budget_replicas: float | None
    sample_rate: float | None
    latest_round: int | None
    window_rounds: int
    wallets_reporting: int = Field(description="Wallets with a stage-0 receipt in the window.")
    wallets_checked: int = Field(
        description="Of those, wallets with a replay verdict for a round in the window."
    )
    max_gap_rounds: int | None = Field(
        description="Budget mode: every wallet is checked at least once in this many rounds."
    )
    mean_check_probability: float
    unnoticed: list[UnnoticedOut] = Field(description="For the mean wallet, by lie fraction and horizon.")
    wallets: list[WalletCoverageOut] = Field(description="A page of wallets by id (limit/offset).")


class MemberListOut(_Out):
    """protocol.roster.MemberList: one stage's members at one epoch, signed by the verifier's key.
    Check it with `MemberList.from_json(body).verify(operator_key, network=..., now=...)`."""

    wallet: str = Field(description="The signer: the verifier's (operator's) public key, hex.")
    signature: str = Field(description="Ed25519 over DOMAIN + canonical JSON of the other fields, hex.")
    network: str
    stage: int
    epoch: int = Field(description="Grows with every change of the stage's membership.")
    effective_round: int = Field(
        description="The round this list applies from: a node keeps its previous list until then, so the "
        "whole stage switches at one round boundary."
    )
    expires_at: int = Field(description="Unix seconds after which a node must refuse this list.")
    policy: Literal["open", "probation", "allowlist"]
    admitted: list[str] = Field(description="Public keys that count in rounds, majorities and quorums.")
    probation: list[str] = Field(
        description="Public keys earning admission: exchanged, screened, not counted."
    )
    admission_rounds: int
    vocab_size: int | None = Field(
        default=None,
        description="The vocabulary the stage's embedding (stage 0) or head (the last stage) has from "
        "vocab_from_round on, after the publisher grew the tokenizer; absent: the network definition's.",
    )
    vocab_from_round: int | None = Field(
        default=None,
        description="The first round of the stage trained at vocab_size (every replica grows there); "
        "given with vocab_size.",
    )


class AdmissionOut(_Out):
    """What it takes to join this run (issue 19)."""

    network: str
    policy: Literal["open", "probation", "allowlist"]
    admission_rounds: int = Field(description="Settled rounds with the stage majority a probationer needs.")
    spot_checks_required: int = Field(
        description="Replay spot checks passed before admission (segment checks at every stage)."
    )
    pow_bits: int = Field(
        description="Leading zero bits of sha256(protocol.roster.POW_DOMAIN, network, public key, pow_nonce) "
        "a new wallet's registration needs; 0: none."
    )
    new_wallets_per_source_per_hour: float | None = Field(description="None: not limited.")
    roster_version: int | None = Field(description="The operator's roster in force, if any.")
