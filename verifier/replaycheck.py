"""Live replay spot checks: re-run a sampled receipt's inner steps and compare the replica's Δ.

A background thread (never the API's request path; one torch thread in the verifier
process, cli.verifier) does, every `poll_s`:

1. **sample** — new receipts (stage 0's, and every stage's that commits to a segment root,
   below), each with probability `sample_rate`, picked by the
   operator's signature over (wallet, stage, round), which a replica cannot predict
   (verifier.sampling); or, with a `budget`, about `budget.checks` a round whatever the
   number of wallets: overdue wallets first, the rest drawn with per-wallet probabilities
   that favour new and low-reputation wallets (verifier.budget). A receipt whose data spans do not follow
   the wallet's shard order (verifier.datacheck.receipt_problems), or that commits to no
   inner optimizer state, fails at once.
2. **fetch** — GET /p2p/replay/{round} from the replica, signed with the operator wallet
   (node.p2p.replay: safetensors of θ_round, Δ and the AdamW state at the round's start).
   Each part must hash to what the replica's signed receipt committed to (base_hash,
   delta_digest, inner_state_digest); a replica that serves something else fails. Fetched
   right after sampling: a node keeps only its last few rounds.
3. **replay** — once round r−1 is settled, θ_round must be its majority weights (θ_0: the
   model the network definition builds); then the claimed batches are read exactly as the
   node reads them and the inner steps re-run from that θ and state
   (verifier.spotcheck.replay_inner_steps), and the Δs compared by cosine and norm. The
   verdict is recorded like the other spot checks (ledger.record_spot_check: a failure costs
   the wallet `spot_check_penalty`). A stage whose vocabulary grew with the tokenizer
   (node.vocab) is decoded and replayed at the vocabulary its θ holds (verifier.stageshape).

What a pass proves: this Δ is what H inner steps of the run's DiLoCo give from the majority
θ_round, from the committed optimizer state, on the data the wallet was assigned. What it
does not: that the committed optimizer state is the one the replica's previous round ended
with (continuity across rounds; a replica could reset or doctor its moments between rounds
and still pass, though it cannot pick them after it is challenged), that unsampled rounds
were honest, or anything about pipeline stages (their gradients depend on other stages).
A challenged replica that cannot be reached, or declines (403, 404, or any other status), is tried
again (RETRY_EVERY_S apart, at least MIN_TRIES times) for `answer_window_s` (10 min) from the
first try; then it fails the check at
`ReputationConfig.unanswered_penalty` (half a failed replay, no fraud proof), which also restarts
its probation. Otherwise a liar would decline exactly the challenges that draw a segment it faked
and be caught never. Not drawn: a receipt that reached the verifier after its round settled (its
node may have dropped the round by then: nodes keep their last few, so an unanswered challenge
could get no verdict, and a pass must not count toward admission either; such a receipt earns no
reputation and no admission, verifier.ledger). Not judged: a challenge first tried more
than a window after its receipt arrived (the verifier's own backlog), a wallet with no registered
address, and a relay replica (`--relay`: no port) when the checker was given no bucket
(`ReplayCheckConfig.relay`; with one, it is challenged through the bucket:
verifier.relaychallenge). Those remain ways around a check.

A check holds one of the `max_queue` fetch slots only while it holds fetched material; up to
MAX_WAITING more wait for answers, holding nothing. Over HTTP, a replica that serves some pieces
and declines the rest holds a slot for at most its window. Through a bucket, whose windows are
long (the pieces' upload at the rate floor), the checker first looks for the holder's answers
(a HEAD each) and reads nothing until every wanted piece is there (`_poll`): a relay replica that
answers all but one holds no slot. One that withdraws or spoils an answer after it was found
fails at once (`_withdrawn`), and a failure of the bucket itself sets the check back to its
start, holding nothing (`_bucket_failed`). The previous round's log, asked only once the pieces
are read (perhaps long after they were answered, when the slots were busy), may be answered
until the later of the pieces' window and `answer_window_s` (and a log's upload) from that ask.
A drawn receipt that is not checked because the queue is full or it came after its round
settled is logged and not counted as checked (the budget's draw still sees its wallet due).

Segment checks (issue 17), at every stage: a receipt that commits to a segment root
(`segment_root`, `segments`; node.segments) is checked by segments instead of whole rounds. The
checker draws `segments_per_check` of its segments by the operator's signature over (wallet,
stage, round) — fixed only once the receipt, and so the chain, is committed
(verifier.segmentcheck.draw_segments) — fetches each one's material from GET
/p2p/segment/{round}/{segment} (node.p2p.replay.SegmentService), and once round r−1 of that
stage is settled with θ_round as its majority, checks each segment against the receipt and
replays it (verifier.segmentcheck.check_segment): stage 0 re-reads its batches from the
assignment, later stages decode the activations and gradients their senders signed. A replay
that fails on material matching the signed commitment is kept as a fraud proof besides
costing reputation: in memory (`fraud_proofs`, the last 16) and, with `fraud_proof_dir` set,
as a file there and a row in `fraud_proofs`, the newest `keep_fraud_proofs` of them within
`keep_fraud_bytes`
(verifier.fraudproofs), which GET /api/fraud-proofs lists and serves and
`neuroshard-check-proof` re-checks alone. Receipts without a segment root
(nodes before issue 17) keep the whole-round replay at stage 0 of single-stage runs; at later
stages they are not replayed. A check costs `segments_per_check` · k/H of the round's work.
Every segment check also fetches the round's last segment, drawn or not, and checks it against
the commitments without replaying it: its end checkpoint is where the receipt's Δ must come from
(Δ = θ_round − end), so a Δ changed after the last inner step (scaled, say) is caught by every
check, not only by those that happen to draw the last segment. It costs one more segment's
download and hashing, no replay. A segment check also holds the round's first checkpoint to
θ_round with a fresh optimizer or the state the replica's previous round ended with (the signed
log of round r−1 and the opening of its last checkpoint; segmentcheck.continuity_problem). A
break leaves a ContinuityFraudProof (kind "continuity") when the replica served the opening of its
round's first checkpoint (`SegmentMaterial.start_inner`) and a signed, opened log of the round
before: the two logs are its own signatures, so the break checks alone with the run's definition.
After a check passes, the senders whose messages its segments consumed (MAX_SENDER_LOGS, drawn)
are held to their own signed round logs (`_match_senders`): a sender whose log contradicts a
header it signed fails in its own stage and round and leaves a SenderFraudProof, kept and listed
like a segment proof (kind "sender"), which checks alone without the run's definition. Under
the ``allowlist`` and ``probation`` policies a pass whose segments consumed messages from a
wallet never registered for the stage its header names counts for nothing (`_strangers`).

Disputes (since 2026-12-08): a receipt may name micro-batches whose audit found the next stage's
answers apart (protocol.reports.Dispute: the answers' signed replies, each addressed to the
receipt's wallet, which the ledger checked). Whether the receipt is drawn or not, each replier is
held to its own signed log of the round its reply names, as a sender is (a log that does not list
the reply, or records sending other bytes, fails it with a SenderFraudProof); a log that agrees
has the segment whose step consumed the micro-batch replayed (`_disputed_segment`,
`_queue_disputed`), each such segment once, so a replier that answered with bytes its step did
not compute, and recorded sending them, fails with a segment fraud proof: how a stage of two,
where no audit can outvote a liar, still catches one. The disputing replica chose what is checked,
so only a failure counts: a pass earns nothing, and what the replier cannot answer (a round it
never reports, material no longer kept) is no verdict (`Challenge.disputed`). A replica can
dispute only answers it was sent, at most MAX_DISPUTES micro-batches of 2–3 replies a round;
disputes of a receipt that came after its round settled, and replies from wallets not registered
for the next stage, are not taken up. A reply whose log has no step on the micro-batch is not
judged (an honest round redone after a crash shows the same), so a liar that does not record its
lie escapes this check.
"""

from __future__ import annotations

import math
import threading
import time
import urllib.error
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from neuroshard.data import Dataset
from neuroshard.node.diloco import flat_parameters, tensor_digest
from neuroshard.node.model import build_stage
from neuroshard.node.p2p.bucket import RelayConfig
from neuroshard.node.p2p.relay import is_relay
from neuroshard.node.p2p.replay import (
    SEGMENT,
    SEGMENT_LOG,
    THETA,
    decode_replay,
    replay_size_bound,
    segment_log_bound,
    segment_size_bound,
)
from neuroshard.node.replay import ReplayRecord, fresh_inner_digest
from neuroshard.node.segment_store import SegmentMaterial
from neuroshard.protocol.identity import wallet_id_of
from neuroshard.protocol.peer import REPLAY
from neuroshard.protocol.pipeline import GradientReply
from neuroshard.protocol.refusal import Refused, malformed
from neuroshard.protocol.reports import DataSpan, Dispute
from neuroshard.protocol.segments import Received, SignedSegmentLog, checkpoint_hash

from . import fraudproofs, ledger, members
from . import models as m
from .background import (
    MIN_BYTES_PER_S,
    BodyTooLarge,
    JobContext,
    PollingThread,
    error_text,
    open_run_dataset,
    signed_get,
)
from .budget import ReplayBudget, Standing, check_rates, overdue
from .coverage import standings
from .datacheck import receipt_problems
from .fraudproofs import DEFAULT_KEEP, DEFAULT_KEEP_BYTES
from .members import MembershipConfig
from .relaychallenge import BucketHolder, BucketUnavailable, NotAnswered, RelayChallenges
from .sampling import draw, sampled
from .segmentcheck import (
    ContinuityFraudProof,
    SenderFraudProof,
    continuity_problem,
    contradicting,
    draw_segments,
    judge_continuity_proof,
    sender_round,
    signed_log_problem,
)
from .segmentlive import (
    allowed_segment_steps,
    judge_segments,
    max_segment_steps,
    segment_count_problem,
    segment_root,
)
from .spotcheck import SpotCheckConfig, SpotCheckError, claimed_batches, compare_deltas, replay_inner_steps
from .stageshape import declared_length, largest_numel, stage_config, stage_size

Log = Callable[[str], None]

