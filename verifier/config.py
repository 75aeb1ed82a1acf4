"""The verifier service's configuration: one typed value the CLI builds and `create_app` takes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from neuroshard.node.wallet import Wallet
from neuroshard.protocol.roster import MAX_POW_BITS
from neuroshard.protocol.signing import FRESHNESS_WINDOW_S

from .evaluator import EvaluatorConfig
from .housekeeping import HousekeepingConfig
from .leader import LeaseConfig
from .members import MembershipConfig
from .network import NetworkDefinition
from .ratelimit import RateLimitConfig, SourceLimitConfig
from .replaycheck import ReplayCheckConfig
from .reputation import ReputationConfig
from .verdict import VerdictConfig
from .vocab import VocabWatchConfig


@dataclass(kw_only=True)
class ReadCacheConfig:
    """How the API serves rendered read responses (neuroshard.api.cache)."""

    max_age_s: float = 5.0
    """A rendered body is re-rendered once it is this old (seconds), written to or not; also the
    Cache-Control max-age a proxy is told (rounded down to whole seconds)."""
    min_interval_s: float = 2.0
    """After a local write, wait at least this long since the last rendering before the next:
    caps recomputation under a steady write load at 1/min_interval_s per key. At 1,000 wallets
    x 200 rounds on PostgreSQL a history render takes ~0.3 s and the full picture ~0.5 s, so a
    worker whose readers poll everything spends about a third of a core re-rendering."""
    background: bool = True
    """Serve a stale body while one background thread re-renders it (False: the request that
    finds it stale re-renders it before answering, which tests use to read their own writes)."""
    max_entries: int = 512
    """Keys kept (pages × parameters); the least recently used one is dropped beyond this."""

    def __post_init__(self) -> None:
        if self.max_age_s < 0 or self.min_interval_s < 0:
            raise ValueError(
                f"ReadCacheConfig: max_age_s ({self.max_age_s}) and min_interval_s "
                f"({self.min_interval_s}) must be ≥ 0"
            )
        if self.max_entries < 1:
            raise ValueError(f"ReadCacheConfig: max_entries must be ≥ 1, got {self.max_entries}")


@dataclass(kw_only=True)
class VerifierConfig:
    database_url: str
    """SQLAlchemy URL: sqlite:///PATH (default) or postgresql://… (normalised to psycopg 3)."""
    network: NetworkDefinition
    """The run's definition, served signed at GET /api/network."""
    operator: Wallet
    """The operator key: signs the network definition and authorises /api/admin/* requests."""
    peer_ttl_s: float = 90.0
    """A node is live while its last heartbeat is younger than this; nodes should beat every ~TTL/3."""
    freshness_window_s: float = FRESHNESS_WINDOW_S
    """Accepted clock skew of signed requests, seconds either way."""
    max_body_bytes: int = 256 * 1024
    """Largest request body accepted (413 beyond). A receipt with 10,000 losses is ~200 KB."""
    rate_limit: RateLimitConfig = field(default_factory=RateLimitConfig)
    registration_limit: SourceLimitConfig | None = field(default_factory=SourceLimitConfig)
    """New wallets per source address (429 beyond); None: unlimited."""
    registration_pow_bits: int = 0
    """Leading zero bits of the hashcash a new wallet's registration must carry (protocol.roster.pow_ok):
    ~2^bits sha256 per wallet, 20 ≈ 1 s and 24 ≈ 15 s of one core. 0: none asked."""
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    """Who counts in a stage: open, probation or allowlist (verifier.members; issue 19)."""
    reputation: ReputationConfig = field(default_factory=ReputationConfig)
    verdict: VerdictConfig = field(default_factory=VerdictConfig)
    settle_after_rounds: int = 1
    """A (stage, round) is judged once most live replicas of the stage reported a round this many later."""
    settle_interval_s: float = 1.0
    """A receipt settles its stage's waiting rounds at most this often per process (issue 15: a
    thousand receipts a round each re-counting the stage cost most of the write path); the lead
    process's housekeeping settles the rest (verifier.housekeeping). 0: every receipt settles."""
    housekeeping: HousekeepingConfig = field(default_factory=HousekeepingConfig)
    """The lead process's sweep: expired nonces forgotten, waiting rounds settled."""
    agreement_window_rounds: int = 20
    """Settled rounds the headline hash-agreement and sync rates are computed over."""
    history_rounds: int = 200
    """(stage, round)s returned by /api/training/history and drawn on the dashboard."""
    reads: ReadCacheConfig = field(default_factory=ReadCacheConfig)
    """How long rendered read responses are served before re-rendering (api.cache)."""
    request_threads: int = 12
    """Threads serving this process's sync routes: registration, settlement, renders of the cached
    reads (the database pool is sized to match; heartbeats and receipts are written by the group
    commit's own threads, verifier.groupcommit). Issue 15: PostgreSQL's default 100 connections
    must hold every worker's threads plus its background ones."""
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    """How the process that runs background work is chosen among workers (verifier.leader)."""
    clock: Callable[[], float] = time.time
    """Unix seconds; injected so tests can move time."""
    live_evaluation: EvaluatorConfig | None = None
    """Measure the held-out loss of the majority model in a background thread (verifier.evaluator);
    None leaves the evaluations table to whoever calls ledger.record_evaluation (API tests)."""
    replay_checks: ReplayCheckConfig | None = None
    """Replay a sample of receipts' inner steps in background threads (verifier.replaycheck); None: don't."""
    vocab_watch: VocabWatchConfig | None = None
    """Read the run's manifest in a background thread and schedule the stages' vocabulary growth
    when the publisher grows the tokenizer (verifier.vocab); None: the vocabulary never grows."""
    fraud_proof_dir: Path | None = None
    """Where the segment fraud proofs are kept (HOME/fraud-proofs, verifier.fraudproofs), served on
    GET /api/fraud-proofs/{sha256}; None: `replay_checks.fraud_proof_dir`, and with neither the
    list still answers from the database but no proof is served from here."""

    @property
    def fraud_proofs_served(self) -> Path | None:
        """The directory GET /api/fraud-proofs/{sha256} serves proofs from, if any."""
        if self.fraud_proof_dir is not None:
            return self.fraud_proof_dir
        return None if self.replay_checks is None else self.replay_checks.fraud_proof_dir

    def __post_init__(self) -> None:
        checks = [
            (self.peer_ttl_s > 0, f"peer_ttl_s must be > 0, got {self.peer_ttl_s}"),
            (self.freshness_window_s > 0, f"freshness_window_s must be > 0, got {self.freshness_window_s}"),
            (self.max_body_bytes >= 1024, f"max_body_bytes must be ≥ 1024, got {self.max_body_bytes}"),
            (
                self.settle_after_rounds >= 1,
                f"settle_after_rounds must be ≥ 1, got {self.settle_after_rounds}",
            ),
            (
                self.agreement_window_rounds >= 1,
                f"agreement_window_rounds must be ≥ 1, got {self.agreement_window_rounds}",
            ),
            (self.settle_interval_s >= 0, f"settle_interval_s must be ≥ 0, got {self.settle_interval_s}"),
            (self.history_rounds >= 1, f"history_rounds must be ≥ 1, got {self.history_rounds}"),
            (self.request_threads >= 1, f"request_threads must be ≥ 1, got {self.request_threads}"),
            (
                0 <= self.registration_pow_bits <= MAX_POW_BITS,
                f"registration_pow_bits must be in [0, {MAX_POW_BITS}], got {self.registration_pow_bits}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"VerifierConfig: {message}")
