"""What one partitioned round takes, holds and returns: its phases, its config, the input a replica
brings (`RoundInput`), what the round holds while it runs (`Held`) and what it returns
(`RoundResult`). The round itself is ``round.OuterRound``."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from neuroshard.protocol.round import AggregateClaim, RoundCommitment, SumLie

from ..validation import ValidationConfig
from .reduce import ANCHOR_FLOOR, AnchorCheck


class Phase(enum.Enum):
    COMMIT = "commit"
    SCATTER = "scatter"
    REDUCE = "reduce"
    GATHER = "gather"
    ECHO = "echo"
    CHECK = "check"
    AGREE = "agree"
    DONE = "done"


@dataclass(kw_only=True)
class RoundConfig:
    """Deadlines and knobs of one round. Defaults suit a stage on the open internet at production H;
    tests and the simulator shorten the deadlines."""

    encoding: str = "int8"
    """Encoding of this replica's parts and of the aggregates it owns (``node.codec``)."""
    commit_timeout_s: float = 30.0
    """How long to wait for the members' commitments before closing the commit phase."""
    part_timeout_s: float = 60.0
    """How long an owner waits for a committed member's part (a ranged read of its Δ)."""
    gather_timeout_s: float = 60.0
    """How long to wait for an owner's claim and aggregate before turning to its backup."""
    agree_timeout_s: float = 15.0
    """How long to wait for the members' digests, and for an aggregate a claim names. Echoes are
    waited for as long as a witness's slowest gather can take (``_echo``): a witness that never
    publishes its echo makes every round wait that long (3.75 minutes at the defaults)."""
    check_miss: float = 0.2
    """Target probability that a cheating owner's part goes unchecked in one round, with 80% of the
    members honest: 0.2 catches it within 3 rounds with probability ≥ 0.992. Each replica checks
    each part it does not own with probability p = 1 − miss^(1/(0.8·n − 1)) (`check_probability`):
    ~1.6 parts at n = 4, ~1.9 at n ≥ 24 — the fewest checks (each costs ≈ d·(n−1)/n bytes in) that
    hold the target at every n."""
    checks: int | None = None
    """Check exactly this many parts instead (tests, benchmarks); None: `check_miss` decides."""
    backups: int = 2
    """How far down the backup chain a missing part is looked for before it is taken as zero; the
    same members witness the part (``Echo``)."""
    validation: ValidationConfig | None = field(default_factory=ValidationConfig)
    """Per-part content screening (``reduce`` module docstring); None skips it."""
    anchor_floor: float = ANCHOR_FLOOR
    """In a round with an anchor (``RoundInput.anchor``): the whole-Δ cosine to it below which a
    contributor is refused on every part (``reduce.AnchorCheck``)."""
    anchored_validation: ValidationConfig | None = None
    """The per-part screening of rounds with an anchor, when it differs from `validation` (None: the
    same). The anchor refuses what points away as a whole, so these limits can be wider: the
    per-part cosine limit is what refuses honest parts of replicas whose data differs."""

    def __post_init__(self) -> None:
        for name in ("commit_timeout_s", "part_timeout_s", "gather_timeout_s", "agree_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RoundConfig.{name} must be > 0, got {getattr(self, name)}")
        if (self.checks is not None and self.checks < 0) or self.backups < 0:
            raise ValueError(
                f"RoundConfig.checks and backups must be >= 0, got {self.checks}, {self.backups}"
            )
        if not 0 < self.check_miss < 1:
            raise ValueError(f"RoundConfig.check_miss must lie in (0, 1), got {self.check_miss}")
        if not -1 <= self.anchor_floor <= 1:
            raise ValueError(f"RoundConfig.anchor_floor is a cosine in [-1, 1], got {self.anchor_floor}")

    def screening(self, anchored: bool) -> ValidationConfig | None:
        """The per-part screening of a round with (`anchored`) or without an anchor."""
        if anchored and self.anchored_validation is not None:
            return self.anchored_validation
        return self.validation


HONEST_SHARE = 0.8
"""The share of honest members the check rate is sized for (the simulator's 20% Byzantine)."""


def check_probability(n: int, miss: float) -> float:
    """Probability with which a replica checks each part it does not own, so that a part goes
    unchecked by all ≈ 0.8·n − 1 other honest replicas with probability ≤ `miss`."""
    checkers = max(1.0, HONEST_SHARE * n - 1)
    return min(1.0, 1.0 - miss ** (1.0 / checkers))