SAME_PRECISION_TOLERANCE = SpotCheckConfig(min_cosine=0.99, norm_tolerance=0.05)
"""For receipts of CPU fp32 work, which the verifier replays the same way: an honest replay gives
cosine 1.000000, norm ratio 1.0000 (bench/RESULTS.md, issue 14; 1 − 1e-13 across thread counts,
SpotCheckConfig)."""
CROSS_PRECISION_TOLERANCE = SpotCheckConfig(min_cosine=0.85, norm_tolerance=0.05)
"""For receipts of bf16/fp16 autocast or GPU work (TF32 matmuls), replayed here in CPU fp32:
measured by bench/bench_replay_tolerance.py (tiny model, 4x64 batches; bench/RESULTS.md). Honest
bf16 rounds replayed in fp32: cosine min 0.9993 at H = 30 (9 rounds), 0.961 at H = 50, 0.998 at
H = 100, 0.941 at H = 200, 0.894 at H = 300 (2 rounds each; the divergence is chaotic, not
monotone in H); norm ratio within 0.9927..1.0159. Lies replayed the same way: other data cosine
≤ 0.749 at every H; made-up Δ |cosine| < 0.002; 25% of steps skipped norm ratio ≤ 0.88; Δ × 1.10
and × 1.25 norm ratio ≥ 1.098. So 0.85 keeps 0.044 above the worst honest cosine at H = 300 and
0.10 above other data; ±0.05 is 3x the worst honest norm deviation. Not caught: Δ × 1.05, and a
skipped-steps Δ rescaled to the honest norm (its cosine is 0.85-0.98 at H <= 200): only a replay
in the claimed precision, or of short segments, can tighten this. Not measured: CUDA bf16 against
CPU fp32 (no GPU here), models larger than tiny, H = 500."""
CALIBRATED_TOLERANCE = CROSS_PRECISION_TOLERANCE
"""The acceptance that holds for every whole-round replay, whatever it trained on (benchmarks print it)."""
SEGMENT_TOLERANCE_STEPS = 25
"""The longest segment `SEGMENT_TOLERANCE` holds for; longer segments are judged like whole rounds
(CROSS_PRECISION_TOLERANCE): at k = 50 the worst of 16 honest bf16 segments already fell to
cosine 0.9962, norm ratio 0.9924."""
SEGMENT_TOLERANCE = SpotCheckConfig(min_cosine=0.995, norm_tolerance=0.02)
"""For segments of at most `SEGMENT_TOLERANCE_STEPS` steps, whatever the receipt trained on: a
short replay from the replica's own committed checkpoint drifts far less than a whole round from
θ_round. Measured on the tiny model, honest segments replayed in CPU fp32 (bench/bench_replay_
tolerance.py --segments, bench/bench_replay.py; bench/RESULTS.md, issue 17):

- bf16 autocast (CPU), k = 5..25 after 100 warm steps: cosine ≥ 0.99990, norm ratio within
  1 ± 0.00062; from a fresh model in its lr warm-up, the worst case: cosine ≥ 0.99912, norm
  ratio within 1 ± 0.0048 (k = 25); fp16 autocast (CPU), k = 10, 25: within 1 ± 0.00003;
  the earlier segment checks (8x128 and 4x64, stages 0 and 1, k = 10): within 1 ± 0.0013; CUDA bf16 on an H100, k = 10: within 1 ± 0.0008;
- lies at those k: an update scaled ×1.05 (norm ratio 1.045..1.051), 20% of the steps skipped
  (norm ratio ≤ 0.862), other data (cosine ≤ 0.93), a made-up update (cosine ≈ 0).

So ±0.02 is 4x the worst honest norm deviation (warm-up, k = 25) and catches ×1.05, which a whole
round's ±0.05 let through; 0.995 is 5.7x the worst honest cosine gap. Not caught: updates scaled
by 2% or less, and 20% of the steps skipped with the update rescaled to the honest norm (cosine
up to 0.998 at k ≤ 10). Not measured: models larger than tiny."""


def tolerance_for(
    device: str | None,
    precision: str | None,
    config: ReplayCheckConfig,
    *,
    segment_steps: int | None = None,
) -> SpotCheckConfig:
    """The acceptance for a receipt that states its inner loop's device and precision. Receipts
    without them come from nodes before issue 14, which trained on the CPU in fp32.
    `segment_steps`: the length of the segments replayed (None: a whole round); segments of at
    most `SEGMENT_TOLERANCE_STEPS` steps are held to `config.segment` whatever the precision."""
    if segment_steps is not None and segment_steps <= SEGMENT_TOLERANCE_STEPS:
        return config.segment
    if device in (None, "cpu") and precision in (None, "fp32"):
        return config.tolerance
    return config.cross_precision


def calibrated_tolerance(segment_steps: int | None = None) -> SpotCheckConfig:
    """The acceptance that holds for every receipt, whatever it trained on: `SEGMENT_TOLERANCE` for
    segments of at most `SEGMENT_TOLERANCE_STEPS` steps, else `CALIBRATED_TOLERANCE`."""
    return tolerance_for("any", "any", ReplayCheckConfig(), segment_steps=segment_steps)


MAX_SENDER_LOGS = 4
"""Senders' logs read per check to match their records (a segment's inputs come from a few
replicas of the neighbouring stages; the bound keeps a check's fetches few whatever the stage's
size), drawn by the operator's signature (sampling.draw). A round log is ~0.3 KB a step."""
MAX_PENDING_SENDERS = 64
"""Sender matches waiting for the sender's receipt or log; more are not queued (and said so)."""
SENDERS_PER_PASS = 8
"""Sender matches tried per pass of the fetching thread, so unreachable senders cannot hold it."""
MAX_WAITING = 64
"""Challenges in the queue beyond `max_queue` (which bounds those holding fetched material): the
rest wait for a replica's answer, holding nothing. More are not issued (and said so)."""
DISPUTED_KEPT = 4096
"""Replier segments remembered as replayed for a dispute (`ReplayChecker._disputed`)."""
MAX_ADMISSION_CHECKS = 16
"""Challenges taken for probationers' admission (not drawn) in the queue at once, per stage: keys
that vote the public majority hash without working reach that check too and can hold a place for
an answer window each; a flood of them in one stage delays that stage's admissions, not every
stage's, nor the drawn checks (its further receipts are left to the draw)."""
MAX_DISPUTE_CHALLENGES = 8
"""Disputes' challenges in the queue at once (beside the drawn ones, and at most one a wallet): a
replier that leaves one unanswered is given no verdict (`Challenge.disputed`), so these places must
not be ones a drawn check, or an admission check, needs."""
MAX_DISPUTE_MATCHES = 16
"""Disputed replies waiting to be held to their repliers' logs at once (within MAX_PENDING_SENDERS):
replies naming rounds that never come wait `sender_wait_s` each, and must not crowd out the
matches of checked replicas' senders."""
MAX_QUEUED_PER_WALLET = 2
"""Challenges of one wallet in the queue at once; a receipt of a wallet that has this many is not
checked now (and said so), and the budget's draw still sees the wallet due. Without it, wallets
that never answer could fill `MAX_WAITING` for their windows with a few wallets' rounds, and no one
else's receipt would be checked meanwhile; now that takes MAX_WAITING / 2 wallets, each losing
`unanswered_penalty` for every challenge it leaves."""
RETRY_EVERY_S = 15.0
"""Least seconds between tries of a challenge whose replica did not answer (a slow pass of the
fetching thread makes it longer)."""
ANSWER_KEPT_S = 20 * 3600.0
"""An answer found in a bucket and gone this soon after it was written was withdrawn by its holder:
a bucket's lifecycle rule keeps objects a day at least (node.p2p.bucket.bucket_lifecycle_rule)."""
MIN_TRIES = 3
"""Tries a challenge gets before it can be judged unanswered, however long they took. Every status
counts as no answer, 401 (clock skew) and 503 included: the replica's server chooses its status,
so an excused code would be a liar's way out. A verifier whose clock is off fails everyone it
challenges: its log says why in every verdict."""
SENDER_DETAIL = "records: "
"""How a sender's failed check (its records, or its log not served) starts its detail: the ledger
holds one per (wallet, stage, round), also across restarts of the verifier."""
SENDER_TIMEOUT_S = 10.0
"""Socket timeout of one sender-log fetch (a log is small), and its grace before the body must
arrive at background.MIN_BYTES_PER_S. Sender matching runs on its own thread besides, so a slow
sender delays only the matching of other senders, never a challenge's fetch or replay."""


@dataclass
class SenderMatch:
    """Messages a passing segment check verified as one sender's (its signed headers), waiting to be
    held against that sender's own signed log of the round they name (`contradicting`)."""

    sender: str
    """The sender's public key, hex."""
    stage: int
    round: int
    receiver: str
    """The checked replica's wallet id."""
    receiver_key: str
    """Its public key, hex: the counterpart the sender's step must record."""
    messages: list[Received]
    since: float
    found: tuple[float, float] | None = None
    """(when this checker first found the sender's receipt, when that receipt reached the
    verifier): from then on the sender has the answer window to serve its log."""
    declined: str = ""
    """Why the sender's log was not read on the latest try."""
    via_bucket: bool = False
    """Asked through the bucket (a sender behind NAT): its challenge is released when the match ends."""
    restarts: int = 0
    """Answer windows restarted because the bucket failed the verifier (`MAX_SENDER_RESTARTS`)."""
    not_before: float = 0.0
    """Not tried again before this time (RETRY_EVERY_S after the bucket failed the verifier)."""
    disputed: str | None = None
    """The micro-batch id when the receiver disputed the sender's answer to it (protocol.reports.
    Dispute): a log that does not contradict the answer has the segment that stepped on the
    micro-batch replayed (`ReplayChecker._disputed_segment`)."""


MAX_SENDER_RESTARTS = 3
"""A sender match whose bucket reads failed the verifier more than this many times (each followed
by a new answer window, RETRY_EVERY_S later) ends unmatched."""


SEGMENTS_PER_CHECK = 4
"""Segments replayed per drawn receipt that commits to a segment root (ReplayCheckConfig)."""


@dataclass(kw_only=True)
class ReplayCheckConfig:
    sample_rate: float = 0.1
    """Share of stage-0 receipts replayed. A replay costs the verifier about what the round cost
    the replica (H inner steps, bench/RESULTS.md), so 0.1 checks one round in ten of every node
    at a tenth of one replica's compute."""
    poll_s: float = 2.0
    """Seconds between looks for new receipts."""
    timeout_s: float = 60.0
    """Socket timeout of one fetch, and the grace before its body must arrive at
    background.MIN_BYTES_PER_S on average (a node dripping its answer is cut off, not waited for)."""
    retry_s: float = 60.0
    """How long after its receipt an unsettled round r−1 is waited for."""
    answer_window_s: float = 600.0
    """How long a challenged replica has to serve what its receipt committed to (tried every
    RETRY_EVERY_S apart, at least MIN_TRIES times), from the first try. A replica still unreachable
    or declining at its end fails the check at `ReputationConfig.unanswered_penalty`, its probation
    restarting (exceptions: `_no_answer`). Nodes serve from disk the moment their receipt is sent
    and keep their last `--replay-rounds` rounds (3), so an honest node answers at once unless it
    is down; segment material survives a restart, whole-round material (in memory) does not. A
    liar could otherwise decline exactly the challenges that draw a segment it faked."""
    sender_wait_s: float = 900.0
    """How long a sender match waits for the sender's receipt and log: rounds are per stage, so a
    sender's round may close up to a round after its receiver's (H = 500 steps: minutes)."""
    max_per_pass: int = 500
    """Receipts looked at per pass, so a backlog never holds the fetching thread for long."""
    max_queue: int = 4
    """Checks holding fetched material (a whole round: 4 × the model's size; or a segment check's
    pieces) until their replay; others wait without fetching (module docstring)."""
    tolerance: SpotCheckConfig = field(default_factory=lambda: replace(SAME_PRECISION_TOLERANCE))
    """Acceptance for receipts of CPU fp32 work (replayed exactly)."""
    cross_precision: SpotCheckConfig = field(default_factory=lambda: replace(CROSS_PRECISION_TOLERANCE))
    """Acceptance for receipts of autocast or GPU work (replayed in another precision)."""
    segment: SpotCheckConfig = field(default_factory=lambda: replace(SEGMENT_TOLERANCE))
    """Acceptance for segments of at most SEGMENT_TOLERANCE_STEPS steps, any precision."""
    cache_dir: Path | None = None
    """Shard cache when the data set is served over HTTP."""
    budget: ReplayBudget | None = None
    """Draw by a compute budget instead of `sample_rate` (verifier.budget): about
    `budget.checks` checks per round whatever the number of wallets, every wallet at least
    once in a bounded number of rounds, new and low-reputation wallets more often."""
    segments_per_check: int = SEGMENTS_PER_CHECK
    """Segments replayed per drawn receipt that commits to a segment root: a check costs this × k/H
    of the round. 4 catches a replica faking 10% of its segments within 11 of its drawn rounds with
    probability 1 − 0.9^44 = 0.990 (bench/bench_replay.py's simulation)."""
    max_message_bytes: int = 64 << 20
    """Largest recorded pipeline message accepted in a segment body (bounds the fetch)."""
    fraud_proof_dir: Path | None = None
    """Where segment fraud proofs are kept as files (the verifier's HOME/fraud-proofs; listed in
    the `fraud_proofs` table, verifier.fraudproofs). None: only in memory (`ReplayChecker.fraud_proofs`)."""
    keep_fraud_proofs: int = DEFAULT_KEEP
    """Proofs kept in `fraud_proof_dir`; the oldest files and rows beyond this are deleted."""
    relay: RelayConfig | None = None
    """The stage bucket (``neuroshard-verifier --relay``): replicas behind NAT (node ``--relay``,
    no port) are challenged through it (verifier.relaychallenge). None: they are not checked."""
    keep_fraud_bytes: int = DEFAULT_KEEP_BYTES
    """Bytes the proofs in `fraud_proof_dir` may hold together (a proof is ~28 bytes per parameter,
    3.5 GB at 125M); the oldest are deleted beyond it (the newest is kept even alone over it).
    `neuroshard-verifier --keep-fraud-gb`."""

    def __post_init__(self) -> None:
        if not 0 <= self.sample_rate <= 1:
            raise ValueError(f"ReplayCheckConfig.sample_rate must lie in [0, 1], got {self.sample_rate}")
        if (
            self.poll_s <= 0
            or self.timeout_s <= 0
            or self.retry_s < 0
            or self.answer_window_s < 0
            or min(
                self.max_queue,
                self.max_per_pass,
                self.segments_per_check,
                self.keep_fraud_proofs,
                self.keep_fraud_bytes,
            )
            < 1
        ):
            raise ValueError(f"ReplayCheckConfig: periods must be > 0 and counts ≥ 1, got {self}")


