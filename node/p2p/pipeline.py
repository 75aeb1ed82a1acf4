"""The pipeline transport: micro-batches to the next stage, gradients back, over the signed peer plane.

- `NextStageRouter` (no I/O) picks the next-stage replica: SWARM's stochastic wiring
  (Ryabinin et al. 2023), probability proportional to measured throughput (an exponential
  moving average of tokens per second, end to end through the rest of the pipeline). A peer
  never measured enters at the back of the queue: it is tried after every measured peer
  when retrying, and drawn with the weight of the slowest measured one (so it gets measured
  without getting the bulk of the traffic). A failed peer is banned for `ban_s`; a busy one
  (503: in its outer round, queue full) is skipped for `busy_s`; a blamed one (its gradient
  overflowed this replica's backward, or an audit outvoted it) for `ban_s` doubled at each blame,
  the record wiped an hour after a ban without another (`BLAME_MEMORY_S`).
- `PipelineClient` sends one micro-batch (`pipeline_wire`) and retries it elsewhere until
  `deadline_s`; it returns the gradient and loss, or raises `PipelineUnavailable`. `blame`
  bans the replica whose answer to an id overflowed the step (node.pipeline.NonFiniteStep's
  `gradient_at_fault`), and the step sends the micro-batch again, elsewhere.
- `PipelineService` is the server side, a `server.ServerExtension`: POST /p2p/pipeline/forward,
  sharing the signed-request middleware; the body limit follows this stage's shapes.
  It checks everything before handing the micro-batch to the `StageWorker`; a bad request is
  a 4xx and never reaches the model.

Exactly once per replica. A micro-batch's id (`pipeline_wire.micro_batch_id`: driver wallet,
round, inner step) stays the same across retries. A replica remembers the last
`PipelineConfig.dedup_window` (sender, id) pairs it took, with their payload hash and their
outcome: the same id and payload again (a retry whose first reply was lost, or sent while the
first is still queued) gets the first outcome back — the same gradient and loss, not a second
inner step; the same id with another payload is refused with 409 `micro_batch_reused` and
changes nothing. A micro-batch that was not stepped (busy, failed) is forgotten, so a retry
trains on it.

What a retry on *another* replica means: the driver cannot know whether the replica that
timed out trained on the micro-batch before its reply was lost. If it did, that replica keeps
the step (its inner step and tokens count in its own round and receipt) and the retry's
replica trains on the same data once too: both are honest work on their own replica, and the
stage's outer round averages them like any two micro-batches. The driver steps once, with
the gradient of the reply it got, and counts the micro-batch's tokens once. What the pipeline
guarantees is that no replica steps twice on one micro-batch, not that exactly one replica of
the next stage does.

Audits. Nothing else holds a gradient answer to anything at the time it is used (the overflow
check aside), and the router sends most micro-batches to whoever answers fastest, so one replica
that answers at once with a made-up gradient would draw most of a sender's traffic and steer its
steps. A sender therefore checks a share of the answers (`PipelineConfig.audit_rate`, 1/16, and
`probation_audit_rate`, 1/4, for the next stage's listed probationers) before its step uses them:
the same micro-batch goes to another replica drawn uniformly among those usable now, and the
answers must agree within what honest drift allows (node.pipeline.answers_disagree: a loose
bound, which catches a negated, zeroed or wildly scaled gradient). Two that disagree get a third
opinion; a clear majority (two that agree against one) decides which answer is used, and bans the
outvoted one like a replica whose gradient overflowed (`NextStageRouter.blamed`, twice as long
each time) unless the two are of lower standing (probationers cannot vote an admitted replica
out). Without one nobody is banned and the first answer is used, as without the audit. A replica
cannot tell which of its answers are checked, so where two honest replicas, one of at least its
standing, are free to check it, each falsified answer is caught with probability about the
audit rate. An audit copy is real work for the replica asked (it trains on it, as on a retry),
so the stages after this one do up to that share more micro-batches (a third opinion and the
audits of later hops add to it). The copy is sent with the first, so an audited step waits for
the slower of the two answers (and after it for a third opinion, or a replacement for a copy that
failed, when one is asked); if the first fails and the copy is answered, that answer is used
unchecked, as a retry's would be.
What audits do not catch: an answer bent within the bound, a lie where fewer than two honest
replicas are free to check it (in a stage of two, a liar is never outvoted), colluders drawn as
each other's auditors, and a replica further down that answers two replicas of this stage
differently (it can make an honest one look outvoted until its own senders' audits catch it).
So every audit that finds two answers apart, whatever it decides, is also reported to the
verifier: the compared answers' signed replies go in the round's receipt (protocol.reports
`Dispute`, `PipelineClient.disputes_of`), and the verifier replays the segment each replier
stepped on the micro-batch in: a replier whose log records its lie fails there, in a stage of two
too, where no audit outvotes it (one that records no step on it is not judged).

Who works with whom. Where the neighbouring stages have member lists (node.membership, from the
verifier), a replica offers micro-batches only to the next stage's replicas on its list and steps
only on micro-batches from those of the stage before (403 `not_a_member` to anyone else), so
fresh wallets in a neighbouring stage cost it no step. Without lists, everyone, as before. A
sender refused as not a member is not banned for it: it raises `NotListed` at its deadline, and a
driver waits for a list that names it (`stages.PipelineLink.downstream`).

The end of a run. A sender whose run ends POSTs a signed `PipelineEnd` to every next-stage
replica it sent work to (`PipelineClient.end`); a replica's `Upstream` records who sends it work
and who ended, and says the pipeline is over for it once every sender heard from in the last
`upstream_ttl_s` has ended (node.stage_replica then ends the worker and passes the end on).
Only a replica's own recent senders can end it (409 `not_a_sender` for anyone else). A sender
ends only when its run is done (``--max-steps``): one stopped by a signal or by a failure sends
nothing, so the replicas it fed keep serving whoever else sends, or the next driver to come.

Route (every refusal is a JSON `ErrorReply`):

| route                        | in -> out                                                        | ok  | refusals        |
|------------------------------|------------------------------------------------------------------|-----|-----------------|
| POST /p2p/pipeline/forward   | `X-NeuroShard-Activation` + safetensors hidden, labels           | 200 | 400 403 409 422 |
|                              | -> `X-NeuroShard-Gradient` + safetensors ∂loss/∂hidden           |     | 429 5xx         |
| POST /p2p/pipeline/end       | `PipelineEnd` (JSON: the sender sends no more micro-batches)     | 204 | 400 409 422     |

A next-stage replica behind NAT (a relay address, ``relay.py``) is reached through the stage
bucket instead: the same signed request, put in the bucket and answered there by that replica's
own server (``mailbox.py``); a client given no bucket leaves such replicas out.

Bodies are packed in the run's codec (`PipelineConfig.codec`, `pipeline_wire`); a micro-batch
in another codec is refused with 422 `wrong_codec`. 422 also answers a micro-batch on which the
layers overflow (non-finite loss or gradient: not stepped) or whose output is degenerate, and
one whose activations are degenerate themselves (`degenerate_activations`: a position whose mean
square is under a quarter of the norm's eps, `node.pipeline.DEGENERATE_MEAN_SQUARE`, which no
honest stage sends); its sender is then struck and its
micro-batches refused with 429 `struck` for `ban_s`, doubled at each strike. 409 = this replica already took the micro-batch's id from this sender with another
payload (the sender moves on to another replica). 503 = busy (the replica is in its outer round or its queue is full; retry another);
502 = this replica could not reach the stage after it (retry another); 500 = the step failed
for another reason (a bug: the sender bans this replica for a while).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from aiohttp import web
from torch import Tensor

from neuroshard.node.actcodec import DEFAULT_CODEC
from neuroshard.protocol.identity import sha256_hex
from neuroshard.protocol.peer import ErrorReply
from neuroshard.protocol.pipeline import (
    ACTIVATION_DTYPES,
    ACTIVATION_HEADER,
    CODEC_NAMES,
    END,
    FORWARD,
    REPLY_HEADER,
    ActivationHeader,
    GradientReply,
    PipelineEnd,
)
from neuroshard.protocol.refusal import Refused, malformed
from neuroshard.protocol.reports import MAX_DISPUTES, Dispute
from neuroshard.protocol.schema import MAX_STAGE
from neuroshard.protocol.segments import Received

from ..membership import Neighbours
from ..model import ModelConfig
from ..pipeline import NonFiniteStep, answers_disagree, degenerate_problem
from ..segments import SegmentRecorder
from ..vocab import vocab_cap
from ..wallet import Wallet
from . import mailbox
from .auth import BODY, PEER_WALLET, Clock, PeerClient, PeerReply, PeerUnreachable, Traffic, head_bytes
from .bucket import BucketStore
from .mailbox import MailboxRoutes
from .peers import PeerEntry, PeerTable
from .pipeline_wire import (
    activation_size_bound,
    decode_activations,
    decode_gradient,
    encode_activations,
    encode_gradient,
    gradient_size_bound,
)
from .relay import is_relay
from .upstream import Upstream

_T = TypeVar("_T")
_U = TypeVar("_U")

MAX_END_BYTES = 2048
"""A `PipelineEnd` is ~400 bytes of JSON."""

JobResult = tuple[Tensor | bytes, float, int] | BaseException
"""(∂loss/∂hidden (B, T, C) — as the job's `encode` made it bytes, when it has one —, loss, the
round the step belonged to) or why it failed."""


class Busy(Exception):
    """The replica cannot take this micro-batch now (in its outer round, queue full, stopping)."""


@dataclass
class Job:
    hidden: Tensor
    """(B, T, C) float32, the previous stage's output."""
    labels: Tensor
    """(B, T) int64."""
    micro_batch: str
    """The driver's micro-batch id (`p2p.pipeline_wire.micro_batch_id`), forwarded to the next stage."""
    done: Callable[[JobResult], None]
    """Called exactly once, from the worker thread (or from `offer`'s caller when refused later)."""
    received: Received | None = None
    """The micro-batch as it arrived (its sender's signed header and the payload bytes), for the
    segment log (node.segments); None when the transport does not hand it over."""
    encode: Callable[[Tensor], bytes] | None = None
    """How the transport puts the gradient it sends back on the wire (its codec). Given, the worker
    encodes the gradient off its training thread and records the bytes as sent by the step before
    the round closes (node.stage_worker), so every step's record names the gradient it returned;
    the result then carries the bytes."""