@dataclass(frozen=True, kw_only=True)
class RoundInput:
    stage: int
    round: int
    base_hash: str
    """sha256 of θ_round (h_r): every member's Δ must be computed from it."""
    members: tuple[str, ...]
    """The round's admitted member wallets, sorted; this replica among them unless it is a
    probationer. Parts, ownership, witnesses and digests are theirs (``neuroshard.node.membership``)."""
    delta: Tensor
    """This replica's Δ (d,) float32, on the CPU."""
    tokens: int
    banned: frozenset[str] = frozenset()
    """Wallets this replica refuses as inputs (proven cheats of earlier rounds)."""
    probationers: tuple[str, ...] = ()
    """Probationers of this round as this replica sees them, sorted, none of them a member: they
    commit to the members' list and send their parts like members; an owner reads and screens
    their parts (``RoundResult.probation``) but never aggregates them, and they own, witness,
    check and count for nothing. A replica's own view: it changes nothing another computes."""
    anchor: Tensor | None = None
    """The round's public anchor, (d,) float32 on the CPU: the outer optimizer's momentum buffer,
    which every member holds bit for bit (its hash is agreed on with θ's), or None in a round
    without the check (the run's first round, a network that names none). Members must agree:
    a commitment with anchor sums in a round without, or without them in a round with, is refused."""


@dataclass(kw_only=True)
class RoundResult:
    aggregate: Tensor
    """Δ_agg (d,) float32: every part's aggregate, zero where no valid one was found."""
    committed: tuple[str, ...] = ()
    """Members whose valid commitment this replica held when it closed the commit phase."""
    claims: dict[int, AggregateClaim] = field(default_factory=dict)
    """Part -> the claim this replica stepped with."""
    refused: dict[str, str] = field(default_factory=dict)
    """Wallet -> why a part (or its commitment) of it was refused, in the parts this replica saw."""
    cheats: dict[str, str] = field(default_factory=dict)
    """Wallet -> proof-backed reason to ban it (fraud, equivocation): the caller bans these."""
    silent: dict[str, str] = field(default_factory=dict)
    """Wallet -> what it did not deliver (no commitment, an owner without its aggregate)."""
    missing_parts: tuple[int, ...] = ()
    checked: tuple[int, ...] = ()
    probation: dict[str, str] = field(default_factory=dict)
    """Probationer -> this replica's verdict on it as an owner: "part j: passed screening (no
    weight)", "part j: refused: …", or why its commitment or part did not come (never in any
    aggregate either way)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Phase -> wall seconds spent in it."""


@dataclass
class Held:
    """What one round holds while it runs (one instance per `run`)."""

    inp: RoundInput
    members_sha: str
    bounds: list[tuple[int, int]]
    owners: list[str]
    commitment: RoundCommitment
    delta_bytes: bytes
    anchor: AnchorCheck | None = None
    """The anchor check of a round with an anchor (from ``RoundInput.anchor``)."""
    lies: dict[str, SumLie] = field(default_factory=dict)
    """Contributor -> the evidence this replica found that its sum tree lies (published as
    ``lie-{wallet}`` and named in the digest, so every member bans it)."""
    commitments: dict[str, RoundCommitment] = field(default_factory=dict)
    """Admitted members' valid commitments (this replica's own included, if it is a member)."""
    probation: dict[str, RoundCommitment] = field(default_factory=dict)
    """Probationers' valid commitments (read by members only: owners screen their parts)."""
    claims: dict[int, AggregateClaim] = field(default_factory=dict)
    aggregates: dict[int, bytes] = field(default_factory=dict)
    """Part -> encoded aggregate to step with (the claim's, or a fraud proof's recomputation)."""
    encodings: dict[int, str] = field(default_factory=dict)
    frauds: set[int] = field(default_factory=set)
    """Parts whose owner this replica holds a checked fraud proof against."""
    equivocations: set[int] = field(default_factory=set)
    """Parts whose deciding signer this replica holds two claims of (zero this round)."""
    screening: list[asyncio.Future[None]] = field(default_factory=list)
    """Owners' screenings of probationers' parts, running beside the later phases (`_settle_probation`)."""
    probation_reads: asyncio.Future[Any] | None = None
    """The probationers' commitment reads (`_probation_commitments`), started by the first screening."""
    gathered: dict[int, AggregateClaim] = field(default_factory=dict)
    """The claims as decided from the echoes, before any fraud proof replaced a part: what the
    check seed and the digest hash, so a fraud found by some replicas only changes neither."""
    result: RoundResult | None = None

    def scope(self) -> dict[str, Any]:
        """The fields that tie a signed claim, echo or digest to this round of this stage, from
        these members on this base: every message of the round carries them."""
        inp = self.inp
        return {
            "stage": inp.stage,
            "round": inp.round,
            "base_hash": inp.base_hash,
            "members_sha256": self.members_sha,
        }