@dataclass
class Challenge:
    """One sampled receipt on its way to a verdict."""

    receipt: m.Receipt
    address: str | BucketHolder
    """The replica's port, or its wallet's key when it is asked through the bucket (a relay replica)."""
    material: ReplayRecord | None = None
    segments: tuple[int, ...] = ()
    """The drawn segments of a receipt that commits to a segment root; () for a whole-round replay."""
    picked_before: int | None = None
    """The wallet's last picked round before this draw (`ReplayChecker._unpick`: a check that ends
    without counting gives it back)."""
    last: int | None = None
    """The round's last segment, fetched on every segment check (replayed only when drawn): its end
    checkpoint is the one the receipt's Δ must come from."""
    pieces: dict[int, SegmentMaterial] = field(default_factory=dict)
    """Fetched segment material, by segment."""
    previous: SignedSegmentLog | None = None
    """The replica's signed log of the round before, with its end opening: fetched when the round
    does not start from a fresh optimizer, to hold it to the state that round ended with."""
    needs_previous: bool = False
    answered: bool = False
    """Through a bucket: every wanted segment's answer was seen there (`ReplayChecker._poll`).
    Until then the check holds no slot of `max_queue`, and the answer window runs."""
    written: float | None = None
    """Through a bucket: when the oldest of the answers `_poll` found was written (bucket clock)."""
    log_asked: float | None = None
    """Through a bucket: when the previous round's log was first asked, after the pieces were read
    (perhaps long after they were answered, when the slots were busy): its own, shorter window."""
    first_try: float | None = None
    """When it was first tried: the answer window starts here, not at the draw, so the verifier's
    own backlog never eats into a replica's time."""
    tries: int = 0
    next_try: float = 0.0
    """No fetch before this (a replica that did not answer waits RETRY_EVERY_S)."""
    admission: bool = False
    """Taken because a probationer's admission waits on it (not drawn): each stage's hold at most
    MAX_ADMISSION_CHECKS places (`ReplayChecker._admission_waiting`)."""
    disputed: str | None = None
    """The micro-batch a dispute named (`ReplayChecker._queue_disputed`): the segment was chosen by
    the disputing replica, not drawn, so a pass earns nothing and no answer costs nothing (the
    replica may have dropped a round that old); only a failed replay or a commitment the served
    material breaks is a verdict."""

    @property
    def holding(self) -> bool:
        """Holds fetched material (memory bounded by `max_queue`)."""
        return self.material is not None or bool(self.pieces)

    @property
    def wanted(self) -> tuple[int, ...]:
        """The segments to fetch: the drawn ones and the last."""
        extra = () if self.last is None or self.last in self.segments else (self.last,)
        return (*self.segments, *extra)

    @property
    def ready(self) -> bool:
        """Everything to check has been fetched."""
        if not self.segments:
            return self.material is not None
        return len(self.pieces) == len(self.wanted) and (not self.needs_previous or self.previous is not None)


REFUSALS = (403, 404)
"""The replica's own answers (node.p2p.replay): not the verifier's key, or the round no longer
held. Others (401 clock skew, 409 nonce, 5xx) may be the verifier's or the network's fault."""


class ReplicaDeclined(Exception):
    """The replica declined to serve a round (403, 404). Retried within the answer window like
    an unreachable replica; a verdict only at its end (`ReplayCheckConfig.answer_window_s`)."""


class Malformed(Exception):
    """The replica served a body that is not replay material for the round (a verdict)."""


