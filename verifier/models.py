"""The verifier's tables, as SQLAlchemy 2 typed ORM classes.

Times are unix seconds (float, double precision in PostgreSQL): they compare directly with
the clock the service is given and mean the same in SQLite and PostgreSQL. A *wallet* is
keyed by its short `wallet_id` (node.wallet.wallet_id_of); its full public key is stored
beside it because signatures are checked against the key, not the id.

Changing anything here needs a new Alembic revision under migrations/versions/.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Deterministic constraint names, so later migrations can refer to (and drop) them by name.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

HASH_LEN = 64
"""sha256 hex digests: θ hashes, Δ digests, body hashes."""
WALLET_ID_LEN = 20
PUBLIC_KEY_LEN = 64

STATUS_ACTIVE = "active"
STATUS_REFUSED = "refused"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Wallet(Base):
    """A node identity that registered once; reputation and refusal live here."""

    __tablename__ = "wallets"

    wallet_id: Mapped[str] = mapped_column(String(WALLET_ID_LEN), primary_key=True)
    public_key: Mapped[str] = mapped_column(String(PUBLIC_KEY_LEN), unique=True)
    reputation: Mapped[float] = mapped_column(Double)
    status: Mapped[str] = mapped_column(String(16), default=STATUS_ACTIVE)
    """'active' or 'refused' (refused wallets get 403 on registration and receipts)."""
    status_reason: Mapped[str | None] = mapped_column(Text, default=None)
    registered_at: Mapped[float] = mapped_column(Double)
    software_version: Mapped[str] = mapped_column(String(64))


class Peer(Base):
    """Where a registered wallet can be reached and when it last said it was alive."""

    __tablename__ = "peers"

    wallet_id: Mapped[str] = mapped_column(ForeignKey("wallets.wallet_id"), primary_key=True)
    address: Mapped[str] = mapped_column(String(255))
    stage: Mapped[int] = mapped_column(Integer)
    registered_at: Mapped[float] = mapped_column(Double)
    last_heartbeat: Mapped[float] = mapped_column(Double)
    round: Mapped[int | None] = mapped_column(Integer, default=None)
    """The replica's outer round at its last heartbeat (DiLoCo progress)."""
    steps_in_round: Mapped[int | None] = mapped_column(Integer, default=None)
    """Inner steps done in that round at its last heartbeat."""

    __table_args__ = (Index("ix_peers_stage_heartbeat", "stage", "last_heartbeat"),)