class JobSink(Protocol):
    """What the pipeline route hands micro-batches to: a stage > 0 replica's job queue
    (node.stage_worker.JobQueue, which its worker takes from; the worker records each step)."""

    def offer(self, job: Job) -> None:
        """Take `job` or raise `Busy`; `job.done` is called exactly once."""
        ...

    def drop(self, sender: str, reason: str) -> int:
        """Answer `Busy(reason)` to the jobs of `sender` still waiting; returns how many."""
        ...


ANSWERS_KEPT = 64
"""Micro-batch ids whose answering replica a `PipelineClient` remembers, for `blame`: a step blames
the answer it just got, so a few are enough (a driver has one step in flight, a worker one job)."""


MAX_STRUCK = 4096
"""Senders a `PipelineService` remembers striking (a stage's replicas, and then some)."""


OUTSIDER_RETRY_S = 10.0
"""How long a next-stage replica that refused this one as not on its member list is skipped: about
the time it takes to read a newer list (`verifier_client.VerifierClientConfig.neighbours_every_s`)."""


AUDIT_ASKS = 3
"""Other next-stage replicas an audit asks at most (one that is busy or fails is passed over): a
second opinion, and a third when the first two disagree."""


DISPUTE_ROUNDS = 8
"""Rounds before the newest one whose disputes a `PipelineClient` keeps for their receipts. A
round's disputes leave when its receipt is built (`disputes_of`); a round whose receipt never is
(resumed mid-round, no verifier, refused) would otherwise keep its own for ever."""


@dataclass(frozen=True)
class _Offer:
    """One micro-batch as this replica sends it, to whichever next-stage replica takes it."""

    round: int
    micro_batch: str
    shape: tuple[int, int, int]
    body: bytes
    payload_sha256: str
    reply_bound: int


@dataclass(frozen=True)
class _Answer:
    """A next-stage replica's signed answer to an `_Offer`, checked and decoded."""

    wallet: str
    grad: Tensor
    loss: float
    reply: GradientReply
    body: bytes

    @property
    def result(self) -> tuple[Tensor, float]:
        return self.grad, self.loss


async def _both(first: Awaitable[_T], second: Awaitable[_U]) -> tuple[_T, _U]:
    """Both at once; if one raises, the other is cancelled (a bare gather would leave it running)."""
    tasks = (asyncio.ensure_future(first), asyncio.ensure_future(second))
    try:
        a, b = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    return a, b


class PipelineUnavailable(ConnectionError):
    """No replica of the next stage took the micro-batch before the deadline (or the node is stopping)."""


class NotListed(PipelineUnavailable):
    """No replica of the next stage took the micro-batch before the deadline, and some refused it
    because this replica is not on their member list of its stage (403 ``not_a_member``): it is
    new, or its stage's list is full; it may be named in a later list."""


