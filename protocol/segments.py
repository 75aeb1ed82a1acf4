"""A round's segment log: what a replica commits to about its inner steps, so a verifier can replay
any k-step segment of any stage (node.segments records it; verifier.segmentcheck checks it).

- `StepRecord`: one inner step: the data span it read (stage 0) or the micro-batch it trained on,
  the messages it consumed (`ReceivedRef`, by hashes) and sent (`SentRef`);
- `SignedHeader`: a pipeline header the replica signed (activations it offered a next-stage
  replica, taken or not; a gradient it answered with);
- `FailedStep`: a micro-batch a later stage's replica forwarded and did not step on (every attempt
  downstream failed, or its backward did): what it was given and what it offered, so the offer
  can be replayed like a step's;
- `SegmentLog`: a round's step records, checkpoint hashes and signed headers; its `root()` is a
  hash chain over them, which the receipt carries (`Receipt.segment_root`);
- `SegmentCommitment`: the replica's signature on that root;
- `checkpoint_hash` / `CheckpointOpening`: a checkpoint's hash from its weights' and optimizer's
  own hashes, and those two for one checkpoint (which the hash alone does not reveal);
- `Received`: a consumed message with its bytes (the signed header and the payload), as kept on disk.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Annotated, Any

from .identity import sha256_hex
from .pipeline import MICRO_BATCH_BYTES
from .refusal import malformed
from .schema import (
    MAX_COUNT,
    MAX_STAGE,
    Message,
    Signed,
    canonical_json,
    choice,
    hex_bytes,
    integer,
    optional,
    parse_json,
)

DOMAIN = b"neuroshard/segments/v1"
KINDS = ("activations", "gradient")
"""What crosses a stage boundary: activations forward (with labels), activation gradients back."""
MAX_STEPS = 1_000_000
"""Inner steps a log may hold (protocol.reports.Receipt.inner_steps' bound)."""
MAX_MESSAGES_PER_STEP = 8
"""A step receives at most an activation and a gradient, and sends at most one of each; 8 leaves
room for a retry recorded twice without letting a log grow without bound."""
HEADERS_PER_STEP = 8
"""A log's signed headers (a gradient answered, and distinct next-stage replicas asked to take a
micro-batch) average at most this many a step, plus `HEADERS_SLACK`; a replica that signs more in
a round records no log for it."""
HEADERS_SLACK = 64


def max_headers(steps: int) -> int:
    """The most signed headers a log of `steps` steps may hold."""
    return HEADERS_PER_STEP * steps + HEADERS_SLACK


def max_failed(steps: int) -> int:
    """The most failed steps a log of `steps` steps may hold (a replica whose downstream fails more
    often than it steps records no log for the round)."""
    return steps + HEADERS_SLACK


FAILED_SEGMENT_SLACK = 8


def max_failed_in_segment(segment_steps: int) -> int:
    """The most replayed failed steps (`FailedStep` with an input) one segment of a log cut in
    segments of `segment_steps` may hold: a check replays each one's forward, so this bounds what
    a segment costs the verifier (k + 8 forwards beside its steps). A job fails when every replica
    downstream failed it for the pipeline's deadline, or when its own backward is not finite
    (node.pipeline.NonFiniteStep) — which a hostile neighbour can cause. A gradient that overflows
    the backward is blamed on its sender, banned, and the output sent elsewhere without a failed
    step (a failed step only once MAX_BLAMED such answers came in a row); activations that do
    fail the step and strike their sender, whose queued micro-batches are then answered busy
    (node.p2p.pipeline), so each hostile wallet of the previous stage costs one failed step per
    ban (README)."""
    return segment_steps + FAILED_SEGMENT_SLACK


_KIND = choice(KINDS)
_SHA256 = hex_bytes(32)
_MICRO_BATCH = hex_bytes(MICRO_BATCH_BYTES)
"""A pipeline micro-batch id (protocol.pipeline.micro_batch_id)."""


@dataclass(frozen=True, kw_only=True)
class ReceivedRef(Message):
    """A message a step consumed, by hashes: `Received` without its bytes."""

    NAME = "received message"
    kind: Annotated[str, _KIND]
    sender: Annotated[str, hex_bytes(32)]
    """The sender's Ed25519 public key, 64 hex characters (its wallet)."""
    header_sha256: Annotated[str, _SHA256]
    payload_sha256: Annotated[str, _SHA256]


@dataclass(frozen=True)
class Received:
    """A message as it arrived: the sender's signed header (JSON bytes, which sign the payload's
    sha256) and the payload bytes. Kept on disk so the verifier can decode what the step used."""

    kind: str
    sender: str
    header: bytes
    body: bytes

    def ref(self) -> ReceivedRef:
        return ReceivedRef(
            kind=self.kind,
            sender=self.sender,
            header_sha256=sha256_hex(self.header),
            payload_sha256=sha256_hex(self.body),
        )


@dataclass(frozen=True, kw_only=True)
class SentRef(Message):
    """A payload this replica sent on: the counterpart holds it under this replica's signature."""

    NAME = "sent message"
    kind: Annotated[str, _KIND]
    payload_sha256: Annotated[str, _SHA256]


@dataclass(frozen=True, kw_only=True, order=True)
class SignedHeader(Message):
    """A pipeline header this replica signed for replica `to`: activations it offered (every
    attempt, taken, busy, refused or lost: an ActivationHeader) or a gradient it answered with (a
    GradientReply). A header names its round, so the log of that round lists it whatever became of
    it: a receiver holding the header finds it there, and a replica that signs headers naming a
    round whose log does not list them is caught (verifier.segmentcheck.contradicting) — which a
    log of completed exchanges alone cannot tell from a lost attempt. A node writes each to disk
    before it sends it, so a round redone after a crash lists what the crashed run signed too."""

    NAME = "signed header"
    kind: Annotated[str, _KIND]
    micro_batch: Annotated[str, _MICRO_BATCH]
    to: Annotated[str, hex_bytes(32)]
    """The replica the header names (its wallet key)."""
    payload_sha256: Annotated[str, _SHA256]


@dataclass
class StepRecord:
    """One inner step. Mutable only inside the recorder, until its round closes (a gradient reply is
    encoded after the step it answers, so its `sent` entry arrives late)."""

    data: tuple[int, int, int] | None = None
    """Stage 0: (shard_id, offset_start, offset_end) of the windows trained on."""
    micro_batch: str = ""
    """The pipeline's micro-batch id (hex), "" when none travelled (single-stage runs)."""
    received: list[ReceivedRef] = field(default_factory=list)
    sent: list[SentRef] = field(default_factory=list)

    def to_obj(self) -> dict[str, Any]:
        return {
            "data": None if self.data is None else list(self.data),
            "micro_batch": self.micro_batch,
            "received": [r.to_obj() for r in self.received],
            "sent": [s.to_obj() for s in self.sent],
        }

    @classmethod
    def from_obj(cls, obj: Any, where: str) -> StepRecord:
        if not isinstance(obj, dict) or set(obj) != {"data", "micro_batch", "received", "sent"}:
            raise malformed(f"{where} must hold exactly data, micro_batch, received, sent")
        data = obj["data"]
        if data is not None:
            if not (isinstance(data, list) and len(data) == 3):
                raise malformed(f"{where}.data must be [shard_id, offset_start, offset_end] or null")
            span = tuple(integer(0, MAX_COUNT)(v, f"{where}.data") for v in data)
            if span[2] < span[1]:
                raise malformed(f"{where}.data ends at {span[2]} before it starts at {span[1]}")
            data = (span[0], span[1], span[2])
        micro = obj["micro_batch"]
        if not (isinstance(micro, str) and len(micro) <= 64 and all(c in "0123456789abcdef" for c in micro)):
            raise malformed(f"{where}.micro_batch must be lower-case hex of at most 64 characters")
        return cls(
            data=data,
            micro_batch=micro,
            received=[ReceivedRef.from_obj(r, f"{where}.received") for r in _items(obj["received"], where)],
            sent=[SentRef.from_obj(s, f"{where}.sent") for s in _items(obj["sent"], where)],
        )

    def sha256(self) -> str:
        return sha256_hex(DOMAIN + b"\nstep\n" + canonical_json(self.to_obj()))


@dataclass(frozen=True)
class FailedStep:
    """A micro-batch a replica of a middle stage (neither the first nor the last) took, forwarded,
    and did not step on: every replica of the next stage it offered the activations to failed or
    refused, or the step's backward did (node.stage_worker). A step that fails changes no weights,
    so the offer was computed at the weights of the round's step `after` (the number of steps
    recorded before it): a segment check replays it as it replays a step's forward, and its
    `sent` holds the activations every attempt carried (one payload: a job encodes its output
    once). A later stage's replica signs headers for such offers, and sender matching holds each
    of them to a step or a failed step of the log (verifier.segmentcheck.contradicting).

    `received` empty: the offer was signed by an earlier run of the round that a crash ended
    (node.segments reads its headers back from disk); that run's weights are gone, so it is
    listed, not replayed. Such entries come first, at `after` 0, and a log that has any earns no
    credit from a segment check that passes (verifier.segmentlive.SegmentsJudged.credit): a
    claimed crash buys what recording no log buys, no more."""

    after: int
    micro_batch: str
    received: tuple[ReceivedRef, ...]
    sent: SentRef

    def to_obj(self) -> dict[str, Any]:
        return {
            "after": self.after,
            "micro_batch": self.micro_batch,
            "received": [r.to_obj() for r in self.received],
            "sent": self.sent.to_obj(),
        }

    @classmethod
    def from_obj(cls, obj: Any, where: str) -> FailedStep:
        if not isinstance(obj, dict) or set(obj) != {"after", "micro_batch", "received", "sent"}:
            raise malformed(f"{where} must hold exactly after, micro_batch, received, sent")
        sent = SentRef.from_obj(obj["sent"], f"{where}.sent")
        if sent.kind != "activations":
            raise malformed(f"{where}.sent must be activations (a failed step offered them on)")
        return cls(
            after=integer(0, MAX_STEPS)(obj["after"], f"{where}.after"),
            micro_batch=_MICRO_BATCH(obj["micro_batch"], f"{where}.micro_batch"),
            received=tuple(
                ReceivedRef.from_obj(r, f"{where}.received") for r in _items(obj["received"], where, 1)
            ),
            sent=sent,
        )


def _items(value: Any, where: str, most: int = MAX_MESSAGES_PER_STEP) -> list[Any]:
    if not isinstance(value, list) or len(value) > most:
        raise malformed(f"{where} lists must hold at most {most} message{'s' * (most != 1)}")
    return value


# --- the round's log and its root -------------------------------------------------------------


def segment_boundaries(steps: int, k: int) -> list[int]:
    """Inner-step indices with a checkpoint: 0, k, 2k, … and `steps` (the round's end)."""
    return [*range(0, steps, k), steps] if steps > 0 else [0]


@dataclass(frozen=True)
class SegmentLog:
    """A round's step records and checkpoint hashes, in order; `root()` is what the replica commits."""

    stage: int
    round: int
    segment_steps: int
    start_step: int
    """The schedule step at the round's start (DiLoCo.schedule_step): where the inner lr was."""
    steps: tuple[StepRecord, ...]
    checkpoints: tuple[str, ...]
    """sha256 of the checkpoint at each of `segment_boundaries(len(steps), segment_steps)`."""
    headers: tuple[SignedHeader, ...] | None = ()
    """Every pipeline header the replica signed naming the round (`SignedHeader`), sorted, each once.
    None: a log written before logs listed them (2026-12-07), read back so that fraud proofs kept
    from then still check (its root is the chain without them); sender matching holds such a log
    to its steps for a round received before the verifier started (an upgrade) and refuses it for
    a round received since (verifier.replaycheck)."""
    failed: tuple[FailedStep, ...] | None = ()
    """Every micro-batch the replica forwarded and did not step on (`FailedStep`), in the order they
    happened (`after` never decreasing). None: a log written before logs listed them (2026-12-07,
    later), read back as `headers` None is; its root is the chain without them."""

    def __post_init__(self) -> None:
        wanted = len(self.boundaries)
        if len(self.checkpoints) != wanted:
            raise malformed(
                f"segment log of {len(self.steps)} steps in segments of {self.segment_steps} needs "
                f"{wanted} checkpoint hashes, has {len(self.checkpoints)}"
            )
        if self.failed is not None:
            afters = [f.after for f in self.failed]
            if len(self.failed) > max_failed(len(self.steps)):
                raise malformed(
                    f"segment log of {len(self.steps)} steps lists {len(self.failed)} failed steps, "
                    f"more than {max_failed(len(self.steps))}"
                )
            if afters != sorted(afters) or any(a >= len(self.steps) for a in afters):
                raise malformed(
                    "segment log failed steps must come in order, each before the round's last step"
                )
            crowded = [
                j
                for j in range(self.segments)
                if len(self.failures_in(j)) > max_failed_in_segment(self.segment_steps)
            ]
            if crowded:
                raise malformed(
                    f"segment log segment {crowded[0]} lists more than "
                    f"{max_failed_in_segment(self.segment_steps)} failed steps"
                )
            carried = [not f.received for f in self.failed]
            if carried != sorted(carried, reverse=True) or any(
                f.after != 0 for f in self.failed if not f.received
            ):
                raise malformed(
                    "segment log failed steps carried from a crashed run (no input) must come "
                    "first, at step 0"
                )
        if self.headers is None:
            return
        if len(self.headers) > max_headers(len(self.steps)):
            raise malformed(
                f"segment log of {len(self.steps)} steps lists {len(self.headers)} signed headers, "
                f"more than {max_headers(len(self.steps))}"
            )
        if list(self.headers) != sorted(set(self.headers)):
            raise malformed("segment log headers must be sorted, each listed once")

    @property
    def boundaries(self) -> list[int]:
        return segment_boundaries(len(self.steps), self.segment_steps)

    @property
    def segments(self) -> int:
        return len(self.boundaries) - 1

    def segment(self, j: int) -> tuple[int, int]:
        """[first, end) inner-step indices of segment j."""
        b = self.boundaries
        if not 0 <= j < len(b) - 1:
            raise IndexError(f"segment {j} of a round with {len(b) - 1} segments")
        return b[j], b[j + 1]

    def failures_in(self, j: int) -> list[int]:
        """Indices in `failed` of the failed steps segment j replays: those that ran at its weights
        (`after` in the segment) and name their input (not carried over from a crashed run)."""
        first, end = self.segment(j)
        return [i for i, f in enumerate(self.failed or ()) if first <= f.after < end and f.received]

    @property
    def carries(self) -> bool:
        """Whether the log lists offers carried from a crashed run of the round (no input: listed,
        not replayed)."""
        return any(not f.received for f in self.failed or ())

    def root(self) -> str:
        """h ← sha256(h ‖ entry) over the header, then checkpoints and step records in step order,
        then the signed headers (one entry: the sha256 of their list; none in a log from before
        they were listed), then the failed steps (likewise)."""
        head = {"stage": self.stage, "round": self.round, "k": self.segment_steps, "start": self.start_step}
        h = hashlib.sha256(DOMAIN + b"\nhead\n" + canonical_json(head)).digest()
        at = dict(zip(self.boundaries, self.checkpoints, strict=True))
        for i in range(len(self.steps) + 1):
            if i in at:
                h = hashlib.sha256(h + b"C" + bytes.fromhex(at[i])).digest()
            if i < len(self.steps):
                h = hashlib.sha256(h + b"S" + bytes.fromhex(self.steps[i].sha256())).digest()
        if self.headers is not None:
            listed = canonical_json([x.to_obj() for x in self.headers])
            h = hashlib.sha256(h + b"H" + hashlib.sha256(DOMAIN + b"\nheaders\n" + listed).digest()).digest()
        if self.failed is not None:
            failed = canonical_json([x.to_obj() for x in self.failed])
            h = hashlib.sha256(h + b"F" + hashlib.sha256(DOMAIN + b"\nfailed\n" + failed).digest()).digest()
        return h.hex()

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "stage": self.stage,
            "round": self.round,
            "segment_steps": self.segment_steps,
            "start_step": self.start_step,
            "steps": [s.to_obj() for s in self.steps],
            "checkpoints": list(self.checkpoints),
        }
        if self.headers is not None:
            obj["headers"] = [x.to_obj() for x in self.headers]
        if self.failed is not None:
            obj["failed"] = [x.to_obj() for x in self.failed]
        return obj

    def to_json(self) -> bytes:
        return canonical_json(self.to_obj())

    @classmethod
    def from_json(cls, data: bytes | str) -> SegmentLog:
        return cls.from_obj(parse_json(data, "segment log"))

    @classmethod
    def from_obj(cls, obj: Any) -> SegmentLog:
        keys = {"stage", "round", "segment_steps", "start_step", "steps", "checkpoints", "headers", "failed"}
        if not isinstance(obj, dict) or not keys - {"headers", "failed"} <= set(obj) <= keys:
            raise malformed(
                f"segment log must hold exactly {', '.join(sorted(keys))} (headers and failed may be absent)"
            )
        steps, hashes, headers = obj["steps"], obj["checkpoints"], obj.get("headers", [])
        failed = obj.get("failed", [])
        if not isinstance(steps, list) or len(steps) > MAX_STEPS or not isinstance(hashes, list):
            raise malformed(f"segment log steps must be a list of at most {MAX_STEPS}")
        if not isinstance(headers, list) or len(headers) > max_headers(len(steps)):
            raise malformed(f"segment log headers must be a list of at most {max_headers(len(steps))}")
        if not isinstance(failed, list) or len(failed) > max_failed(len(steps)):
            raise malformed(f"segment log failed steps must be a list of at most {max_failed(len(steps))}")
        return cls(
            stage=integer(0, MAX_STAGE)(obj["stage"], "segment log stage"),
            round=integer(0, MAX_COUNT)(obj["round"], "segment log round"),
            segment_steps=integer(1, MAX_STEPS)(obj["segment_steps"], "segment log segment_steps"),
            start_step=integer(0, MAX_COUNT)(obj["start_step"], "segment log start_step"),
            steps=tuple(StepRecord.from_obj(s, f"segment log step {i}") for i, s in enumerate(steps)),
            checkpoints=tuple(hex_bytes(32)(h, "segment log checkpoint") for h in hashes),
            headers=tuple(SignedHeader.from_obj(x, "segment log header") for x in headers)
            if "headers" in obj
            else None,
            failed=tuple(FailedStep.from_obj(x, f"segment log failed step {i}") for i, x in enumerate(failed))
            if "failed" in obj
            else None,
        )