class Receipt(Base):
    """One signed work report: what a replica did in one round of one stage."""

    __tablename__ = "receipts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    wallet_id: Mapped[str] = mapped_column(ForeignKey("wallets.wallet_id"))
    stage: Mapped[int] = mapped_column(Integer)
    round: Mapped[int] = mapped_column(Integer)
    inner_steps: Mapped[int] = mapped_column(Integer)
    start_step: Mapped[int] = mapped_column(Integer)
    """Global inner step at the round's start (the inner learning-rate schedule depends on it)."""
    tokens: Mapped[int] = mapped_column(BigInteger)
    shard_id: Mapped[int | None] = mapped_column(Integer)
    """The first shard read this round (all spans are in data_spans); None for stages that read no data."""
    offset_start: Mapped[int | None] = mapped_column(Integer)
    offset_end: Mapped[int | None] = mapped_column(Integer)
    data_spans: Mapped[list[Any]] = mapped_column(JSON)
    """[[shard_id, offset_start, offset_end], ...] in reading order; offsets count windows."""
    losses: Mapped[list[Any]] = mapped_column(JSON)
    """Self-reported inner-step losses: shown, never used for the verdict."""
    loss_sum: Mapped[float] = mapped_column(Double, default=0.0)
    loss_count: Mapped[int] = mapped_column(Integer, default=0)
    """Sum and number of `losses`: a round's reported loss is averaged in SQL, not from the JSON."""
    base_hash: Mapped[str] = mapped_column(String(HASH_LEN))
    result_hash: Mapped[str] = mapped_column(String(HASH_LEN))
    delta_digest: Mapped[str] = mapped_column(String(HASH_LEN))
    inner_state_digest: Mapped[str | None] = mapped_column(String(HASH_LEN), default=None)
    """The replica's commitment to its inner optimizer state at the round's start (node.replay);
    None from nodes that cannot be replayed (pipeline stages, older software)."""
    device: Mapped[str | None] = mapped_column(String(8), default=None)
    """cpu, cuda or mps: where the inner steps ran; None from older nodes (CPU)."""
    precision: Mapped[str | None] = mapped_column(String(8), default=None)
    """fp32, bf16 or fp16: the inner steps' precision; None from older nodes (fp32)."""
    segment_root: Mapped[str | None] = mapped_column(String(HASH_LEN), default=None)
    """Root of the replica's segment log for the round (node.segments): what a segment check holds
    it to, at any stage; None from nodes before issue 17."""
    segments: Mapped[int | None] = mapped_column(Integer, default=None)
    """Segments in that log; None with segment_root."""
    accepted: Mapped[list[Any]] = mapped_column(JSON)
    rejected: Mapped[list[Any]] = mapped_column(JSON)
    equivocators: Mapped[list[Any]] = mapped_column(JSON)
    disputes: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    """The round's disputed micro-batches (protocol.reports.Dispute objects, each reply's signature
    checked and addressed to this wallet): the replay checker holds their repliers to their logs
    and replays the segments that stepped on them. None: none (and every receipt before 0015)."""
    accepted_count: Mapped[int] = mapped_column(Integer, default=0)
    rejected_count: Mapped[int] = mapped_column(Integer, default=0)
    """len(accepted) and len(rejected), summed per round in SQL by summary.recent_rounds."""
    body_sha256: Mapped[str] = mapped_column(String(HASH_LEN))
    """sha256 of the signed body: an identical resubmission is acknowledged, a different one refused."""
    received_at: Mapped[float] = mapped_column(Double)

    __table_args__ = (
        UniqueConstraint("wallet_id", "stage", "round", name="uq_receipts_wallet_stage_round"),
        Index("ix_receipts_stage_round", "stage", "round"),
        Index("ix_receipts_round", "round"),
    )


class Nonce(Base):
    """A request nonce already used by a signer; kept until its timestamp is outside the window."""

    __tablename__ = "nonces"

    public_key: Mapped[str] = mapped_column(String(PUBLIC_KEY_LEN), primary_key=True)
    nonce: Mapped[str] = mapped_column(String(64), primary_key=True)
    expires_at: Mapped[float] = mapped_column(Double, index=True)


class Evaluation(Base):
    """A held-out loss the verifier measured itself on the majority model."""

    __tablename__ = "evaluations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    round: Mapped[int] = mapped_column(Integer, index=True)
    loss: Mapped[float] = mapped_column(Double)
    loss_stderr: Mapped[float | None] = mapped_column(Double, default=None)
    """Standard error of the mean over evaluation batches; None when unknown."""
    tokens: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Double)


class TextSample(Base):
    """A short text the verifier generated itself from the majority model it measured (issue 14):
    what the dashboard shows beside the loss curve. One every few evaluations."""

    __tablename__ = "text_samples"

    round: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    """Stage 0's round of the measured model, as in `evaluations`."""
    prompt: Mapped[str] = mapped_column(Text)
    text: Mapped[str] = mapped_column(Text)
    """The continuation only (the prompt not repeated), as decoded; untrusted for HTML."""
    max_new_tokens: Mapped[int] = mapped_column(Integer)
    """Tokens asked for; the text is shorter when the model ended it (end-of-sequence)."""
    temperature: Mapped[float] = mapped_column(Double)
    seed: Mapped[int | None] = mapped_column(BigInteger, default=None)
    created_at: Mapped[float] = mapped_column(Double)


