"""Bodies of the signed writes nodes send to the verifier (JSON), as strict pydantic models.

One definition for sender and receiver. Every model forbids unknown fields and is strict
(no "3" for 3, no true for 1); floats must be finite. The signer's identity is not in the
body: it is the X-NeuroShard-Wallet header the signature is checked against (verifier.auth).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

HexDigest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
"""sha256, lower-case hex."""
WalletId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{20}$")]
"""node.wallet.wallet_id_of(public key)."""
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
"""Fits a 32-bit signed INTEGER column in both SQLite and PostgreSQL."""
MAX_TOKENS = 2**40
"""Tokens one replica may claim for one round: ~1.1e12, a thousand times a production round
(H=500 steps of 1M-token batches is 5e8). Bounded so the store sums them without overflow: SQLite's
SUM is a 64-bit integer that raised "integer overflow" on four receipts of 2^62 (issue 19), and
summary.totals sums in double precision besides, exact up to 2^53 tokens in all."""
MAX_LOSS = 1e6
"""Largest self-reported inner-step loss (nats): ~10^5 times the loss of a uniform guess over any
vocabulary; a number past it is no cross-entropy. 10,000 of them sum to 1e10, far from a float's
range, so a round's loss sum cannot overflow to inf (1e308 losses did)."""
Loss = Annotated[float, Field(ge=0.0, le=MAX_LOSS, allow_inf_nan=False)]
"""A cross-entropy in nats: finite and never negative (-1e308 was accepted and shown, issue 19)."""

MAX_STAGES = 1024
MAX_LOSSES = 10_000
"""Self-reported inner-step losses per receipt: one per step for H up to 10,000."""
MAX_SPANS = 256
MAX_CONTRIBUTIONS = 1024
"""Accepted, rejected and equivocating wallets per receipt: far above any stage's replica count."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RegisterRequest(_Wire):
    """POST /api/register: a wallet announces where it can be reached and which stage it trains."""

    address: Annotated[
        str, StringConstraints(pattern=r"^https?://[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}/?$", max_length=255)
    ] = Field(description="Base URL of the node's peer plane, e.g. http://203.0.113.5:9000")
    stage: Annotated[int, Field(ge=0, lt=MAX_STAGES)] = Field(description="The stage this replica holds.")
    software_version: Annotated[
        str, StringConstraints(pattern=r"^[0-9A-Za-z.+\-_]+$", min_length=1, max_length=64)
    ] = Field(description="neuroshard version string of the node, e.g. 0.1.0.")
    pow_nonce: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = Field(
        default=None,
        description="Registration proof of work (node.roster.solve_pow): required for a new wallet when "
        "the verifier asks for one (GET /api/admission: pow_bits > 0).",
    )


class HeartbeatRequest(_Wire):
    """POST /api/heartbeat: still alive, and how far into DiLoCo the replica is."""

    stage: Annotated[int, Field(ge=0, lt=MAX_STAGES)]
    round: Count = Field(description="Current outer round.")
    steps_in_round: Count = Field(description="Inner steps done in the current round.")


class DataSpan(_Wire):
    """A run of windows read from one shard: positions [offset_start, offset_end) of the shard's
    window permutation (data.shards.window_order seeded by the wallet id)."""

    shard_id: Count
    offset_start: Count
    offset_end: Count

    @model_validator(mode="after")
    def _ordered(self) -> DataSpan:
        if self.offset_end < self.offset_start:
            raise ValueError(f"offset_end {self.offset_end} < offset_start {self.offset_start}")
        return self


class AcceptedContribution(_Wire):
    wallet: WalletId
    payload_sha256: HexDigest | None = Field(
        default=None, description="sha256 of the aggregated payload, if known."
    )


class RejectedContribution(_Wire):
    wallet: WalletId
    reason: Annotated[str, StringConstraints(min_length=1, max_length=200)]


class ReceiptRequest(_Wire):
    """POST /api/receipts: one replica's work in one round of one stage."""

    stage: Annotated[int, Field(ge=0, lt=MAX_STAGES)]
    round: Count
    inner_steps: Annotated[int, Field(ge=1, le=1_000_000)] = Field(description="H actually run this round.")
    start_step: Count = Field(description="Global inner step at the round's start (for the lr schedule).")
    tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] = Field(description="Tokens trained on this round.")
    data: list[DataSpan] = Field(
        max_length=MAX_SPANS,
        description="What was read, in order; stage 0 reads the data, later pipeline stages send [].",
    )
    losses: list[Loss] = Field(
        max_length=MAX_LOSSES, description="Self-reported inner-step losses (nats, 0..MAX_LOSS)."
    )
    base_hash: HexDigest = Field(description="sha256 of θ_round the replica started from.")
    result_hash: HexDigest = Field(description="sha256 of θ_{round+1} after the outer step.")
    delta_digest: HexDigest = Field(description="sha256 of this replica's own pseudo-gradient Δ.")
    inner_state_digest: HexDigest | None = Field(
        default=None,
        description="sha256 of the replica's inner AdamW state at the round's start (node.replay.InnerState), "
        "committed before any spot check asks for it; required for a replay spot check.",
    )
    device: Literal["cpu", "cuda", "mps"] | None = Field(
        default=None,
        description="Where the inner steps ran (node.device); None from nodes before issue 14 (CPU).",
    )
    precision: Literal["fp32", "bf16", "fp16"] | None = Field(
        default=None,
        description="The inner steps' autocast precision over fp32 master weights; picks the replay's "
        "acceptance (verifier.replaycheck.tolerance_for). None from nodes before issue 14 (fp32).",
    )
    segment_root: HexDigest | None = Field(
        default=None,
        description="Root of the replica's segment log for this round (node.segments.SegmentLog.root): its "
        "step records and its weights' and optimizer's hash every k inner steps, committed before any "
        "segment check. None from nodes before issue 17: accepted, and only a whole-round replay "
        "(stage 0) can check them.",
    )
    segments: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(
        default=None, description="Segments in that log (ceil(inner_steps / k)); given with segment_root."
    )
    accepted: list[AcceptedContribution] = Field(default_factory=list, max_length=MAX_CONTRIBUTIONS)
    rejected: list[RejectedContribution] = Field(default_factory=list, max_length=MAX_CONTRIBUTIONS)
    equivocators: list[WalletId] = Field(
        default_factory=list,
        max_length=MAX_CONTRIBUTIONS,
        description="Wallets caught sending two different signed payloads for this (stage, round).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ReceiptRequest:
        if self.stage == 0 and not self.data:
            raise ValueError("a stage-0 receipt must say which data it read (data is empty)")
        if len(self.losses) > self.inner_steps:
            raise ValueError(f"{len(self.losses)} losses for {self.inner_steps} inner steps")
        if (self.segment_root is None) != (self.segments is None):
            raise ValueError("segment_root and segments come together or not at all")
        if self.segments is not None and self.segments > self.inner_steps:
            raise ValueError(f"{self.segments} segments for {self.inner_steps} inner steps")
        return self


class ReinstateRequest(_Wire):
    """POST /api/admin/reinstate (operator-signed): let a refused wallet back in."""

    wallet_id: WalletId
    reputation: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = Field(
        default=None, description="Reputation to restart from; default: the configured initial value."
    )