@dataclass(kw_only=True)
class PipelineConfig:
    """The pipeline of one node. Times in seconds."""

    num_stages: int
    """S: stages the model is cut into (the network's stage layout)."""
    codec: str = ""
    """Activations and gradients on the wire (`actcodec.CODECS`), the run's choice (network
    definition ``[stages] codec``): "fitted43" (the default, `actcodec.DEFAULT_CODEC`, taken when
    this is left empty: 4 bits forward in fitted codes, 3 back in dithered ones), "int8" (8.25
    bits per value), "hadamard4" (4 bits forward, 6 back), "hadamard43" (4 forward, 3 back), or the
    uncompressed casts "bf16" (fp32's range, so small gradients do not flush to zero) and "fp16"
    (3 more mantissa bits). A replica refuses micro-batches in another."""
    dtype: str | None = None
    """Before codecs: "bf16" or "fp16". Given, it names the codec of that name (kept so the
    `--activation-dtype` flag keeps working); it may not contradict a `codec` given too."""
    max_batch: int = 64
    """Largest micro-batch (sequences) a replica accepts; sizes the body limit."""
    request_timeout_s: float = 60.0
    """One micro-batch's round trip through the rest of the pipeline."""
    deadline_s: float = 300.0
    """How long a micro-batch may wait for any next-stage replica (they may all be in a round)."""
    ban_s: float = 30.0
    """How long a replica that failed a micro-batch is skipped."""
    busy_s: float = 0.2
    """How long a replica that answered 503 (busy) is skipped."""
    retry_pause_s: float = 0.05
    """Pause when every next-stage replica is banned, busy or unknown."""
    max_pending: int = 4
    """Micro-batches a stage > 0 replica lets wait behind the one it computes."""
    probation_pending: int = 2
    """Micro-batches from the previous stage's listed probationers a stage > 0 replica holds at
    once, waiting or in its step; more are answered busy (their senders try another replica or
    later). Listed keys cost a registration, not verified rounds: without this, a flood of them
    could fill the queue its admitted senders' micro-batches wait in."""
    probation_per_sender: int = 1
    """Of those, how many one probationer may hold: one busy probationer cannot take every place
    from the others (each gets its turn as its micro-batches are answered)."""
    network: str | None = None
    """The run's definition digest (NetworkDefinition.digest), which every header names; a replica
    refuses micro-batches of another run. None: no run joined (headers name none)."""
    throughput_ema: float = 0.3
    """Weight of the newest measurement in the throughput average."""
    dedup_window: int = 32
    """(sender, micro-batch id) pairs, with their outcomes, a replica remembers. A retry of a lost
    reply comes right after the sender's `request_timeout_s`, when at most `max_pending` + 1 other
    micro-batches per sender have been taken here since; each outcome held costs its gradient,
    B·T·C·4 bytes (512 KiB for the tiny model at 8 × 128: 16 MiB for the window)."""
    audit_rate: float = 1 / 16
    """The share of answers from admitted next-stage replicas (from every one, where the next stage
    has no member list) that this replica checks against another replica's answer to the same
    micro-batch before its step uses one (`PipelineClient`, "Audits"). Each check costs the rest of
    the pipeline one or two more micro-batches of work."""
    probation_audit_rate: float = 0.25
    """The share of answers from the next stage's listed probationers checked so: they cost a
    registration, not verified rounds."""
    upstream_ttl_s: float = 600.0
    """A stage > 0 replica ends when every replica of the stage before it that sent it a micro-batch
    in the last `upstream_ttl_s` has sent a signed `PipelineEnd` (a sender quiet for longer, gone
    without a word, no longer counts)."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_stages <= MAX_STAGE + 1:
            raise ValueError(
                f"PipelineConfig.num_stages must lie in [1, {MAX_STAGE + 1}], got {self.num_stages}"
            )
        if self.dtype is not None:
            if self.dtype not in ACTIVATION_DTYPES:
                raise ValueError(
                    f"PipelineConfig.dtype must be one of {ACTIVATION_DTYPES}, got {self.dtype!r}"
                )
            if self.codec not in ("", self.dtype):
                raise ValueError(f"PipelineConfig: dtype {self.dtype!r} contradicts codec {self.codec!r}")
            self.codec = self.dtype
        elif not self.codec:
            self.codec = DEFAULT_CODEC
        if self.codec not in CODEC_NAMES:
            raise ValueError(f"PipelineConfig.codec must be one of {CODEC_NAMES}, got {self.codec!r}")
        for name in ("max_batch", "request_timeout_s", "deadline_s", "retry_pause_s", "dedup_window",
                     "upstream_ttl_s"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"PipelineConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.ban_s < 0 or self.busy_s < 0 or self.max_pending < 0:
            raise ValueError("PipelineConfig: ban_s, busy_s and max_pending must be >= 0")
        if self.probation_pending < 1:  # 0 would keep every probationer of a pipeline from its rounds
            raise ValueError(f"PipelineConfig.probation_pending must be >= 1, got {self.probation_pending}")
        if not 1 <= self.probation_per_sender <= self.probation_pending:
            raise ValueError(
                f"PipelineConfig.probation_per_sender must be in [1, probation_pending = "
                f"{self.probation_pending}], got {self.probation_per_sender}"
            )
        if not 0 < self.throughput_ema <= 1:
            raise ValueError(f"PipelineConfig.throughput_ema must lie in (0, 1], got {self.throughput_ema}")
        for name in ("audit_rate", "probation_audit_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"PipelineConfig.{name} must lie in [0, 1], got {getattr(self, name)}")


@dataclass
class _Link:
    arrival: int
    throughput: float | None = None
    """Tokens per second through this peer (EMA); None until measured."""
    skip_until: float = 0.0
    failures: int = 0
    successes: int = 0
    blamed: int = 0
    """Answers from this peer blamed (a gradient that overflowed this replica's backward, or one an
    audit outvoted) since its record was last wiped (`BLAME_MEMORY_S`)."""
    blamed_until: float = 0.0
    """When the ban of its latest blame was to end (an answer since may have lifted it)."""


BLAME_BAN_DOUBLINGS = 7
"""A blamed replica's ban doubles with each blame up to 2**7 × ban_s (64 min at the default 30 s)."""
BLAME_MEMORY_S = 3600.0
"""A replica blamed more than this long after its last ban ended starts again from `ban_s`: an
honest one outvoted now and then by honest drift (node.pipeline.AUDIT_MIN_COSINE) does not pile up
bans over a long run, while one caught again within this of its last ban's end keeps doubling."""


@dataclass
class NextStageRouter:
    """Which next-stage replica gets the next micro-batch. Not thread-safe: one event loop owns it."""

    ban_s: float
    busy_s: float
    ema: float = 0.3
    rng: random.Random = field(default_factory=random.Random)
    _links: dict[str, _Link] = field(default_factory=dict)

    def _link(self, wallet: str) -> _Link:
        link = self._links.get(wallet)
        if link is None:
            link = self._links[wallet] = _Link(arrival=len(self._links))
        return link

    def throughput(self, wallet: str) -> float | None:
        link = self._links.get(wallet)
        return None if link is None else link.throughput

    def ranking(self, candidates: Iterable[str], now: float) -> list[str]:
        """Usable candidates, fastest measured first, then never-measured ones in order of arrival."""
        links = {w: self._link(w) for w in candidates}
        usable = [w for w, link in links.items() if link.skip_until <= now]
        measured = sorted((w for w in usable if links[w].throughput is not None),
                          key=lambda w: (-(links[w].throughput or 0.0), w))  # fmt: skip
        fresh = sorted((w for w in usable if links[w].throughput is None), key=lambda w: links[w].arrival)
        return measured + fresh

    def choose(self, candidates: Iterable[str], now: float) -> str | None:
        """A usable candidate drawn with probability ∝ throughput (unmeasured: the slowest measured
        one's, or 1 when none is measured); None when none is usable."""
        ranked = self.ranking(candidates, now)
        if not ranked:
            return None
        measured = [t for w in ranked if (t := self._links[w].throughput) is not None]
        floor = min(measured) if measured else 1.0
        weights = [self._links[w].throughput or floor for w in ranked]
        return self.rng.choices(ranked, weights=weights, k=1)[0]

    def succeeded(self, wallet: str, tokens: int, seconds: float | None) -> None:
        """The peer answered; `tokens` in `seconds` go into its throughput average (None: an
        answer that measures nothing, as one whose upload shared the link with an audit copy)."""
        link = self._link(wallet)
        if seconds is not None:
            rate = tokens / max(seconds, 1e-6)
            link.throughput = (
                rate if link.throughput is None else (1 - self.ema) * link.throughput + self.ema * rate
            )
        link.failures = 0
        link.successes += 1
        link.skip_until = 0.0

    def failed(self, wallet: str, now: float) -> None:
        """Ban for `ban_s`; the measured throughput is forgotten (the peer re-enters at the back)."""
        link = self._link(wallet)
        link.failures += 1
        link.throughput = None
        link.arrival = max((lk.arrival for lk in self._links.values()), default=0) + 1
        link.skip_until = now + self.ban_s

    def busy(self, wallet: str, now: float) -> None:
        self._link(wallet).skip_until = now + self.busy_s

    def outsider(self, wallet: str, now: float) -> None:
        """The peer refused this replica as not on its member list: asked again after
        `OUTSIDER_RETRY_S`, by when it may have read a list that names this replica. Not a failure:
        its measured throughput stays."""
        self._link(wallet).skip_until = now + OUTSIDER_RETRY_S

    def blamed(self, wallet: str, now: float) -> float:
        """The peer answered with a gradient that overflowed this replica's backward from a sound
        forward (a faulty or hostile replica, node.pipeline.NonFiniteStep): banned like a
        failure, for `ban_s` doubled at each such answer (at most BLAME_BAN_DOUBLINGS times), so
        a replica that keeps lying is asked ever more rarely; one blamed again only
        BLAME_MEMORY_S after its last ban ended starts again from `ban_s`. An audit's outvoted
        answer is blamed the same way. Returns the ban in seconds."""
        link = self._link(wallet)
        self.failed(wallet, now)
        if link.blamed and now > link.blamed_until + BLAME_MEMORY_S:
            link.blamed = 0
        link.blamed += 1
        ban = self.ban_s * 2.0 ** min(link.blamed - 1, BLAME_BAN_DOUBLINGS)
        link.skip_until = link.blamed_until = now + ban
        return ban


def _refusal_code(reply: PeerReply) -> str | None:
    """The code of a peer's ErrorReply, or None when the body is not one."""
    try:
        return ErrorReply.from_json(reply.body).error
    except Refused:
        return None