def checkpoint_hash(weights_sha256: str, inner_sha256: str) -> str:
    """A checkpoint's hash in a log: over the sha256 of its weights (float32, little-endian, the
    receipt's base_hash at a round's start) and of its inner AdamW state (node.replay.InnerState.digest)."""
    return sha256_hex(DOMAIN + b"\n" + f"checkpoint\n{weights_sha256}\n{inner_sha256}".encode())


@dataclass(frozen=True, kw_only=True)
class CheckpointOpening(Message):
    """The two hashes behind one checkpoint hash (`checkpoint_hash`). A round log's end opening lets
    the verifier hold the next round's starting optimizer state to the one this round ended with
    (verifier.segmentcheck.continuity_problem) without fetching a checkpoint: sha256 binds both."""

    NAME = "checkpoint opening"
    weights_sha256: Annotated[str, _SHA256]
    inner_sha256: Annotated[str, _SHA256]

    def sha256(self) -> str:
        return checkpoint_hash(self.weights_sha256, self.inner_sha256)


@dataclass(frozen=True, kw_only=True)
class SegmentCommitment(Signed):
    """A replica's signature on its round's segment root: with the log and a segment's material it
    makes a failed segment check re-checkable by anyone (verifier.segmentcheck.SegmentFraudProof)."""

    NAME = "segment commitment"
    DOMAIN = b"neuroshard/segment-commitment/v2"
    stage: Annotated[int, integer(0, MAX_STAGE)]
    round: Annotated[int, integer(0, MAX_COUNT)]
    root: Annotated[str, hex_bytes(32)]
    network: Annotated[str | None, optional(hex_bytes(32))] = None
    """sha256 of the canonical bytes of the run's definition the replica trains under
    (node.network_definition.NetworkDefinition.digest): one wallet may train several runs, whose
    round numbers repeat, and a proof that holds two of its logs against each other
    (verifier.segmentcheck.ContinuityFraudProof) must show they are of one run. None: unbound
    (no such proof holds it to another log)."""