class HashVote(Base):
    """A replica's θ_{r+1} hash for one (stage, round), taken from its receipt."""

    __tablename__ = "hash_votes"

    stage: Mapped[int] = mapped_column(Integer, primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    wallet_id: Mapped[str] = mapped_column(ForeignKey("wallets.wallet_id"), primary_key=True)
    result_hash: Mapped[str] = mapped_column(String(HASH_LEN))
    base_hash: Mapped[str] = mapped_column(String(HASH_LEN))

    __table_args__ = (Index("ix_hash_votes_round_stage", "round", "stage"),)


class Round(Base):
    """A settled (stage, round): its majority hash and agreement, fixed once the stage moved on."""

    __tablename__ = "rounds"

    stage: Mapped[int] = mapped_column(Integer, primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    majority_hash: Mapped[str | None] = mapped_column(String(HASH_LEN))
    """None when no hash had a strict plurality (a tie)."""
    votes: Mapped[int] = mapped_column(Integer)
    agreeing: Mapped[int] = mapped_column(Integer)
    synced: Mapped[int] = mapped_column(Integer)
    """Receipts whose base hash was the previous round's majority hash."""
    sync_checked: Mapped[int] = mapped_column(Integer)
    """Receipts whose base hash could be checked (the previous round is settled with a majority)."""
    settled_at: Mapped[float] = mapped_column(Double)


class ReputationEvent(Base):
    """Why a wallet's reputation moved: the recent verdicts /api/nodes/{wallet} shows."""

    __tablename__ = "reputation_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    wallet_id: Mapped[str] = mapped_column(ForeignKey("wallets.wallet_id"), index=True)
    stage: Mapped[int | None] = mapped_column(Integer)
    round: Mapped[int | None] = mapped_column(Integer)
    delta: Mapped[float] = mapped_column(Double)
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Double)


MEMBER_ADMITTED = "admitted"
MEMBER_PROBATION = "probation"


class Membership(Base):
    """A wallet's standing in one stage (issue 19, verifier.members): admitted, or on probation
    with the verified rounds and spot checks it has earned since its probation (re)started."""

    __tablename__ = "memberships"

    stage: Mapped[int] = mapped_column(Integer, primary_key=True)
    wallet_id: Mapped[str] = mapped_column(ForeignKey("wallets.wallet_id"), primary_key=True)
    status: Mapped[str] = mapped_column(String(16))
    """'admitted' or 'probation'."""
    streak: Mapped[int] = mapped_column(Integer, default=0)
    """Settled rounds agreeing with the stage's majority since probation (re)started."""
    checks_passed: Mapped[int] = mapped_column(Integer, default=0)
    """Replay spot checks passed since probation (re)started."""
    last_round: Mapped[int | None] = mapped_column(Integer, default=None)
    """The latest round counted in `streak` (each round counts once)."""
    last_named_turn: Mapped[int | None] = mapped_column(BigInteger, default=None)
    """The last turn of the stage's listed probationers that named it to take its turn (None:
    never): those named least recently go first (verifier.members.listed_probation)."""
    alive_turn: Mapped[int | None] = mapped_column(BigInteger, default=None)
    """The last turn at whose start the wallet's replica of this stage had sent a heartbeat within
    the ledger's `peer_ttl_s` (None: none): in that turn it goes ahead of the idle probationers
    (verifier.members.next_turn)."""
    since: Mapped[float] = mapped_column(Double)
    """When the current status began (probation start or restart, or admission)."""
    reason: Mapped[str | None] = mapped_column(Text, default=None)
    """Why the status last changed."""

    __table_args__ = (Index("ix_memberships_stage_status", "stage", "status"),)


class StageEpoch(Base):
    """A stage's membership epoch: +1 with every change of who is admitted or on probation, or of
    the stage's vocabulary schedule (verifier.vocab)."""

    __tablename__ = "stage_epochs"

    stage: Mapped[int] = mapped_column(Integer, primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
    changed_at: Mapped[float] = mapped_column(Double)
    changed_round: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """The newest round any replica of the stage had reported when the epoch last changed: the
    member list of this epoch takes effect `MembershipConfig.lead_rounds` after it."""
    vocab_size: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """The vocabulary the stage's embedding (stage 0) or head (the last stage) has from
    `vocab_from_round` on, after the publisher grew the tokenizer; 0: the network definition's,
    never grown. Set by verifier.vocab, served in the stage's member list."""
    vocab_from_round: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """The first round of the stage trained at `vocab_size`: every replica grows at this round
    boundary, so the replicas stay bit-identical."""
    turn: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """The turn of the listed probationers with no recent progress (verifier.members.next_turn):
    which of them a list names is drawn per turn, so a new epoch within a turn keeps the names."""
    turn_started_at: Mapped[float] = mapped_column(Double, default=0.0, server_default="0")
    turn_round: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """The stage's round when the turn started (verifier.members.stage_round, as its list's epoch
    notes it): the turn lasts until rounds past its list's effective round settled, and progress
    older than `MembershipConfig.probation_idle_rounds` before it no longer holds a place."""


class RosterRow(Base):
    """An operator-signed roster (protocol.roster.Roster) the verifier accepted; the highest
    version not yet expired is in force."""

    __tablename__ = "rosters"

    version: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    body: Mapped[str] = mapped_column(Text)
    """The signed document as canonical JSON (what GET /api/roster serves)."""
    expires_at: Mapped[int] = mapped_column(BigInteger)
    received_at: Mapped[float] = mapped_column(Double)


FRAUD_REASON_LEN = 400
"""The verdict text kept with a fraud proof (as ledger.record_receipt_check cuts its detail)."""


class FraudProof(Base):
    """A fraud proof the replay checker found (verifier.fraudproofs): the bytes are in
    HOME/fraud-proofs/<sha256>.proof, this row says whose they are and why they prove fraud. The
    file is written before the row is committed, so a row never names a missing file."""

    __tablename__ = "fraud_proofs"

    sha256: Mapped[str] = mapped_column(String(HASH_LEN), primary_key=True)
    """sha256 of the proof's bytes (SegmentFraudProof.encode or SenderFraudProof.encode): its name on
    disk and in the API."""
    wallet_id: Mapped[str] = mapped_column(ForeignKey("wallets.wallet_id"), index=True)
    stage: Mapped[int] = mapped_column(Integer)
    round: Mapped[int] = mapped_column(Integer)
    segment: Mapped[int] = mapped_column(Integer)
    """The failed segment of the round (node.segments); of a sender proof, the segment of the
    sender's log holding the step that contradicts its header; of a continuity proof, 0 (the
    round's first checkpoint)."""
    kind: Mapped[str] = mapped_column(String(16), default="segment", server_default="segment")
    """"segment" (SegmentFraudProof: a failed replay), "sender" (SenderFraudProof: a sender's
    signed log contradicts a header it signed) or "continuity" (ContinuityFraudProof: a round
    starts from an optimizer state neither fresh nor the one the wallet's round before ended with)."""
    reason: Mapped[str] = mapped_column(String(FRAUD_REASON_LEN))
    """The verdict, e.g. 'segment 3 of 4: norm ratio 1.25 …'."""
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    data_spans: Mapped[list[Any]] = mapped_column(JSON)
    """The receipt's [[shard_id, offset_start, offset_end], ...]: what a stage-0 re-check compares
    the signed log's spans with (neuroshard-check-proof --spans); [] at later stages."""
    device: Mapped[str | None] = mapped_column(String(8), default=None)
    """The receipt's device and precision, which chose the replay tolerance
    (verifier.replaycheck.tolerance_for); None from nodes that did not state them (CPU, fp32)."""
    precision: Mapped[str | None] = mapped_column(String(8), default=None)
    created_at: Mapped[float] = mapped_column(Double, index=True)
