"""What a node tells the verifier: registration, heartbeats, round receipts; and the operator's reinstatement.

Bodies of the signed writes (POST /api/register, /api/heartbeat, /api/receipts,
/api/admin/reinstate). The signer's identity is not in the body: it is the
X-NeuroShard-Wallet header the request signature is checked against (`protocol.signing`).
Wallets inside a receipt are wallet ids (`identity.wallet_id_of`), not public keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from .pipeline import MICRO_BATCH_BYTES, GradientReply
from .refusal import invalid
from .schema import Message, choice, hex_bytes, integer, list_of, matching, message, number, optional, text

MAX_STAGES = 1024
COUNT_MAX = 2**31 - 1
"""Counts fit a 32-bit signed INTEGER column in both SQLite and PostgreSQL."""
MAX_TOKENS = 2**40
"""Tokens one replica may claim for one round: ~1.1e12, a thousand times a production round
(H=500 steps of 1M-token batches is 5e8). Bounded so the store sums them without overflow: SQLite's
SUM is a 64-bit integer that raised "integer overflow" on four receipts of 2^62 (issue 19), and
summary.totals sums in double precision besides, exact up to 2^53 tokens in all."""
MAX_LOSS = 1e6
"""Largest self-reported inner-step loss (nats): ~10^5 times the loss of a uniform guess over any
vocabulary; a number past it is no cross-entropy. 10,000 of them sum to 1e10, far from a float's
range, so a round's loss sum cannot overflow to inf (1e308 losses did)."""
MAX_LOSSES = 10_000
"""Self-reported inner-step losses per receipt: one per step for H up to 10,000."""
MAX_SPANS = 256
MAX_CONTRIBUTIONS = 1024
"""Accepted, rejected and equivocating wallets per receipt: far above any stage's replica count."""
MAX_REASON_CHARS = 200
MAX_INNER_STEPS = 1_000_000

Stage = Annotated[int, integer(0, MAX_STAGES - 1)]
Count = Annotated[int, integer(0, COUNT_MAX)]
Sha256 = Annotated[str, hex_bytes(32)]
WalletId = Annotated[str, hex_bytes(10)]
"""identity.wallet_id_of(public key): 20 lowercase hex characters."""


@dataclass(frozen=True, kw_only=True)
class RegisterRequest(Message):
    """POST /api/register: a wallet announces where it can be reached and which stage it trains."""

    NAME = "register request"
    address: Annotated[
        str, matching(r"https?://[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}/?", 255, "http(s)://host:port")
    ]
    """Base URL of the node's peer plane, e.g. http://203.0.113.5:9000."""
    stage: Stage
    """The stage this replica holds."""
    software_version: Annotated[str, matching(r"[0-9A-Za-z.+\-_]{1,64}", 64, "a version string")]
    """neuroshard version string of the node, e.g. 0.1.0."""
    pow_nonce: Annotated[int | None, optional(integer(0, 2**63 - 1))] = None
    """Registration proof of work (protocol.roster.solve_pow): required for a new wallet when the
    verifier asks for one (GET /api/admission: pow_bits > 0)."""


@dataclass(frozen=True, kw_only=True)
class HeartbeatRequest(Message):
    """POST /api/heartbeat: still alive, and how far into DiLoCo the replica is."""

    NAME = "heartbeat request"
    stage: Stage
    round: Count
    """Current outer round."""
    steps_in_round: Count
    """Inner steps done in the current round."""


@dataclass(frozen=True, kw_only=True)
class DataSpan(Message):
    """A run of windows read from one shard: positions [offset_start, offset_end) of the shard's
    window permutation (data.shards.window_order seeded by the wallet id)."""

    NAME = "data span"
    shard_id: Count
    offset_start: Count
    offset_end: Count

    def check(self) -> None:
        if self.offset_end < self.offset_start:
            raise invalid(f"offset_end {self.offset_end} < offset_start {self.offset_start}")


@dataclass(frozen=True, kw_only=True)
class AcceptedContribution(Message):
    NAME = "accepted contribution"
    wallet: WalletId
    payload_sha256: Annotated[str | None, optional(hex_bytes(32))] = None
    """sha256 of the aggregated payload, if known."""


@dataclass(frozen=True, kw_only=True)
class RejectedContribution(Message):
    NAME = "rejected contribution"
    wallet: WalletId
    reason: Annotated[str, text(MAX_REASON_CHARS, min_chars=1)]


MAX_DISPUTES = 2
"""Disputed micro-batches one receipt names: each may cost the verifier a segment check of every
replica it names, so a replica reports the first two of a round."""
MAX_DISPUTE_REPLIES = 3
"""The answers an audit compares at most (the first, a second opinion, a third)."""