class ReplayChecker:
    """Replays a sample of receipts' inner steps, or their drawn segments, on threads of its own."""

    def __init__(
        self,
        ctx: JobContext,
        *,
        config: ReplayCheckConfig | None = None,
        dataset: Callable[[], Dataset] | None = None,
        membership: MembershipConfig | None = None,
    ) -> None:
        """`dataset`: a loader in place of the run's published data set (tests). `membership`: a
        pass counts toward a probationer's admission (verifier.members)."""
        self.ctx = ctx
        self.started_at = ctx.clock()
        """When this checker started: sender logs without a header list are refused for rounds
        received since, and held to their steps for rounds received before (an upgrade)."""
        self.membership = membership or MembershipConfig()
        self.config = config or ReplayCheckConfig()
        self._open_dataset = dataset or (
            lambda: open_run_dataset(
                ctx.network, self.config.cache_dir, ctx.log, needed_by="replay checks need"
            )
        )
        self._dataset: Dataset | None = None
        self._stages: dict[int, tuple[int, int, str]] = {}
        """Stage → (numel, parameter tensors, θ_0 hash) of that stage's model."""
        self.fraud_proofs: deque[bytes] = deque(maxlen=16)
        """Fraud proofs found here (SegmentFraudProof or SenderFraudProof bytes), newest last."""
        self.queue: list[Challenge] = []
        self._overdue_picks: dict[int, int] = {}
        """Round → receipts drawn for being overdue (at most the budget's coverage share)."""
        self._overdue_taken: set[tuple[str, int]] = set()
        """(wallet, round) drawn as overdue, so a pick that is then not checked gives its place back."""
        self._picked: dict[str, int] = {}
        """Wallet → round of its latest receipt drawn here (its verdict may not be recorded yet)."""
        self.last_id: int | None = None
        """Receipts up to this id were looked at; None until the first pass, which starts at the newest."""
        self.passed = 0
        self.failed = 0
        self.unanswered = 0
        """Challenges left unanswered for the answer window (counted in `failed` too)."""
        self.replay_seconds = 0.0
        self._loop = PollingThread("replay-check", self.run_once, self.config.poll_s, ctx.log, "replay check")
        self._replays: ThreadPoolExecutor | None = None
        self._running: Future[None] | None = None
        self._count_lock = threading.Lock()
        self._sender_jobs: ThreadPoolExecutor | None = None
        self._matching: Future[None] | None = None
        self._senders: deque[SenderMatch] = deque()
        self._senders_lock = threading.Lock()
        self._fresh_digests: dict[tuple[int, int], str] = {}
        """(values, tensors) → a fresh optimizer's digest at that size."""
        self._penalised: set[tuple[str, int, int]] = set()
        """(wallet, stage, round) already failed for its records: one penalty per round."""
        self._disputes_found: deque[tuple[m.Receipt, str | BucketHolder, int, str]] = deque()
        """Disputed segments located by the sender matching thread, (the replier's receipt, where to
        ask it, segment, micro-batch), queued as challenges by the next pass (`_collect`)."""
        self._disputed: OrderedDict[tuple[str, int, int, int], None] = OrderedDict()
        """(wallet, stage, round, segment) replayed for a dispute: each once (the newest
        DISPUTED_KEPT remembered)."""
        self.disputes = 0
        """Disputed answers taken up (each held to its replier's log)."""
        relay = self.config.relay
        self._bucket = None if relay is None else RelayChallenges(relay, ctx.operator, ctx.clock, ctx.log)
        """Challenges of relay replicas through the stage bucket; None without `relay`."""

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Sample and fetch on one thread, replay on another: a replay takes about as long as the
        replica's round, and meanwhile other sampled rounds must be fetched before nodes drop them."""
        if self.ctx.network.num_stages != 1:
            self.ctx.log(
                f"replay check: {self.ctx.network.num_stages} stages; receipts with a segment root are checked "
                "by segment at every stage, others are not replayed"
            )
        self._replays = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replay")
        self._sender_jobs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replay-senders")
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop(self.config.timeout_s)
        if self._replays is not None:
            self._replays.shutdown(wait=True, cancel_futures=True)
            self._replays = None
        if self._sender_jobs is not None:
            self._sender_jobs.shutdown(wait=True, cancel_futures=True)
            self._sender_jobs = None
        if self._dataset is not None:
            self._dataset.source.close()

    # --- one pass -----------------------------------------------------------------------------

    def run_once(self) -> None:
        """Sample new receipts, fetch what they committed to, and start the next replay if none is
        running (inline, when the checker was not started: tests)."""
        self._collect()
        now = self.ctx.clock()
        for challenge in list(self.queue):
            if challenge.ready or now < challenge.next_try:
                continue
            if self._in_bucket(challenge) and not challenge.answered:
                self._poll(challenge)  # holds nothing: a holder that answers all but one holds no slot
                if not challenge.answered:
                    continue
            holding = sum(c.holding for c in self.queue)
            if challenge.holding or holding < self.config.max_queue:
                self._fetch(challenge)
        if self._sender_jobs is None:
            self._match_senders()  # inline (tests)
        elif self._matching is None or self._matching.done():
            # Its own thread: a sender that answers slowly holds only the matching of senders.
            self._matching = self._sender_jobs.submit(self._match_senders)
            self._matching.add_done_callback(self._log_failure)
        if self._running is None or self._running.done():
            self._running = None
            self._replay_next()

    def _collect(self) -> None:
        with self.ctx.db.read() as session:
            if self.last_id is None:
                self.last_id = session.scalar(select(func.max(m.Receipt.id))) or 0
                if self._bucket is not None:  # what an earlier run asked: its queue is gone
                    cleared = self._bucket.clear()
                    if cleared:
                        self.ctx.log(
                            f"replay check: {cleared} challenges an earlier run left in the bucket deleted"
                        )
                return
            rows = session.execute(
                select(m.Receipt, m.Peer.address, m.Wallet.public_key)
                .join(m.Peer, m.Peer.wallet_id == m.Receipt.wallet_id, isouter=True)
                .join(m.Wallet, m.Wallet.wallet_id == m.Receipt.wallet_id, isouter=True)
                .where(m.Receipt.id > self.last_id)
                .order_by(m.Receipt.id)
                .limit(self.config.max_per_pass)
            ).all()
            session.expunge_all()
            draw = self._budget_draw(session) if rows and self.config.budget is not None else None
            probation = members.awaiting_checks(session, self.membership) if rows else set()
        self._queue_disputed()
        for receipt, address, public_key in rows:
            self.last_id = receipt.id
            if receipt.disputes and public_key is not None:
                self._queue_disputes(receipt, public_key)
            segmented = segment_root(receipt)
            if segmented is None and (receipt.stage != 0 or self.ctx.network.num_stages != 1):
                continue  # no segment root, and no whole round to replay alone
            # A probationer that did its rounds is checked at once: its admission waits on it. Each
            # stage's such checks hold at most MAX_ADMISSION_CHECKS places: keys that vote the public
            # majority hash without working get here too, and must not hold every stage's up.
            wanted = (
                (receipt.stage, receipt.wallet_id) in probation
                and not self._queued(receipt.wallet_id)
                and self._admission_waiting(receipt.stage) < MAX_ADMISSION_CHECKS
            )
            if not (wanted or (self._drawn(receipt) if draw is None else draw(receipt))):
                continue
            picked_before = self._picked.get(receipt.wallet_id)
            self._picked[receipt.wallet_id] = max(
                receipt.round, -1 if picked_before is None else picked_before
            )
            if self._dataset is None:
                self._dataset = self._open_dataset()
            problems = (
                receipt_problems(receipt, self._dataset.manifest, self.ctx.network)
                if receipt.stage == 0
                else []
            )
            if segmented is None and receipt.inner_state_digest is None:
                problems.append("the receipt commits to no inner optimizer state, so it cannot be replayed")
            count = segment_count_problem(receipt, allowed_segment_steps(self.ctx.network))
            if count is not None:
                problems.append(count)
            if problems:
                self._record(receipt, False, "; ".join(problems))
            elif self._after_settlement(receipt.stage, receipt.round, receipt.received_at):
                # No verdict could be given if it went unanswered, so a pass must not count either
                # (toward admission): a node would answer only the late rounds it did honestly.
                self.ctx.log(
                    f"replay check: {receipt.wallet_id} round {receipt.round} came after its round "
                    "settled; not checked"
                )
                self._unpick(receipt, picked_before)  # a late receipt resets no clock
            elif address is None:
                self.ctx.log(
                    f"replay check: {receipt.wallet_id} has no registered address; round {receipt.round} skipped"
                )
            elif is_relay(address) and (self._bucket is None or public_key is None):
                self.ctx.log(
                    f"replay check: {receipt.wallet_id} is a relay replica and the verifier has no "
                    f"bucket to challenge it through (--relay); round {receipt.round} not checked"
                )
            elif (waiting := self._drawn_waiting()) >= self.config.max_queue + MAX_WAITING:
                self.ctx.log(
                    f"replay check: {waiting} challenges already waiting; "
                    f"{receipt.wallet_id} round {receipt.round} not checked"
                )
                self._unpick(receipt, picked_before)
            elif (queued := self._queued_of(receipt.wallet_id)) >= MAX_QUEUED_PER_WALLET:
                self.ctx.log(
                    f"replay check: {receipt.wallet_id} has {queued} challenges in the queue already; "
                    f"round {receipt.round} not checked"
                )
                self._unpick(receipt, picked_before)
            else:
                drawn = () if segmented is None else self._draw_segments(receipt, segmented[1])
                last = None if segmented is None else segmented[1] - 1
                where = BucketHolder(public_key) if is_relay(address) and public_key else address
                self.queue.append(
                    Challenge(
                        receipt,
                        where,
                        segments=drawn,
                        last=last,
                        picked_before=picked_before,
                        admission=wanted,
                    )
                )

    # --- disputes: answers an audit found apart (protocol.reports.Dispute) ----------------------

    def _queue_disputes(self, receipt: m.Receipt, receiver_key: str) -> None:
        """Hold each reply a receipt disputes to its replier's own signed round log, as a sender of
        what a checked replica consumed is held (`SenderMatch`), whether the receipt is drawn or
        not: the disputing replica's audit could not tell which answer was wrong (in a stage of two
        it never can), the replier's log and its segment's replay can. The ledger checked each
        reply's signature and that it answers the receipt's wallet. Not taken up: a receipt that
        came after its round settled (held back, it could name rounds its repliers no longer
        keep), replies of a stage the run does not have or from wallets not registered for it, and
        more than MAX_DISPUTE_MATCHES waiting at once (they must not crowd out ordinary matches)."""
        if self._after_settlement(receipt.stage, receipt.round, receipt.received_at):
            self.ctx.log(
                f"replay check: {receipt.wallet_id} round {receipt.round} came after its round settled; "
                "its disputes are not taken up"
            )
            return
        now = self.ctx.clock()
        disputes = []
        for obj in receipt.disputes or ():
            try:
                disputes.append(Dispute.from_obj(obj, "dispute"))
            except Refused as exc:  # stored by the ledger from a parsed Dispute: not expected
                self.ctx.log(
                    f"replay check: {receipt.wallet_id} round {receipt.round}: a dispute does not parse: {exc}"
                )
        keys = sorted({r.wallet for d in disputes for r in d.replies})
        with self.ctx.db.read() as session:
            rows = session.execute(
                select(m.Wallet.public_key, m.Peer.stage)
                .join(m.Peer, m.Peer.wallet_id == m.Wallet.wallet_id)
                .where(m.Wallet.public_key.in_(keys))
            )
            registered = {(key, stage) for key, stage in rows}
        for dispute in disputes:
            for reply in dispute.replies:
                what = f"the dispute of {receipt.wallet_id} round {receipt.round} over micro-batch {dispute.micro_batch[:8]}"
                if (
                    reply.stage >= self.ctx.network.num_stages
                    or (reply.wallet, reply.stage) not in registered
                ):
                    self.ctx.log(
                        f"replay check: {what}: {reply.wallet[:16]}… is not a registered replica of stage "
                        f"{reply.stage}; its reply not taken up"
                    )
                    continue
                message = Received("gradient", reply.wallet, reply.to_json(), b"")
                match = SenderMatch(
                    reply.wallet, reply.stage, reply.round, receipt.wallet_id, receiver_key, [message], now,
                    disputed=dispute.micro_batch,
                )  # fmt: skip
                with self._senders_lock:
                    waiting = sum(1 for x in self._senders if x.disputed is not None)
                    if waiting >= MAX_DISPUTE_MATCHES or len(self._senders) >= MAX_PENDING_SENDERS:
                        self.ctx.log(f"replay check: {waiting} disputed replies waiting; {what} not taken up")
                        return
                    self._senders.append(match)
                self.disputes += 1

    def _disputed_segment(
        self, match: SenderMatch, receipt: m.Receipt, where: str | BucketHolder, signed: SignedSegmentLog
    ) -> None:
        """The replier's log does not contradict its disputed answer: find the step that consumed
        the micro-batch from the disputing replica (the one that records sending the disputed
        payload, when several did) and have its segment replayed (on the next pass: this runs on
        the sender matching thread). A log with no such step proves nothing alone (a round redone
        after a crash lists the crashed run's headers, not its steps): logged only."""
        assert match.disputed is not None
        wallet = receipt.wallet_id
        log = signed.log
        payload = GradientReply.from_json(match.messages[0].header).payload_sha256
        stepped = [
            i
            for i, step in enumerate(log.steps)
            if step.micro_batch == match.disputed
            and any(ref.sender == match.receiver_key for ref in step.received)
        ]
        if not stepped:
            self.ctx.log(
                f"replay check: {wallet} round {match.round}'s log has no step on micro-batch "
                f"{match.disputed[:8]} disputed by {match.receiver}; no segment to replay, no verdict"
            )
            return
        sent = [i for i in stepped if any(ref.payload_sha256 == payload for ref in log.steps[i].sent)]
        step = (sent or stepped)[0]
        segment = next(j for j in range(log.segments) if log.segment(j)[0] <= step < log.segment(j)[1])
        self._disputes_found.append((receipt, where, segment, match.disputed))

    def _queue_disputed(self) -> None:
        """Queue the segments the sender matching thread located (`_disputed_segment`) as challenges
        of their repliers' receipts (`Challenge.disputed`), each segment of a replier's round once
        (a dispute over an honest answer cannot keep another over a lie in the same round from its
        check), within the queue's bounds."""
        while self._disputes_found:
            receipt, where, segment, micro_batch = self._disputes_found.popleft()
            key = (receipt.wallet_id, receipt.stage, receipt.round, segment)
            what = f"{receipt.wallet_id} round {receipt.round} (disputed micro-batch {micro_batch[:8]})"
            if key in self._disputed or any(
                (c.receipt.wallet_id, c.receipt.stage, c.receipt.round) == key[:3] and segment in c.segments
                for c in self.queue
            ):
                continue  # that segment's replay is done or coming
            if self._after_settlement(receipt.stage, receipt.round, receipt.received_at):
                self.ctx.log(f"replay check: {what} came after its round settled; not checked")
                continue
            disputed = [c for c in self.queue if c.disputed is not None]
            if len(disputed) >= MAX_DISPUTE_CHALLENGES:
                self.ctx.log(
                    f"replay check: {len(disputed)} disputes' challenges already waiting; {what} not checked"
                )
                continue
            if any(c.receipt.wallet_id == receipt.wallet_id for c in disputed):
                self.ctx.log(
                    f"replay check: {receipt.wallet_id} has a dispute's challenge in the queue already; {what} not checked"
                )
                continue
            self._disputed[key] = None
            while len(self._disputed) > DISPUTED_KEPT:
                self._disputed.popitem(last=False)
            count = receipt.segments or 1
            self.ctx.log(f"replay check: {what}: segment {segment} of {count} to replay")
            self.queue.append(
                Challenge(receipt, where, segments=(segment,), last=count - 1, disputed=micro_batch)
            )

    def _admission_waiting(self, stage: int) -> int:
        """Challenges in the queue taken for a probationer's admission in `stage`."""
        return sum(1 for c in self.queue if c.admission and c.receipt.stage == stage)

    def _drawn_waiting(self) -> int:
        """Challenges in the queue that were drawn (or asked for admission), not a dispute's: those
        have places of their own (MAX_DISPUTE_CHALLENGES), so disputes a replica files cannot crowd
        out, or hold back, anyone's drawn checks."""
        return sum(1 for c in self.queue if c.disputed is None)

    def _queued_of(self, wallet_id: str) -> int:
        """The wallet's drawn challenges in the queue (a dispute's do not count: `_drawn_waiting`)."""
        return sum(1 for c in self.queue if c.receipt.wallet_id == wallet_id and c.disputed is None)

    def _unpick(self, receipt: m.Receipt, before: int | None) -> None:
        """A drawn receipt was not checked, by the wallet's doing or the queue's: not counted as
        checked either, so the budget's draw still sees the wallet due (`_budget_draw`), and an
        overdue place of its round it took is given back for another overdue wallet."""
        wallet_id = receipt.wallet_id
        if before is None:
            self._picked.pop(wallet_id, None)
        else:
            self._picked[wallet_id] = before
        if (wallet_id, receipt.round) in self._overdue_taken:
            self._overdue_taken.discard((wallet_id, receipt.round))
            self._overdue_picks[receipt.round] = max(0, self._overdue_picks.get(receipt.round, 0) - 1)

    def _draw_segments(self, receipt: m.Receipt, count: int) -> tuple[int, ...]:
        return draw_segments(
            self.ctx.operator,
            receipt.wallet_id,
            receipt.stage,
            receipt.round,
            count,
            self.config.segments_per_check,
        )

    def _queued(self, wallet_id: str) -> bool:
        return self._queued_of(wallet_id) > 0

    def _drawn(self, receipt: m.Receipt) -> bool:
        rate = self.config.sample_rate
        return sampled(self.ctx.operator, "replay", receipt.wallet_id, receipt.stage, receipt.round, rate)

    def _budget_draw(self, session: Session) -> Callable[[m.Receipt], bool]:
        """This pass's draw under the budget: overdue wallets, else q_w by the operator's signature."""
        assert self.config.budget is not None
        budget = self.config.budget
        latest = session.scalar(select(func.max(m.Receipt.round)).where(m.Receipt.stage == 0)) or 0
        merged: dict[str, Standing] = {}
        for standing in standings(session):
            last = max(standing.last_checked_round or -1, self._picked.get(standing.wallet_id, -1))
            merged[standing.wallet_id] = replace(standing, last_checked_round=None if last < 0 else last)
        rates = check_rates(list(merged.values()), latest, budget)
        gap = budget.max_gap(len(merged))
        # Overdue wallets get the coverage share of each round and no more, so the budget holds
        # when many fall due at once (all that joined together); the rest wait a round or two.
        per_round = math.ceil(budget.coverage_share * budget.checks)
        for old in [r for r in self._overdue_picks if r < latest - 10]:
            del self._overdue_picks[old]
        self._overdue_taken = {(w, r) for w, r in self._overdue_taken if r >= latest - 10}

        def draw(receipt: m.Receipt) -> bool:
            standing = merged.get(receipt.wallet_id)
            if standing is None:
                return False
            picked = self._picked.get(receipt.wallet_id)
            if picked is not None and picked >= receipt.round:
                return False
            if (
                overdue(standing, receipt.round, gap)
                and self._overdue_picks.get(receipt.round, 0) < per_round
            ):
                self._overdue_picks[receipt.round] = self._overdue_picks.get(receipt.round, 0) + 1
                self._overdue_taken.add((receipt.wallet_id, receipt.round))
                return True
            return sampled(
                self.ctx.operator,
                "replay",
                receipt.wallet_id,
                receipt.stage,
                receipt.round,
                rates[receipt.wallet_id],
            )

        return draw

    @staticmethod
    def _in_bucket(challenge: Challenge) -> bool:
        """A segment check of a relay replica: its pieces are looked for before they are read."""
        return isinstance(challenge.address, BucketHolder) and bool(challenge.segments)

    def _poll(self, challenge: Challenge) -> None:
        """Look for the answers of a bucket check (`_in_bucket`) without reading them, asking again
        for those not there; `answered` once every wanted piece not yet read is there. The window
        runs from the first look, as from the first try over HTTP."""
        assert isinstance(challenge.address, BucketHolder) and self._bucket is not None
        receipt = challenge.receipt
        if challenge.first_try is None:
            challenge.first_try = self.ctx.clock()
        challenge.tries += 1
        paths = [
            SEGMENT.format(round=receipt.round, segment=j)
            for j in challenge.wanted
            if j not in challenge.pieces
        ]
        try:
            looked = self._bucket.look(challenge.address.public_key, paths)
        except BucketUnavailable as exc:
            self._bucket_failed(challenge, exc)
            return
        if looked.missing:
            self._no_answer(challenge, f"not answered: {', '.join(looked.missing)} not in the bucket yet")
        else:
            challenge.answered, challenge.written = True, looked.oldest

    def _bucket_failed(self, challenge: Challenge, exc: BucketUnavailable) -> None:
        """The verifier's own failure: this try does not count, and the window starts again. What
        was read is let go (the check holds no slot while the bucket is out) and asked again."""
        self.ctx.log(
            f"replay check: the bucket failed the verifier, {challenge.receipt.wallet_id} not judged yet: {exc}"
        )
        self._restart(challenge)
        challenge.next_try = self.ctx.clock() + RETRY_EVERY_S

    @staticmethod
    def _restart(challenge: Challenge) -> None:
        """Back to the first look: nothing held, a new window (a bucket check only)."""
        challenge.first_try, challenge.tries, challenge.log_asked = None, 0, None
        if isinstance(challenge.address, BucketHolder) and challenge.segments:
            challenge.pieces.clear()
            challenge.answered, challenge.written = False, None
            challenge.previous, challenge.needs_previous = None, False

    def _withdrawn(self, challenge: Challenge, exc: NotAnswered) -> None:
        """An answer `_poll` saw is gone or unreadable before it was read. The holder deletes an
        answer only once the verifier deleted its challenge, and the bucket's lifecycle rule keeps
        every object a day at least (node.p2p.bucket.bucket_lifecycle_rule): so within
        ANSWER_KEPT_S of the answers' writing the holder took it back, and fails as one that does
        not answer (else it could keep a slot, deleting and restoring one answer while the rest
        download). Later, the verifier was too slow to read it: the check starts over."""
        written = challenge.written
        if written is not None and self.ctx.clock() - written < ANSWER_KEPT_S:
            self._drop(challenge)
            self._unanswered(
                challenge, f"withdrew or spoiled an answer in the bucket after it was found there ({exc})"
            )
            return
        self.ctx.log(
            f"replay check: {challenge.receipt.wallet_id}'s answers expired before they were read; asked again"
        )
        self._restart(challenge)
        challenge.next_try = self.ctx.clock() + RETRY_EVERY_S

    def _fetch(self, challenge: Challenge) -> None:
        receipt = challenge.receipt
        if challenge.first_try is None:
            challenge.first_try = self.ctx.clock()
        challenge.tries += 1
        try:
            if challenge.segments:
                unanswered = []
                for j in challenge.wanted:  # through a bucket, every missing piece is asked at once
                    if j not in challenge.pieces:
                        try:
                            challenge.pieces[j] = self._get_segment(challenge.address, receipt, j)
                        except NotAnswered as exc:
                            if challenge.answered:  # found by `_poll`, gone now
                                self._withdrawn(challenge, exc)
                                return
                            unanswered.append(j)
                if unanswered:
                    raise NotAnswered(f"segments {unanswered} not in the bucket yet")
                challenge.needs_previous = receipt.round > 0 and not self._starts_fresh(challenge)
                if challenge.needs_previous and challenge.previous is None:
                    if self._in_bucket(challenge) and challenge.log_asked is None:
                        challenge.log_asked, challenge.tries = self.ctx.clock(), 1
                    challenge.previous = self._get_log(challenge.address, receipt.round - 1)
                return
            record = self._get_replay(challenge.address, receipt.round)
        except Malformed as exc:
            self._drop(challenge)
            self._record(receipt, False, f"served a malformed replay body: {exc}")
            return
        except BucketUnavailable as exc:
            self._bucket_failed(challenge, exc)
            return
        except (ReplicaDeclined, NotAnswered, OSError, ValueError) as exc:
            what = {ReplicaDeclined: "declined", NotAnswered: "not answered"}.get(type(exc), "unreachable")
            self._no_answer(challenge, f"{what}: {exc}")
            return
        mismatched = [
            what
            for what, digest, committed in (
                ("θ_round", tensor_digest(record.theta_round), receipt.base_hash),
                ("Δ", tensor_digest(record.delta), receipt.delta_digest),
                ("inner optimizer state", record.inner.digest(), receipt.inner_state_digest),
            )
            if digest != committed
        ]
        if mismatched:
            self._drop(challenge)
            self._record(
                receipt, False, f"served {', '.join(mismatched)} other than its receipt committed to"
            )
            return
        challenge.material = record

    def _no_answer(self, challenge: Challenge, why: str) -> None:
        """A try got no usable answer: try again later, or give the verdict once the answer window
        (from the first try; for a bucket's previous-round log, from its first ask) has passed and
        the replica had `MIN_TRIES`. No verdict when the first
        try came later than a window after the receipt (the verifier's own backlog: the node may
        have dropped the round by then). Receipts that came after their round settled are never
        drawn (`_collect`), so none reaches here."""
        receipt = challenge.receipt
        now = self.ctx.clock()
        assert challenge.first_try is not None
        window = self._window(challenge)
        since, deadline = challenge.first_try, challenge.first_try + window
        if challenge.log_asked is not None:  # the pieces are read: a log is left, ~0.3 KB a step
            log_bytes = segment_log_bound(self.ctx.network.diloco.inner_steps)
            log_deadline = challenge.log_asked + self.config.answer_window_s + log_bytes / MIN_BYTES_PER_S
            if log_deadline > deadline:
                since, deadline = challenge.log_asked, log_deadline
        if now <= deadline or challenge.tries < MIN_TRIES:
            challenge.next_try = now + RETRY_EVERY_S
            return
        self._drop(challenge)
        if challenge.first_try - receipt.received_at > window:
            self.ctx.log(
                f"replay check: {receipt.wallet_id} round {receipt.round} not served for {window:.0f} s "
                f"({why}); the verifier first asked more than a window after the receipt: no verdict"
            )
            return
        self._unanswered(challenge, f"did not answer its challenge within {deadline - since:.0f} s ({why})")

    def _unanswered(self, challenge: Challenge, detail: str) -> None:
        """Fail a dropped challenge's replica at `unanswered_penalty` (no fraud proof); a dispute's
        check gives no verdict (`Challenge.disputed`)."""
        if challenge.disputed is not None:
            receipt = challenge.receipt
            self.ctx.log(
                f"replay check: {receipt.wallet_id} round {receipt.round} (disputed micro-batch "
                f"{challenge.disputed[:8]}) {detail}; no verdict for a dispute's check"
            )
            return
        try:
            self._record(challenge.receipt, False, detail, penalty=self.ctx.reputation.unanswered_penalty)
        finally:
            with self._count_lock:
                self.unanswered += 1

    def _window(self, challenge: Challenge) -> float:
        """How long `challenge` may go unanswered: `answer_window_s`, and through a bucket as long
        again as its answers take to upload at MIN_BYTES_PER_S (over HTTP, a try started inside the
        window streams on past it; through a bucket, every answer must be up before the end)."""
        window = self.config.answer_window_s
        if isinstance(challenge.address, BucketHolder):
            numel, n_tensors, _ = self._stage(challenge.receipt.stage)
            if challenge.segments:
                size = len(challenge.wanted) * 4 * (7 * numel + 2 * n_tensors)
            else:
                size = replay_size_bound(numel, n_tensors)
            window += size / MIN_BYTES_PER_S
        return window

    def _after_settlement(self, stage: int, round_: int, received_at: float) -> bool:
        """Whether a receipt received at `received_at` came after its (stage, round) settled."""
        with self.ctx.db.read() as session:
            settled = session.get(m.Round, (stage, round_))
            return settled is not None and settled.settled_at < received_at

    def _replay_next(self) -> None:
        for challenge in self.queue:
            if not challenge.ready:
                continue
            receipt = challenge.receipt
            trusted = self._base_is_majority(receipt)
            if trusted is None:
                if self.ctx.clock() - receipt.received_at > self.config.retry_s:
                    self._drop(challenge)
                    self.ctx.log(
                        f"replay check: round {receipt.round - 1} never settled; {receipt.wallet_id} skipped"
                    )
                continue
            self._drop(challenge)
            if not trusted:
                # Hash agreement already judges a replica on a minority θ; replaying from it
                # would check work against weights nobody else holds.
                self.ctx.log(
                    f"replay check: {receipt.wallet_id} round {receipt.round} started from a minority θ "
                    f"({receipt.base_hash[:16]}); not replayed"
                )
                return
            if self._replays is None:
                self._check(challenge)
            else:
                self._running = self._replays.submit(self._check, challenge)
                self._running.add_done_callback(self._log_failure)
            return

    def _log_failure(self, future: Future[None]) -> None:
        """Log what a replay on the replay thread raised: nothing else reads its result."""
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            self.ctx.log(f"replay check: a replay failed: {type(exc).__name__}: {exc}")

    def _base_is_majority(self, receipt: m.Receipt) -> bool | None:
        """Whether θ_round is the stage's majority θ_r; None while round r−1 is not settled."""
        if receipt.round == 0:
            return receipt.base_hash == self._stage(receipt.stage)[2]
        with self.ctx.db.read() as session:
            settled = session.get(m.Round, (receipt.stage, receipt.round - 1))
            majority = None if settled is None else settled.majority_hash
            if settled is not None and majority is None:
                return False  # a tie: no majority θ to replay from
        return None if majority is None else majority == receipt.base_hash

    def _stage(self, stage: int) -> tuple[int, int, str]:
        """(numel, parameter tensors, θ_0 hash) of `stage`'s model in this run's definition (a stage
        grown with the tokenizer holds more values: `_decoded_numel`)."""
        if stage not in self._stages:
            model = build_stage(self.ctx.network.model, stage, self.ctx.network.num_stages)
            params = list(model.parameters())
            self._stages[stage] = (
                sum(p.numel() for p in params),
                len(params),
                tensor_digest(flat_parameters(params)),
            )
        return self._stages[stage]

    def _check(self, challenge: Challenge) -> None:
        if challenge.segments:
            self._check_segments(challenge)
        else:
            assert challenge.material is not None
            self._replay(challenge.receipt, challenge.material)

    def _check_segments(self, challenge: Challenge) -> None:
        """Check and replay the drawn segments and record the verdict (on the replay thread)."""
        receipt = challenge.receipt
        device, precision = getattr(receipt, "device", None), getattr(receipt, "precision", None)
        started = time.perf_counter()
        # The run's k picks the tolerance, whatever k the replica committed with (the legacy H/10
        # is accepted, but not its looser whole-round tolerance).
        k = self.ctx.network.segment_k
        judged = judge_segments(
            self.ctx.network,
            receipt,
            challenge.pieces,
            tolerance_for(device, precision, self.config, segment_steps=k),
            self._dataset,
            replay=challenge.segments,
        )
        seconds = time.perf_counter() - started
        with self._count_lock:
            self.replay_seconds += seconds
        if judged.ok:  # the log is the committed one: hold its start to the round before
            broken = self._continuity(challenge)
            if broken is not None:
                detail = f"optimizer continuity: {broken}"
                proof = self._continuity_proof(challenge)
                self._record(
                    receipt, False, detail, reason=detail, kind=fraudproofs.KIND_CONTINUITY,
                    proofs=[] if proof is None else [k for k in [self._write_proof(receipt, 0, proof)] if k],
                )  # fmt: skip
                return
        if judged.ok and challenge.disputed is not None:
            # The disputing replica chose the segment: a pass says nothing of the segments a fair
            # draw would have checked, so it earns nothing (and leaves the wallet as due as it was).
            with self._count_lock:
                self.passed += 1
            self.ctx.log(
                f"replay check: {receipt.wallet_id} round {receipt.round} passed the check of disputed "
                f"micro-batch {challenge.disputed[:8]}, not counted: {judged.detail}"
            )
            self._queue_senders(challenge)
            return
        if judged.ok and judged.credit:
            strangers = self._strangers(challenge)
            if strangers is not None:
                judged = replace(judged, credit=False, detail=f"{judged.detail}; {strangers}")
        if judged.ok and not judged.credit:
            # Offers of a crashed run are listed, not replayed, and inputs from wallets no stage
            # registered vouch for nothing: a pass earns nothing (no more than a receipt without
            # a root earns). Its headers still hold its senders to their logs.
            self.ctx.log(
                f"replay check: {receipt.wallet_id} round {receipt.round} passed, not counted: {judged.detail}"
            )
            if self._picked.get(receipt.wallet_id) == receipt.round:  # nothing later picked since
                self._unpick(receipt, challenge.picked_before)  # still due, as without a root
            self._queue_senders(challenge)
            return
        self.fraud_proofs.extend(proof for _, proof in judged.proofs)
        kept = [k for k in (self._write_proof(receipt, j, proof) for j, proof in judged.proofs) if k]
        self._record(
            receipt, judged.ok, f"{judged.detail}; {seconds:.2f} s", proofs=kept, reason=judged.detail
        )
        if judged.ok:  # the drawn segments' headers are now their senders' checked signatures
            self._queue_senders(challenge)

    def _write_proof(self, receipt: m.Receipt, segment: int, proof: bytes) -> tuple[int, str, int] | None:
        """Write a proof's file before its row is committed; (segment, sha256, size), or None
        when there is nowhere to keep it or the write failed (the verdict stands either way)."""
        directory = self.config.fraud_proof_dir
        if directory is None:
            return None
        try:
            short = fraudproofs.room_for(directory, len(proof))
            if short is not None:
                self.ctx.log(
                    f"replay check: the fraud proof of {receipt.wallet_id} round {receipt.round} segment "
                    f"{segment} is not written to {directory} ({short}); kept in memory only"
                )
                return None
            return segment, fraudproofs.write_proof(directory, proof), len(proof)
        except OSError as exc:
            self.ctx.log(
                f"replay check: the fraud proof of {receipt.wallet_id} round {receipt.round} segment "
                f"{segment} could not be written to {directory} ({exc}); kept in memory only"
            )
            return None

    def _replay(self, receipt: m.Receipt, material: ReplayRecord) -> None:
        """Replay one round and record the verdict (on the replay thread when started)."""
        assert self._dataset is not None  # opened when the receipt was sampled
        started = time.perf_counter()
        try:
            batches = claimed_batches(
                source=self._dataset.source,
                manifest=self._dataset.manifest,
                wallet_id=receipt.wallet_id,
                spans=[DataSpan(shard_id=s, offset_start=a, offset_end=b) for s, a, b in receipt.data_spans],
                batch_size=self.ctx.network.batch_size,
                seq_len=self.ctx.network.seq_len,
            )
            replayed = replay_inner_steps(
                self.ctx.network.model,
                self.ctx.network.diloco,
                material.theta_round,
                batches,
                round_=receipt.round,
                inner_state=material.inner,
            )
        except SpotCheckError as exc:
            self._record(receipt, False, f"cannot be replayed: {exc}")
            return
        seconds = time.perf_counter() - started
        with self._count_lock:
            self.replay_seconds += seconds
        # The receipt's device and precision fields (node.receipt) once the database keeps them.
        device, precision = getattr(receipt, "device", None), getattr(receipt, "precision", None)
        result = compare_deltas(material.delta, replayed, tolerance_for(device, precision, self.config))
        self._record(
            receipt,
            result.ok,
            f"{result.reason}; {receipt.inner_steps} inner steps replayed in {seconds:.2f} s",
        )

    # --- verdicts and the peer plane ----------------------------------------------------------

    def _drop(self, challenge: Challenge) -> None:
        self.queue.remove(challenge)
        if isinstance(challenge.address, BucketHolder) and self._bucket is not None:
            # Whatever was asked and not read: its holder then deletes the answers it uploaded.
            r = challenge.receipt.round
            paths = [SEGMENT.format(round=r, segment=j) for j in challenge.wanted]
            paths += [REPLAY.format(round=r)] + ([SEGMENT_LOG.format(round=r - 1)] if r > 0 else [])
            self._bucket.release(challenge.address.public_key, paths)

    def _record(
        self,
        receipt: m.Receipt,
        ok: bool,
        detail: str,
        *,
        proofs: Sequence[tuple[int, str, int]] = (),
        reason: str = "",
        penalty: float | None = None,
        kind: str = fraudproofs.KIND_SEGMENT,
    ) -> None:
        """Record the verdict and list the fraud proofs (segment, sha256, size) already written to
        `fraud_proof_dir`, in one transaction; then delete the files of rows pruned beyond
        `keep_fraud_proofs` and old files no row names."""
        now = self.ctx.clock()
        with self.ctx.db.write() as session:
            ledger.record_receipt_check(
                session,
                receipt,
                ok=ok,
                detail=f"replay: {detail}",
                now=now,
                cfg=self.ctx.reputation,
                membership=self.membership,
                penalty=penalty,
            )
            kept = self._list_proofs(session, receipt, proofs, reason, kind)
        self._tidy_proofs(receipt, proofs, *kept)
        with self._count_lock:
            if ok:
                self.passed += 1
            else:
                self.failed += 1
        verdict = "passed" if ok else "FAILED"
        self.ctx.log(f"replay check: {receipt.wallet_id} round {receipt.round} {verdict}: {detail}")

    def _list_proofs(
        self,
        session: Session,
        receipt: m.Receipt,
        proofs: Sequence[tuple[int, str, int]],
        reason: str,
        kind: str,
    ) -> tuple[list[str], list[str]]:
        """List proofs already written (in the verdict's transaction) and prune beyond the keep
        limits: (the sha256s pruned, those still listed), both empty without proofs."""
        now = self.ctx.clock()
        for segment, sha256, size in proofs:
            fraudproofs.add_row(
                session, sha256=sha256, size=size, receipt=receipt, segment=segment, reason=reason,
                now=now, kind=kind,
            )  # fmt: skip
        if not proofs:
            return [], []
        dropped = fraudproofs.prune_rows(session, self.config.keep_fraud_proofs, self.config.keep_fraud_bytes)
        return dropped, fraudproofs.listed(session)

    def _tidy_proofs(
        self, receipt: m.Receipt, proofs: Sequence[tuple[int, str, int]], dropped: list[str], held: list[str]
    ) -> None:
        """After the commit: delete the files of pruned rows and old files no row names."""
        directory = self.config.fraud_proof_dir
        if proofs and directory is not None:
            fraudproofs.remove_files(directory, dropped)
            fraudproofs.sweep_orphans(directory, held, now=time.time())
        for _, sha256, size in proofs:
            self.ctx.log(
                f"replay check: fraud proof {sha256} ({size / 1e6:.1f} MB) of {receipt.wallet_id} "
                f"round {receipt.round} kept in {directory}"
            )

    def _fresh(self, piece: SegmentMaterial) -> str:
        """A fresh optimizer's digest at the size of `piece`'s model (grown vocabularies included)."""
        shape = (piece.theta_round.numel(), piece.start.inner.steps.numel())
        if shape not in self._fresh_digests:
            self._fresh_digests[shape] = fresh_inner_digest(*shape)
        return self._fresh_digests[shape]

    def _starts_fresh(self, challenge: Challenge) -> bool:
        """Whether the served log's first checkpoint is θ_round with a fresh optimizer (then no
        earlier round needs reading; whether the log is the committed one is judged later)."""
        piece = next(iter(challenge.pieces.values()))
        start = checkpoint_hash(challenge.receipt.base_hash, self._fresh(piece))
        return bool(piece.log.checkpoints) and piece.log.checkpoints[0] == start

    def _get_log(
        self, address: str | BucketHolder, round_: int, *, timeout_s: float | None = None
    ) -> SignedSegmentLog:
        """A replica's signed log of `round_`; raises like _get_segment."""
        bound = segment_log_bound(self.ctx.network.diloco.inner_steps)
        body = self._signed_get(address, SEGMENT_LOG.format(round=round_), bound, timeout_s=timeout_s)
        try:
            return SignedSegmentLog.decode(body)
        except Refused as exc:
            raise Malformed(str(exc)) from None

    def _continuity(self, challenge: Challenge) -> str | None:
        """Why the checked round's starting optimizer state does not continue the replica's previous
        round (segmentcheck.continuity_problem); None when it does. A log of the round before served
        without its end opening fails: a node resets its optimizer whenever a round does not follow
        one it closed itself, and it keeps the end of every round it closes, so only a replica that
        strips it (to keep its moments unchecked) serves a non-fresh start without one."""
        receipt = challenge.receipt
        piece = challenge.pieces[challenge.segments[0]]
        previous = challenge.previous
        with self.ctx.db.read() as session:
            previous_root = session.scalar(
                select(m.Receipt.segment_root).where(
                    m.Receipt.wallet_id == receipt.wallet_id,
                    m.Receipt.stage == receipt.stage,
                    m.Receipt.round == receipt.round - 1,
                )
            )
        return continuity_problem(
            piece.log, receipt.base_hash, self._fresh(piece), previous, piece.commitment.wallet, previous_root
        )

    def _continuity_proof(self, challenge: Challenge) -> bytes | None:
        """A failed continuity check as a ContinuityFraudProof's bytes, kept in `fraud_proofs`
        too; None when the replica's answer makes none (no start opening served: nodes before it
        was; a round before whose log was not served, not signed, or not opened: the verdict
        stands, but only the replica's own contradicting signatures prove fraud to others)."""
        piece = challenge.pieces[challenge.segments[0]]
        if piece.start_inner is None:
            return None
        signed = SignedSegmentLog(piece.log, piece.commitment)
        proof = ContinuityFraudProof.of(signed, piece.theta_round, piece.start_inner, challenge.previous)
        network = self.ctx.network
        verdict = judge_continuity_proof(
            proof,
            n_tensors=piece.start.inner.steps.numel(),
            network=network.digest(),
            num_stages=network.num_stages,
        )
        if not verdict.proves:
            return None
        data = proof.encode()
        self.fraud_proofs.append(data)
        return data

    def _get_segment(self, address: str | BucketHolder, receipt: m.Receipt, segment: int) -> SegmentMaterial:
        """Segment `segment` of the receipt's round as the replica serves it; raises like _get_replay."""
        stage, num_stages = receipt.stage, self.ctx.network.num_stages
        _, n_tensors, _ = self._stage(stage)
        committed = segment_root(receipt)
        assert committed is not None
        k = max_segment_steps(receipt.inner_steps, committed[1])
        largest = largest_numel(self.ctx.network.model, stage, num_stages)
        limit = segment_size_bound(largest, n_tensors, k, self.config.max_message_bytes)
        path = SEGMENT.format(round=receipt.round, segment=segment)
        body = self._signed_get(address, path, limit)
        try:
            numel = self._decoded_numel(body, "theta_round", stage, num_stages, "segment material")
            material = SegmentMaterial.decode(body, numel=numel, n_tensors=n_tensors)
        except Refused as exc:
            raise Malformed(str(exc)) from None
        if material.segment != segment:
            raise Malformed(f"asked for segment {segment}, served segment {material.segment}")
        return material

    # --- senders' records ----------------------------------------------------------------------

    @staticmethod
    def _signed_by_senders(challenge: Challenge) -> dict[tuple[str, int, int], list[Received]]:
        """The drawn segments' messages by (sender's public key, its stage, its round), as their
        headers name them (`sender_round`); the failed steps' activations were signed by senders too."""
        by_sender: dict[tuple[str, int, int], list[Received]] = {}
        for j in challenge.segments:
            piece = challenge.pieces[j]
            for step in [*piece.received, *(messages for _, messages, _ in piece.failed)]:
                for message in step:
                    where = sender_round(message)
                    if where is not None:
                        by_sender.setdefault((message.sender, *where), []).append(message)
        return by_sender

    def _strangers(self, challenge: Challenge) -> str | None:
        """Why a passed check earns no credit because its segments consumed messages from wallets
        that never registered with this verifier for the stage their headers name (None: all did,
        or the policy is ``open``, under which a replica takes everyone's).

        Under ``allowlist`` or ``probation`` a replica takes micro-batches only from wallets on
        its neighbour stages' member lists (node.membership.Neighbours), and a wallet is listed
        only after it registered for that stage, which leaves a `Membership` row that is never
        deleted, or when the operator's roster names it for that stage. A stranger's inputs are
        then ones the replica should not have taken: made up and signed with a free key, say, to
        steer its training while every segment replays. No verdict, because an honest replica that could not read the lists yet takes everyone (it
        starts with none, and a verifier that cannot be reached is not a reason to stop), and a
        verdict would let whoever keeps it from reading them cost it reputation: the pass
        counts for nothing instead, so rounds trained on such inputs earn no reputation and no
        admission. A wallet that registered and was dropped from the lists later (refused, or off
        the roster) is not a stranger: a replica reads the lists every 15 s, not at once. One that
        only the roster named, never registered, is judged by the roster in force at the check:
        dropped from it since the round, it is a stranger (the round's roster is not kept)."""
        if self.membership.policy == "open":
            return None
        pairs = {(key, stage) for key, stage, _ in self._signed_by_senders(challenge)}
        if not pairs:
            return None
        with self.ctx.db.read() as session:
            rows = session.execute(
                select(m.Wallet.public_key, m.Membership.stage)
                .join(m.Membership, m.Membership.wallet_id == m.Wallet.wallet_id)
                .where(m.Wallet.public_key.in_(sorted({key for key, _ in pairs})))
            )
            known = {(key, stage) for key, stage in rows}
            # The operator's roster lists its wallets whether they registered or not.
            roster = members.current_roster(session, now=self.ctx.clock())
        if roster is not None:
            known |= {(key, stage) for key, stage in pairs if key in roster.wallets(stage)}
        strangers = sorted(pairs - known)
        if not strangers:
            return None
        named = ", ".join(
            f"{wallet_id_of(bytes.fromhex(key))} (stage {stage})" for key, stage in strangers[:3]
        )
        more = f" and {len(strangers) - 3} more" if len(strangers) > 3 else ""
        return (
            f"it stepped on messages signed by {len(strangers)} wallet(s) never registered for the stage "
            f"their headers name: {named}{more}"
        )

    def _queue_senders(self, challenge: Challenge) -> None:
        """Queue the senders of the drawn segments' messages (`MAX_SENDER_LOGS` of them, drawn) for matching
        against their own logs: on the fetching thread, once their receipts are in."""
        by_sender = self._signed_by_senders(challenge)
        now = self.ctx.clock()
        receiver = challenge.receipt.wallet_id
        key = next(iter(challenge.pieces.values())).commitment.wallet  # checked: the receipt's wallet
        with self._senders_lock:
            # In the order of a draw, not of the replica's records: a receiver that listed other
            # senders first could otherwise keep a colluding sender from ever being matched.
            r = challenge.receipt
            order = sorted(
                by_sender, key=lambda k: draw(self.ctx.operator, "sender", r.wallet_id, r.round, *k)
            )
            for sender, stage, round_ in order[:MAX_SENDER_LOGS]:
                messages = by_sender[(sender, stage, round_)]
                if len(self._senders) >= MAX_PENDING_SENDERS:
                    self.ctx.log(
                        f"replay check: {len(self._senders)} sender matches waiting; the rest not matched"
                    )
                    return
                self._senders.append(SenderMatch(sender, stage, round_, receiver, key, messages, now))

    def _match_senders(self) -> None:
        """Try up to `SENDERS_PER_PASS` queued sender matches. One whose sender has no receipt yet
        waits up to `sender_wait_s` after it was queued (then `_sender_missing`); one whose receipt
        is in but whose log is not served, `answer_window_s` after the receipt was found, and then
        fails the sender's spot check as an unanswered challenge does (`_sender_unanswered`)."""
        with self._senders_lock:
            batch = [self._senders.popleft() for _ in range(min(SENDERS_PER_PASS, len(self._senders)))]
        for match in batch:
            if match.not_before <= self.ctx.clock() and self._try_sender(match):
                self._release_sender(match)  # ended: a challenge through the bucket goes with it
                continue
            with self._senders_lock:
                self._senders.append(match)

    def _try_sender(self, match: SenderMatch) -> bool:
        """One try of `_match_senders`; True when the match has ended."""
        try:
            if self._match_sender(match):
                return True
            now = self.ctx.clock()
            if match.found is not None:
                if now - match.found[0] > self.config.answer_window_s:
                    self._sender_unanswered(match)
                    return True
            elif now - match.since > self.config.sender_wait_s and self._sender_missing(match):
                return True
        except Exception as exc:  # best effort: a sender's answer must not stop the checker
            self.ctx.log(f"replay check: matching a sender's log failed: {type(exc).__name__}: {exc}")
            return True
        return False

    def _match_sender(self, match: SenderMatch) -> bool:
        """Hold one sender's signed log against the headers it signed (verifier.segmentcheck.
        contradicting): a contradiction is a failed spot check of the sender in its own stage
        and round, once per round. False: not yet (no receipt, or the log not served yet)."""
        wallet = wallet_id_of(bytes.fromhex(match.sender))
        where = (wallet, match.stage, match.round)
        if self._already_penalised(where):
            return True
        with self.ctx.db.read() as session:
            found = session.execute(
                select(m.Receipt, m.Peer.address)
                .join(m.Peer, m.Peer.wallet_id == m.Receipt.wallet_id, isouter=True)
                .where(
                    m.Receipt.wallet_id == wallet,
                    m.Receipt.stage == match.stage,
                    m.Receipt.round == match.round,
                )
            ).first()
            session.expunge_all()
        if found is None:
            return False  # its receipt is not in yet
        receipt, address = found
        root, received_at = receipt.segment_root, receipt.received_at
        # A sender behind NAT (a relay stage-0 or middle replica) is asked through the bucket.
        behind_nat = address is not None and is_relay(address)
        if root is None or address is None or (behind_nat and self._bucket is None):
            self.ctx.log(
                f"replay check: {wallet} round {match.round} commits to no segment log, or has no address "
                "the verifier can reach (a relay replica needs the verifier's --relay); not matched"
            )
            return True
        if match.found is None:
            match.found = (self.ctx.clock(), received_at)
        where_from: str | BucketHolder = BucketHolder(match.sender) if behind_nat else address
        match.via_bucket = behind_nat
        try:
            signed = self._get_log(
                where_from, match.round, timeout_s=min(SENDER_TIMEOUT_S, self.config.timeout_s)
            )
        except NotAnswered as exc:  # asked through the bucket: read again on a later pass
            return self._log_not_read(match, wallet, str(exc))
        except BucketUnavailable as exc:  # the verifier's own trouble: a new window, not a verdict
            match.restarts += 1
            match.found = None
            if match.restarts > MAX_SENDER_RESTARTS:
                self.ctx.log(
                    f"replay check: the bucket failed the verifier {match.restarts} times asking {wallet} "
                    f"for its round {match.round} log ({exc}); not matched"
                )
                return True
            match.not_before = self.ctx.clock() + RETRY_EVERY_S  # as a challenge's try after it
            return self._log_not_read(match, wallet, f"the bucket failed the verifier: {exc}")
        except (ReplicaDeclined, OSError) as exc:
            what = "declined" if isinstance(exc, ReplicaDeclined) else "unreachable"
            return self._log_not_read(match, wallet, f"{what}: {exc}")
        except (Malformed, ValueError) as exc:
            return self._log_not_read(match, wallet, f"unreadable: {exc}")
        problem = signed_log_problem(signed, match.sender, match.stage, match.round, root)
        if problem is None and signed.log.headers is None and received_at >= self.started_at:
            # A round committed before this verifier started may be an older node's, from before
            # logs listed their headers (an upgrade): held to its steps only (`contradicting`).
            problem = "its log lists no signed headers (a log from before 2026-12-07), which a node must"
        middle = 0 < match.stage < self.ctx.network.num_stages - 1
        if problem is None and middle and signed.log.failed is None and received_at >= self.started_at:
            # Likewise a log from before failed steps were listed: a middle stage's offers are not
            # held to its steps (`contradicting`), so one received since must list them (the first
            # and last stages never fail a step after offering: nothing to list).
            problem = (
                "its log lists no failed steps (a log from before 2026-12-07, later), which a node's must"
            )
        if problem is None and signed.commitment.network != self.ctx.network.digest():
            # Headers are held only to a log of their own run: one naming another, or none, would
            # keep the sender out of every claim (a node names its run: NetworkDefinition.digest).
            problem = "its log's commitment does not name this run (the definition's digest)"
        if problem is not None:  # not its committed log (which a node keeps, restarts included): none served
            return self._log_not_read(match, wallet, f"not its committed log: {problem}")
        contradictions = contradicting(signed, match.messages, match.receiver_key)
        if not contradictions:
            if match.disputed is not None:
                self._disputed_segment(match, receipt, where_from, signed)
            return True
        texts = "; ".join(text for _, text in contradictions[:3])
        detail = f"{SENDER_DETAIL}its signed log contradicts what it signed for {match.receiver}: {texts}"
        # Both statements are the sender's own signatures: a proof anyone can check alone.
        message = contradictions[0][0]
        proof = SenderFraudProof(signed, Received(message.kind, message.sender, message.header, b""))
        data = proof.encode()
        self.fraud_proofs.append(data)
        written = self._write_proof(receipt, proof.segment(), data)
        self._sender_failed(where, detail, None, proof=(receipt, written, detail))
        return True

    def _sender_missing(self, match: SenderMatch) -> bool:
        """A sender that sent no receipt for the round its headers name within `sender_wait_s`;
        False when that receipt came in after all (match it on the next pass).

        It fails as an unanswered challenge (once a round) when it kept reporting other rounds of
        that stage: a later round than the one named (it went past the round without reporting
        it), or, since the match was queued, only earlier ones (it named a round ahead of its own,
        which it may never reach). Either way its signed headers name a round whose log nobody
        can ask for. No verdict for a sender that registered again after the named round began (a
        node stopped or crashed mid-round resumes from its checkpoint and sends no receipt for
        that round: a restart, not a lie, as far as anyone can tell), nor for one that reported
        nothing since the match was queued (it may be down). A sender that lost its receipt
        without restarting (its tracker dropped it) pays like one down for a whole answer window."""
        wallet = wallet_id_of(bytes.fromhex(match.sender))
        if match.disputed is not None:  # the round a disputed reply names need not be one it reports
            self.ctx.log(
                f"replay check: {wallet} sent no receipt for round {match.round}, which its disputed reply "
                f"names, within {self.config.sender_wait_s:.0f} s; not matched, no verdict"
            )
            return True
        with self.ctx.db.read() as session:
            mine = (m.Receipt.wallet_id == wallet, m.Receipt.stage == match.stage)
            if (
                session.scalar(select(m.Receipt.round).where(*mine, m.Receipt.round == match.round))
                is not None
            ):
                return False  # it came in since the last try
            later = session.scalar(select(func.max(m.Receipt.round)).where(*mine))
            recent = session.scalar(
                select(func.max(m.Receipt.round)).where(*mine, m.Receipt.received_at >= match.since)
            )
            began = session.scalar(
                select(func.max(m.Receipt.received_at)).where(*mine, m.Receipt.round < match.round)
            )
            registered = session.scalar(select(m.Peer.registered_at).where(m.Peer.wallet_id == wallet))
        named = f"round {match.round}"
        if registered is not None and registered >= (began or 0.0):
            self.ctx.log(
                f"replay check: {wallet} sent no receipt for {named}, which its headers name, and registered "
                "again since that round began (a restart drops an unfinished round); its records are not matched"
            )
            return True
        if later is not None and later > match.round:
            why = (
                f"reported stage {match.stage} up to round {later} but never {named}, which its headers name"
            )
        elif recent is not None and recent < match.round:
            why = f"its headers name {named}, ahead of every round it reported since (up to {recent})"
        else:
            self.ctx.log(
                f"replay check: the log of {wallet} {named} was not read within "
                f"{self.config.sender_wait_s:.0f} s and it reported nothing since; its records are not matched"
            )
            return True
        where = (wallet, match.stage, match.round)
        if self._already_penalised(where):
            return True
        detail = f"{SENDER_DETAIL}{why}: no log to hold its headers to"
        if self._sender_failed(where, detail, self.ctx.reputation.unanswered_penalty):
            with self._count_lock:
                self.unanswered += 1
        return True

    def _release_sender(self, match: SenderMatch) -> None:
        """A match through the bucket has ended: its challenge goes, so the sender's answer does (a
        log that was read was released by the read already; a second delete changes nothing)."""
        if match.via_bucket and self._bucket is not None:
            self._bucket.release(match.sender, [SEGMENT_LOG.format(round=match.round)])

    def _log_not_read(self, match: SenderMatch, wallet: str, why: str) -> bool:
        """No usable log from the sender on this try: tried again until the answer window ends."""
        self.ctx.log(f"replay check: the log of {wallet} round {match.round} not read yet ({why})")
        match.declined = why
        return False

    def _sender_unanswered(self, match: SenderMatch) -> None:
        """A sender whose receipt is in did not serve its round's log for the answer window: an
        unanswered challenge of the sender in its own stage and round, once a round (a sender that
        refused its log only where its records contradict its headers would otherwise never be
        held to them). None when its receipt reached the verifier after the round settled."""
        assert match.found is not None
        wallet = wallet_id_of(bytes.fromhex(match.sender))
        where = (wallet, match.stage, match.round)
        late = self._after_settlement(match.stage, match.round, match.found[1])
        what = f"did not serve its round log within {self.config.answer_window_s:.0f} s ({match.declined})"
        if match.disputed is not None:  # a disputing replica named the round, perhaps one long gone
            self.ctx.log(
                f"replay check: {wallet} round {match.round} {what}; no verdict for a disputed reply"
            )
            return
        if late or self._already_penalised(where):
            self.ctx.log(f"replay check: {wallet} round {match.round} {what}; no verdict")
            return
        if self._sender_failed(where, f"{SENDER_DETAIL}{what}", self.ctx.reputation.unanswered_penalty):
            with self._count_lock:
                self.unanswered += 1

    def _already_penalised(self, where: tuple[str, int, int]) -> bool:
        """Whether the sender already failed for its records in that stage and round: here, or in
        the ledger (a restarted verifier)."""
        if where in self._penalised:
            return True
        wallet, stage, round_ = where
        with self.ctx.db.read() as session:
            found = session.scalar(
                select(m.ReputationEvent.id)
                .where(
                    m.ReputationEvent.wallet_id == wallet,
                    m.ReputationEvent.stage == stage,
                    m.ReputationEvent.round == round_,
                    m.ReputationEvent.delta < 0,
                    m.ReputationEvent.reason.startswith(
                        f"spot check failed in stage {stage} round {round_}: {SENDER_DETAIL}", autoescape=True
                    ),
                )
                .limit(1)
            )
        if found is not None:
            self._penalised.add(where)
        return found is not None

    def _sender_failed(
        self,
        where: tuple[str, int, int],
        detail: str,
        penalty: float | None,
        *,
        proof: tuple[m.Receipt, tuple[int, str, int] | None, str] | None = None,
    ) -> bool:
        """Record a sender's failed spot check in its own stage and round, once a round; False when
        it cannot be recorded (no longer registered). `proof`: (the sender's receipt, its written
        SenderFraudProof's (segment, sha256, size) or None, the reason), listed in the same
        transaction."""
        wallet, stage, round_ = where
        written = () if proof is None or proof[1] is None else (proof[1],)
        try:
            with self.ctx.db.write() as session:
                ledger.record_spot_check(
                    session, wallet, stage=stage, round_=round_, ok=False, detail=detail[:400],
                    now=self.ctx.clock(), cfg=self.ctx.reputation, membership=self.membership,
                    penalty=penalty,
                )  # fmt: skip
                kept = (
                    ([], [])
                    if proof is None
                    else self._list_proofs(session, proof[0], written, proof[2], fraudproofs.KIND_SENDER)
                )
        except Refused as exc:  # not registered (any more): nothing to hold it to
            self.ctx.log(f"replay check: {wallet} round {round_}: {detail}; not recorded ({exc})")
            return False
        if proof is not None:
            self._tidy_proofs(proof[0], written, *kept)
        self._penalised.add(where)
        with self._count_lock:
            self.failed += 1
        self.ctx.log(f"replay check: {wallet} round {round_} FAILED: {detail}")
        return True

    def _signed_get(
        self, address: str | BucketHolder, path: str, limit: int, *, timeout_s: float | None = None
    ) -> bytes:
        """GET `path` signed by the operator; ReplicaDeclined on 403/404, Malformed past `limit` bytes.
        From a BucketHolder: its answer in the bucket, NotAnswered while there is none."""
        if isinstance(address, BucketHolder):
            assert self._bucket is not None  # only queued with a bucket (_collect)
            try:
                return self._bucket.get(address.public_key, path, limit)
            except BodyTooLarge as exc:
                raise Malformed(str(exc)) from None
        try:
            body, _ = signed_get(
                self.ctx.operator,
                address,
                path,
                max_bytes=limit,
                timeout_s=self.config.timeout_s if timeout_s is None else timeout_s,
                now=self.ctx.clock(),
            )
        except urllib.error.HTTPError as exc:
            if exc.code in REFUSALS:
                raise ReplicaDeclined(f"HTTP {exc.code} {error_text(exc)}") from None
            raise
        except BodyTooLarge as exc:
            raise Malformed(str(exc)) from None
        return body

    def _get_replay(self, address: str | BucketHolder, round_: int) -> ReplayRecord:
        """The replica's replay material for `round_`; raises ReplicaDeclined or Malformed, or OSError or
        ValueError when there is no usable answer."""
        path = REPLAY.format(round=round_)
        _, n_tensors = stage_size(self.ctx.network.model, 0, 1)
        largest = largest_numel(self.ctx.network.model, 0, 1)
        body = self._signed_get(address, path, replay_size_bound(largest, n_tensors))
        try:
            numel = self._decoded_numel(body, THETA, 0, 1, "replay body")
            return decode_replay(body, round_, numel, n_tensors)
        except Refused as exc:
            raise Malformed(str(exc)) from None

    def _decoded_numel(self, body: bytes, theta: str, stage: int, num_stages: int, what: str) -> int:
        """The values θ in `body` holds, by its header: this stage's, at the definition's
        vocabulary or a grown one (verifier.stageshape); Refused otherwise. The body's other
        vectors are decoded at that length."""
        numel = declared_length(body, theta, what)
        try:
            stage_config(self.ctx.network.model, stage, num_stages, numel)
        except ValueError as exc:
            raise malformed(f"{what}: {exc}") from None
        return numel