class PipelineClient:
    """Sends micro-batches to the next stage. Its coroutines run on the peer network's event loop."""

    def __init__(
        self,
        *,
        wallet: Wallet,
        stage: int,
        peers: PeerTable,
        config: PipelineConfig,
        clock: Clock,
        log: Callable[[str], None],
        stop: threading.Event,
        router: NextStageRouter | None = None,
        segments: SegmentRecorder | None = None,
        bucket: BucketStore | None = None,
        receivers: Neighbours | None = None,
        audit_rng: random.Random | None = None,
    ) -> None:
        """`bucket`: the stage bucket (``--relay``), through which next-stage replicas behind NAT are
        reached (mailbox.py); without it they are left out. `receivers`: the next stage's
        membership (node.membership.Neighbours); replicas it does not take are never offered a
        micro-batch (None: every live one is)."""
        if not 0 <= stage < config.num_stages - 1:
            raise ValueError(f"stage {stage} has no next stage among {config.num_stages}")
        self.wallet = wallet
        self.stage = stage
        self.peers = peers
        self.config = config
        self.clock = clock
        self.log = log
        self.stop = stop
        self.segments = segments
        """Where the sent activations and the gradient replies are recorded (node.segments), if anywhere."""
        self.bucket = bucket
        self.receivers = receivers
        self._cleanup = mailbox.Cleanup()
        self.router = router or NextStageRouter(
            ban_s=config.ban_s, busy_s=config.busy_s, ema=config.throughput_ema
        )
        self.client = PeerClient(
            wallet, clock=clock, connect_timeout_s=min(5.0, config.request_timeout_s),
            request_timeout_s=config.request_timeout_s,
        )  # fmt: skip
        self.audit_rng = audit_rng or random.SystemRandom()
        """Which answers are audited, and by whom (the OS's randomness: a replica must not be able to
        tell which of its answers will be checked)."""
        self.retries = 0
        self.audits = 0
        """Answers audited (`_audit`), and of those: ..."""
        self.audit_blamed = 0
        """... answers outvoted, their senders banned;"""
        self.audits_unsettled = 0
        """... disputes no majority settled (nobody banned);"""
        self.audits_unchecked = 0
        """... audits that got no second answer (nobody else usable, or every one asked busy,
        failing, holding the id with another payload, or past the deadline)."""
        self.blamed = 0
        """Gradients refused as overflowing this replica's backward (`blame`)."""
        self.disputes_reported = 0
        """Disputes handed to a receipt for the verifier (`disputes_of`), and ..."""
        self.disputes_dropped = 0
        """... found but not kept: past MAX_DISPUTES in their round, a micro-batch already disputed
        in it, or their round's receipt never built within DISPUTE_ROUNDS."""
        self._disputes: dict[int, list[Dispute]] = {}
        """round -> the disputes of micro-batches sent for it, the first MAX_DISPUTES, until its
        receipt takes them."""
        self._disputes_lock = threading.Lock()
        """Audits add disputes on the event loop's thread; the receipt takes them on the training thread."""
        self._not_member: set[str] = set()
        """Next-stage replicas whose last answer refused this one as not on their member list."""
        self._answered: OrderedDict[str, str] = OrderedDict()
        """micro-batch id -> the replica whose gradient came back for it last (the newest
        ANSWERS_KEPT): whom `blame` bans."""
        self.sent_to: set[str] = set()
        """Replicas of the next stage this one offered a micro-batch to: where `end` goes (one that
        never took one refuses the end, harmlessly)."""

    @property
    def traffic(self) -> Traffic:
        """Pipeline bytes only (the round exchange has its own client and counters)."""
        return self.client.traffic

    async def start(self) -> None:
        await self.client.start()

    async def close(self) -> None:
        await self._cleanup.wait()
        await self.client.close()

    async def forward(
        self, hidden: Tensor, labels: Tensor, *, round_: int, micro_batch: str, patient: bool = True
    ) -> tuple[Tensor, float]:
        """Send hidden (B, T, C) and labels (B, T) to a next-stage replica, retrying elsewhere;
        returns (∂loss/∂hidden (B, T, C) float32, loss). `micro_batch` is the driver's
        `micro_batch_id`, the same on every attempt and every hop. No attempt starts after
        `deadline_s`; then `PipelineUnavailable`, or `NotListed` when replicas skipped refused this
        one as not on their member list. Not `patient` (a middle replica, whose sender can go
        elsewhere): `NotListed` as soon as every replica it may ask refused it so, and
        `PipelineUnavailable` as soon as every one holds its id with another payload (409). A share
        of the answers is audited first (`_audit`)."""
        batch, seq_len, dim = hidden.shape
        codec = self.config.codec
        body = await asyncio.get_running_loop().run_in_executor(
            None, encode_activations, hidden, labels, codec
        )
        offer = _Offer(
            round=round_, micro_batch=micro_batch, shape=(batch, seq_len, dim), body=body,
            payload_sha256=sha256_hex(body), reply_bound=gradient_size_bound(batch, seq_len, dim, codec),
        )  # fmt: skip
        deadline = time.monotonic() + self.config.deadline_s
        refused: set[str] = set()
        """Replicas that already took this id with another payload: never asked again for it."""
        while True:
            if self.stop.is_set():
                raise PipelineUnavailable(f"micro-batch {micro_batch[:8]}: the node is stopping")
            now = self.clock()
            reachable = [
                e
                for e in self.peers.live(now, self.stage + 1)
                if e.wallet not in refused and (self.bucket is not None or not is_relay(e.address))
            ]
            live = {
                e.wallet: e for e in reachable if self.receivers is None or self.receivers.takes(e.wallet)
            }
            pick = self.router.choose(live, now)
            if not patient and refused and not live:  # everyone it may ask holds the id with another payload
                raise PipelineUnavailable(
                    f"micro-batch {micro_batch[:8]}: {len(refused)} replica(s) of stage {self.stage + 1} already "
                    "took its id with another payload, and no other is left to ask"
                )
            late = time.monotonic() > deadline
            outsiders = self._not_member & live.keys()
            if outsiders and (late or (not patient and pick is None and outsiders == live.keys())):
                raise NotListed(
                    f"micro-batch {micro_batch[:8]}: {len(outsiders)} replica(s) of stage {self.stage + 1} "
                    f"do not take micro-batches from this one (it is not on their member list of stage "
                    f"{self.stage}) and no other took it"
                )
            if pick is None or late:
                if late:
                    raise PipelineUnavailable(
                        f"micro-batch {micro_batch[:8]}: no replica of stage {self.stage + 1} took it "
                        f"within {self.config.deadline_s:.0f} s ({len(live)} known, {len(refused)} "
                        f"had its id with another payload, {len(reachable) - len(live)} not taken "
                        "by the stage's member list)"
                    )
                await asyncio.sleep(self.config.retry_pause_s)
                continue
            auditor = None
            if self.audit_rng.random() < self._audit_rate(pick):
                others = [w for w in self.router.ranking(live, now) if w != pick]
                auditor = self.audit_rng.choice(others) if others else ""
            if not auditor:
                outcome, seconds = await self._timed_ask(live[pick], offer)
                asked_with = None
            else:  # asked at the same time: an audited step waits for the slower, not for both
                (outcome, seconds), (audited, audit_seconds) = await _both(
                    self._timed_ask(live[pick], offer), self._timed_ask(live[auditor], offer)
                )
                asked_with = (auditor, audited)
                if not isinstance(outcome, _Answer) and isinstance(audited, _Answer):
                    # The first failed and the second answered: its answer, unchecked, as a retry's.
                    self._missed(pick, outcome, refused, micro_batch)
                    pick, outcome, seconds, auditor, asked_with = auditor, audited, audit_seconds, None, None
            if isinstance(outcome, _Answer):
                # An audited attempt shared this replica's uplink with the copy: not a measurement.
                self.router.succeeded(pick, batch * seq_len, seconds if not auditor else None)
                if auditor is not None:
                    outcome = await self._audit(offer, outcome, live, deadline, asked_with, refused)
                return self._consume(offer, outcome)
            if auditor and not isinstance(audited, _Answer):
                self._missed(auditor, audited, refused, micro_batch, retry=False)
            self._missed(pick, outcome, refused, micro_batch)

    def _missed(
        self, wallet: str, outcome: str, refused: set[str], micro_batch: str, *, retry: bool = True
    ) -> None:
        """An attempt `wallet` did not answer: the micro-batch's bytes refused as degenerate (raises:
        every replica would refuse them), its id held with another payload (never asked again for
        it), or the router's account (`_set_back`). `retry`: the attempt was the one to answer it."""
        self.retries += retry
        if outcome == "degenerate":
            raise NonFiniteStep(
                f"a stage {self.stage + 1} replica refused micro-batch {micro_batch[:8]}'s activations "
                "as degenerate (node.pipeline.DEGENERATE_MEAN_SQUARE); not sent elsewhere"
            )
        if outcome == "reused":
            refused.add(wallet)
            self.log(f"pipeline: stage {self.stage + 1} replica {wallet[:12]} already took micro-batch "
                     f"{micro_batch[:8]} with another payload; sending it elsewhere")  # fmt: skip
        else:
            self._set_back(wallet, outcome, micro_batch)

    def _set_back(self, wallet: str, outcome: str, micro_batch: str) -> None:
        """The router's account of an attempt that `wallet` did not answer: busy, not taking this
        replica (not a member), or failed (banned `ban_s`)."""
        if outcome == "outsider":
            if wallet not in self._not_member:
                self.log(f"pipeline: stage {self.stage + 1} replica {wallet[:12]} takes no micro-batch from this one "
                         f"(it is not on its member list of stage {self.stage}); asking again every "
                         f"{OUTSIDER_RETRY_S:.0f} s")  # fmt: skip
            self._not_member.add(wallet)
            self.router.outsider(wallet, self.clock())
            return
        if outcome == "busy":
            self.router.busy(wallet, self.clock())
        elif outcome not in ("reused", "degenerate"):
            self.router.failed(wallet, self.clock())
            self.log(f"pipeline: stage {self.stage + 1} replica {wallet[:12]} failed ({outcome}); "
                     f"banned {self.config.ban_s:.0f} s, retrying micro-batch {micro_batch[:8]} elsewhere")  # fmt: skip

    def _audit_rate(self, wallet: str) -> float:
        return self.config.probation_audit_rate if self._standing(wallet) == 1 else self.config.audit_rate

    def _standing(self, wallet: str) -> int:
        """2 admitted, 1 a listed probationer, 0 anyone where the next stage has no member list."""
        roster = None if self.receivers is None else self.receivers.roster
        if roster is None:
            return 0
        return 2 if wallet in roster.admitted else 1 if wallet in roster.probation else 0

    async def _disagree(self, first: _Answer, second: _Answer) -> str | None:
        return await asyncio.get_running_loop().run_in_executor(
            None, answers_disagree, first.grad, second.grad
        )

    async def _audit(
        self,
        offer: _Offer,
        first: _Answer,
        live: dict[str, PeerEntry],
        deadline: float,
        asked_with: tuple[str, _Answer | str] | None,
        refused: set[str],
    ) -> _Answer:
        """Audits: the same micro-batch (the same bytes under the same id, in a header signed for
        each) goes to another next-stage replica drawn uniformly among those usable now — not by
        throughput, which a replica that answers at once without computing would win — and the two
        answers must agree within what honest drift and the codec allow
        (node.pipeline.answers_disagree). The first such replica is asked with the first
        (`asked_with`: its wallet and outcome, already in). Two that disagree get a third opinion;
        `_settle` decides. A replica busy, failing or holding the id with another payload (added to
        `refused`) is passed over; at most AUDIT_ASKS are asked, none after the deadline or a stop.
        With no second answer the first is used unchecked. Returns the answer to use. Answers apart
        are also kept for the verifier (`_dispute`), whatever `_settle` makes of them."""
        self.audits += 1
        others = [
            w for w in self.router.ranking(live, self.clock()) if w != first.wallet and w not in refused
        ]
        self.audit_rng.shuffle(others)
        pending: list[tuple[str, _Answer | str | None]] = [(w, None) for w in others]
        if asked_with is not None:
            pending = [asked_with, *((w, None) for w in others if w != asked_with[0])]
        answers = [first]
        asked = 0
        for wallet, given in pending:
            if len(answers) == 3:
                break
            if given is None:  # a new ask: only within the bounds (one already in costs no wait)
                if asked == AUDIT_ASKS or time.monotonic() > deadline or self.stop.is_set():
                    break
                outcome = await self._ask(live[wallet], offer)
            else:
                outcome = given
            asked += 1
            if not isinstance(outcome, _Answer):
                if outcome == "reused":
                    refused.add(wallet)
                else:
                    self._set_back(wallet, outcome, offer.micro_batch)
                continue
            answers.append(outcome)
            if len(answers) == 2:
                why = await self._disagree(first, outcome)
                if why is None:
                    return first
        if len(answers) == 1:
            self.audits_unchecked += 1
            return first
        self._dispute(offer, answers)
        return await self._settle(offer, answers, why or "they disagree")

    async def _settle(self, offer: _Offer, answers: list[_Answer], why: str) -> _Answer:
        """Two or three answers, the first two disagreeing (`why`). A clear majority, two that agree
        with each other against one that disagrees with both, decides which answer is used: one of
        the two. It bans the odd one, twice as long each time (`NextStageRouter.blamed`), only when
        one of the two has at least the odd one's standing (probationers cannot vote an admitted
        replica out). Anything else (no third opinion, all three apart, a third that agrees with
        both) bans nobody, since honest replicas far apart in a round can disagree, and the first
        answer is used, as it would have been without the audit."""
        first, second = answers[0], answers[1]
        if len(answers) == 3:
            third = answers[2]
            with_first, with_second = await self._disagree(first, third), await self._disagree(second, third)
            odd = first if with_second is None and with_first is not None else None
            odd = second if with_first is None and with_second is not None else odd
            if odd is not None:
                pair = [a for a in answers if a is not odd]
                if max(self._standing(a.wallet) for a in pair) >= self._standing(odd.wallet):
                    self._audit_blame(odd, offer, why)
                    return pair[0]
                self.audits_unsettled += 1
                self.log(f"pipeline: stage {self.stage + 1} replica {odd.wallet[:12]}'s answer to micro-batch "
                         f"{offer.micro_batch[:8]} disagrees with two others' that agree ({why}), whose standing "
                         "is lower; not used, nobody banned")  # fmt: skip
                return pair[0]
        self.audits_unsettled += 1
        names = ", ".join(a.wallet[:12] for a in answers)
        self.log(f"pipeline: stage {self.stage + 1} replicas {names} answered micro-batch {offer.micro_batch[:8]} "
                 f"differently ({why}) and no majority settles it; nobody banned, "
                 f"{first.wallet[:12]}'s answer used")  # fmt: skip
        return first

    def _dispute(self, offer: _Offer, answers: list[_Answer]) -> None:
        """Keep the signed replies of answers apart for the receipt of the round the micro-batch was
        sent for: an audit outvotes nobody in a stage of two, or where standing forbids it, and can
        be fooled by colluders, whereas the verifier can replay the segment each replier stepped on
        the micro-batch in. The first MAX_DISPUTES of a round, each micro-batch once."""
        try:
            dispute = Dispute.checked(micro_batch=offer.micro_batch, replies=tuple(a.reply for a in answers))
        except Refused as exc:  # answers that passed `_try` make a valid one; never lose the step over it
            self.log(f"pipeline: the dispute over micro-batch {offer.micro_batch[:8]} is not reported: {exc}")
            return
        with self._disputes_lock:
            kept = self._disputes.setdefault(offer.round, [])
            if len(kept) == MAX_DISPUTES or any(d.micro_batch == offer.micro_batch for d in kept):
                self.disputes_dropped += 1
                return
            kept.append(dispute)
            newest = max(self._disputes)
            for stale in [r for r in self._disputes if r < newest - DISPUTE_ROUNDS]:
                self.disputes_dropped += len(self._disputes.pop(stale))

    def disputes_of(self, round_: int) -> tuple[Dispute, ...] | None:
        """Hands over the disputes of micro-batches sent for `round_` (None: there were none), for
        that round's receipt; called once the round's steps are done."""
        with self._disputes_lock:
            kept = self._disputes.pop(round_, None)
            if not kept:
                return None
            self.disputes_reported += len(kept)
            return tuple(kept)

    def _audit_blame(self, liar: _Answer, offer: _Offer, why: str) -> None:
        ban = self.router.blamed(liar.wallet, self.clock())
        self.audit_blamed += 1
        self.log(f"pipeline: stage {self.stage + 1} replica {liar.wallet[:12]}'s answer to micro-batch "
                 f"{offer.micro_batch[:8]} disagrees with two others' that agree ({why}); not used, "
                 f"banned {ban:.0f} s")  # fmt: skip

    def _consume(self, offer: _Offer, answer: _Answer) -> tuple[Tensor, float]:
        """The answer the step in progress uses: recorded (the activations it was for, and the
        reply) and remembered for `blame`."""
        if self.segments is not None:
            self.segments.note_sent(offer.micro_batch, "activations", offer.payload_sha256, offer.body)
            self.segments.note_received(
                Received("gradient", answer.wallet, answer.reply.to_json(), answer.body), offer.micro_batch
            )
        self._answered[offer.micro_batch] = answer.wallet
        self._answered.move_to_end(offer.micro_batch)
        while len(self._answered) > ANSWERS_KEPT:
            self._answered.popitem(last=False)
        return answer.result

    async def _timed_ask(self, peer: PeerEntry, offer: _Offer) -> tuple[_Answer | str, float]:
        """`_ask`, and how long it took in seconds."""
        started = time.monotonic()
        outcome = await self._ask(peer, offer)
        return outcome, time.monotonic() - started

    async def _ask(self, peer: PeerEntry, offer: _Offer) -> _Answer | str:
        """One attempt at `peer`, under a header signed for it and recorded before it leaves."""
        self.sent_to.add(peer.wallet)  # tried is enough: it may have taken the micro-batch and lost the reply
        batch, seq_len, dim = offer.shape
        header = ActivationHeader.create(  # signed for this replica: a header names its recipient
            self.wallet, to=peer.wallet, micro_batch=offer.micro_batch, stage=self.stage + 1, round=offer.round,
            batch=batch, seq_len=seq_len, dim=dim, codec=self.config.codec, payload_sha256=offer.payload_sha256,
            network=self.config.network,
        )  # fmt: skip
        if self.segments is not None:  # every header it signs, taken or not, on disk before it leaves
            await asyncio.get_running_loop().run_in_executor(
                None,
                self.segments.note_header,
                offer.round,
                "activations",
                offer.micro_batch,
                peer.wallet,
                offer.payload_sha256,
                offer.body,
            )
        outcome = await self._try(peer, offer.body, header, offer.reply_bound)
        if outcome != "outsider":
            self._not_member.discard(peer.wallet)
        return outcome

    async def blame(self, micro_batch: str, why: str) -> str | None:
        """The gradient that came back for `micro_batch` overflowed this replica's backward
        (node.pipeline.NonFiniteStep.gradient_at_fault): its sender is banned (`router.blamed`),
        the step in progress does not list it as received, and a retry of the micro-batch goes to
        another replica. Returns the blamed wallet (None: no answer known for that id)."""
        wallet = self._answered.pop(micro_batch, None)
        if wallet is None:
            return None
        ban = self.router.blamed(wallet, self.clock())
        self.blamed += 1
        if self.segments is not None:
            self.segments.note_discarded(micro_batch, wallet)
        self.log(f"pipeline: stage {self.stage + 1} replica {wallet[:12]} answered micro-batch {micro_batch[:8]} "
                 f"with a gradient that overflows this stage's backward ({why}); banned {ban:.0f} s, "
                 "sending it elsewhere")  # fmt: skip
        return wallet

    async def end(self, round_: int, step: int) -> tuple[int, int]:
        """Tell every next-stage replica this one sent work to that it sends no more (a signed
        `PipelineEnd`); returns (told, tried). One small POST per replica it used, once per run."""
        end = PipelineEnd.create(self.wallet, stage=self.stage, round=round_, step=step)
        body = end.to_json()
        wallets = sorted(self.sent_to)

        async def tell(wallet: str) -> bool:
            peer = self.peers.get(wallet)
            if peer is None:
                return False
            try:
                reply = await self._post(peer, END, body, {}, 4096, min(10.0, self.config.request_timeout_s))
            except PeerUnreachable:
                return False
            return reply.status == 204

        told = await asyncio.gather(*(tell(w) for w in wallets))
        return sum(told), len(wallets)

    async def _post(
        self,
        peer: PeerEntry,
        path: str,
        body: bytes,
        headers: dict[str, str],
        max_bytes: int,
        timeout_s: float,
    ) -> PeerReply:
        """A signed POST to `peer`: over HTTP, or through the bucket to a replica behind NAT, whose
        answer also waits on the bucket's polls (so it gets half as long again)."""
        if not is_relay(peer.address):
            return await self.client.request(
                "POST",
                peer.address,
                path,
                body=body,
                headers=headers,
                max_bytes=max_bytes,
                timeout_s=timeout_s,
            )
        if self.bucket is None:
            raise PeerUnreachable(f"{peer.wallet[:12]} is behind NAT and this replica has no bucket")
        return await mailbox.post(
            self.bucket, self.wallet, self.clock, peer.wallet, path, body=body, headers=headers,
            max_bytes=max_bytes, timeout_s=1.5 * timeout_s, traffic=self.client.traffic, cleanup=self._cleanup,
        )  # fmt: skip

    async def _try(
        self,
        peer: PeerEntry,
        body: bytes,
        header: ActivationHeader,
        reply_bound: int,
    ) -> _Answer | str:
        """One attempt: the answer, "busy", "reused" (409: the replica holds this id with another
        payload), "outsider" (403: its member list does not name this replica), "degenerate"
        (422: it refused the activations as degenerate), or why it failed."""
        headers = {ACTIVATION_HEADER: header.to_json().decode()}
        try:
            reply = await self._post(peer, FORWARD, body, headers, reply_bound, self.config.request_timeout_s)
        except PeerUnreachable as exc:
            return str(exc)
        if reply.status in (502, 503):
            return "busy"
        if reply.status == 409:
            return "reused"
        if reply.status == 403 and _refusal_code(reply) == "not_a_member":
            return "outsider"
        if reply.status == 422 and _refusal_code(reply) == "degenerate_activations":
            return "degenerate"
        if not reply.ok:
            return f"status {reply.status}: {reply.error()}"
        try:
            raw = reply.headers.get(REPLY_HEADER)
            if raw is None:
                raise malformed(f"reply has no {REPLY_HEADER} header")
            answer = GradientReply.from_json(raw)
            if answer.wallet != peer.wallet or not answer.signature_valid():
                raise malformed("reply is not signed by the replica we sent to")
            if answer.to != self.wallet.public_key_hex:
                raise malformed("reply is addressed to another replica")
            if (answer.micro_batch, answer.stage, answer.codec, answer.network) != (
                header.micro_batch,
                header.stage,
                header.codec,
                header.network,
            ):
                raise malformed("reply is for another micro-batch, stage, codec or run")
            if sha256_hex(reply.body) != answer.payload_sha256:
                raise malformed("reply body differs from its signed payload_sha256")
            shape = (header.batch, header.seq_len, header.dim)
            grad = await asyncio.get_running_loop().run_in_executor(
                None, decode_gradient, reply.body, shape, header.codec
            )
        except Refused as exc:
            return f"bad reply: {exc}"
        return _Answer(wallet=answer.wallet, grad=grad, loss=answer.loss, reply=answer, body=reply.body)