@dataclass(frozen=True)
class SignedSegmentLog:
    """A replica's round log with its signed commitment, without checkpoints or payloads: what
    GET /p2p/segment-log/{round} serves, so the verifier can hold what a sender recorded sending
    against the headers it signed for its receivers (verifier.segmentcheck.contradicting),
    and, with the opening of its last checkpoint (`end`; absent from nodes before it was added),
    the replica's next round to the optimizer state this one ended with."""

    log: SegmentLog
    commitment: SegmentCommitment
    end: CheckpointOpening | None = None

    def encode(self) -> bytes:
        obj = {"commitment": self.commitment.to_obj(), "log": self.log.to_obj()}
        if self.end is not None:
            obj["end"] = self.end.to_obj()
        return canonical_json(obj)

    @classmethod
    def decode(cls, data: bytes) -> SignedSegmentLog:
        obj = parse_json(data, "signed segment log")
        if not isinstance(obj, dict) or not {"commitment", "log"} <= set(obj) <= {"commitment", "log", "end"}:
            raise malformed("signed segment log must hold commitment, log and optionally end, nothing else")
        end = None if "end" not in obj else CheckpointOpening.from_obj(obj["end"])
        return cls(SegmentLog.from_obj(obj["log"]), SegmentCommitment.from_obj(obj["commitment"]), end)