@dataclass(frozen=True, kw_only=True)
class Dispute(Message):
    """A micro-batch whose audit found the next stage's answers apart (node.p2p.pipeline
    `PipelineClient._audit`): the answers' signed replies, each its replica's word that it
    answered this micro-batch in the round it names, addressed to the receipt's wallet. The
    verifier holds each replier to its own signed round log and replays the segment that stepped on
    the micro-batch (verifier.replaycheck), whoever an audit could not outvote."""

    NAME = "dispute"
    micro_batch: Annotated[str, hex_bytes(MICRO_BATCH_BYTES)]
    replies: Annotated[tuple[GradientReply, ...], list_of(message(GradientReply), MAX_DISPUTE_REPLIES)]

    def check(self) -> None:
        if len(self.replies) < 2:
            raise invalid(f"a dispute names the answers that disagree: 2 or 3, got {len(self.replies)}")
        if any(r.micro_batch != self.micro_batch for r in self.replies):
            raise invalid(f"every reply of a dispute answers its micro-batch {self.micro_batch}")
        if len({r.wallet for r in self.replies}) != len(self.replies):
            raise invalid("the replies of a dispute come from different replicas")
        if len({(r.to, r.stage) for r in self.replies}) != 1:
            raise invalid("the replies of a dispute answer one replica, from one stage")


@dataclass(frozen=True, kw_only=True)
class Receipt(Message):
    """POST /api/receipts: one replica's signed work report for one round of one stage."""

    NAME = "receipt"
    stage: Stage
    round: Count
    inner_steps: Annotated[int, integer(1, MAX_INNER_STEPS)]
    """H actually run this round."""
    start_step: Count
    """Global inner step at the round's start (for the lr schedule)."""
    tokens: Annotated[int, integer(0, MAX_TOKENS)]
    """Tokens trained on this round."""
    data: Annotated[tuple[DataSpan, ...], list_of(message(DataSpan), MAX_SPANS)]
    """What was read, in order; stage 0 reads the data, later pipeline stages send []."""
    losses: Annotated[tuple[float, ...], list_of(number(0.0, MAX_LOSS), MAX_LOSSES)]
    """Self-reported inner-step losses (nats, 0..MAX_LOSS)."""
    base_hash: Sha256
    """sha256 of θ_round the replica started from."""
    result_hash: Sha256
    """sha256 of θ_{round+1} after the outer step."""
    delta_digest: Sha256
    """sha256 of this replica's own pseudo-gradient Δ."""
    inner_state_digest: Annotated[str | None, optional(hex_bytes(32))] = None
    """sha256 of the replica's inner AdamW state at the round's start (node.replay.InnerState),
    committed before any spot check asks for it; required for a replay spot check."""
    device: Annotated[str | None, optional(choice(("cpu", "cuda", "mps")))] = None
    """Where the inner steps ran (node.device); None from nodes before issue 14 (CPU)."""
    precision: Annotated[str | None, optional(choice(("fp32", "bf16", "fp16")))] = None
    """The inner steps' autocast precision over fp32 master weights; picks the replay's acceptance
    (verifier.replaycheck.tolerance_for). None from nodes before issue 14 (fp32)."""
    segment_root: Annotated[str | None, optional(hex_bytes(32))] = None
    """Root of the replica's segment log for this round (node.segments.SegmentLog.root): its step
    records and its weights' and optimizer's hash every k inner steps, committed before any segment
    check. None from nodes before issue 17: accepted, and only a whole-round replay (stage 0) can
    check them."""
    segments: Annotated[int | None, optional(integer(1, MAX_INNER_STEPS))] = None
    """Segments in that log (ceil(inner_steps / k)); given with segment_root."""
    accepted: Annotated[
        tuple[AcceptedContribution, ...], list_of(message(AcceptedContribution), MAX_CONTRIBUTIONS)
    ] = ()
    rejected: Annotated[
        tuple[RejectedContribution, ...], list_of(message(RejectedContribution), MAX_CONTRIBUTIONS)
    ] = ()
    equivocators: Annotated[tuple[str, ...], list_of(hex_bytes(10), MAX_CONTRIBUTIONS)] = ()
    """Wallets caught sending two different signed payloads for this (stage, round)."""
    disputes: Annotated[tuple[Dispute, ...] | None, optional(list_of(message(Dispute), MAX_DISPUTES))] = None
    """Micro-batches of this round whose answers from the next stage disagreed (`Dispute`), each
    answer signed to this replica by the next stage's replica; None (left out of the JSON) when
    there were none, so a receipt without any reads as before (issue 17)."""

    def check(self) -> None:
        if self.stage == 0 and not self.data:
            raise invalid("a stage-0 receipt must say which data it read (data is empty)")
        if len(self.losses) > self.inner_steps:
            raise invalid(f"{len(self.losses)} losses for {self.inner_steps} inner steps")
        if (self.segment_root is None) != (self.segments is None):
            raise invalid("segment_root and segments come together or not at all")
        if self.segments is not None and self.segments > self.inner_steps:
            raise invalid(f"{self.segments} segments for {self.inner_steps} inner steps")
        for dispute in self.disputes or ():
            if dispute.replies[0].stage != self.stage + 1:
                raise invalid(
                    f"a stage-{self.stage} receipt disputes answers of stage {self.stage + 1}, "
                    f"not {dispute.replies[0].stage}"
                )
        if self.disputes is not None and len({d.micro_batch for d in self.disputes}) != len(self.disputes):
            raise invalid("a receipt names each disputed micro-batch once")


@dataclass(frozen=True, kw_only=True)
class ReinstateRequest(Message):
    """POST /api/admin/reinstate (operator-signed): let a refused wallet back in."""

    NAME = "reinstate request"
    wallet_id: WalletId
    reputation: Annotated[float | None, optional(number(0.0, 1.0))] = None
    """Reputation to restart from; default: the configured initial value."""