@dataclass
class _Taken:
    """A micro-batch handed to the worker: its payload hash and (eventually) its outcome."""

    payload_sha256: str
    outcome: asyncio.Future[JobResult]


class PipelineService:
    """POST /p2p/pipeline/forward on a stage > 0 replica; a `server.ServerExtension`."""

    ROUTE = "pipeline_forward"
    END_ROUTE = "pipeline_end"

    def __init__(
        self,
        *,
        wallet: Wallet,
        stage: int,
        model_config: ModelConfig,
        config: PipelineConfig,
        worker: JobSink,
        reply_timeout_s: float | None = None,
        senders: Neighbours | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        """`senders`: the previous stage's membership (node.membership.Neighbours); micro-batches
        from wallets it does not take are refused (403 ``not_a_member``). None: everyone's are taken.
        `log`: where strikes are said (none by default)."""
        if not 1 <= stage < config.num_stages:
            raise ValueError(f"PipelineService serves stages 1..{config.num_stages - 1}, got stage {stage}")
        self.wallet = wallet
        self.stage = stage
        self.model_config = model_config
        self.config = config
        self.worker = worker
        self.reply_timeout_s = reply_timeout_s or config.request_timeout_s
        self.senders = senders
        self.log = log or (lambda _: None)
        if senders is not None and senders.stage != stage - 1:
            raise ValueError(f"stage {stage} takes micro-batches from stage {stage - 1}, not {senders.stage}")
        self.outsiders = 0
        """Micro-batches refused because the previous stage's member list does not take their sender."""
        self.probation_held = 0
        """Micro-batches of listed probationers waiting or in the step (`PipelineConfig.probation_pending`)."""
        self.probation_busy = 0
        """Probationers' micro-batches answered busy because `probation_pending` were held, or
        `probation_per_sender` of the sender's."""
        self._probation_of: Counter[str] = Counter()
        """Held micro-batches by probationer (`probation_per_sender`)."""
        self.served = 0
        self.duplicates = 0
        """Requests answered from a micro-batch already taken (retries): no second inner step."""
        self._taken: OrderedDict[tuple[str, str], _Taken] = OrderedDict()
        self.upstream = Upstream(config.upstream_ttl_s)
        """Who sends this replica work, and who of them ended (the stage replica ends on `over`)."""
        self.traffic = Traffic()
        """Answered micro-batches at the HTTP layer (as the middleware counts them): the pipeline's
        share of this server's traffic, so a bench can tell it from the round exchange's."""
        self._struck: OrderedDict[str, tuple[int, float]] = OrderedDict()
        """sender -> (strikes, refused until, monotonic s): senders whose activations overflowed
        this replica's step (`_strike`); the newest MAX_STRUCK."""

    def set_vocab(self, vocab_size: int) -> None:
        """The head grew (node.vocab): labels below the new vocabulary are taken from now on."""
        self.model_config = dataclasses.replace(self.model_config, vocab_size=vocab_size)

    @property
    def label_bound(self) -> int:
        """Labels must lie below this. Only the last stage scores them against its head; a stage in
        between passes them on and holds no vocabulary rows, so it takes any id a grown tokenizer gives."""
        last = self.stage == self.config.num_stages - 1
        return self.model_config.vocab_size if last else vocab_cap(self.model_config.vocab_size)

    def body_limit(self, route: str) -> int | None:
        if route == self.END_ROUTE:
            return MAX_END_BYTES
        if route != self.ROUTE:
            return None
        cfg = self.model_config
        return activation_size_bound(self.config.max_batch, cfg.max_seq_len, cfg.dim, self.config.codec)

    def mailbox(self) -> MailboxRoutes:
        """What a replica behind NAT takes through its bucket (mailbox.py): both routes."""
        cfg = self.model_config
        return MailboxRoutes(
            routes={FORWARD: self.body_limit(self.ROUTE) or 0, END: MAX_END_BYTES},
            reply_bytes=gradient_size_bound(
                self.config.max_batch, cfg.max_seq_len, cfg.dim, self.config.codec
            ),
            timeout_s=self.reply_timeout_s + 10.0,
            refuses=None if self.senders is None else self._unread,
        )

    def refuses_unread(self, route: str, wallet: str) -> Refused | None:
        """`node.p2p.server.RefusesUnread`: a micro-batch whose headers claim a sender that the
        previous stage's list does not take is refused before its body is read, as through the
        bucket (`_unread`); a recent sender's are read whatever the list says now."""
        if route != self.ROUTE or self.senders is None:
            return None
        why = self._unread(wallet)
        return (
            None
            if why is None
            else Refused("not_a_member", f"{why}: this replica takes no micro-batch from it")
        )

    def _unread(self, sender: str) -> str | None:
        """`MailboxRoutes.refuses`: why a sender's requests are answered unread. A recent sender's
        are read whatever the list says now (a retry of a micro-batch taken, its end), as over HTTP."""
        return None if self.upstream.knows(sender) else self._outsider(sender)

    def _outsider(self, sender: str) -> str | None:
        assert self.senders is not None
        why = self.senders.refusal(sender)
        if why is not None:
            self.outsiders += 1
        return why

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(FORWARD, self._forward, name=self.ROUTE)
        app.router.add_post(END, self._end, name=self.END_ROUTE)

    def _check(self, header: ActivationHeader, request: web.Request) -> None:
        cfg = self.model_config
        if header.wallet != request[PEER_WALLET]:
            raise Refused("not_own", "an activation header must be signed by the wallet that sends it")
        if not header.signature_valid():
            raise Refused("bad_activation_signature", "the activation header's signature does not verify")
        if header.to != self.wallet.public_key_hex:
            raise Refused("misdirected", "the activation header is addressed to another replica")
        if header.network != self.config.network:
            raise Refused(
                "another_run",
                f"the activation header is of run {str(header.network)[:16]}, this replica trains "
                f"{str(self.config.network)[:16]}",
            )
        if header.stage != self.stage:
            raise Refused(
                "wrong_stage",
                f"micro-batch is for stage {header.stage}, this replica holds stage {self.stage}",
            )
        if header.codec != self.config.codec:
            raise Refused(
                "wrong_codec",
                f"micro-batch is in codec {header.codec}, this run's is {self.config.codec}",
            )
        if header.dim != cfg.dim:
            raise Refused("wrong_shape", f"hidden width {header.dim} != this model's dim {cfg.dim}")
        if header.seq_len > cfg.max_seq_len or header.batch > self.config.max_batch:
            raise Refused("wrong_shape",
                f"micro-batch ({header.batch}, {header.seq_len}) exceeds ({self.config.max_batch}, {cfg.max_seq_len})",
            )  # fmt: skip
        if sha256_hex(request[BODY]) != header.payload_sha256:
            raise Refused("payload_mismatch", "body sha256 differs from the signed header's payload_sha256")

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        raw = request.headers.get(ACTIVATION_HEADER)
        if raw is None:
            raise Refused("malformed", f"missing {ACTIVATION_HEADER} header")
        header = ActivationHeader.from_json(raw)
        self._check(header, request)
        taken = self._known(header)  # a retry of a micro-batch stepped on gets its answer, struck or not
        if taken is None:
            self._refuse_outsider(header.wallet)
            self._refuse_struck(header.wallet)
            taken = await self._take(header, request[BODY])
        self.upstream.sent(header.wallet)  # taken: this sender is live (`_take` raised if busy)
        try:
            outcome = await asyncio.wait_for(asyncio.shield(taken.outcome), self.reply_timeout_s)
        except TimeoutError:
            # Still queued or computing: the outcome stays here for a retry of the same id.
            raise Refused("busy", f"no result within {self.reply_timeout_s:.0f} s") from None
        return await self._reply(request, header, outcome)

    def _strike(self, sender: str, why: str) -> None:
        """`sender`'s activations gave a step that overflowed with a sound gradient from downstream
        (NonFiniteStep, not `gradient_at_fault`), or a degenerate output (the same), or were
        degenerate themselves (node.pipeline.degenerate_problem): its micro-batches are refused for `ban_s`,
        doubled at each strike (as the router bans a blamed next-stage replica), and those
        already queued are answered busy. A middle replica that offered its output on records such
        a step as failed (node.segments), and a segment holds only so many
        (protocol.segments.max_failed_in_segment): without the strikes a hostile sender could run
        that budget out and cost this replica its round's log."""
        strikes = self._struck.pop(sender, (0, 0.0))[0] + 1
        ban = self.config.ban_s * 2.0 ** min(strikes - 1, BLAME_BAN_DOUBLINGS)
        self._struck[sender] = (strikes, time.monotonic() + ban)
        while len(self._struck) > MAX_STRUCK:
            self._struck.popitem(last=False)
        self.log(
            f"pipeline: {sender[:12]} struck ({strikes}), its micro-batches refused for {ban:.0f} s: {why}"
        )
        self.worker.drop(sender, f"{sender[:12]} is struck: {why}")

    def _refuse_probation_busy(self, sender: str) -> bool:
        """Refuse (busy) a probationer's micro-batch while `probation_pending` are held, or
        `probation_per_sender` of its own; whether `sender` is one (the previous stage's list names
        it on probation)."""
        roster = None if self.senders is None else self.senders.roster
        probation = roster is not None and sender in roster.probation
        if probation and self._probation_of[sender] >= self.config.probation_per_sender:
            self.probation_busy += 1
            raise Refused(
                "busy",
                f"{self._probation_of[sender]} of its micro-batches already wait here or are in the step "
                "(a probationer's share)",
            )
        if probation and self.probation_held >= self.config.probation_pending:
            self.probation_busy += 1
            raise Refused(
                "busy",
                f"{self.probation_held} micro-batches of stage {self.stage - 1}'s probationers already "
                "wait here or are in the step",
            )
        return probation

    def _hold_probation(self, sender: str) -> None:
        self.probation_held += 1
        self._probation_of[sender] += 1

    def _release_probation(self, sender: str) -> None:
        self.probation_held -= 1
        self._probation_of[sender] -= 1
        if not self._probation_of[sender]:
            del self._probation_of[sender]

    def _refuse_outsider(self, sender: str) -> None:
        why = None if self.senders is None else self._outsider(sender)
        if why is not None:
            raise Refused("not_a_member", f"{why}: this replica takes no micro-batch from it")

    def _refuse_struck(self, sender: str) -> None:
        struck = self._struck.get(sender)
        if struck is not None and time.monotonic() < struck[1]:
            raise Refused(
                "struck",
                f"{struck[0]} micro-batch(es) from {sender[:12]} failed this replica's step or were degenerate; "
                f"refused for {struck[1] - time.monotonic():.0f} s more",
            )

    async def _end(self, request: web.Request) -> web.StreamResponse:
        end = PipelineEnd.from_json(request[BODY])
        if end.wallet != request[PEER_WALLET]:
            raise Refused("not_own", "a pipeline end must be signed by the wallet that sends it")
        if not end.signature_valid():
            raise Refused("bad_end_signature", "the pipeline end's signature does not verify")
        if end.stage != self.stage - 1:
            raise Refused(
                "wrong_stage",
                f"an end from stage {end.stage}; this replica hears from stage {self.stage - 1}",
            )
        if not self.upstream.ended(end):
            raise Refused(
                "not_a_sender",
                f"this replica took no micro-batch from {end.wallet[:12]} in the last "
                f"{self.upstream.ttl_s:.0f} s: only its senders can end it",
            )
        return web.Response(status=204)

    def _known(self, header: ActivationHeader) -> _Taken | None:
        """The micro-batch this sender already handed over under this id; 409 if its payload differs."""
        taken = self._taken.get((header.wallet, header.micro_batch))
        if taken is None:
            return None
        if taken.payload_sha256 != header.payload_sha256:
            raise Refused("micro_batch_reused",
                f"micro-batch {header.micro_batch[:8]} was already taken from this sender with another payload",
            )  # fmt: skip
        self.duplicates += 1
        return taken

    def _decode(self, body: bytes, header: ActivationHeader) -> tuple[Tensor, Tensor, str | None]:
        """`decode_activations`, and why they are degenerate (None: they are not), off the event loop."""
        hidden, labels = decode_activations(body, header, self.label_bound)
        return hidden, labels, degenerate_problem(hidden, self.model_config.norm_eps)

    async def _take(self, header: ActivationHeader, body: bytes) -> _Taken:
        """Decode the micro-batch and queue it on the worker, remembering its id; Busy -> 503."""
        self._refuse_probation_busy(header.wallet)  # before the decode's work, and again after it
        loop = asyncio.get_running_loop()
        hidden, labels, degenerate = await loop.run_in_executor(None, self._decode, body, header)
        if degenerate is not None:  # an honest stage sends none (pipeline.DEGENERATE_MEAN_SQUARE)
            self._strike(header.wallet, f"it sent degenerate activations ({degenerate})")
            raise Refused("degenerate_activations", f"{degenerate}; not taken")
        key = (header.wallet, header.micro_batch)
        taken = _Taken(header.payload_sha256, loop.create_future())

        def settle(outcome: JobResult) -> None:
            if not taken.outcome.done():
                taken.outcome.set_result(outcome)
                if isinstance(outcome, NonFiniteStep) and not outcome.gradient_at_fault:
                    self._strike(
                        header.wallet, f"one of its micro-batches failed this replica's step ({outcome})"
                    )
            if isinstance(outcome, BaseException) and self._taken.get(key) is taken:
                del self._taken[key]  # not stepped: a retry of this id may train on it

        def done(outcome: JobResult) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the node is stopping, nobody waits
                loop.call_soon_threadsafe(settle, outcome)

        known = self._known(header)  # the same id may have arrived while this one was decoding
        if known is not None:
            return known
        probation = self._refuse_probation_busy(header.wallet)
        try:
            received = Received("activations", header.wallet, header.to_json(), body)
            codec = header.codec
            self.worker.offer(
                Job(hidden, labels, header.micro_batch, done, received, lambda g: encode_gradient(g, codec))
            )
        except Busy as exc:
            raise Refused("busy", str(exc)) from None
        if probation:
            self._hold_probation(header.wallet)
            taken.outcome.add_done_callback(lambda _: self._release_probation(header.wallet))
        self._taken[key] = taken
        while len(self._taken) > self.config.dedup_window:
            self._taken.popitem(last=False)
        return taken

    async def _reply(
        self, request: web.Request, header: ActivationHeader, outcome: JobResult
    ) -> web.Response:
        if isinstance(outcome, Busy):
            raise Refused("busy", str(outcome))
        if isinstance(outcome, ConnectionError):
            raise Refused("downstream", f"the next stage is unreachable: {outcome}")
        if isinstance(outcome, NonFiniteStep) and outcome.gradient_at_fault:
            # The next stage's answers overflowed the step, MAX_BLAMED times: not this micro-batch's
            # fault nor this replica's, so the sender retries elsewhere without a ban, as for 502.
            raise Refused("downstream", f"the next stage answered with gradients that overflow: {outcome}")
        if isinstance(outcome, NonFiniteStep):
            raise Refused("non_finite", str(outcome))
        if isinstance(outcome, BaseException):
            raise Refused("step_failed", f"{type(outcome).__name__}: {outcome}")
        body, loss, round_ = outcome
        if not isinstance(body, bytes):  # the worker encodes what `_take`'s job asks it to
            raise Refused("step_failed", "the stage worker returned an unencoded gradient")
        # The worker recorded these bytes as the step's gradient sent back before answering.
        reply = GradientReply.create(
            self.wallet, to=header.wallet, micro_batch=header.micro_batch, stage=self.stage, round=round_,
            loss=min(max(loss, 0.0), 1e6), codec=header.codec, payload_sha256=sha256_hex(body),
            network=header.network,
        )  # fmt: skip
        self.served += 1
        response = web.Response(
            status=200, body=body, headers={REPLY_HEADER: reply.to_json().decode()},
            content_type="application/octet-stream",
        )  # fmt: skip
        self.traffic.requests += 1
        self.traffic.bytes_received += len(request[BODY]) + head_bytes(
            f"{request.method} {request.raw_path} HTTP/1.1", request.raw_headers
        )
        self.traffic.bytes_sent += len(body) + head_bytes("HTTP/1.1 200 OK", response.headers.items())
        return response
